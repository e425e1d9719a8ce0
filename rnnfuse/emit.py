"""Recurrence -> native ONNX op, plus the small adapters that keep every original output exactly as it was.

The emitter only *adds* nodes: the native op, the mask plumbing (lengths, and for the exact path the gather
that moves each row's valid steps to the front and the gather that puts results back), and one adapter per
original output. The caller validates the new tensors against the old ones, then commits (replaces uses)
or drops them (dead-code removal sweeps the unused candidate away).

Masked steps, per the original graph: states are carried; a per-step output holds the previous output
(CARRY, starting from the output's initial value) or zeros (ZERO). onnxruntime zero-fills ``Y`` past
``sequence_lens`` and returns zeros as ``Y_h`` for rows of length 0, so those are fixed up where the
original would differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto, TensorProto, helper

from .builder import Builder
from .dims import declared_name, extent_key
from .emit_inputs import prepared_input, time_major_input
from .empty_runs import full_lengths, has_steps, may_run_empty
from .errors import Decline
from .graph import Graph
from .recurrence import NONE, ZERO, CountOutput, Init, Recurrence, SeqOutput
from .row_steps import emit_row_step
from .step_heads import apply_head

GENERAL = "exact"  # any mask: valid steps are gathered to the front, results scattered back
POST_PADDED = "post-padded"  # the caller guarantees every row's padding is at its end
LENGTHS = "lengths"  # the mask is t < lengths, built by rnnfuse: every row's valid steps come first


@dataclass
class MaskPlumbing:
    """Per-mask tensors, built once and shared by every recurrence that reads the same mask."""

    m2: str  # [T, B] bool
    mi: str  # [T, B] int64
    lens64: str  # [B]
    lens32: str  # [B] int32 (sequence_lens)
    extra: dict = field(default_factory=dict)


class EmitCache:
    """Shared plumbing across the recurrences of one pass (masks are often shared by a whole stack)."""

    def __init__(self):
        self.masks: dict[tuple[str, bool], MaskPlumbing] = {}  # (mask, true at padded steps) -> its plumbing
        self.compacted: dict[tuple[str, str], str] = {}
        # a given initial state -> its [1, B, H] view (cells side by side read one h0: 1,041 equal Unsqueezes)
        self.init_views: dict[str, str] = {}
        self.state_shapes: dict[tuple[str, int], str] = {}  # (x, H) -> [1, B, H], B x's batch


@dataclass
class Emission:
    native: NodeProto
    replacements: dict[str, str]  # original tensor -> new tensor
    path: str  # "unmasked" | GENERAL | POST_PADDED
    direction: str
    mask: str | None  # the mask tensor of the original graph that both versions read
    mask_time_axis: int = 0
    # a big head's probe points (rnnfuse.step_heads.probe_points): original tensor -> {body tensor -> (its
    # rows on every step, laid out as the original tensor; its element type)}: what validation compares in
    # place of the head
    head_probes: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)


def _need_opset(b: Builder, v: int, what: str) -> None:
    if b.opset < v:
        raise Decline(f"{what} needs opset {v}; the model has opset {b.opset}")


def _mask_plumbing(b: Builder, cache: EmitCache, mask: str, rank: int | None, padding: bool = False) -> MaskPlumbing:
    """The [T, B] valid-step mask and the lengths computed from ``mask`` (``padding``: true at padded steps)."""
    mp = cache.masks.get((mask, padding))
    if mp is not None:
        return mp
    if rank == 3:
        m2 = b.squeeze(mask, [2])
    elif rank == 2:
        m2 = mask
    else:
        raise Decline(f"the mask has rank {rank}; expected [T, B] or [T, B, 1]")
    if padding:
        m2 = b.op("Not", m2)
    mi = b.op("Cast", m2, to=TensorProto.INT64)
    lens64 = b.reduce_sum(mi, [0], keepdims=0)
    lens32 = b.op("Cast", lens64, to=TensorProto.INT32)
    mp = MaskPlumbing(m2, mi, lens64, lens32)
    cache.masks[(mask, padding)] = mp
    b.g.model.facts.seq_lens_mask[lens32] = mask
    return mp


def _extra(b: Builder, mp: MaskPlumbing, key: str, make):
    if key not in mp.extra:
        mp.extra[key] = make()
    return mp.extra[key]


def _grid(b: Builder, mp: MaskPlumbing):
    """t as [T, 1] and b as [1, B] (int64), and B as a 1-element tensor."""

    def make():
        T = b.dim(mp.m2, 0)
        B = b.dim(mp.m2, 1)
        zero, one = b.const(np.array(0, np.int64), "zero"), b.const(np.array(1, np.int64), "one")
        t = b.unsqueeze(b.op("Range", zero, b.squeeze(T, [0]), one), [1])
        bb = b.unsqueeze(b.op("Range", zero, b.squeeze(B, [0]), one), [0])
        return t, bb, B

    return _extra(b, mp, "grid", make)


def _cumsum(b: Builder, mp: MaskPlumbing) -> str:
    return _extra(b, mp, "cs", lambda: b.op("CumSum", mp.mi, b.const(np.array(0, np.int64), "axis0")))


def _compact(b: Builder, cache: EmitCache, mp: MaskPlumbing, x: str, mask: str) -> str:
    """Each row's valid steps moved to the front, in order: x_c[k, b] = x[t_k(b), b]."""
    key = (x, mp.m2)  # (the valid-step mask: one tensor may be read as a valid mask and as a padding mask)
    if key in cache.compacted:
        return cache.compacted[key]
    xc = b.op("Gather", b.op("Flatten", x, axis=2), _compaction_index(b, mp), axis=0)
    cache.compacted[key] = xc
    b.g.model.facts.compactions[xc] = (x, mp.m2, mask)
    return xc


