"""``AssembleRowWrites``: a buffer whose every row is written, one step at a time, with that step of a
sequence, is that sequence.

A common way to collect a recurrence's outputs is a preallocated tensor written at each step: ``outs =
torch.zeros(T, B, H)`` then ``outs[t] = h`` (``outs[:, t] = h`` batch-first). Exporters write that as a chain
of T scatters, one per step, each copying the whole buffer (``ScatterND`` with the index ``[[t]]`` from torch's
tracer, ``ScatterElements`` with an index tensor filled with t from dynamo's ``select_scatter``). Once the
steps are fused, each step's ``h`` is a slice of the native op's Y, so the buffer is Y (its time axis moved to
the buffer's): T scatters and their O(T^2) copying become at most one Transpose.

Found when the chain's writes cover every row of the buffer's axis (a static length) and each row written
last is ``Gather(Y, t)`` of one native recurrent op's output along one axis, through views (Unsqueeze,
Expand, Reshape); the rewrite is validated like every other (the shapes the views must keep are checked by
running it), and reads of an intermediate buffer's shape (the exporter sizes each update from it) are moved
to the first buffer, which has the same shape.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse.dataflow import reads_shape_only
from rnnfuse.dims import static_dim
from rnnfuse.findings import Finding, Options, PassResult
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.rewrite import Rewrite, apply_rewrites

_SCATTERS = ("ScatterND", "ScatterElements")
_VIEWS = ("Unsqueeze", "Squeeze", "Expand", "Reshape", "Identity")


def _written_row(g: Graph, s: NodeProto) -> tuple[int, int, str] | None:
    """``(axis, row, value)`` when the scatter ``s`` writes one whole row of its data along ``axis``: ScatterND
    at the constant index ``[[t]]``, or ScatterElements whose indices hold t everywhere (a constant, or one
    expanded to the update's shape)."""
    if attr(s, "reduction", "none") not in ("none", b"none"):
        return None
    if s.op_type == "ScatterND":
        idx = g.const(s.input[1])
        if idx is None or idx.shape != (1, 1):
            return None
        return 0, int(idx.ravel()[0]), s.input[2]
    idx = g.const(s.input[1])
    if idx is None:
        p = g.producer.get(s.input[1])
        idx = g.const(p.input[0]) if p is not None and p.op_type == "Expand" else None
    if idx is None or idx.size == 0 or not np.all(idx == idx.ravel()[0]):
        return None
    return attr(s, "axis", 0), int(idx.ravel()[0]), s.input[2]


def _row_source(g: Graph, value: str) -> tuple[str, int, int] | None:
    """``(Y, axis, t)`` when ``value`` is ``Gather(Y, t)`` (t a constant scalar) through views."""
    for _ in range(6):
        p = g.producer.get(value)
        if p is None:
            return None
        if p.op_type == "Gather":
            t = g.const(p.input[1])
            if t is None or t.ndim != 0:
                return None
            return p.input[0], attr(p, "axis", 0), int(t)
        if p.op_type not in _VIEWS:
            return None
        value = p.input[0]
    return None


def _recurrent_output(g: Graph, y: str) -> bool:
    """Whether ``y`` is a native LSTM/GRU/RNN's output (through the Squeeze or Transpose of its Y): what a
    fused or exported recurrence hands the buffer."""
    for _ in range(4):
        p = g.producer.get(y)
        if p is None:
            return False
        if p.op_type in ("LSTM", "GRU", "RNN"):
            return True
        if p.op_type not in ("Squeeze", "Transpose", "Identity", "Reshape"):
            return False
        y = p.input[0]
    return False


def _chain(g: Graph, end: NodeProto) -> list[NodeProto] | None:
    """The scatters writing into one buffer, first to last, ending at ``end``; each intermediate buffer read
    by the next write only (and for its shape)."""
    chain = [end]
    while True:
        p = g.producer.get(chain[-1].input[0])
        if p is None or p.op_type != end.op_type or attr(p, "axis", 0) != attr(end, "axis", 0):
            break
        if any(u is not chain[-1] and not reads_shape_only(g, u) for u in g.uses(p.output[0])):
            break
        if g.is_graph_output(p.output[0]):
            break
        chain.append(p)
    return chain[::-1] if len(chain) > 1 else None


def _assembled(g: Graph, chain: list[NodeProto]) -> tuple[str, int, int] | None:
    """``(Y, Y's axis, the buffer's axis)`` when the chain writes every row with the matching slice of Y."""
    buf = chain[0].input[0]
    writes = [_written_row(g, s) for s in chain]
    if any(w is None for w in writes) or len({w[0] for w in writes}) != 1:
        return None
    axis = writes[0][0]
    rank = g.model.rank(buf)
    if rank is None:
        return None
    axis = axis + rank if axis < 0 else axis
    length = static_dim(g, buf, axis)
    if length is None or length < 2:
        return None
    last: dict[int, str] = {}
    for _, t, value in writes:
        last[t + length if t < 0 else t] = value  # (a row written twice holds its last write)
    if set(last) != set(range(length)):
        return None
    sources = {t: _row_source(g, v) for t, v in last.items()}
    if None in sources.values() or len({(y, ax) for y, ax, _ in sources.values()}) != 1:
        return None
    y, y_axis, _ = sources[0]
    if any(t != (src_t + length if src_t < 0 else src_t) for t, (_, _, src_t) in sources.items()):
        return None  # (row t holds step t of Y)
    if not _recurrent_output(g, y):
        return None
    y_rank = g.model.rank(y)
    if y_rank != rank or static_dim(g, y, y_axis) not in (None, length):
        return None
    return y, (y_axis + rank if y_axis < 0 else y_axis), axis


class AssembleRowWrites:
    name = "row-writes"
    fuses_only_with = frozenset({"LSTM", "GRU", "RNN"})  # (the rows are a native recurrent op's output)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        rewrites, shape_moves = [], []
        chained = set()
        ends = [s for s in g.nodes_of(*_SCATTERS) if not any(u.op_type == s.op_type and u.input[0] == s.output[0]
                                                            for u in g.uses(s.output[0]))]
        for end in ends:
            chain = _chain(g, end)
            if chain is None or any(id(s) in chained for s in chain):
                continue
            found = _assembled(g, chain)
            if found is None:
                continue
            chained.update(id(s) for s in chain)
            y, y_axis, axis = found
            new = y
            if y_axis != axis:
                perm = list(range(g.model.rank(y)))
                perm.insert(axis, perm.pop(y_axis))
                new = g.add_node("Transpose", [y], 1, name="rnnfuse/Transpose", anchor=end, perm=perm)[0]
            f = Finding(self.name, "row writes", end.name or end.output[0], "merged",
                        cell=f"{len(chain)} {end.op_type} writes of '{y}' -> " + ("Transpose" if new != y else "it"))
            rewrites.append(Rewrite(f, {end.output[0]: new}))
            shape_moves.append((chain, f))
        apply_rewrites(g, ctx, rewrites, res, prune=False)
        for chain, f in shape_moves:
            if f.status != "merged":
                continue
            buf = chain[0].input[0]
            for s in chain[:-1]:  # (a scatter keeps its data's shape: the first buffer's)
                g.replace_reads([u for u in g.uses(s.output[0]) if reads_shape_only(g, u)], s.output[0], buf)
            res.modified = True
        if res.modified:
            g.prune()
        return res
