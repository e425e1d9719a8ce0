"""A Loop carrying several states as one tensor, cut apart in the step and joined again for the next one, as
one carried tensor per piece.

jax code may carry ``concatenate([h, c])`` through a ``lax.scan`` and cut it with ``hc[:, :H]``, ``hc[:, H:]``
(TF1's ``state_is_tuple=False`` did the same): the Loop front end then sees one carried value that the cell
reads in slices, which is no state of a native cell. When the body reads the carried tensor only through
slices of constant bounds along its last axis that cut it into adjacent pieces, and its next value is the
``Concat`` along that axis of values as wide as those pieces, in the same order, every version of it is the
pieces side by side. The same Loop then carries each piece as a tensor of its own: a slice reading a piece is
that piece, the next pieces are the parts of the Concat (each computed at its piece's width: the Loop front
end declines a state whose next value is not), the initial pieces are slices of the initial value
(before the Loop) and the final value is the Concat of the final pieces (after it). The rewritten Loop
computes the same values by construction; it is tried in place (:func:`passes.loop_split.fuse_parts`) and
put back when no recurrence of it fuses.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, TypeProto, helper, numpy_helper

from rnnfuse import op_args
from rnnfuse.dims import static_dim, value_source
from rnnfuse.graph import Graph, attr
from rnnfuse.protos import has_subgraph

_TO_THE_END = 2**31 - 1


def unpack_pieces(g: Graph, loop: NodeProto) -> tuple[NodeProto, list[NodeProto], list[NodeProto]] | None:
    """``(the Loop carrying each state cut from one carried tensor piece by piece, the Slices cutting its
    initial value before it, the Concats joining its final pieces after it)``, all new (not in the graph), or
    None when no carried value is such a tensor."""
    proto = next((a.g for a in loop.attribute if a.name == "body" and a.type == AttributeProto.GRAPH), None)
    n_carried = len(loop.input) - 2
    if proto is None or n_carried < 1 or len(proto.input) != 2 + n_carried or len(proto.output) < 1 + n_carried:
        return None
    body = g.subgraph(loop)
    captured = set().union(*(body.implicit_inputs(n) for n in proto.node if has_subgraph(n)))
    cuts = {}  # carried position -> its pieces' bounds, in order
    for k in range(n_carried):
        found = _pieces(g, body, loop, proto, k, captured)
        if found is not None:
            cuts[k] = found
    if not cuts:
        return None
    return _rebuilt(g, loop, body, proto, cuts)


def _pieces(g: Graph, body: Graph, loop: NodeProto, proto: GraphProto, k: int, captured: set):
    """``(the bounds [(start, end), ...] of the pieces carried value k is cut into, each Slice reading it ->
    the index of its piece)`` (see the module), else None."""
    name, nxt, init = proto.input[2 + k].name, proto.output[1 + k].name, loop.input[2 + k]
    # (what the body says first: every Loop's carried values are looked at, and an init's type may be another
    # Loop's output, known only by inference)
    if not init or name in captured or body.is_graph_output(name) or not body.uses(name) or any(
            u.op_type != "Slice" for u in body.uses(name)):
        return None
    cat = body.producer.get(value_source(body, nxt))  # (through jax's float -> float Cast of each next value)
    if cat is None or cat.op_type != "Concat":
        return None
    shape = g.model.shape(init)
    if not shape or not isinstance(shape[-1], int):
        return None
    rank, width = len(shape), shape[-1]
    read = {}  # id(Slice) -> its bounds; id(a whole view of it) -> None (dropped with the tensor)
    views = [name]
    while views:  # (through Slices taking every element: TorchScript's s[:, :H] is s[0:INT_MAX] first)
        for n in body.uses(views.pop()):
            b = _last_axis_slice(body, n, rank, width)
            if b is None and _takes_all(body, n, rank) and n.output[0] not in captured:
                read[id(n)] = None
                views.append(n.output[0])
            elif b is None or body.is_graph_output(n.output[0]):
                return None
            else:
                read[id(n)] = b
    pieces = sorted({b for b in read.values() if b is not None})
    if len(pieces) < 2 or pieces[0][0] != 0 or pieces[-1][1] != width or any(
            a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
        return None  # (not adjacent pieces covering it once each)
    if attr(cat, "axis", 0) not in (-1, rank - 1):
        return None
    # (a part's width the types leave unknown, as jax's carried weights leave a body's products, is checked once
    # the step is read: each piece's next value is computed at its width, recurrence_layers._check_width)
    if len(cat.input) != len(pieces) or any(static_dim(g, part, -1) not in (None, e - s) for part, (s, e) in zip(cat.input, pieces)):
        return None
    return pieces, {n: (None if b is None else pieces.index(b)) for n, b in read.items()}


def _last_axis_slice(body: Graph, n: NodeProto, rank: int, width: int) -> tuple[int, int] | None:
    """``(start, end)`` when ``n`` is a Slice of constant bounds, step 1, along the last axis alone."""
    if n.op_type != "Slice":
        return None
    starts, ends, axes, steps = op_args.slice_args_of(body, n)
    if starts is None or ends is None or axes is None or len(axes) != 1 or axes[0] not in (-1, rank - 1):
        return None
    if steps not in (None, [1]):
        return None
    s, e = starts[0], ends[0]
    s, e = s + width if s < 0 else s, e + width if e < 0 else min(e, width)
    return (s, e) if 0 <= s < e <= width else None


def _takes_all(body: Graph, n: NodeProto, rank: int) -> bool:
    """Whether ``n`` is a Slice of constant bounds, step 1, taking every element of axes other than the last."""
    if n.op_type != "Slice":
        return False
    starts, ends, axes, steps = op_args.slice_args_of(body, n)
    if starts is None or ends is None or axes is None or steps not in (None, [1] * len(axes)):
        return False
    return all(a not in (-1, rank - 1) and s == 0 and e >= _TO_THE_END for a, s, e in zip(axes, starts, ends))


def _rebuilt(g: Graph, loop: NodeProto, body: Graph, proto: GraphProto, cuts: dict[int, list]):
    """The new Loop, the Slices before it and the Concats after it (see :func:`unpack_pieces`)."""
    new_body = GraphProto()
    new_body.CopyFrom(proto)
    del new_body.node[:]
    piece_in = {k: [g.fresh(f"{proto.input[2 + k].name}/rnnfuse_piece{j}") for j in range(len(b))]
                for k, (b, _) in cuts.items()}
    # each Slice reading a piece -> that piece's body input (None: a whole view of the tensor, dropped)
    by_slice = {n: (None if j is None else piece_in[k][j]) for k, (_, reads) in cuts.items() for n, j in reads.items()}
    for n in proto.node:
        if id(n) in by_slice and by_slice[id(n)] is None:
            continue
        if id(n) in by_slice:
            n = helper.make_node("Identity", [by_slice[id(n)]], [n.output[0]], name=n.name)
        new_body.node.append(n)
    del new_body.input[2:]
    del new_body.output[1:]
    inputs, finals, before, after = list(loop.input[:2]), [], [], []
    where = loop.name or "loop"
    for k, v in enumerate(proto.input[2:]):
        init, final = loop.input[2 + k], loop.output[k] if k < len(loop.output) else ""
        if k not in cuts:
            new_body.input.append(v)
            new_body.output.append(proto.output[1 + k])
            inputs.append(init)
            finals.append(final)
            continue
        cat = body.producer.get(value_source(body, proto.output[1 + k].name))
        last = len(g.model.shape(init)) - 1
        piece_finals = []
        for j, (s, e) in enumerate(cuts[k][0]):
            t = _piece_type(v.type, e - s)
            new_body.input.append(helper.make_value_info(piece_in[k][j], t))
            nxt = g.fresh(f"{piece_in[k][j]}/next")
            new_body.output.append(helper.make_value_info(nxt, t))
            new_body.node.append(helper.make_node("Identity", [cat.input[j]], [nxt]))
            cut = g.fresh(f"{init}/rnnfuse_piece{j}")
            bounds = [_const(g, [bound], before) for bound in (s, e, last)]
            before.append(helper.make_node("Slice", [init, *bounds], [cut], name=g.fresh(f"{where}/rnnfuse_cut{k}_{j}")))
            inputs.append(cut)
            piece_finals.append(g.fresh(f"{final or where + '/state' + str(k)}/rnnfuse_piece{j}"))
        finals.extend(piece_finals)
        if final:
            after.append(helper.make_node("Concat", piece_finals, [final], axis=last,
                                          name=g.fresh(f"{where}/rnnfuse_join{k}")))
    new_body.output.extend(proto.output[1 + len(proto.input) - 2:])
    # (named as the Loop is known to the user: a Loop without a name by its first output, which is a piece now)
    new = helper.make_node("Loop", inputs, finals + list(loop.output[len(proto.input) - 2:]),
                           name=loop.name or (loop.output[0] if loop.output else ""), body=new_body)
    if loop.domain:
        new.domain = loop.domain
    return new, before, after


def _piece_type(t: TypeProto, width: int) -> TypeProto:
    """The carried tensor's type with its last dim ``width`` (its element type alone when it declares no shape)."""
    out = TypeProto()
    out.CopyFrom(t)
    if out.HasField("tensor_type") and out.tensor_type.HasField("shape") and out.tensor_type.shape.dim:
        last = out.tensor_type.shape.dim[-1]
        last.Clear()
        last.dim_value = width
    return out


def _const(g: Graph, values: list[int], nodes: list[NodeProto]) -> str:
    """An int64 ``Constant`` holding ``values``, appended to ``nodes`` (a node, not an initializer: a Loop put
    back takes its nodes with it)."""
    name = g.fresh("rnnfuse/piece_bound")
    nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))))
    return name
