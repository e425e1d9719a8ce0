"""Index vectors that hold 0, 1, .., n-1 or n-1, .., 0, read from how they are computed, for every n.

A Gather of a tensor's own rows in order is the tensor itself, and one in reverse order is its time flip; an
exporter may compute such indices in more ways than a constant or one ``Range``: jax2onnx writes ``xs[::-1]``
fed to a scan as ``(n - 1) + -1 * Cast(Range(0, n, 1))`` reversed again by a Gather, reshaped to [n, 1],
broadcast to that same shape and flattened: the rows in order. What is read here is exact for every n, from
the ops alone:

* an arithmetic run is ``(sign, offset, n)``: element k holds ``offset + sign * k`` (sign +-1, offset and n as
  :mod:`rnnfuse.index_terms` size terms); a constant vector, an integer ``Range(s, l, +-1)``, Cast to int32 or
  int64, ``Mul`` by -1 (of a run starting at 0), and adding or subtracting a scalar keep it one;
* ``Gather(v, w)`` of a run vector v by a run vector w over v's own n (in order or reversed) is v or v
  reversed;
* Reshape, Squeeze, Unsqueeze and Flatten keep the elements in order; ``Expand(Reshape(v, s), s2)`` with s and
  s2 both provably [n, 1, .., 1] is that Reshape.

Anything else is not read (None). A caller checks the rank of the vector it gathers with.
"""

from __future__ import annotations

import numpy as np

from onnx import TensorProto

from .dataflow import runtime_values
from .dims import root_dim
from .graph import Graph, attr
from .index_terms import elementwise, scalar_term, size_term, terms

_DEPTH = 16
_INTEGERS = (TensorProto.INT32, TensorProto.INT64)  # (what an index run is computed in: no float rounding)
_IN_ORDER = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def _plus(a: tuple | None, k: int) -> tuple | None:
    """A size term plus k (index_terms' term arithmetic), None for no size term."""
    return elementwise("Add", [a, ("c", k)]) if a is not None and a[0] in ("c", "d") else None


def _negated(a: tuple | None) -> tuple | None:
    return ("c", -a[1]) if a is not None and a[0] == "c" else None


def arithmetic_run(g: Graph, name: str, depth: int = 0) -> tuple[int, tuple, tuple] | None:
    """``(sign, offset, n)`` when ``name`` holds ``offset + sign * k`` for k = 0 .. n-1, else None."""
    if depth > _DEPTH or not name:
        return None
    c = g.const(name)
    if c is not None:
        arr = np.asarray(c)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
            return None
        for sign in (1, -1):
            if np.array_equal(arr, arr[0] + sign * np.arange(arr.size)):
                return sign, ("c", int(arr[0])), ("c", int(arr.size))
        return None
    scope = g.scope_of(name)
    n = scope.producer.get(name) if scope is not None else None
    if n is None or name in runtime_values(scope):
        # (a run's elements are constants and sizes; a value computed from the inputs' values holds data. Read
        # on, its other operands were folded, and a fold may infer a cone's types: the 4,000 compacting Gathers
        # of fused masked ops, index vectors computed from the mask, cost drop-no-ops 2.9 s at 90,000 nodes)
        return None
    op = n.op_type
    if op in _IN_ORDER or (op == "Cast" and attr(n, "to") in _INTEGERS):
        return arithmetic_run(g, n.input[0], depth + 1)
    if op == "Range" and len(n.input) == 3 and g.model.elem_type(name) in _INTEGERS:  # (a float run rounds)
        start, limit, delta = (scalar_term(g, i) for i in n.input)
        if delta == ("c", 1) and start == ("c", 0):
            return 1, start, limit
        if delta == ("c", -1) and limit == ("c", -1):
            return -1, start, _plus(start, 1)
        return None
    if op == "Expand" and len(n.input) == 2:
        inner = scope.producer.get(n.input[0])
        run = arithmetic_run(g, n.input[0], depth + 1) if inner is not None and inner.op_type == "Reshape" else None
        if run is None or g.model.rank(inner.input[0]) != 1:
            return None
        lengths = {run[2], length_term(g, inner.input[0], 0)}  # (the vector reshaped holds the run's n)
        return run if _column(g, inner.input[1], lengths) and _column(g, n.input[1], lengths) else None
    if op == "Gather" and len(n.input) == 2 and attr(n, "axis", 0) == 0:
        if g.model.rank(n.input[0]) != 1 or g.model.rank(n.input[1]) != 1:
            return None  # (rows of a [m, 2] reordered are no reversal of its elements)
        v, w = arithmetic_run(g, n.input[0], depth + 1), arithmetic_run(g, n.input[1], depth + 1)
        if v is None or w is None or v[2] is None or w[2] not in (v[2], length_term(g, n.input[0], 0)):
            return None
        if w[0] == 1 and w[1] == ("c", 0):
            return v
        if w[0] == -1 and w[1] == _plus(w[2], -1):  # v reversed
            last = _last(v)
            return (-v[0], last, v[2]) if last is not None else None
        return None
    return _affine(g, n, depth)


