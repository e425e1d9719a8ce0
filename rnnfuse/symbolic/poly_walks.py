"""Walks over a polynomial's atoms: substitution, the states and inputs it reads, states set to zero, the
step input masked and unmasked, and a loose comparison key (chains whose first step saw a zero initial
state)."""

from __future__ import annotations

from typing import Callable

from .algebra import (ACTIVATION, AFFINE, GATED_ROW, MASKED_INPUT, STATE, STEP_INPUT, Act, Atom, Lin, LinAtom, Poly,
                      State, StepInput, StepInputPart)


def substitute(p: Poly, fn: Callable[[Atom], Poly | None]) -> Poly:
    """Replace atoms by polynomials (``fn`` returns None to keep an atom); recurses into arguments."""
    cache: dict = {}

    def atom_poly(a: Atom) -> Poly:
        if a.key in cache:
            return cache[a.key]
        r = fn(a)
        if r is None:
            if isinstance(a, Act):
                r = Poly.atom(Act(a.kind, a.params, substitute(a.arg, fn)))
            else:
                r = Poly.atom(a)
        cache[a.key] = r
        return r

    out = Poly.const(0.0)
    for mono, c in p.terms.items():
        term = Poly.const(c)
        for k in mono:
            term = term.mul(atom_poly(p.atoms[k]))
        out = out.add(term)
    return out


def sources(p: Poly, follow_gated_rows: bool = False) -> set:
    """The keys of the states and step inputs ``p`` reads, through activations and weight matmuls.

    A gated row (GRU's ``r * h`` as a matmul operand) counts the states its product names; with
    ``follow_gated_rows`` its own polynomial is walked instead, so the states and inputs its gates read count
    too (which layer of a stacked step a state belongs to)."""
    out: set = set()
    stack = [p]
    while stack:
        q = stack.pop()
        for a in q.atoms.values():
            if isinstance(a, (State, StepInput)):
                out.add(a.key)
            elif isinstance(a, StepInputPart):
                out.add((STEP_INPUT, a.sym))
            elif isinstance(a, Act):
                stack.append(a.arg)
            elif isinstance(a, LinAtom):
                for s in a.lin.sources():
                    if s[0] in (STATE, STEP_INPUT):
                        out.add(s)
                    elif s[0] == MASKED_INPUT and len(s) > 5:  # (the input where the mask is valid, a state held
                        out.add((STEP_INPUT, s[2]))  # elsewhere: the cell below's output, the held state its own)
                    elif s[0] == GATED_ROW:
                        if not follow_gated_rows:
                            out.update(k for k in s[1] if k[0] == STATE)
                        elif s in a.lin.rows:
                            stack.append(a.lin.rows[s])
    return out


def zero_states(p: Poly, syms: set[str]) -> Poly:
    """``p`` with the given states set to zero (their matmul terms dropped too)."""

    def fn(a: Atom):
        if isinstance(a, State) and a.sym in syms:
            return Poly.const(0.0)
        if isinstance(a, LinAtom):
            keep = [(s, w) for s, w in a.lin.terms if not (s[0] == STATE and s[1] in syms) and not (s[0] == GATED_ROW and any(k[0] == STATE and k[1] in syms for k in s[1]))]
            if len(keep) == len(a.lin.terms):
                return None
            if not keep and not a.lin.biases:
                return Poly.const(0.0)
            return Poly.atom(LinAtom(Lin.make(keep, a.lin.biases, a.lin.ncols)))
        return None

    return substitute(p, fn)


def masked_inputs(p: Poly) -> set:
    """The :data:`MASKED_INPUT` keys ``p`` reads, through activations, weight matmuls and gated rows."""
    out: set = set()
    stack = [p]
    while stack:
        q = stack.pop()
        for a in q.atoms.values():
            if isinstance(a, Act):
                stack.append(a.arg)
            elif isinstance(a, LinAtom):
                out.update(s for s in a.lin.sources() if s[0] == MASKED_INPUT)
                stack.extend(a.lin.rows.values())
    return out


def unmask_inputs(p: Poly, mask_sym: str, valid: float) -> Poly:
    """``p`` with every step input scaled by mask ``mask_sym``, ``(a + b*m) * x``, that is ``x`` where the mask
    is ``valid`` (``a + b*valid == 1``) read as ``x``: what the cell computes at valid steps. Other masked inputs stay."""

    def row_key(src):
        # (a state held at masked steps beside the input, src[5], must be zero where the mask is valid)
        if src[0] == MASKED_INPUT and src[1] == mask_sym and src[3] + src[4] * valid == 1.0 and src[5:] in ((), (valid,)):
            return (STEP_INPUT, src[2])
        return src

    def fn(a: Atom):
        if not isinstance(a, LinAtom) or not masked_inputs(Poly.atom(a)):
            return None
        terms, rows = [], {}
        for src, w in a.lin.terms:
            if src[0] == GATED_ROW and src in a.lin.rows:  # r*h whose gate r reads the input: its key names r
                row = unmask_inputs(a.lin.rows[src], mask_sym, valid)
                (mono, _), = row.terms.items()
                src = (GATED_ROW, mono)
                rows[src] = row
            terms.append((row_key(src), w))
        return Poly.atom(LinAtom(Lin.make(terms, a.lin.biases, a.lin.ncols, rows)))

    return substitute(p, fn)


def loose_key(p: Poly):
    """Like ``p.key`` but biases compare by value (a folded ``0 @ W + b`` equals ``b``)."""

    def akey(a: Atom):
        if isinstance(a, LinAtom):
            s = a.lin.bias_sum()
            return (AFFINE, tuple(sorted(repr((t[0], t[1].key)) for t in a.lin.terms)), None if s is None else s.tobytes())
        if isinstance(a, Act):
            return (ACTIVATION, a.kind, a.params, loose_key(a.arg))
        return a.key

    items = []
    for mono, c in p.terms.items():
        items.append((tuple(sorted(repr(akey(p.atoms[k])) for k in mono)), c))
    return tuple(sorted(items, key=repr))
