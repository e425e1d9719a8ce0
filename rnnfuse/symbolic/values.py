"""What the step evaluator computes for a tensor: a constant, a polynomial tensor, a concatenation of rows
for a matmul, the step mask, a shape -- or an opaque value with the reason it has no symbolic form."""

from __future__ import annotations

import numpy as np

from ..errors import Decline, ProjectedAgain
from .algebra import (GATED_ROW, MASK, MASKED_INPUT, STATE, STEP_INPUT, STEP_INPUT_PART, ZERO_ROW, Act, ConstRef, Lin, LinAtom,
                      Mask, Poly, State, StepInput)


class Value:
    pass


class Const(Value):
    """A constant (numpy array)."""

    __slots__ = ("arr", "ref")

    def __init__(self, arr: np.ndarray, ref: ConstRef | None = None):
        self.arr = np.asarray(arr)
        self.ref = ref

    def constref(self) -> ConstRef:
        if self.ref is None:
            self.ref = ConstRef.of(self.arr)
        return self.ref


class Fill(Const):
    """A tensor of runtime shape filled with one value (``ConstantOfShape(Shape(...))`` zero states)."""


class RowConst(Const):
    """A constant that varies along units only but has the runtime batch shape ``[B, N]``
    (``0 @ W + b`` on a zero state of runtime shape). Held as ``[1, N]``: slices and shapes see two axes."""

    def __init__(self, arr: np.ndarray, ref: ConstRef | None = None):
        arr = np.asarray(arr)
        super().__init__(arr.reshape(1, -1) if arr.ndim < 2 else arr, ref)


class ShapeValue(Value):
    """The shape of a symbolic [*(1,)*lead, B, N] value: known dims, None for the batch."""

    __slots__ = ("dims",)

    def __init__(self, dims: list):
        self.dims = dims


class SymTensor(Value):
    """A symbolic [*(1,)*lead, B, N] tensor given by a polynomial."""

    __slots__ = ("poly", "lead")

    def __init__(self, poly: Poly, lead: int = 0):
        self.poly, self.lead = poly, lead


class ConcatRows(Value):
    """A concatenation of leaf rows (``[x, h]``) usable as the left operand of a weight matmul."""

    __slots__ = ("segments", "lead")

    def __init__(self, segments: tuple, lead: int = 0):
        self.segments, self.lead = segments, lead  # (src_key, width, poly of the segment)


