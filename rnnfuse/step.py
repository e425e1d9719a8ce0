"""From a step's polynomials to roles: which states are the cell's, how the mask acts, what each output is.

Shared by every front end that has an explicit step (Loop and Scan bodies, TorchScript loops). Masking is
read from the maths: a masked state update is ``m * new + (1 - m) * old`` (however it is written), so the
polynomial of the update splits into the terms with the mask atom and those without.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cells import Recognised, recognise
from .errors import Decline
from .recurrence import CARRY, NONE, ZERO, FinalOutput, Init, SeqOutput
from .symbolic import MASK, STATE, Poly, State, StepInput, masked_inputs, sources, unmask_inputs


class NoStateFedBack(Decline):
    """No carried value is read by the updates: nothing recurs (see rnnfuse.recurrence_layers.cells_first)."""


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
    time_axis: int = 0  # where the stacked steps' time axis is: [T, B, H] 0, [B, T, H] 1, [B, H, T] 2
    reversed: bool = False
    accumulate: str = ""  # a running sum's start (see rnnfuse.recurrence.SeqOutput)
    # the stacked outputs read only zeroed by a mask after the stack (``stack(outs) * m``): the product's name,
    # which a masked recurrence's zero-filled Y is once the front end shows the mask is the states' own
    # (rnnfuse.zeroed_outputs)
    zeroed: str = ""


@dataclass
class StepAnalysis:
    rec: Recognised
    masked: bool
    mask_sym: str | None
    h0: Init
    c0: Init
    mask_negated: bool = False  # the mask is true at padded steps (``Where(pad, old, new)``): valid = not mask
    seq_outputs: list[SeqOutput] = field(default_factory=list)
    finals: list[FinalOutput] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def split_mask(p: Poly, negated: bool = False) -> tuple[Poly, Poly | None, set]:
    """``p = old + m * delta`` -> (old, delta or None, mask symbols). ``m * m = m`` for a 0/1 mask.
    ``negated``: the mask is true at padded steps, the valid mask is ``v = 1 - m``, and ``p = old' + v * delta'``
    with ``old' = old + delta`` and ``delta' = -delta`` is what is returned."""
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
    pd = Poly(delta, atoms_delta)
    if negated:
        return po.add(pd), pd.scale(-1.0), syms
    return po, pd, syms


def unmasked_value(p: Poly) -> Poly:
    """What a masked select ``p = A + m * D`` is at valid steps, whichever way round its mask is read: with a
    valid mask (true at valid steps) it is ``A + D`` and the other side ``A`` the kept state or zeros; with a
    padding mask it is ``A``, and ``A + D`` is the kept state (a bare state atom) or zeros. An unmasked ``p`` is
    itself. Used where the step's states are not known yet; :func:`analyse` reads the mask's sense from them."""
    a, d, _ = split_mask(p)
    if d is None:
        return a
    b = a.add(d)
    if (_bare_state(b) and not _bare_state(a)) or (not b.terms and a.terms):
        return a  # a padding mask
    return b


def _bare_state(p: Poly) -> bool:
    sa = p.single_atom()
    return sa is not None and sa[1] == 1.0 and isinstance(sa[0], State)


def _reads(p: Poly) -> set:
    """State symbols a polynomial depends on (elementwise or through a matmul; a gated row by the states its
    product names)."""
    return {sym for kind, sym in sources(p) if kind == STATE}


def analyse(x: StepInput, states: list[StepState], outs: list[StepOut], state_atoms: dict[str, State]) -> StepAnalysis:
    """Recognise the cell of a step's carried states, then say what each per-step output and used final
    value is in terms of the native op's outputs."""
    if not states:
        raise Decline("no carried state")
    un = _unmask(states, state_atoms)
    if any(masked_inputs(p) for p in [s.out_poly for s in states] + [o.poly for o in outs]):
        states, outs = _unmask_inputs(states, outs, un)
        un = _unmask(states, state_atoms)
    cell_syms, carry_of = _cell_states(states, un)
    rec = recognise({c: un.new_cell[c] for c in cell_syms}, x, {c: state_atoms[c] for c in cell_syms})
    by_sym = {s.sym: s for s in states}
    h0 = by_sym[rec.h].init
    c0 = by_sym[rec.c].init if rec.c else Init()
    masked = un.mask_sym is not None
    an = StepAnalysis(rec, masked, un.mask_sym, h0, c0, un.negated)
    for o in outs:
        so = _seq_output(o, un.new_cell[rec.h], an, carry_of, by_sym)
        an.seq_outputs.append(replace(so, accumulate=o.accumulate))
    for s in states:
        if s.final:
            an.finals.append(_final_output(s, an, carry_of, un.zero_fill))
    return an


