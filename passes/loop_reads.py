"""How a Loop body walks time: which body reads take element i of an invariant tensor along one axis, and
the proof that the loop runs exactly once per time step.

The index arithmetic is read symbolically (:mod:`rnnfuse.index_terms`), so any exporter's spelling of "the
iteration number", "T - 1 - i" or "[i, i + 1) on axis a" is recognised, not one graph's node order.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper

from rnnfuse import op_args
from rnnfuse.dataflow import rank_of
from rnnfuse.dims import condition_bounds, dim_key, extent_key, root_dim, time_dim_key, time_keys, value_source
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.index_terms import TO_THE_END, one_element, terms
from rnnfuse.time_flips import time_flip_source


def invariant_source(body: Graph, name: str, invariants: dict[str, str]) -> str | None:
    """The outer tensor a body value is, when it is the same in every iteration, else None.

    Either an outer-scope capture, or a loop-carried value the body passes on unchanged (jax2onnx threads
    every closed-over weight and the scanned sequence itself through the Loop that way), seen through
    Identity nodes: both are loop invariants and read the same."""
    while True:
        if not body.defines(name):
            return name
        if name in invariants:
            return invariants[name]
        n = body.producer.get(name)
        if n is None or n.op_type != "Identity":
            return None
        name = n.input[0]


def counter_step(body: Graph, name: str) -> tuple[str, int] | None:
    """``name`` = ``v + k`` for a constant k -> (v, k); v -> (v, 0); each seen through value-keeping casts."""
    name = value_source(body, name)
    n = body.producer.get(name)
    if n is not None and n.op_type == "Add":
        for a, b in ((0, 1), (1, 0)):
            c = body.const(n.input[b])
            if c is not None and np.asarray(c).size == 1:
                k = np.asarray(c).ravel()[0]
                if k != int(k):  # i + 0.5 is no step count (a float compare against it differs from i's)
                    return None
                return value_source(body, n.input[a]), int(k)
        return None
    return name, 0


def _one_of(ts: list | None, term: tuple) -> bool:
    return ts is not None and len(ts) == 1 and ts[0] == term


def _index_form(g: Graph, body: Graph, idx: str, index_syms: dict[str, int], data: str, axis: int = 0) -> str | None:
    """How a Gather index walks time: ``i`` -> "forward", ``T - 1 - i`` (T = data's size on ``axis``) -> "reverse",
    ``-1 - i`` -> "reverse_end" (from the data's own end, whatever its length)."""
    name = value_source(body, idx)
    if index_syms.get(name) == 0:
        return "forward"
    n = body.producer.get(name)
    if n is not None and n.op_type == "Reshape" and _one_of(terms(body, idx, index_syms), ("i", 0)):
        shape = body.const(n.input[1])
        if shape is not None and np.asarray(shape).size == 0:  # a scalar: jax's Reshape(Where(i < 0, i + T, i), [])
            return "forward"
    if n is None or n.op_type != "Sub":
        return None
    a, b = n.input
    step = counter_step(body, b)
    if step is None or step[0] not in index_syms:
        return None
    k = index_syms[step[0]] + step[1]  # subtracted value is i + k
    ca = body.const(a)
    if ca is not None and np.asarray(ca).size == 1 and int(np.asarray(ca).ravel()[0]) == k - 1:
        return "reverse_end"  # -1 - i: a negative index counts from the end (-1 - i >= -T for every i < T)
    T_keys = _time_size_keys(g, data, axis)
    # a must be T - 1 + k
    an = body.producer.get(value_source(body, a)) if body.scope_of(a) is body else None
    if an is None:
        an = g.producer.get(value_source(g, a))
    if k == 1 and _size_keys(g, dim_key(body, a)) & T_keys:
        return "reverse"
    if an is not None and an.op_type == "Sub":
        c = body.const(an.input[1])
        if c is not None and np.asarray(c).size == 1 and int(np.asarray(c).ravel()[0]) == 1 - k and _size_keys(g, dim_key(body, an.input[0])) & T_keys:
            return "reverse"
    return None


def _size_keys(g: Graph, key) -> set:
    """A size's keys: its own, and for a dimension the model declares with a symbolic name, that name (the
    dims a model names alike are one size: the T of ``Gather(mask, T - 1 - i)`` may be read from x's shape)."""
    out = {key}
    if key is not None and key[0] == "dim":
        t = g.model.known_type(key[1])
        dims = t[1] if t is not None else None
        if dims is not None and 0 <= key[2] < len(dims) and isinstance(dims[key[2]], str):
            out.add(("param", dims[key[2]]))
    return out


def _time_size_keys(g: Graph, name: str, axis: int) -> set:
    """Every key of ``name``'s time extent (:func:`rnnfuse.dims.time_keys`) with the names it is declared by."""
    return set().union(*(_size_keys(g, key) for key in time_keys(g, name, axis)))


def _same_time_length(g: Graph, data: str, axis: int, x: str, x_axis: int) -> bool:
    """Whether ``data``'s extent along ``axis`` is provably x's time length (both seen through their time
    flips): one number, one declared name, or one axis of a tensor both were made from. (A loop reads a longer
    mask's first T rows, or its rows from its own end at ``-1 - i``: a native op would read all of them.)"""
    mine = _size_keys(g, extent_key(g, data, axis)) - {None}
    return bool(mine & _time_size_keys(g, x, x_axis))


def same_time_length(g: Graph, data: str, x: str, axis: int) -> bool:
    """Whether ``data`` and ``x`` provably have one time length along ``axis`` (both seen through their time
    flips)."""
    return _same_time_length(g, _unflipped(g, data, axis), axis, _unflipped(g, x, axis), axis)


def check_step_lengths(g: Graph, others: set, x: str, x_axis: int, read_forms: set) -> None:
    """Decline a tensor of ``others`` the body reads per step (time-major) whose time length may differ from x's:
    one read from its own end (``-1 - i``) unless its length is provably x's; one read from its start when the
    file gives the two lengths apart (two numbers, or two names of graph inputs). (A length the file leaves
    unknown, a mask computed from x, say, is left to validation, as before.) ``read_forms``: how the body's
    step reads index time (see :func:`_index_form`)."""
    from_end = "reverse_end" in read_forms
    x = _unflipped(g, x, x_axis)
    for other in sorted(others):
        data = _unflipped(g, other, 0)
        if not _same_time_length(g, data, 0, x, x_axis) and (from_end or _declared_apart(g, data, 0, x, x_axis)):
            raise Decline(f"'{other}' is read per step but its time length is not provably the input's")


def _declared_apart(g: Graph, a: str, a_axis: int, b: str, b_axis: int) -> bool:
    """Whether the file gives ``a``'s and ``b``'s extents (both seen through their time flips) as two different
    numbers, or as two different names of graph inputs (a name an exporter makes up for an intermediate's
    unknown dim says nothing)."""
    dims = []
    for name, axis in ((a, a_axis), (b, b_axis)):
        shape = g.model.shape(name) or []
        d = shape[axis] if axis < len(shape) else None
        dims.append(d if isinstance(d, int) or (isinstance(d, str) and name in g.input_names) else None)
    return None not in dims and dims[0] != dims[1]


def _unflipped(g: Graph, name: str, axis: int) -> str:
    """``name`` seen through its time flips (a flip keeps the extent: a backward layer's x and mask)."""
    for _ in range(8):
        src = time_flip_source(g, name, axis)
        if src is None:
            break
        name = src
    return name


def step_read(g: Graph, body: Graph, n: NodeProto, index_syms: dict[str, int], invariants: dict[str, str]):
    """If body node ``n`` reads element i (the iteration number) of a loop-invariant tensor along one axis:
    (the outer tensor, the axis, "forward" | "reverse"), else None.

    Recognised reads: ``Gather(D, i, axis=a)`` (tf2onnx, jax2onnx; a = 1 for TorchScript's ``x[:, t]``) and
    ``Squeeze(Slice(D, starts, ends, axes), [a])`` taking ``[i, i + 1)`` on axis a and everything on the
    other axes (jax's ``dynamic_slice`` / ``dynamic_index_in_dim``, strided-slice reads)."""
    if n.op_type == "Gather" and len(n.input) >= 2:
        # TorchScript writes x[:, t] as Gather(Slice(x, 0:INT_MAX on axis 0), t, axis=1)
        data = _full_slice_source(g, body, n.input[0], invariants) or invariant_source(body, n.input[0], invariants)
        perm = None
        if data is None:  # jax's x[:, t] with a traced t: Gather(Transpose(x), t) of a transpose in the body
            data, perm = _transposed_invariant(body, n.input[0], invariants)
        rank = rank_of(g, data) if data is not None else None
        if data is None or rank is None:
            return None
        axis = attr(n, "axis", 0)
        axis = axis + rank if axis < 0 else axis
        if perm is not None:  # element t along the transpose's axis is element t along the source's perm[axis],
            rest = [p for k, p in enumerate(perm) if k != axis]  # the same tensor when the other axes keep order
            if len(perm) != rank or rest != sorted(rest):
                return None
            axis = perm[axis]
        form = _index_form(g, body, n.input[1], index_syms, data, axis)
        return (data, axis, form) if form is not None else None
    if n.op_type != "Squeeze":
        return None
    sl = body.producer.get(n.input[0])
    if sl is None or sl.op_type != "Slice" or len(sl.input) < 3:
        return None
    inner = sl.input[0]
    data = invariant_source(body, inner, invariants)
    rank = rank_of(g, data) if data is not None else None
    if data is None or rank is None:
        return None
    sq_axes = op_args.axes(n, g.model.opset, op_args.const_reader(body, n))
    if sq_axes is None or len(sq_axes) != 1:
        return None
    axis = sq_axes[0]
    axis = axis + rank if axis < 0 else axis
    starts = terms(body, sl.input[1], index_syms)
    ends = terms(body, sl.input[2], index_syms)
    axes = terms(body, sl.input[3], index_syms) if len(sl.input) > 3 and sl.input[3] else [("c", a) for a in range(len(starts or []))]
    steps = terms(body, sl.input[4], index_syms) if len(sl.input) > 4 and sl.input[4] else None
    if starts is None or ends is None or axes is None or len(starts) != len(ends) or len(axes) != len(starts):
        return None
    steps = steps if steps is not None else [("c", 1)] * len(starts)
    if any(a[0] != "c" for a in axes) or len(steps) != len(starts):
        return None
    seen = set()
    for (_, a), st, en, step in zip(axes, starts, ends, steps):
        a = a + rank if a < 0 else a
        seen.add(a)
        if a == axis:
            if st != ("i", 0) or not one_element(en, step):
                return None
        elif not (st == ("c", 0) and step == ("c", 1) and _covers(g, data, inner, a, en)):
            return None
    if axis not in seen:
        return None
    return data, axis, "forward"


def _transposed_invariant(body: Graph, name: str, invariants: dict[str, str]) -> tuple[str | None, list | None]:
    """``name`` = Transpose(D, perm) computed in the body from a loop invariant D: (D's outer tensor, perm)."""
    n = body.producer.get(name)
    if n is None or n.op_type != "Transpose":
        return None, None
    src = invariant_source(body, n.input[0], invariants)
    perm = attr(n, "perm")
    return (src, list(perm)) if src is not None and perm is not None else (None, None)


def _covers(g: Graph, data: str, inner: str, axis: int, end) -> bool:
    """Does a slice end ``end`` (an index term) reach the end of ``data`` on ``axis``?"""
    if end[0] == "c":
        d = g.model.shape(data)
        return end[1] >= TO_THE_END or (d is not None and isinstance(d[axis], int) and end[1] >= d[axis])
    if end[0] == "d" and end[2] == 0:
        keys = time_keys(g, data, axis) | {("dim",) + root_dim(g, inner, axis)}
        return end[1] in keys
    return False


def _full_slice_source(g: Graph, body: Graph, name: str, invariants: dict[str, str]) -> str | None:
    """``name`` = Slice(D, 0, INT_MAX) on some axes (a no-op view such as TorchScript's ``x[:]``): D."""
    scope = body.scope_of(name)
    n = scope.producer.get(name) if scope is not None else None
    if n is None or n.op_type != "Slice" or len(n.input) < 3:
        return None
    args = [terms(body, i) if i else None for i in list(n.input[1:5]) + [""] * (5 - len(n.input))]
    starts, ends, _axes, steps = args
    if starts is None or ends is None or (len(n.input) > 4 and n.input[4] and steps is None):
        return None
    if any(t != ("c", 0) for t in starts) or any(t[0] != "c" or t[1] < 2**31 - 1 for t in ends):
        return None
    if steps is not None and any(t != ("c", 1) for t in steps):
        return None
    src = n.input[0]
    return invariant_source(body, src, invariants) if scope is body else src


def check_trip_count(g: Graph, body: Graph, loop: NodeProto, x: str, index_syms: dict[str, int], axis: int = 0) -> None:
    """Prove the loop runs exactly T iterations (x's size on ``axis``), or Decline.

    ``index_syms`` maps body names holding the iteration number to their offset (0 for the iteration input
    and counters starting at 0)."""
    T_keys = time_keys(g, x, axis)
    T = next((k for k in T_keys if k[0] == "const"), time_dim_key(g, x, axis))
    deltas: list[int] = []
    M = loop.input[0] if loop.input else ""
    if M:
        k = dim_key(g, M)
        if k in T_keys:
            deltas.append(0)
        elif k is not None and k[0] == "const" and (k[1] >= 2**31 - 1 or (T[0] == "const" and k[1] >= T[1])):
            pass  # a bound at least T: the condition decides
        elif k is not None and k[0] == "const":
            raise Decline(f"the loop runs at most {k[1]} iterations, not once per time step")
        else:
            raise Decline("cannot prove the trip count equals the number of time steps")
    for bound in condition_bounds(body, body.output_names[0], true=body.input_names[1]):
        if bound is None:
            raise Decline("the loop condition is not a bound on the iteration number")
        a, b = bound
        cs = counter_step(body, a)
        if cs is None or cs[0] not in index_syms:
            raise Decline("the loop condition compares something other than the iteration number")
        k = index_syms[cs[0]] + cs[1]  # the compared value is i + k
        if dim_key(body, b) not in T_keys:
            raise Decline("the loop condition's bound is not the number of time steps")
        deltas.append(1 - k)
    if not deltas:
        raise Decline("the loop has no bound")
    if min(deltas) != 0:
        raise Decline("the loop does not run exactly once per time step")
    # the first iteration must run whenever T >= 1
    cond0 = loop.input[1] if len(loop.input) > 1 else ""
    for bound in condition_bounds(g, cond0) if cond0 else []:
        if bound is None or dim_key(g, bound[0]) != ("const", 0) or dim_key(g, bound[1]) not in T_keys:
            raise Decline("cannot prove the loop's first iteration runs")


# ---------------------------------------------------------------------------- length masks written by hand


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
        step = counter_step(body, n.input[side])
        if step is None or step[0] not in index_syms:
            continue
        lengths, sign, shift = _lengths_operand(body, n.input[1 - side], invariants)
        if lengths is None or body.defines(lengths):
            return None
        shape = g.model.shape(lengths)
        if shape is None or len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            return None
        if sign < 0 and g.model.elem_type(lengths) not in _SIGNED:  # (the mask negates the lengths as they are)
            return None
        return LengthMask(lengths, n.op_type, index_syms[step[0]] + step[1], side == 0, len(shape) == 2, sign, shift)
    return None


def _lengths_operand(body: Graph, name: str, invariants: dict[str, str]) -> tuple[str | None, int, int | str]:
    """``(L, sign, shift)`` when ``name`` is ``sign * L + shift`` for a loop-invariant tensor L, computed in the
    body (jax's pre-padded ``t >= T - lengths``, TorchScript's ``Neg(lengths) + T``): L itself, ``c - L``,
    ``L + c``, ``L - c``, ``-L + c``, the shift ``c`` a scalar integer constant, or the name of a loop-invariant
    scalar the body adds (x's time length, read outside). ``(None, 1, 0)`` otherwise."""
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


def _shift(body: Graph, name: str, invariants: dict[str, str]) -> int | str | None:
    """A scalar integer constant, or the outer name of a loop-invariant scalar that is no constant; else None."""
    c = body.const(name)
    if c is not None:
        return int(np.ravel(c)[0]) if np.size(c) == 1 and np.asarray(c).dtype.kind in "iu" else None
    outer = invariant_source(body, name, invariants)
    shape = body.model.shape(outer) if outer is not None else None
    scalar = shape is not None and all(isinstance(d, int) for d in shape) and int(np.prod(shape or [1])) == 1
    return outer if scalar else None


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
    ``sign * lengths + shift``."""

    def __init__(self, lengths: str, op: str, offset: int, step_first: bool, unit: bool, sign: int = 1, shift: int = 0):
        self.lengths, self.op, self.offset, self.step_first, self.unit = lengths, op, offset, step_first, unit
        self.sign, self.shift = sign, shift

    @property
    def key(self) -> tuple:
        return (self.lengths, self.op, self.offset, self.step_first, self.sign, self.shift)

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
    elif lm.shift:  # (in the lengths' type, as the body adds it)
        shift = np.array(lm.shift, helper.tensor_dtype_to_np_dtype(et or TensorProto.INT64))
        lens = op("Add", lens, g.add_initializer(shift, "rnnfuse/length_mask/shift"))
    shape_t, shape_l = ([1, -1], [-1, 1]) if time_axis == 1 else ([-1, 1], [1, -1])
    t, lens = op("Reshape", t, const(shape_t)), op("Reshape", lens, const(shape_l))
    mask = op(lm.op, t, lens) if lm.step_first else op(lm.op, lens, t)
    xs = g.model.shape(x) or [None, None, None]
    g.model.declare(mask, (TensorProto.BOOL, [xs[0], xs[1]]))  # [T, B] (or [B, T]), as x
    return mask