def _compaction_index(b: Builder, mp: MaskPlumbing) -> str:
    """Flat [T, B] row indices into a flattened [T*B, F] input that gather each row's valid steps first."""

    def make():
        t, bb, B = _grid(b, mp)
        cs = _cumsum(b, mp)
        one = b.const(np.array(1, np.int64), "one")
        # destination of step t: its rank among valid steps, or after all valid steps for masked ones
        dest = b.op(
            "Where",
            mp.m2,
            b.op("Sub", cs, one),
            b.op("Sub", b.op("Add", b.unsqueeze(mp.lens64, [0]), t), cs),
        )
        shape = b.op("Shape", mp.m2)
        src = b.op(
            "ScatterElements",
            b.op("ConstantOfShape", shape, value=_i64_tensor(0)),
            dest,
            b.op("Expand", t, shape),
            axis=0,
        )
        return b.op("Add", b.op("Mul", src, B), bb)

    return _extra(b, mp, "compaction", make)


def _i64_tensor(v: int):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array([v], dtype=np.int64))


def _init_state(b: Builder, init: Init, x: str, hidden: int, cache: EmitCache) -> str:
    """``[1, B, H]`` initial state input for the native op ('' when zeros)."""
    if init.is_zero:
        return ""
    if init.tensor is not None:
        if init.tensor not in cache.init_views:
            view = init.tensor if init.lead else b.unsqueeze(init.tensor, [0])
            if not _same_batch(b.g, init.tensor, 1 if init.lead else 0, x):
                # (not provably x's batch: a state given with batch 1 broadcasts against x's rows in the
                # original, and the native op takes exactly [1, B, H])
                view = b.op("Expand", view, _state_shape(b, cache, x, hidden))
            cache.init_views[init.tensor] = view
        return cache.init_views[init.tensor]
    return b.op("Expand", b.const(np.array(init.fill, np.float32), "fill"), _state_shape(b, cache, x, hidden))


def _state_shape(b: Builder, cache: EmitCache, x: str, hidden: int) -> str:
    """``[1, B, H]``, B the time-major ``x``'s batch (built once per x and H)."""
    if (x, hidden) not in cache.state_shapes:
        cache.state_shapes[x, hidden] = b.op("Concat", b.i64(1), b.dim(x, 1), b.i64(hidden), axis=0)
    return cache.state_shapes[x, hidden]


