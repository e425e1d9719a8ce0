"""The types ONNX shape inference gives plain float ops (elementwise ones, matrix products), worked out
without running it.

A cone type query (:mod:`rnnfuse.cone_types`) infers the nodes a tensor is computed from. Behind a
recurrence there may be 100,000 of them that only scale, shift and squash its input (``x * s + b``, an
activation): ONNX inference of such a cone cost 0.8 s, though each node's output type is its input's. And
a cell's first step (``tanh(x_0 @ W + h0 @ R + b)``) is typed per cell: 1,041 cells side by side, one
0.2 ms inference each. Here those nodes are typed the way inference types them, in one pass; inference runs
on the rest.

Exact where it answers, and it answers only where the rule is plainly ONNX's:

* ops in ONNX's domain since opset 7 or before whose output type is their inputs' elementwise type and
  broadcast shape; MatMul of two operands of rank 2 or more (``[..., M, K] @ [..., K, N]``, the leading
  dims broadcast) and Gemm (``[M, N]``, C not read: inference reads none of it), K the same dim on both
  sides (inference rejects two different numbers, and names nothing for a number against a symbol);
* float, double or float16 tensors (the integer tensors a shape is computed with carry values that
  inference propagates, and that a type alone does not);
* every input's dims known (an unknown dim is one inference would name anew), broadcasting only where it
  is unambiguous (equal dims, or a 1 against anything).

Anything else, or a node reading a value not typed yet, is left to inference.
"""

from __future__ import annotations

from typing import Callable

from onnx import NodeProto, TensorProto

from .protos import ONNX_DOMAINS, attr

Type = tuple[int, "list | None"]

# one input, the output its type (in ONNX's domain since opset 7 or before; attributes that shape nothing)
UNARY = frozenset(("Relu", "Tanh", "Sigmoid", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil",
                   "Identity", "Softplus", "Softsign", "Elu", "Selu", "LeakyRelu", "HardSigmoid"))
# two inputs of one element type, the output their broadcast shape
BINARY = frozenset(("Add", "Sub", "Mul", "Div", "Pow"))
# matrix products (MatMul since opset 1, Gemm's inference the same since opset 7)
PRODUCTS = frozenset(("MatMul", "Gemm"))
FLOATS = frozenset((TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16))


def typed_by_rule(nodes: list[NodeProto], known: Callable[[str], "Type | None"], edited: "set[str] | frozenset" = frozenset(),
                  from_edits: set[str] | None = None) -> tuple[dict[str, Type], list[NodeProto]]:
    """The output types of the ``nodes`` (in topological order) this module's rule gives, reading the types
    of what they read from ``known`` (or from what an earlier node of the list was given here); and the
    nodes it gives none, in their order (for inference). ``from_edits``: names whose types rest on one an
    edit declared (those of ``edited``, or of ``from_edits`` itself): the outputs of a node typed here that
    reads one join it.

    One short step a node: the types are held as tuples while the pass runs, so a chain's nodes share one
    and each distinct broadcast is worked out once (a 100,000-node prologue: ~0.1 s)."""
    read_types: dict[str, tuple | None] = {}  # what ``known`` gave, as (elem_type, dims tuple) or None (not plain)
    typed: dict[str, tuple] = {}  # given here
    broadcasts: dict[tuple, tuple | None] = {}
    rest: list[NodeProto] = []
    tracked = from_edits is not None and bool(edited or from_edits)  # (none yet: none can join)

    def read(name: str) -> tuple | None:
        t = typed.get(name)
        if t is None:
            if name not in read_types:
                k = known(name) if name else None
                read_types[name] = (k[0], tuple(k[1])) if _plain(k) else None
            t = read_types[name]
        return t

    for n in nodes:
        op = n.op_type
        unary = op in UNARY
        if not (unary or op in BINARY or op in PRODUCTS or op == "Constant") or n.domain not in ONNX_DOMAINS:
            rest.append(n)
            continue
        outs = n.output[:]
        ins = n.input[:]
        t = None
        if len(outs) != 1 or not outs[0]:
            pass
        elif op == "Constant":
            t = read(outs[0])  # (a Constant's type is the one its tensor declares)
        elif unary:
            t = read(ins[0]) if len(ins) == 1 else None
        elif op in PRODUCTS:
            if len(ins) == 2 or (op == "Gemm" and len(ins) == 3):
                a, b = read(ins[0]), read(ins[1])
                if a is not None and b is not None:
                    t = _product(n, a, b)
        elif len(ins) == 2:
            a, b = read(ins[0]), read(ins[1])
            if a is not None and b is not None:
                if a == b:
                    t = a
                else:
                    key = (a, b)
                    if key not in broadcasts:
                        broadcasts[key] = _binary(a, b)
                    t = broadcasts[key]
        if t is None:
            rest.append(n)
            continue
        typed[outs[0]] = t
        if tracked and any(i in edited or i in from_edits for i in ins):
            from_edits.add(outs[0])
    return {name: (t[0], list(t[1])) for name, t in typed.items()}, rest


def _plain(t: "Type | None") -> bool:
    """A float type whose every dim is known (a number or a symbol)."""
    return t is not None and t[0] in FLOATS and t[1] is not None and all(d is not None for d in t[1])


def _product(n: NodeProto, a: tuple, b: tuple) -> tuple | None:
    """The type of MatMul or Gemm ``n`` on types ``a`` and ``b``; None where the rule does not answer (see the
    module's docstring)."""
    da, db = a[1], b[1]
    if a[0] != b[0] or len(da) < 2 or len(db) < 2:
        return None
    if n.op_type == "Gemm":
        if len(da) != 2 or len(db) != 2:
            return None
        trans_a, trans_b = _int_attr(n, "transA"), _int_attr(n, "transB")
        if trans_a is None or trans_b is None:
            return None
        m, k = (da[1], da[0]) if trans_a else da
        k2, cols = (db[1], db[0]) if trans_b else db
        return (a[0], (m, cols)) if k == k2 else None
    if da[-1] != db[-2]:
        return None
    lead = _binary((a[0], da[:-2]), (b[0], db[:-2]))
    return None if lead is None else (a[0], lead[1] + (da[-2], db[-1]))


def _int_attr(n: NodeProto, name: str) -> int | None:
    """An int attribute's value, 0 when the node leaves it out; None when it is given as anything else."""
    v = attr(n, name, 0)
    return v if isinstance(v, int) else None


def _binary(a: tuple, b: tuple) -> tuple | None:
    """The type of a binary op on types ``a`` and ``b``: one element type, the shapes broadcast where that is
    unambiguous (per axis, aligned from the last: equal dims, or a 1 against anything); None otherwise (two
    element types, two different symbols, a number against a symbol)."""
    if a[0] != b[0]:
        return None
    da, db = a[1], b[1]
    out = []
    for k in range(1, max(len(da), len(db)) + 1):
        x = da[-k] if k <= len(da) else 1
        y = db[-k] if k <= len(db) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    out.reverse()
    return (a[0], tuple(out))