class Transposed(Value):
    """``inner`` ([B, N], a step value) transposed to [N, B] (a vmapped per-example cell: ``W @ h.T``)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Value):
        self.inner = inner


class BoolMask(Value):
    """The step mask (``neg`` for its negation), shape [B, 1] (``unit``) or [B]."""

    __slots__ = ("sym", "neg", "unit")

    def __init__(self, sym: str, neg: bool, unit: bool):
        self.sym, self.neg, self.unit = sym, neg, unit

    def as_number(self) -> Value:
        """The mask cast to a number: 1 where it holds, 0 elsewhere (``[B]``: usable once unsqueezed)."""
        p = Poly.atom(Mask(self.sym))
        p = Poly.const(1.0).sub(p) if self.neg else p
        return SymTensor(p, 0) if self.unit else MaskVector(p)


class UnitGroups(Value):
    """A [B, N] step value viewed as [B, groups, width] (``gates.view(B, 4, H)``, to be unbound into gates):
    group k is units ``k*width .. (k+1)*width`` of ``poly``."""

    __slots__ = ("poly", "groups", "width")

    def __init__(self, poly: Poly, groups: int, width: int):
        self.poly, self.groups, self.width = poly, groups, width

    def take(self, start: int, stop: int) -> Poly:
        """Groups ``start .. stop`` as one polynomial of their units."""
        return self.poly.cols(start * self.width, stop * self.width)


class Opaque(Value):
    """A value with no symbolic form, and why; ``error`` the kind of Decline it raises where it is used (a
    :class:`~rnnfuse.errors.ProjectedAgain` makes the front end read the step's input another way)."""

    __slots__ = ("why", "error")

    def __init__(self, why: str, error: type = Decline):
        self.why, self.error = why, error


# activations whose ONNX RNN names and params rnnfuse knows
ACTIVATIONS = {
    "Sigmoid": (),
    "Tanh": (),
    "Relu": (),
    "HardSigmoid": ("alpha", "beta"),
    "LeakyRelu": ("alpha",),
    "ThresholdedRelu": ("alpha",),
    "Elu": ("alpha",),
    "Softsign": (),
    "Softplus": (),
    "ScaledTanh": ("alpha", "beta"),  # (no ONNX op: written as a*tanh(b*x), read by ops_math's _tanh and _scale)
}
ACTIVATION_DEFAULTS = {"HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.01,), "ThresholdedRelu": (1.0,), "Elu": (1.0,)}


class MaskVector(SymTensor):
    """A 0/1 mask of shape [B] (no trailing unit axis): only usable after Unsqueeze/Reshape to [B, 1]."""


# ---- coercions


def as_poly(v: Value, what: str = "value") -> Poly:
    if isinstance(v, SymTensor):
        return v.poly  # leading unit axes ([1, B, H]) do not change the maths
    if isinstance(v, Const):
        return const_poly(v)
    if isinstance(v, ConcatRows):
        if len(v.segments) == 1 and not v.lead:
            return v.segments[0][2]
        raise Decline("a concatenation of inputs is used elementwise")
    if isinstance(v, Opaque):
        raise v.error(v.why)
    if isinstance(v, BoolMask):
        raise Decline("a boolean mask is used as a number without Cast")
    raise Decline(f"{what} has no symbolic form")


def const_poly(v: Const) -> Poly:
    arr = v.arr
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.floating):
        raise Decline("a non-float constant in cell maths")
    flat = arr.ravel()
    if flat.size == 0:
        raise Decline("an empty constant")
    if np.all(flat == flat[0]):
        return Poly.const(float(flat[0]))
    # a vector along the last axis (a bias), possibly with leading unit dims or identical rows
    vec = _as_vector(arr)
    if vec is None:
        raise Decline("a constant that varies along the batch axis")
    ref = v.constref() if arr.ndim == 1 else ConstRef.of(vec)
    return Poly.atom(LinAtom(Lin.make([], [ref], int(vec.shape[0]))))


def _as_vector(arr: np.ndarray) -> np.ndarray | None:
    if arr.ndim == 1:
        return arr
    flat = arr.reshape(-1, arr.shape[-1])
    if np.all(flat == flat[0:1]):
        return flat[0]
    return None


def as_rows(v: Value) -> ConcatRows:
    """The left operand of a weight matmul: a leaf, a gated state (r*h) or a concatenation of those."""
    if isinstance(v, ConcatRows):
        return v
    if isinstance(v, SymTensor):
        p = v.poly
        if not p.terms:  # identically zero (r * h with a zero initial h): contributes nothing
            return ConcatRows((((ZERO_ROW,), None, Poly.const(0.0)),), v.lead)
        if len(p.terms) == 1:
            (m, c), = p.terms.items()
            if c == 1.0 and m:
                atoms = [p.atoms[k] for k in m]
                if len(atoms) == 1 and (isinstance(atoms[0], (State, StepInput)) or atoms[0].key[0] == STEP_INPUT_PART):
                    a = atoms[0]
                    return ConcatRows(((a.key, a.ncols, p),), v.lead)
                if any(isinstance(a, State) for a in atoms) and all(isinstance(a, (State, Act)) for a in atoms):
                    key = (GATED_ROW, m)
                    width = max((a.ncols or 0) for a in atoms) or None
                    return ConcatRows(((key, width, p),), v.lead)
        masked = _masked_input(p)
        if masked is not None:
            return ConcatRows(((masked, p.atoms[(STEP_INPUT, masked[2])].ncols, p),), v.lead)
        sa = p.single_atom()
        if sa is not None and isinstance(sa[0], LinAtom) and sa[0].lin.sources() and \
                all(src[0] == STEP_INPUT for src in sa[0].lin.sources()):  # (the step input read as x @ K + b)
            raise ProjectedAgain(f"a matmul whose left operand is an affine map of the step input ({p!r})")
        raise Decline(f"a matmul whose left operand is not a step input or state ({p!r})")
    if isinstance(v, Opaque):
        raise v.error(v.why)
    if isinstance(v, Fill) and float(v.arr) == 0.0:
        return ConcatRows((((ZERO_ROW,), None, Poly.const(0.0)),))  # a zero state of runtime shape, e.g. concat([x, 0])
    if isinstance(v, Const) and not isinstance(v, RowConst) and v.arr.ndim == 2 and v.arr.size and not v.arr.any():
        return ConcatRows((((ZERO_ROW,), None, Poly.const(0.0)),))  # a zero state of static shape [B, N]
    if isinstance(v, Const):
        raise Decline("a matmul of two constants")
    raise Decline("a matmul of an unsupported value")


def _masked_input(p: Poly) -> tuple | None:
    """The :data:`MASKED_INPUT` key of ``(a + b*m) * x`` (the step input zeroed at masked steps, ``x * m`` or
    ``Where(m, x, 0)``), or None. Whether it is ``x`` where the cell's result is seen is for
    :func:`rnnfuse.step.analyse` to say, once it knows the mask the states keep.

    Also ``m*x + (1 - m)*S`` for a state S (the cell below's masked new state, ``Where(m, new, h)``, read by a
    cell stacked on it in the same step): x where m is 1, whatever at masked steps; its key ends with the mask
    value at which the held part is zero (1.0 here; 0.0 for ``(1 - m)*x + m*S``)."""
    a = b = 0.0
    x = m = None
    held: dict = {}  # state key -> [coefficient of S, coefficient of m*S]
    for mono, c in p.terms.items():
        inputs = [k for k in mono if k[0] == STEP_INPUT]
        masks = [k for k in mono if k[0] == MASK]
        states = [k for k in mono if k[0] == STATE]
        if len(masks) > 1 or len(mono) != len(inputs) + len(masks) + len(states) or len(inputs) + len(states) != 1:
            return None
        if masks:
            if m not in (None, masks[0]):
                return None
            m = masks[0]
        if states:
            held.setdefault(states[0], [0.0, 0.0])[1 if masks else 0] += c
            continue
        if x not in (None, inputs[0]):
            return None
        x = inputs[0]
        if masks:
            b += c
        else:
            a += c
    if x is None or m is None:
        return None
    if not held:
        return (MASKED_INPUT, m[1], x[1], a, b)
    zero_at = {1.0 if cs[0] == -cs[1] else 0.0 if cs[0] == 0.0 else None for cs in held.values()}
    if len(zero_at) != 1 or None in zero_at:
        return None
    return (MASKED_INPUT, m[1], x[1], a, b, zero_at.pop())


def weight_of(v: Value, what: str) -> ConstRef:
    if isinstance(v, Const):
        return v.constref()
    if isinstance(v, Opaque):
        raise Decline(f"{what} is not a constant: weights are computed at runtime ({v.why})")
    raise Decline(f"{what} is not a constant: weights are computed at runtime")


def weighted(v: Value, w: ConstRef) -> tuple[Lin, int]:
    """``(v @ w as a linear map, the leading unit axes of the result)`` for the left operand ``v`` of a weight
    matmul: what :func:`as_rows` reads, or a sum of several step inputs (``(y1_t + x_t) @ W``: a residual
    stack's upper cell reads the cell below's output plus the step input, each through the same weight)."""
    lin = input_sum_lin(v, w)
    if lin is not None:
        return lin, v.lead
    row = as_rows(v)
    return matmul_lin(row, w), row.lead


def input_sum_lin(v: Value, w: ConstRef) -> Lin | None:
    """``sum_k c_k (a_k @ w)`` for ``v = sum_k c_k a_k``, two or more terms each a step input (or its columns),
    a carried state (``(x_t + h) @ W``: one weight for both), or an affine map of step inputs (``proj(x_t) =
    x_t @ P + b``, whose product is ``x_t @ (P w) + b w``), at least one a step input itself; None for any
    other operand."""
    if not isinstance(v, SymTensor) or len(v.poly.terms) < 2:
        return None
    p, lin, direct = v.poly, None, False
    for mono, c in p.terms.items():
        a = p.atoms[mono[0]] if len(mono) == 1 else None
        if a is not None and (isinstance(a, (StepInput, State)) or a.key[0] == STEP_INPUT_PART):
            # (a state beside the step input: (x_t + h) @ W, tied input and recurrent weights)
            part = matmul_lin(ConcatRows(((a.key, a.ncols, Poly.atom(a)),), v.lead), w)
            direct |= not isinstance(a, State)
        elif isinstance(a, LinAtom) and not a.lin.rows and all(
                src[0] == STEP_INPUT for src in a.lin.sources()) and a.lin.ncols == w.arr.shape[0]:
            part = Lin.make([(src, m.then(w)) for src, m in a.lin.terms], [b.then(w) for b in a.lin.biases], w.ncols)
        else:
            return None
        part = part if c == 1.0 else part.scaled(c)
        lin = part if lin is None else lin.plus(part)
    return lin if direct else None


def input_product_lin(v: Value, w: ConstRef) -> Lin | None:
    """``v @ w`` for an operand made of several step inputs: their sum (:func:`input_sum_lin`) or their
    concatenation (``cat(y1_t, x_t) @ W``: a skip connection read by a native op inside the step); None for any
    other operand (a single step input, a state among the pieces)."""
    lin = input_sum_lin(v, w) if isinstance(v, SymTensor) and v.lead == 1 else None
    if lin is not None or not isinstance(v, (SymTensor, ConcatRows)):
        return lin
    try:
        row = as_rows(v)
    except Decline:
        return None
    if row.lead != 1 or len(row.segments) < 2 or any(src[0] not in (STEP_INPUT, STEP_INPUT_PART) for src, _, _ in row.segments):
        return None
    return matmul_lin(row, w)


def matmul_lin(row: ConcatRows, w: ConstRef) -> Lin:
    if w.arr.ndim != 2:
        raise Decline(f"a matmul with a rank-{w.arr.ndim} weight")
    terms = []
    rows = {}
    r0 = 0
    unknown = [i for i, seg in enumerate(row.segments) if seg[1] is None]
    if len(unknown) == 1 and len(row.segments) > 1:  # e.g. [x, h] with h's width only implied by W
        known = sum(seg[1] for seg in row.segments if seg[1] is not None)
        k = unknown[0]
        seg = row.segments[k]
        row = ConcatRows(row.segments[:k] + ((seg[0], int(w.arr.shape[0]) - known, seg[2]),) + row.segments[k + 1:], row.lead)
    for src, width, seg_poly in row.segments:
        if src[0] == ZERO_ROW:
            r0 += width if width is not None else int(w.arr.shape[0]) - r0
            continue
        if src[0] == GATED_ROW:
            rows[src] = seg_poly
        if width is None:
            if len(row.segments) != 1:
                raise Decline("a concatenation of inputs of unknown width")
            width = w.arr.shape[0]
        if src[0] == STEP_INPUT_PART:  # columns of the step input: its weight placed at their rows
            _, sym, start, _, total = src
            terms.append(((STEP_INPUT, sym), w.rows(r0, r0 + width).placed_rows(start, total)))
        else:
            terms.append((src, w.rows(r0, r0 + width)))
        r0 += width
    if r0 != w.arr.shape[0]:
        raise Decline(f"matmul widths do not match ({r0} vs {w.arr.shape[0]})")
    return Lin.make(terms, [], w.ncols, rows)


def lead_axes(*vals) -> int:
    """Leading unit axes of an elementwise result: broadcasting keeps the most."""
    leads = [v.lead for v in vals if isinstance(v, (SymTensor, ConcatRows))]
    return max(leads) if leads else 0


def elementwise_poly(v: Value) -> Poly:
    if isinstance(v, MaskVector):
        raise Decline("a [B] mask broadcast against [B, H] (batch would align with units)")
    if isinstance(v, SymTensor):
        return v.poly
    return as_poly(v)