def _same_batch(g: Graph, state: str, axis: int, x: str) -> bool:
    """Whether ``state``'s extent on ``axis`` is the time-major ``x``'s batch: provably (one size, one tensor's
    axis), or by the model's inputs naming both alike."""
    if extent_key(g, state, axis) == extent_key(g, x, 1):
        return True
    name = declared_name(g, state, axis)
    return name is not None and name == declared_name(g, x, 1)


def _init_value(b: Builder, init: Init) -> str:
    """An initial value as something that broadcasts against [B, H]."""
    if init.tensor is not None:
        return b.squeeze(init.tensor, [0]) if init.lead else init.tensor
    return b.const(np.array(init.fill, np.float32), "fill")


def emit(g: Graph, rec: Recurrence, cache: EmitCache, post_padded: bool = False, portable: bool = False) -> Emission:
    cell = rec.cell
    b = Builder(g, rec.anchor, f"rnnfuse/{cell.op}")
    if b.opset < 7:
        raise Decline(f"opset {b.opset} is older than the native recurrent ops' opset 7")
    x_in, mask_in = prepared_input(g, rec)
    _need_float(g, x_in)
    x, mask, mrank, mask_source, mask_time_axis, direction = time_major_input(b, rec, x_in, mask_in)

    path = "unmasked"
    seq_lens = ""
    mp = None
    if mask is not None:
        _need_opset(b, 11, "the mask handling")
        mp = _mask_plumbing(b, cache, mask, mrank, rec.mask_negated)
        seq_lens = mp.lens32
        path = POST_PADDED if post_padded else GENERAL
        if rec.mask_made:  # a mask computed from lengths: post-padded by construction, or any pattern
            path = LENGTHS if rec.mask_made == "post" else GENERAL
        if rec.mask_negated:
            # a padding mask: validation's post-padded patterns are patterns of valid steps, and a mask made
            # from lengths valid-first is the padding, valid-last
            path = GENERAL
        if path == GENERAL:
            x = _compact(b, cache, mp, x, mask)
    # a time length that may be 0: a GRU reads full lengths (without them onnxruntime's aborts on no steps) and
    # final states are guarded (see rnnfuse.empty_runs)
    nonempty = None
    if mp is None and may_run_empty(g, x_in, rec.x_time_axis):
        if any(not fo.init.is_zero for fo in rec.finals):
            nonempty = has_steps(b, x)
        if cell.kind.op == "GRU":
            seq_lens = full_lengths(b, x)

    Ws, Rs, Bs = cell.weight_parts()
    ins = [x, b.stacked(Ws, "W"), b.stacked(Rs, "R"), b.stacked(Bs, "B") if cell.has_bias() else "", seq_lens]
    kind = cell.kind
    inits = {"h": rec.h0, "c": rec.c0}
    states_in = {s: _init_state(b, inits[s], x, cell.hidden, cache) for s in kind.states}
    ins += [states_in[s] for s in kind.states]
    extras = kind.extra_arrays(cell)  # e.g. an LSTM's peepholes P
    ins += [b.const(extras[name][None], name) if name in extras else "" for name in kind.extra_inputs]
    while ins and ins[-1] == "":
        ins.pop()
    native_dir = direction
    if portable and mp is not None and direction == "reverse":
        # OpenVINO's sequence kernel ignores sequence_lens (dynamic shapes) and so reverses whole rows:
        # reverse each row's valid steps here and run forward; only steps before a row's length are read
        ins[0] = b.op("ReverseSequence", ins[0], mp.lens64, batch_axis=1, time_axis=0)
        native_dir = "forward"
    attrs = native_attrs(cell, native_dir)
    outs = g.add_node(kind.op, ins, kind.n_outputs, name=f"rnnfuse/{kind.op}", anchor=rec.anchor, **attrs)
    native = g.producer[outs[0]]
    finals = {s: outs[kind.output_of(s)] for s in kind.states}
    Y3 = b.squeeze(outs[0], [1])
    if native_dir != direction:
        Y3 = b.op("ReverseSequence", Y3, mp.lens64, batch_axis=1, time_axis=0)  # what a reverse op's Y holds
    head_probes: dict[str, dict[str, tuple[str, int]]] = {}
    row_type = helper.np_dtype_to_tensor_dtype(np.asarray(Ws[0]).dtype)  # (the native op's: X, W, R and Y alike)
    h_init = states_in["h"]  # (what a head reading the h a step read sees first: the op's own initial h)
    if not h_init and any(so.head is not None and so.head.h_prev for so in rec.seq_outputs):
        h_init = b.op("Expand", b.const(np.array(0.0, np.float32), "fill"), _state_shape(b, cache, x, cell.hidden))
    repl = _replacements(b, rec, Y3, finals, mp, path, direction, head_probes, row_type, h_init, nonempty)
    for rs in rec.row_steps:  # a state at one step per row: a twin op whose sequence_lens end at that step
        if direction != "forward" or mp is not None:
            raise Decline("a state read at one step per row of a masked or reverse recurrence")
        repl[rs.tensor] = emit_row_step(b, rs, kind.op, ins, kind.n_outputs, kind.output_of(rs.which), attrs)
    for co in rec.counts:
        repl[co.tensor] = _final_count(b, co)
    _declare_outputs(g, rec, x_in, repl)
    # validation overrides a mask the original reads too; a mask made from lengths it must leave as it is
    return Emission(native, repl, path, direction, mask_source if mp is not None and not rec.mask_made else None,
                    mask_time_axis, head_probes)


