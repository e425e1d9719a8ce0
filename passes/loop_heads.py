"""Per-step outputs of a Loop or Scan body that are no state of the step: heads applied to a new h.

A Loop's or Scan's scan output (or a TorchScript ``SequenceInsert``) is usually a cell's new h, or a masked copy of it;
the front end reads those through the step analysis. An output computed *from* a new h (``fc(h)``,
``tanh(h @ V + x_t @ U)``) is set aside here, and once the cells are recognised it becomes that cell's Y
with the head's nodes applied after the native op (:mod:`rnnfuse.step_heads`, which also says why a
candidate is not a head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from rnnfuse.dataflow import post_order
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.recurrence import CARRY, NONE, Init, Recurrence, SeqOutput
from rnnfuse.recurrence_layers import owner
from rnnfuse.step import unmasked_value
from rnnfuse.step_heads import find_head
from rnnfuse.symbolic import BoolMask, Const, Poly, State, SymTensor, mask_sense


@dataclass
class HeadCandidate:
    """A per-step output that is not a state of the step: perhaps a head on a new h."""

    name: str  # the body tensor
    outer: str  # the stacked output
    time_axis: int = 0  # (as SeqOutput's)
    reversed: bool = False
    accumulate: str = ""  # a running sum's start (see rnnfuse.recurrence.SeqOutput)


def _new_value_keys(layer, state_out: dict[str, str]) -> dict[str, tuple]:
    """sym -> the polynomial key of the state's unmasked new value, for the states of ``layer``."""
    keys = {}
    for sym in layer.syms:
        try:
            p = layer.ev.poly(state_out[sym])
        except Decline:
            continue
        keys[sym] = unmasked_value(p).key
    return keys


@dataclass
class FarOutputs:
    """Whether a per-step output far from the step's states (more than ``COPY_OPS`` nodes beyond their maths)
    may be taken for a head without evaluating it (``allowed``), and whether one was (``taken``). A step that
    then declines is looked at again with it off (:func:`with_far_outputs`): a state copied through many ops
    (70 Identities) is a head to the shortcut, and the head path declines some of what the state path fuses
    (a c read at its last step, a TorchScript sequence)."""

    allowed: bool = True
    taken: bool = False


def with_far_outputs(analyse):
    """``analyse(far)`` with the shortcut on, and again with it off if the step declined after taking it."""
    far = FarOutputs()
    try:
        return analyse(far)
    except Decline:
        if not far.taken:
            raise
    return analyse(FarOutputs(allowed=False))


@dataclass
class StateKeys:
    """What tells a per-step output that is one of the step's states: per layer, the polynomial keys of its
    states' new values (``per_layer``), with the step's :class:`FarOutputs` and whether it is masked (in a
    masked step the shortcut is off: a masked copy of a state is told from a head by its maths)."""

    per_layer: list[set]
    far: FarOutputs
    masked: bool


def state_value_keys(layers: list, state_out: dict[str, str], far: FarOutputs | None = None) -> StateKeys:
    """Per layer: the polynomial keys of its states' updates and of their unmasked new values."""
    per_layer = []
    for layer in layers:
        keys = set(_new_value_keys(layer, state_out).values())
        for sym in layer.syms:
            try:
                keys.add(layer.ev.poly(state_out[sym]).key)
            except Decline:
                continue
        per_layer.append(keys)
    # (every mask enters a step as a BoolMask leaf, which each layer's evaluator starts from)
    masked = any(isinstance(v, BoolMask) for layer in layers for v in layer.ev.memo.values())
    return StateKeys(per_layer, far if far is not None else FarOutputs(allowed=False), masked)


def state_output(layers: list, name: str, state_keys: StateKeys) -> tuple[int, Poly] | None:
    """(layer, polynomial) of a per-step output that is (a masked copy of) one of the step's states, or None:
    an output computed from them (a head) or one the cell maths cannot express."""
    far = state_keys.far
    if far.allowed and not state_keys.masked and _far_from_states(layers, name):
        far.taken = True
        return None  # (a head of 100,000 ops was evaluated symbolically just to learn it is none of the states)
    try:
        li = owner(layers, name)
        poly = layers[li].ev.poly(name)
    except Decline:
        return None
    keys = state_keys.per_layer[li]
    if poly.key in keys or unmasked_value(poly).key in keys:
        return li, poly
    return None


# a masked copy of a state is a few ops on top of the state's maths (a Where on the mask, a Mul by it, a Cast):
# an output needing more of the step's nodes than this beyond what the states' own maths evaluated is taken for
# a head, unevaluated (see FarOutputs)
COPY_OPS = 64


