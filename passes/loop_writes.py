"""A carried buffer each step writes at its iteration's slot through index arithmetic: the stacked outputs.

jax2onnx writes ``ys.at[t].set(h)``, ``ys.at[:, t].set(h)`` and ``lax.dynamic_update_slice(ys, h[None], (t, 0,
0))`` in a ``fori_loop`` as one ``ScatterND`` over a full grid of indices, built from t and the shapes (with
jax's wrapping of negative indices, its clamping of starts and a filter of the valid ones); TorchScript's
``outs[t, :, :] = h`` is an ``index_put`` with a ``Range`` per sliced axis, broadcast and concatenated. Each
spelling's index arithmetic is its exporter's; what matters is what the write does, and that is a function of
the iteration number and the shapes alone. So a write is found by its structure and its placement is read by
running it:

- **Structure** (:func:`scattered_write`): the buffer's new value is ``ScatterND(buffer, indices, updates)``
  without reduction; the indices are computed from the iteration number, constants and shapes only; the
  updates are a step value ``y`` moved into place by ops that only move elements (views, broadcasts, gathers
  and slices at such indices); nothing else in the write reads a value. The buffer itself is read by nothing
  but the write (its shape included).
- **Placement** (:func:`write_axis`): the write's nodes, copied into a model of their own, are run for every
  iteration of buffers of several lengths and batch sizes (on both sides of the width and of a fixed length;
  the model's own length and batch where it fixes them), on distinct random values: the write must put ``y``
  at slot i along one axis (0: time-major ``[T, B, H]``, 1: batch-first ``[B, T, H]``) and keep every other
  element. A run shows the sizes it was run at; a slot that changes only at other sizes is kept out by what
  the indices may be computed with: integer moves, comparisons and position arithmetic (no reduction, no cast
  to a narrow type), with no number but 0, +-1 and the extents the file fixes where the length or the batch
  is free (``Min(i, 15)`` is i at every length up to 16). The buffer must be [T, B, H] with x's batch and
  the state's width, and the rewrite's validation runs the whole loop at the model's input sizes.

After a loop that runs once per step of x over a buffer with one slot per step, the buffer holds the per-step
values stacked along that axis: one more per-step output of the step (:mod:`.loop_buffers` reads the simpler
``ScatterND(buf, [[i]], row)`` by its structure alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from rnnfuse.check_session import options
from rnnfuse.dims import extent_key
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.protos import has_subgraph
from .loop_extents import same_extent_along

# ops that only move elements: op -> the positions of the inputs whose elements they move (the others must be
# index values: shapes, axes, positions)
_MOVES = {"Reshape": (0,), "Expand": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Identity": (0,), "Flatten": (0,),
          "Transpose": (0,), "Gather": (0,), "Slice": (0,), "ScatterND": (0, 2), "Concat": None}
_INDEX, _DATA = "index", "data"
# ops whose constant operands are numbers the slot is computed with (not axes or positions in a shape)
_ARITHMETIC = {"Add", "Sub", "Mul", "Div", "Mod", "Min", "Max", "Clip", "Range", "Less", "LessOrEqual", "Greater",
               "GreaterOrEqual", "Equal", "Neg", "Abs", "ReduceProd", "ReduceSum"}
_MAX_SLOTS = 64  # (iterations probed: every one up to this many slots, else this many spread over them)
_PROBE_ELEMENTS = 1 << 20  # (a probe buffer past this many elements is run at batch 1 and 3 only)


@dataclass
class ScatteredWrite:
    """One carried buffer's write, found by :func:`scattered_write`."""

    value: str  # the body tensor written: the step's y
    nodes: list[NodeProto]  # the write's nodes, in evaluation order
    buffer: str  # the body input: the buffer before the write
    out: str  # the write's result (the body output, or what it copies)
    iteration: list[str]  # the body tensors the write reads that are the iteration number
    types: dict[str, int] = field(default_factory=dict)  # element types of its inputs (declared by the body)
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # the values it reads from outside its nodes
    numbers: dict[str, np.ndarray] = field(default_factory=dict)  # constants its index arithmetic computes with
    axis: int | None = None  # the buffer's time axis, once run (write_axis)
    reverse: bool = False  # it writes at slot T - 1 - i (the per-step values stacked last step first), once run
    hidden: int | None = None  # the width of what it writes, once run