def _final_count(b: Builder, co: CountOutput) -> str:
    """A counter's final value: its start plus the number of steps, in the counter's type and shape."""
    steps = b.op("Gather", b.op("Shape", co.of), b.const(np.array(co.axis, np.int64), "axis"), axis=0)
    et = b.g.model.elem_type(co.start)
    if not et:
        raise Decline(f"the type of the counter '{co.start}' is unknown")
    return b.op("Add", co.start, b.op("Cast", steps, to=et))


def _need_float(g: Graph, x: str) -> None:
    """Decline a recurrence whose sequence is not float32: the native op's weights, fills and states are built
    as float (a float16 or double cell's op would bind its type to two element types and not load, and an
    original that does not load in onnxruntime either would then take it unvalidated)."""
    et = g.model.elem_type(x)
    if et and et != TensorProto.FLOAT:
        raise Decline(f"the recurrence computes in {TensorProto.DataType.Name(et).lower()}: rnnfuse builds "
                      "float32 native ops only")


def _replacements(b: Builder, rec: Recurrence, Y3: str, finals: dict, mp, path: str, direction: str,
                  head_probes: dict, row_type: int, h_init: str = "", nonempty: str | None = None) -> dict[str, str]:
    """Original tensor -> the adapter computing it from the native op's outputs (``head_probes`` gains the
    probe points of each big head, see :class:`Emission`; ``row_type``: the element type of Y; ``nonempty``:
    whether x has a step, where its length may be 0: a final state is then its initial value)."""
    repl: dict[str, str] = {}
    for so in rec.seq_outputs:
        v = _seq_output(b, so, Y3, finals["h"], mp, path, direction)
        if direction == "reverse":
            v = b.flip0(v)
        probes: dict[str, tuple[str, int]] | None = {} if so.head is not None and so.head.probes else None
        if so.head is not None:  # a per-step head on h: applied to every step at once, in processing order
            v = apply_head(b, so.head, v, probes, row_type, h_init)
            if so.zero_masked:  # (where(m, head(h), 0): the head's value is zeros at masked steps)
                if mp is None:
                    raise Decline("a head zeroed at masked steps in a recurrence without a mask")
                valid = _valid_steps(b, mp, path)
                v = b.op("Where", b.flip0(valid) if direction == "reverse" else valid, v,
                         b.const(np.array(0.0, np.float32), "fill"))
        if so.accumulate:  # a running sum: its start plus every step's value (in any order: a sum)
            if probes:
                raise Decline("a running sum of a head checked at its probe points")
            repl[so.tensor] = b.op("Add", so.accumulate, b.reduce_sum(v, [0]))
            continue
        repl[so.tensor] = _as_stacked(b, so, v)
        if probes:
            head_probes[so.tensor] = {name: (_as_stacked(b, so, t), et) for name, (t, et) in probes.items()}
    for fo in rec.finals:
        src_t = finals.get(fo.which)
        if src_t is None:
            raise Decline("a final cell state from a cell without one")
        if mp is not None and fo.which == "h":
            # read the last valid step from Y rather than trusting Y_h with sequence_lens (runtimes differ
            # past a row's length: onnxruntime zero-fills, OpenVINO keeps computing)
            v = _final_from_y(b, mp, Y3, direction)
        else:
            v = b.squeeze(src_t, [0])
        if mp is not None:
            v = b.op("Where", _any_valid(b, mp), v, _init_value(b, fo.init))
        elif nonempty is not None and not fo.init.is_zero:  # (on no steps the native op's final states are zeros)
            v = b.op("Where", nonempty, v, _init_value(b, fo.init))
        if fo.lead:
            v = b.unsqueeze(v, [0])
        repl[fo.tensor] = v
    # the state after step k: that step of the hidden-state sequence (processing order), kept at masked steps.
    # The sequence is built once for all steps reading it alike (a backward chain of 6,660 steps read each
    # built its own flip of Y, and a masked one its own gather of Y back to the steps: T copies of [T, B, H])
    step_seqs: dict[tuple, str] = {}
    for sr in rec.step_reads:
        key = (sr.fill,) if sr.fill == NONE else (sr.fill, sr.init.tensor, sr.init.fill, sr.init.lead)
        seq = step_seqs.get(key)
        if seq is None:
            seq = _seq_output(b, SeqOutput("", sr.fill, sr.init), Y3, finals["h"], mp, path, direction)
            if direction == "reverse":
                seq = b.flip0(seq)
            step_seqs[key] = seq
        v = b.op("Gather", seq, b.const(np.array(sr.step, np.int64), "step"), axis=0)
        repl[sr.tensor] = b.unsqueeze(v, [0]) if sr.lead else v
    # every replacement gets a tensor of its own (a graph output may take over its name)
    seen: set[str] = set()
    for k, v in list(repl.items()):
        if v in seen:
            repl[k] = b.op("Identity", v)
        seen.add(repl[k])
    return repl


