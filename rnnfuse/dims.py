"""Symbolic reasoning about sizes: which tensor dimension an integer value is, and time flips.

``dim_key(g, name)`` names the size a scalar (or 1-element) integer tensor holds, as ``("dim", root, axis)``
or ``("const", value)``, looking through Shape, Gather/Slice of shapes, Cast, Squeeze/Unsqueeze, Transpose
and shape-preserving unary ops. Two values with equal keys are provably equal. ``time_flip_source`` finds
``x`` behind a full reversal of the time axis (``ReverseSequence`` with every length equal to T, a
``Slice`` with step -1, or a ``Gather`` of the indices T-1 .. 0, constant or computed from the shape as
``jnp.flip`` / ``torch.flip`` exporters write it).
"""

from __future__ import annotations

import numpy as np

from . import op_args
from .graph import Graph, attr

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
        if n.op_type in ("Where",) and len(n.input) == 3:
            # a select keeps the shape of its value inputs when they all have the same rank and dims
            return (name, axis)
        return (name, axis)
    return (name, axis)


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
    if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten") and n.input:
        return dim_key(g, n.input[0], depth + 1)
    if op in ("Gather", "Slice"):
        data = n.input[0]
        ds = scope.producer.get(data)
        if ds is None:
            return None
        # look through a Cast of the shape
        while ds is not None and ds.op_type in ("Cast", "Identity"):
            data = ds.input[0]
            ds = scope.producer.get(data)
        if ds is None or ds.op_type != "Shape":
            return None
        if op == "Gather":
            idx = g.const(n.input[1])
            if idx is None or np.asarray(idx).size != 1:
                return None
            k = int(np.asarray(idx).ravel()[0])
        else:
            starts, ends, _, _ = op_args.slice_args(n, g.model.opset, op_args.const_reader(g, n))
            if not starts or not ends:
                return None
            s, e = starts[0], ends[0]
            if e != s + 1 and not (s == -1 and e >= 2**31 - 1):
                return None
            k = s
        start = attr(ds, "start", 0) or 0
        src = ds.input[0]
        rank = g.model.rank(src)
        if k < 0:
            if rank is None:
                return None
            k += rank
        k += start if start >= 0 else (rank or 0)
        root = root_dim(g, src, k)
        return ("dim",) + root
    if op == "Shape":
        src = n.input[0]
        rank = g.model.rank(src)
        start, end = attr(n, "start", 0) or 0, attr(n, "end", None)
        if rank is not None and end is None and rank - start == 1:
            return ("dim",) + root_dim(g, src, start)
        return None
    return None


def static_dim(g: Graph, name: str, axis: int) -> int | None:
    s = g.model.shape(name)
    if s is None or axis >= len(s) or axis < -len(s):
        return None
    d = s[axis]
    return d if isinstance(d, int) else None


def time_dim_key(g: Graph, name: str, axis: int = 0):
    d = static_dim(g, name, axis)
    if d is not None:
        return ("const", d)
    return ("dim",) + root_dim(g, name, axis)


def loop_invariant_init(body: Graph, name: str) -> str | None:
    """If ``name`` is a Loop body input carried through unchanged, the Loop input that initialises it."""
    loop = body.owner
    ins = body.input_names
    if name not in ins:
        return None
    k = ins.index(name)
    if k < 2:
        return None
    outs = body.output_names
    if k - 1 >= len(outs):
        return None
    out = outs[k - 1]
    while out != name:
        p = body.producer.get(out)
        if p is None or p.op_type != "Identity":
            return None
        out = p.input[0]
    return loop.input[k] if k < len(loop.input) else None


def _full_lengths(g: Graph, lens: str, x: str, time_axis: int, batch_axis: int) -> bool:
    """True if every entry of ``lens`` equals the time length of ``x``."""
    tkey = time_dim_key(g, x, time_axis)
    c = g.const(lens)
    if c is not None:
        flat = np.asarray(c).ravel()
        return tkey[0] == "const" and flat.size > 0 and bool(np.all(flat == tkey[1]))
    scope = g.scope_of(lens)
    n = scope.producer.get(lens) if scope else None
    while n is not None and n.op_type in ("Cast", "Identity"):
        lens = n.input[0]
        n = scope.producer.get(lens)
    if n is None:
        return False
    if n.op_type in ("Expand", "Tile"):
        k = dim_key(g, n.input[0])
        return k is not None and k == tkey
    if n.op_type == "ConstantOfShape":
        v = attr(n, "value")
        return v is not None and tkey[0] == "const" and int(np.asarray(v).ravel()[0]) == tkey[1]
    return False