def scattered_write(body: Graph, buf_in: str, buf_out: str, iteration: set[str]) -> ScatteredWrite | None:
    """The write of carried buffer ``buf_in`` when ``buf_out`` is one ScatterND of it as the module doc says;
    None when ``buf_out`` is no ScatterND of ``buf_in``; Decline when it is one but not such a write.
    ``iteration``: body tensors equal to the iteration number."""
    out = buf_out
    s = body.producer.get(out)
    while s is not None and s.op_type == "Identity" and len(body.uses(out)) == 0:
        out = s.input[0]
        s = body.producer.get(out)
    if s is None or s.op_type != "ScatterND" or s.input[0] != buf_in or len(s.input) < 3:
        return None
    why = "a carried buffer updated by a ScatterND that is no write of a step's value at slots the iteration " \
          "number and the shapes alone choose"
    if attr(s, "reduction", "none") not in ("none", b"none") or (body.uses(out) and out != buf_out):
        raise Decline(why)
    y = _written_value(body, s.input[2])
    if y is None or y == buf_in:
        raise Decline(why)
    kinds: dict[str, str | None] = {buf_in: _DATA, y: _DATA, **{i: _INDEX for i in iteration}}
    nodes: list[NodeProto] = []
    consts: dict[str, np.ndarray] = {}
    if _kind(body, s.output[0], kinds, nodes, consts) != _DATA or kinds.get(s.input[1]) != _INDEX:
        raise Decline(why)
    inside = {id(n) for n in nodes}
    if any(id(u) not in inside for u in body.uses(buf_in)):  # (the buffer is read for the write only)
        raise Decline("an output buffer read inside the step")
    read_iteration = [i for i in iteration if i in {x for n in nodes for x in n.input}]
    declared = {i.name: i.type.tensor_type.elem_type for i in body.proto.input if i.type.HasField("tensor_type")}
    types = {i: declared.get(i) or TensorProto.INT64 for i in read_iteration}
    types[buf_in] = declared.get(buf_in) or TensorProto.FLOAT
    numbers = {i: np.asarray(body.const(i)) for n in nodes if n.op_type in _ARITHMETIC for i in n.input
               if i and body.const(i) is not None}
    return ScatteredWrite(y, nodes, buf_in, s.output[0], read_iteration, types, consts, numbers)


def _written_value(body: Graph, upd: str) -> str | None:
    """The step value the updates move into place: back through element-moving ops from ``upd`` to the first
    tensor the step also uses elsewhere than for its shape (or computes otherwise)."""
    cur = upd
    for _ in range(32):
        p = body.producer.get(cur)
        if p is None or p.op_type not in _MOVES or p.op_type in ("ScatterND", "Concat") or not p.input:
            return cur
        d = p.input[0]
        if body.is_graph_output(d) or sum(u.op_type not in ("Shape", "Size") for u in body.uses(d)) != 1:
            return d
        cur = d
    return None


def _kind(body: Graph, name: str, kinds: dict, nodes: list, consts: dict) -> str | None:
    """What ``name`` is computed from: ``"index"`` (the iteration number, constants, shapes), ``"data"`` (the
    buffer's or y's elements, only moved), or None (anything else: the write is not one). Appends the nodes
    it walks to ``nodes`` in evaluation order, and the constants they read from outside to ``consts``."""
    stack = [name]
    while stack:
        cur = stack[-1]
        if cur in kinds:
            stack.pop()
            continue
        p = body.producer.get(cur)
        if p is None:
            value = body.const(cur)
            kinds[cur] = _INDEX if value is not None else None
            if value is not None:
                consts[cur] = np.asarray(value)
            stack.pop()
            continue
        if has_subgraph(p) or (not p.input and p.op_type != "Constant"):
            kinds[cur] = None
            stack.pop()
            continue
        pending = [i for i in p.input if i and i not in kinds]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        for o in p.output:
            kinds[o] = _node_kind(p, kinds)
        nodes.append(p)
    return kinds.get(name)


