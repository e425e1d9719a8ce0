"""Scan front end: ONNX ``Scan`` (opset 9+) whose body is one recurrent step.

Scan states are the cell's states (or copies of its output, or pass-through values); the scan inputs are the
step input (float ``[T, B, F]``, or ``[B, T, F]`` with ``scan_input_axes=1``) and optionally a bool mask
scanned the same way; ``scan_input_directions=1`` processes time backwards; scan outputs are the per-step
outputs (``scan_output_axes`` / ``scan_output_directions`` honoured). A body that runs several cells per step
is read layer by layer (:mod:`rnnfuse.recurrence_layers`): one native op per cell, each above the first
reading the Y of the one below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.carried import carried_unchanged
from rnnfuse.dims import fixed_batch
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.findings import Options, PassResult
from rnnfuse.protos import scan_output_layout
from rnnfuse.recurrence import InputPrep, Recurrence
from rnnfuse.recurrence_layers import cells_first, check_feeds, layer_recurrence, split_layers
from rnnfuse.inputs import input_projection, projected_leaf, reading_projections
from rnnfuse.mask_proof import body_mask_differs
from rnnfuse.rewrite import fuse_nodes
from rnnfuse.builder import Builder
from rnnfuse.row_wise import ROW_RANK, BodyMask, body_mask, mask_on_every_step
from rnnfuse.step import StepOut, analyse
from rnnfuse.symbolic import Const, BoolMask, Opaque, Poly, State, SymTensor, StepInput, weight_ops

from .loop_inputs import find_input_map, side_by_side
from .loop_heads import FarOutputs, HeadCandidate, add_heads, state_output, state_value_keys, with_far_outputs


def _passthrough(body: Graph, k: int) -> bool:
    """Whether state k is passed on unchanged (a weight or bound threaded through the Scan)."""
    return carried_unchanged(body, body.output_names[k], body.input_names[k])


@dataclass
class _Scanned:
    """The scanned step input (and mask) of a Scan."""

    x_outer: str  # the tensor the recurrence reads (X, or X0 when the steps read slices of X0 @ K + b)
    x_atom: StepInput
    x_dir: int  # scan_input_directions: 1 runs time backwards
    x_axis: int  # 0: time-major; 1: batch-first
    mask_outer: str | None
    x_prep: InputPrep  # the projection's time flips, built by the emitter
    x_reads: set[str] = field(default_factory=set)  # the body input that is x_t
    x_read_source: str = ""  # the scanned tensor (X, or X0 @ K + b)
    x_read_axis: int = 0  # the axis the Scan slices it along (x_axis is X0's when the steps read a projection)
    derived: BodyMask | None = None  # the step mask the body computes from x_t

    @property
    def x_reversed(self) -> bool:
        return bool(self.x_dir)


def scan_recurrence(g: Graph, scan: NodeProto) -> tuple[Recurrence, dict] | list[tuple[Recurrence, dict]]:
    return reading_projections(lambda: with_far_outputs(lambda far: _scan_recurrence(g, scan, far)))


def _scan_recurrence(g: Graph, scan: NodeProto, far: FarOutputs):
    if g.model.opset < 9:
        raise Decline("Scan before opset 9 (batched form with sequence_lens)")
    body = g.subgraph(scan)
    n_state = len(scan.input) - attr(scan, "num_scan_inputs")
    leaves: dict = {}
    # state inputs passed on unchanged (weights, bounds, context): body input -> the Scan's input
    passed = {body.input_names[k]: scan.input[k] for k in range(n_state) if _passthrough(body, k)}
    scanned = _scanned_inputs(g, body, scan, n_state, passed, leaves)
    states, recurrent, aliases = _scan_states(g, body, scan, n_state, leaves)
    state_out = {f"s{k}": body.output_names[k] for k in recurrent}
    layers = split_layers(body, leaves, state_out, scanned.x_atom, fixed_batch(g, scanned.x_outer, scanned.x_axis))
    layer_step_states = cells_first(g, scan, body, layers, states, body_out=0, node_in=0)
    outs, heads = _scan_outputs(g, body, scan, n_state, layers, state_out, far)
    where = scan.name or scan.output[0]
    recs: list[Recurrence] = []
    cell_states: list[tuple[str, str | None]] = []
    for li, layer in enumerate(layers):
        an = analyse(layer.x, layer_step_states[li], outs[li], states)
        rec = layer_recurrence("Scan", where, an, layers, li, recs, x=scanned.x_outer, mask=scanned.mask_outer,
                               x_time_axis=scanned.x_axis, x_reversed=bool(scanned.x_dir),
                               x_prep=scanned.x_prep, remove=[scan], anchor=scan)
        cell_states.append((an.rec.h, an.rec.c))
        recs.append(rec)
    check_feeds(layers, cell_states)
    if scanned.derived is not None and any(r.mask == _DERIVED_MASK for r in recs):
        _scan_derived_mask(g, body, scan, recs, scanned)
    if heads:  # per-step outputs computed from a new h: the head runs on Y after the native op
        add_heads(body, layers, recs, cell_states, heads, state_out, scanned, passed, set())
    if len(recs) == 1:
        return recs[0], aliases
    return [(r, aliases if i == 0 else {}) for i, r in enumerate(recs)]


def _scanned_inputs(g: Graph, body: Graph, scan: NodeProto, n_state: int, passed: dict[str, str],
                    leaves: dict) -> _Scanned:
    """The float input scanned over time (or several side by side, scanned alike) and an optional bool mask
    scanned the same way; their body tensors' symbolic values go into ``leaves``."""
    m = attr(scan, "num_scan_inputs")
    bin_ = body.input_names
    in_dirs = attr(scan, "scan_input_directions") or [0] * m
    in_axes = attr(scan, "scan_input_axes") or [0] * m
    x_outer = mask_outer = None
    x_atom = None
    x_dir = x_axis = None
    x_prep = InputPrep()
    floats: list[tuple[str, str, int, int]] = []  # the float inputs scanned: (outer, body input, direction, axis)
    for j in range(m):
        outer = scan.input[n_state + j]
        inner = bin_[n_state + j]
        et = g.model.elem_type(outer)
        rank = g.model.rank(outer)
        ax = in_axes[j] % rank if rank else in_axes[j]
        if ax not in (0, 1):
            raise Decline(f"a scan input scanned along axis {in_axes[j]}")
        if et == TensorProto.BOOL:
            if mask_outer is not None:
                raise Decline("two masks are scanned")
            if rank not in (2, 3):
                raise Decline(f"the scanned mask has rank {rank}")
            mask_outer, m_dir, m_axis = outer, in_dirs[j], ax
            leaves[inner] = BoolMask("m", False, rank == 3)
        else:
            if rank != 3:
                raise Decline(f"the scanned input has rank {rank}, not 3")
            floats.append((outer, inner, in_dirs[j], ax))
    if len({(d, ax) for _, _, d, ax in floats}) > 1:
        raise Decline("two inputs are scanned in different directions or along different axes")
    if len(floats) > 1:  # sequences scanned side by side: the native op reads them concatenated on features
        x_outer, x_inner, x_dir, x_axis = floats[0]
        x_scanned, x_scanned_axis = x_outer, x_axis
        parts: dict[str, list[str]] = {}
        for outer, inner, _, _ in floats:  # (one tensor scanned twice is one sequence read by both)
            parts.setdefault(outer, []).append(inner)
        x_atom, side = side_by_side(g, parts, x_axis, leaves)
        x_prep = InputPrep(side_by_side=side)
    elif floats:
        x_outer, x_inner, x_dir, x_axis = floats[0]
        x_scanned, x_scanned_axis = x_outer, x_axis
        input_map = find_input_map(g, body, x_outer, x_axis, [x_inner], ROW_RANK, passed)
        proj = input_projection(g, x_outer, x_axis) if input_map is None else None
        if input_map is not None:  # the cell reads a row-wise map of x_t: the op reads it on every step
            x_atom = StepInput("x", input_map.width)
            leaves[input_map.value] = SymTensor(Poly.atom(x_atom))
            x_prep = InputPrep(input_map=input_map)
        elif proj is not None:  # the steps read slices of X0 @ K + b: the recurrence reads X0
            x_atom, leaves[x_inner] = projected_leaf(proj)
            x_outer, x_prep, x_axis = proj.x0, InputPrep(proj.flips), proj.time_axis
        else:
            shape = g.model.shape(x_outer)
            x_atom = StepInput("x", shape[2] if shape and isinstance(shape[2], int) else None)
            leaves[x_inner] = SymTensor(Poly.atom(x_atom))
    if x_outer is None:
        raise Decline("no scanned float input")
    if mask_outer is not None and (m_dir, m_axis) != (x_dir, x_axis):
        raise Decline("the mask is scanned differently from the input")
    scanned = _Scanned(x_outer, x_atom, x_dir, x_axis, mask_outer, x_prep, {x_inner}, x_scanned, x_scanned_axis)
    if mask_outer is None:  # (none scanned: perhaps one computed from x_t)
        _find_derived_mask(g, body, passed, scanned, leaves)
    return scanned


