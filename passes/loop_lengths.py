"""Length masks a Loop body writes by hand: the iteration number compared with per-row lengths (``t < lengths``,
jax's pre-padded ``t >= T - lengths``, TorchScript's ``Neg(lengths) + T``), and the whole [T, B] mask built
with the same comparison before the native op; also a scanned ``arange`` read as the iteration number."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper

from rnnfuse.dims import dim_key, value_source
from rnnfuse.graph import Graph, attr
from .loop_reads import counter_step, counts_down, invariant_source


def counting_offset(g: Graph, data: str) -> int | None:
    """``s`` when the 1-D integer tensor ``data`` is ``s, s + 1, s + 2, ...`` (a constant, or ``Range(s, n, 1)``):
    element i of it is the iteration number plus s (jax scans ``(xs, arange(T))`` to see t). Else None."""
    et = g.model.elem_type(data)
    if et not in (TensorProto.INT32, TensorProto.INT64):
        return None
    c = g.const(data)
    if c is not None:
        arr = np.asarray(c)
        if arr.ndim != 1 or arr.size == 0 or not np.array_equal(arr, arr[0] + np.arange(arr.size)):
            return None
        return int(arr[0])
    n = g.producer.get(data)
    if n is None or n.op_type != "Range":
        return None
    start, delta = g.const(n.input[0]), g.const(n.input[2])
    if start is None or delta is None or np.size(start) != 1 or int(np.ravel(delta)[0]) != 1:
        return None
    return int(np.ravel(start)[0])


_COMPARE = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
_SIGNED = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}


def length_mask(g: Graph, body: Graph, n: NodeProto, index_syms: dict[str, int], invariants: dict[str, str]):
    """If body node ``n`` compares the iteration number with a loop-invariant tensor of per-row lengths
    (``t < lengths``, ``lengths > t``, ``t + 1 <= lengths``, ...): ``LengthMask``, else None.

    Such a comparison is the step's mask: which of the B rows are valid at step t. It is the same at step t
    whatever the state, so the whole [T, B] mask can be computed before the native op with the same
    comparison (:func:`build_length_mask`)."""
    if n.op_type not in _COMPARE or len(n.input) != 2:
        return None
    for side in (0, 1):
        step = counter_step(body, n.input[side], invariants)
        time_index = None
        if step is None or step[0] not in index_syms:
            if not counts_down(body, n.input[side], index_syms):
                continue
            # (``t = T - 1 - i``, compared as the time index of a step read backwards: proven T - 1 - i once
            # x, and so T, is known; the mask is then op(t, lengths) in time order)
            time_index, step = n.input[side], None
        lengths, sign, shift = _lengths_operand(body, n.input[1 - side], invariants)
        if lengths is None or body.defines(lengths):
            return None
        shape = g.model.shape(lengths)
        if shape is None or len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            return None
        if sign < 0 and g.model.elem_type(lengths) not in _SIGNED:  # (the mask negates the lengths as they are)
            return None
        offset = 0 if step is None else index_syms[step[0]] + step[1]
        return LengthMask(lengths, n.op_type, offset, side == 0, len(shape) == 2, sign, shift, time_index)
    return None


def _lengths_operand(body: Graph, name: str, invariants: dict[str, str]) -> tuple[str | None, int, int | str]:
    """``(L, sign, shift)`` when ``name`` is ``sign * L + shift`` for a loop-invariant tensor L, computed in the
    body (jax's pre-padded ``t >= T - lengths``, TorchScript's ``Neg(lengths) + T``): L itself, ``c - L``,
    ``L + c``, ``L - c``, ``-L + c``, the shift ``c`` a scalar integer constant, or the name of a loop-invariant
    scalar the body adds (x's time length, read outside). ``(None, 1, 0)`` otherwise."""
    name = _integer_source(body, name)
    outer = invariant_source(body, name, invariants)
    if outer is not None:
        return outer, 1, 0
    n = body.producer.get(name)
    if n is None or n.op_type not in ("Add", "Sub") or len(n.input) != 2:
        return None, 1, 0
    for k in (0, 1):
        c = _shift(body, n.input[k], invariants)
        v, sign = _signed_invariant(body, n.input[1 - k], invariants)
        if c is None or v is None:
            continue
        if n.op_type == "Add":
            return v, sign, c
        if k == 0:  # c - (sign * L)
            return v, -sign, c
        if isinstance(c, int):  # (sign * L) - c
            return v, sign, -c
    return None, 1, 0


def _integer_source(body: Graph, name: str) -> str:
    """``name`` seen through the casts of an integer tensor to a type that holds each of its values (tf2onnx
    compares ``float(lengths) > float(t)``): the comparison reads the same on the integers. (To float: rounding
    keeps the order against any t below 2**24, which every step count is; int64 to int32 wraps: not seen
    through.)"""
    return value_source(body, name, lambda n: n.op_type == "Cast"
                        and _widens(body.model.elem_type(n.input[0]), attr(n, "to")))


_BITS = {TensorProto.INT8: 8, TensorProto.INT16: 16, TensorProto.INT32: 32, TensorProto.INT64: 64}


def _widens(src: int | None, to: int | None) -> bool:
    """Whether a cast from the signed integer type ``src`` to ``to`` keeps every value's order (a wider signed
    integer, or a float type)."""
    if src not in _BITS:
        return False
    return to in (TensorProto.FLOAT, TensorProto.DOUBLE) or (to in _BITS and _BITS[to] >= _BITS[src])


def _shift(body: Graph, name: str, invariants: dict[str, str]) -> int | str | tuple | None:
    """A scalar integer constant, the outer name of a loop-invariant scalar that is no constant, or ``("dim",
    D, k)``: an outer tensor D's extent on axis k, which the body reads itself (jax2onnx's ``T - lengths`` with
    T from the scanned tensor's shape); else None."""
    c = body.const(name)
    if c is not None:
        return int(np.ravel(c)[0]) if np.size(c) == 1 and np.asarray(c).dtype.kind in "iu" else None
    outer = invariant_source(body, name, invariants)
    shape = body.model.shape(outer) if outer is not None else None
    scalar = shape is not None and all(isinstance(d, int) for d in shape) and int(np.prod(shape or [1])) == 1
    return outer if scalar else _outer_extent(body, name)


def _outer_extent(body: Graph, name: str) -> tuple | None:
    """``("dim", D, k)`` when ``name`` holds the extent of axis k of a tensor D of an enclosing scope (read as
    :func:`rnnfuse.dims.dim_key` reads a size: ``Gather(Shape(D), k)`` and its spellings, through the ops that
    keep the value); else None."""
    key = dim_key(body, name)
    if key is None or key[0] != "dim":
        return None
    src = key[1]
    return None if body.defines(src) or body.scope_of(src) is None else key


def _signed_invariant(body: Graph, name: str, invariants: dict[str, str]) -> tuple[str | None, int]:
    """``(L, 1)`` for a loop-invariant L, ``(L, -1)`` for ``Neg(L)``; else ``(None, 1)``."""
    outer = invariant_source(body, name, invariants)
    if outer is not None:
        return outer, 1
    n = body.producer.get(name)
    if n is not None and n.op_type == "Neg":
        outer = invariant_source(body, n.input[0], invariants)
        if outer is not None:
            return outer, -1
    return None, 1


class LengthMask:
    """mask[t, b] = ``op(t + offset, L[b])`` (``step_first``) or ``op(L[b], t + offset)``, where L is
    ``sign * lengths + shift``. t is the iteration number, or with ``time_index`` (the body value compared, the
    step's ``T - 1 - i``) the time step a loop that reads time backwards is at."""

    def __init__(self, lengths: str, op: str, offset: int, step_first: bool, unit: bool, sign: int = 1, shift: int = 0,
                 time_index: str | None = None):
        self.lengths, self.op, self.offset, self.step_first, self.unit = lengths, op, offset, step_first, unit
        self.sign, self.shift, self.time_index = sign, shift, time_index

    @property
    def key(self) -> tuple:
        return (self.lengths, self.op, self.offset, self.step_first, self.sign, self.shift, self.time_index)

    def build(self, g: Graph, x: str, time_axis: int, anchor: NodeProto) -> str:
        """The mask laid out like ``x`` (built once per layout: every layer of a stacked step keeps to it)."""
        built = self.__dict__.setdefault("_built", {})
        if time_axis not in built:
            built[time_axis] = build_length_mask(g, self, x, time_axis, anchor)
        return built[time_axis]

    @property
    def valid_first(self) -> bool:
        """Whether every row's valid steps come first (t below a bound): the mask is post-padded by construction."""
        below = self.op in ("Less", "LessOrEqual")
        return below if self.step_first else not below


def build_length_mask(g: Graph, lm: LengthMask, x: str, time_axis: int, anchor: NodeProto) -> str:
    """The [T, B] bool mask (``[B, T]`` when ``time_axis`` is 1, like x) that ``lm`` computes step by step,
    T being x's time length (the loop runs once per step of x). Needs opset 11 (Range)."""

    def op(op_type, *ins, **attrs):
        return g.add_node(op_type, list(ins), name=f"rnnfuse/length_mask/{op_type}", anchor=anchor, **attrs)[0]

    def const(v, dtype=np.int64):
        return g.add_initializer(np.array(v, dtype), "rnnfuse/length_mask/const")

    T = op("Gather", op("Shape", x), const(time_axis), axis=0)
    t = op("Range", const(lm.offset), op("Add", T, const(lm.offset)), const(1))  # t + offset, t = 0 .. T-1
    et = g.model.elem_type(lm.lengths)
    if et is not None and et != TensorProto.INT64:  # compare in the lengths' type, as the body does
        t = op("Cast", t, to=et)
    lens = op("Reshape", lm.lengths, const([-1]))
    if lm.sign < 0:
        lens = op("Neg", lens)
    if isinstance(lm.shift, str):  # a scalar the body adds, read as it does (in the lengths' type)
        lens = op("Add", lens, lm.shift)
    elif isinstance(lm.shift, tuple):  # an outer tensor's extent the body reads and adds (in the lengths' type)
        _, src, k = lm.shift
        extent = op("Gather", op("Shape", src), const(k), axis=0)
        lens = op("Add", lens, op("Cast", extent, to=et or TensorProto.INT64))
    elif lm.shift:  # (in the lengths' type, as the body adds it)
        shift = np.array(lm.shift, helper.tensor_dtype_to_np_dtype(et or TensorProto.INT64))
        lens = op("Add", lens, g.add_initializer(shift, "rnnfuse/length_mask/shift"))
    shape_t, shape_l = ([1, -1], [-1, 1]) if time_axis == 1 else ([-1, 1], [1, -1])
    t, lens = op("Reshape", t, const(shape_t)), op("Reshape", lens, const(shape_l))
    mask = op(lm.op, t, lens) if lm.step_first else op(lm.op, lens, t)
    xs = g.model.shape(x) or [None, None, None]
    g.model.declare(mask, (TensorProto.BOOL, [xs[0], xs[1]]))  # [T, B] (or [B, T]), as x
    return mask
