"""Row-wise functions: nodes of a step that treat every batch row on its own, and running them on every step.

A step of a recurrence computes some values from the step's rows alone (the new h, the input x_t) and
constants: a head on the new h (``fc(h_t)``, :mod:`rnnfuse.step_heads`), a mask computed from the input
(``(x_t != 0).any(-1)``, :mod:`passes.unrolled.derived_masks`, :mod:`passes.loop_reads`). When every node in
between maps ``[rows, ...]`` tensors to ``[rows, ...]`` tensors row by row, applying it at every step is
applying it once to all steps with the time and batch axes flattened into rows: ``f(S[t]) for each t`` =
``f(Flatten(S))`` reshaped back. Row independence is proven per op here (:func:`check_row_wise`), never
assumed; :func:`replay` copies such nodes onto the flattened rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto

from . import op_args
from .errors import Decline
from .graph import Graph, attr

# elementwise ops whose every input is a row tensor or a constant that does not span rows
ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitShift", "Cast", "CastLike",
    "Ceil", "Celu", "Clip", "Cos", "Cosh", "Div", "Elu", "Equal", "Erf", "Exp", "Floor", "Gelu", "Greater",
    "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Less",
    "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu",
    "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign",
    "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where", "Xor",
})
# reductions over a row's features (``any`` / ``all`` are written with ReduceMax / ReduceMin of a cast)
REDUCTIONS = frozenset({
    "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare",
})
ROW_RANK = 2  # a row tensor is [rows, features]; a reduction without keepdims leaves [rows] (rank 1)
UNIT_ROWS = -ROW_RANK  # (row_masks' x_rank) inputs known to be [rows, 1]: a step's slice of a [B, T] tensor


def check_row_wise(g: Graph, n: NodeProto, rows: dict[str, int], const_of, role: str = "a per-step output",
                   reductions: bool = False) -> int:
    """The rank of what ``n`` computes when it maps row tensors to row tensors row by row; else Decline.

    ``rows``: tensor -> its rank as a row tensor (``ROW_RANK``, or 1 for ``[rows]``), 0 for a constant;
    ``const_of(name)``: the value of a constant the node reads; ``role`` names what the node computes in the
    reasons; ``reductions``: whether a reduction over the features (and the Squeeze / Unsqueeze of the unit
    axis it leaves) is allowed (a head's per-step output keeps its features, a mask reduces them)."""
    op = n.op_type
    ins = [i for i in n.input if i]
    row_ins = [i for i in ins if rows.get(i)]
    ranks = {rows[i] for i in row_ins}
    what = f"{op} '{n.name or n.output[0]}'"
    if n.domain not in ("", "ai.onnx"):
        raise Decline(f"{role} is computed by the custom op {n.domain}::{op}")
    if len(ranks) > 1:
        raise Decline(f"{what} of {role} combines rows of different ranks")
    rank = ranks.pop() if ranks else ROW_RANK

    def small(name: str) -> bool:  # a constant that broadcasts along the rows instead of spanning them
        c = const_of(name)
        return c is not None and (np.ndim(c) < rank or (np.ndim(c) == rank and np.shape(c)[0] == 1))

    if op in ELEMENTWISE:
        if all(rows.get(i) or small(i) for i in ins):
            return rank
        raise Decline(f"{what} of {role} combines a row with a constant spanning rows")
    if op == "Gather":
        picked = _gather_rank(n, rank, row_ins, what, role, const_of)
        if picked is not None:
            return picked
    if op in ("Reshape", "Expand") and row_ins == [n.input[0]] and len(ins) == 2:
        found = row_shape(g, n.input[1], rows, const_of)  # [rows, *dims]: the rows stay rows
        if found is not None:
            dims, _ = found
            out = 1 + len(dims) if op == "Reshape" else max(rank, 1 + len(dims))
            if out <= ROW_RANK and (op == "Expand" or all(d > 0 or d == -1 for d in dims)):
                return out
        raise Decline(f"{what} of {role} does not keep the rows as rows")
    if reductions and op in REDUCTIONS | {"Squeeze", "Unsqueeze"} and row_ins == [n.input[0]]:
        out = _unit_axis_rank(g, n, rank, const_of)
        if out is not None:
            return out
    elif rank != ROW_RANK:
        pass  # (the ops below are read on [rows, features] tensors only)
    elif op == "MatMul":
        w = const_of(n.input[1])
        if rows.get(n.input[0]) and not rows.get(n.input[1]) and w is not None and np.ndim(w) == 2:
            return rank
        raise Decline(f"{what} of {role} is not rows times a constant matrix")
    elif op == "Gemm":
        w = const_of(n.input[1])
        if (rows.get(n.input[0]) and not attr(n, "transA", 0) and w is not None and np.ndim(w) == 2
                and (len(n.input) < 3 or not n.input[2] or small(n.input[2]))):
            return rank
        raise Decline(f"{what} of {role} is not rows times a constant matrix")
    elif op in ("Softmax", "LogSoftmax", "Hardmax"):
        if _axis_is_features(n, 1 if g.model.opset < 13 else -1) and row_ins == [n.input[0]]:
            return rank
    elif op == "Concat":
        if _axis_is_features(n, None) and len(row_ins) == len(ins):
            return rank
    elif op == "Split":
        sizes = n.input[1] if len(n.input) > 1 else ""
        if _axis_is_features(n, 0) and len(row_ins) == 1 and (not sizes or const_of(sizes) is not None):
            return rank
    elif op == "Slice":
        if _cuts_only_features(n, g.model.opset, const_of) and row_ins == [n.input[0]]:
            return rank
    elif op == "Flatten":
        if attr(n, "axis", 1) == 1 and row_ins == [n.input[0]]:
            return rank
    elif op == "LayerNormalization":
        if attr(n, "axis", -1) in (1, -1) and row_ins == [n.input[0]] and all(small(i) for i in ins[1:]):
            return rank
    raise Decline(f"{what} of {role} is not a row-wise op (it may mix batch rows or steps)")


def _gather_rank(n: NodeProto, rank: int, row_ins: list[str], what: str, role: str, const_of) -> int | None:
    """The rank of a row-wise Gather's output: an embedding lookup of each row's id, or features picked by
    constant indices (``x[:, t, 0]``: one column a row); None for any other Gather (not row-wise)."""
    if rank == 1 and row_ins == [n.input[1]] and attr(n, "axis", 0) == 0:
        table = const_of(n.input[0])  # an embedding lookup: each row's id picks that row's features
        if table is not None and np.ndim(table) == 2:
            return ROW_RANK
        raise Decline(f"{what} of {role} is not a lookup in a constant table")
    if rank == ROW_RANK and row_ins == [n.input[0]] and _axis_is_features(n, 0):
        cols = const_of(n.input[1])
        if cols is not None and np.ndim(cols) <= 1:
            return 1 if np.ndim(cols) == 0 else ROW_RANK
        raise Decline(f"{what} of {role} picks features by runtime indices")
    return None


def _cuts_only_features(n: NodeProto, opset: int, const_of) -> bool:
    """Whether a Slice of ``[rows, features]`` cuts the features alone: the rows' axis, when named, taken whole
    (TorchScript writes ``x_t[:, 0]`` as ``x_t[0:INT_MAX, :]`` before the column's Gather)."""
    args = op_args.slice_args(n, opset, lambda i: const_of(n.input[i]))
    if None in args:
        return False
    return all(a in (1, -1) or (a == 0 and s == 0 and e >= 2**31 - 1 and step == 1) for s, e, a, step in zip(*args))


def _axis_is_features(node: NodeProto, default) -> bool:
    return attr(node, "axis", default) in (1, -1)


def _unit_axis_rank(g: Graph, n: NodeProto, rank: int, const_of) -> int | None:
    """The rank after a reduction over the features of ``[rows, features]`` (kept as a unit axis or dropped),
    or after a Squeeze / Unsqueeze of that unit axis; None for any other axis (the rows' axis 0 above all)."""
    axes = op_args.axes(n, g.model.opset, lambda i: const_of(n.input[i]) if i < len(n.input) and n.input[i] else None)
    if not axes or len(axes) != 1:
        return None  # (no axes: a reduction over every axis, a Squeeze of every unit axis, B = 1 included)
    op = n.op_type
    if op == "Unsqueeze":
        return ROW_RANK if rank == 1 and axes[0] in (1, -1) else None
    if rank != ROW_RANK or axes[0] not in (1, -1):
        return None
    if op == "Squeeze":
        return 1
    return ROW_RANK if attr(n, "keepdims", 1) else 1


def row_shape(g: Graph, shape: str, rows: dict[str, int], const_of) -> tuple[list[int], list[NodeProto]] | None:
    """``(dims, nodes)`` when the shape tensor ``shape`` is ``[rows, *dims]``: the row count read from a row
    tensor's own shape (``Gather(Shape(r), [0])`` or ``Slice(Shape(r), 0, 1)``), alone or concatenated with
    constant dims (how jax2onnx broadcasts a ``[B]`` value to ``[B, 1]``); ``nodes`` compute it, in evaluation
    order. None for any other shape (a constant one bakes the batch size in)."""
    p = g.producer.get(shape)
    parts = list(p.input) if p is not None and p.op_type == "Concat" and attr(p, "axis", 0) == 0 else [shape]
    nodes = [p] if len(parts) > 1 or parts[0] != shape else []
    first = g.producer.get(parts[0])
    src = g.producer.get(first.input[0]) if first is not None and first.input else None
    if src is None or src.op_type != "Shape" or not rows.get(src.input[0]) or len(src.attribute):
        return None
    if first.op_type == "Gather":
        idx = const_of(first.input[1])
        if idx is None or np.ndim(idx) != 1 or np.size(idx) != 1 or int(np.ravel(idx)[0]) != 0 or attr(first, "axis", 0):
            return None
    elif first.op_type == "Slice":
        bounds = [const_of(i) if i else None for i in list(first.input[1:4]) + [""] * (4 - len(first.input))]
        if any(b is None or np.size(b) != 1 for b in bounds[:2]) or int(np.ravel(bounds[0])[0]) != 0 or int(
                np.ravel(bounds[1])[0]) != 1 or (bounds[2] is not None and int(np.ravel(bounds[2])[0]) != 0):
            return None
    else:
        return None
    dims: list[int] = []
    for part in parts[1:]:
        c = const_of(part)
        if c is None or np.ndim(c) != 1:
            return None
        dims += [int(d) for d in c]
    return dims, [src, first] + nodes


def folded_from_shapes(g: Graph, name: str, limit: int = 32) -> bool:
    """Whether the constant ``name`` is folded from a Shape or Size of some tensor, not from constants alone: a
    step's static shape (``Shape(h_t)[0:1] ++ [K]``), which applied to every step's rows at once is wrong."""
    stack, seen = [name], set()
    while stack and len(seen) < limit:
        p = g.producer.get(stack.pop())
        if p is None or id(p) in seen:
            continue
        if p.op_type in ("Shape", "Size"):
            return True
        seen.add(id(p))
        stack.extend(i for i in p.input if i)
    return bool(stack)  # (a cone too deep to read: taken as one)


def replay(b, nodes: list[NodeProto], env: dict[str, str], hint: str) -> dict[str, str]:
    """Copy ``nodes`` (in evaluation order) beside ``b``'s anchor, each reading ``env[name]`` for every input
    ``env`` names (the flattened rows, the constants re-homed in the graph) and its own input otherwise;
    ``env`` gains each copied output. ``b`` is an :class:`~rnnfuse.emit.Builder`."""
    b.g.add_copies(nodes, env, f"{b.prefix}/{hint}", anchor=b.anchor)
    return env


def unflatten(b, rows: str, like: str) -> str:
    """``rows`` (``[T*B, ...]`` computed on ``Flatten(like, axis=2)``) reshaped to ``like``'s two leading axes."""
    lead = b.op("Slice", b.op("Shape", like), b.i64(0), b.i64(2), b.i64(0))
    rest = b.op("Slice", b.op("Shape", rows), b.i64(1), b.i64(2**62), b.i64(0))
    return b.op("Reshape", rows, b.op("Concat", lead, rest, axis=0))


# ---------------------------------------------------------------------------------- masks from the rows

# nodes walked from a step's input at most (a cell reads x_t through a matmul or two; a mask is a few nodes)
_WALK_LIMIT = 64
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
# what turns one mask into another without reading anything else: the step evaluator reads these on a mask
_MASK_VIEWS = frozenset({"Not", "Identity", "Cast", "Unsqueeze", "Squeeze"})
# the ops that make a bool: a value computed from one is a step mask, or arithmetic on it, not the input
BOOL_OPS = frozenset({"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And", "Or", "Xor", "IsNaN",
                      "IsInf"})
# ops whose outputs the ONNX type constraints make numeric, never bool: their type need not be asked (a cone
# inference each, where the model is too big to infer whole: 1,041 cells side by side read x_t each)
_NEVER_BOOL = frozenset({"MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Tanh", "Sigmoid", "Relu",
                         "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "HardSigmoid", "Exp", "Log", "Sqrt", "Pow",
                         "Erf", "Softmax", "LogSoftmax", "LayerNormalization", "Einsum", "ReduceSum", "ReduceMean",
                         "Max", "Min", "Clip"})


def op_makes_bool(n: NodeProto) -> bool | None:
    """Whether ``n``'s op makes its outputs bool (True), never does (False), or it depends on the types read
    (None): what the ONNX standard ops fix, no type asked."""
    if n.domain not in ("", "ai.onnx"):
        return None
    return True if n.op_type in BOOL_OPS else False if n.op_type in _NEVER_BOOL else None


def row_masks(g: Graph, xs: list[str], const_of, x_rank: int = ROW_RANK) -> list[tuple[str, list[NodeProto], int]]:
    """The bool masks a step computes from its input rows ``xs`` (all x_t: ``[B, F]`` tensors, or one value a
    row, ``[B]`` (``x_rank`` 1) or ``[B, 1]`` (``UNIT_ROWS``: a step's slice of a ``[B, T]`` mask input, say))
    and constants alone, row by row, that something else reads (themselves, or as a float cast or negation):
    each with the nodes computing it from ``xs``, in evaluation order, and its rank: one value per row, ``[B]``
    (1) or ``[B, 1]`` (2). ``const_of(name)``: the value of a constant, else None."""
    rows: dict[str, int] = {x: abs(x_rank) for x in xs}
    walked, ids = walk_rows(g, xs, rows, const_of, "a step mask", reductions=True)
    unit = _unit_rows(g, walked, rows, const_of, set(xs) if x_rank == UNIT_ROWS else set())

    def read_outside(v: str, views: int = 4) -> bool:
        """Whether ``v`` is read outside the walk, itself or through views of it (``m.float().unsqueeze(1)``)."""
        return any(id(u) not in ids or (views and u.op_type in _MASK_VIEWS and read_outside(u.output[0], views - 1))
                   for u in g.uses(v))

    roots: dict[str, None] = {}
    for n in walked:
        m = n.output[0]
        if len(n.output) != 1 or not _is_bool(g, m, ids):
            continue  # (a mask is made a read of the whole mask in its node's place: the node computes it alone)
        if read_outside(m):
            roots[_mask_root(g, m, ids)] = None
    # one value per row: [B] or [B, 1] (a [B, F] comparison of the features is no step mask)
    return [(m, cone(g, m, ids, walked), rows[m]) for m in roots if rows[m] == 1 or unit(m)]


def _other_reads(node: NodeProto, rows: dict[str, int], const_of) -> Iterator[str]:
    """What ``node`` reads beside rows and constants (a Reshape's or Expand's shape is checked apart)."""
    for i in node.input:
        if i and i not in rows and const_of(i) is None and not (node.op_type in ("Reshape", "Expand") and i == node.input[1]):
            yield i


def walk_rows(g: Graph, xs: list[str], rows: dict[str, int], const_of, role: str, reductions: bool = False,
              admit=None) -> tuple[list[NodeProto], set[int]]:
    """The nodes computed from ``xs`` (and constants) that act row by row (:func:`check_row_wise`), in
    evaluation order, with their ids; ``rows`` gains each one's outputs and their row ranks. ``admit(node,
    others)``: whether a node that also reads ``others`` (neither rows nor constants; an iterator) may be walked all
    the same, those then counting as rows (a context row beside x_t); by default it may not."""
    walked: list[NodeProto] = []
    ids: set[int] = set()
    stack = list(xs)
    while stack and len(walked) < _WALK_LIMIT:
        for c in g.uses(stack.pop()):
            if id(c) in ids:
                continue
            # (lazily: a node reading every step's value, a Concat or Sum of T, is met from every step; most
            # visits end at its first other read, so the visits cost O(T), not O(T^2))
            reads_other = _other_reads(c, rows, const_of)
            first = next(reads_other, None)
            others: list[str] = []
            if first is not None:
                if admit is None or not admit(c, itertools.chain((first,), reads_other)):
                    continue  # (a node also reading a value not computed yet is met again from that value)
                others = list(_other_reads(c, rows, const_of))
            try:
                rank = check_row_wise(g, c, {**rows, **dict.fromkeys(others, ROW_RANK)} if others else rows,
                                      const_of, role, reductions=reductions)
            except Decline:
                continue
            rows.update(dict.fromkeys(others, ROW_RANK))
            if c.op_type in ("Reshape", "Expand"):  # (the nodes reading its rows' shape go with it)
                for s in row_shape(g, c.input[1], rows, const_of)[1]:
                    if id(s) not in ids:
                        ids.add(id(s))
                        walked.append(s)
            ids.add(id(c))
            walked.append(c)
            for o in c.output:
                rows[o] = rank
                stack.append(o)
    return walked, ids


def _unit_rows(g: Graph, walked: list[NodeProto], rows: dict[str, int], const_of, unit_xs: set[str]):
    """Whether a walked row tensor is known to be ``[B, 1]``: an input known to be (``unit_xs``), a reduction
    over the features kept as a unit axis, an added unit axis, elementwise ops of those with one-value
    constants, or a declared shape. Asked of the candidate masks only, and of what they are computed from as
    far as the answer needs: a type is asked of no other value (each is an inference in a big graph: a
    1,800-step Keras layer's per-step projections spent the whole model's inference budget, 6,581 queries)."""
    made = {n.output[0]: n for n in walked}
    memo: dict[str, bool] = dict.fromkeys(unit_xs, True)

    def unit(o: str) -> bool:
        got = memo.get(o)
        if got is not None:
            return got
        memo[o] = False  # (until decided)
        n = made.get(o)
        if n is None or rows.get(o) != ROW_RANK:  # (a node reading the rows' shape, walked with its Reshape)
            return False
        op = n.op_type
        memo[o] = (op in REDUCTIONS or op == "Unsqueeze"  # (a row-wise reduction keeping a rank-2 row reduced axis 1)
                   or (op in ELEMENTWISE and all(unit(i) if rows.get(i) else np.size(const_of(i)) == 1
                                                 for i in n.input if i))
                   or (g.model.shape(o) or [None, None])[1:] == [1]
                   # (one value a row given its unit axis, as jax2onnx broadcasts a [B] value)
                   or (op in ("Reshape", "Expand") and (op == "Reshape" or unit(n.input[0]))
                       and (row_shape(g, n.input[1], rows, const_of) or [None])[0] == [1]))
        return memo[o]

    return unit


@dataclass
class BodyMask:
    """The one step mask a Loop or Scan body computes from x_t alone (:func:`body_mask`)."""

    out: str  # the body's mask
    nodes: list  # the body nodes computing it from x_t, in evaluation order
    rank: int  # 2: [B, 1]; 1: [B]
    consts: dict  # the constants they read, by value (the body's own: copied beside the loop)


def body_mask(body: Graph, xs: set[str], const_of, x_rank: int = ROW_RANK) -> BodyMask | None:
    """The one mask a body computes from its x_t reads ``xs`` (:func:`row_masks`, ``x_rank`` as there); None
    when there is none, or several (the step analysis then says what it reads)."""
    found = row_masks(body, sorted(xs), const_of, x_rank)
    if len(found) != 1:
        return None
    out, nodes, rank = found[0]
    made = {o for n in nodes for o in n.output} | set(xs)
    consts = {i: np.asarray(const_of(i)) for n in nodes for i in n.input if i and i not in made}
    return BodyMask(out, nodes, rank, consts)


def _is_bool(g: Graph, v: str, ids: set[int]) -> bool:
    """Whether ``v`` is a bool: declared so, or a reshape or broadcast (walked in ``ids``) of one."""
    for _ in range(6):
        p = g.producer.get(v)
        fixed = op_makes_bool(p) if p is not None else None
        if fixed is not None:  # (no type asked: a 1,800-step Keras layer's walked values spent half the budget)
            return fixed
        et = g.model.elem_type(v)
        if et is not None or p is None or id(p) not in ids or p.op_type not in ("Reshape", "Expand", "Identity"):
            return et == TensorProto.BOOL
        v = p.input[0]
    return False


def _mask_root(g: Graph, m: str, ids: set[int]) -> str:
    """The bool ``m`` is a view of (its negation, a cast back to bool, an added unit axis): the mask itself, so
    that ``m`` and ``Not(m)`` read beside it are one mask, not two."""
    while True:
        p = g.producer.get(m)
        if p is None or id(p) not in ids or p.op_type not in _MASK_VIEWS or g.model.elem_type(p.input[0]) != TensorProto.BOOL:
            return m
        m = p.input[0]


def cone(g: Graph, m: str, ids: set[int], walked: list[NodeProto]) -> list[NodeProto]:
    """The walked nodes ``m`` is computed from, in evaluation order."""
    need: set[int] = set()
    stack = [m]
    while stack:
        p = g.producer.get(stack.pop())
        if p is not None and id(p) in ids and id(p) not in need:
            need.add(id(p))
            stack.extend(i for i in p.input if i)
    return [n for n in walked if id(n) in need]


def mask_on_every_step(b, nodes: list[NodeProto], xs: list[str], seq: str, out: str, rank: int,
                       consts: dict[str, np.ndarray], x_rank: int = ROW_RANK) -> str:
    """The mask ``out`` (of ``rank``, computed from the step input rows ``xs`` by ``nodes``: see
    :func:`row_masks`) for every step of the sequence ``seq`` (``[T, B, F]`` or ``[B, T, F]``; ``[T, B]`` or
    ``[B, T]`` for inputs of one value a row, ``x_rank`` as there) at once, laid out like it: ``[T, B(, 1)]``
    or ``[B, T(, 1)]``. ``consts``: the constants the nodes read that the graph beside ``b`` does not hold (a
    Loop body's own)."""
    g: Graph = b.g
    mask = on_every_step(b, nodes, xs, seq, out, consts, x_rank)
    lead = (g.model.shape(seq) or [None, None])[:2]
    g.model.declare(mask, (TensorProto.BOOL, list(lead) + [1] * (rank - 1)))
    return mask


def on_every_step(b, nodes: list[NodeProto], xs: list[str], seq: str, out: str, consts: dict[str, np.ndarray] | None = None,
                  x_rank: int = ROW_RANK, tiled: dict[str, str] | None = None) -> str:
    """``out``, computed row by row from the step input rows ``xs`` by ``nodes`` (in evaluation order), for
    every step of ``seq`` at once, laid out like it (see :func:`mask_on_every_step`). ``tiled``: other row
    tensors the nodes read, each already repeated for every step's rows (``[T * B, C]``, in ``seq``'s order)."""
    rows = b.op("Flatten", seq, axis=2)  # every (t, b) or (b, t) row ([T * B, 1] for a [T, B] sequence)
    if x_rank == 1:
        rows = b.squeeze(rows, [1])  # the rows as the nodes read them: [T * B]
    env = {x: rows for x in xs}
    env.update(tiled or {})
    env.update({name: b.const(arr, "step") for name, arr in (consts or {}).items()})
    replay(b, nodes, env, "rows")
    return unflatten(b, env[out], seq)