def _as_stacked(b: Builder, so, v: str) -> str:
    """Steps ``v`` ([T, B, ...] in processing order) laid out as the original stacks ``so``'s steps."""
    if so.reversed:
        v = b.flip0(v)
    if so.time_axis:
        v = b.op("Transpose", v, perm=[1, 0, 2] if so.time_axis == 1 else [1, 2, 0])
    return v


def _declare_outputs(g: Graph, rec: Recurrence, x: str, repl: dict) -> None:
    """What the new tensors are, for the passes that read them next (a stacked layer slices a sequence output);
    ``x`` is the prepared input."""
    hidden = rec.cell.hidden
    xt = g.model.known_type(x)
    et = xt[0] if xt and xt[0] else 1
    xs = xt[1] if xt and xt[1] else [None, None, None]
    T, B = [(xs[0], xs[1]), (xs[1], xs[0]), (xs[2], xs[0])][rec.x_time_axis]
    for so in rec.seq_outputs:
        width = hidden if so.head is None else None
        dims = [B, width] if so.accumulate else [[T, B, width], [B, T, width], [B, width, T]][so.time_axis]
        g.model.declare(repl[so.tensor], (et, dims))
    for fo in list(rec.finals) + list(rec.step_reads):
        g.model.declare(repl[fo.tensor], (et, [1, B, hidden] if fo.lead else [B, hidden]))