def _far_from_states(layers: list, name: str) -> bool:
    """Whether more than ``COPY_OPS`` of the step's nodes compute ``name`` beyond the tensors the layers'
    evaluators already hold (their states' maths, evaluated by :func:`state_value_keys`): a bounded walk back."""
    memos = [layer.ev.memo for layer in layers]
    body = layers[0].ev.graph
    stack, seen = [name], set()
    while stack:
        cur = stack.pop()
        if not cur or any(cur in memo for memo in memos):
            continue
        p = body.producer.get(cur)
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if len(seen) > COPY_OPS:
            return True
        stack.extend(p.input)
    return False


def _evaluate_near_states(body: Graph, ev, name: str) -> None:
    """Evaluate in ``ev`` the tensors ``name`` is computed from that lie within ``COPY_OPS`` ops of what ``ev``
    holds (the states' maths), bottom-up; further ones stay unevaluated. :func:`find_head` reads a tensor's
    value to know whether it is a state (h, c) or a constant, and a tensor that far from the states is neither
    (it walks into it: its ops are the head's). A 100,000-op head was evaluated symbolically whole for this."""
    depth: dict[str, int] = {}  # body tensor -> ops beyond what ev holds (0: held, or from outside the body)

    def open_(cur: str):
        p = body.producer.get(cur)
        if p is None or cur in ev.memo:  # (an outside value is evaluated where a node near the states reads it)
            depth[cur] = 0
            return None
        return p.input

    def close(cur: str) -> int:
        d = 1 + max((depth[i] for i in body.producer[cur].input if i), default=0)
        if d <= COPY_OPS:
            ev.value(cur)  # (its inputs are held or evaluated just before: one node's evaluation)
        return d

    post_order(name, depth, open_, close)


def add_heads(body: Graph, layers: list, recs: list[Recurrence], cell_states: list, heads: list[HeadCandidate],
              state_out: dict[str, str], step_in, invariants: dict[str, str], counters: set[str]) -> None:
    """Per-step outputs computed from a layer's new h: that layer's Y with the head applied after the op.
    ``cell_states``: per layer, the symbols of its cell's h and c; ``step_in``: how the body reads x_t."""
    for cand in heads:
        reason = None
        for li in reversed(range(len(layers))):  # a head usually sits on the top cell
            layer, rec = layers[li], recs[li]
            h_sym, c_sym = cell_states[li]
            keys = _new_value_keys(layer, state_out)
            other = {k: f"state {s} (the cell state c)" if s == c_sym else f"state {s}"
                     for s, k in keys.items() if s != h_sym and k != keys[h_sym]}
            _evaluate_near_states(body, layer.ev, cand.name)
            target, h_key, zero_masked = cand.name, keys[h_sym], False
            if rec.masked:
                # (the head then reads the op's Y carried through masked steps: the new h at a valid step, the
                # h kept at a masked one, and one step later the h the step read)
                kept = _selected_at_valid_steps(body, layer.ev, cand.name, rec)
                if kept is not None:  # where(m, head(h), 0): zeros at masked steps, after the head
                    target, zero_masked = kept, True
                else:  # head(where(m, h_new, h)): the head on the kept h
                    h_key = layer.ev.poly(state_out[h_sym]).key
            try:
                head = find_head(body, layer.ev, target, h_key, other, step_in.x_reads,
                                 step_in.x_read_source, step_in.x_axis, step_in.x_reversed, invariants, counters,
                                 _lower_cells_h(layers, li, cell_states, state_out), Poly.atom(State(h_sym, None)).key)
            except Decline as d:
                fill_reason = _masked_fill_reason(body, layer.ev, cand.name, rec) if rec.masked else None
                reason = reason or (Decline(fill_reason) if fill_reason else d)
                continue
            if head.layer_h and (rec.masked or any(recs[j].masked for j in head.layer_h.values())):
                raise Decline("a per-step output computed from several cells' h under a mask")
            for name, j in head.layer_h.items():  # the other cells' Y, handed to this one when emitted
                head.layer_h[name] = _steps_output(recs[j], j)
            fill, init = (CARRY, rec.h0) if rec.masked else (NONE, Init())
            rec.seq_outputs.append(SeqOutput(cand.outer, fill, init, cand.time_axis, cand.reversed, head=head,
                                             accumulate=cand.accumulate, zero_masked=zero_masked))
            break
        else:
            raise reason


def _selected_at_valid_steps(body: Graph, ev, name: str, rec: Recurrence) -> str | None:
    """The tensor a masked step's output ``name`` selects at valid steps when it is zeros at masked ones,
    ``where(m, y, 0)`` or ``y * m`` with m the mask as 0/1 numbers, else None."""
    sel = _mask_select(body, ev, name, rec)
    return sel[0] if sel is not None and _is_zero(sel[1]) else None  # (sel[0] None: zeros at valid steps too)


