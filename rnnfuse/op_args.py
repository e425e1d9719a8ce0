"""How an ONNX op's arguments are read at the model's opset, in one place.

Several arguments moved from attributes to inputs over the opsets: the axes of Squeeze, Unsqueeze and
ReduceSum (opset 13) and of the other reductions (18), Split's sizes (13), Slice's starts, ends, axes and
steps (10), Clip's bounds (11). Every reader here takes the node, the opset and ``value(i)``: the constant
value of input ``i`` (called only for an input the node gives), or None when it is not known. What a missing
constant means is the caller's decision (the folder gives up, the step evaluator declines with a reason), so
``value`` may also raise.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from onnx import NodeProto

from .protos import attr

# tf2onnx writes "to the end of the axis" as 1e9 in strided slices (and 1e9 as the step of a shrunk axis): an
# axis that long would hold 4 GB for every element of the other axes, so 1e9 or more reaches any real axis end
TO_THE_END = 10**9

Value = Callable[[int], "np.ndarray | None"]

# the opset from which an op reads its axes from input 1 instead of an attribute
_AXES_INPUT_SINCE = {"Squeeze": 13, "Unsqueeze": 13, "ReduceSum": 13}
_REDUCE_AXES_INPUT_SINCE = 18  # every other Reduce*


def given(node: NodeProto, i: int) -> bool:
    """Whether the node gives input ``i`` (optional inputs are left out or named "")."""
    return given_in(node.input, i)


def given_in(ins, i: int) -> bool:
    """:func:`given` over a node's inputs already read."""
    return len(ins) > i and bool(ins[i])


def ints(v) -> list[int] | None:
    return None if v is None else [int(x) for x in np.asarray(v).ravel().tolist()]


def _input_ints(node: NodeProto, i: int, value: Value) -> list[int] | None:
    return ints(value(i)) if given(node, i) else None


def axes(node: NodeProto, opset: int, value: Value) -> list[int] | None:
    """The axes a Squeeze, Unsqueeze or reduction names; None if it names none (the op's default) or they are
    not known."""
    since = _AXES_INPUT_SINCE.get(node.op_type, _REDUCE_AXES_INPUT_SINCE if node.op_type.startswith("Reduce") else 13)
    if opset < since:
        return attr(node, "axes")
    return _input_ints(node, 1, value)


def squeezed(dims: list, axes: list[int]) -> list | None:
    """``dims`` (one entry an axis of a tensor: its extent, its role, its number) without the ``axes`` a
    Squeeze names (negative ones count from the end); None when one is out of range or named twice."""
    rank = len(dims)
    gone = {a % rank for a in axes if -rank <= a < rank}
    if len(gone) != len(axes):
        return None
    return [d for k, d in enumerate(dims) if k not in gone]


def unsqueezed(dims: list, axes: list[int], fill=1) -> list | None:
    """``dims`` with ``fill`` at the ``axes`` an Unsqueeze adds (the output's: negative ones count from its
    end), the input's entries filling the other places in order; None when one is out of range or named
    twice."""
    rank = len(dims) + len(axes)
    added = {a % rank for a in axes if -rank <= a < rank}
    if len(added) != len(axes):
        return None
    rest = iter(dims)
    return [fill if k in added else next(rest) for k in range(rank)]


def split_sizes(node: NodeProto, opset: int, value: Value) -> list[int] | None:
    """A Split's part sizes; None for equal parts (none given) or sizes that are not known."""
    if opset < 13:
        return attr(node, "split")
    return _input_ints(node, 1, value)


def split_bounds(node: NodeProto, opset: int, value: Value) -> dict[str, tuple[int, int]] | None:
    """Each output of a Split with given sizes: its ``[start, end)`` along the split axis; None when the sizes
    are not given (equal parts) or not known, or one is negative."""
    sizes = split_sizes(node, opset, value)
    if not sizes or min(sizes) < 0:
        return None
    ends = np.cumsum(sizes).tolist()
    return {o: (e - n, e) for o, n, e in zip(node.output, sizes, ends)}


