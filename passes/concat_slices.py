"""``MergeConsecutiveSlices``: a Concat of consecutive slices of one tensor is one slice of it.

Merging per-step ops into one (passes/step_chains.py) leaves both ends of the sequence in pieces: the merged
op reads ``Concat(x[0:1], x[1:2], ..., x[T-1:T])`` and the model's output is ``Concat(Y[0:1], ..., Y[T-1:T])``
(each piece perhaps through the same Squeeze or Transpose), T nodes each, where one slice says the same.
Exact: slices ``[s_1, e_1), [e_1, e_2), ...`` of one axis with non-negative constant bounds and step 1,
clamped to the axis length, concatenated along that axis are ``[s_1, e_n)`` clamped the same way; a Squeeze
of another axis or a Transpose applied to every piece alike is applied once to the whole.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper

from rnnfuse import op_args
from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, attr

# per-piece layout ops that commute with slicing: the sliced axis moves through them (_moved_axis)
_LAYOUT = ("Squeeze", "Transpose", "Identity")


def _piece(g: Graph, name: str) -> tuple | None:
    """``name`` = layout(Slice(src, [s], [e], [axis])): (src, axis as written, s, e, the layout node or None)."""
    p = g.producer.get(name)
    layout = None
    if p is not None and p.op_type in _LAYOUT and len(g.uses(name)) <= 1:
        layout, p = p, g.producer.get(p.input[0])
    if p is None or p.op_type != "Slice" or len(g.uses(p.output[0])) > 1:
        return None
    starts, ends, axes, steps = op_args.slice_args(p, g.model.opset, op_args.const_reader(g, p))
    if None in (starts, ends) or len(starts) != 1 or (steps is not None and steps != [1]):
        return None
    if starts[0] < 0 or ends[0] < starts[0]:
        return None
    return p.input[0], (axes or [0])[0], starts[0], ends[0], layout


def _same_layout(g: Graph, a: NodeProto | None, b: NodeProto | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.op_type != b.op_type or len(a.input) != len(b.input):
        return False
    if [x.SerializeToString() for x in a.attribute] != [x.SerializeToString() for x in b.attribute]:
        return False
    for x, y in zip(a.input[1:], b.input[1:]):  # (each step's Squeeze has its own copy of the axes)
        if x != y:
            cx, cy = g.const(x), g.const(y)
            if cx is None or cy is None or not np.array_equal(cx, cy):
                return False
    return True


def _moved_axis(g: Graph, layout: NodeProto | None, axis: int, rank: int) -> int | None:
    """Where the sliced ``axis`` is after the layout op (None: the op drops or is unsure of it)."""
    if layout is None or layout.op_type == "Identity":
        return axis
    if layout.op_type == "Transpose":
        perm = attr(layout, "perm")
        return list(perm).index(axis) if perm is not None and axis in perm else None
    axes = op_args.axes(layout, g.model.opset, op_args.const_reader(g, layout))
    if axes is None:
        return None
    axes = [a + rank if a < 0 else a for a in axes]
    return None if axis in axes else axis - sum(1 for a in axes if a < axis)


def _merged(g: Graph, cat: NodeProto) -> tuple | None:
    """(source, axis, start, end, layout) when every input of ``cat`` is the next piece of one tensor."""
    pieces = [_piece(g, i) for i in cat.input]
    if len(pieces) < 2 or any(p is None for p in pieces) or any(p[0] != pieces[0][0] for p in pieces):
        return None
    src = pieces[0][0]
    rank = g.model.rank(src)  # (asked once the pieces are slices of one tensor: a type may cost an inference)
    if rank is None:
        return None
    _, axis, start, end, layout = pieces[0]
    axis = axis + rank if axis < 0 else axis
    for p in pieces[1:]:
        if (p[1] + rank if p[1] < 0 else p[1]) != axis or p[2] != end or not _same_layout(g, p[4], layout):
            return None
        end = p[3]
    cat_axis = attr(cat, "axis", 0)
    out_rank = g.model.rank(cat.output[0])
    if out_rank is None:
        return None
    if _moved_axis(g, layout, axis, rank) != (cat_axis + out_rank if cat_axis < 0 else cat_axis):
        return None
    return src, axis, start, end, layout


class MergeConsecutiveSlices:
    name = "merge-slices"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        merged = 0
        if model.opset < 10:  # (Slice bounds as inputs)
            return res
        for cat in g.nodes_of("Concat"):
            if not g.alive(cat):
                continue
            found = _merged(g, cat)
            if found is None:
                continue
            src, axis, start, end, layout = found
            consts = [g.add_initializer(np.array([v], np.int64), f"rnnfuse/slice_{k}") for k, v in
                      (("start", start), ("end", end), ("axis", axis))]
            new = g.add_node("Slice", [src] + consts, 1, name="rnnfuse/Slice", anchor=cat)[0]
            if layout is not None:
                attrs = {a.name: helper.get_attribute_value(a) for a in layout.attribute}
                new = g.add_node(layout.op_type, [new] + list(layout.input[1:]), 1, name=f"rnnfuse/{layout.op_type}",
                                 anchor=cat, **attrs)[0]
            g.replace_uses(cat.output[0], new)
            g.remove_node(cat)
            merged += 1
        if merged:
            res.modified = True
            res.notes.append(f"merged {merged} concatenations of consecutive slices")
        return res
