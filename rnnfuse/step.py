"""From a step's polynomials to roles: which states are the cell's, how the mask acts, what each output is.

Shared by every front end that has an explicit step (Loop and Scan bodies, TorchScript loops). Masking is
read from the maths: a masked state update is ``m * new + (1 - m) * old`` (however it is written), so the
polynomial of the update splits into the terms with the mask atom and those without.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cells import Recognised, recognise
from .errors import Decline
from .recurrence import CARRY, NONE, ZERO, FinalOutput, Init, SeqOutput
from .symbolic import GATED_ROW, MASK, STATE, Act, LinAtom, Poly, State, StepInput


@dataclass
class StepState:
    sym: str
    out_poly: Poly
    init: Init
    final: str | None = None  # outer tensor holding the final value, if anyone reads it


@dataclass
class StepOut:
    poly: Poly
    outer: str  # outer tensor holding the stacked outputs
    batch_first: bool = False
    reversed: bool = False


@dataclass
class StepAnalysis:
    rec: Recognised
    masked: bool
    mask_sym: str | None
    h0: Init
    c0: Init
    seq_outputs: list[SeqOutput] = field(default_factory=list)
    finals: list[FinalOutput] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def split_mask(p: Poly) -> tuple[Poly, Poly | None, set]:
    """``p = old + m * delta`` -> (old, delta or None, mask symbols). ``m * m = m`` for a 0/1 mask."""
    old, delta = {}, {}
    syms: set = set()
    atoms_old, atoms_delta = {}, {}
    for mono, c in p.terms.items():
        mkeys = [k for k in mono if k[0] == MASK]
        if not mkeys:
            old[mono] = old.get(mono, 0.0) + c
            continue
        syms.update(k[1] for k in mkeys)
        rest = tuple(k for k in mono if k[0] != "M")
        delta[rest] = delta.get(rest, 0.0) + c
    for k, a in p.atoms.items():
        atoms_old[k] = a
        atoms_delta[k] = a
    po = Poly(old, atoms_old)
    if not delta:
        return po, None, syms
    return po, Poly(delta, atoms_delta), syms


def _reads(p: Poly) -> set:
    """State symbols a polynomial depends on (elementwise or through a matmul)."""
    out: set = set()
    stack = [p]
    while stack:
        q = stack.pop()
        for a in q.atoms.values():
            if isinstance(a, State):
                out.add(a.sym)
            elif isinstance(a, Act):
                stack.append(a.arg)
            elif isinstance(a, LinAtom):
                for s in a.lin.sources():
                    if s[0] == STATE:
                        out.add(s[1])
                    elif s[0] == GATED_ROW:
                        out.update(k[1] for k in s[1] if k[0] == STATE)
    return out


def analyse(x: StepInput, states: list[StepState], outs: list[StepOut], state_atoms: dict[str, State]) -> StepAnalysis:
    if not states:
        raise Decline("no carried state")
    mask_syms: set = set()
    new_cell: dict[str, Poly] = {}
    masked_states: dict[str, bool] = {}
    zero_fill: set = set()  # carried outputs that hold zeros at masked steps (never read back)
    for s in states:
        old, delta, syms = split_mask(s.out_poly)
        mask_syms |= syms
        if delta is None:
            new_cell[s.sym] = s.out_poly
            masked_states[s.sym] = False
            continue
        if not old.terms:
            zero_fill.add(s.sym)
        elif old.key != Poly.atom(state_atoms[s.sym]).key:
            raise Decline(f"state {s.sym} is not kept at masked steps (its update is not a masked select)")
        new_cell[s.sym] = old.add(delta)
        masked_states[s.sym] = True
    if len(mask_syms) > 1:
        raise Decline("states are masked by different masks")
    mask_sym = next(iter(mask_syms)) if mask_syms else None

    read = set()
    for p in new_cell.values():
        read |= _reads(p)
    cell_syms = [s.sym for s in states if s.sym in read]
    if not cell_syms:
        raise Decline("no state feeds back into the step")
    for z in zero_fill & set(cell_syms):
        raise Decline(f"state {z} is reset to zero at masked steps and read back by the cell")
    carry_of: dict[str, str] = {}
    for s in states:
        if s.sym in read:
            continue
        match = [c for c in cell_syms if new_cell[c].key == new_cell[s.sym].key]
        if not match:
            raise Decline(f"carried value {s.sym} is neither a cell state nor a copy of the output")
        if mask_sym is not None and not masked_states[s.sym]:
            # updated at every step, masked or not: its value at masked steps is no native output
            if s.final:
                raise Decline(f"a carried copy of the output ({s.sym}) ignores the mask and is used")
            continue
        carry_of[s.sym] = match[0]
    if mask_sym is not None and not all(masked_states[c] for c in cell_syms):
        raise Decline("some cell states ignore the mask")
    rec = recognise({c: new_cell[c] for c in cell_syms}, x, {c: state_atoms[c] for c in cell_syms})
    by_sym = {s.sym: s for s in states}
    h0 = by_sym[rec.h].init
    c0 = by_sym[rec.c].init if rec.c else Init()
    masked = mask_sym is not None
    an = StepAnalysis(rec, masked, mask_sym, h0, c0)

    # per-step outputs
    h_cell = new_cell[rec.h]
    for o in outs:
        old, delta, syms = split_mask(o.poly)
        if syms and syms != {mask_sym}:
            raise Decline("a per-step output uses another mask")
        if delta is None:
            if old.key == h_cell.key:
                fill = NONE
                if masked:
                    raise Decline("a per-step output ignores the mask (the cell runs on masked steps)")
                an.seq_outputs.append(SeqOutput(o.outer, fill, Init(), o.batch_first, o.reversed))
                continue
            # the new value of a masked state read as a whole
            raise Decline(f"a per-step output is not the cell output ({o.poly!r})")
        new = old.add(delta)
        if new.key != h_cell.key:
            raise Decline("a per-step output is not the cell's hidden output")
        if not old.terms:
            an.seq_outputs.append(SeqOutput(o.outer, ZERO, Init(), o.batch_first, o.reversed))
            continue
        sa = old.single_atom()
        if sa and sa[1] == 1.0 and isinstance(sa[0], State) and (sa[0].sym == rec.h or carry_of.get(sa[0].sym) == rec.h):
            an.seq_outputs.append(SeqOutput(o.outer, CARRY, by_sym[sa[0].sym].init, o.batch_first, o.reversed))
            continue
        raise Decline(f"masked steps of a per-step output hold {old!r}")
    # final values
    for s in states:
        if not s.final:
            continue
        if s.sym == rec.h:
            an.finals.append(FinalOutput(s.final, "h", s.init if masked else Init()))
        elif s.sym == rec.c:
            an.finals.append(FinalOutput(s.final, "c", s.init if masked else Init()))
        elif carry_of.get(s.sym) == rec.h and s.sym not in zero_fill:
            an.finals.append(FinalOutput(s.final, "h", s.init if masked else Init()))
        else:
            raise Decline(f"the final value of {s.sym} is used")
    return an
