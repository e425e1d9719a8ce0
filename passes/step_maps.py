"""``StackStepMaps``: per-step copies of one row-wise map over a native op's steps, stacked on time, become
the map applied once to the whole sequence.

What an unrolled export computes from each step's h without carrying it (a head ``fc(h_t)`` stacked on time,
``cat([h1_t, h2_t])`` of two cells side by side) is still there per step once the cells are fused: T copies
of the map, each on its step ``Gather(Y, t)``, then T Unsqueezes and a Concat (a torch trace of a 100-step
loop with a per-step head keeps ~400 small nodes next to one LSTM). When every copy is the same map on the
same steps' offsets and the map treats every batch row on its own (proven per op by :mod:`rnnfuse.row_wise`:
elementwise with constants that do not span rows, a matmul by a constant, concat along features ...), the
stack is the map applied to every step's rows at once: ``map(Flatten(Y))`` reshaped to ``[T, B, K]``.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse.emit import Builder
from rnnfuse.errors import Decline
from rnnfuse.findings import Finding, Options, PassResult
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.rewrite import Rewrite, apply_rewrites
from rnnfuse.row_wise import ROW_RANK, check_row_wise, folded_from_shapes, replay, unflatten

_NATIVE = ("LSTM", "GRU", "RNN")


def _unsqueezed(g: Graph, name: str, axis: int) -> str | None:
    """``v`` when ``name`` is ``Unsqueeze(v, [axis])`` read by nothing else (the stacking of one step)."""
    p = g.producer.get(name)
    if p is None or p.op_type != "Unsqueeze" or g.n_uses(name) != 1 or g.is_graph_output(name):
        return None
    axes = g.const(p.input[1]) if len(p.input) > 1 else attr(p, "axes")
    if axes is None or [int(a) for a in np.asarray(axes).ravel()] not in ([axis], [axis - 3]):
        return None
    return p.input[0] if g.model.rank(p.input[0]) == 2 else None


def _native_sequence(g: Graph, seq: str) -> bool:
    """Whether ``seq`` ([T, B, H]) is a native recurrent op's Y with its direction axis squeezed."""
    p = g.producer.get(seq)
    if p is not None and p.op_type == "Squeeze":
        p = g.producer.get(p.input[0])
    return p is not None and p.op_type in _NATIVE and g.model.rank(seq) == 3


def _step_of(g: Graph, name: str) -> tuple[str, int] | None:
    """``(seq, t)`` when ``name`` is step t of a native op's sequence: ``Gather(seq, t)`` on its time axis."""
    p = g.producer.get(name)
    if p is None or p.op_type != "Gather" or attr(p, "axis", 0) != 0:
        return None
    t = g.const(p.input[1])
    if t is None or np.asarray(t).ndim != 0 or int(t) < 0 or not _native_sequence(g, p.input[0]):
        return None
    return p.input[0], int(t)


class _Map:
    """One step's copy of the map: its nodes in evaluation order and a signature that is the same for every
    copy of the same map over the same step offsets."""

    def __init__(self, g: Graph, out: str, item: int):
        self.g, self.item = g, item
        self.nodes: list[NodeProto] = []
        self._index: dict[int, int] = {}  # node id -> its place in ``nodes``
        self.steps: dict[str, tuple[str, int]] = {}  # tensor -> (sequence, offset of its step from the item's)
        self.consts: dict[str, np.ndarray] = {}
        self.refs: dict[str, tuple] = {}
        self.signature = (self._ref(out, set()), tuple(self._node_key(n) for n in self.nodes))

    def _ref(self, name: str, walking: set) -> tuple:
        if name in self.refs:
            return self.refs[name]
        g = self.g
        step = _step_of(g, name)
        c = g.const(name) if step is None else None
        if step is not None:
            self.steps[name] = (step[0], step[1] - self.item)
            ref = ("step", step[0], step[1] - self.item)
        elif c is not None:  # a weight by its name; a copied constant by its value
            if folded_from_shapes(g, name):  # (from a step's static shape: it would bake [B, ...] in)
                raise Decline(f"'{name}' is computed from the shape of a step")
            self.consts[name] = np.asarray(c)
            ref = ("init", name) if name in g.initializers else ("const", c.dtype.str, c.shape, np.asarray(c).tobytes())
        else:
            p = g.producer.get(name)
            # (bounded by the values walked, not the nodes kept: those are kept once their inputs are walked,
            # so a map reading back into a long declined chain recursed through all of it first)
            if p is None or name in walking or len(walking) > 64:
                raise Decline(f"'{name}' is no step of a native op's output, constant or mapped value")
            walking.add(name)
            ins = tuple(self._ref(i, walking) if i else ("",) for i in p.input)
            if id(p) not in self._index:
                self._index[id(p)] = len(self.nodes)
                self.nodes.append(p)
            ref = ("node", self._index[id(p)], list(p.output).index(name), ins)
        self.refs[name] = ref
        return ref

    @staticmethod
    def _node_key(n: NodeProto) -> tuple:
        return (n.op_type, n.domain, tuple(a.SerializeToString() for a in n.attribute))


