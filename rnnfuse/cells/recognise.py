"""Cell recognition: the polynomials of one step -> a :class:`CellSpec` for a native LSTM, GRU or RNN op.

One recogniser serves every front end. It reads the cell's maths from the canonical polynomials built by
:mod:`rnnfuse.symbolic` (so node order, Gemm vs MatMul, Split vs Slice do not matter); each kind's matcher
extracts the gate weights as exact slices of the model's constants; then the step polynomials are
*re-derived* from the spec and must be identical to what the graph computes. Anything the spec does not
capture (an extra term, a peephole on the wrong cell state, a scaled state) makes the two differ, and the cell is
declined.
"""

from __future__ import annotations

from itertools import permutations

from ..errors import Decline
from ..symbolic import Act, LinAtom, Poly, State, StepInput, substitute
from .kinds import KINDS
from .match import with_diagonal_weights, with_uniform_bias
from .spec import CellSpec


class Recognised:
    """A spec plus which state symbol is its hidden state ``h`` and which its cell state ``c`` (or None)."""

    def __init__(self, spec: CellSpec, h: str, c: str | None):
        self.spec, self.h, self.c = spec, h, c


def recognise(new: dict[str, Poly], x: StepInput, states: dict[str, State]) -> Recognised:
    """Find the native cell whose step maths equal ``new`` (state symbol -> polynomial of its new value)."""
    syms = list(states)
    kinds = [k for k in KINDS.values() if len(k.states) == len(syms)]
    if not kinds:
        counts = " or ".join(str(n) for n in sorted({len(k.states) for k in KINDS.values()}))
        raise Decline(f"{len(syms)} recurrent states (a native cell has {counts})")
    reasons = []
    for kind in kinds:
        for order in permutations(syms):
            roles = dict(zip(kind.states, order))
            h, c = roles["h"], roles.get("c")
            try:
                spec = kind.match(new, x, states, h, c)
                polys = spec.step_polys(Poly.atom(x), Poly.atom(states[h]), Poly.atom(states[c]) if c else None)
                if any(not _same(polys[s], new[roles[s]]) for s in kind.states):
                    raise Decline(f"the step computes more than a {kind.op} cell")
                return Recognised(spec, h, c)
            except Decline as d:
                reasons.append((kind, order, d.reason))
    # report the reason of the first try whose outer form fits (else of the first try)
    fitting = [r for k, order, r in reasons if k.looks_like(new[order[k.states.index("h")]])]
    raise Decline((fitting or [reasons[0][2]])[0])


def _same(a: Poly, b: Poly) -> bool:
    if a.key == b.key:
        return True
    a, b = fold_offsets(a), fold_offsets(b)
    if a.key == b.key or canonical_clips(a).key == canonical_clips(b).key:
        return True
    if fold_diagonals(a).key == fold_diagonals(b).key:
        return True
    return fold_scales(a).key == fold_scales(b).key


def fold_scales(p: Poly) -> Poly:
    """A constant multiple of an affine map inside every activation, ``act(k * lin + b)``, written as the one
    map ``act(lin')`` whose weights and bias are ``lin``'s times k, plus b (:func:`.match._affine_map` reads a
    gate so: jax's forget gate ``sigmoid(-z)``)."""

    def fn(a):
        if not isinstance(a, Act):
            return None
        arg = fold_scales(a.arg)
        offset = arg.as_lin_offset()
        if offset is not None and offset[1] not in (0.0, 1.0):
            lin, k, b = offset
            arg = Poly.atom(LinAtom(with_uniform_bias(lin.scaled(k), b) if b else lin.scaled(k)))
        return Poly.atom(Act(a.kind, a.params, arg))

    return substitute(p, fn)


def fold_diagonals(p: Poly) -> Poly:
    """Elementwise state terms inside every activation, ``act(lin + u * h)``, written as the one affine map
    ``act(lin')`` whose weight for h is ``diag(u)`` (:func:`.match.with_diagonal_weights`): how a native op
    with a diagonal recurrent weight (IndRNN's) computes what the graph spells elementwise; so too a whole
    polynomial of that form (a linear cell, ``h + x @ W``, under the identity activation)."""

    def fn(a):
        if not isinstance(a, Act):
            return None
        arg = fold_diagonals(a.arg)
        lin = with_diagonal_weights(arg)
        return Poly.atom(Act(a.kind, a.params, Poly.atom(LinAtom(lin)) if lin is not None else arg))

    folded = substitute(p, fn)
    lin = with_diagonal_weights(folded)  # (a linear cell's new state itself, ``u * h + lin``: no activation)
    return Poly.atom(LinAtom(lin)) if lin is not None else folded


def canonical_clips(p: Poly) -> Poly:
    """One form for what a clip and an activation spell two ways: ``Relu(Clip(a, lo, c))`` for any lo <= 0 is
    ``Clip(a, 0, c)`` (a native op's clip before its Relu, lo = -c; Keras' relu6; its relu(max_value=c), written
    Relu, Min and Max). (An Affine activation is a polynomial already: see
    :func:`rnnfuse.cells.kind.activate`.)"""

    def fn(atom):
        if not isinstance(atom, Act):
            return None
        arg = canonical_clips(atom.arg)
        sa = arg.single_atom()
        inner = sa[0] if sa and sa[1] == 1.0 else None
        clip = inner.params if isinstance(inner, Act) and inner.kind == "Clip" else None
        if atom.kind == "Relu" and clip is not None and clip[1] > 0 and clip[0] <= 0:  # (any lower bound <= 0)
            return Poly.atom(Act("Clip", (0.0, inner.params[1]), inner.arg))
        return Poly.atom(Act(atom.kind, atom.params, arg))

    return substitute(p, fn)


def fold_offsets(p: Poly) -> Poly:
    """Scalar biases folded into the affine map they add to, inside every activation: ``act(lin + b)`` and
    ``act(... + m*lin + b*m)`` (a uniform recurrent bias under GRU's reset gate, ``r*(h@R) + b*r``) are written
    as ``act(lin + [b, b, ...])`` and ``act(... + m*(lin + [b, ...]))``: one canonical form for a bias vector whose
    entries are all equal, however the symbolic algebra split it."""

    def fn(a):
        if isinstance(a, Act):
            return Poly.atom(Act(a.kind, a.params, _fold_scalar_multiples(fold_offsets(a.arg))))
        return None

    return substitute(p, fn)


def _fold_scalar_multiples(p: Poly) -> Poly:
    """Fold each term ``b*m`` into a term ``1*m*lin`` of the same polynomial (m a product of atoms, maybe empty)."""
    for m, coef in p.terms.items():
        lin_keys = [k for k in m if isinstance(p.atoms[k], LinAtom)]
        if coef != 1.0 or len(lin_keys) != 1:
            continue
        rest = tuple(k for k in m if k != lin_keys[0])
        b = p.terms.get(rest)
        if not b:
            continue
        lin = p.atoms[lin_keys[0]].lin
        folded = Poly.atom(LinAtom(with_uniform_bias(lin, b)))
        for k in rest:
            folded = folded.mul(Poly.atom(p.atoms[k]))
        others = Poly({t: c for t, c in p.terms.items() if t not in (m, rest)}, p.atoms)
        return _fold_scalar_multiples(others.add(folded))
    return p
