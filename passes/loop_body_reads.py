"""What a Loop body reads per step, sorted: the input's reads (by the tensor read, the time axis, the order
and how far ahead of the iteration number), the mask, a length mask, a [T, B] tensor of one value a row
(:func:`body_reads`), and the offset the native op's input starts at (:func:`input_offset`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import TensorProto

from rnnfuse.dataflow import rank_of
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.symbolic import BoolMask
from .loop_lengths import counting_offset, length_mask
from .loop_masks import RowReads, check_mask_read
from .loop_reads import cast_of_bool, step_read


@dataclass
class BodyReads:
    """What a body reads per step, sorted: the input's reads by the tensor they read (several: sequences read side
    by side), the mask, a length mask, a [T, B] tensor of rows, and how the reads index time."""

    leaves: dict = field(default_factory=dict)
    x_parts: dict = field(default_factory=dict)  # tensor read as the step input -> its body read nodes
    x_axis: int | None = None
    mask_outer: str | None = None
    mask_axis: int = 0
    lengths: object = None
    rows: RowReads | None = None
    forms: set = field(default_factory=set)  # "forward" | "reverse" | "reverse_end"
    offsets: set = field(default_factory=set)  # s of the input's reads at step i + s (loop_reads.read_offset)


def body_reads(g: Graph, body: Graph, index_syms: dict[str, int], invariants: dict[str, str]) -> BodyReads:
    """Sort the body's per-step reads (element i of an invariant tensor, a length mask computed from i).
    ``index_syms`` (body name -> its offset from the iteration number) gains the elements of counting
    sequences read at i."""
    r = BodyReads()
    for n in body.nodes:
        lm = length_mask(g, body, n, index_syms, invariants)
        if lm is not None:  # t < lengths written by hand: a step mask computed from the iteration number
            if r.lengths is not None and r.lengths.key != lm.key:
                raise Decline("two different length masks are computed")
            r.lengths = lm
            r.leaves[n.output[0]] = BoolMask("m", False, lm.unit)
            continue
        read = step_read(g, body, n, index_syms, invariants)
        if read is None:
            continue
        data, axis, form, ahead = read
        offset = counting_offset(g, data) if (axis, form, ahead) == (0, "forward", 0) else None
        if offset is not None:  # element i of (s, s + 1, ...): the iteration number, plus s
            index_syms[n.output[0]] = offset
            continue
        r.forms.add(form)
        et = g.model.elem_type(data)
        rank = rank_of(g, data)
        of_bool = cast_of_bool(g, data) if et != TensorProto.BOOL and rank == 2 else None  # ([T, B]: one value a row)
        if et == TensorProto.BOOL or of_bool is not None:  # (a bool mask, or one cast to 0/1 numbers outside)
            _at_the_step(ahead, "a mask")
            check_mask_read(g, of_bool or data, axis, rank, r.mask_outer)
            r.mask_outer, r.mask_axis = of_bool or data, axis
            mask = BoolMask("m", False, rank == 3 or n.op_type == "Slice")  # ([B, 1] a row)
            r.leaves[n.output[0]] = mask if of_bool is None else mask.as_number()
        elif rank == 2 and axis in (0, 1) and (r.rows is None or (r.rows.source, r.rows.axis) == (data, axis)):
            # one value a row per step, no bool: what the body may compute its step mask from
            _at_the_step(ahead, "a sequence of one value a row")
            r.rows = r.rows or RowReads(data, set(), [], 1, axis)
            r.rows.reads.add(n.output[0])
            r.rows.nodes.append(n)
        else:
            if r.x_axis not in (None, axis):
                raise Decline("two per-step inputs are read along different axes")
            if rank != 3:
                raise Decline(f"the per-step input has rank {rank}, not [T, B, F]")
            if axis not in (0, 1, 2):
                raise Decline(f"the per-step input is read along axis {axis}")
            r.x_axis = axis
            r.x_parts.setdefault(data, []).append(n)
            r.offsets.add(ahead)
    return r


def _at_the_step(ahead: int, what: str) -> None:
    """Decline ``what`` read ahead of the iteration number: only the input is read from a later step (the
    native op's input is then x from that step on; a mask or rows read so would need the same cut, not done)."""
    if ahead:
        raise Decline(f"{what} is read {ahead} steps ahead of the iteration number")


def input_offset(r: BodyReads, proj, rows) -> int:
    """s when every read of the input takes its element ``i + s`` (0: the iteration's own), read alone: a mask,
    a length mask, rows, a second sequence or a time flip beside it would need the same cut (not done)."""
    if len(r.offsets) > 1:
        raise Decline(f"the per-step input is read at {len(r.offsets)} different offsets from the iteration number")
    ahead = next(iter(r.offsets), 0)
    if ahead and (r.mask_outer is not None or r.lengths is not None or rows is not None or len(r.x_parts) > 1
                  or (proj is not None and proj.flips)):
        raise Decline(f"the input is read {ahead} steps ahead of the iteration number beside a mask, lengths, "
                      "another sequence or a time flip")
    return ahead
