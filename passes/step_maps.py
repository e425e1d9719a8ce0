"""``StackStepMaps``: per-step copies of one row-wise map over a native op's steps, stacked on time, become
the map applied once to the whole sequence.

What an unrolled export computes from each step's h without carrying it (a head ``fc(h_t)`` stacked on time,
``cat([h1_t, h2_t])`` of two cells side by side) is still there per step once the cells are fused: T copies
of the map, each on its step ``Gather(Y, t)``, then T Unsqueezes and a Concat (a torch trace of a 100-step
loop with a per-step head keeps ~400 small nodes next to one LSTM). When every copy is the same map, each
reading the step after (or before: a backward cell's steps stacked in the forward order, read flipped once)
the one the previous copy read, and the map treats every batch row on its own (proven per op by :mod:`rnnfuse.row_wise`:
elementwise with constants that do not span rows, a matmul by a constant, concat along features ...), the
stack is the map applied to every step's rows at once: ``map(Flatten(Y))`` reshaped to ``[T, B, K]``. A copy
may also read the model input's own step (``Y1[t] + proj(x[t])``, a residual stack's upper input), taken the
same way, as long as it reads a native op's step too. Consecutive parts of Y concatenated on time as they are
(one-step parts perhaps last first), each viewed as ``[steps, B, H]`` (dynamo without its optimizer transposes
and reshapes each call's Y before ``torch.cat(ys)``) or as one transpose of it (a batch-first layer's
``[B, steps, H]``, concatenated on axis 1), are that stretch of Y, transposed the same way.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args, rewrite
from rnnfuse.builder import Builder
from rnnfuse.dataflow import settled_dim
from rnnfuse.errors import Decline
from rnnfuse.findings import Finding, Options, PassResult
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.index_order import length_term
from rnnfuse.index_terms import terms
from rnnfuse.op_shapes import known_rank
from rnnfuse.rewrite import Rewrite, apply_rewrites
from rnnfuse.row_wise import ROW_RANK, check_row_wise, folded_from_shapes, replay, unflatten

_NATIVE = ("LSTM", "GRU", "RNN")


def _unsqueezed(g: Graph, name: str, axis: int) -> str | None:
    """``v`` when ``name`` is ``Unsqueeze(v, [axis])`` read by nothing else (the stacking of one step; v's rank,
    2, is asked once v proves to be mapped from a step: _stacked_map)."""
    p = g.producer.get(name)
    if p is None or p.op_type != "Unsqueeze" or g.n_uses(name) != 1 or g.is_graph_output(name):
        return None
    axes = g.const(p.input[1]) if len(p.input) > 1 else attr(p, "axes")
    if axes is None or [int(a) for a in np.asarray(axes).ravel()] not in ([axis], [axis - 3]):
        return None
    return p.input[0]


def _native_sequence(g: Graph, seq: str) -> bool:
    """Whether ``seq`` ([T, B, H]) is a native recurrent op's Y, its direction axis squeezed, perhaps sliced
    on the way (one direction of a bidirectional op, a time flip: how the bidirectional merge and the
    emitter hand a direction on). Only where the pass looks: any [T, B, H] tensor's rows are steps and batch
    rows, which is all the map's proof reads."""
    name = seq
    for _ in range(4):
        p = g.producer.get(name)
        if p is None or p.op_type not in _NATIVE + ("Squeeze", "Slice"):
            return False
        if p.op_type in _NATIVE:  # (Y, not a final state; its rank asked last: a type may be inferred for it)
            return p.output[0] == name and known_rank(g, seq) == 3
        name = p.input[0]
    return False


