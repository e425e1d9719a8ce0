"""Loop front end: ONNX ``Loop`` nodes whose body is one recurrent step (tf2onnx's Keras layers).

A body qualifies when every part of it is accounted for:

* carried values are the cell's states, copies of its output (Keras' "previous output" for masking),
  pass-through values (weights, bounds), iteration counters, or output buffers written at the iteration's row
  (``outs[t] = h``, :mod:`.loop_buffers`);
* the step input is ``Gather(X, i)`` of an outer ``[T, B, F]`` tensor by the iteration index, the mask
  likewise from an outer bool ``[T, B(, 1)]`` tensor;
* the loop provably runs once per time step of X (trip count and condition are T, read symbolically);
* the state updates and per-step outputs are a native cell's maths (see :mod:`rnnfuse.cells`).

Anything else is declined with the reason. TorchScript loops that collect outputs with ``SequenceInsert``
are handled here too: the sequence is a per-step output and ``ConcatFromSequence`` its stacking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.carried import loop_invariant_init
from rnnfuse.dims import fixed_batch
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model
from rnnfuse.findings import Options, PassResult
from rnnfuse.recurrence import CountOutput, FinalOutput, InputPrep, Recurrence
from rnnfuse.recurrence_layers import cells_first, check_feeds, layer_recurrence, split_layers
from rnnfuse.inputs import input_projection, projected_leaf, reading_projections
from rnnfuse.op_args import TO_THE_END
from rnnfuse.rewrite import fuse_nodes
from rnnfuse.row_steps import RowStep, row_step_reads
from rnnfuse.row_wise import ROW_RANK, BodyMask
from rnnfuse.step import StepOut, analyse
from rnnfuse.zeroed_outputs import product_of, zeroed_by_mask, zeroed_products
from .loop_buffers import accumulated, check_buffer_length, grown, row_write
from .loop_split import fuse_parts
from .loop_writes import ScatteredWrite, check_buffer_rows, scattered_write, write_axis
from .loop_inputs import find_input_map, side_by_side
from .loop_outputs import final_role, last_step_reads, sequence_output
from .loop_heads import FarOutputs, HeadCandidate, add_heads, state_output, state_value_keys, with_far_outputs
from .loop_masks import (DERIVED_MASK, LENGTH_MASK, RowReads, attach_derived_mask, attach_length_mask,
                         find_derived_mask, laid_out_like_x)
from .loop_body_reads import body_reads, input_offset
from .loop_counts import check_trip_count, integer_carry_reason
from .loop_extents import check_same_batch, check_step_lengths
from .loop_reads import counter_step, keeps_time_axis, reads_backwards
from rnnfuse.symbolic import Const, Opaque, State, SymTensor, StepInput, Poly, weight_ops


_WHOLE_TYPES = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8,
                TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}  # (a sum of them wraps as Cast(T) + start)


@dataclass
class _Carried:
    """What each carried value of a Loop is (by its position k among the carried values)."""

    n: int  # carried values
    n_scan: int  # per-step (scan) outputs of the body
    index_syms: dict[str, int]  # body input -> its offset: the iteration number (0) and counters that follow it
    invariants: dict[str, str]  # body input -> outer init: values passed through unchanged
    recurrent: list[int]  # the cell's states (and carried copies of its output)
    seqs: list[int]  # carried sequences (TorchScript SequenceInsert outputs)
    buffers: dict[int, str] = field(default_factory=dict)  # carried buffers written at row i -> the value written
    grown: dict[int, int] = field(default_factory=dict)  # buffers grown by one row a step instead -> their axis
    scattered: dict[int, ScatteredWrite] = field(default_factory=dict)  # buffers written by index arithmetic
    accums: dict[int, str] = field(default_factory=dict)  # carried sums of a per-step value -> the value summed


@dataclass
class StepReads:
    """The per-step input and mask the body reads: element i of an invariant tensor along its time axis."""

    leaves: dict  # body tensor -> its symbolic value: the mask reads and the input reads
    x_outer: str  # the tensor the recurrence reads (X, or X0 when the steps read slices of X0 @ K + b)
    x_axis: int  # 0: time-major [T, B, F]; 1: batch-first
    x_atom: StepInput
    x_reversed: bool  # the steps read time backwards
    mask_outer: str | None
    x_reads: set[str]  # the body tensors that read x_t
    x_read_source: str  # the tensor they read element t of (X, or X0 @ K + b)
    x_prep: InputPrep  # the projection's time flips, built by the emitter
    lengths: object = None  # a LengthMask: the step mask is t compared with per-row lengths (built by the emitter)
    derived: BodyMask | None = None  # the step mask is computed in the body from what derived_from reads
    x_read_nodes: list = field(default_factory=list)  # the body nodes reading x_t
    x_rank: int = ROW_RANK  # x_t is [B, F]; 1: one id a row ([B]), which the cell reads through a lookup
    rows: "RowReads | None" = None  # the step's element of a [T, B] tensor that is no bool mask
    mask_cut: bool = False  # the mask's length is not provably x's: the native op reads its first T steps
    mask_axis: int = 0  # the time axis of the mask read (mask_outer): 0 [T, B], 1 [B, T] (it may differ from x's)
    derived_from: "RowReads | None" = None  # what the derived mask is computed from: x_t, or rows
    offset: int = 0  # the body reads x's element i + offset (TorchScript's range(offset, T)): x from that step on


def loop_recurrence(g: Graph, loop: NodeProto) -> tuple[Recurrence, dict] | list[tuple[Recurrence, dict]]:
    return reading_projections(lambda: with_far_outputs(lambda far: _loop_recurrence(g, loop, far)))


def _loop_recurrence(g: Graph, loop: NodeProto, far: FarOutputs):
    body = g.subgraph(loop)
    carried = _carried_values(g, body, loop)
    step_in = _step_input(g, body, loop, carried)
    leaves = dict(step_in.leaves)
    states = _body_leaves(g, body, loop, carried, leaves, {step_in.x_read_source, step_in.x_outer})
    state_out = {f"s{k}": body.output_names[1 + k] for k in carried.recurrent}
    layers = split_layers(body, leaves, state_out, step_in.x_atom, fixed_batch(g, step_in.x_outer, step_in.x_axis))
    layer_step_states = cells_first(g, loop, body, layers, states, body_out=1, node_in=2)
    outs_of, last_of, heads, extra_remove = _per_step_outputs(g, body, loop, carried, layers, state_out, far,
                                                              fixed_batch(g, step_in.x_outer, step_in.x_axis))
    aliases, counts = _final_aliases(g, body, loop, carried, step_in)
    recs, cell_states = _layer_recurrences(g, loop, layers, layer_step_states, states, outs_of, last_of, extra_remove,
                                           step_in)
    # (a loop reading x from step s runs no step for T <= s: the op then reads an empty x, which the emitter
    # guards: rnnfuse.empty_runs)
    if heads:
        add_heads(body, layers, recs, cell_states, heads, state_out, step_in, carried.invariants,
                  set(carried.index_syms))
    if step_in.offset and (set(carried.buffers) - set(carried.grown) or counts):
        # (a buffer's rows and a counter's final value are proven against x's whole length)
        raise Decline(f"an output buffer or a counter's final value beside an input read {step_in.offset} steps "
                      "ahead of the iteration number")
    for k in set(carried.buffers) - set(carried.grown):  # (a grown one has a row a step by construction)
        w = carried.scattered.get(k)
        if w is not None and w.axis is None:
            continue  # (its output is unused: what it holds matters to no one)
        check_buffer_length(g, loop.input[2 + k], step_in.x_read_source, step_in.x_axis, w.axis if w else 0)
        if w is not None:
            check_buffer_rows(g, loop.input[2 + k], w, step_in.x_read_source, step_in.x_axis)
    if step_in.lengths is not None:
        attach_length_mask(g, recs, step_in)
    if step_in.derived is not None:
        attach_derived_mask(g, body, loop, recs, step_in)
    recs[0].counts = counts
    if len(recs) == 1:
        return recs[0], aliases
    return [(r, aliases if i == 0 else {}) for i, r in enumerate(recs)]


def _carried_values(g: Graph, body: Graph, loop: NodeProto) -> _Carried:
    """Sort the carried values into counters, pass-through values, carried sequences and recurrent states."""
    bin_, bout = body.input_names, body.output_names
    n_carried = len(loop.input) - 2
    if n_carried < 0 or len(bin_) != n_carried + 2:
        raise Decline("malformed Loop")
    out = _Carried(n_carried, len(bout) - 1 - n_carried, {bin_[0]: 0}, {}, [], [])
    for k in range(n_carried):  # (first: a counter may add one of them)
        inv = loop_invariant_init(body, bin_[2 + k])
        if inv is not None:
            out.invariants[bin_[2 + k]] = inv
    for k in range(n_carried):
        bi, bo, init = bin_[2 + k], bout[1 + k], loop.input[2 + k]
        if bi in out.invariants:
            continue
        step = counter_step(body, bo, out.invariants)
        counts = step is not None and step[0] == bi and step[1] == 1
        c0 = g.const(init) if init and counts else None  # (a fold asked of a counter's start only)
        start = float(np.asarray(c0).ravel()[0]) if c0 is not None and np.asarray(c0).size == 1 else None
        if counts and start is not None and np.asarray(c0).dtype.kind in "iuf" and start.is_integer():
            out.index_syms[bi] = int(start)  # the iteration number plus its start (a jax
            # carry's t from 1, compared as t <= L)
            continue
        prod = g.producer.get(init) if init else None
        if prod is not None and prod.op_type == "SequenceEmpty":
            out.seqs.append(k)
            continue
        iteration = {name for name, start in out.index_syms.items() if start == 0}
        written = row_write(body, bi, bo, iteration)
        if written is not None:  # outs[i] = y: the per-step values stacked (see loop_buffers)
            out.buffers[k] = written
            continue
        scattered = scattered_write(body, bi, bo, iteration)
        if scattered is not None:  # ys.at[:, i].set(y): the per-step values stacked (see loop_writes)
            out.buffers[k], out.scattered[k] = scattered.value, scattered
            continue
        grew = grown(g, body, bi, bo, init) if init else None
        if grew is not None:  # out = cat([out, y[None]]): the per-step values stacked (see loop_buffers)
            out.buffers[k], out.grown[k] = grew
            continue
        summed = accumulated(body, bi, bo)
        if summed is not None:  # acc = acc + y: the per-step values summed (see loop_buffers)
            out.accums[k] = summed
            continue
        # the body's declaration of the value, else its outer init's type (inferred, in a big model: a chain
        # of 25,000 Loops asked it of each Loop's init, 1 s)
        et = _declared_elem_type(body, 2 + k) or (g.model.elem_type(init) if init else None)
        if et is not None and et not in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16):
            raise Decline(integer_carry_reason(bi, TensorProto.DataType.Name(et), step, start))
        out.recurrent.append(k)
    if not out.recurrent:
        raise Decline("no recurrent state")
    return out


def _declared_elem_type(body: Graph, k: int) -> int:
    """The element type the body declares for its k-th input (0: none)."""
    t = body.proto.input[k].type
    return t.tensor_type.elem_type if t.HasField("tensor_type") else 0


def _x_leaf(g: Graph, x_outer: str, x_axis: int, masked: bool):
    """(the input projection the steps read, or None; the step input's atom; its symbolic value)."""
    proj = input_projection(g, x_outer, x_axis) if x_axis in (0, 1) else None
    if proj is not None and proj.time_axis != x_axis and masked:
        proj = None  # (X0 batch-first beside a time-major mask: the steps' input is read as computed)
    if proj is not None:  # the steps read slices of X0 @ K + b: the recurrence reads X0
        return (proj, *projected_leaf(proj))
    shape = g.model.shape(x_outer)
    width = shape[1 if x_axis == 2 else 2] if shape and len(shape) == 3 else None  # ([B, F, T] for time axis 2)
    x_atom = StepInput("x", width if isinstance(width, int) else None)
    return proj, x_atom, SymTensor(Poly.atom(x_atom))


def _step_leaf(g: Graph, body: Graph, carried: _Carried, x_outer: str, x_axis: int, x_reads: list[str], x_rank: int,
               masked: bool, leaves: dict, kept: set[str]):
    """``(projection, atom, input map)``: the step input's leaf added to ``leaves``, on x_t itself (its
    input projection's, if the steps read slices of one) or on the row-wise map of it the cell reads instead
    (an input MLP, a LayerNorm, an embedding lookup of ids: ``x_rank`` 1), which the native op then reads
    applied to every step. ``kept``: the reads that keep the time axis ([1, B, F])."""
    input_map = None if kept else find_input_map(g, body, x_outer, x_axis, x_reads, x_rank, carried.invariants)
    if input_map is not None:
        x_atom = StepInput("x", input_map.width)
        leaves[input_map.value] = SymTensor(Poly.atom(x_atom))
        return None, x_atom, input_map
    if x_rank == 1:
        raise Decline("no per-step input (element i of an invariant tensor) in the body")
    proj, x_atom, x_value = _x_leaf(g, x_outer, x_axis, masked)
    for r in x_reads:
        leaves[r] = SymTensor(x_value.poly, 1) if r in kept else x_value
    return proj, x_atom, None


def _step_input(g: Graph, body: Graph, loop: NodeProto, carried: _Carried) -> StepReads:
    """The step input and mask: element i of an invariant tensor along its time axis; the loop must run once
    per time step of that tensor."""
    r = body_reads(g, body, carried.index_syms, carried.invariants)
    leaves, mask_outer, lengths, rows, x_axis = r.leaves, r.mask_outer, r.lengths, r.rows, r.x_axis
    x_outer = next(iter(r.x_parts), None)
    x_read_nodes = r.x_parts.get(x_outer, [])
    x_reads = [n.output[0] for n in x_read_nodes]
    x_rank = ROW_RANK
    if x_outer is None and rows is not None:  # one value a row: perhaps ids whose lookup the cell reads
        x_outer, x_axis, x_rank, x_reads, x_read_nodes = rows.source, rows.axis, 1, sorted(rows.reads), rows.nodes
    if x_outer is None:
        raise Decline("no per-step input (element i of an invariant tensor) in the body")
    if x_axis == 2 and (mask_outer is not None or lengths is not None or rows is not None or len(r.x_parts) > 1):
        raise Decline("a mask or a second sequence beside an input read along its last axis")
    side: tuple = ()
    kept = {n.output[0] for ns in r.x_parts.values() for n in ns if keeps_time_axis(n)}
    if kept and (len(r.x_parts) > 1 or x_axis == 2):
        raise Decline("a step input read with its time axis kept beside another sequence, or along its last axis")
    if len(r.x_parts) > 1:  # sequences read side by side: the native op reads them concatenated on features
        x_atom, side = side_by_side(g, {d: [n.output[0] for n in ns] for d, ns in r.x_parts.items()}, x_axis, leaves)
        proj = input_map = None
    else:
        proj, x_atom, input_map = _step_leaf(g, body, carried, x_outer, x_axis, x_reads, x_rank,
                                             mask_outer is not None or lengths is not None, leaves, kept)
    if input_map is not None and x_rank == 1:
        rows = None  # (the ids are the step input)
    if len(r.forms) > 1:
        raise Decline(f"one recurrence reads its per-step inputs in {len(r.forms)} orders ({', '.join(sorted(r.forms))})")
    ahead = input_offset(r, proj, rows)
    # (a read of x past its last step fails only in a Gather: a Slice clamps, a backward read wraps)
    counted_ok = (r.forms == {"forward"} and mask_outer is None and rows is None and len(r.x_parts) == 1
                  and (proj is None or not proj.flips) and bool(x_read_nodes)
                  and all(n.op_type == "Gather" for n in x_read_nodes))
    count = check_trip_count(g, body, loop, x_outer, carried.index_syms, x_axis, carried.invariants, offset=ahead,
                             counted_ok=counted_ok)
    others = {mask_outer: r.mask_axis, rows and rows.source: rows and rows.axis}
    others = {k: a for k, a in others.items() if k not in (None, x_outer)}
    mask_cut = check_step_lengths(g, others, x_outer, x_axis, r.forms, mask_outer)
    check_same_batch(g, others, x_outer, x_axis)
    if lengths is not None:
        if mask_outer is not None:
            raise Decline("a step reads a mask and computes another from lengths")
        if lengths.time_index is not None:  # (compared with the time index: proven T - 1 - i, x read there too)
            if r.forms != {"reverse"} or not reads_backwards(g, body, lengths.time_index, carried.index_syms, x_outer, x_axis):
                raise Decline("a length mask compares a step count other than the time step x is read at")
        elif r.forms - {"forward"}:
            raise Decline("a length mask on a step that reads time backwards")
        mask_outer = LENGTH_MASK
    prep = InputPrep(proj.flips) if proj is not None else InputPrep(input_map=input_map, side_by_side=side)
    step_in = StepReads(leaves, x_outer if proj is None else proj.x0, x_axis if proj is None else proj.time_axis,
                         x_atom, bool(r.forms - {"forward"}), mask_outer, set(x_reads), x_outer, prep, lengths, None,
                         x_read_nodes, x_rank=x_rank, offset=ahead)
    if ahead or count:  # the op reads x from step s on (a projection's X0 alike: it maps each step alone)
        prep.steps, prep.count = (ahead, TO_THE_END, step_in.x_axis), count
    step_in.rows, step_in.mask_cut, step_in.mask_axis = rows, mask_cut, r.mask_axis
    if rows is not None and (mask_outer is not None or lengths is not None):
        raise Decline(f"the body reads a step of '{rows.source}' (one value a row, not bool) beside its mask")
    if mask_outer is None:  # (none read, none compared with lengths: perhaps one computed from x_t or rows)
        find_derived_mask(g, body, step_in, carried.invariants)
        if ahead and step_in.derived is not None:
            raise Decline(f"a step mask is computed from the input read {ahead} steps ahead of the iteration number")
    return step_in


def _body_leaves(g: Graph, body: Graph, loop: NodeProto, carried: _Carried, leaves: dict,
                 sequences: set) -> dict[str, State]:
    """Add the symbolic values of the body's other inputs to ``leaves``: a state atom per recurrent value,
    constants for pass-through values, and opaque values for what the cell maths must not read. Returns the
    states by symbol."""
    bin_ = body.input_names
    states: dict[str, State] = {}
    for k in carried.recurrent:
        bi = bin_[2 + k]
        # (each dim as the body declares it, or as the outer init has it where the body's is a name:
        # TorchScript declares every carried value's dims by name)
        # (the outer init's type asked only where the body's leaves a dim this reads unknown: a Loop's init may be
        # another Loop's output, typed only by inference)
        inner = body.local_shape(bi) or []
        unknown = not inner or not isinstance(inner[-1], int) or (len(inner) == 3 and not isinstance(inner[0], int))
        outer = (g.model.shape(loop.input[2 + k]) or []) if unknown else []
        shape = [d if isinstance(d, int) or len(outer) != len(inner) else outer[j] for j, d in enumerate(inner)] or outer
        H = shape[-1] if shape and isinstance(shape[-1], int) else None
        st = State(f"s{k}", H)
        states[st.sym] = st
        # ([1, B, H]: a native op's own state, carried from one call to the next: TorchScript's
        # ``y, (h, c) = lstm(x[t:t + 1], (h, c))``)
        leaves[bi] = SymTensor(Poly.atom(st), 1 if len(shape) == 3 and shape[0] == 1 else 0)
    for bi, init in carried.invariants.items():
        c = g.const(init)
        if c is not None:
            leaves[bi] = Const(c)
            continue
        fv = g.fill_value(init)
        if fv is not None:
            leaves[bi] = Const(np.array(fv, dtype=np.float32))
        else:
            leaves[bi] = Opaque(f"the sequence of the per-step input ('{bi}') is read other than at the iteration's step"
                                if init in sequences else f"'{bi}', carried through the loop unchanged, is a runtime value the cell maths reads (a weight that is "
                                  "not constant, or a tensor read other than as the step's input, mask or lengths)")
    for name in carried.index_syms:
        leaves.setdefault(name, Opaque("the iteration number is used in the cell maths"))
    leaves[bin_[1]] = Opaque("the loop condition is used in the cell maths")
    for k in carried.seqs:
        leaves[bin_[2 + k]] = Opaque("a sequence is read inside the step")
    for k in [*carried.buffers, *carried.accums]:
        leaves[bin_[2 + k]] = Opaque("an output buffer or a running sum is read inside the step")
    return states


def _per_step_outputs(g: Graph, body: Graph, loop: NodeProto, carried: _Carried, layers: list,
                      state_out: dict[str, str], far: FarOutputs, batch: int | None):
    """The used per-step outputs, by layer: stacked ones (``outs_of``), ones read only at their last step
    (``last_of``: (poly, outer, [(tensor, lead)])), outputs that are no state of the step (``heads``: perhaps
    a head on a new h), and the carried sequences' stacking nodes to remove. ``batch``: the batch size the
    model fixes, if any."""
    bout = body.output_names
    n_carried = carried.n
    outs_of: dict[int, list[StepOut]] = {i: [] for i in range(len(layers))}
    last_of: dict[int, list] = {}
    heads: list[HeadCandidate] = []
    state_keys = state_value_keys(layers, state_out, far)
    for j in range(carried.n_scan):
        outer = loop.output[n_carried + j] if n_carried + j < len(loop.output) else ""
        if not outer or not g.n_uses(outer):
            continue
        found = state_output(layers, bout[1 + n_carried + j], state_keys)
        if found is None:
            heads.append(HeadCandidate(bout[1 + n_carried + j], outer))
            continue
        li, poly = found
        last = last_step_reads(g, outer) or [RowStep(t, "", k) for t, k in row_step_reads(g, outer, loop)]
        if last:  # e.g. tf.scan's per-step c read only as cs[-1]: the final value of the state it tracks
            last_of.setdefault(li, []).append((poly, outer, last))
            continue
        outs_of[li].append(StepOut(poly, outer, zeroed=product_of(g, outer)))
    # the buffer after the loop: the written values, time-major; a running sum: its start plus theirs
    for k, value in [*carried.buffers.items(), *carried.accums.items()]:
        outer = loop.output[k] if k < len(loop.output) else ""
        start = loop.input[2 + k] if k in carried.accums else ""
        if outer and g.n_uses(outer):
            found = state_output(layers, value, state_keys)
            bf = carried.grown.get(k) == 1  # (grown along axis 1: batch-first)
            flipped = False  # (the values stacked last step first)
            if k in carried.scattered:  # (its placement read by running it, at the state's width)
                if found is None or found[1].ncols is None:
                    raise Decline("an output buffer written by index arithmetic with a value that is no state of "
                                  "the step")
                trip = g.const(loop.input[0]) if loop.input[0] else None
                bf = write_axis(g, carried.scattered[k], found[1].ncols, batch,
                                int(trip) if trip is not None and np.size(trip) == 1 else None) == 1
                flipped = carried.scattered[k].reverse
            if found is None:
                heads.append(HeadCandidate(value, outer, accumulate=start, time_axis=int(bf)))
            else:
                outs_of[found[0]].append(StepOut(found[1], outer, accumulate=start, time_axis=int(bf),
                                                 reversed=flipped))
    extra_remove: list[NodeProto] = []
    for k in carried.seqs:
        li, out = sequence_output(g, body, loop, k, layers, extra_remove, state_keys)
        if li is None:
            heads.append(out)
        else:
            outs_of[li].append(out)
    return outs_of, last_of, heads, extra_remove


def _final_aliases(g: Graph, body: Graph, loop: NodeProto, carried: _Carried, step_in: StepReads):
    """Used final values of pass-through carried values (each is its outer init) and of counters (their start
    plus the number of time steps, which the loop was proven to run)."""
    aliases: dict[str, str] = {}
    counts: list[CountOutput] = []
    for k in range(carried.n):
        final = loop.output[k] if k < len(loop.output) else ""
        if not final or not g.n_uses(final):
            continue
        bi = body.input_names[2 + k]
        if bi in carried.invariants:
            aliases[final] = carried.invariants[bi]
        elif bi in carried.index_syms:
            if g.model.elem_type(loop.input[2 + k]) not in _WHOLE_TYPES:  # (float16 stops counting at 2048)
                raise Decline("the final value of a counter that is no integer is used")
            if step_in.x_prep.count is not None:  # (its final is its start plus x's length: see CountOutput)
                raise Decline("the final value of a counter of a loop run for a runtime trip count is used")
            counts.append(CountOutput(final, loop.input[2 + k], step_in.x_outer, step_in.x_axis))
    return aliases, counts


def _layer_recurrences(g: Graph, loop: NodeProto, layers: list, layer_step_states: list, states: dict[str, State],
                       outs_of: dict, last_of: dict, extra_remove: list, step_in: StepReads):
    """One recurrence per layer of the step (``layer_step_states``: each one's carried states), each reading
    the layer below's Y (the first reads x); and per layer, the symbols of its cell's h and c states."""
    where = loop.name or loop.output[0]
    recs: list[Recurrence] = []
    cell_states: list[tuple[str, str | None]] = []
    for li, layer in enumerate(layers):
        step_states = layer_step_states[li]
        an = analyse(layer.x, step_states, outs_of[li], states)
        finals, stacked, row_steps = [], [], []
        for poly, outer, reads in last_of.get(li, []):
            role = final_role(poly, step_states, an)
            by_row = isinstance(reads[0], RowStep)  # one step per row (flax's carry at seq_lengths - 1)
            if role is None or (by_row and (role[0] != "c" or an.masked)):
                # e.g. Keras' masked output sliced at its last step, h read at a step per row: stacked as before
                stacked.append(StepOut(poly, outer))
            elif by_row:  # the per-step c, which no native output holds, at one step per row
                row_steps += [RowStep(r.tensor, "c", r.step) for r in reads]
            else:
                finals += [FinalOutput(t, role[0], role[1], lead) for t, lead in reads]
        if stacked:
            an = analyse(layer.x, step_states, outs_of[li] + stacked, states)
        an.finals += finals
        rec = layer_recurrence("Loop", where, an, layers, li, recs, x=step_in.x_outer, mask=step_in.mask_outer,
                               x_time_axis=step_in.x_axis, x_reversed=step_in.x_reversed,
                               x_prep=step_in.x_prep, remove=[loop] + extra_remove, anchor=loop,
                               row_steps=row_steps, mask_cut=step_in.mask_cut)
        if step_in.mask_outer not in (None, LENGTH_MASK, DERIVED_MASK):  # (built later, each laid out then)
            laid_out_like_x(rec, step_in.mask_axis)
        mask_read = step_in.mask_outer if step_in.mask_outer not in (LENGTH_MASK, DERIVED_MASK) else None
        zeroed_by_mask(g, rec.seq_outputs, zeroed_products(g, outs_of[li] + stacked), mask_read, step_in.mask_axis,
                       an.mask_negated)
        cell_states.append((an.rec.h, an.rec.c))
        if step_in.mask_outer is not None and not an.masked:
            rec.notes.append("the body reads a mask but no state depends on it")
        recs.append(rec)
    check_feeds(layers, cell_states)
    return recs, cell_states


class FuseLoops:
    """Rewrite recurrent ``Loop`` nodes of the main graph into native LSTM/GRU/RNN ops."""

    name = "loop"
    fuses_only_with = frozenset({"Loop"})

    def run(self, model: Model, ctx: Options) -> PassResult:
        return fuse_nodes(model, ctx, self.name, "Loop", "Loop", loop_recurrence, body_needs=weight_ops(),
                          parts_of=fuse_parts)