_DERIVED_MASK = "<the mask the body computes from x_t, computed for every step and scanned>"


def _find_derived_mask(g: Graph, body: Graph, passed: dict[str, str], scanned: _Scanned, leaves: dict) -> None:
    """The one step mask the body computes from x_t alone, row by row (:func:`rnnfuse.row_wise.row_masks`), if
    any, becomes the step's mask: its leaf, and ``scanned.derived``."""

    def const_of(name: str):
        return g.const(passed[name]) if name in passed else body.const(name)

    scanned.derived = body_mask(body, scanned.x_reads, const_of)
    if scanned.derived is not None:
        leaves[scanned.derived.out] = BoolMask("m", False, scanned.derived.rank == 2)
        scanned.mask_outer = _DERIVED_MASK


def _scan_derived_mask(g: Graph, body: Graph, scan: NodeProto, recs: list[Recurrence], scanned: _Scanned) -> None:
    """A mask the body computes from x_t: computed for every step at once beside the Scan (``M``, the same
    row-wise nodes on every step's rows) and scanned with x, the body reading its step of ``M`` where it
    computed it, so that the original and the rewrite read one mask (the one validation overrides)."""
    d = scanned.derived
    b = Builder(g, scan, "rnnfuse/step_mask")
    mask = mask_on_every_step(b, d.nodes, sorted(scanned.x_reads), scanned.x_read_source, d.out, d.rank, d.consts)
    # (validation compares the op with the body given M: that M is what the body computed is proven here; M is
    # scanned as x is, the body's x_t a slice of the scanned tensor along its own scan axis)
    why = body_mask_differs(g, mask, scanned.x_axis, scanned.x_read_source, scanned.x_read_axis,
                            sorted(scanned.x_reads), d.nodes, d.out, d.consts)
    if why is not None:
        raise Decline(why)
    n_scan = attr(scan, "num_scan_inputs")
    for a in scan.attribute:  # the mask is scanned as x is: the same axis and direction
        if a.name == "num_scan_inputs":
            a.i = n_scan + 1
        elif a.name == "scan_input_axes":
            a.ints.append(scanned.x_axis)
        elif a.name == "scan_input_directions":
            a.ints.append(scanned.x_dir)
    scan.input.append(mask)
    step = body.add_input("rnnfuse/step_mask", TensorProto.BOOL, [None] * d.rank)
    body.rewrite_in_place(body.producer[d.out], "Identity", [step])  # (the Scan's inputs are read again there)
    for r in recs:
        if r.mask == _DERIVED_MASK:
            r.mask = mask
            r.notes.append("mask: computed from the step input in the body, for every step before the scan")


