"""Step semantics of ONNX arithmetic, activations, matmuls, casts and the mask's Where/Not (activations written
piecewise, with clips and comparisons, are read in :mod:`.ops_piecewise`)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from .. import op_args
from ..errors import Decline
from ..graph import attr
from .algebra import Act, LinAtom, Mask, Poly
from .ops_piecewise import COMPARISONS, Above, Indicator, above_where, clip_poly, compare, hard_sigmoid, indicated, scalar
from .values import (
    ACTIVATIONS,
    ACTIVATION_DEFAULTS,
    BoolMask,
    Const,
    Fill,
    MaskVector,
    SymTensor,
    Value,
    elementwise_poly,
    const_poly,
    lead_axes,
    weight_of,
    weighted,
)


def _binary(ev, node, ins):
    a, b = ins
    if node.op_type == "Mul" and isinstance(a, Indicator) != isinstance(b, Indicator):
        return [indicated(a, b) if isinstance(a, Indicator) else indicated(b, a)]
    lead = lead_axes(a, b)
    pa, pb = elementwise_poly(a), elementwise_poly(b)
    op = node.op_type
    if op == "Add":
        return [SymTensor(_activation_identity(pa.add(pb)), lead)]
    if op == "Sub":
        return [SymTensor(_activation_identity(pa.sub(pb)), lead)]
    if op == "Mul":
        if pb.is_const():
            return [SymTensor(_scale(pa, pb.const_value()), lead)]
        if pa.is_const():
            return [SymTensor(_scale(pb, pa.const_value()), lead)]
        return [SymTensor(pa.mul(pb), lead)]
    if op == "Div":
        if not pb.is_const():
            q = _softsign(pa, pb)
            q = _logistic(pa, pb) if q is None else q
            if q is not None:
                return [SymTensor(q, lead)]
        if not pb.is_const():
            raise Decline("division by a cell value that is not 1 + exp(q) (a logistic sigmoid) or 1 + |x| (softsign)")
        if pb.const_value() == 0.0:
            raise Decline("division by zero")
        return [SymTensor(_scale(pa, 1.0 / pb.const_value()), lead)]
    raise Decline(op)


def _activation_identity(p: Poly) -> Poly:
    """One activation written through another: ``0.5 * tanh(0.5 * z) + 0.5`` is ``sigmoid(z)``, and ``2 *
    sigmoid(2 * z) - 1`` is ``tanh(z)`` (exact identities; the native op computes the activation itself).
    Any other sum is left as it is."""
    if len(p.terms) != 2 or () not in p.terms:
        return p
    b = p.terms[()]
    ((m, coeff),) = [(m, c) for m, c in p.terms.items() if m != ()]
    if len(m) != 1 or not isinstance(p.atoms[m[0]], Act):
        return p
    atom = p.atoms[m[0]]
    if atom.kind in ("Tanh", "ScaledTanh"):
        alpha, beta = atom.params if atom.kind == "ScaledTanh" else (1.0, 1.0)
        if _near(coeff * alpha, 0.5) and _near(b, 0.5):  # 0.5 * tanh(beta * a) + 0.5 = sigmoid(2 * beta * a)
            return Poly.atom(Act("Sigmoid", (), atom.arg.scale(2.0 * beta)))
    if atom.kind == "Sigmoid" and _near(coeff, 2.0) and _near(b, -1.0):  # 2 * sigmoid(a) - 1 = tanh(a / 2)
        return _tanh(atom.arg.scale(0.5))
    return p


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-7 * abs(b)


def _scale(p: Poly, c: float) -> Poly:
    """``c * p``; ``clip(a*L + b, 0, k) / k`` becomes HardSigmoid(a/k, b/k)(L)."""
    sa = p.single_atom()
    if sa is not None:
        atom, coeff = sa
        if isinstance(atom, Act) and atom.kind == "Clip" and atom.params[0] == 0.0 and atom.params[1] > 0:
            k = atom.params[1]
            if abs(coeff * c * k - 1.0) < 1e-6:
                hs = hard_sigmoid(atom.arg, 1.0 / k)
                if hs is not None:
                    return hs
        if isinstance(atom, Act) and atom.kind in ("Tanh", "ScaledTanh"):
            # a * tanh(b * x) is ScaledTanh(a, b)(x); a scale of +-1 or 0 stays a coefficient (n - z*n must cancel)
            alpha, beta = atom.params if atom.kind == "ScaledTanh" else (1.0, 1.0)
            if abs(alpha * coeff * c) not in (0.0, 1.0):
                return Poly.atom(Act("ScaledTanh", (alpha * coeff * c, beta), atom.arg))
    return p.scale(c)


def _neg(ev, node, ins):
    return [SymTensor(elementwise_poly(ins[0]).scale(-1.0), lead_axes(ins[0]))]


def _identity(ev, node, ins):
    return [ins[0]]


def _dropout(ev, node, ins):
    """Dropout at inference (no training_mode, or a constant false one) is the identity."""
    if len(ins) > 2 and ins[2] is not None:
        if not isinstance(ins[2], Const) or bool(np.asarray(ins[2].arr).any()):
            raise Decline("a Dropout in training mode")
    if len(node.output) > 1 and node.output[1]:
        raise Decline("a Dropout whose mask is used")
    return [ins[0]]


def _activation(kind: str):
    def h(ev, node, ins):
        names = ACTIVATIONS[kind]
        defaults = ACTIVATION_DEFAULTS.get(kind, ())
        params = tuple(attr(node, n, d) for n, d in zip(names, defaults))
        p = elementwise_poly(ins[0])
        if kind == "Tanh":
            return [SymTensor(_tanh(p), lead_axes(ins[0]))]
        return [SymTensor(Poly.atom(Act(kind, params, p)), lead_axes(ins[0]))]

    return h


def _celu(ev, node, ins):
    """``Celu(alpha)(x) = max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``, torch's ``F.celu``: with alpha 1
    (its default) it is Elu(1), a native activation; another alpha is ``alpha * Elu(1)(x / alpha)``, a scaled
    state no native op carries."""
    alpha = float(attr(node, "alpha", 1.0))
    if alpha != 1.0:
        raise Decline(f"Celu with alpha {alpha:g}: only alpha 1 (Elu(1)) is a native activation")
    return [SymTensor(Poly.atom(Act("Elu", (1.0,), elementwise_poly(ins[0]))), lead_axes(ins[0]))]


def _tanh(p: Poly) -> Poly:
    """``tanh(b * x)`` is ScaledTanh(1, b)(x): the scale stays an activation parameter, the weights exact."""
    lo = p.as_lin_offset()
    if lo is not None and lo[2] == 0.0 and lo[1] != 1.0:
        return Poly.atom(Act("ScaledTanh", (1.0, lo[1]), Poly.atom(LinAtom(lo[0]))))
    coefs = set(p.terms.values())
    if lo is None and len(coefs) == 1 and () not in p.terms and coefs != {1.0}:  # tanh(b * (f*c + i*g))
        (b,) = coefs
        return Poly.atom(Act("ScaledTanh", (1.0, b), p.scale(1.0 / b)))
    return Poly.atom(Act("Tanh", (), p))


def _abs(ev, node, ins):
    return [SymTensor(Poly.atom(Act("Abs", (), elementwise_poly(ins[0]))), lead_axes(ins[0]))]


def _softsign(pa: Poly, pb: Poly) -> Poly | None:
    """``x / (1 + |x|)`` (torch's softsign) is Softsign(x)."""
    if pb.key == Poly.const(1.0).add(Poly.atom(Act("Abs", (), pa))).key:
        return Poly.atom(Act("Softsign", (), pa))
    return None


def _exp(ev, node, ins):
    return [SymTensor(Poly.atom(Act("Exp", (), elementwise_poly(ins[0]))), lead_axes(ins[0]))]


def _reciprocal(ev, node, ins):
    q = _logistic(Poly.const(1.0), elementwise_poly(ins[0]))  # (constants are folded before handlers)
    if q is None:
        raise Decline(f"a reciprocal of a cell value that is not 1 + exp(q) (a logistic sigmoid): 1 / ({elementwise_poly(ins[0])!r})")
    return [SymTensor(q, lead_axes(ins[0]))]


def _logistic(num: Poly, den: Poly) -> Poly | None:
    """The logistic sigmoid written out: ``num / (1 + exp(q))`` is ``num * Sigmoid(-q)``, and
    ``k * exp(q) / (1 + exp(q))`` is ``k * Sigmoid(q)``. (An exp with a coefficient other than 1 in the
    denominator would be a shifted argument, q + log(c): not exact in float, so not read.)"""
    if len(den.terms) != 2 or den.terms.get(()) != 1.0:
        return None
    (m, c), = ((m, c) for m, c in den.terms.items() if m != ())
    e = den.atoms[m[0]] if len(m) == 1 else None
    if c != 1.0 or not (isinstance(e, Act) and e.kind == "Exp"):
        return None
    ns = num.single_atom()
    if ns is not None and ns[0].key == e.key:
        return Poly.atom(Act("Sigmoid", (), e.arg)).scale(ns[1])
    sig = Poly.atom(Act("Sigmoid", (), e.arg.scale(-1.0)))
    return sig.scale(num.const_value()) if num.is_const() else num.mul(sig)


def _clip(ev, node, ins):
    lo, hi = op_args.clip_bounds(node, ev.opset, lambda i: scalar(ins[i], ("Clip min", "Clip max")[i - 1]))
    return [SymTensor(clip_poly(elementwise_poly(ins[0]), lo, hi), lead_axes(ins[0]))]


def _minmax(ev, node, ins):
    if len(ins) != 2:
        raise Decline(f"{node.op_type} with {len(ins)} inputs")
    a, b = ins
    if isinstance(a, Const):
        a, b = b, a
    c = scalar(b, f"{node.op_type} operand")
    p = elementwise_poly(a)
    sa = p.single_atom()
    if node.op_type == "Max":
        # Max(Clip(x, -inf, hi), lo) -> Clip(x, lo, hi);  Max(x, 0) -> Relu
        if sa and isinstance(sa[0], Act) and sa[0].kind == "Clip" and sa[1] == 1.0 and sa[0].params[0] == float("-inf"):
            return [SymTensor(clip_poly(sa[0].arg, c, sa[0].params[1]), lead_axes(a))]
        return [SymTensor(clip_poly(p, c, float("inf")), lead_axes(a))]
    if sa and isinstance(sa[0], Act) and sa[1] == 1.0:
        if sa[0].kind == "Clip" and sa[0].params[1] == float("inf"):
            return [SymTensor(clip_poly(sa[0].arg, sa[0].params[0], c), lead_axes(a))]
        if sa[0].kind == "Relu":
            return [SymTensor(clip_poly(sa[0].arg, 0.0, c), lead_axes(a))]
    return [SymTensor(clip_poly(p, float("-inf"), c), lead_axes(a))]


def _matmul(ev, node, ins):
    a, b = ins
    lin, lead = weighted(a, weight_of(b, "the matmul weight"))
    return [SymTensor(Poly.atom(LinAtom(lin)), lead)]


def einsum_as_matmul(node, ins) -> tuple[int, bool]:
    """``(which operand is the step value, whether the weight is read transposed)`` of an Einsum that is a
    matmul of a [B, K] step value by a constant [K, N] (``bk,kn->bn``) or its transpose (``bk,nk->bn``),
    operands in either order (jnp.einsum, torch.einsum); Decline for any other Einsum."""
    if len(ins) != 2:
        raise Decline(f"an Einsum of {len(ins)} operands")
    eq = op_args.einsum_terms(node)
    if eq is None or len(eq[0]) != 2 or any(len(t) != 2 for t in eq[0] + [eq[1]]):
        raise Decline(f"an Einsum that is not a matmul of two matrices ({op_args.einsum_equation(node)})")
    k = 1 if isinstance(ins[0], Const) and not isinstance(ins[0], Fill) else 0
    transposed = op_args.einsum_matmul(node, k)
    if transposed is None:
        raise Decline(f"an Einsum that is not a matmul of a step value by a weight ({op_args.einsum_equation(node)})")
    return k, transposed


def _einsum(ev, node, ins):
    k, transposed = einsum_as_matmul(node, ins)
    w = weight_of(ins[1 - k], "the Einsum weight")
    lin, lead = weighted(ins[k], w.T() if transposed else w)
    return [SymTensor(Poly.atom(LinAtom(lin)), lead)]


def _gemm(ev, node, ins):
    a, b = ins[0], ins[1]
    if attr(node, "transA", 0):
        raise Decline("Gemm with transA")
    w = weight_of(b, "the Gemm weight")
    if attr(node, "transB", 0):
        w = w.T()
    lin, _ = weighted(a, w)
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    p = Poly.atom(LinAtom(lin))
    if alpha != 1.0:
        p = Poly.atom(LinAtom(lin.scaled(alpha)))
    if len(ins) > 2 and ins[2] is not None:
        if isinstance(ins[2], Const):
            arr = ins[2].arr if beta == 1.0 else (ins[2].arr * np.asarray(beta, dtype=ins[2].arr.dtype)).astype(ins[2].arr.dtype)
            cp = const_poly(Const(arr) if beta != 1.0 else ins[2])
        else:
            cp = elementwise_poly(ins[2]).scale(beta) if beta != 1.0 else elementwise_poly(ins[2])  # C may be h @ R (tf2onnx)
        p = p.add(cp)
    return [SymTensor(p)]


def _cast(ev, node, ins):
    v = ins[0]
    to = attr(node, "to")
    if isinstance(v, BoolMask):
        return [v if to == onnx.TensorProto.BOOL else v.as_number()]
    if isinstance(v, SymTensor) and _is_mask_value(v.poly):  # a 0/1 mask as a number: any type holds it
        sense = mask_sense(v.poly)
        if to != onnx.TensorProto.BOOL:
            return [v]
        if sense is not None:
            return [BoolMask(sense[0], sense[1], True)]
    if isinstance(v, SymTensor):
        src = ev.graph.model.elem_type(node.input[0])
        if to in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16) and (src is None or src == to):
            return [v]
        raise Decline("a cast of a cell value to another type")
    if isinstance(v, Above) and to in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
        return [Indicator(v)]  # (tf2onnx's float select: Cast(x > t) * a + Cast(Not(x > t)) * b)
    raise Decline("an unsupported cast")