def _step_of(g: Graph, name: str, splits: dict) -> tuple | None:
    """``(seq, t)`` when ``name`` is step t of a native op's sequence: ``Gather(seq, t)`` on its time axis, or
    the rows of a one-step part of ``Split(Y)``, Y a one-direction native op's own ``[T, 1, B, H]`` output (seq
    is Y then): what step_chains leaves of torch's ``y, state = rnn(x[t:t+1], state); head(y[0])`` per call.
    ``(x, t, axis)`` when it is ``Gather(x, t)`` of a rank-3 model input x on its time axis (0 or 1).
    ``splits``: each Split's parts' bounds, worked out once a run."""
    p = g.producer.get(name)
    if p is None or p.domain not in ("", "ai.onnx"):
        return None
    found = _part_rows(g, name, splits)
    if found is not None or p.op_type != "Gather":
        return found
    t, axis = g.const(p.input[1]), attr(p, "axis", 0)
    if t is None or np.asarray(t).ndim != 0 or int(t) < 0:
        return None
    if axis == 0 and _native_sequence(g, p.input[0]):
        return p.input[0], int(t)
    # (a model input's own time step, x[t] or x[:, t] of a [T, B, F] or [B, T, F] input: what a residual stack's
    # upper step input h1_t + proj(x_t) reads beside the lower op's step)
    if axis in (0, 1) and g.is_graph_input(p.input[0]) and known_rank(g, p.input[0]) == 3:
        return p.input[0], int(t), axis
    return None


# ops that only view a tensor's elements (in memory order, where no axis of more than one element is moved past
# another)
_VIEWS = ("Squeeze", "Unsqueeze", "Reshape", "Transpose", "Gather", "Identity")


def _part_rows(g: Graph, name: str, splits: dict) -> tuple[str, int] | None:
    """``(Y, t)`` when ``name`` is the ``[B, H]`` rows of part t of ``Split(Y)`` (one step; Y a one-direction
    native op's output), reached by views that only drop, add or move axes of one element: trace squeezes the
    direction axis and takes ``[0]``, dynamo transposes, reshapes and takes ``[0]``. The axes are followed as
    unit (1), batch ("b") and hidden ("h"); every view keeps the elements' order, so rows stay rows."""
    found = _viewed_part(g, name, splits)
    return (found[0], found[1]) if found is not None and found[2] == 1 and found[3] == ["b", "h"] else None


def _viewed_part(g: Graph, name: str, splits: dict) -> tuple[str, int, int, list] | None:
    """``(Y, first step, steps, axes)`` when ``name`` is a part of ``Split(Y)`` along time (Y a one-direction
    native op's own ``[T, 1, B, H]`` output) through views, its axes as the views leave them: unit (1), steps
    ("t", a part of more than one), batch ("b") and hidden ("h")."""
    views = []
    cur = name
    while len(views) <= 8:
        p = g.producer.get(cur)
        if p is None or p.domain not in ("", "ai.onnx") or p.op_type not in _VIEWS + ("Split",):
            return None
        if p.op_type == "Split":
            break
        views.append(p)
        cur = p.input[0]
    else:
        return None
    if not views or attr(p, "axis", 0) != 0 or not _native_y(g, p.input[0]):
        return None
    if id(p) not in splits:  # (the node is held beside its bounds: no later node takes its id)
        splits[id(p)] = (p, op_args.split_bounds(p, g.model.opset, op_args.const_reader(g, p)))
    part = (splits[id(p)][1] or {}).get(cur)
    hidden = attr(g.producer[p.input[0]], "hidden_size", None)
    if part is None or part[1] <= part[0] or not isinstance(hidden, int) or hidden < 2:
        return None
    steps = part[1] - part[0]
    dims = ["t" if steps > 1 else 1, 1, "b", "h"]  # the part: [steps, 1 direction, B, H]
    for v in reversed(views):
        dims = _viewed(g, v, dims, hidden, steps)
        if dims is None:
            return None
    return p.input[0], part[0], steps, dims


