"""A Loop or Scan body whose cell reads a row-wise map of the step's slice, not the slice itself.

jax's ``lax.scan`` steps, TorchScript loops and Scan bodies transform x_t before the cell: an input MLP, a
LayerNorm, a scale, an embedding lookup of the step's token ids (``E[tokens[t]]``), ``concat([x_t, z])`` with
a context row z the loop carries unchanged or the body captures. Such a map is the same at every step, so the
native op reads it applied to the whole sequence (:mod:`rnnfuse.input_maps`), built beside the loop only when
the rewrite is emitted (:class:`StepInputMap` is the recurrence's ``InputPrep.input_map``): a declined
candidate adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.builder import Builder
from rnnfuse.errors import Decline
from rnnfuse.fold import evaluate
from rnnfuse.graph import Graph, has_subgraph
from rnnfuse.input_maps import mapped_input, tile_context
from rnnfuse.row_wise import on_every_step
from rnnfuse.symbolic import Poly, StepInput, StepInputPart, SymTensor
from .loop_extents import same_extent, same_time_length


@dataclass
class StepInputMap:
    """``value`` (the body tensor the cell reads) = a row-wise map of the step's element of ``source``."""

    source: str  # the outer sequence: x ([T, B, F] or [B, T, F]), or ids one a row ([T, B])
    time_axis: int
    reads: list[str]  # the body tensors holding the step's element of ``source``
    x_rank: int  # ROW_RANK for x_t [B, F]; 1 for one id a row [B]
    value: str
    nodes: list[NodeProto]  # the body nodes computing ``value`` from ``reads``, in evaluation order
    outer: dict[str, str]  # body values the map reads that the loop carries unchanged -> their outer tensor
    consts: dict[str, np.ndarray]  # the body's own constants the map reads, by value
    context: list[str]  # among ``outer``: context rows [B, C], repeated for every step's rows
    width: int | None  # the features of ``value``: the cell's input size

    def build(self, g: Graph, seq: str, anchor: NodeProto) -> str:
        """The map applied to every step of ``seq`` (laid out like it, ``[T, B, F']`` or ``[B, T, F']``)."""
        b = Builder(g, anchor, "rnnfuse/step_input")
        env = dict(self.outer)
        for c in self.context:
            env[c] = tile_context(b, self.outer[c], seq, self.time_axis)
        whole = on_every_step(b, self.nodes, self.reads, seq, self.value, self.consts, self.x_rank, tiled=env)
        lead = (g.model.shape(seq) or [None, None])[:2]
        # (ids map to the table's floats; a float x maps to its own type)
        et = g.model.elem_type(self.value) or (TensorProto.FLOAT if self.x_rank == 1 else g.model.elem_type(seq))
        g.model.declare(whole, (et, list(lead) + [self.width]))
        return whole


def find_input_map(g: Graph, body: Graph, source: str, time_axis: int, reads: list[str], x_rank: int,
                   invariants: dict[str, str]) -> StepInputMap | None:
    """The row-wise map of the step's reads of ``source`` the cell reads instead of them, if there is one.
    ``invariants``: body input -> outer init of the values the loop (or Scan) carries unchanged (closed-over
    weights, context rows)."""

    const_of = _constants(g, body, invariants)

    def is_context(name: str) -> bool:
        """Computed before the loop, so from no step's slice: carried unchanged, or captured from outside."""
        outside = invariants.get(name, None if body.defines(name) else name)
        return outside is not None and g.defines(outside) and g.const(outside) is None and len(
            g.model.shape(outside) or body.local_shape(name) or []) == 2

    found = mapped_input(body, sorted(reads), const_of, is_context, x_rank)
    if found is None:
        return None
    made = {o for n in found.nodes for o in n.output} | set(reads)
    outer: dict[str, str] = {c: invariants.get(c, c) for c in found.context}
    consts: dict[str, np.ndarray] = {}
    for i in (i for n in found.nodes for i in n.input):
        if not i or i in made or i in outer or i in consts:
            continue
        if i in invariants:
            outer[i] = invariants[i]
        elif body.defines(i):  # (a name the body captures from outside is read there as it is)
            value = const_of(i)
            if value is None:
                return None
            consts[i] = np.asarray(value)
    return StepInputMap(source, time_axis, sorted(reads), x_rank, found.value, found.nodes, outer, consts,
                        list(found.context), _width(g, source, set(reads), x_rank, found, outer, const_of))


