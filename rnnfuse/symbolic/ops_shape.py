"""Step semantics of ONNX ops that select, join or reshape a step's [B, N] values (and read their shapes)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import op_args
from ..errors import Decline
from ..graph import attr
from .values import (BoolMask, ConcatRows, Const, Fill, MaskVector, RowConst, ShapeValue, SymTensor, UnitGroups, Value, as_rows,
                     elementwise_poly, lead_axes)


def _shape(ev, node, ins):
    v = ins[0]
    if isinstance(v, (BoolMask, MaskVector)):  # the step mask: [B] (or [B, 1]); jax reshapes it by its own shape
        dims = [None, 1] if isinstance(v, BoolMask) and v.unit else [None]
        dims = dims[attr(node, "start", 0):attr(node, "end", None)]
        return [Const(np.array(dims, dtype=np.int64))] if all(d is not None for d in dims) else [ShapeValue(dims)]
    if isinstance(v, (SymTensor, ConcatRows)):
        n = v.poly.ncols if isinstance(v, SymTensor) else sum(w or 0 for _, w, _ in v.segments) or None
        dims = [1] * v.lead + [None, n]
        start, end = attr(node, "start", 0), attr(node, "end", None)
        dims = dims[start:end]
        return [Const(np.array(dims, dtype=np.int64))] if all(d is not None for d in dims) else [ShapeValue(dims)]
    raise Decline("the shape of an unsupported value")


def _norm_axis(ev, node, v: Value, axis: int) -> int:
    """Map an axis of a [*(1,)*lead, B, N] value to -1 (units), 0 (batch) or -2 (a leading unit axis)."""
    lead = v.lead if isinstance(v, (SymTensor, ConcatRows)) else 0
    rank = lead + 2
    a = axis + rank if axis < 0 else axis
    if a == rank - 1:
        return -1
    if a == rank - 2:
        return 0
    return -2


def _group_axis(v: UnitGroups, axis: int) -> bool:
    """Whether ``axis`` of a [B, groups, width] view is its group axis."""
    return axis in (1, -2)


def _split(ev, node, ins):
    v = ins[0]
    if isinstance(v, UnitGroups):  # gates.view(B, 4, H).unbind(1) (trace): one group per output, kept as [B, 1, H]
        if not _group_axis(v, attr(node, "axis", 0)):
            raise Decline("a split of grouped units along another axis than the groups")
        sizes = op_args.split_sizes(node, ev.opset, lambda i: _const_arg(ins[i], "a split of runtime sizes"))
        sizes = sizes if sizes is not None else op_args.equal_split(v.groups, len(node.output))
        starts = np.cumsum([0] + list(sizes))
        return [UnitGroups(v.take(int(a), int(b)), int(b - a), v.width) for a, b in zip(starts[:-1], starts[1:])]
    axis = _norm_axis(ev, node, v, attr(node, "axis", 0))
    if axis != -1:
        raise Decline("a split that is not along the unit axis")
    p = elementwise_poly(v)
    n = p.ncols
    sizes = op_args.split_sizes(node, ev.opset, lambda i: _const_arg(ins[i], "a split of runtime sizes"))
    if sizes is None:
        if n is None:
            raise Decline("a split of unknown width")
        sizes = op_args.equal_split(n, len(node.output))
    outs, s0 = [], 0
    for s in sizes:
        outs.append(SymTensor(p.cols(s0, s0 + s), lead_axes(v)))
        s0 += s
    return outs


def _slice(ev, node, ins):
    v = ins[0]
    starts, ends, axes, steps = op_args.slice_args(node, ev.opset, lambda i: _const_arg(ins[i], "a slice with runtime bounds"))
    if all(s == 0 and e >= op_args.TO_THE_END and st == 1 for s, e, st in zip(starts, ends, steps)):
        return [v]  # every element of every axis it names (tf2onnx's x[:, None] after a kept column): a view of v
    if isinstance(v, UnitGroups):  # view[:, k:k+1] (dynamo's unbind): groups k.., kept as an axis
        if len(axes) != 1 or not _group_axis(v, axes[0]) or steps[0] != 1:
            raise Decline("a slice of grouped units along another axis than the groups")
        a, b, _ = slice(starts[0], ends[0]).indices(v.groups)
        return [UnitGroups(v.take(a, b), b - a, v.width)]
    p = elementwise_poly(v)
    out = p
    for s, e, a, st in zip(starts, ends, axes, steps):
        na = _norm_axis(ev, node, v, a)
        if na == -1:
            n = p.ncols
            if st != 1:
                raise Decline("a strided slice of units")
            if n is None:
                if s < 0 or e < 0:
                    raise Decline("a slice of unknown width")
                n = e
            s0, e0, _ = slice(s, e).indices(n)
            out = out.cols(s0, e0)
        elif not _whole_batch(ev, s, e, st):
            raise Decline("a slice along the batch axis")
    return [SymTensor(out, lead_axes(v))]


def _whole_batch(ev, start: int, end: int, step: int) -> bool:
    """Whether a slice ``start:end:step`` along the batch axis takes every row: to the end, or to a fixed batch
    size or past it."""
    if step != 1:
        return False
    if end >= 2**31 - 1:
        return start == 0 or (ev.batch is not None and start <= -ev.batch)
    return ev.batch is not None and end >= ev.batch and (start == 0 or start <= -ev.batch)


def _gather(ev, node, ins):
    v, idx = ins
    if not isinstance(idx, Const):
        raise Decline("a gather with runtime indices")
    if isinstance(v, UnitGroups):  # view[:, k]: group k as a [B, width] value
        k = int(idx.arr) + (v.groups if int(idx.arr) < 0 else 0) if idx.arr.ndim == 0 else None
        if k is None or not _group_axis(v, attr(node, "axis", 0)) or not 0 <= k < v.groups:
            raise Decline("a gather of grouped units that is not one group")
        return [SymTensor(v.take(k, k + 1))]
    axis = _norm_axis(ev, node, v, attr(node, "axis", 0))
    if axis == -2 and idx.arr.ndim == 0 and int(idx.arr) in (0, -1) and isinstance(v, (SymTensor, ConcatRows)):
        # element 0 of a leading unit axis is the value without it, as a Squeeze (jax's
        # ``lax.dynamic_slice_in_dim(x, t, 1)[0]``: a one-step slice, then its one element)
        return [_without_lead(v, 1)]
    if axis != -1 or idx.arr.ndim != 1:
        raise Decline("a gather that is not a unit selection")
    ind = [int(i) for i in idx.arr]
    if ind != list(range(ind[0], ind[0] + len(ind))):
        raise Decline("a gather of non-contiguous units")
    return [SymTensor(elementwise_poly(v).cols(ind[0], ind[0] + len(ind)), lead_axes(v))]


def _concat(ev, node, ins):
    axis = attr(node, "axis")
    ref = next(v for v in ins if not isinstance(v, Const))
    na = _norm_axis(ev, node, ref, axis)
    if na != -1:
        raise Decline("a concatenation that is not along the unit axis")
    segs = []
    for v in ins:
        segs.extend(as_rows(v).segments)
    return [ConcatRows(tuple(segs), lead_axes(*ins))]


def _const_arg(v, why: str):
    if v is not None and not isinstance(v, Const):
        raise Decline(why)
    return None if v is None else v.arr


def _axes_of(ev, node, ins):
    return op_args.axes(node, ev.opset, lambda i: _const_arg(ins[i], "runtime axes"))


def _unsqueeze(ev, node, ins):
    v = ins[0]
    axes = _axes_of(ev, node, ins)
    if isinstance(v, MaskVector):
        if axes in ([1], [-1]):
            return [SymTensor(v.poly, 0)]
        raise Decline("an unsupported reshape of the mask")
    if isinstance(v, BoolMask):
        if not v.unit and axes in ([1], [-1]):
            return [BoolMask(v.sym, v.neg, True)]
        raise Decline("an unsupported reshape of the mask")
    if isinstance(v, (SymTensor, ConcatRows)) and axes is not None and all(a == 0 for a in axes) and len(axes) == 1:
        return [SymTensor(v.poly, v.lead + 1) if isinstance(v, SymTensor) else ConcatRows(v.segments, v.lead + 1)]
    raise Decline("an unsqueeze that is not a leading axis")


def _without_lead(v, k: int):
    """``v`` (a SymTensor or ConcatRows) without ``k`` of its leading unit axes: the same rows."""
    return SymTensor(v.poly, v.lead - k) if isinstance(v, SymTensor) else ConcatRows(v.segments, v.lead - k)


def _squeeze(ev, node, ins):
    v = ins[0]
    axes = _axes_of(ev, node, ins)
    if isinstance(v, UnitGroups):
        if v.groups != 1 or axes is None or len(axes) != 1 or not _group_axis(v, axes[0]):
            raise Decline("a squeeze of grouped units that is not their one group")
        return [SymTensor(v.poly)]
    if isinstance(v, (SymTensor, ConcatRows)) and v.lead and (axes is None or all(0 <= a < v.lead for a in axes)):
        return [_without_lead(v, v.lead if axes is None else len(set(axes)))]
    if isinstance(v, BoolMask) and v.unit and axes in ([1], [-1]):
        return [BoolMask(v.sym, v.neg, False)]
    shape = ev.graph.model.shape(node.input[0]) if node.input else None
    if isinstance(v, SymTensor) and not v.lead and axes in (None, [0]) and shape and len(shape) == 2 and shape[0] == 1 and shape[1] != 1:
        # a model with its batch fixed to 1: tf2onnx squeezes h @ R ([1, N] -> [N]) to feed it to a Gemm as C;
        # [N] broadcasts back exactly as [1, N] does
        return [SymTensor(v.poly, 0)]
    raise Decline("a squeeze of a [B, N] value")


def _reshape(ev, node, ins):
    v, shp = ins
    if isinstance(v, ShapeValue) and len(v.dims) == 1 and isinstance(shp, Const) and \
            np.asarray(shp.arr).ravel().tolist() in ([-1], [1]):
        return [v]  # one dim as a 1-element vector (dynamo's ``Reshape(size(0), [-1])`` before a Concat)
    if isinstance(v, BoolMask) and isinstance(shp, ShapeValue) and shp.dims == [None, 1]:
        return [BoolMask(v.sym, v.neg, True)]  # the [B] step mask as [B, 1], the batch read from a cell value
    if isinstance(v, MaskVector) and isinstance(shp, ShapeValue) and shp.dims == [None, 1]:
        return [SymTensor(v.poly, 0)]
    if isinstance(v, SymTensor) and not v.lead and isinstance(shp, ShapeValue) and len(shp.dims) == 2 and \
            shp.dims[0] is None and shp.dims[1] is not None and shp.dims[1] == v.poly.ncols:
        return [v]  # [B, N] viewed as [B, N], the batch read from a value (dynamo's ``x[:, t].view(B, -1)``)
    groups = _unit_groups(v, shp.dims) if isinstance(shp, ShapeValue) else None
    if groups is not None:  # (the batch read from a value)
        return [groups]
    if isinstance(v, Fill) and isinstance(shp, ShapeValue):
        return [Fill(v.arr)]  # a constant of runtime shape (a zero state's h @ R) is one value whatever its shape
    if (isinstance(v, RowConst) and isinstance(shp, ShapeValue) and shp.dims[:1] == [None]
            and all(isinstance(d, int) for d in shp.dims[1:]) and int(np.prod(shp.dims[1:])) == v.arr.size):
        return [RowConst(v.arr.reshape([1] + shp.dims[1:]))]  # a bias row broadcast over the batch, viewed
    if not isinstance(shp, Const):
        raise Decline("a reshape to a runtime shape")
    shape = [int(s) for s in shp.arr]
    if isinstance(v, MaskVector) and len(shape) == 2 and shape[1] == 1:
        return [SymTensor(v.poly, 0)]
    if isinstance(v, BoolMask) and len(shape) == 2 and shape[1] == 1:
        return [BoolMask(v.sym, v.neg, True)]
    if isinstance(v, SymTensor) and len(shape) == 2:
        n = v.poly.ncols
        if shape[1] in (n, -1 if n is None else n) and shape[0] in (-1, 0) and v.lead == 0:
            return [v]
        if v.lead == 0 and shape[1] == n:
            return [v]
    if isinstance(v, SymTensor) and len(shape) == 3 and shape[0] == 1 and v.lead == 0:
        return [SymTensor(v.poly, 1)]
    groups = _unit_groups(v, shape)
    if groups is not None:
        return [groups]
    raise Decline("a reshape of a cell value")


def _unit_groups(v: Value, shape: list) -> UnitGroups | None:
    """``v`` ([B, N]) reshaped to [B, G, W] with G * W = N, the batch kept (-1, 0 or read from a shape)."""
    if not isinstance(v, SymTensor) or v.lead or len(shape) != 3 or shape[0] not in (-1, 0, None):
        return None
    g, w, n = shape[1], shape[2], v.poly.ncols
    if not (isinstance(g, int) and isinstance(w, int) and g > 0 and w > 0 and n is not None and g * w == n):
        return None
    return UnitGroups(v.poly, g, w)


def _expand(ev, node, ins):
    """Expand to a constant shape only broadcasts (tf2onnx writes x + zeros as Expand(x, shape))."""
    v, shp = ins
    if isinstance(v, BoolMask) and v.unit and isinstance(shp, (ShapeValue, Const)):
        # the [B, 1] step mask broadcast over the units ([B, N]): the same mask, as Tile does (a static batch
        # is written out, as for a cell value's Expand below)
        dims = shp.dims if isinstance(shp, ShapeValue) else [int(d) for d in np.asarray(shp.arr).ravel()]
        if len(dims) == 2:
            return [v]
    if isinstance(v, SymTensor) and isinstance(shp, ShapeValue) and len(shp.dims) == 2 and shp.dims[0] is None:
        # [B, 1] (jax's step mask as float) broadcast to [B, N], the batch read from a step value's shape
        n = v.poly.ncols
        if v.lead == 0 and shp.dims[1] is not None and n in (None, shp.dims[1]):
            return [v]
    if not isinstance(shp, Const) or not isinstance(v, SymTensor):
        raise Decline("an Expand to a runtime shape")
    shape = [int(d) for d in shp.arr.ravel()]
    n = v.poly.ncols
    if len(shape) < 2 or (n is not None and shape[-1] not in (1, n)) or any(d != 1 for d in shape[:-2]):
        raise Decline("an Expand that changes a cell value's shape")
    return [SymTensor(v.poly, max(v.lead, len(shape) - 2))]


def _tile(ev, node, ins):
    """Tile of the [B, 1] step mask along units (Keras' ``_expand_mask``): the same mask, broadcast."""
    v, reps = ins
    if isinstance(v, BoolMask) and v.unit and isinstance(reps, Const):
        r = [int(d) for d in reps.arr.ravel()]
        if len(r) == 2 and r[0] == 1:
            return [v]
    raise Decline("a Tile of a cell value")


HANDLERS: dict[str, Callable] = {
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Shape": _shape,
    "Expand": _expand,
    "Tile": _tile,
}