def _viewed(g: Graph, v: NodeProto, dims: list, hidden: int, steps: int = 1) -> list | None:
    """The axes after view ``v`` (see _viewed_part: ``steps`` is the extent of "t"), or None where it may move
    the rows or is not known."""
    op, rank = v.op_type, len(dims)
    const = lambda i: g.const(v.input[i])  # noqa: E731
    if op == "Identity":
        return dims
    if op == "Transpose":
        perm = _transpose_perm(v, rank)
        if perm is None:
            return None
        out = [dims[k] for k in perm]
        return out if [d for d in out if d != 1] == [d for d in dims if d != 1] else None
    if op == "Gather":
        idx, axis = const(1), attr(v, "axis", 0)
        ok = idx is not None and np.asarray(idx).ndim == 0 and int(idx) in (0, -1) and -rank <= axis < rank
        return dims[:axis % rank] + dims[axis % rank + 1:] if ok and dims[axis % rank] == 1 else None
    if op in ("Squeeze", "Unsqueeze"):
        axes = op_args.axes(v, g.model.opset, const)
        if axes is None:
            return None  # (a Squeeze of every unit axis: the batch too, where it is 1)
        if op == "Unsqueeze":
            return op_args.unsqueezed(dims, axes)
        kept = op_args.squeezed(list(range(rank)), axes)  # (the axes it keeps: those it drops must be units)
        if not axes or kept is None or any(dims[k] != 1 for k in range(rank) if k not in kept):
            return None
        return [dims[k] for k in kept]
    # (Reshape: to a shape whose entries other than 1 are the same axes in the same order, only units added or
    # dropped; a constant, or one computed from the input's own shape, as dynamo without its optimizer writes
    # [T, B, dirs * H])
    shape = const(1)
    values = [int(x) for x in np.asarray(shape).ravel()] if shape is not None else _shape_entries(g, v, dims)
    if values is None or (attr(v, "allowzero", 0) and 0 in values):  # (a 0 that is no copy: empty)
        return None
    entries = [dims[k] if x == 0 and k < rank else x for k, x in enumerate(values)]
    wide = [k for k, x in enumerate(entries) if x != 1]
    axes = [d for d in dims if d != 1]
    if len(wide) != len(axes) or sum(entries[k] == -1 for k in wide) > 1:
        return None  # (one -1 is the one extent the others leave: exact where they are the axes' own)
    known = {"h": hidden, "t": steps}
    for k, d in zip(wide, axes):
        x = entries[k]
        if x in (d, -1) or x == known.get(d):
            continue
        if d == "b" and x == _static_batch(g, v.input[0], dims):
            continue  # (a number is the batch where that is the input's, fixed: an export at one batch size)
        return None
    return _spread(axes, wide, len(entries))


def _transpose_perm(v: NodeProto, rank: int) -> list[int] | None:
    """Transpose ``v``'s permutation of a rank-``rank`` input (none given: the axes reversed), None where it is
    no permutation of that rank."""
    perm = attr(v, "perm", None) or list(range(rank))[::-1]
    return perm if sorted(perm) == list(range(rank)) else None


def _spread(axes: list, at: list[int], rank: int) -> list:
    """``axes`` placed at the positions ``at`` of a rank-``rank`` list of units."""
    out: list = [1] * rank
    for k, d in zip(at, axes):
        out[k] = d
    return out


def _static_batch(g: Graph, name: str, dims: list) -> int | None:
    """The batch extent of ``name`` (its axes ``dims``) where it is a number."""
    axes = [k for k, d in enumerate(dims) if d == "b"]
    return settled_dim(g, name, axes[0]) if len(axes) == 1 else None


def _shape_entries(g: Graph, v: NodeProto, dims: list) -> list | None:
    """The entries of Reshape ``v``'s computed shape as numbers, or "b" where one is its input's batch extent
    (read as size terms, :mod:`rnnfuse.index_terms`); None where another is not known."""
    ts = terms(g, v.input[1])
    batch_axes = [k for k, d in enumerate(dims) if d == "b"]
    if ts is None or len(batch_axes) != 1:
        return None
    batch = length_term(g, v.input[0], batch_axes[0])
    out = []
    for t in ts:
        if t[0] == "c":
            out.append(int(t[1]))
        elif t == batch:
            out.append("b")
        else:
            return None
    return out


