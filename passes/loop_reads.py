"""How a Loop body walks time: which body reads take element i of an invariant tensor along one axis, and
which carried value counts the steps (the proof that the loop runs once per step: :mod:`passes.loop_counts`).

The index arithmetic is read symbolically (:mod:`rnnfuse.index_terms`), so any exporter's spelling of "the
iteration number", "T - 1 - i" or "[i, i + 1) on axis a" is recognised, not one graph's node order. Whether
what a body reads shares x's time length and batch: :mod:`.loop_extents`.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse import op_args
from rnnfuse.dataflow import rank_of
from rnnfuse.dims import dim_key, keeps_value, root_dim, time_keys, unit_chunks, value_source
from rnnfuse.graph import Graph, attr
from rnnfuse.index_terms import TO_THE_END, one_element, past_every_index, terms
from .loop_extents import size_keys, timesize_keys


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


def counter_step(body: Graph, name: str, invariants: dict[str, str] | None = None) -> tuple[str, int] | None:
    """``name`` = ``v + k`` for a constant k -> (v, k); v -> (v, 0); each seen through value-keeping casts. k
    may be a constant the loop carries through unchanged (``invariants``: tf2onnx's autograph ``for t in
    tf.range(n)`` adds ``range/delta`` so)."""
    name = value_source(body, name)
    n = body.producer.get(name)
    if n is not None and n.op_type == "Add":
        for a, b in ((0, 1), (1, 0)):
            k = n.input[b]
            c = body.const(invariants[k] if invariants and k in invariants else k)
            if c is not None and np.asarray(c).size == 1:
                k = np.asarray(c).ravel()[0]
                if k != int(k):  # i + 0.5 is no step count (a float compare against it differs from i's)
                    return None
                return value_source(body, n.input[a]), int(k)
        return None
    return name, 0


def read_offset(body: Graph, idx: str, index_syms: dict[str, int]) -> int | None:
    """s when body value ``idx`` is the scalar ``i + s`` (i the iteration number, s a whole constant), from
    its arithmetic: Add, Sub and Mul of the iteration number (or a counter that follows it) and scalar
    integer constants, seen through value-keeping casts. TorchScript writes ``for t in range(start, T)`` as
    ``start + i * 1``, so ``x[t]`` is read ``start`` steps ahead of the iteration number, and ``x[t - 1]`` of
    ``range(1, T + 1)`` at ``(1 + i * 1) - 1``, i itself. None for any other index (a slope other than 1, a
    constant that is not a scalar: its Gather would keep an axis)."""

    def affine(name: str, depth: int) -> tuple[int, int] | None:  # (a, b): the value is a * i + b
        name = value_source(body, name)
        if name in index_syms:
            return 1, index_syms[name]
        c = body.const(name)
        if c is not None:
            a = np.asarray(c)
            return (0, int(a)) if a.ndim == 0 and a.dtype.kind in "iu" else None
        n = body.producer.get(name)
        if depth > 8 or n is None or n.op_type not in ("Add", "Sub", "Mul") or len(n.input) != 2:
            return None
        x, y = affine(n.input[0], depth + 1), affine(n.input[1], depth + 1)
        if x is None or y is None:
            return None
        if n.op_type == "Add":
            return x[0] + y[0], x[1] + y[1]
        if n.op_type == "Sub":
            return x[0] - y[0], x[1] - y[1]
        if x[0] and y[0]:
            return None  # (i * i)
        return x[0] * y[1] + y[0] * x[1], x[1] * y[1]

    found = affine(idx, 0)
    return found[1] if found is not None and found[0] == 1 else None


def _one_of(ts: list | None, term: tuple) -> bool:
    return ts is not None and len(ts) == 1 and ts[0] == term


def _negated(body: Graph, name: str) -> str | None:
    """v when ``name`` is ``Neg(v)``, ``v * -1`` or ``-1 * v``; else None."""
    n = body.producer.get(name)
    if n is None:
        return None
    if n.op_type == "Neg":
        return n.input[0]
    if n.op_type == "Mul" and len(n.input) == 2:
        for k in (0, 1):
            c = body.const(n.input[k])
            if c is not None and np.size(c) == 1 and float(np.ravel(c)[0]) == -1.0:
                return n.input[1 - k]
    return None


def _index_form(g: Graph, body: Graph, idx: str, index_syms: dict[str, int], data: str, axis: int = 0) -> str | None:
    """How a Gather index walks time: ``i`` -> "forward", ``T - 1 - i`` (T = data's size on ``axis``) -> "reverse",
    ``-1 - i`` -> "reverse_end" (from the data's own end, whatever its length)."""
    idx = _without_wrap_fixup(g, body, idx, data, axis)
    name = value_source(body, idx)
    if index_syms.get(name) == 0:
        return "forward"
    n = body.producer.get(name)
    if n is not None and n.op_type == "Reshape" and _one_of(terms(body, idx, index_syms), ("i", 0)):
        shape = body.const(n.input[1])
        if shape is not None and np.asarray(shape).size == 0:  # a scalar: jax's Reshape(Where(i < 0, i + T, i), [])
            return "forward"
    found = _minus_index(body, n, index_syms)
    if found is None:
        return None
    a, k, shift = found  # the index is a - (i + k) + shift
    T_keys = timesize_keys(g, data, axis)
    ca = body.const(a)
    a_value = int(np.asarray(ca).ravel()[0]) if ca is not None and np.asarray(ca).size == 1 else None
    if a_value is not None and a_value + shift == k - 1:
        return "reverse_end"  # -1 - i: a negative index counts from the end (-1 - i >= -T for every i < T)
    if a_value is not None and ("const", a_value + 1 - k + shift) in T_keys:
        return "reverse"  # T - 1 - i for a static T (jax's x[:, T - 1 - t], T a Python number)
    # a must be T - 1 + k - shift
    an = body.producer.get(value_source(body, a)) if body.scope_of(a) is body else None
    if an is None:
        an = g.producer.get(value_source(g, a))
    if k - shift == 1 and size_keys(g, dim_key(body, a)) & T_keys:
        return "reverse"
    if an is not None and an.op_type == "Sub":
        c = body.const(an.input[1])
        if c is not None and np.asarray(c).size == 1 and int(np.asarray(c).ravel()[0]) == 1 - k + shift and size_keys(g, dim_key(body, an.input[0])) & T_keys:
            return "reverse"
    return None


def _without_wrap_fixup(g: Graph, body: Graph, idx: str, data: str, axis: int) -> str:
    """The index v that ``Where(v < 0, v + n, v)`` wraps, for n the extent of ``data``'s ``axis``, seen
    through the reshapes, one-element expands and value-keeping casts around it; else ``idx`` itself.

    jax2onnx wraps every traced index so (numpy's negative indices). Gather reads a negative index from the
    end already, so for n the axis's own extent the wrapped index reads the same element as v does: a
    reversed read ``x[:, T - 1 - t]``, whose sign no bound on the iteration number settles, is then read as the
    ``T - 1 - i`` it is."""
    name = idx
    for _ in range(8):
        n = body.producer.get(name)
        if n is None:
            return idx
        if n.op_type == "Where" and len(n.input) == 3:
            break
        if n.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Identity") or (n.op_type == "Cast" and keeps_value(n)):
            name = n.input[0]
        elif n.op_type == "Expand" and (c := body.const(n.input[1])) is not None and int(np.prod(c)) == 1:
            name = n.input[0]
        else:
            return idx
    else:
        return idx
    cond, wrapped, v = (body.producer.get(n.input[0]), body.producer.get(n.input[1]), n.input[2])
    if cond is None or cond.op_type != "Less" or cond.input[0] != v or terms(body, cond.input[1]) != [("c", 0)]:
        return idx
    if wrapped is None or wrapped.op_type != "Add" or v not in wrapped.input:
        return idx
    extent = wrapped.input[1] if wrapped.input[0] == v else wrapped.input[0]
    return v if size_keys(g, dim_key(body, extent)) & timesize_keys(g, data, axis) else idx


def counts_down(body: Graph, idx: str, index_syms: dict[str, int]) -> bool:
    """Whether body value ``idx`` is ``a - (i + k) + shift`` for the iteration number i (a time index counted
    down: :func:`reads_backwards` proves it T - 1 - i once T is known)."""
    return _minus_index(body, body.producer.get(value_source(body, idx)), index_syms) is not None


def reads_backwards(g: Graph, body: Graph, idx: str, index_syms: dict[str, int], data: str, axis: int) -> bool:
    """Whether body value ``idx`` is ``T - 1 - i``, T ``data``'s extent on ``axis``."""
    return _index_form(g, body, idx, index_syms, data, axis) == "reverse"


def _minus_index(body: Graph, n: NodeProto | None, index_syms: dict[str, int]) -> tuple[str, int, int] | None:
    """``(a, k, shift)`` when node ``n`` computes ``a - (i + k) + shift`` (i the iteration number): ``a - i``,
    ``a + i * -1`` (TorchScript's range(T - 1, -1, -1): start + i * step), and either with a constant added or
    subtracted after it (``(T - i) - 1``)."""
    shift = 0
    if n is not None and n.op_type in ("Add", "Sub") and len(n.input) == 2:
        for j in ((1,) if n.op_type == "Sub" else (1, 0)):
            c = body.const(n.input[j])
            inner = body.producer.get(value_source(body, n.input[1 - j]))
            if c is not None and np.size(c) == 1 and np.asarray(c).dtype.kind in "iu" and inner is not None \
                    and inner.op_type in ("Add", "Sub"):
                shift, n = (-1 if n.op_type == "Sub" else 1) * int(np.ravel(c)[0]), inner
                break
    if n is not None and n.op_type == "Add":
        neg = [k for k in (0, 1) if _negated(body, n.input[k]) is not None]
        if len(neg) != 1:
            return None
        a, b = n.input[1 - neg[0]], _negated(body, n.input[neg[0]])
    elif n is None or n.op_type != "Sub":
        return None
    else:
        a, b = n.input
    step = counter_step(body, b)
    if step is None or step[0] not in index_syms:
        return None
    return a, index_syms[step[0]] + step[1], shift


def step_read(g: Graph, body: Graph, n: NodeProto, index_syms: dict[str, int], invariants: dict[str, str]):
    """If body node ``n`` reads element i (the iteration number) of a loop-invariant tensor along one axis:
    (the outer tensor, the axis, "forward" | "reverse" | "reverse_end", the offset), else None. The offset
    is s for a Gather of element ``i + s`` (:func:`read_offset`: TorchScript's ``range(s, T)``, a jax counter
    from s), read "forward"; 0 for every other read.

    Recognised reads: ``Gather(D, i, axis=a)`` (tf2onnx, jax2onnx; a = 1 for TorchScript's ``x[:, t]``) and
    ``Squeeze(Slice(D, starts, ends, axes), [a])`` taking ``[i, i + 1)`` on axis a and everything on the
    other axes (jax's ``dynamic_slice`` / ``dynamic_index_in_dim``, strided-slice reads), and ``SequenceAt(S, i)``
    of ``S = SplitToSequence(D, axis=a)`` into one-element chunks (TorchScript's ``for x_t in x.unbind(a)``)."""
    if n.op_type == "SequenceAt" and len(n.input) == 2:
        src = unit_chunks(g, invariant_source(body, n.input[0], invariants) or "")
        form = _index_form(g, body, n.input[1], index_syms, *src) if src is not None else None
        return (*src, form, 0) if form is not None else None
    if n.op_type == "Gather" and len(n.input) >= 2:
        # TorchScript writes x[:, t] as Gather(Slice(x, 0:INT_MAX on axis 0), t, axis=1)
        data = _full_slice_source(g, body, n.input[0], invariants) or invariant_source(body, n.input[0], invariants)
        perm = None
        if data is None:  # jax's x[:, t] with a traced t: Gather(Transpose(x), t) of a transpose in the body
            data, perm = _transposed_invariant(body, n.input[0], invariants)
        rank = rank_of(g, data) if data is not None else None
        if data is None or rank is None:  # (perhaps element 0 of a one-step slice: read as its Squeeze)
            return _slice_read(g, body, n, index_syms, invariants) if _unit_gather(body, n) else None
        axis = attr(n, "axis", 0)
        axis = axis + rank if axis < 0 else axis
        if perm is not None:  # element t along the transpose's axis is element t along the source's perm[axis],
            rest = [p for k, p in enumerate(perm) if k != axis]  # the same tensor when the other axes keep order
            if len(perm) != rank or rest != sorted(rest):
                return None
            axis = perm[axis]
        form = _index_form(g, body, n.input[1], index_syms, data, axis)
        if form is not None:
            return data, axis, form, 0
        offset = read_offset(body, n.input[1], index_syms)
        return (data, axis, "forward", offset) if offset is not None and offset >= 0 else None
    return _slice_read(g, body, n, index_syms, invariants)


def _slice_read(g: Graph, body: Graph, n: NodeProto, index_syms: dict[str, int], invariants: dict[str, str]):
    """:func:`step_read` of ``Squeeze(Slice(D, ...))`` taking ``[i + s, i + s + 1)`` on one axis and everything
    on the others; of a Slice keeping a [B, T] mask's column ``[i, i + 1)`` as [B, 1]; of a Slice keeping x's
    step ``[i, i + 1)`` as [1, B, F] (TorchScript's ``lstm(x[t:t + 1], state)``), or [B, 1, F] transposed to
    it (``x[:, t:t + 1]`` fed to a time-major op); else None."""
    kept = keeps_time_axis(n)
    squeezed = n.op_type == "Squeeze" or _unit_gather(body, n)  # (jax's dynamic_slice_in_dim(x, t, 1)[0])
    if not squeezed and not kept:
        return None
    if n.op_type == "Transpose" and list(attr(n, "perm", []) or []) != [1, 0, 2]:
        return None
    sl = n if n.op_type == "Slice" else body.producer.get(n.input[0])
    if sl is None or sl.op_type != "Slice" or len(sl.input) < 3:
        return None
    inner = sl.input[0]
    data = invariant_source(body, inner, invariants) or _full_slice_source(g, body, inner, invariants)
    rank = rank_of(g, data) if data is not None else None
    if data is None or rank is None:
        return None
    kept_axis = None  # (the one axis a kept read takes one element of)
    if kept:
        column = rank == 2 and (g.model.elem_type(data) == TensorProto.BOOL or cast_of_bool(g, data) is not None)
        if column and n.op_type == "Slice":
            kept_axis = 1
        elif rank == 3 and g.model.elem_type(data) != TensorProto.BOOL and (n.op_type == "Transpose" or not any(
                u.op_type == "Squeeze" or _unit_gather(body, u) for u in body.uses(n.output[0]))):
            kept_axis = 1 if n.op_type == "Transpose" else 0  # (a Squeeze of the Slice is a read of its own)
        else:
            return None
    else:
        sq_axes = [attr(n, "axis", 0)] if n.op_type == "Gather" else op_args.axes(n, g.model.opset,
                                                                                op_args.const_reader(body, n))
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
    if kept:
        stepped = [a + rank if a < 0 else a for (_, a), st in zip(axes, starts) if st == ("i", 0)]
        if stepped != [kept_axis]:
            return None
        axis = kept_axis
    seen, form, ahead = set(), "forward", 0
    for k, ((_, a), st, en, step) in enumerate(zip(axes, starts, ends, steps)):
        a = a + rank if a < 0 else a
        seen.add(a)
        if a == axis and st[0] == "i" and st[1] > 0 and not kept and one_element(_shifted(en, -st[1]), step):
            ahead = st[1]  # [i + s, i + s + 1): element i + s (a jax counter from s)
        elif a == axis and st != ("i", 0) and not kept:
            if not _one_from_the_end(g, body, sl.input[1], k, en, step, index_syms, data, axis):
                return None
            form = "reverse"
        elif a == axis:
            if st != ("i", 0) or not one_element(en, step):
                return None
        elif not (st == ("c", 0) and step == ("c", 1) and _covers(g, data, inner, a, en)):
            return None
    if axis not in seen:
        return None
    return data, axis, form, ahead


def _unit_gather(body: Graph, n: NodeProto) -> bool:
    """Whether ``n`` is a Gather of element 0 (or -1) by a scalar constant: of a one-element axis, its Squeeze."""
    if n.op_type != "Gather" or len(n.input) < 2:
        return False
    idx = body.const(n.input[1])
    return idx is not None and np.ndim(idx) == 0 and int(idx) in (0, -1)


def keeps_time_axis(n: NodeProto) -> bool:
    """Whether a read by body node ``n`` (see :func:`step_read`) keeps the time axis it takes one element of: a
    Slice ([B, 1] of a mask, [1, B, F] of x) or the Transpose of one, not a Squeeze or a Gather."""
    return n.op_type in ("Slice", "Transpose")


def _shifted(term: tuple, k: int) -> tuple:
    """An index term with k added to its iteration number part (``i + 2`` shifted by -1: ``i + 1``)."""
    if term[0] == "i" or term[:2] == ("ge", "i"):
        return term[:-1] + (term[-1] + k,)
    return term


def _one_from_the_end(g: Graph, body: Graph, starts: str, k: int, end: tuple, step: tuple, index_syms: dict[str, int],
                      data: str, axis: int) -> bool:
    """Whether a Slice whose k-th start, end and step are these takes element T - 1 - i of ``data``'s ``axis``
    alone (tf2onnx's x[:, n - 1 - t]: a shrunk axis, a step of 1e9 to an end of 1e9, from T - 1 - i)."""
    start = _element(body, starts, k, index_syms)
    return (start is not None and reads_backwards(g, body, start, index_syms, data, axis) and step[0] == "c"
            and step[1] >= TO_THE_END and past_every_index(end))


def _element(body: Graph, vec: str, k: int, index_syms: dict[str, int]) -> str | None:
    """The body value element ``k`` of the 1-D int tensor ``vec`` is, through the ways tf2onnx builds a strided
    slice's starts: value-keeping casts, ``Where`` on a condition the terms decide, ``Concat`` of pieces and
    ``Unsqueeze`` of a scalar. None if it is not one value of the body."""
    for _ in range(16):
        name = value_source(body, vec)
        n = body.producer.get(name)
        if n is None:
            return None
        if n.op_type == "Unsqueeze":
            return n.input[0] if k == 0 else None
        if n.op_type == "Where":
            cond = terms(body, n.input[0], index_syms)
            pick = cond[k if len(cond) > 1 else 0] if cond else None
            if pick not in (("c", 0), ("c", 1)):
                return None
            vec = n.input[1 if pick == ("c", 1) else 2]
            k = k if len(terms(body, vec, index_syms) or []) > 1 else 0
            continue
        if n.op_type == "Concat":
            for piece in n.input:
                size = len(terms(body, piece, index_syms) or [])
                if not size:
                    return None
                if k < size:
                    vec = piece
                    break
                k -= size
            else:
                return None
            continue
        return name if k == 0 and (body.model.shape(name) or [None]) in ([], [1]) else None
    return None


def cast_of_bool(g: Graph, name: str) -> str | None:
    """The bool tensor ``name`` is a cast of to numbers (tf's ``cast(sequence_mask(lengths), float)``, torch's
    ``mask.float()``: 0 and 1 only), seen through Identity; else None."""
    n = g.producer.get(name)
    while n is not None and n.op_type == "Identity":
        n = g.producer.get(n.input[0])
    if n is None or n.op_type != "Cast" or attr(n, "to") == TensorProto.BOOL:
        return None
    return n.input[0] if g.model.elem_type(n.input[0]) == TensorProto.BOOL else None


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
    """``name`` = Slice(D, 0, INT_MAX) on some axes (a no-op view such as TorchScript's ``x[:]``, or several:
    ``x[:, :, t]`` slices axes 0 and 1 whole, one Slice each): D."""
    for _ in range(8):
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
        name = n.input[0]
        if scope is not body:
            return name
        outer = invariant_source(body, name, invariants)
        if outer is not None:
            return outer
    return None
