"""The native op's input: the recurrence's x and mask with what the front end found but did not build (a map
of x's rows, time flips, the slice of the steps run over, sequences read side by side, a mask cut to x's
length or built from lengths), then laid out time-major as the op reads them (:func:`time_major_input`)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .builder import Builder
from .errors import Decline
from .graph import Graph, attr
from .op_args import TO_THE_END
from .recurrence import Recurrence
from .time_flips import time_flip_source


def prepared_input(g: Graph, rec: Recurrence) -> tuple[str, str | None]:
    """``rec.x`` and ``rec.mask`` with what the front end found but did not build (``rec.x_prep``): the map of
    x's rows the cell reads, the time flips of x, then the slice of the steps the recurrence runs over (x and
    mask alike)."""
    x, mask = rec.x, rec.mask
    if rec.x_prep.ys_beside or rec.x_prep.side_by_side:  # sequences read beside x: one input, features after x's
        others = _laid_out_like_x(g, rec.x_prep.side_by_side, rec.anchor, rec.x_prep.side_batch_first,
                                  rec.x_prep.side_map)
        x = _side_by_side(g, x, (*rec.x_prep.ys_beside, *others), rec.anchor)
    if rec.x_prep.input_map is not None:  # (row-wise: it commutes with the flips and the slice below)
        x = rec.x_prep.input_map.build(g, x, rec.anchor)
    for flip in rec.x_prep.flips:
        if flip.op_type == "ReverseSequence":
            flipped = g.add_node("ReverseSequence", [x, flip.input[1]], 1, name="rnnfuse/ReverseSequence", anchor=flip,
                                 time_axis=attr(flip, "time_axis", 0), batch_axis=attr(flip, "batch_axis", 1))[0]
        elif flip.op_type == "Gather":  # the indices T-1 .. 0 hold for x too (same time length)
            flipped = g.add_node("Gather", [x, flip.input[1]], 1, name="rnnfuse/Gather", anchor=flip,
                                 axis=attr(flip, "axis", 0))[0]
        else:
            flipped = g.add_node("Slice", [x] + list(flip.input[1:]), 1, name="rnnfuse/Slice", anchor=flip)[0]
        g.model.declare(flipped, g.model.known_type(x))  # a time flip keeps the type and shape
        x = flipped
    if rec.x_prep.steps is not None:
        start, stop, axis = rec.x_prep.steps
        bounds = [np.array([v], np.int64) for v in rec.x_prep.steps]
        consts = [g.add_initializer(v, f"rnnfuse/slice{i}") for i, v in enumerate(bounds)]
        if rec.x_prep.count is not None:
            consts[1] = _counted_stop(g, rec.x_prep.count, consts[0], rec.anchor)
        x = _steps_of(g, x, consts, start, stop, axis, rec.anchor)
        if mask is not None:
            mask = _steps_of(g, mask, consts, start, stop, axis, rec.anchor)
    if rec.x_prep.lengths is not None:  # the mask is t compared with lengths: built from them, laid out like x
        # (over the steps run: x's first M for a runtime trip count M, read forward)
        mask = rec.x_prep.lengths.build(g, x if rec.x_prep.count is not None else rec.x, rec.x_time_axis, rec.anchor)
    if mask is not None and rec.mask_cut:  # (its first T steps, as the loop reads them)
        mask = _first_steps(g, mask, x, rec)
    return x, mask


def _first_steps(g: Graph, mask: str, x: str, rec: Recurrence) -> str:
    """``mask`` cut to x's time length along its time axis."""
    axis = rec.x_time_axis if rec.mask_batch_first is None else int(rec.mask_batch_first)
    b = Builder(g, rec.anchor, "rnnfuse/mask_cut")
    cut = b.op("Slice", mask, b.i64(0), b.dim(x, rec.x_time_axis), b.i64(axis))
    dims = list(g.model.shape(mask) or []) or None
    if dims is not None and axis < len(dims):
        dims[axis] = (g.model.shape(x) or [None] * 3)[rec.x_time_axis]  # (x's time length)
    g.model.declare(cut, (g.model.elem_type(mask), dims))
    return cut