def _native_y(g: Graph, y: str) -> bool:
    """Whether ``y`` is a one-direction, sequence-first native op's ``Y`` ([T, 1, B, H])."""
    p = g.producer.get(y)
    return (p is not None and p.op_type in _NATIVE and p.domain in ("", "ai.onnx") and p.output[0] == y
            and attr(p, "direction", "forward") != "bidirectional" and not attr(p, "layout", 0))


class _Map:
    """One step's copy of the map: its nodes in evaluation order, the steps it reads, and a signature that is the
    same for every copy of the same map (which steps each copy reads: :func:`_step_runs`)."""

    def __init__(self, g: Graph, out: str, item: int, splits: dict):
        self.g, self.item, self.splits = g, item, splits
        self.nodes: list[NodeProto] = []
        self._index: dict[int, int] = {}  # node id -> its place in ``nodes``
        self.steps: dict[str, tuple[str, int]] = {}  # tensor -> (sequence, its step), in the order read
        self.consts: dict[str, np.ndarray] = {}
        self.refs: dict[str, tuple] = {}
        self.signature = (self._ref(out, set()), tuple(self._node_key(n) for n in self.nodes))

    def _ref(self, name: str, walking: set) -> tuple:
        if name in self.refs:
            return self.refs[name]
        g = self.g
        step = _step_of(g, name, self.splits)
        c = g.const(name) if step is None else None
        if step is not None:  # (which step is read where: the same place in every copy; its step per copy,
            self.steps[name] = step  # forward or backward with the item, _step_runs)
            ref = ("step", step[0], step[2:], len(self.steps) - 1)  # (step[2:]: an input's time axis)
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


def _stacked_map(g: Graph, cat: NodeProto, splits: dict) -> tuple[_Map, int, int] | None:
    """``(the first step's map, the stacking axis, the number of steps)`` when every input of ``cat`` stacks
    the same row-wise map of the steps of native ops' sequences; None when it is not such a stack."""
    axis = attr(cat, "axis", 0)
    axis = axis + 3 if axis < 0 else axis  # (the stacked items are [B, K] rows: the stack is rank 3)
    if axis not in (0, 1) or len(cat.input) < 2:
        return None
    items = [_unsqueezed(g, i, axis) for i in cat.input]
    if None in items:
        return None
    # (a copy unlike the first ends the look: 6,660 copies were walked before the first was compared)
    try:
        first = _Map(g, items[0], 0, splits)
        if not any(len(step) == 2 for step in first.steps.values()):
            return None  # (a map of a model input's steps alone is no recurrence's: left as it is)
        maps = [first]
        for k in range(1, len(items)):
            m = _Map(g, items[k], k, splits)
            if m.signature != first.signature:
                return None
            maps.append(m)
    except Decline:
        return None
    # (each item's rank asked only now: a Concat of Unsqueezed scalars, a shape's assembly in every block of a
    # dynamic-shape transformer, inferred a cone per item to learn it was not rank 2)
    runs = _step_runs(maps)
    if runs is None or any(known_rank(g, item) != 2 for item in items):
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
    return first, axis, len(items), runs


def _stacked_parts(g: Graph, cat: NodeProto, splits: dict) -> tuple[str, int, list[int], int, list[int]] | None:
    """``(Y, first step, each part's steps, +1 or -1, perm)`` when ``cat`` concatenates on time consecutive
    parts of ``Split(Y)`` in order, each viewed as ``[steps, B, H]`` or a transpose of it, the same for all
    (dynamo without its optimizer transposes and reshapes each call's Y before ``torch.cat(ys)``, then to
    batch-first ``[B, steps, H]`` for a batch-first layer), or one-step parts last first (-1): a stretch of Y,
    transposed by ``perm``."""
    axis = attr(cat, "axis", 0)
    if not -3 <= axis < 3 or len(cat.input) < 2:
        return None
    parts, layout = [], None
    for i in cat.input:
        found = _part_layout(g, i, splits)
        if found is None or (parts and (found[0] != parts[0][0] or found[4] != layout)):
            return None
        parts.append(found)
        layout = found[4]
    if layout[axis % 3] != "t":
        return None
    y, first, lengths = parts[0][0], parts[0][1], [p[2] for p in parts]
    perm = [("t", "b", "h").index(d) for d in layout]
    if all(p[1] == q[1] + q[2] for q, p in zip(parts, parts[1:])):
        return y, first, lengths, 1, perm
    if all(n == 1 for n in lengths) and all(p[1] == q[1] - 1 for q, p in zip(parts, parts[1:])):
        return y, first, lengths, -1, perm
    return None


