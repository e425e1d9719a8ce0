"""The step mask of a Loop body: a bool mask it reads (checked here), a length mask it computes from the
iteration number (:func:`.loop_reads.length_mask`), or one it computes row by row from the step's element of an
input (x_t, or a ``[T, B]`` float or integer mask compared with 0: :func:`rnnfuse.row_wise.body_mask`). The
last two are built for every step beside the loop, so that the native op and the original read one mask (the
one validation overrides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnx import NodeProto

from rnnfuse.builder import Builder
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.mask_proof import body_mask_differs
from rnnfuse.recurrence import Recurrence
from rnnfuse.row_wise import ROW_RANK, body_mask, mask_on_every_step
from rnnfuse.symbolic import BoolMask

if TYPE_CHECKING:
    from .loop import StepReads


@dataclass
class RowReads:
    """The body's reads of one step of an outer tensor (``Gather(S, i, axis)`` on its time axis)."""

    source: str  # S: [T, B, F] (x), or [T, B] (one value a row: a float or integer mask, say); or batch-first
    reads: set[str]  # the body tensors holding the step's element
    nodes: list  # the Gather nodes reading it
    x_rank: int  # as row_wise.row_masks reads them
    axis: int = 0  # S's time axis: 0 time-major, 1 batch-first ([B, T]: ``mask[:, t]``)


LENGTH_MASK = "<the mask t < lengths, built before the native op>"
DERIVED_MASK = "<the mask the body computes from x_t (or a [T, B] input), computed for every step before the loop>"


def attach_length_mask(g: Graph, recs: list[Recurrence], step_in: StepReads) -> None:
    """A hand-written length mask: the native ops that keep to it get it built by the emitter, before them."""
    if not any(r.mask == LENGTH_MASK for r in recs):
        return
    if g.model.opset < 11:
        raise Decline(f"a length mask needs opset 11 (Range); the model has opset {g.model.opset}")
    for r in recs:
        if r.mask == LENGTH_MASK:
            r.x_prep.lengths, r.mask_made = step_in.lengths, "post" if step_in.lengths.valid_first else "any"
            r.notes.append(f"mask: {step_in.lengths.op} of the step and '{step_in.lengths.lengths}' (lengths)")


def attach_derived_mask(g: Graph, body: Graph, loop: NodeProto, recs: list[Recurrence], step_in: StepReads) -> None:
    """A mask the body computes from x_t: computed for every step at once beside the loop (``M``, the same
    row-wise nodes on every step's rows), and the body reads its step of ``M`` where it computed it, so that
    the original and the rewrite read one mask (the one validation overrides)."""
    if not any(r.mask == DERIVED_MASK for r in recs):
        return
    d, src = step_in.derived, step_in.derived_from
    b = Builder(g, loop, "rnnfuse/step_mask")
    # (M is laid out like S: [T, B(, 1)], or [B, T(, 1)] for a batch-first S)
    mask = mask_on_every_step(b, d.nodes, sorted(src.reads), src.source, d.out, d.rank, d.consts, src.x_rank)
    # (validation compares the op with the body given M: that M is what the body computed is proven here)
    why = body_mask_differs(g, mask, src.axis, src.source, src.axis, sorted(src.reads), d.nodes, d.out, d.consts)
    if why is not None:
        raise Decline(why)
    read = src.nodes[0]  # Gather(S, i, axis): the step's index, as its element is read
    body.rewrite_in_place(body.producer[d.out], "Gather", [mask, read.input[1]], axis=src.axis)
    for r in recs:
        if r.mask == DERIVED_MASK:
            r.mask = mask
            laid_out_like_x(r, src.axis)
            what = "the step input" if src.x_rank == ROW_RANK else f"'{src.source}'"
            r.notes.append(f"mask: computed from {what} in the body, for every step before the loop")


def find_derived_mask(g: Graph, body: Graph, step_in: StepReads, invariants: dict[str, str]) -> None:
    """The one step mask the body computes from the step's element of a ``[T, B]`` input that is no bool mask
    (a float mask compared with 0) or else from x_t (read by ``Gather(S, i)`` on the time-major axis), if any,
    becomes the step's mask: its leaf, and ``step_in.derived``. A ``[T, B]`` input read otherwise declines."""

    def const_of(name: str):
        return g.const(invariants[name]) if name in invariants else body.const(name)

    x = RowReads(step_in.x_read_source, step_in.x_reads, step_in.x_read_nodes, step_in.x_rank, step_in.x_axis)
    for src in ([step_in.rows] if step_in.rows is not None else [x]):
        # (each read is element i of the source on src.axis, as step_read found it, through any view of it: its
        # Gather gives the index the body's read of M takes)
        if src.axis not in (0, 1) or not all(n.op_type == "Gather" for n in src.nodes):
            continue
        step_in.derived = body_mask(body, src.reads, const_of, src.x_rank)
        if step_in.derived is not None:
            step_in.leaves[step_in.derived.out] = BoolMask("m", False, step_in.derived.rank == 2)
            step_in.mask_outer, step_in.derived_from = DERIVED_MASK, src
            return
    if step_in.rows is not None:
        raise Decline(f"the body reads a step of '{step_in.rows.source}' (one value a row, not bool) other than to compute"
                      " its mask")


def laid_out_like_x(rec: Recurrence, mask_axis: int) -> None:
    """Record the time axis ``mask_axis`` of ``rec``'s mask where it is not the one of the x ``rec`` reads (a
    ``[B, T]`` mask beside a time-major x, or the cell below's time-major Y above a batch-first mask)."""
    if rec.mask is not None and mask_axis != rec.x_time_axis:
        rec.mask_batch_first = mask_axis == 1


def check_mask_read(g: Graph, data: str, axis: int, rank: int | None, mask_outer: str | None) -> None:
    """A bool mask read by the body: one, along axis 0 or 1 (batch-first, as the step input must be too), one
    value a row."""
    if mask_outer not in (None, data):
        raise Decline("two different masks are read")
    if axis not in (0, 1):
        raise Decline(f"the mask is read along axis {axis}")
    if rank not in (2, 3):
        raise Decline(f"the mask has rank {rank}")
    if rank == 3 and (g.model.shape(data) or [None] * 3)[2] != 1:
        raise Decline("the mask is not one value per row (or its last axis is not known to be 1)")