def equal_split(size: int, parts: int) -> list[int]:
    """The sizes of a Split into ``parts`` without sizes: equal, the last one smaller if it must be."""
    step = -(-size // parts)
    return [min(step, size - i * step) for i in range(parts)]


def slice_args(node: NodeProto, opset: int, value: Value, ins: list[str] | None = None):
    """A Slice's ``(starts, ends, axes, steps)`` as lists of ints. Axes the node leaves out are the first
    ``len(starts)`` ones and steps it leaves out are 1; an argument that is not known is None (and so are
    the defaults that depend on it). ``ins``: the node's inputs, when the caller has read them."""
    if opset < 10:
        starts, ends = attr(node, "starts"), attr(node, "ends")
        axes_ = attr(node, "axes", list(range(len(starts))) if starts is not None else None)
        return starts, ends, axes_, [1] * len(starts) if starts is not None else None
    ins = node.input[:] if ins is None else ins

    def read(i: int) -> list[int] | None:
        return ints(value(i)) if given_in(ins, i) else None

    starts, ends = read(1), read(2)
    default_axes = list(range(len(starts))) if starts is not None else None
    axes_ = read(3) if given_in(ins, 3) else default_axes
    steps = read(4) if given_in(ins, 4) else ([1] * len(starts) if starts is not None else None)
    return starts, ends, axes_, steps


def slice_args_of(g, node: NodeProto):
    """:func:`slice_args` of a Slice of scope ``g``, its bounds read as ``g.const`` gives them, the node's
    inputs read once (the front ends ask this of every per-step Slice of a trace, most of them more than once:
    torch's ``nn.LSTM`` called per step, 16,669 Slices asked 49,992 times). Bounds all constant are kept by
    the Slice's inputs in ``g.slice_args_memo`` (a GraphIndex's): a name's constant value never changes in a run."""
    ins = node.input[:]
    const = g.const
    opset = g.model.opset
    memo = getattr(g, "slice_args_memo", None) if opset >= 10 else None  # (before opset 10: attributes)
    if memo is None:
        return slice_args(node, opset, lambda i: const(ins[i]), ins)
    key = tuple(ins)
    got = memo.get(key)
    if got is None:
        got = slice_args(node, opset, lambda i: const(ins[i]), ins)
        if None in got:
            return got  # (a bound not known now: asked again, never kept)
        memo[key] = got
    return tuple(list(a) for a in got)  # (the caller's own lists)


def inferred_slice_ends(g, node: NodeProto, starts: list[int], axes: list[int]) -> list[int] | None:
    """The ends of a Slice whose end bounds are computed (jax2onnx writes ``x[t]``'s batch end as
    ``Shape(h)[0]``, of the state the step before computed), read from the types: an axis the output has as
    long as the source (the same number, or the same dimension name inference carried there from the model's
    inputs; not a made-up ``unk__N``) and started at 0 is taken whole; one the output has one element of,
    started at ``t >= 0``, is ``[t, t + 1)``. None when an axis is neither, or a shape is not known. Types are
    asked where they cost no walk (``settled_type``: jax2onnx declares them): a transformer's many Slices to a
    computed length must not each infer its cone."""
    src, out = (g.model.settled_type(v) for v in node.input[0:1] + node.output[0:1])
    src, out = src and src[1], out and out[1]
    if src is None or out is None or len(src) != len(out) or len(starts) != len(axes):
        return None
    ends = []
    for start, axis in zip(starts, axes):
        if not -len(src) <= axis < len(src):
            return None
        whole, got = src[axis], out[axis]
        if start == 0 and whole == got and (isinstance(whole, int) or _named(whole)):
            ends.append(2**63 - 1)
        elif got == 1 and start >= 0:
            ends.append(start + 1)
        else:
            return None
    return ends


def _named(d) -> bool:
    return isinstance(d, str) and bool(d) and not d.startswith("unk__")


def clip_bounds(node: NodeProto, opset: int, value: Value) -> tuple:
    """A Clip's ``(min, max)``: attributes before opset 11, then inputs 1 and 2 as ``value`` gives them (None
    for a bound given but not known); -inf / inf where the node gives none."""
    if opset < 11:
        return attr(node, "min", float("-inf")), attr(node, "max", float("inf"))
    lo = value(1) if given(node, 1) else float("-inf")
    hi = value(2) if given(node, 2) else float("inf")
    return lo, hi


def const_reader(g, node: NodeProto) -> Value:
    """``value`` for a node of graph ``g``: its inputs' constant values (``Graph.const``)."""
    return lambda i: g.const(node.input[i])


def einsum_equation(node: NodeProto) -> str:
    """An Einsum's equation, spaces dropped."""
    eq = attr(node, "equation", b"")
    return (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")


def einsum_terms(node: NodeProto) -> tuple[list[str], str] | None:
    """An Einsum's operand terms and output term, or None for an equation with an ellipsis or no explicit
    output."""
    eq = einsum_equation(node)
    lhs, arrow, out = eq.partition("->")
    if not arrow or "." in eq:
        return None
    return lhs.split(","), out


def einsum_matmul(node: NodeProto, data: int) -> bool | None:
    """Whether the Einsum ``node`` is ``operand[data] @ W`` for a matrix W, reading W transposed: True for
    ``...k,nk->...n``, False for ``...k,kn->...n`` (the data term's leading letters kept in order, its last one
    contracted, either operand first); None for any other equation."""
    parsed = einsum_terms(node)
    if parsed is None or len(parsed[0]) != 2:
        return None
    terms, out = parsed
    step, weight = terms[data], terms[1 - data]
    if len(weight) != 2 or not step or len(set(step)) != len(step) or len(out) != len(step):
        return None
    f, d = step[-1], out[-1]
    if out[:-1] != step[:-1] or d in step or set(weight) != {f, d}:
        return None
    return weight.index(f) == 1
