"""Per-step outputs masked after the loop: a masked recurrence whose steps output the cell's raw new h
(``outs.append(h_new)`` while ``h = where(m_t, h_new, h)``), the stack of them read only zeroed where the
states' mask is off (``stack(outs) * mask.unsqueeze(-1).float()``, ``stack(outs).masked_fill(~mask.unsqueeze(-1),
0)``, ``where(mask.unsqueeze(-1), stack(outs), 0)`` or ``zeros_like(stack(outs))`` there). That product is the
native op's Y zero-filled at masked steps, for any mask: a front end (an unrolled chain's stack, a Loop's scan
output or list of outputs) offers it as the output (:func:`zeroing_product`), the step analysis reads the raw
output as zero-filled there (:mod:`rnnfuse.step`), and once the recurrence's mask is known
:func:`zeroed_by_mask` declines unless the zeroing is by that very mask tensor, laid out like the stack
(validation feeds that tensor, so it feeds the product's factor too)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from . import op_args
from .dims import filled_extent, restores_extents
from .errors import Decline
from .graph import Graph, attr
from .row_wise import FLOATS

# casts a mask may pass through on its way to the factor or condition: to 0/1 floats or to bool
_MASK_CASTS = frozenset(FLOATS) | {TensorProto.BOOL}
_OTHER_MASK = "a per-step output masked after the loop by another mask than the states'"


def zeroing_product(g: Graph, stacked: str) -> tuple[str, str, bool] | None:
    """``(product, factor, kept_where_false)`` when the stacked outputs are read only through one node that
    zeroes some of them: ``Mul(stacked, factor)``, ``Where(factor, stacked, 0)`` or ``Where(factor, 0, stacked)``
    (kept where the factor is false: ``masked_fill``). None otherwise."""
    uses = g.uses(stacked)
    others = [u for u in uses if u.op_type != "Shape"]  # (a Shape may size the zeros: zeros_like(stacked))
    if len(others) != 1 or g.is_graph_output(stacked):
        return None
    u, shapes = others[0], [s for s in uses if s.op_type == "Shape"]
    if u.op_type == "Mul" and len(u.input) == 2 and len(set(u.input)) == 2 and not shapes:
        return u.output[0], u.input[1] if u.input[0] == stacked else u.input[0], False
    if u.op_type == "Where" and len(u.input) == 3 and u.input[0] != stacked:
        cond, a, b = u.input
        if a == stacked and b != stacked and _zeros(g, b, u, shapes):
            return u.output[0], cond, False
        if b == stacked and a != stacked and _zeros(g, a, u, shapes):
            return u.output[0], cond, True
    return None


def product_of(g: Graph, stacked: str) -> str:
    """The zeroing product the stacked outputs are read as (:func:`zeroing_product`), or ""."""
    found = zeroing_product(g, stacked)
    return found[0] if found is not None else ""


def _adds_unit_axis(g: Graph, reshape) -> bool:
    """Whether ``reshape`` gives its [d0, d1] input the shape [d0, d1, 1]: entries its input's extents (or 0,
    which copies them, or one -1), then 1."""
    src = reshape.input[0]
    if g.model.rank(src) != 2 or g.model.rank(reshape.output[0]) not in (3, None):
        return False
    shape = reshape.input[1]
    if filled_extent(g, shape, 2) != ("const", 1) or filled_extent(g, shape, 3) is not None:
        return False
    return restores_extents(g, shape, src, 2, zero_copies=not attr(reshape, "allowzero", 0))


def _zeros(g: Graph, name: str, where, shapes: list) -> bool:
    """Whether ``name``, read by ``where`` alone, is all zeros: a constant, or (``shapes``: the stack's Shape
    nodes, then the one it is sized by) zeros of the stack's shape, ``ConstantOfShape(Shape(stacked))`` or
    ``Expand(0, Shape(stacked))`` (torch's ``zeros_like``, traced and by dynamo)."""
    if not shapes:
        c = g.const(name)
        return c is not None and c.size > 0 and not np.any(c)
    p = g.producer.get(name)
    whole = len(shapes) == 1 and attr(shapes[0], "start", 0) == 0 and attr(shapes[0], "end", None) is None
    if not whole or p is None or g.uses(name) != [where]:
        return False
    if p.op_type == "ConstantOfShape":
        value = attr(p, "value", None)
        zero = value is None or not np.any(value)
    elif p.op_type == "Expand":
        c = g.const(p.input[0])
        zero = c is not None and c.size == 1 and not np.any(c)
    else:
        return False
    sized_by = p.input[0] if p.op_type == "ConstantOfShape" else p.input[1]
    return zero and sized_by == shapes[0].output[0] and g.uses(sized_by) == [p]


def zeroed_by_mask(g: Graph, seq_outputs: list, zeroed: dict, mask: str | None, mask_axis: int | None,
                   negated: bool) -> None:
    """Declines unless every output read as a zeroing product (``zeroed``: product -> (factor, kept where the
    factor is false, the stack's time axis)) keeps exactly the valid steps of the recurrence's ``mask`` (time
    along ``mask_axis``; ``negated``: true at padded steps): its factor is that [T, B] or [B, T] tensor through
    casts to 0/1 or bool, ``Not``, a transpose of its two axes, and one unit axis added last."""
    for so in seq_outputs:
        if so.tensor not in zeroed:
            continue
        factor, kept_where_false, axis = zeroed[so.tensor]
        if mask is None or mask_axis is None or g.model.rank(mask) != 2:
            raise Decline(_OTHER_MASK)
        name, unsqueezes, flips, nots = factor, [], 0, int(kept_where_false)
        while name != mask and (p := g.producer.get(name)) is not None:
            if p.op_type == "Unsqueeze":
                unsqueezes.append(op_args.axes(p, g.model.opset, op_args.const_reader(g, p)))
            elif p.op_type == "Reshape":  # (jax2onnx's mask[..., None]: a reshape to the mask's extents and 1)
                unsqueezes.append([2] if _adds_unit_axis(g, p) else None)
            elif p.op_type == "Expand":  # (a broadcast along the unit axis, which the product makes anyway; one
                # that adds axes would give the product more than the stack's)
                if g.model.rank(p.output[0]) is None or g.model.rank(p.output[0]) != g.model.rank(p.input[0]):
                    break
            elif p.op_type == "Transpose" and list(attr(p, "perm", []) or []) in ([1, 0], [1, 0, 2]):
                flips += 1  # (a [T, B] mask read as [B, T], before or after its unit axis is added)
            elif p.op_type == "Not":
                nots += 1
            elif p.op_type != "Cast" or attr(p, "to") not in _MASK_CASTS:
                break
            name = p.input[0]
        time_axis = mask_axis if flips % 2 == 0 else 1 - mask_axis
        if name != mask or unsqueezes not in ([[2]], [[-1]]) or time_axis != axis or nots % 2 != int(negated):
            raise Decline(_OTHER_MASK)


def zeroed_products(g: Graph, outs: list) -> dict:
    """:func:`zeroed_by_mask`'s ``zeroed`` for the step outputs ``outs`` (``rnnfuse.step.StepOut``) offered as
    zeroing products: product -> (factor, kept where the factor is false, the stack's time axis)."""
    zeroed = {}
    for o in outs:
        found = zeroing_product(g, o.outer) if o.zeroed else None
        if found is not None:
            zeroed[found[0]] = (found[1], found[2], o.time_axis)
    return zeroed