def _is_mask_value(p: Poly) -> bool:
    """A value of the step mask alone (one value per batch row, [B, 1])."""
    return bool(p.atoms) and all(isinstance(a, Mask) for a in p.atoms.values())


def mask_sense(p: Poly) -> tuple[str, bool] | None:
    """``(symbol, negated)`` when ``p`` is the 0/1 step mask ``m`` or ``1 - m``."""
    if len(p.atoms) != 1:
        return None
    (key, a), = p.atoms.items()
    if not isinstance(a, Mask):
        return None
    if p.terms == {(key,): 1.0}:
        return a.sym, False
    if p.terms == {(key,): -1.0, (): 1.0}:
        return a.sym, True
    return None


def _compare(ev, node, ins):
    """A comparison; of the 0/1 step mask (or 1 - m) with a threshold between its two values, that mask again
    (torch's ``m_t > 0`` of a ``mask.float()`` read per step)."""
    k = 1 if isinstance(ins[0], Const) and not isinstance(ins[1], Const) else 0
    x, t = ins[k], ins[1 - k]
    sense = mask_sense(x.poly) if isinstance(x, SymTensor) and isinstance(t, Const) and _is_mask_value(x.poly) else None
    if sense is not None:
        c = scalar(t, "the threshold")
        strict, negated = COMPARISONS[(node.op_type, k)]
        if (0.0 <= c < 1.0) if strict else (0.0 < c <= 1.0):  # (true for the value 1 alone)
            return [BoolMask(sense[0], sense[1] != negated, not isinstance(x, MaskVector))]
    return compare(ev, node, ins)


