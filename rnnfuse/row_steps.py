"""A per-step state read at one step per batch row: the native op's final state with ``sequence_lens``.

flax's ``nn.RNN(..., seq_lengths=L)`` runs every step unmasked, stacks the carry of every step, and returns
the carry at step ``L[b] - 1`` of each row b: ``GatherND(cs, [[k_b, b] for b])``. For h that is a read of Y;
for an LSTM's c no native output holds c per step. But the state after step k_b of an unmasked run is what a
native op run with ``sequence_lens[b] = k_b + 1`` holds in ``Y_c`` (onnxruntime's ``Y_c`` is the state at
each row's last valid step, and the steps before it are computed exactly as without lengths). So such a
read is a second native op over the same input and weights, with those lengths, and its ``Y_c``.

The read must provably take one step per row: ``GatherND(cs [T, B, H], idx [B, 2], batch_dims=0)`` whose
second column is the constant ``0 .. B-1`` and whose first column does not depend on the loop. Steps are
normalised as GatherND does (a negative k counts from the end); an index outside ``[-T, T)`` makes the
original fail, so it needs no answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto

from .graph import Graph, attr


@dataclass
class RowStep:
    """The state ``which`` ("h" | "c") after step ``step[b]`` of each row b: a [B, H] tensor of the graph."""

    tensor: str
    which: str
    step: str  # [B, 1] (or [B]) int tensor of the graph: the step index per row


def row_step_reads(g: Graph, outer: str, loop: NodeProto) -> list[tuple[str, str]]:
    """``[(tensor, step)]`` when every reader of the stacked per-step output ``outer`` ([T, B, H]) takes one
    step per batch row (see the module doc), else []."""
    uses = g.uses(outer)
    if g.is_graph_output(outer) or any(u.op_type != "GatherND" or u.input[0] != outer or attr(u, "batch_dims", 0) != 0
                                       for u in uses):
        return []  # (asked before the shape: the first shape asked of a model with 1,600 Loops inferred it whole)
    shape = g.model.shape(outer)
    if not shape or len(shape) != 3 or not isinstance(shape[1], int):
        return []
    batch = shape[1]
    out = []
    for u in uses:
        step = _step_column(g, u.input[1], batch)
        if step is None or _reads_node(g, step, loop):
            return []
        out.append((u.output[0], step))
    return out


def _step_column(g: Graph, idx: str, batch: int) -> str | None:
    """The first column of ``idx`` = Concat([k, arange(B)], axis 1) (through Casts to int64): k, or None."""
    n = g.producer.get(idx)
    while n is not None and n.op_type in ("Cast", "Identity"):
        if n.op_type == "Cast" and attr(n, "to") not in (TensorProto.INT64, TensorProto.INT32):
            return None
        n = g.producer.get(n.input[0])
    if n is None or n.op_type != "Concat" or attr(n, "axis", None) not in (1, -1) or len(n.input) != 2:
        return None
    rows = g.const(n.input[1])
    if rows is None or np.shape(rows) != (batch, 1) or [int(v) for v in np.ravel(rows)] != list(range(batch)):
        return None
    k_shape = g.model.shape(n.input[0])
    if k_shape is None or len(k_shape) != 2 or k_shape[1] != 1:  # one step per row, known to be
        return None
    return n.input[0]


def _reads_node(g: Graph, name: str, node: NodeProto, limit: int = 256) -> bool:
    """Whether ``name`` is computed from an output of ``node`` (or the walk is too long to say)."""
    outs = set(node.output)
    stack, seen = [name], set()
    while stack:
        cur = stack.pop()
        if cur in outs:
            return True
        if cur in seen or not cur:
            continue
        seen.add(cur)
        if len(seen) > limit:
            return True
        p = g.producer.get(cur)
        if p is not None:
            stack.extend(p.input)
    return False


def emit_row_step(b, rs: RowStep, op_type: str, ins: list[str], n_outputs: int, output_of: int, attrs: dict) -> str:
    """[B, H]: the state after step ``rs.step`` of each row, from a native op like the main one (inputs
    ``ins``, unmasked, time-major) run with ``sequence_lens = step + 1``."""
    x = ins[0]
    T = b.dim(x, 0)
    k = b.op("Cast", b.op("Flatten", rs.step, axis=1), to=TensorProto.INT64)  # [B, 1]
    k = b.op("Reshape", k, b.i64(-1))
    zero = b.const(np.array(0, np.int64), "zero")
    k = b.op("Where", b.op("Less", k, zero), b.op("Add", k, T), k)  # GatherND's negative steps count from the end
    lens = b.op("Cast", b.op("Add", k, b.const(np.array(1, np.int64), "one")), to=TensorProto.INT32)
    row_ins = list(ins) + [""] * (5 - len(ins))
    row_ins[4] = lens
    while row_ins and row_ins[-1] == "":
        row_ins.pop()
    outs = b.g.add_node(op_type, row_ins, n_outputs, name=f"{b.prefix}/{op_type}_at_row_steps", anchor=b.anchor, **attrs)
    return b.squeeze(outs[output_of], [0])
