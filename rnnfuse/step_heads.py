"""A per-step output computed *from* the cell's new h inside the step: a head applied after the native op.

``for t: h, c = cell(x[t], (h, c)); ys.append(fc(h))`` (TorchScript), ``lax.scan`` whose step returns
``dense(h)`` (jax2onnx), a step output ``h @ V + x_t @ U``: the loop's scan output is not h but a function of
the new h (and of the step input). When that function treats every batch row on its own and reads nothing
that changes from step to step except h_t and x_t, applying it to every step at once is the same maths:
``head(Y[t]) for each t`` = ``head(Y)`` with the time and batch axes flattened into rows. The native op
computes Y, and the head's nodes, copied out of the step, run once on ``Flatten(Y)`` (and ``Flatten(X)``).

Row independence is proven per op, not assumed: every node between h_t / x_t and the output must be a
row-wise op on ``[rows, features]`` tensors (elementwise with constants that do not span rows, a matmul
by a constant matrix, a softmax or a concat / split / slice along the feature axis, ...). A head that
reads the state *before* the update (the previous step's h), the cell state c (no native output holds c per
step), the iteration number, or a runtime tensor of the outer graph is declined with that reason; a head
that feeds back into the state is not a head at all (the state's maths then include it and the cell is not
recognised).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import AttributeProto, NodeProto

from .errors import Decline
from .graph import Graph, attr
from .symbolic import Const, SymTensor

# elementwise ops whose every input is a row tensor or a constant that does not span rows
_ELEMENTWISE = {
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "Cast", "CastLike",
    "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater",
    "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Less",
    "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu",
    "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign",
    "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor",
}
_FEATURE_AXIS_OPS = {"Softmax", "LogSoftmax", "Hardmax", "Concat", "Split", "Flatten", "LayerNormalization"}


@dataclass
class StepHead:
    """Body nodes computing one per-step output from the new h (and x_t), row-wise; see the module doc."""

    nodes: list[NodeProto]  # in evaluation order
    out: str  # the body tensor of the per-step output
    h: set[str] = field(default_factory=set)  # body tensors equal to the new h ([B, H])
    x: set[str] = field(default_factory=set)  # body tensors equal to the step input x_t ([B, F])
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # constants of the step the nodes read
    refs: dict[str, str] = field(default_factory=dict)  # body name -> constant of the outer graph it is
    x_source: str = ""  # the outer tensor x_t is element t of
    x_axis: int = 0  # its time axis (0: [T, B, F]; 1: [B, T, F])
    x_reversed: bool = False  # the step reads x from its last step to its first


def find_head(body: Graph, ev, out: str, h_key, other_keys: dict, x_reads: set[str], x_source: str, x_axis: int,
              x_reversed: bool, invariants: dict[str, str], counters: set[str]) -> StepHead:
    """The head computing the body tensor ``out`` from the new h, or Decline with the reason it is none.

    ``ev``: the step's evaluator (its memo holds the values found so far); ``h_key``: the polynomial key of
    the new h; ``other_keys``: key -> name of the other states' new values (c); ``x_reads``: the body tensors
    that read x_t; ``invariants``: loop-carried values passed through unchanged -> their outer tensor;
    ``counters``: the iteration number and its copies."""
    head = StepHead([], out, x_source=x_source, x_axis=x_axis, x_reversed=x_reversed)

    def const_of(name: str):
        v = ev.memo.get(name)
        return v.arr if isinstance(v, Const) else body.const(invariants.get(name, name))
    order: list[NodeProto] = []
    seen: set[str] = set()
    rows: dict[str, bool] = {}  # tensor -> whether it is a row tensor (False: a constant)
    stack: list[tuple[str, bool]] = [(out, False)]
    while stack:
        name, expanded = stack.pop()
        if expanded:
            n = body.producer[name]
            _check_row_wise(body, n, rows, const_of)
            row_out = any(rows.get(i) for i in n.input if i)  # computed from constants alone: no row axis
            for o in n.output:
                rows[o] = row_out
            order.append(n)
            continue
        if name in seen or not name:
            continue
        seen.add(name)
        role = _leaf(body, ev, name, h_key, other_keys, x_reads, invariants, counters, head)
        if role is not None:
            rows[name] = role
            continue
        n = body.producer[name]
        if n.op_type in ("Loop", "Scan", "If") or any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in n.attribute):
            raise Decline(f"the per-step output '{out}' is computed by a {n.op_type} inside the step")
        stack.append((name, True))
        stack.extend((i, False) for i in n.input if i and i not in seen)
    if not head.h:
        raise Decline(f"the per-step output '{out}' does not read the new hidden state")
    done: set[int] = set()
    for n in order:  # a node reached twice is computed once
        if id(n) not in done:
            done.add(id(n))
            head.nodes.append(n)
    return head


def _leaf(body: Graph, ev, name: str, h_key, other_keys: dict, x_reads: set[str], invariants: dict[str, str],
          counters: set[str], head: StepHead) -> bool | None:
    """True: a row leaf (h_t, x_t); False: a constant; None: computed by a body node to walk into."""
    v = ev.memo.get(name)
    if isinstance(v, SymTensor):
        key = v.poly.key
        if key == h_key:
            if v.lead:
                raise Decline(f"the per-step output reads the new hidden state as a [1, B, H] tensor '{name}'")
            if body.model.rank(name) != 2:  # a batch-1 Squeeze to [H] has h's maths but no row axis
                raise Decline(f"the per-step output reads the new hidden state as a rank-{body.model.rank(name)} "
                              f"tensor '{name}', not [B, H] rows")
            head.h.add(name)
            return True
        if key in other_keys:
            raise Decline(f"a per-step output reads the new {other_keys[key]} at every step (no native output holds it)")
    if name in x_reads:
        head.x.add(name)
        return True
    if name in counters:
        raise Decline("a per-step output reads the iteration number")
    outer = invariants.get(name, name)
    if not body.defines(outer) and body.parent is not None and body.parent.const(outer) is not None:
        head.refs[name] = outer  # a constant of the outer graph (a weight carried through unchanged)
        return False
    c = body.const(name)
    if c is None and isinstance(v, Const):  # computed from constants and pass-through values alone
        c = v.arr
    if c is not None:
        head.consts[name] = np.asarray(c)
        return False
    if name in body.input_names:
        if name in invariants:
            raise Decline(f"a per-step output reads '{invariants[name]}', computed at runtime outside the loop")
        raise Decline(f"a per-step output reads the carried state '{name}' before the step updates it "
                      "(the previous step's value)")
    if name not in body.producer:
        raise Decline(f"a per-step output reads '{name}', computed at runtime outside the loop")
    return None


def _axis_is_features(node: NodeProto, default) -> bool:
    return attr(node, "axis", default) in (1, -1)


def _check_row_wise(body: Graph, n: NodeProto, rows: dict[str, bool], const_of) -> None:
    """Decline unless ``n`` maps [rows, features] tensors to [rows, features] tensors row by row.
    ``const_of(name)``: the value of a constant the node reads (a weight carried through unchanged too)."""
    op = n.op_type
    ins = [i for i in n.input if i]
    row_ins = [i for i in ins if rows.get(i)]
    what = f"{op} '{n.name or n.output[0]}'"

    def small(name: str) -> bool:  # a constant that broadcasts along the rows instead of spanning them
        c = const_of(name)
        return c is not None and (np.ndim(c) <= 1 or (np.ndim(c) == 2 and np.shape(c)[0] == 1))

    if n.domain not in ("", "ai.onnx"):
        raise Decline(f"a per-step output is computed by the custom op {n.domain}::{op}")
    if op in _ELEMENTWISE:
        if all(rows.get(i) or small(i) for i in ins):
            return
        raise Decline(f"{what} of a per-step output combines a row with a constant spanning rows")
    if op == "MatMul":
        w = const_of(n.input[1])
        if rows.get(n.input[0]) and not rows.get(n.input[1]) and w is not None and np.ndim(w) == 2:
            return
        raise Decline(f"{what} of a per-step output is not rows times a constant matrix")
    if op == "Gemm":
        w = const_of(n.input[1])
        if (rows.get(n.input[0]) and not attr(n, "transA", 0) and w is not None and np.ndim(w) == 2
                and (len(n.input) < 3 or not n.input[2] or small(n.input[2]))):
            return
        raise Decline(f"{what} of a per-step output is not rows times a constant matrix")
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        if _axis_is_features(n, 1 if body.model.opset < 13 else -1) and row_ins == [n.input[0]]:
            return
    elif op == "Concat":
        if _axis_is_features(n, None) and len(row_ins) == len(ins):
            return
    elif op == "Split":
        sizes = n.input[1] if len(n.input) > 1 else ""
        if _axis_is_features(n, 0) and len(row_ins) == 1 and (not sizes or const_of(sizes) is not None):
            return
    elif op == "Slice":
        axes = _slice_axes(n, const_of)
        if axes is not None and all(a in (1, -1) for a in axes) and row_ins == [n.input[0]]:
            return
    elif op == "Flatten":
        if attr(n, "axis", 1) == 1 and row_ins == [n.input[0]]:
            return
    elif op == "LayerNormalization":
        if attr(n, "axis", -1) in (1, -1) and row_ins == [n.input[0]] and all(small(i) for i in ins[1:]):
            return
    raise Decline(f"{what} of a per-step output is not a row-wise op (it may mix batch rows or steps)")


def _slice_axes(n: NodeProto, const_of) -> list[int] | None:
    """The axes a Slice cuts, when its starts/ends/axes are constants."""
    if len(n.input) == 1:  # opset < 10: attributes
        axes = attr(n, "axes", None)
        return list(axes) if axes is not None else list(range(len(attr(n, "starts", []))))
    consts = [const_of(i) if i else None for i in n.input[1:4]]
    if consts[0] is None or consts[1] is None:
        return None
    if len(n.input) > 3 and n.input[3]:
        if consts[2] is None:
            return None
        return [int(a) for a in np.asarray(consts[2]).ravel()]
    return list(range(np.asarray(consts[0]).size))


# --------------------------------------------------------------------------- emission


def apply_head(b, head: StepHead, y: str) -> str:
    """``head`` on every step of ``y`` ([T, B, H], time-major, in processing order): [T, B, K].

    ``b`` is the emitter's :class:`~rnnfuse.emit.Builder`: the copied nodes are added beside the native op."""
    g: Graph = b.g
    env: dict[str, str] = {}
    rows = b.op("Flatten", y, axis=2)  # [T*B, H]: every step's rows, step after step
    for name in head.h:
        env[name] = rows
    if head.x:
        x = head.x_source
        if head.x_axis == 1:
            x = b.op("Transpose", x, perm=[1, 0, 2])
        if head.x_reversed:
            x = b.flip0(x)
        xr = b.op("Flatten", x, axis=2)
        for name in head.x:
            env[name] = xr
    for name, arr in head.consts.items():
        env[name] = b.const(arr, "head")
    env.update(head.refs)
    for n in head.nodes:
        outs = g.add_node(n.op_type, [env.get(i, i) if i else "" for i in n.input], len(n.output),
                          name=f"{b.prefix}/head/{n.op_type}", anchor=b.anchor, domain=n.domain)
        g.producer[outs[0]].attribute.extend(n.attribute)
        for o, new in zip(n.output, outs):
            env[o] = new
    # back to [T, B, K]: the steps and batch rows of y
    shape = b.op("Concat", b.op("Slice", b.op("Shape", y), b.i64(0), b.i64(2), b.i64(0)), b.i64(-1), axis=0)
    return b.op("Reshape", env[head.out], shape)