def _laid_out_like_x(g: Graph, others: tuple, anchor, batch_first: bool = False, side_map=None) -> tuple:
    """Sequences read beside a [T, B, F] x laid out like it: ``side_map`` (a step input map) applied to each
    first, in its own layout, then [B, T, F] ones (``batch_first``) transposed."""
    if side_map is not None:
        others = tuple(side_map.build(g, name, anchor) for name in others)
    if not batch_first:
        return others
    laid = []
    for name in others:
        t = g.add_node("Transpose", [name], 1, name="rnnfuse/Transpose", anchor=anchor, perm=[1, 0, 2])[0]
        dims = g.model.shape(name)
        g.model.declare(t, (g.model.elem_type(name), [dims[1], dims[0], dims[2]] if dims else None))
        laid.append(t)
    return tuple(laid)


def _side_by_side(g: Graph, x: str, others: tuple, anchor) -> str:
    """``x`` and ``others`` (all [T, B, F_k]) concatenated on features, declared so."""
    shapes = [g.model.shape(name) or [None] * 3 for name in (x, *others)]
    width = sum(s[2] for s in shapes) if all(isinstance(s[2], int) for s in shapes) else None
    cat = g.add_node("Concat", [x, *others], 1, name="rnnfuse/Concat", anchor=anchor, axis=2)[0]
    g.model.declare(cat, (TensorProto.FLOAT, [shapes[0][0], shapes[0][1], width]))
    return cat


def _counted_stop(g: Graph, count: str, start: str, anchor) -> str:
    """The step after the last of ``count`` steps from ``start``, ``start + max(count, 0)`` as a 1-element int64:
    a loop whose trip count is not positive runs no step (a negative Slice end would count from the end)."""
    b = Builder(g, anchor, "rnnfuse/steps")
    n = b.op("Reshape", b.op("Cast", count, to=TensorProto.INT64), b.i64(1))
    zero = b.i64(0)  # (Where and Less, not Max: Max takes integers from opset 12 only)
    return b.op("Add", start, b.op("Where", b.op("Less", n, zero), zero, n))


def _steps_of(g: Graph, x: str, consts: list[str], start: int, stop: int, axis: int, anchor) -> str:
    """``x``'s steps start..stop-1 along ``axis`` (``stop`` TO_THE_END: to its last), declared with ``x``'s
    type (the emitter reads the mask's rank)."""
    out = g.add_node("Slice", [x] + consts, 1, name="rnnfuse/Slice", anchor=anchor)[0]
    t = g.model.known_type(x)
    if t is not None:
        dims = list(t[1]) if t[1] is not None else None
        if dims is not None and axis < len(dims):
            if stop < TO_THE_END:
                dims[axis] = stop - start
            else:  # (from step start on: a known length less start, else unknown)
                dims[axis] = dims[axis] - start if isinstance(dims[axis], int) and dims[axis] >= start else None
        g.model.declare(out, (t[0], dims))
    return out


def time_major_input(b: Builder, rec: Recurrence, x: str, mask: str | None):
    """``(x, mask, mask rank, mask_source, mask_time_axis, direction)``: the (prepared) input and mask
    time-major, read backwards (direction "reverse") when the front end says so or x is a time flip of another
    tensor. ``mask_source`` is what validation overrides: a tensor the original reads too (``rec.mask``, not
    the slice of it the recurrence runs over)."""
    g = b.g
    mask_source, mask_time_axis = rec.mask, 0
    mrank = g.model.rank(mask) if mask else None
    if mask is not None and mrank not in (2, 3):
        raise Decline(f"the mask has rank {mrank}")
    if rec.x_time_axis:  # ([B, T, F] or a Conv1d's [B, F, T]: the native op reads [T, B, F])
        x = b.op("Transpose", x, perm=[1, 0, 2] if rec.x_time_axis == 1 else [2, 0, 1])
    if mask is not None and rec.x_time_axis == 2:
        raise Decline("a mask beside an input whose time axis is its last")
    if mask is not None and (rec.x_time_axis == 1 if rec.mask_batch_first is None else rec.mask_batch_first):
        mask = b.op("Transpose", mask, perm=[1, 0, 2][:mrank])
        mask_time_axis = 1
    reverse = rec.x_reversed  # the front end already knows the processing order is backwards in time
    if not reverse and not rec.x_time_axis:
        src = time_flip_source(g, x, 0)
        msrc = time_flip_source(g, mask, 0) if mask else None
        if src is not None and (mask is None or msrc is not None):
            x, mask, reverse = src, msrc, True
            mask_source = msrc
    return x, mask, mrank, mask_source, mask_time_axis, "reverse" if reverse else "forward"
