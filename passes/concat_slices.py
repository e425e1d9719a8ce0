"""``MergeConsecutiveSlices``: a Concat of consecutive slices of one tensor is one slice of it.

Merging per-step ops into one (passes/step_chains.py) leaves both ends of the sequence in pieces: the merged
op reads ``Concat(x[0:1], x[1:2], ..., x[T-1:T])`` and the model's output is the Concat of the parts of
``Split(Y)`` (each piece perhaps through the same Squeezes, Unsqueezes or Transposes), T nodes each, where one
slice says the same. A Split's consecutive parts are consecutive slices: the same rule takes them.
Exact: slices ``[s_1, e_1), [e_1, e_2), ...`` of one axis with non-negative constant bounds and step 1,
clamped to the axis length, concatenated along that axis are ``[s_1, e_n)`` clamped the same way; layout ops
applied to every piece alike (a Squeeze of another axis, an Unsqueeze, a Transpose) that carry the sliced axis
to the concatenated one are applied once to the whole.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper

from rnnfuse import op_args
from rnnfuse.dataflow import settled_rank
from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, attr

# per-piece layout ops that commute with slicing: the sliced axis moves through them (_moved_axis)
_LAYOUT = ("Squeeze", "Unsqueeze", "Transpose", "Identity")


def _piece(g: Graph, name: str, bounds: dict) -> tuple | None:
    """``name`` = layouts(Slice(src, [s], [e], [axis])) or layouts(Split(src)[k]): (src, axis as written, s, e,
    the layout ops from the cut out). torch's per-step output is ``Y[t:t+1]`` squeezed, then transposed to
    batch-first: two layout ops. A piece read elsewhere too stays for those readers (torch's trace reads the
    batch size off the first step's ``x[0:1]``). ``bounds``: each Split's parts' bounds, worked out once (a
    merged chain's Y is cut into thousands)."""
    layouts = []
    p = g.producer.get(name)
    while p is not None and p.op_type in _LAYOUT:
        layouts.append(p)
        name = p.input[0]
        p = g.producer.get(name)
    if p is not None and p.op_type == "Split":
        if id(p) not in bounds:  # (the node is held beside its bounds: a node the pass adds cannot take its id)
            bounds[id(p)] = (p, op_args.split_bounds(p, g.model.opset, op_args.const_reader(g, p)))
        cut = bounds[id(p)][1]
        if not cut or name not in cut:
            return None
        return p.input[0], attr(p, "axis", 0), cut[name][0], cut[name][1], layouts[::-1]
    if p is None or p.op_type != "Slice":
        return None
    starts, ends, axes, steps = op_args.slice_args_of(g, p)
    if None in (starts, ends) or len(starts) != 1 or (steps is not None and steps != [1]):
        return None
    if starts[0] < 0 or ends[0] < starts[0]:
        return None
    return p.input[0], (axes or [0])[0], starts[0], ends[0], layouts[::-1]


def _same_layout(g: Graph, a: NodeProto, b: NodeProto) -> bool:
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


def _moved_axis(g: Graph, layout: NodeProto, axis: int, rank: int) -> tuple[int, int] | None:
    """Where the sliced ``axis`` of a rank-``rank`` input is after the layout op, and the op's output rank
    (None: the op drops the axis or is unsure of it)."""
    if layout.op_type == "Identity":
        return axis, rank
    if layout.op_type == "Transpose":
        perm = attr(layout, "perm")
        return (list(perm).index(axis), rank) if perm is not None and axis in perm else None
    axes = op_args.axes(layout, g.model.opset, op_args.const_reader(g, layout))
    if axes is None:
        return None
    # (the input's axis each of the output's axes is, None for one an Unsqueeze adds)
    out = op_args.squeezed(list(range(rank)), axes) if layout.op_type == "Squeeze" else \
        op_args.unsqueezed(list(range(rank)), axes, fill=None)
    return None if out is None or axis not in out else (out.index(axis), len(out))


def _merged(g: Graph, cat: NodeProto, bounds: dict) -> tuple | None:
    """(source, axis, start, end, layout ops) when every input of ``cat`` is the next piece of one tensor,
    each through the same layout ops."""
    pieces = [_piece(g, i, bounds) for i in cat.input]
    if len(pieces) < 2 or any(p is None for p in pieces) or any(p[0] != pieces[0][0] for p in pieces):
        return None
    src = pieces[0][0]
    # (asked once the pieces are slices of one tensor: a type may cost an inference; a native op's Y needs none)
    rank = settled_rank(g, src)
    rank = g.model.rank(src) if rank is None else rank
    if rank is None:
        return None
    _, axis, start, end, layouts = pieces[0]
    axis = axis + rank if axis < 0 else axis
    for p in pieces[1:]:
        if (p[1] + rank if p[1] < 0 else p[1]) != axis or p[2] != end or len(p[4]) != len(layouts) or not all(
                _same_layout(g, a, b) for a, b in zip(p[4], layouts)):
            return None
        end = p[3]
    moved, out_rank = axis, rank
    for layout in layouts:
        step = _moved_axis(g, layout, moved, out_rank)
        if step is None:
            return None
        moved, out_rank = step
    if moved != attr(cat, "axis", 0) % out_rank:
        return None
    return src, axis, start, end, layouts


class MergeConsecutiveSlices:
    name = "merge-slices"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        merged = 0
        bounds: dict = {}
        if model.opset < 10:  # (Slice bounds as inputs)
            return res
        for cat in g.nodes_of("Concat"):
            if not g.alive(cat):
                continue
            found = _merged(g, cat, bounds)
            if found is None:
                continue
            src, axis, start, end, layouts = found
            consts = [g.add_initializer(np.array([v], np.int64), f"rnnfuse/slice_{k}") for k, v in
                      (("start", start), ("end", end), ("axis", axis))]
            new = g.add_node("Slice", [src] + consts, 1, name="rnnfuse/Slice", anchor=cat)[0]
            for layout in layouts:  # (applied once to the whole, in the pieces' order)
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