def _reduce_unit_axis(ev, node, ins):
    """ReduceMin / ReduceMax of the [B, 1] step mask over its unit axis, keeping it (Keras 3's
    ``all(not mask, axis=-1, keepdims=True)`` on the JAX backend): the mask itself."""
    v = ins[0]
    if not isinstance(v, SymTensor) or not _is_mask_value(v.poly):
        raise Decline(f"{node.op_type} of a cell value")
    axes = op_args.axes(node, ev.opset, lambda i: ins[i].arr if i < len(ins) and isinstance(ins[i], Const) else None)
    rank = v.lead + 2
    if not attr(node, "keepdims", 1) or not axes or any(a not in (-1, rank - 1) for a in axes):
        raise Decline(f"{node.op_type} of the step mask over an axis other than its last, or not keeping it")
    return [v]


def _not(ev, node, ins):
    v = ins[0]
    if isinstance(v, BoolMask):
        return [BoolMask(v.sym, not v.neg, v.unit)]
    if isinstance(v, Above):
        return [Above(v.poly, v.t, v.lead, v.strict, not v.negated)]
    raise Decline("Not of a non-mask value")


def equal_branches(ins) -> Value | None:
    """The value of ``Where(c, a, b)`` whose branches are one polynomial, whatever ``c`` is (torch.lerp is
    written ``Where(|w| < 0.5, start + w * (end - start), end - (end - start) * (1 - w))``), else None."""
    if len(ins) != 3 or not all(isinstance(v, SymTensor) for v in ins[1:]):
        return None
    a, b = ins[1], ins[2]
    return SymTensor(a.poly, lead_axes(a, b)) if a.poly.key == b.poly.key else None