@dataclass
class _Unmasked:
    """Each state's update with the mask taken out (``m * new + (1 - m) * old`` -> ``new``)."""

    new_cell: dict[str, Poly]  # state -> its update at a valid step
    masked_states: dict[str, bool]  # state -> whether its update is masked
    zero_fill: set  # carried outputs that hold zeros at masked steps (never read back)
    mask_sym: str | None  # the one mask, if any state is masked
    negated: bool = False  # the mask is true at padded steps


def _unmask(states: list[StepState], state_atoms: dict[str, State]) -> _Unmasked:
    negated = _padding_mask(states, state_atoms)
    mask_syms: set = set()
    un = _Unmasked({}, {}, set(), None, negated)
    for s in states:
        old, delta, syms = split_mask(s.out_poly, negated)
        mask_syms |= syms
        if delta is None:
            un.new_cell[s.sym] = s.out_poly
            un.masked_states[s.sym] = False
            continue
        if not old.terms:
            un.zero_fill.add(s.sym)
        elif old.key != Poly.atom(state_atoms[s.sym]).key:
            raise Decline(f"state {s.sym} is not kept at masked steps (its update is not a masked select)")
        un.new_cell[s.sym] = old.add(delta)
        un.masked_states[s.sym] = True
    if len(mask_syms) > 1:
        raise Decline("states are masked by different masks")
    un.mask_sym = next(iter(mask_syms)) if mask_syms else None
    return un


def _unmask_inputs(states: list[StepState], outs: list[StepOut], un: "_Unmasked"):
    """The states and outputs with the step input read as itself where the cell reads it scaled by the mask
    (``x * m``, ``Where(m, x, 0)``). Exact when that scaling is 1 at valid steps and the mask is the one the
    states keep: a masked recurrence shows nothing the cell computes at masked steps (its states are kept
    there and its outputs carry or hold zeros; an output of the raw cell is declined below)."""
    if un.mask_sym is None:
        raise Decline("the step input is multiplied by a mask, but no state is masked (the cell sees other inputs)")
    valid = 0.0 if un.negated else 1.0
    states = [replace(s, out_poly=unmask_inputs(s.out_poly, un.mask_sym, valid)) for s in states]
    outs = [replace(o, poly=unmask_inputs(o.poly, un.mask_sym, valid)) for o in outs]
    if any(masked_inputs(p) for p in [s.out_poly for s in states] + [o.poly for o in outs]):
        raise Decline("the step input is multiplied by a mask other than the one the states keep, or is not "
                      "itself at valid steps")
    return states, outs


def _padding_mask(states: list[StepState], state_atoms: dict[str, State]) -> bool:
    """Whether the states' mask is true at padded steps: every masked state then keeps its old value (or
    holds zeros) where the mask is true, ``Where(pad, old, new)``, and not where it is false (a mask read
    the usual way round fits that reading, and keeps it)."""

    def fits(negated: bool) -> bool:
        for s in states:
            old, delta, _ = split_mask(s.out_poly, negated)
            if delta is not None and old.terms and old.key != Poly.atom(state_atoms[s.sym]).key:
                return False
        return True

    return any(split_mask(s.out_poly)[1] is not None for s in states) and not fits(False) and fits(True)