# what index arithmetic may use: moving and comparing integers, the arithmetic of positions; no reduction, no
# cast to a narrow type (Cast(i, INT8) is i for 128 steps, then wraps), nothing a run at a few sizes would not show
_INDEX_OPS = {"Shape", "Size", "Constant", "ConstantOfShape", "Identity", "Reshape", "Expand", "Unsqueeze", "Squeeze",
              "Concat", "Gather", "Slice", "Transpose", "Flatten", "Range", "NonZero", "Where", "And", "Or", "Not",
              "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Min", "Max", "Less", "LessOrEqual", "Greater",
              "GreaterOrEqual", "Equal", "Cast", "ReduceProd", "ReduceSum"}
_INDEX_CASTS = {TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL}


def _node_kind(p: NodeProto, kinds: dict) -> str | None:
    ins = [kinds.get(i) if i else _INDEX for i in p.input]
    if None in ins:
        return None
    if p.op_type in ("Shape", "Size"):
        return _INDEX
    if all(k == _INDEX for k in ins):
        if p.op_type not in _INDEX_OPS or (p.op_type == "Cast" and attr(p, "to") not in _INDEX_CASTS):
            return None
        return _INDEX
    moved = _MOVES.get(p.op_type, ())
    if moved is None:  # (Concat: every input moved)
        return _DATA
    if all((k == _DATA) <= (j in moved) for j, k in enumerate(ins)):
        return _DATA
    return None