def _where(ev, node, ins):
    cond, a, b = ins
    if isinstance(cond, Const) and cond.arr.dtype == np.bool_ and cond.arr.size and (cond.arr.all() or not cond.arr.any()):
        return [a if cond.arr.all() else b]  # a constant condition (Keras on torch: ``t < T`` with T static)
    if isinstance(cond, Above):  # Where(x > t, x, 0): ThresholdedRelu(t)(x); Where(x > 0, x, a*(exp(x) - 1)): Elu(a)
        p = above_where(cond, elementwise_poly(a), elementwise_poly(b))
        if p is None:
            raise Decline("Where on a comparison of a cell value that is not a thresholded or leaky relu, an elu "
                          "or a clip")
        return [SymTensor(p, lead_axes(a, b))]
    if not isinstance(cond, BoolMask):
        raise Decline("Where with a condition that is not the step mask")
    if not cond.unit:
        raise Decline("a [B] mask broadcast against [B, H] (batch would align with units)")
    m = Poly.atom(Mask(cond.sym))
    pa, pb = elementwise_poly(a), elementwise_poly(b)
    if cond.neg:
        pa, pb = pb, pa
    lead = lead_axes(a, b)
    return [SymTensor(m.mul(pa).add(Poly.const(1.0).sub(m).mul(pb)), lead)]


HANDLERS: dict[str, Callable] = {
    "Add": _binary,
    "Sub": _binary,
    "Mul": _binary,
    "Div": _binary,
    "Neg": _neg,
    "Identity": _identity,
    "Dropout": _dropout,
    "Clip": _clip,
    "Max": _minmax,
    "Min": _minmax,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
    "ReduceMin": _reduce_unit_axis,
    "ReduceMax": _reduce_unit_axis,
    "Cast": _cast,
    "Not": _not,
    "Where": _where,
}
for _k in ACTIVATIONS:
    HANDLERS[_k] = _activation(_k)
HANDLERS["Abs"] = _abs
HANDLERS["Celu"] = _celu
HANDLERS["Exp"] = _exp
HANDLERS["Reciprocal"] = _reciprocal
for _k in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual"):
    HANDLERS[_k] = _compare