def _cell_states(states: list[StepState], un: _Unmasked) -> tuple[list[str], dict[str, str]]:
    """The cell's states (those the updates read) and, for every other carried value, the cell state it
    copies (``carry_of``; a copy updated at masked steps too is left out, unless it is used)."""
    read = set()
    for p in un.new_cell.values():
        read |= _reads(p)
    cell_syms = [s.sym for s in states if s.sym in read]
    if not cell_syms:
        raise NoStateFedBack("no state feeds back into the step")
    for z in un.zero_fill & set(cell_syms):
        raise Decline(f"state {z} is reset to zero at masked steps and read back by the cell")
    carry_of: dict[str, str] = {}
    for s in states:
        if s.sym in read:
            continue
        match = [c for c in cell_syms if un.new_cell[c].key == un.new_cell[s.sym].key]
        if not match:
            raise Decline(f"carried value {s.sym} is neither a cell state nor a copy of the output")
        if un.mask_sym is not None and not un.masked_states[s.sym]:
            # updated at every step, masked or not: its value at masked steps is no native output
            if s.final:
                raise Decline(f"a carried copy of the output ({s.sym}) ignores the mask and is used")
            continue
        carry_of[s.sym] = match[0]
    if un.mask_sym is not None and not all(un.masked_states[c] for c in cell_syms):
        raise Decline("some cell states ignore the mask")
    return cell_syms, carry_of


def _seq_output(o: StepOut, h_cell: Poly, an: StepAnalysis, carry_of: dict[str, str], by_sym: dict[str, StepState]) -> SeqOutput:
    """A per-step output as the native op's Y: the cell output at valid steps, and at masked steps nothing
    (unmasked), zeros, or the carried previous output."""
    rec = an.rec
    old, delta, syms = split_mask(o.poly, an.mask_negated)
    if syms and syms != {an.mask_sym}:
        raise Decline("a per-step output uses another mask")
    if delta is None:
        if old.key == h_cell.key:
            if an.masked and o.zeroed and not o.reversed:  # (zeros where the product's factor is 0)
                return SeqOutput(o.zeroed, ZERO, Init(), o.time_axis, o.reversed)
            if an.masked:
                raise Decline("a per-step output ignores the mask (the cell runs on masked steps)")
            return SeqOutput(o.outer, NONE, Init(), o.time_axis, o.reversed)
        # the new value of a masked state read as a whole
        raise Decline(f"a per-step output is not the cell output ({o.poly!r})")
    new = old.add(delta)
    if new.key != h_cell.key:
        raise Decline("a per-step output is not the cell's hidden output")
    if not old.terms:
        return SeqOutput(o.outer, ZERO, Init(), o.time_axis, o.reversed)
    sa = old.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], State) and (sa[0].sym == rec.h or carry_of.get(sa[0].sym) == rec.h):
        return SeqOutput(o.outer, CARRY, by_sym[sa[0].sym].init, o.time_axis, o.reversed)
    raise Decline(f"masked steps of a per-step output hold {old!r}")


def _final_output(s: StepState, an: StepAnalysis, carry_of: dict[str, str], zero_fill: set) -> FinalOutput:
    """A used final value: the op's Y_h (h, or a masked copy of it) or Y_c."""
    rec = an.rec
    # (the value where a row has no valid step, or, unmasked, where the run has no step: rnnfuse.empty_runs)
    init = s.init  # (a carried value's final has its initial value's shape: [1, B, H] for a lead of 1)
    if s.sym == rec.h:
        return FinalOutput(s.final, "h", init, init.lead)
    if s.sym == rec.c:
        return FinalOutput(s.final, "c", init, init.lead)
    if carry_of.get(s.sym) == rec.h and s.sym not in zero_fill:
        return FinalOutput(s.final, "h", init, init.lead)
    raise Decline(f"the final value of {s.sym} is used")
