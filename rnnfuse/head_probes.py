"""The original side of a big head's probe check: the loop once more, outputting the head's probe points.

A per-step head too big to validate whole (:data:`rnnfuse.step_heads.PROBED_ABOVE`) is validated at its probe
points (:func:`rnnfuse.step_heads.probe_points`): the rows it reads and its first nodes' outputs, compared on
every step with what the replayed head computes there. The original loop does not output those body tensors,
so a copy of it is built beside it and never connected: same inputs and attributes, its body the original
body's nodes that compute the carried states and the probe points (not the rest of the head), its outputs the
states, the replaced scan outputs that are no head, and one scan output per probe point, stacked as the head's
was. Its outputs are the original's values (the same nodes on the same inputs), so every pair the rewrite
replaces is checked against the copy: a head's probe points, and every other replaced output unchanged.
"""

from __future__ import annotations

from onnx import GraphProto, NodeProto, helper

from .graph import Graph, attr
from .protos import carried_layout, scan_output_layout


def probe_pairs(g: Graph, node: NodeProto, replacements: dict[str, str],
                head_probes: dict[str, dict[str, tuple[str, int]]]) -> dict[str, str] | None:
    """(old, new) pairs validated in place of ``replacements`` (original tensor -> new), the rewrite of Loop
    or Scan ``node`` of ``g``; None when they cannot stand for them: a replaced tensor that is no output of
    ``node`` (computed after it: the copy would have to copy that too), or a loop of another kind.
    ``head_probes``: :attr:`rnnfuse.emit.Emission.head_probes`."""
    if node.op_type not in ("Loop", "Scan") or node.domain not in ("", "ai.onnx") or g.parent is not None:
        return None
    if node.op_type == "Scan" and g.model.opset < 9:  # (Scan-8 reads sequence lengths first: another layout)
        return None
    body = attr(node, "body")
    lead, n_states = carried_layout(node)
    position = {o: k for k, o in enumerate(node.output) if o}
    if any(old not in position for old in replacements) or n_states < 0:
        return None
    axes, directions = scan_output_layout(node, len(node.output) - n_states)
    outputs = [body.output[k] for k in range(lead + n_states)]  # the condition and the states, kept
    kept = list(range(n_states))  # the node's outputs the copy keeps, in its order
    probed: list[tuple[int, str, str, int]] = []  # (the head's scan output, body tensor, new tensor, its type)
    for old in sorted(replacements, key=position.get):
        k = position[old]
        if k < n_states:
            continue
        if old in head_probes:
            probed += [(k, name, new, et) for name, (new, et) in head_probes[old].items()]
            continue
        outputs.append(body.output[lead + k])
        kept.append(k)
    # each probe point through an Identity of its own: a point may be a state the body outputs already (h_t)
    copies = [helper.make_node("Identity", [name], [f"rnnfuse_probe_{j}/{name}"]) for j, (_, name, _, _) in enumerate(probed)]
    outputs += [helper.make_tensor_value_info(c.output[0], et, None) for c, (_, _, _, et) in zip(copies, probed)]
    copy_outs = g.add_node(node.op_type, list(node.input), len(outputs) - lead, name=f"{node.name or 'loop'}/probe",
                           anchor=node, domain=node.domain, body=_body_computing(g.subgraph(node), outputs, copies))
    copy = g.producer[copy_outs[0]]
    scans = [k - n_states for k in kept[n_states:]] + [k - n_states for k, _, _, _ in probed]
    for a in node.attribute:
        if a.name == "body":
            continue
        if a.name in ("scan_output_axes", "scan_output_directions"):
            values = axes if a.name == "scan_output_axes" else directions
            copy.attribute.append(helper.make_attribute(a.name, [values[j] for j in scans]))
        else:
            copy.attribute.append(a)
    pairs = {}
    for j, k in enumerate(kept):
        old = node.output[k]
        if old in replacements:
            pairs[copy_outs[j]] = replacements[old]
    for j, (_, _, new, _) in enumerate(probed):
        pairs[copy_outs[len(kept) + j]] = new
    return pairs


def _body_computing(body: Graph, outputs: list, extra: list[NodeProto]) -> GraphProto:
    """A copy of loop body ``body`` (its index) with nodes ``extra`` (reading its values) added and ``outputs``
    (value infos) as its outputs, holding only the nodes and initializers they are computed from: the index's
    cone of what they read, nested subgraphs' captures included."""
    extra_outs = {o for n in extra for o in n.output}
    nodes = body.cone([o.name for o in outputs if o.name not in extra_outs] + [i for n in extra for i in n.input])
    read = {i for n in [*nodes, *extra] for i in body.reads(n)} | {o.name for o in outputs}
    out = GraphProto(name=body.proto.name)
    out.node.extend([*nodes, *extra])
    out.input.extend(body.proto.input)
    out.output.extend(outputs)
    out.initializer.extend(t for t in body.proto.initializer if t.name in read)
    out.sparse_initializer.extend(t for t in body.proto.sparse_initializer if t.values.name in read)
    return out
