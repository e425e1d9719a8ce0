"""Symbolic reasoning about sizes: which tensor dimension an integer value is.

``dim_key(g, name)`` names the size a scalar (or 1-element) integer tensor holds, as ``("dim", root, axis)``
or ``("const", value)``, looking through Shape, Gather/Slice of shapes, Squeeze/Unsqueeze, Transpose,
shape-preserving unary ops and casts that keep the value (:func:`keeps_value`). Two values with equal keys
are provably equal. Arithmetic on sizes
(``T - 1``) is read by :mod:`rnnfuse.index_terms`, time flips by :mod:`rnnfuse.time_flips`. A Loop's trip count
and condition bound the extents it stacks (:func:`condition_bounds`).
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from . import op_args
from .cells.kinds import output_dims
from .carried import loop_invariant_init
from .graph import Graph, attr

# types that hold every index and size unchanged (float and double: exact below 2**24, which bounds every real
# axis and loop); a narrower type wraps or rounds (int16: 40000 becomes -25536), unsigned wraps -1, bool is v != 0
_VALUE_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT, TensorProto.DOUBLE})
SCALAR_RESHAPES = ("Squeeze", "Unsqueeze", "Reshape", "Flatten")  # (hand a 1-element value on whole: a count, a size)

_SHAPE_PRESERVING = {
    "Identity", "Cast", "Not", "Neg", "Abs", "Sigmoid", "Tanh", "Relu", "Exp", "Log", "Sqrt",
    "Reciprocal", "Floor", "Ceil", "Round", "Sign", "IsNaN", "Softsign", "Softplus", "ReverseSequence",
}  # fmt: skip


def root_dim(g: Graph, name: str, axis: int, depth: int = 0) -> tuple[str, int]:
    """Follow ``dim(name, axis)`` through shape-preserving producers to a canonical (tensor, axis)."""
    while depth < 64:
        depth += 1
        scope = g.scope_of(name)
        if scope is None or name not in scope.producer:
            return (name, axis)
        n = scope.producer[name]
        rank = g.model.rank(name)
        if axis < 0 and rank is not None:
            axis += rank
        if n.op_type in _SHAPE_PRESERVING and n.input:
            name = n.input[0]
            continue
        if n.op_type == "Transpose":
            perm = attr(n, "perm")
            if perm is None or axis < 0:
                return (name, axis)
            name, axis = n.input[0], perm[axis]
            continue
        if axis >= 0 and n.op_type == "Gather" and len(n.input) == 2:  # (an embedding lookup: the ids' axes)
            inner = _gather_source(g, n, axis)
            if inner is None:
                return (name, axis)
            name, axis = inner
            continue
        if axis >= 0 and rank is not None and n.op_type in _LEADING_FROM_FIRST:
            inner = _leading_source(g, n, rank, axis)
            if inner is None:
                return (name, axis)
            name = inner
            continue
        if n.op_type in ("Squeeze", "Unsqueeze") and axis >= 0:
            inner = _unit_axis_source(scope, n, axis)
            if inner is None:
                return (name, axis)
            name, axis = n.input[0], inner
            continue
        dims = output_dims(n, name) if axis >= 0 else None
        if dims is not None:
            # (a native op's outputs take the sequence and batch extents from X: a stacked layer's trip count
            # is its input's, read off the layer below)
            if axis >= len(dims) or not isinstance(dims[axis], tuple):
                return (name, axis)
            k, axis = dims[axis]
            name = n.input[k]
            continue
        if n.op_type == "Loop" and axis == 0:
            # (a scan output stacks one row per iteration: a Loop whose condition stays true runs its trip
            # count, and TorchScript's stacked loops all run x.size(0), read once before the first)
            trips = _trip_count_dim(scope, n, name)
            if trips is None:
                return (name, axis)
            name, axis = trips
            continue
        if n.op_type in ("Where",) and len(n.input) == 3:
            # a select keeps the shape of its value inputs when they all have the same rank and dims
            return (name, axis)
        return (name, axis)
    return (name, axis)


# ops whose output takes some axes from one operand alone: a matmul by a matrix its leading axes from the left
# operand (an input projection x @ W, [T, B, F] @ [F, G]), and a broadcasting op the axes only one operand has
# (its bias: x @ W + b)
_LEADING_FROM_FIRST = {"MatMul", "Add", "Sub", "Mul", "Div"}


def _leading_source(g: Graph, n: NodeProto, rank: int, axis: int) -> str | None:
    """The input of ``n`` (output rank ``rank``) whose extent on ``axis`` its output has on that axis, when
    one input alone gives it; else None."""
    if len(n.input) != 2:
        return None
    ranks = [g.model.rank(i) for i in n.input]
    if None in ranks:
        return None
    if n.op_type == "MatMul":  # ([.., M, K] @ [K, N]: the leading axes and M are the left operand's)
        return n.input[0] if ranks[1] == 2 and ranks[0] == rank >= 2 and axis < rank - 1 else None
    full = [i for i, r in zip(n.input, ranks) if r == rank]
    short = [r for r in ranks if r != rank]
    if len(full) == 1 and all(axis < rank - r for r in short):
        return full[0]
    return None


def _gather_source(g: Graph, n: NodeProto, axis: int) -> tuple[str, int] | None:
    """``(tensor, axis)`` whose extent ``Gather(data, ids, axis=a)`` has on its output ``axis``: the ids' axes
    take the place of data's axis a (``E[tokens]``: [B, T] ids, [B, T, F] rows), data's other axes keep
    theirs. None when a rank is not known."""
    a = attr(n, "axis", 0)
    r_data, r_ids = g.model.rank(n.input[0]), g.model.rank(n.input[1])
    if r_data is None or r_ids is None:
        return None
    a = a + r_data if a < 0 else a
    if axis < a:
        return n.input[0], axis
    if axis < a + r_ids:
        return n.input[1], axis - a
    return n.input[0], axis - r_ids + 1


def _trip_count_dim(scope: Graph, loop: NodeProto, name: str) -> tuple[str, int] | None:
    """(tensor, axis) whose extent Loop ``loop``'s scan output ``name`` has on axis 0: the trip count's, where
    it is one (``Gather(Shape(t), a)``) and the loop's condition is true by construction, on entry and after
    every iteration (:func:`condition_bounds`: none)."""
    outs = list(loop.output)
    if len(loop.input) < 2 or not loop.input[0] or name not in outs:
        return None
    body = scope.subgraph(loop)
    n_carried = len(loop.input) - 2
    if outs.index(name) < n_carried:
        return None  # (a carried value, not a scan output)
    if loop.input[1] and condition_bounds(scope, loop.input[1]):
        return None
    if condition_bounds(body, body.output_names[0], true=body.input_names[1]):
        return None
    key = dim_key(scope, loop.input[0])  # (the Loop's own scope: it may sit in another body)
    return key[1:] if key is not None and key[0] == "dim" else None


def condition_bounds(g: Graph, cond: str, true: str = "") -> list[tuple[str, str] | None]:
    """The conjuncts of a Loop's bool condition ``cond`` (through And and Identity) that are not true by
    construction (a constant True, or ``true``: the body's condition input, passed on): each as ``(a, b)`` when
    it is ``a < b`` (``Less(a, b)``, ``Greater(b, a)``), None when it is no such bound. Empty: always true."""
    out = []
    for term in _conjuncts(g, cond):
        if term == true:
            continue
        c = g.const(term)
        if c is not None and bool(np.asarray(c).all()):
            continue
        n = g.producer.get(term)
        if n is None or n.op_type not in ("Less", "Greater"):
            out.append(None)
        else:
            out.append((n.input[0], n.input[1]) if n.op_type == "Less" else (n.input[1], n.input[0]))
    return out


def _conjuncts(g: Graph, name: str) -> list[str]:
    out, stack = [], [name]
    while stack:
        cur = stack.pop()
        n = g.producer.get(cur)
        if n is not None and n.op_type == "And":
            stack.extend(n.input)
        elif n is not None and n.op_type == "Identity":
            stack.append(n.input[0])
        else:
            out.append(cur)
    return out


def _unit_axis_source(g: Graph, n: NodeProto, axis: int) -> int | None:
    """The input axis that Squeeze / Unsqueeze ``n`` carries to its output's ``axis`` (None: the axis is one
    Unsqueeze adds, or the axes are unknown)."""
    axes = op_args.axes(n, g.model.opset, op_args.const_reader(g, n))
    if not axes:
        return None
    squeeze = n.op_type == "Squeeze"
    if any(a < 0 for a in axes):  # (a rank is asked only for negative axes: it may cost an inference)
        rank = g.model.rank(n.input[0] if squeeze else n.output[0])
        if rank is None:
            return None
    else:  # (any rank holding the axes and ``axis`` maps it alike: the axes after it do not move it)
        rank = max(*axes, axis) + 1 + len(axes)
    if squeeze:
        kept = op_args.squeezed(list(range(rank)), axes)  # (the input axis at each output place)
        return kept[axis] if kept is not None and axis < len(kept) else None
    source = op_args.unsqueezed(list(range(rank - len(axes))), axes, fill=None)
    return source[axis] if source is not None and axis < len(source) else None


def dim_key(g: Graph, name: str, depth: int = 0):
    """A canonical key for the integer a scalar/1-element tensor holds, or None if unknown."""
    if depth > 32 or not name:
        return None
    c = g.const(name)
    if c is not None:
        flat = np.asarray(c).ravel()
        if flat.size == 1 and np.issubdtype(flat.dtype, np.number) and flat[0] == int(flat[0]):
            return ("const", int(flat[0]))
        return None  # (a fraction is no size: 1.4 must not read as 1)
    scope = g.scope_of(name)
    if scope is None or name not in scope.producer:
        if scope is not None and scope.owner is not None and scope.owner.op_type == "Loop":
            # a loop-carried value that the body passes through unchanged is its initial value
            init = loop_invariant_init(scope, name)
            if init is not None:
                return dim_key(scope.parent, init, depth + 1)
        return None
    n = scope.producer[name]
    op = n.op_type
    if (keeps_value(n) or op in SCALAR_RESHAPES) and n.input:
        return dim_key(g, n.input[0], depth + 1)
    if op in ("Gather", "Slice"):
        ds = scope.producer.get(value_source(scope, n.input[0]))  # the shape, seen through a cast
        if ds is None or ds.op_type != "Shape":
            return None
        if op == "Gather":
            idx = g.const(n.input[1])
            if idx is None or np.asarray(idx).size != 1:
                return None
            k = int(np.asarray(idx).ravel()[0])
        else:
            starts, ends, _, _ = op_args.slice_args_of(g, n)
            if not starts or not ends:
                return None
            s, e = starts[0], ends[0]
            if e != s + 1 and not (s == -1 and e >= 2**31 - 1):
                return None
            k = s
        dims = _shape_dims(g, ds)
        if dims is None or not -len(dims) <= k < len(dims):
            return None
        return ("dim",) + root_dim(g, ds.input[0], dims[k])
    if op == "Shape":  # (one dim: Shape(x, start=k) of the last, or Shape(x, start=k, end=k + 1))
        dims = _shape_dims(g, n)
        return ("dim",) + root_dim(g, n.input[0], dims[0]) if dims is not None and len(dims) == 1 else None
    if op == "SequenceLength":  # (the number of x.unbind(a)'s elements: x's size on a)
        src = unit_chunks(g, n.input[0])
        return ("dim",) + root_dim(g, *src) if src is not None else None
    if op in ("ReduceMin", "Min"):
        return _least(g, n, depth)
    return None


def _least(g: Graph, n: NodeProto, depth: int):
    """The key of ``min(a, b, ...)`` (``Min``, or ``ReduceMin`` of a Concat of one-element values): the one
    size left once those at least 2**31 - 1 (no size) are dropped (TorchScript's ``enumerate(x)`` runs
    ``min(INT64_MAX, x.size(0))`` times) and so are maxes of another part and anything (TF's ``dynamic_rnn``
    runs ``min(T, max(1, T))``), the least constant, or ``("min", key, ...)`` of several sizes."""
    parts = list(n.input)
    if n.op_type == "ReduceMin":
        cat = g.scope_of(n.input[0]).producer.get(n.input[0])
        if cat is None or cat.op_type != "Concat" or len(n.input) > 1 and n.input[1]:
            return None  # (the reduced axes as an input: not asked)
        parts = list(cat.input)
    keys, bounded = [], []  # (bounded: the operands' keys of a part that is a max, at least each of them)
    for p in (p for p in parts if p):
        k = dim_key(g, p, depth + 1)
        m = g.producer.get(value_source(g, p)) if k is None else None
        if m is not None and m.op_type == "Max":
            bounded.append({dim_key(g, a, depth + 1) for a in m.input} - {None})
        elif k is None:
            return None
        else:
            keys.append(k)
    # a max of several values, one of them another part, is never less than it (tf's min(T, max(1, T)))
    if not keys or any(not b & set(keys) for b in bounded):
        return None
    if all(k[0] == "const" for k in keys):
        return ("const", min(k[1] for k in keys))
    known = {k for k in keys if not (k[0] == "const" and k[1] >= 2**31 - 1)}
    if len(known) == 1:
        return known.pop()
    # (several sizes: ("min", ...) of them, equal to each only where they are one: zip(x.unbind(1), m.unbind(1)))
    return ("min",) + tuple(sorted(known, key=repr)) if all(k[0] != "min" for k in known) else None


def unit_chunks(g: Graph, seq: str) -> tuple[str, int] | None:
    """``(D, a)`` when ``seq`` is ``SplitToSequence(D, axis=a, keepdims=0)`` into one-element chunks with the
    axis dropped: ``x.unbind(a)`` as TorchScript writes it (a scalar ``split`` of 1, whose chunks onnxruntime
    squeezes by ``keepdims=0`` and so TorchScript reads as ``[B, F]``; no split: one element each). Else None."""
    scope = g.scope_of(seq) if seq else None
    n = scope.producer.get(seq) if scope is not None else None
    if n is None or n.op_type != "SplitToSequence" or attr(n, "keepdims", 1) != 0:
        return None
    if len(n.input) > 1 and n.input[1]:
        split = g.const(n.input[1])
        if split is None or np.asarray(split).shape != () or int(split) != 1:
            return None
    rank = g.model.rank(n.input[0])
    axis = attr(n, "axis", 0)
    if rank is None or not -rank <= axis < rank:
        return None
    return n.input[0], axis + rank if axis < 0 else axis


def _shape_dims(g: Graph, shape: NodeProto) -> list[int] | None:
    """The axes of its input a ``Shape`` node gives, in order (``start`` and ``end`` clamped as ONNX does, from
    the rank when either is negative or ``end`` is given); None where the rank is needed and not known."""
    start, end = attr(shape, "start", 0) or 0, attr(shape, "end", None)
    rank = g.model.rank(shape.input[0])
    if rank is None:
        return None
    start, end = (v + rank if v < 0 else v for v in (start, rank if end is None else end))
    return list(range(min(max(start, 0), rank), min(max(end, 0), rank)))


def keeps_value(n: NodeProto) -> bool:
    """Whether node ``n`` hands an index or size on unchanged: an Identity, or a Cast to a type that holds every
    such value (int64, int32, float, double)."""
    return n.op_type == "Identity" or (n.op_type == "Cast" and attr(n, "to") in _VALUE_TYPES)


def value_source(g: Graph, name: str, keeps=keeps_value) -> str:
    """``name`` seen through the nodes of ``g`` that produce it and hand their input on unchanged: by default
    Identity nodes and value-keeping casts (``keeps`` says which, for a stricter reading)."""
    n = g.producer.get(name)
    while n is not None and keeps(n):
        name = n.input[0]
        n = g.producer.get(name)
    return name


def spans_any_extent(start: int, end: int) -> bool:
    """Whether a slice ``start:end`` (step 1) takes every element of an axis whatever its length: from 0 to an
    end no extent reaches (2**31 - 1 or more)."""
    return start == 0 and end >= 2**31 - 1


def takes_whole_axis(g: Graph, src: str, axis: int, start: int, end: int) -> bool:
    """Whether a slice ``start:end`` (step 1) takes every element of ``src``'s ``axis``: from its start to the
    end, or over its static extent (jax's static slices name every axis: ``[0, t, 0]:[B, t + 1, F]``)."""
    if spans_any_extent(start, end):
        return True
    rank = g.model.rank(src) if axis < 0 else None
    if axis < 0 and rank is None:
        return False
    d = static_dim(g, src, axis + rank if axis < 0 else axis)
    return d is not None and (start == 0 or start <= -d) and end >= d


def static_dim(g: Graph, name: str, axis: int) -> int | None:
    s = g.model.shape(name)
    if s is None or axis >= len(s) or axis < -len(s):
        return None
    d = s[axis]
    return d if isinstance(d, int) else None


# ops whose output broadcasts their inputs: an extent of the output is one of an input's that is not 1
_BROADCASTING = {"Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Equal", "And", "Or", "Xor", "Add", "Sub", "Mul",
                 "Div"}


def extent_key(g: Graph, name: str, axis: int, depth: int = 0):
    """A canonical key for the length of ``name`` along ``axis`` (``("const", n)`` when it is known), read from
    how the tensor was made where the file leaves it symbolic or unknown: through shape-keeping ops, an
    Unsqueeze of other axes, a broadcasting op's operand that has the axis, and ``Range(0, n, 1)``'s n (torch's
    ``arange(T)[:, None] < lengths[None, :]`` mask has the length of the x whose shape gave T). None if unknown."""
    d = static_dim(g, name, axis)
    if d is not None:
        return ("const", d)
    p = g.producer.get(name)
    if p is None or depth > 16:
        return _static(g, ("dim",) + root_dim(g, name, axis))
    op = p.op_type
    if op in _SHAPE_PRESERVING or op in ("Cast", "Not", "Identity"):
        return extent_key(g, p.input[0], axis, depth + 1)
    if op == "Unsqueeze":
        axes = op_args.axes(p, g.model.opset, op_args.const_reader(g, p))
        rank = g.model.rank(name)
        if axes is None or rank is None or not -rank <= axis < rank:
            return None
        axis %= rank
        source = op_args.unsqueezed(list(range(rank - len(axes))), axes, fill=None)  # (each axis' input axis)
        if source is None:
            return None
        return ("const", 1) if source[axis] is None else extent_key(g, p.input[0], source[axis], depth + 1)
    if op == "Range":
        start, delta = g.const(p.input[0]), g.const(p.input[2])
        if axis == 0 and start is not None and delta is not None and int(start) == 0 and int(delta) == 1:
            return _static(g, dim_key(g, p.input[1]))
        return None
    if op == "ConstantOfShape":
        return filled_extent(g, p.input[0], axis)
    if op == "Expand" and g.const(p.input[0]) is not None and np.size(g.const(p.input[0])) == 1:
        return filled_extent(g, p.input[1], axis)  # (one value expanded: the shape's extents)
    if op in _BROADCASTING:
        rank = g.model.rank(name)
        keys = set()
        for i in p.input:
            r = g.model.rank(i)
            if rank is None or r is None:
                return None
            k = extent_key(g, i, axis - (rank - r), depth + 1) if axis - (rank - r) >= 0 else ("const", 1)
            if k is None:
                return None
            keys.add(k)
        keys.discard(("const", 1))
        return keys.pop() if len(keys) == 1 else (("const", 1) if not keys else None)
    return _static(g, ("dim",) + root_dim(g, name, axis))


def filled_extent(g: Graph, shape: str, axis: int):
    """The key of element ``axis`` of the shape a fill is made with (``zeros(x.size(0), B, H)``: a Concat of
    one-element pieces), or None."""
    p = g.producer.get(shape)
    parts = list(p.input) if p is not None and p.op_type == "Concat" else [shape]
    at = 0
    for part in parts:
        c = g.const(part)
        size = np.size(c) if c is not None else (1 if dim_key(g, part) is not None else None)
        if size is None:
            return None
        if at <= axis < at + size:
            return ("const", int(np.ravel(c)[axis - at])) if c is not None else _static(g, dim_key(g, part))
        at += size
    return None


def restores_extents(g: Graph, shape: str, src: str, count: int, zero_copies: bool = False) -> bool:
    """Whether entries 0 .. count-1 of the shape value ``shape`` are ``src``'s extents there: equal, one of them -1
    (inferred as it), or, with ``zero_copies`` (``shape`` reshapes ``src`` itself, allowzero off), 0."""
    entries = [filled_extent(g, shape, a) for a in range(count)]
    ok = [e is not None and (e == extent_key(g, src, a) or (zero_copies and e == ("const", 0)))
          for a, e in enumerate(entries)]
    return all(ok) or (ok.count(False) == 1 and entries[ok.index(False)] == ("const", -1))


def _static(g: Graph, key):
    """``key`` with a dimension the file gives as a number read as that number."""
    if key is not None and key[0] == "dim":
        d = static_dim(g, key[1], key[2])
        if d is not None:
            return ("const", d)
    return key


def declared_name(g: Graph, name: str, axis: int) -> str | None:
    """The name the model's inputs give ``name``'s extent on ``axis`` (through shape-keeping ops and transposes to
    a graph input's own axis): the model's contract that extents named alike are one size (not a name an
    exporter makes up for an unknown dim, tf2onnx's ``unk__N``, which says nothing); else None."""
    root, ax = root_dim(g, name, axis)
    if root not in g.model.graph.input_names:  # (the main graph's inputs: a body's are carried values)
        return None
    shape = g.model.shape(root) or []
    d = shape[ax] if 0 <= ax < len(shape) else None
    return d if isinstance(d, str) and d and not d.startswith("unk__") else None


def time_dim_key(g: Graph, name: str, axis: int = 0):
    d = static_dim(g, name, axis)
    if d is not None:
        return ("const", d)
    return ("dim",) + root_dim(g, name, axis)


def untransposed(g: Graph, name: str, axis: int) -> tuple[str, int] | None:
    """``(S, 1 - axis)`` when ``name`` is ``Transpose(S)`` swapping its first two axes (the rest kept) and ``axis``
    is one of them: the same slices read along S's own axis. Else None."""
    n = g.producer.get(name)
    rank = g.model.rank(n.input[0]) if n is not None and n.op_type == "Transpose" else None
    if rank is None or axis not in (0, 1) or list(attr(n, "perm") or []) != [1, 0, *range(2, rank)]:
        return None
    return n.input[0], 1 - axis


def time_keys(g: Graph, name: str, axis: int = 0) -> set:
    """Every key ``name``'s extent along ``axis`` goes by: its canonical (tensor, axis) through shape-keeping
    producers, and the number the file gives for it or for that root (a symbolic name declared on the way,
    jax2onnx's for a Loop's stacked outputs, hides a static T of the tensor they were computed from)."""
    root = root_dim(g, name, axis)
    own = static_dim(g, name, axis)  # (time_dim_key's, the root found once)
    keys = {("const", own) if own is not None else ("dim",) + root, ("dim",) + root}
    d = static_dim(g, *root)
    if d is not None:
        keys.add(("const", d))
    return keys


def fixed_batch(g: Graph, x: str, time_axis: int) -> int | None:
    """The batch size of the sequence ``x`` ([T, B, F], or [B, T, F] with ``time_axis`` 1) when the model fixes
    it (a static export), else None."""
    shape = g.model.shape(x) or []
    b = shape[1 - time_axis] if len(shape) == 3 and time_axis in (0, 1) else None
    return b if isinstance(b, int) and b > 0 else None
