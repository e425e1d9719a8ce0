"""Arithmetic on shape values (rnnfuse.op_shapes.shape_value): a tensor holding a shape or part of one, its
entries ints, symbols (str: an extent that varies at run time) or None (not known). torch's traces compute
shapes with Add/Sub/Mul/Div (``x.size(1) * 2``, ``numel // 4``), through Casts to float and back; an answer
is given only where every type the value may be held in computes it exactly."""

from __future__ import annotations

ARITH = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
         "Div": lambda a, b: a // b if b and a % b == 0 else None}  # (exact division only: int and float agree)
# Cast targets that keep a shape value's numbers (below EXACT_BELOW): float, int32, int64, double (not bool, nor
# narrow or unsigned ints: a difference may be negative)
_FLOAT = 1
_VALUE_KEEPING_CASTS = frozenset((_FLOAT, 6, 7, 11))
# the largest magnitude arithmetic answers: every type the values may be held in (Cast to float) is exact below
EXACT_BELOW = 1 << 24


def cast(to: int, value):
    """A shape value Cast to element type ``to``: the same numbers where the type holds them exactly, else None
    (a Cast to int32 of the int64 maximum, torch's "to the end"); a symbol (an extent) kept, but not in a float,
    whose integers stop being exact at 2^24."""
    if value is None or to not in _VALUE_KEEPING_CASTS:
        return None
    keep = lambda x: (x if -EXACT_BELOW < x < EXACT_BELOW else None) if type(x) is int else \
        None if to == _FLOAT else x  # noqa: E731
    return tuple(map(keep, value)) if isinstance(value, tuple) else keep(value)


def arith(op: str, a, b):
    """``a op b`` on shape values (ints or tuples of them, broadcast as ONNX does), entry by entry (see
    :func:`_entry`); None where a length does not broadcast."""
    if a is None or b is None:
        return None
    xs, ys = a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)
    if len(xs) != len(ys) and 1 not in (len(xs), len(ys)):
        return None
    n = max(len(xs), len(ys))
    out = tuple(_entry(op, x, y) for x, y in zip(xs * n if len(xs) == 1 else xs, ys * n if len(ys) == 1 else ys))
    return out if isinstance(a, tuple) or isinstance(b, tuple) else out[0]


def _entry(op: str, x, y):
    """One entry of ``x op y``: known where both are numbers and the result is exact (see ``EXACT_BELOW``),
    or where one is the operation's identity (``x * 1``, ``x + 0``, ``x - 0``, ``x / 1``: ``x`` itself, a
    symbol too); else None."""
    if type(x) is int and type(y) is int:
        v = ARITH[op](x, y)
        return v if v is not None and -EXACT_BELOW < v < EXACT_BELOW else None
    identity = 0 if op in ("Add", "Sub") else 1
    if type(y) is int and y == identity:
        return x
    if type(x) is int and x == identity and op in ("Add", "Mul"):
        return y
    return None