def _scan_states(g: Graph, body: Graph, scan: NodeProto, n_state: int, leaves: dict):
    """Scan states: pass-through values become constants (their final values aliases of their inits), the
    others recurrent states. Returns (states by symbol, the recurrent positions, aliases)."""
    bin_ = body.input_names
    states: dict[str, State] = {}
    recurrent: list[int] = []
    aliases: dict[str, str] = {}
    for k in range(n_state):
        init = scan.input[k]
        if _passthrough(body, k):
            c = g.const(init)
            fv = g.fill_value(init)
            leaves[bin_[k]] = Const(c) if c is not None else Const(np.array(fv, np.float32)) if fv is not None else Opaque(
                f"scan state '{bin_[k]}' is passed through but computed at runtime")
            if k < len(scan.output) and scan.output[k] and g.n_uses(scan.output[k]):
                aliases[scan.output[k]] = init
            continue
        shape = body.local_shape(bin_[k]) or g.model.shape(init) or []
        H = shape[-1] if shape and isinstance(shape[-1], int) else None
        st = State(f"s{k}", H)
        states[st.sym] = st
        leaves[bin_[k]] = SymTensor(Poly.atom(st))
        recurrent.append(k)
    if not recurrent:
        raise Decline("no recurrent state")
    return states, recurrent, aliases


def _scan_outputs(g: Graph, body: Graph, scan: NodeProto, n_state: int, layers: list, state_out: dict[str, str],
                  far: FarOutputs):
    """The used scan outputs by layer (``scan_output_axes`` / ``scan_output_directions`` honoured), and the
    ones that are no state of the step (perhaps heads on a new h)."""
    bout = body.output_names
    n_scan_out = len(bout) - n_state
    out_axes, out_dirs = scan_output_layout(scan, n_scan_out)
    outs: dict[int, list[StepOut]] = {i: [] for i in range(len(layers))}
    heads: list[HeadCandidate] = []
    state_keys = state_value_keys(layers, state_out, far)
    for j in range(n_scan_out):
        outer = scan.output[n_state + j] if n_state + j < len(scan.output) else ""
        if not outer or not g.n_uses(outer):
            continue
        rank = 3
        ax = out_axes[j] % rank
        if ax not in (0, 1):
            raise Decline(f"a scan output stacked along axis {out_axes[j]}")
        found = state_output(layers, bout[n_state + j], state_keys)
        if found is None:
            heads.append(HeadCandidate(bout[n_state + j], outer, time_axis=ax, reversed=bool(out_dirs[j])))
            continue
        li, poly = found
        outs[li].append(StepOut(poly, outer, time_axis=ax, reversed=bool(out_dirs[j])))
    return outs, heads


class FuseScans:
    """Rewrite recurrent ``Scan`` nodes of the main graph into native LSTM/GRU/RNN ops."""

    name = "scan"
    fuses_only_with = frozenset({"Scan"})

    def run(self, model: Model, ctx: Options) -> PassResult:
        return fuse_nodes(model, ctx, self.name, "Scan", "Scan", scan_recurrence, body_needs=weight_ops())