def _last(run: tuple) -> tuple | None:
    """The last element of a run, as a term: offset + sign * (n - 1)."""
    sign, offset, n = run
    if offset == ("c", 0) and sign == 1:
        return _plus(n, -1)
    if sign == -1 and offset == _plus(n, -1):
        return ("c", 0)
    if offset[0] == "c" and n[0] == "c":
        return ("c", offset[1] + sign * (n[1] - 1))
    return None


def _affine(g: Graph, n, depth: int) -> tuple | None:
    """A run times +-1, plus a scalar, minus a scalar, or a scalar minus a run."""
    op = n.op_type
    if op not in ("Add", "Sub", "Mul") or len(n.input) != 2:
        return None
    for k in (0, 1):
        run = arithmetic_run(g, n.input[k], depth + 1)
        a = scalar_term(g, n.input[1 - k])
        if run is None or a is None:
            continue
        sign, offset, size = run
        if op == "Mul":
            if a == ("c", 1):
                return run
            return (-sign, offset, size) if a == ("c", -1) and offset == ("c", 0) else None
        if op == "Sub" and k == 1:  # a - run
            if offset[0] != "c":
                return None
            return -sign, _plus(a, -offset[1]), size
        if op == "Sub":  # run - a
            a = _negated(a)
            if a is None:
                return None
        if offset == ("c", 0):
            return sign, a, size
        return (sign, _plus(offset, a[1]), size) if a[0] == "c" else None
    return None


def length_term(g: Graph, name: str, axis: int) -> tuple:
    """The size term of ``name``'s extent along ``axis`` as ``Shape(name)[axis]`` reads it."""
    return size_term(("dim",) + root_dim(g, name, axis))


def _column(g: Graph, shape: str, n: set) -> bool:
    """Whether a shape vector is provably [n, 1, .., 1], n the run's length (one of the size terms ``n``): a
    Reshape to it and an Expand to it then keep the run as it is, n = 0 included (no other dim that a Reshape
    would copy from its input where it is 0 and an Expand would not)."""
    ts = terms(g, shape)
    return ts is not None and len(ts) >= 1 and ts[0] in n and all(t == ("c", 1) for t in ts[1:])


def in_order(g: Graph, name: str) -> tuple | None:
    """n when ``name`` holds 0, 1, .., n-1 (a size term), else None."""
    run = arithmetic_run(g, name)
    return run[2] if run is not None and run[0] == 1 and run[1] == ("c", 0) else None


def reversed_order(g: Graph, name: str) -> tuple | None:
    """n when ``name`` holds n-1, .., 1, 0 (a size term), else None."""
    run = arithmetic_run(g, name)
    return run[2] if run is not None and run[0] == -1 and run[1] == _plus(run[2], -1) else None
