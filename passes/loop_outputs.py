"""How a Loop's per-step outputs are read after it: stacked outputs of which only the last step is read (the
final value of the state they track), and TorchScript's carried sequences (``SequenceInsert`` once per step,
stacked by ``ConcatFromSequence``)."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.recurrence import Init
from rnnfuse.step import StepOut, StepState
from rnnfuse.symbolic import SymTensor, Poly
from rnnfuse.zeroed_outputs import product_of
from .loop_heads import HeadCandidate, StateKeys, state_output


def last_step_reads(g: Graph, outer: str) -> list[tuple[str, int]]:
    """``[(tensor, lead)]`` when every reader of the stacked output ``outer`` ([T, B, H]) takes its last step:
    ``Gather(outer, -1)`` ([B, H]), ``Slice(outer, -1, end, axis 0)`` ([1, B, H]) or its Squeeze on axis 0;
    else []."""
    out = []
    if g.is_graph_output(outer):
        return []
    for u in g.uses(outer):
        if u.op_type == "Gather" and attr(u, "axis", 0) == 0 and u.input[0] == outer:
            idx = g.const(u.input[1])
            if idx is None or idx.size != 1 or idx.ndim != 0 or int(idx) != -1:
                return []
            out.append((u.output[0], 0))
            continue
        if u.op_type != "Slice" or u.input[0] != outer:
            return []
        starts, ends, axes, steps = op_args.slice_args_of(g, u)
        if axes != [0] or starts != [-1] or ends is None or ends[0] < 2**31 - 1 or steps != [1]:
            return []
        sq = g.uses(u.output[0])
        if len(sq) == 1 and sq[0].op_type == "Squeeze" and not g.is_graph_output(u.output[0]):
            if op_args.axes(sq[0], g.model.opset, op_args.const_reader(g, sq[0])) == [0]:
                out.append((sq[0].output[0], 0))
                continue
        out.append((u.output[0], 1))
    return out



def sequence_output(g: Graph, body: Graph, loop: NodeProto, k: int, layers: list, extra_remove,
                     state_keys: StateKeys) -> tuple[int | None, StepOut | HeadCandidate]:
    """A carried sequence built by SequenceInsert(seq, y) each step and stacked by ConcatFromSequence: (its
    layer, the output), or (None, a head candidate) when y is no state of the step."""
    bi, bo = body.input_names[2 + k], body.output_names[1 + k]
    n = body.producer.get(bo)
    if n is None or n.op_type != "SequenceInsert" or n.input[0] != bi:
        raise Decline("a carried sequence that is not appended to once per step")
    prepend = False
    if len(n.input) > 2 and n.input[2]:
        pos = body.const(n.input[2])
        if pos is None or np.asarray(pos).size != 1 or int(np.asarray(pos).ravel()[0]) != 0:
            raise Decline("a carried sequence inserted into at a runtime position")
        prepend = True
    final = loop.output[k]
    users = g.uses(final)
    if g.is_graph_output(final) or len(users) != 1 or users[0].op_type != "ConcatFromSequence":
        raise Decline("a sequence output that is not stacked with ConcatFromSequence")
    cat = users[0]
    axis, new_axis = attr(cat, "axis", 0), attr(cat, "new_axis", 0)
    appended = n.input[1]
    u = body.producer.get(appended)
    layout = axis  # (where the stacked steps' time axis is in the output)
    if new_axis == 0 and axis in (1, 2) and u is not None and u.op_type == "Unsqueeze" and op_args.axes(
            u, g.model.opset, op_args.const_reader(body, u)) == [axis]:
        appended, new_axis = u.input[0], 1  # cat([h.unsqueeze(a) ...], a) is stack([h ...], a) (TorchScript)
    elif new_axis == 0 and axis == 1 and u is not None and u.op_type == "Transpose" and list(
            attr(u, "perm", []) or []) == [1, 0, 2]:
        # cat([y.transpose(0, 1) ...], 1) of [1, B, H] steps is their cat on time, batch-first (a batch-first
        # nn.GRU called once a step: its Y step as [B, 1, H])
        appended, axis = u.input[0], 0
    found = state_output(layers, appended, state_keys)
    if found is None:  # a head computes [B, K] from h: stacked like h
        if not (new_axis == 1 and axis in (0, 1, 2)):
            raise Decline("the per-step outputs are stacked along an unsupported axis")
        extra_remove.append(cat)
        return None, HeadCandidate(appended, cat.output[0], time_axis=layout, reversed=prepend)
    li = found[0]
    val = layers[li].ev.value(appended)
    if not isinstance(val, SymTensor):
        raise Decline("the appended value is not a cell output")
    # element [1, B, H] concatenated on axis 0 (time-major), or [B, H] stacked with new_axis on axis 0, 1
    # (batch-first: torch.stack(outs, dim=1)) or 2 (time last: torch.stack(outs, dim=2))
    if not ((new_axis == 1 and axis in (0, 1, 2) and val.lead == 0) or (new_axis == 0 and axis == 0 and val.lead == 1)):
        raise Decline("the per-step outputs are stacked along an unsupported axis")
    extra_remove.append(cat)
    return li, StepOut(Poly(val.poly.terms, val.poly.atoms), cat.output[0], reversed=prepend, time_axis=layout,
                       zeroed=product_of(g, cat.output[0]))


def final_role(poly: Poly, step_states: list[StepState], an) -> tuple[str, Init] | None:
    """The cell state a per-step output read only at its last step is: ("h" | "c", the value with no valid
    step), or None (another per-step output, handled as a stacked one)."""
    for st in step_states:
        if st.out_poly.key != poly.key:
            continue
        if st.sym in (an.rec.h, an.rec.c):
            return "h" if st.sym == an.rec.h else "c", st.init if an.masked else Init()
    return None
