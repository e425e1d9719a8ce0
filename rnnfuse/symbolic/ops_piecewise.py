"""Activations written piecewise: clips, and the comparisons of a cell value with a constant that a ``Where``
or a cast of the comparison selects with (a thresholded or leaky relu, an elu, jax's hard_tanh, tf2onnx's
float select ``Cast(x > t) * a + Cast(Not(x > t)) * b``), read as the native activation they compute."""

from __future__ import annotations

import numpy as np

from ..errors import Decline
from .algebra import Act, Poly
from .values import Const, SymTensor, Value, elementwise_poly, lead_axes


def hard_sigmoid(arg: Poly, s: float) -> Poly | None:
    """``s * (a*P + b)`` clipped to [0, 1] is HardSigmoid(a*s, b*s)(P), where a is the coefficient every
    non-constant term of ``arg`` shares: P is a gate's affine map, a clipped one (Clip(a*clip(x)+b, 0, 1)),
    an LSTM's new cell state ``f*c + i*g`` or a GRU candidate's ``x@W + r*(h@R + b)`` -- the argument the
    native op's activation receives. Terms with different coefficients have no one such reading."""
    coefs = {c for m, c in arg.terms.items() if m != ()}
    if len(coefs) != 1:
        return None
    (a,) = coefs
    unit = Poly({m: 1.0 for m in arg.terms if m != ()}, arg.atoms)
    return Poly.atom(Act("HardSigmoid", (a * s, arg.const_value() * s), unit))


class Above(Value):
    """``x > t`` (``strict``) or ``x >= t`` for a cell value x and a scalar t, or (``negated``) its negation
    (``x <= t``, ``x < t``): only usable as a Where's condition that makes an activation of x (see
    :func:`above_where`)."""

    __slots__ = ("poly", "t", "lead", "strict", "negated")

    def __init__(self, poly: Poly, t: float, lead: int, strict: bool = True, negated: bool = False):
        self.poly, self.t, self.lead, self.strict, self.negated = poly, t, lead, strict, negated


def above_where(cond: Above, pa: Poly, pb: Poly) -> Poly | None:
    """``Where(x > t, pa, pb)`` (or ``x >= t``) as an activation of x: ThresholdedRelu(t) (``x``, ``0``, strict);
    the branches meeting at t, so that the comparison's strictness does not matter: max(x, t) (``x``, ``t``),
    min(x, t) (``t``, ``x``: at t = 0 the input jax's elu gives its expm1, which only the negative branch reads),
    a clip of x to [lo, hi] (one branch a bound, the other x clipped at the other bound: jax's hard_tanh),
    LeakyRelu(alpha) (``x``, ``alpha * x``, t = 0), Elu(alpha) (``x``, ``alpha * exp(x) - alpha``, the exp's
    argument x or min(x, 0), t = 0); else None."""
    if cond.negated:  # (x <= t is not x > t: the branches swap)
        pa, pb = pb, pa
    x, t = cond.poly, cond.t
    if pa.key == x.key and pb.key == Poly.const(0.0).key and cond.strict:
        return Poly.atom(Act("ThresholdedRelu", (t,), x))
    clipped = _where_clip(x, t, pa, pb)
    if clipped is not None:
        return clipped
    if t != 0.0:
        return None
    below = clip_poly(x, float("-inf"), 0.0)
    if pa.key == x.key and pb.terms and set(pb.terms) == set(x.terms) and () not in x.terms:
        ratios = {pb.terms[m] / c for m, c in x.terms.items()}
        if len(ratios) == 1 and next(iter(ratios)) != 1.0:  # x above 0, alpha * x below it
            return Poly.atom(Act("LeakyRelu", (ratios.pop(),), x))
    if pa.key != x.key or len(pb.terms) != 2 or () not in pb.terms:
        return None
    (m, alpha), = ((m, c) for m, c in pb.terms.items() if m != ())
    e = pb.atoms[m[0]] if len(m) == 1 else None
    if not (isinstance(e, Act) and e.kind == "Exp" and e.arg.key in (x.key, below.key)) or pb.terms[()] != -alpha:
        return None
    return Poly.atom(Act("Elu", (alpha,), x))


