"""A step's input map: what the cell reads of the step's slice, computed from that slice row by row.

Models often transform x_t inside the loop before the cell sees it: an input MLP (``relu(x_t W1 + b1)``), a
LayerNorm, a scale, an embedding lookup of the step's token ids, ``cat([x_t, z])`` with a context row z (a
latent, a speaker embedding: one row per batch row, the same at every step). When every node in between acts
row by row (:func:`rnnfuse.row_wise.check_row_wise`), applying the map at every step is applying it once to
the whole sequence, so the native op can read the mapped sequence as its X. Both front ends use this: the
unrolled chain (:mod:`passes.unrolled.whole_inputs`) and Loop bodies (:mod:`passes.loop_inputs`).

:func:`mapped_input` finds the map in one step; :func:`tile_context` repeats a context row for every step's
rows so that :func:`rnnfuse.row_wise.on_every_step` can replay the map on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from onnx import NodeProto, TensorProto

from .graph import Graph
from .row_wise import BOOL_OPS, FLOATS, ROW_RANK, cone, op_makes_bool, walk_rows

# what lies between a cell's input matmul and where its result meets the state (gate slices, a bias, views)
_PLUMBING = {"Split", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten", "Add", "Sub"}
# what only lays a row's values out anew, picks some (a gate's slice of a projected x_t) or casts them: no map
# of x_t on its own (the cell maths reads through them)
_VIEWS = {"Reshape", "Expand", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast", "CastLike", "Slice", "Split"}


@dataclass
class MappedInput:
    """``value = f(xs, context)``: the map's output the cell reads, the nodes computing it from the step's
    reads ``xs`` (evaluation order) and the context rows they read beside them."""

    value: str
    nodes: list[NodeProto]
    context: list[str]


def mapped_input(g: Graph, xs: list[str], const_of: Callable, is_context: Callable[[str], bool],
                 x_rank: int = ROW_RANK) -> MappedInput | None:
    """The row-wise map of the step's reads ``xs`` (x_t ``[B, F]``, or one id a row ``[B]`` for ``x_rank`` 1)
    that the step's cell reads, when it reads one other than x_t itself: the input of the cell's input matmul
    (where its result, through gate slices and a bias, meets the state), or the value the cell reads directly.
    A step mask computed from the same reads (a bool, or a view of one, read outside the map) is no input.
    ``is_context(name)``: whether a value a Concat reads beside the rows is a context row (computed from no
    step's slice); ``const_of(name)``: a constant's value, else None."""
    rows = {x: x_rank for x in xs}
    walked, ids = walk_rows(g, xs, rows, const_of, "a step input", reductions=True, admit=lambda node, others: (
        node.op_type == "Concat" and all(is_context(i) for i in others)))

    def read_outside(v: str) -> bool:
        return any(id(u) not in ids and u.op_type not in ("Shape", "Size") for u in g.uses(v))

    masks = _mask_values(g, walked)
    exits = {v for n in walked for v in n.output if v in rows and v not in masks and read_outside(v)}
    exits |= {x for x in xs if read_outside(x)}
    before = {v: _before_input_matmul(g, v, ids, const_of) for v in exits}
    # an exit that is itself what another exit's matmul multiplies is read as that input (x_t's projection read
    # by the cell's input matmul and by a skip connection, ``h + proj(x_t)``), not as a matmul's result
    multiplied = {b for v, b in before.items() if b != v}
    inputs = {b for v, b in before.items() if v not in multiplied}
    if len(inputs) != 1:
        return None
    value = inputs.pop()
    if value in xs or rows.get(value) != ROW_RANK or g.model.elem_type(value) not in FLOATS:
        return None
    nodes = cone(g, value, ids, walked)
    if all(n.op_type in _VIEWS for n in nodes if n.output[0] in rows):
        return None  # (a view of x_t is x_t to the cell maths: nothing to apply to the whole sequence)
    read = {i for n in nodes for i in n.input}
    made = {o for n in walked for o in n.output}
    return MappedInput(value, nodes, [r for r in rows if r not in xs and r not in made and r in read])


def tile_context(b, row: str, seq: str, time_axis: int) -> str:
    """The context row ``row`` (``[B, C]``) repeated for every step's rows of ``seq`` (``[T, B, ...]`` for
    ``time_axis`` 0, ``[B, T, ...]`` for 1), flattened as :func:`rnnfuse.row_wise.on_every_step` flattens
    ``seq``: ``[T * B, C]`` in ``seq``'s order. ``b`` is an :class:`~rnnfuse.emit.Builder`."""
    lead = b.op("Slice", b.op("Shape", seq), b.i64(0), b.i64(2), b.i64(0))
    width = b.op("Slice", b.op("Shape", row), b.i64(1), b.i64(2), b.i64(0))
    return b.op("Flatten", b.op("Expand", b.unsqueeze(row, [time_axis]), b.op("Concat", lead, width, axis=0)), axis=2)


def _mask_values(g: Graph, walked: list[NodeProto]) -> set[str]:
    """The walked values that are a step mask or computed from one (``m.float()``, ``1 - m``): what a step
    decides from its rows about padding, not the input its cell reads."""
    out: set[str] = set()
    for n in walked:
        read = n.input[1:] if n.op_type == "Where" else n.input  # (a select by a mask is no arithmetic on it)
        if n.op_type in BOOL_OPS or any(i in out for i in read) or (op_makes_bool(n) is None and any(
                g.model.elem_type(o) == TensorProto.BOOL for o in n.output)):
            out.update(o for o in n.output if o)
    return out


def _before_input_matmul(g: Graph, v: str, ids: set[int], const_of: Callable) -> str:
    """What the matmul producing ``v`` (through gate slices, a bias, views) multiplies; ``v`` without one."""
    cur = v
    for _ in range(8):
        p = g.producer.get(cur)
        if p is None or id(p) not in ids:
            return v
        if p.op_type in ("MatMul", "Gemm"):
            return p.input[0]
        if p.op_type not in _PLUMBING:
            return v
        dyn = [i for i in p.input if i and const_of(i) is None]
        if len(dyn) != 1:
            return v
        cur = dyn[0]
    return v
