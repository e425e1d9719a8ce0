"""Writing a scope's node list back into its GraphProto, moving the messages it holds instead of copying them
(and dropping initializers from one in place).

Protobuf copies a message appended to a repeated field, so rebuilding ``graph.node`` from a Python list
(``del graph.node[:]; graph.node.extend(nodes)``) makes every node a new message: the graph index, which
maps names to node objects, then has to be built again (0.3 s for 100,000 nodes), and for a moment every
node is held twice. The repeated field can be reordered in place, though (``sort`` moves the messages and
keeps their Python objects), and cut at its end. A small fusion in a big graph (a recurrence behind a
100,000-node prologue) therefore appends its few new nodes, sorts, and drops what was removed: the index
stays exact but for the new nodes, which :func:`write_back` names with their copies.
"""

from __future__ import annotations

from onnx import NodeProto

# the field is rewritten whole when fewer than this share of the messages it holds stay (a fused chain keeps
# a handful of 100,000: copying those few costs less than sorting the many)
MIN_KEPT_SHARE = 0.5


def write_back(field, nodes: list[NodeProto]) -> list[tuple[NodeProto, NodeProto]] | None:
    """Make ``field`` (a GraphProto's ``node``) hold ``nodes``, in that order. The messages it already holds
    stay the same objects; the nodes it does not hold are appended (copied) and returned as (node, its copy
    in the field) pairs. None when the field was rewritten whole instead: every node in it is then a copy."""
    held = list(field)  # (protobuf keeps one Python object per message: the identities below are stable)
    held_ids = set(map(id, held))
    new = [n for n in nodes if id(n) not in held_ids]
    if len(nodes) - len(new) < MIN_KEPT_SHARE * len(held):
        del field[:]
        field.extend(nodes)
        return None
    field.extend(new)
    copies = list(field)[len(held):]
    copy_of = {id(n): c for n, c in zip(new, copies)}
    rank = {id(copy_of.get(id(n), n)): k for k, n in enumerate(nodes)}
    gone = len(nodes)  # (the messages no longer listed sort after the rest, and are cut off)
    field.sort(key=lambda m: rank.get(id(m), gone))
    del field[len(nodes):]
    # (upb and the pure-Python protobuf move messages on a sort; were one to copy them, the index would name
    # messages the proto no longer holds: then it is built again, as after a rewrite)
    if any(a is not copy_of.get(id(b), b) for a, b in zip(field, nodes)):
        return None
    return list(zip(new, copies))


def drop_initializers(inits, drop: set[str]) -> None:
    """Remove the initializers named in ``drop`` from the repeated field ``inits``, the others kept in order.

    Runs of dropped entries are deleted in place, last run first, while that costs less than one copy of the
    list: re-adding the kept tensors instead would copy every kept weight (protobuf copies a message added to
    a repeated field), which for a weight-heavy model is the whole model once more."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(inits):
        if t.name in drop:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    if len(runs) <= 64:
        for a, b in reversed(runs):
            del inits[a:b]
        return
    keep = [t for t in inits if t.name not in drop]
    del inits[:]
    inits.extend(keep)