def write_axis(g: Graph, w: ScatteredWrite, hidden: int, batch: int | None, trip: int | None) -> int:
    """The axis along which ``w`` writes y ([B, ``hidden``]) at the iteration's slot, found by running it (see
    the module doc); Decline when it is no such write. ``batch``: the batch size the model fixes, if any;
    ``trip``: the loop's constant trip count, if any."""
    if w.axis is not None:
        return w.axis
    from rnnfuse.validate import ort_module

    ort = ort_module()
    try:
        sess = ort.InferenceSession(_write_model(g, w).SerializeToString(), options(ort),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # (a write onnxruntime cannot load alone: no placement to read)
        raise Decline(f"an output buffer's write could not be run alone ({str(e).splitlines()[0][:120]})")
    rng = np.random.default_rng(0)
    sizes = {hidden} | ({trip} if trip else set())  # (the extents the file fixes: jax2onnx computes with them)
    if trip:  # (T - 1 - i for a fixed T: jax's ys.at[T - 1 - t])
        sizes.add(trip - 1)
    if not (trip and batch) and _fixed_numbers(w, {0, 1, -1} | sizes | {-n for n in sizes}):
        raise Decline("an output buffer written at slots computed with numbers of its own (the loop's length or "
                      "batch is not fixed: where the write goes at other sizes is not what a run at a few shows)")
    # (sizes on both sides of each other, of the width and of a fixed length: a slot clamped at one of them
    # shows; the larger ones only while a buffer stays small, a few MB: a 6,000-step loop is run at batch 1, 3)
    batches = [batch] if batch else sorted({1, 3, hidden + 2} | ({trip + 2, trip + hidden + 2} if trip else set()))
    lengths = [trip] if trip else [3, 5, hidden + max(batches) + 3]
    sizes = [(b, t) for b in batches for t in lengths if b * t * hidden <= _PROBE_ELEMENTS or b in (1, 3, batch)]
    found = [(a, False) for a in (0, 1) if _places(sess, w, a, hidden, sizes, rng)]
    if not found:  # (the values stacked last step first: read flipped, as a backward layer's are)
        found = [(a, True) for a in (0, 1) if _places(sess, w, a, hidden, sizes, rng, reverse=True)]
    if len(found) != 1:
        raise Decline("an output buffer written by index arithmetic that does not put the step's value at the "
                      "iteration's slot (or at its slot counted from the end)")
    (w.axis, w.reverse), w.hidden = found[0], hidden
    return w.axis


def check_buffer_rows(g: Graph, init: str, w: ScatteredWrite, x: str, x_axis: int) -> None:
    """Decline unless the buffer ``init`` is [T, B, H] (or [B, T, H]) with x's batch size and the written value's
    width: a grid write may fill part of a wider or longer-batched buffer, whose rest no native output holds
    (the placement was read at buffers exactly y's size)."""
    if g.model.rank(init) != 3 or extent_key(g, init, 2) != ("const", w.hidden):
        raise Decline("an output buffer written by index arithmetic whose width is not provably the state's")
    if not same_extent_along(g, init, 1 - w.axis, x, 1 - x_axis):
        raise Decline("an output buffer written by index arithmetic whose batch size is not provably the input's")


def _fixed_numbers(w: ScatteredWrite, allowed: set) -> list:
    """The numbers the write's index arithmetic uses that are not ``allowed`` and no slice bound to the end: a
    slot clamped at 15 (``Min(i, 15)``) is i for every length a run at a few short ones shows, and not after.
    Exporters build their grids from the iteration number and the shapes, with 0, 1 and -1 alone (and a fixed
    length: jax wraps a negative index by adding it)."""
    big = 2**31 - 1
    odd = []
    for name, value in w.numbers.items():
        arr = np.asarray(value)
        if arr.dtype.kind not in "iuf":
            continue
        if any(v not in allowed and abs(v) < big for v in arr.ravel().tolist()):
            odd.append(name)
    return odd


def _places(sess, w: ScatteredWrite, axis: int, hidden: int, sizes, rng, reverse: bool = False) -> bool:
    """Whether every run (``sizes``: (batch, length) pairs) puts y at slot i along ``axis`` (``reverse``: at
    slot T - 1 - i) and keeps the rest of the buffer."""
    dtype = helper.tensor_dtype_to_np_dtype(w.types[w.buffer])
    for b, t in sizes:
        steps = range(t) if t <= _MAX_SLOTS else np.unique(np.linspace(0, t - 1, _MAX_SLOTS).astype(int))
        for i in steps:
            buf = rng.standard_normal((t, b, hidden) if axis == 0 else (b, t, hidden)).astype(dtype)
            y = (rng.standard_normal((b, hidden)) + 10.0).astype(dtype)  # (apart from every buffer value)
            feeds = {w.buffer: buf, w.value: y}
            for name in w.iteration:
                feeds[name] = np.array(i, dtype=helper.tensor_dtype_to_np_dtype(w.types[name]))
            try:
                (got,) = sess.run([w.out], feeds)
            except Exception:
                return False
            want = buf.copy()
            np.moveaxis(want, axis, 0)[t - 1 - i if reverse else i] = y
            if got.shape != want.shape or not np.array_equal(got, want):
                return False
    return True


def _write_model(g: Graph, w: ScatteredWrite) -> onnx.ModelProto:
    """The write's nodes as a model: the buffer, y and the iteration number as inputs, constants inlined."""
    inits = [numpy_helper.from_array(v, name) for name, v in w.consts.items()]
    et = w.types[w.buffer]
    inputs = [helper.make_tensor_value_info(w.buffer, et, None), helper.make_tensor_value_info(w.value, et, None)]
    inputs += [helper.make_tensor_value_info(i, w.types[i], []) for i in w.iteration]
    graph = helper.make_graph(list(w.nodes), "rnnfuse_write_probe", inputs,
                              [helper.make_tensor_value_info(w.out, et, None)], inits)
    m = helper.make_model(graph, opset_imports=list(g.model.proto.opset_import))
    m.ir_version = g.model.proto.ir_version
    return m