def _part_layout(g: Graph, name: str, splits: dict) -> tuple | None:
    """``(Y, first step, steps, axes, layout)`` when ``name`` is a part of ``Split(Y)`` viewed (_viewed_part),
    or a Transpose of such a view, as three axes: time (a one-step part's one unit axis), batch and hidden in
    the order ``layout`` gives (a Transpose that moves the steps of a longer part past the batch is no view of
    rows, but stacked on time it is the transpose of the stacked parts)."""
    found = _viewed_part(g, name, splits)
    perm = list(range(3))
    if found is None:
        p = g.producer.get(name)
        if p is None or p.op_type != "Transpose" or p.domain not in ("", "ai.onnx"):
            return None
        perm = _transpose_perm(p, 3)
        found = _viewed_part(g, p.input[0], splits) if perm is not None else None
        if found is None:
            return None
    dims = ["t" if d == ("t" if found[2] > 1 else 1) else d for d in found[3]]
    if len(dims) != 3 or sorted(map(str, dims)) != ["b", "h", "t"]:
        return None
    return (*found, [dims[k] for k in perm])


def _stretch(g: Graph, cat: NodeProto, y: str, first: int, steps: int, direction: int, perm: list[int]) -> str:
    """``steps`` steps of the native op's Y from ``first`` on (back from it: ``direction`` -1), its direction
    axis squeezed, transposed by ``perm``."""
    b = Builder(g, cat, "rnnfuse/step_maps")
    out = _run(b, b.squeeze(y, [1]), first, steps, direction, settled_dim(g, y, 0))
    return out if perm == [0, 1, 2] else b.op("Transpose", out, perm=perm)


def _run(b: Builder, seq: str, start: int, n_steps: int, direction: int, length: int | None) -> str:
    """Rows ``start``, ``start + direction``, ... of ``seq``, ``n_steps`` of them (``length``: seq's own number
    of rows where known: all of them in order is seq itself)."""
    if direction < 0:  # (rows start, start - 1, ...: a slice with step -1; past row 0 when it ends there)
        end = start - n_steps if start - n_steps >= 0 else -(2**62)
        return b.op("Slice", seq, b.i64(start), b.i64(end), b.i64(0), b.i64(-1))
    if not start and length == n_steps:
        return seq
    return b.op("Slice", seq, b.i64(start), b.i64(start + n_steps), b.i64(0))


def _step_runs(maps: list[_Map]) -> list[tuple[int, int]] | None:
    """For each step the maps read (in the order read): ``(first step, +1 or -1)`` when copy k reads step
    ``first + k`` of its sequence, or ``first - k`` (a backward cell's output stacked in the forward order:
    torch's ``cat([hf[t], hb[T - 1 - t]])``); None when a read follows neither."""
    runs = []
    reads = [list(m.steps.values()) for m in maps]
    for k, (_, start, *_) in enumerate(reads[0]):
        steps = [r[k][1] for r in reads]
        if all(t == start + j for j, t in enumerate(steps)):
            runs.append((start, 1))
        elif all(t == start - j for j, t in enumerate(steps)):
            runs.append((start, -1))
        else:
            return None
    return runs