def _stacked_map(g: Graph, cat: NodeProto) -> tuple[_Map, int, int] | None:
    """``(the first step's map, the stacking axis, the number of steps)`` when every input of ``cat`` stacks
    the same row-wise map of the steps of native ops' sequences; None when it is not such a stack."""
    axis = attr(cat, "axis", 0)
    axis = axis + 3 if axis < 0 else axis  # (the stacked items are [B, K] rows: the stack is rank 3)
    if axis not in (0, 1) or len(cat.input) < 2:
        return None
    items = [_unsqueezed(g, i, axis) for i in cat.input]
    if None in items:
        return None
    try:
        maps = [_Map(g, r, k) for k, r in enumerate(items)]
    except Decline:
        return None
    first = maps[0]
    if not first.steps or any(m.signature != first.signature for m in maps[1:]):
        return None
    rows = {name: ROW_RANK for name in first.steps}
    rows.update({name: 0 for name in first.consts})
    try:
        for n in first.nodes:
            rank_out = check_row_wise(g, n, rows, lambda v: first.consts.get(v, g.const(v)), "a stacked per-step map")
            for o in n.output:
                rows[o] = rank_out if any(rows.get(i) for i in n.input if i) else 0
    except Decline:
        return None
    return first, axis, len(items)


def _emit(g: Graph, cat: NodeProto, m: _Map, axis: int, n_steps: int) -> str:
    """The map applied once to steps [offset, offset + n_steps) of each sequence it reads, stacked on ``axis``."""
    b = Builder(g, cat, "rnnfuse/step_maps")
    env: dict[str, str] = {}
    like = None
    for name, (seq, offset) in m.steps.items():
        part, shape = seq, g.model.shape(seq)
        if offset or not shape or shape[0] != n_steps:
            part = b.op("Slice", seq, b.i64(offset), b.i64(offset + n_steps), b.i64(0))
        like = like or part
        env[name] = b.op("Flatten", part, axis=2)
    for name, arr in m.consts.items():
        if name not in g.initializers:
            env[name] = b.const(arr, "map")
    out = replay(b, m.nodes, env, "map")[m.nodes[-1].output[0]] if m.nodes else next(iter(env.values()))
    y = unflatten(b, out, like)
    return b.op("Transpose", y, perm=[1, 0, 2]) if axis == 1 else y


class StackStepMaps:
    """Stacked per-step copies of a row-wise map over native ops' steps: the map applied once (module doc)."""

    name = "step-maps"
    fuses_only_with = frozenset(_NATIVE)  # (the steps are a native recurrent op's output)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        if not g.nodes_of(*_NATIVE):
            return res  # (no step to map: a Concat's items are not asked their ranks, a cone inferred each)
        rewrites = []
        for cat in g.nodes_of("Concat"):
            found = _stacked_map(g, cat)
            if found is None:
                continue
            m, axis, n_steps = found
            new = _emit(g, cat, m, axis, n_steps)
            ops = "+".join(n.op_type for n in m.nodes)
            f = Finding(self.name, "stacked steps", cat.name or cat.output[0], "merged",
                        cell=f"{n_steps} per-step {ops} -> one over the sequence" if ops else f"{n_steps} steps -> one slice")
            rewrites.append(Rewrite(f, {cat.output[0]: new}))
        apply_rewrites(g, ctx, rewrites, res)
        return res