def _size_plus(g: Graph, name: str, depth: int = 0) -> tuple | None:
    """``name`` (a scalar or 1-element integer) as (size key, offset): ``n - 1`` is (dim_key(n), -1); a
    constant c is (("const", 0), c). None when it is neither a size nor a size plus a constant."""
    if depth > 8 or not name:
        return None
    key = dim_key(g, name)
    if key is not None:
        return (("const", 0), key[1]) if key[0] == "const" else (key, 0)
    scope = g.scope_of(name)
    n = scope.producer.get(name) if scope is not None else None
    if n is None:
        return None
    if n.op_type in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape") and n.input:
        return _size_plus(g, n.input[0], depth + 1)
    if n.op_type in ("Add", "Sub") and len(n.input) == 2:
        a, b = _size_plus(g, n.input[0], depth + 1), _size_plus(g, n.input[1], depth + 1)
        if a is None or b is None:
            return None
        if n.op_type == "Sub":
            if b[0] != ("const", 0):
                return None
            return (a[0], a[1] - b[1])
        if a[0] != ("const", 0) and b[0] != ("const", 0):
            return None
        return (a[0] if a[0] != ("const", 0) else b[0], a[1] + b[1])
    return None


def _same_size(a: tuple | None, b: tuple | None) -> bool:
    """Two (size key, offset) pairs name the same integer (a constant size folds into the offset)."""
    if a is None or b is None:
        return False
    norm = [((("const", 0), k[1] + off) if k[0] == "const" else (k, off)) for k, off in (a, b)]
    return norm[0] == norm[1]


def _descending_indices(g: Graph, idx: str, length: tuple) -> bool:
    """True if ``idx`` holds [T-1, T-2, ..., 0] for the time length keyed ``length``: a constant, a
    ``Range(T-1, -1, -1)``, or ``(T-1) - Range(0, T, 1)``."""
    c = g.const(idx)
    if c is not None:
        arr = np.asarray(c)
        return (length[0] == "const" and arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer)
                and arr.tolist() == list(range(length[1] - 1, -1, -1)))
    scope = g.scope_of(idx)
    n = scope.producer.get(idx) if scope is not None else None
    while n is not None and n.op_type in ("Cast", "Identity"):
        n = scope.producer.get(n.input[0])
    if n is None:
        return False
    size = (length, 0)
    if n.op_type == "Range" and len(n.input) == 3:
        start, limit, delta = (_size_plus(g, i) for i in n.input)
        return (_same_size(start, (length, -1)) and _same_size(limit, (("const", 0), -1))
                and _same_size(delta, (("const", 0), -1)))
    if n.op_type == "Sub" and len(n.input) == 2:
        if g.model.shape(n.input[0]) not in ([], [1]):  # a [1, 1] start would add an axis to the Gather
            return False
        r = scope.producer.get(n.input[1])
        if r is None or r.op_type != "Range" or len(r.input) != 3:
            return False
        start, limit, delta = (_size_plus(g, i) for i in r.input)
        return (_same_size(_size_plus(g, n.input[0]), (length, -1)) and _same_size(start, (("const", 0), 0))
                and _same_size(limit, size) and _same_size(delta, (("const", 0), 1)))
    return False


def time_flip_source(g: Graph, name: str, time_axis: int = 0) -> str | None:
    """If ``name`` is its source reversed along ``time_axis`` (every row entirely), that source."""
    scope = g.scope_of(name)
    if scope is None:
        return None
    n = scope.producer.get(name)
    if n is None:
        return None
    if n.op_type == "ReverseSequence":
        if attr(n, "time_axis", 0) != time_axis:
            return None
        if _full_lengths(g, n.input[1], n.input[0], time_axis, attr(n, "batch_axis", 1)):
            return n.input[0]
        return None
    if n.op_type == "Slice":
        starts, ends, axes, steps = op_args.slice_args(n, g.model.opset, op_args.const_reader(g, n))
        if starts is None or ends is None or axes is None or steps is None:
            return None
        rank = g.model.rank(n.input[0])
        axes = [a + rank if a < 0 and rank else a for a in axes]
        if len(axes) == 1 and axes[0] == time_axis and steps == [-1] and starts[0] in (-1, 2**63 - 1, 2**31 - 1) and ends[0] <= -(2**31):
            return n.input[0]
    if n.op_type == "Gather" and len(n.input) == 2:
        axis = attr(n, "axis", 0)
        rank = g.model.rank(n.input[0])
        if axis < 0 and rank is not None:
            axis += rank
        if axis == time_axis and _descending_indices(g, n.input[1], time_dim_key(g, n.input[0], time_axis)):
            return n.input[0]
    return None