def _emit(g: Graph, cat: NodeProto, m: _Map, axis: int, n_steps: int, runs: list[tuple[int, int]]) -> str:
    """The map applied once to the steps each read runs over (``runs``: from a first step, forward or
    backward, ``n_steps`` of them) of the sequence it reads, stacked on ``axis``."""
    b = Builder(g, cat, "rnnfuse/step_maps")
    env: dict[str, str] = {}
    like = None
    for (name, (seq, _, *time_axis)), (start, direction) in zip(m.steps.items(), runs):
        if _native_y(g, seq):  # (a native op's own Y, [T, 1, B, H]: its direction axis squeezed first)
            seq = b.squeeze(seq, [1])
        shape = g.model.shape(seq)
        if time_axis == [1]:  # (a batch-first input: its steps first)
            seq, shape = b.op("Transpose", seq, perm=[1, 0, 2]), shape and [shape[1], shape[0], shape[2]]
        part = _run(b, seq, start, n_steps, direction, shape[0] if shape else None)
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
        big = len(g.nodes) > rewrite.WHOLE_MODEL_LIMIT  # (validated whole, else on its first copies)
        splits: dict = {}  # (see _step_of)
        for cat in g.nodes_of("Concat"):
            parts = _stacked_parts(g, cat, splits)
            if parts is not None:
                y, first, lengths, direction, perm = parts
                last = first + direction * (sum(lengths) - 1)
                f = Finding(self.name, "stacked steps", cat.name or cat.output[0], "merged",
                            cell=f"{len(cat.input)} views of steps {first}..{last} -> one slice")
                rw = Rewrite(f, {cat.output[0]: _stretch(g, cat, y, first, sum(lengths), direction, perm)})
                if big and len(cat.input) > PREFIX_COPIES:  # (the first views stacked, as a map's copies)
                    stack = Builder(g, cat, "rnnfuse/step_maps_check").op("Concat", *cat.input[:PREFIX_COPIES],
                                                                          axis=attr(cat, "axis", 0))
                    rw.proxy = {stack: _stretch(g, cat, y, first, sum(lengths[:PREFIX_COPIES]), direction, perm)}
                    rw.proxy_how = f"the first {PREFIX_COPIES} views stacked"
                rewrites.append(rw)
                continue
            found = _stacked_map(g, cat, splits)
            if found is None:
                continue
            m, axis, n_steps, runs = found
            new = _emit(g, cat, m, axis, n_steps, runs)
            ops = "+".join(n.op_type for n in m.nodes)
            f = Finding(self.name, "stacked steps", cat.name or cat.output[0], "merged",
                        cell=f"{n_steps} per-step {ops} -> one over the sequence" if ops else f"{n_steps} steps -> one slice")
            rw = Rewrite(f, {cat.output[0]: new})
            if big and n_steps > PREFIX_COPIES:
                rw.proxy = _prefix_check(g, cat, m, axis, runs)
                rw.proxy_how = f"the first {PREFIX_COPIES} copies stacked"
            rewrites.append(rw)
        apply_rewrites(g, ctx, rewrites, res)  # (and the prefix checks' nodes, never connected, pruned)
        return res


# the copies of a map a big model's check stacks (_prefix_check)
PREFIX_COPIES = 4


def _prefix_check(g: Graph, cat: NodeProto, m: _Map, axis: int, runs: list[tuple[int, int]]) -> dict[str, str]:
    """What a big model validates in place of a stack: the stack of the first ``PREFIX_COPIES`` copies
    (a Concat of theirs, added beside) against the map applied once to their steps. Every other copy is the
    same map (its signature) on the step after the one before (``runs``), each op proven row-wise; what a
    prefix does not see is proven so. 6,660 copies validated whole were a 33,000-node check model."""
    b = Builder(g, cat, "rnnfuse/step_maps_check")
    first = b.op("Concat", *cat.input[:PREFIX_COPIES], axis=attr(cat, "axis", 0))
    return {first: _emit(g, cat, m, axis, PREFIX_COPIES, runs)}
