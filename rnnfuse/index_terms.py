"""Integer index arithmetic read as terms with bounds: what a small int tensor holds, element by element.

A *term* is one integer, written as a tuple:

* ``("c", v)``: the constant v (booleans are 0 / 1);
* ``("i", k)``: the iteration number of a Loop plus k;
* ``("d", key, k)``: a tensor dimension plus k (``key`` as :func:`rnnfuse.dims.dim_key` names it, never a
  constant: a constant size is a ``("c", v)``);
* ``("ge", "i", k)``: at least the iteration number plus k (a ``Max`` that could go either way);
* ``UNKNOWN``: an integer nothing is known about.

Two equal terms name the same integer, so "this start is T - 1" is ``term == size_term(key, -1)``.

Why bounds matter: exporters guard index arithmetic with conditions that only a lower bound decides —
jax's negative-index fix-up ``Where(i < 0, i + n, i)``, tf2onnx's strided-slice masks compared with 0,
``Max(i + 1, 0)``. The iteration number is never negative and a dimension never is, so ``i + k`` and
``dim + k`` are at least k: ``i + 1 < 0`` is false at every iteration, and the fix-up is ``i`` itself. A
comparison whose outcome the bounds do not settle stays ``UNKNOWN``, never a guess.

Only exact arithmetic is read: a fraction is no integer (``1.4`` is not ``1``), a cast to a narrow or an
unsigned type (which wraps or rounds) is not read through, and a cast to bool is ``v != 0``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .dims import dim_key, keeps_value
from .graph import Graph, attr
from .op_args import TO_THE_END

UNKNOWN = ("?",)
_SIGNS_WHERE_TRUE = {  # comparison -> the signs of x - y where it holds
    "Less": {-1}, "LessOrEqual": {-1, 0}, "Greater": {1}, "GreaterOrEqual": {0, 1}, "Equal": {0},
}
_ELEMENTWISE = set(_SIGNS_WHERE_TRUE) | {"And", "Or", "Not", "Where", "Max", "Min", "Add", "Sub"}


def size_term(key: tuple, k: int = 0) -> tuple:
    """The term for the size ``key`` (a :func:`rnnfuse.dims.dim_key`) plus k."""
    return ("c", key[1] + k) if key[0] == "const" else ("d", key, k)


def terms(g: Graph, name: str, index_syms: dict[str, int] | None = None, depth: int = 0) -> list | None:
    """The terms of the small int tensor ``name`` of ``g``, element by element; None if the tensor itself is
    not understood. ``index_syms`` maps the names holding the iteration number to their offset (``("i", k)``).

    Enough for the index arithmetic exporters write around a dynamic slice or a reversal: Concat of
    Unsqueezed scalars, ``starts + sizes``, ``T - 1``, jax's negative-index fix-up ``Where(i < 0, i + n, i)``,
    and tf2onnx's strided-slice masks (``Where(And(strides < 0, mask), 1e9, [0, i])``, ``Max`` with constants)
    whose conditions are constant or decided by ``i >= 0``."""
    index_syms = index_syms or {}
    if depth > 24 or not name:
        return None
    if name in index_syms:
        return [("i", index_syms[name])]
    c = g.const(name)
    if c is not None:
        return _leaf_terms(np.asarray(c))
    scope = g.scope_of(name)
    n = scope.producer.get(name) if scope is not None else None
    op = n.op_type if n is not None else None
    if op == "Cast" and attr(n, "to") == TensorProto.BOOL:
        inner = terms(g, n.input[0], index_syms, depth + 1)
        return None if inner is None else [("c", int(t[1] != 0)) if t[0] == "c" else UNKNOWN for t in inner]
    if op == "Cast" and not keeps_value(n):
        return None  # narrow and unsigned types wrap or round index values
    if op in ("Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape"):
        return terms(g, n.input[0], index_syms, depth + 1)
    if op == "Expand":  # to a shape of one element (jax's broadcast of a scalar index): the elements as they are
        shape = g.const(n.input[1])
        return terms(g, n.input[0], index_syms, depth + 1) if shape is not None and int(np.prod(shape)) == 1 else None
    if op == "Concat" and attr(n, "axis", 0) in (0, -1):
        parts = [terms(g, i, index_syms, depth + 1) for i in n.input]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if op in _ELEMENTWISE:
        if op in ("Max", "Min") and len(n.input) != 2:
            return None
        lists = _broadcast(*(terms(g, i, index_syms, depth + 1) for i in n.input))
        return None if lists is None else [elementwise(op, list(ts)) for ts in zip(*lists)]
    k = dim_key(g, name)  # a size: Shape, Gather / Slice of a shape, a size a Loop carries unchanged
    return None if k is None else [size_term(k)]


def scalar_term(g: Graph, name: str) -> tuple | None:
    """The one term of a scalar (or 1-element) int tensor read without an iteration number, else None."""
    ts = terms(g, name)
    return ts[0] if ts is not None and len(ts) == 1 and ts[0] != UNKNOWN else None


def _leaf_terms(arr: np.ndarray) -> list | None:
    """A constant as terms: integers, booleans (0 / 1), and floats that hold integers (index arithmetic
    exporters route through float, e.g. tf2onnx's Max of a strided slice's ends)."""
    if arr.ndim > 1:
        return None
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            return None
    elif not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        return None
    return [("c", int(v)) for v in arr.ravel()]


def _broadcast(*lists):
    """Term lists of equal length (a single term stands for every position), or None."""
    if any(t is None for t in lists):
        return None
    n = max(len(t) for t in lists)
    out = [t * n if len(t) == 1 else t for t in lists]
    return out if all(len(t) == n for t in out) else None


def _bounds(t: tuple) -> tuple:
    """(lowest, highest) value of a term, None for unbounded: i + k and a dimension + k are at least k."""
    if t[0] == "c":
        return t[1], t[1]
    if t[0] in ("i", "d", "ge"):
        return t[-1], None
    return None, None


def _signs(x: tuple, y: tuple) -> set:
    """The signs ``x - y`` can have (exact for one symbol on both sides)."""
    if x[0] == y[0] and x[0] in ("c", "i", "d") and x[:-1] == y[:-1]:
        d = x[-1] - y[-1]
        return {(d > 0) - (d < 0)}
    (x_lo, x_hi), (y_lo, y_hi) = _bounds(x), _bounds(y)
    d_lo = x_lo - y_hi if x_lo is not None and y_hi is not None else None
    d_hi = x_hi - y_lo if x_hi is not None and y_lo is not None else None
    signs = set()
    if d_lo is None or d_lo < 0:
        signs.add(-1)
    if (d_lo is None or d_lo <= 0) and (d_hi is None or d_hi >= 0):
        signs.add(0)
    if d_hi is None or d_hi > 0:
        signs.add(1)
    return signs


def elementwise(op: str, ts: list) -> tuple:
    """One position of a comparison, logic op, Where, Max, Min, Add or Sub over terms."""
    if op in _SIGNS_WHERE_TRUE:
        possible = _signs(*ts)
        return ("c", 1) if possible <= _SIGNS_WHERE_TRUE[op] else ("c", 0) if not possible & _SIGNS_WHERE_TRUE[op] else UNKNOWN
    if op in ("And", "Or"):
        absorbing = ("c", 0) if op == "And" else ("c", 1)
        if absorbing in ts:
            return absorbing
        return ts[0] if all(t[0] == "c" for t in ts) else UNKNOWN
    if op == "Not":
        return ("c", 1 - ts[0][1]) if ts[0][0] == "c" else UNKNOWN
    if op == "Where":
        cond, a, b = ts
        return a if cond == ("c", 1) else b if cond == ("c", 0) else a if a == b else UNKNOWN
    if op in ("Max", "Min"):
        x, y = ts
        possible = _signs(x, y)
        x_wins, y_wins = ({0, 1}, {-1, 0}) if op == "Max" else ({-1, 0}, {0, 1})
        if possible <= x_wins or possible <= y_wins:
            return x if possible <= x_wins else y
        if op == "Max":  # at least each side: keep the iteration-number side as a lower bound, or a constant
            sym = [t for t in ts if t[0] == "i"]
            consts = [t[1] for t in ts if t[0] == "c"]
            return ("ge",) + sym[0] if sym else ("ge", "c", max(consts)) if consts else UNKNOWN
        return UNKNOWN
    x, y = ts  # Add, Sub: a symbol plus or minus a constant, or one symbol minus itself
    if y[0] == "c":  # (a lower bound stays one when a constant is added or taken away)
        return x[:-1] + (x[-1] + (y[1] if op == "Add" else -y[1]),) if x[0] != "?" else UNKNOWN
    if op == "Add" and x[0] == "c":
        return y[:-1] + (y[-1] + x[1],) if y[0] != "?" else UNKNOWN
    if op == "Sub" and x[0] == y[0] and x[0] in ("i", "d") and x[:-1] == y[:-1]:
        return ("c", x[-1] - y[-1])
    return UNKNOWN


def one_element(end: tuple, step: tuple) -> bool:
    """A slice from i with this end and step takes element i alone: ``[i, i + 1)``, or tf2onnx's shrunk axis
    (a step of 1e9 or more from i, to an end past i)."""
    if step == ("c", 1):
        return end == ("i", 1)
    past_i = past_every_index(end) or (end[0] == "i" and end[1] >= 1) or (end[:2] == ("ge", "i") and end[-1] >= 1)
    return step[0] == "c" and step[1] >= TO_THE_END and past_i


def past_every_index(end: tuple) -> bool:
    """Whether a slice end is at or past the end of any real axis: 1e9 or more (tf2onnx's "to the end"), or a
    ``Max`` with it."""
    return (end[0] == "c" or end[:2] == ("ge", "c")) and end[-1] >= TO_THE_END