def _masked_fill_reason(body: Graph, ev, name: str, rec: Recurrence) -> str | None:
    """Why a masked step's output that selects by the mask is no native output, when it is not a head zeroed
    at masked steps: what it holds there (else None: the head's own reason stands)."""
    try:  # (asked after a head was declined: a value it cannot read leaves that reason)
        sel = _mask_select(body, ev, name, rec)
        if sel is None or _is_zero(sel[1]):
            return None
        only_masked = sel[0] is None or _is_zero(ev.value(sel[0]))
    except Decline:
        return None
    if only_masked:
        return "a per-step output holds its value at masked steps only (zeros at valid ones): no native output holds it"
    if isinstance(sel[1], Const) and np.size(sel[1].arr) == 1:
        return (f"a per-step output holds {float(np.ravel(sel[1].arr)[0]):g} at masked steps: a native op's Y holds "
                "zeros or the carried h there")
    return None


def _mask_select(body: Graph, ev, name: str, rec: Recurrence) -> tuple | None:
    """``(the tensor at valid steps, the value at masked ones)`` when ``name`` selects by the step mask:
    ``where(m, y, z)`` in either sense, or ``y * m`` (z zero) and ``y * (1 - m)`` (None: zeros at valid steps,
    y at masked ones), m the mask as 0/1 numbers; a Cast to float after it kept (jax2onnx's dtype fix). Else
    None."""
    p = body.producer.get(name)
    while p is not None and (p.op_type == "Identity" or (p.op_type == "Cast" and attr(p, "to", 0) == TensorProto.FLOAT)):
        p = body.producer.get(p.input[0])
    if p is not None and p.op_type == "Mul" and len(p.input) == 2:
        return _multiplied_by_mask(ev, p, rec)
    if p is None or p.op_type != "Where" or len(p.input) != 3:
        return None
    cond = ev.value(p.input[0])
    if not isinstance(cond, BoolMask):
        return None
    # (BoolMask.neg: the value is the mask symbol negated; rec.mask_negated: the mask is true at padded steps)
    keep, other = p.input[1:] if cond.neg == rec.mask_negated else p.input[2:0:-1]
    return keep, ev.value(other)


def _is_zero(v) -> bool:
    return isinstance(v, Const) and not np.any(v.arr)


_ZERO = Const(np.zeros((), np.float32))


def _multiplied_by_mask(ev, mul, rec: Recurrence) -> tuple | None:
    """``(y, 0)`` when ``mul`` is ``y * m`` (either order), m the step mask as numbers, [B, 1], 1 at valid
    steps: y at a valid step, 0 at a masked one, as ``where(m, y, 0)`` for a finite y (the native op's steps are
    finite where the original's are: both compute the cell on the same inputs); ``(None, y's value)`` for
    ``y * (1 - m)``, zeros at valid steps."""
    for k in (0, 1):
        try:
            v = ev.value(mul.input[k])
        except Decline:
            continue
        # (a [B] mask vector would broadcast along the features, not the rows)
        sense = mask_sense(v.poly) if type(v) is SymTensor and not v.lead else None
        if sense is None:  # (else m, or 1 - m: sense[1])
            continue
        # (rec.mask_negated: the mask holds at padded steps, so its complement is 1 at valid ones)
        y = mul.input[1 - k]
        if sense[1] == rec.mask_negated:
            return y, _ZERO
        try:  # (only a reason asks what y is at masked steps)
            return None, ev.value(y)
        except Decline:
            return None
    return None


def _lower_cells_h(layers: list, li: int, cell_states: list, state_out: dict[str, str]) -> dict:
    """The new h of each cell below ``li`` as layer ``li``'s evaluator sees it (a cell beside it: its maths;
    the cell it reads: its step input) -> that cell's index, for a head over several cells' h."""
    out = {}
    for j in range(li):
        try:
            out[unmasked_value(layers[li].ev.poly(state_out[cell_states[j][0]])).key] = j
        except Decline:
            continue
    return out


def _steps_output(rec: Recurrence, j: int) -> str:
    """An internal sequence output of ``rec`` (cell ``j`` of its step): its Y, time-major in processing order."""
    name = f"{rec.where}/rnnfuse_cell{j + 1}_steps"
    if not any(so.tensor == name for so in rec.seq_outputs):
        rec.seq_outputs.append(SeqOutput(name, NONE, Init(), internal=True))
    return name
