"""Walking what a step's combining node reads from an older step back to the state that step carries: through
the recurrent weight matmul (``h @ R``, read by the step it feeds) and through slices that cut units or leading
unit axes (the gates of ``h @ R`` split, a per-layer initial state's slice)."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args
from rnnfuse.dataflow import dynamic_inputs, lead_of, shape_derived
from rnnfuse.dims import takes_whole_axis
from rnnfuse.graph import Graph, attr

# ops a carried state passes through on its way to a combining node (one non-constant input each)
_STATE_SIDE = {"Gemm", "MatMul", "Einsum", "Split", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Add", "Mul", "Sub", "Cast", "Gather"}
_SLICING = frozenset(("Split", "Slice", "Gather"))


def state_root(g: Graph, name: str, iv, pulled: set, stop: dict, limit: int = 12, ops: list | None = None,
               given: set = frozenset()) -> str | None:
    """Walk a combining node's older input back through state-side ops to the carried tensor.

    Arithmetic with constants is walked only on the combining side of a weight matmul (a bias added to
    ``h @ R``): behind the matmul it belongs to the older step's state (``1.7 * tanh(a)``, ``0.5 * a + 0.1``),
    whose result is what the step carries."""
    read_through_weights = False
    read, walked, n_ops = name, [], len(ops) if ops is not None else 0  # (what the combining node reads; the walk)
    for _ in range(limit):
        if name in stop:
            return name
        p = g.producer.get(name)
        if p is None or p.op_type not in _STATE_SIDE:
            if read_through_weights and p is not None and p.op_type == "Concat" and _reads_step_input(g, p, stop):
                # the weights belong to the older step: its cell has no activation (``h = W cat(x, h) + b``, the
                # old char-RNN tutorial's), so the state is the matmul's result that this step reads, and the
                # nodes walked to here are the older step's, none between the state and this step
                pulled.difference_update(walked)
                if ops is not None:
                    del ops[n_ops:]
                return read
            return name
        dyn = dynamic_inputs(g, p) or [i for i in p.input if i in given]
        if not dyn:
            # computed from constants and shapes only: a zero initial state, not a carried value, or a given
            # constant one (a learned h0 broadcast to the batch)
            return name if name in given else None
        if len(dyn) != 1:
            return name
        if p.op_type in ("MatMul", "Gemm") and p.input[0] != dyn[0]:
            return name
        if p.op_type in ("Add", "Sub", "Mul") and any(i and i != dyn[0] and g.const(i) is None for i in p.input):
            return name  # combined with a runtime-shaped fill (0 + m * new at a first step): a state itself
        if p.op_type in ("Add", "Sub", "Mul") and read_through_weights:
            return name
        read_through_weights |= p.op_type in ("MatMul", "Gemm", "Einsum")  # (an Einsum: either operand)
        if not _keeps_rows(g, p):
            return name  # e.g. Slice(h0, layer) of a per-layer initial state: the state starts here
        if p.op_type in _SLICING and iv.get(dyn[0]) is None and _walk_ends_at(g, dyn[0]):
            # units cut from a value no step computes, where the walk would end: the parts of a given initial
            # state (``h0, c0 = tanh(W ctx).chunk(2)``), each a state of its own, not one state the first step
            # splits (the gates cut from ``h0 @ R``, its views or its bias walk on to h0)
            return name
        if id(p) not in pulled:
            pulled.add(id(p))
            walked.append(id(p))
        if ops is not None:
            ops.append(p.op_type)
        name = dyn[0]
    return name


def _walk_ends_at(g: Graph, name: str) -> bool:
    """Whether a walk reaching ``name`` would end there: nothing computes it (an input, a constant) or no
    state-side op does (an activation, a Concat)."""
    p = g.producer.get(name)
    return p is None or p.op_type not in _STATE_SIDE


def _reads_step_input(g: Graph, node: NodeProto, stop: dict) -> bool:
    """Whether ``node`` reads a step's slice, as it is or reshaped (Squeeze, Reshape, ...)."""
    for i in node.input:
        for _ in range(3):
            if i in stop:
                return True
            p = g.producer.get(i)
            if p is None or p.op_type not in ("Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity", "Cast"):
                break
            i = p.input[0]
    return False


def unit_groups(g: Graph, name: str, depth: int = 0) -> bool:
    """Whether ``name`` is a [B, G, W] view of a [B, G*W] value's units (``gates.view(B, 4, H)``) or a slice of
    its groups: axis 1 then cuts units, not rows."""
    p = g.producer.get(name)
    if p is None or depth > 4:
        return False
    if p.op_type == "Reshape":
        shape = g.const(p.input[1])
        if shape is None:  # [B, G, W] with B read from a shape (torch trace's view(B, 4, H))
            cat = g.producer.get(p.input[1])
            return (cat is not None and cat.op_type == "Concat" and len(cat.input) == 3 and shape_derived(g, cat.input[0])
                    and all(g.const(i) is not None and np.asarray(g.const(i)).size == 1 for i in cat.input[1:]))
        return np.asarray(shape).ravel().tolist()[:1] in ([-1], [0]) and np.asarray(shape).size == 3
    return p.op_type in ("Split", "Slice") and unit_groups(g, p.input[0], depth + 1)


def _keeps_rows(g: Graph, p: NodeProto) -> bool:
    """Slicing ops on the way to a state must cut units (the last axis) or drop/add leading unit axes."""
    if p.op_type not in ("Split", "Gather", "Slice"):
        if p.op_type in ("Squeeze", "Unsqueeze"):
            axes = op_args.axes(p, g.model.opset, op_args.const_reader(g, p))
            return axes == [0] or (p.op_type == "Squeeze" and axes == [1] and unit_groups(g, p.input[0]))
        return True  # (no axis to check: the leading axes are not asked for, which would walk back the chain)
    if unit_groups(g, p.input[0]) and (attr(p, "axis", 0) == 1 if p.op_type != "Slice" else True):
        return True  # groups of units (the evaluator checks the slice is along them)
    # (the last axis is asked its number only when it is not -1: a value's lead follows its producers back,
    # as far as a whole chain of masked steps, with a type query at each)
    def units_axis(ax: int) -> bool:
        return ax == -1 or ax == (lead_of(g, p.input[0]) or 0) + 1

    if p.op_type in ("Split", "Gather"):
        return units_axis(attr(p, "axis", 0))
    if p.op_type == "Slice":
        starts, ends, axes, steps = op_args.slice_args_of(g, p)
        if axes is None:
            return False
        if all(units_axis(ax) for ax in axes):
            return True  # units only (bounds may come from shapes, as in torch's chunk)
        if starts is None or ends is None or steps is None:
            return False
        for s0, e0, ax, st in zip(starts, ends, axes, steps):
            full = st == 1 and takes_whole_axis(g, p.input[0], ax, s0, e0)  # (or over its static extent)
            if not full and not units_axis(ax):
                return False
        return True