def _where_clip(x: Poly, t: float, pa: Poly, pb: Poly) -> Poly | None:
    """``Where(x > t, pa, pb)`` when it is x clipped (both branches equal at x = t): max(x, t), min(x, t), or
    clip(x, lo, t) / clip(x, t, hi) with the other bound inside the branch that is x."""
    inf = float("inf")
    bound = Poly.const(t).key
    if pa.key == x.key and pb.key == bound:
        return clip_poly(x, t, inf)
    if pa.key == bound and pb.key == x.key:
        return clip_poly(x, -inf, t)
    for branch, other, lo_side in ((pb, pa, False), (pa, pb, True)):
        sa = branch.single_atom()
        c = sa[0] if sa and sa[1] == 1.0 and isinstance(sa[0], Act) and sa[0].kind == "Clip" else None
        if c is None or c.arg.key != x.key or other.key != bound:
            continue
        lo, hi = c.params
        if lo_side and lo == -inf and t <= hi:  # Where(x > t, min(x, hi), t)
            return clip_poly(x, t, hi)
        if not lo_side and hi == inf and lo <= t:  # Where(x > t, t, max(x, lo))
            return clip_poly(x, lo, t)
    return None


# comparison op -> (whether the cell value is the first operand, strict, negated) read as x > t / x >= t
# (op, which input is the constant) -> (strict, negated): x > t or x >= t, negated for the Less forms
COMPARISONS = {("Greater", 0): (True, False), ("GreaterOrEqual", 0): (False, False), ("Less", 0): (False, True),
                ("LessOrEqual", 0): (True, True), ("Greater", 1): (False, True), ("GreaterOrEqual", 1): (True, True),
                ("Less", 1): (True, False), ("LessOrEqual", 1): (False, False)}


def compare(ev, node, ins):
    a, b = ins
    k = 1 if isinstance(a, Const) and not isinstance(b, Const) else 0
    x, t = (a, b) if k == 0 else (b, a)
    if not isinstance(t, Const):
        raise Decline("a comparison of two cell values")
    strict, negated = COMPARISONS[(node.op_type, k)]
    return [Above(elementwise_poly(x), scalar(t, "the threshold"), lead_axes(x), strict, negated)]


def clip_poly(p: Poly, lo: float, hi: float) -> Poly:
    if lo == 0.0 and hi == 1.0:
        hs = hard_sigmoid(p, 1.0)
        if hs is not None:
            return hs
    if lo == 0.0 and hi == float("inf"):
        return Poly.atom(Act("Relu", (), p))
    return Poly.atom(Act("Clip", (lo, hi), p))


def scalar(v: Value | None, what: str) -> float | None:
    if v is None:
        return None
    if not isinstance(v, Const):
        raise Decline(f"{what} is not a constant")
    flat = v.arr.ravel()
    if flat.size == 0 or not np.all(flat == flat[0]):
        raise Decline(f"{what} is not a scalar")
    return float(flat[0])


class Indicator(Value):
    """``Cast(x > t)``: 1 where the comparison holds, else 0; only usable as a factor (see :func:`indicated`)."""

    __slots__ = ("cond", "lead")

    def __init__(self, cond: Above):
        self.cond, self.lead = cond, cond.lead


def indicated(ind: Indicator, other) -> SymTensor:
    """``Cast(x > t) * p``: ``Where(x > t, p, 0)``, when that is an activation of x (x times its own step: a
    thresholded relu) or zero (a zero else-branch of a select); Decline otherwise."""
    p = elementwise_poly(other)
    if p.key == Poly.const(0.0).key:
        return SymTensor(p, lead_axes(other))
    q = above_where(ind.cond, p, Poly.const(0.0))
    if q is None:
        raise Decline("a step function of a cell value that makes no activation")
    return SymTensor(q, lead_axes(other))