def _width(g: Graph, source: str, reads: set[str], x_rank: int, found, outer: dict[str, str], const_of) -> int | None:
    """The features of the map's output (what the cell's input matmul reads), from the map run on one row of
    zeros; None when a width it needs is unknown or a node does not fold."""
    shape = g.model.shape(source) or []
    width = shape[-1] if x_rank != 1 and len(shape) == 3 else None
    if x_rank != 1 and not isinstance(width, int):
        return None
    row = np.zeros((1,), np.int64) if x_rank == 1 else np.zeros((1, width), np.float32)
    env: dict[str, np.ndarray] = {}
    for c in found.context:
        cols = (g.model.shape(outer[c]) or [None, None])[-1]
        if not isinstance(cols, int):
            return None
        env[c] = np.zeros((1, cols), np.float32)
    for n in found.nodes:
        ins = [None if not i else row if i in reads else env[i] if i in env else const_of(i) for i in n.input]
        out = evaluate(n, ins, g.model.opset)
        if out is None:
            return None
        env.update(zip(n.output, out))
    value = env.get(found.value)
    return int(value.shape[-1]) if value is not None and value.ndim == 2 else None


def side_by_side(g: Graph, parts: dict[str, list[str]], axis: int, leaves: dict) -> tuple[StepInput, tuple]:
    """Several sequences a step reads side by side (``lax.scan`` over ``(x, x2)``, both feeding the cell): the
    native op reads them concatenated on features, in the order the body first reads them. Each read's leaf is
    its columns of that concatenation, so ``x_t @ W1 + x2_t @ W2`` is one input weight ``[W1; W2]``. Returns
    the step input's atom and the sequences after the first. ``parts``: each sequence -> the body tensors
    holding its step. Each must be float [T, B, F] of a static width and provably the first one's time length
    and batch size (a concatenation of different lengths would fail where a loop ran; a Scan requires one
    length, but validation cannot feed a file that declares two; a batch of 1 broadcasts in the step)."""
    names = list(parts)
    widths = []
    for name in names:
        shape = g.model.shape(name) or []
        width = shape[2] if len(shape) == 3 and isinstance(shape[2], int) else None
        if g.model.elem_type(name) != TensorProto.FLOAT or width is None:
            raise Decline(f"the step reads '{name}' beside another sequence, and it is no float [T, B, F] of a "
                          "static width")
        if not same_time_length(g, name, names[0], axis):
            raise Decline(f"the step reads '{name}' beside '{names[0]}', and their time lengths are not provably one")
        if not same_extent(g, name, names[0], 1 - axis):  # (a batch of 1 broadcast beside x's would run too)
            raise Decline(f"the step reads '{name}' beside '{names[0]}', and their batch sizes are not provably one")
        widths.append(width)
    total, start = sum(widths), 0
    for name, width in zip(names, widths):
        part = SymTensor(Poly.atom(StepInputPart("x", start, start + width, total)))
        for read in parts[name]:
            leaves[read] = part
        start += width
    return StepInput("x", total), tuple(names[1:])


_FOLD_DEPTH = 12  # producers folded back from one value (a bias broadcast to the batch is a few views)


def _constants(g: Graph, body: Graph, invariants: dict[str, str]):
    """``const_of(name)`` for the body: the values of constant pass-through inputs (jax carries its closed-over
    weights through the loop), and what the body computes from them and its own constants alone (a bias
    reshaped and expanded to the batch), folded on demand and remembered."""
    memo: dict[str, np.ndarray | None] = {}

    def const_of(name: str, depth: int = 0):
        if name in memo:
            return memo[name]
        memo[name] = None  # (guards cycles)
        if name in invariants:
            value = g.const(invariants[name])
        else:
            value = body.const(name)
            p = body.producer.get(name)
            if value is None and p is not None and depth < _FOLD_DEPTH and not has_subgraph(p):
                ins = [const_of(i, depth + 1) if i else None for i in p.input]
                if all(v is not None for v, i in zip(ins, p.input) if i):
                    out = evaluate(p, ins, g.model.opset)
                    value = out[list(p.output).index(name)] if out else None
        memo[name] = value
        return value

    return const_of