def _seq_output(b: Builder, so, Y3: str, Yh: str, mp: MaskPlumbing | None, path: str, direction: str) -> str:
    if mp is None or so.fill == NONE:
        if mp is not None:
            raise Decline("a per-step output that ignores the mask")
        return Y3
    if path in (POST_PADDED, LENGTHS):
        # every value past a row's length is set explicitly: runtimes disagree about Y there
        inlen = _valid_steps(b, mp, path)
        if so.fill == ZERO:
            return b.op("Where", inlen, Y3, b.const(np.array(0.0, np.float32), "fill"))
        if direction == "forward":
            last = b.op("Where", _any_valid(b, mp), _final_from_y(b, mp, Y3, direction), _init_value(b, so.init))
            return b.op("Where", inlen, Y3, b.unsqueeze(last, [0]))
        return b.op("Where", inlen, Y3, _init_value(b, so.init))
    # exact path: results are in compacted order; gather each step's value back
    t, bb, B = _grid(b, mp)
    cs = _cumsum(b, mp)
    zero = b.const(np.array(0, np.int64), "zero")
    if direction == "forward":
        idx = b.op("Sub", cs, b.const(np.array(1, np.int64), "one"))
        valid = mp.m2 if so.fill == ZERO else b.op("Greater", cs, zero)
    else:
        idx = b.op("Sub", cs, mp.mi)
        valid = mp.m2 if so.fill == ZERO else b.op("Less", idx, b.unsqueeze(mp.lens64, [0]))
    safe = b.op("Where", valid, idx, zero)
    flat = b.op("Add", b.op("Mul", safe, B), bb)
    gathered = b.op("Gather", b.op("Flatten", Y3, axis=2), flat, axis=0)
    out = b.op("Where", b.unsqueeze(valid, [2]), gathered, _fill_of(b, so))
    # at each row's k-th valid step this holds Y3[k]: a next layer compacting it with the same mask reads Y3
    b.g.model.facts.uncompactions[out] = (Y3, mp.m2)
    return out


def _valid_steps(b: Builder, mp: MaskPlumbing, path: str) -> str:
    """[T, B, 1] bool, in processing order: whether each step of each row is a valid one (where a ZERO fill
    keeps Y)."""
    if path in (POST_PADDED, LENGTHS):
        t, _, _ = _grid(b, mp)
        return b.unsqueeze(b.op("Less", t, b.unsqueeze(mp.lens64, [0])), [2])
    return b.unsqueeze(mp.m2, [2])


def _fill_of(b: Builder, so) -> str:
    return b.const(np.array(0.0, np.float32), "fill") if so.fill == ZERO else _init_value(b, so.init)


def native_attrs(cell, direction: str) -> dict:
    """Attributes of the native op for ``cell`` (activation lists repeated for bidirectional): the kind's."""
    return cell.kind.attributes(cell, direction)


def _any_valid(b: Builder, mp: MaskPlumbing) -> str:
    """[B, 1]: whether a row has at least one valid step."""
    return _extra(b, mp, "any_valid", lambda: b.unsqueeze(
        b.op("Greater", mp.lens64, b.const(np.array(0, np.int64), "zero")), [1]))


def _final_from_y(b: Builder, mp: MaskPlumbing, Y3: str, direction: str) -> str:
    """[B, H]: the state after each row's last valid step, read from Y (step len-1 forward, step 0 reverse)."""
    if direction == "reverse":
        return b.op("Gather", Y3, b.const(np.array(0, np.int64), "zero"), axis=0)
    t, bb, B = _grid(b, mp)
    zero = b.const(np.array(0, np.int64), "zero")
    last = b.op("Where", b.op("Greater", mp.lens64, zero), b.op("Sub", mp.lens64, b.const(np.array(1, np.int64), "one")), zero)
    flat = b.op("Add", b.op("Mul", last, b.squeeze(B, [0])), b.squeeze(bb, [0]))
    return b.op("Gather", b.op("Flatten", Y3, axis=2), flat, axis=0)
