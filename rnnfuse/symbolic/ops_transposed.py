"""Step values seen transposed: ``W @ h.T`` instead of ``h @ W.T``.

A cell written for one example (Equinox's ``LSTMCell``/``GRUCell`` compute ``W @ x + U @ h`` on vectors) and
batched with ``jax.vmap`` is exported as ``Transpose(Gemm(W, Transpose(h)))``: the batch axis moves to the back
for the matmul and back again after it. ``Transpose(v)`` of a ``[B, N]`` step value is held as
:class:`~.values.Transposed` (``[N, B]``); a constant matrix times it is the transpose of ``v @ W.T``; a split
along its first axis splits ``v``'s units; elementwise ops act on the values inside; transposing back gives the
step value again. Anything else that touches a transposed value (a matmul that would mix batch rows, a
transpose of another shape) is declined.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper

from ..errors import Decline
from ..graph import attr
from .algebra import LinAtom, Poly
from .values import ConcatRows, Const, SymTensor, Transposed, Value, as_rows, matmul_lin

# ops that act element by element: the same on a transposed value as on the value itself
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Neg", "Identity", "Cast", "Tanh", "Sigmoid", "Relu", "Abs", "Exp",
                "Reciprocal", "Clip", "Max", "Min", "Where", "HardSigmoid", "Softsign", "Softplus", "LeakyRelu", "Elu",
                "Celu"}


def _transpose(ev, node, ins):
    v = ins[0]
    perm = list(attr(node, "perm", []) or [])
    if isinstance(v, (SymTensor, ConcatRows)) and not v.lead and perm in ([], [1, 0]):
        return [Transposed(v)]
    raise Decline("a Transpose of a cell value")


def on_transposed(ev, node: NodeProto, ins: list[Value | None], handlers: dict) -> list[Value]:
    """Evaluate ``node`` when one of its inputs is a :class:`Transposed` value."""
    op = node.op_type
    if op == "Transpose":
        perm = list(attr(node, "perm", []) or [])
        if perm in ([], [1, 0]):
            return [ins[0].inner]
        raise Decline("a Transpose of a transposed cell value to another layout")
    if op in ("MatMul", "Gemm"):
        return [_const_times(node, ins)]
    if op == "Split":
        if attr(node, "axis", 0) not in (0, -2):
            raise Decline("a split of a transposed cell value across the batch")
        flipped = _with_axis(node, 1)
        inner = [ins[0].inner] + list(ins[1:])
        return [Transposed(v) for v in handlers["Split"](ev, flipped, inner)]
    if op in _ELEMENTWISE:
        inner = []
        for v in ins:
            if isinstance(v, Transposed):
                inner.append(v.inner)
            elif v is None or (isinstance(v, Const) and np.size(v.arr) == 1):
                inner.append(v)  # a scalar broadcasts the same way in either layout
            else:
                raise Decline(f"{op} of a transposed cell value and a value laid out the other way")
        return [Transposed(v) for v in handlers[op](ev, node, inner)]
    raise Decline(f"unsupported op {op} on a transposed cell value")


def _const_times(node: NodeProto, ins: list[Value | None]) -> Transposed:
    """``A @ v.T`` (+ a scalar): the transpose of ``v @ A.T``."""
    a, b = ins[0], ins[1]
    if not isinstance(a, Const) or not isinstance(b, Transposed):
        raise Decline(f"{node.op_type} of a transposed cell value that may mix batch rows")
    A = np.asarray(a.arr)
    alpha, beta = 1.0, 1.0
    if node.op_type == "Gemm":
        if attr(node, "transB", 0):
            raise Decline("Gemm of a transposed cell value with transB (it mixes batch rows)")
        if attr(node, "transA", 0):
            A = A.T
        alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    if A.ndim != 2:
        raise Decline(f"a matmul of a transposed cell value by a rank-{A.ndim} constant")
    lin = matmul_lin(as_rows(b.inner), Const(np.ascontiguousarray(A.T)).constref())
    p = Poly.atom(LinAtom(lin if alpha == 1.0 else lin.scaled(alpha)))
    c = ins[2] if node.op_type == "Gemm" and len(ins) > 2 else None
    if c is not None and beta != 0.0:
        if not isinstance(c, Const) or np.size(c.arr) != 1:
            raise Decline("Gemm of a transposed cell value with a bias laid out per row")
        p = p.add(Poly.const(float(np.ravel(c.arr)[0]) * beta))
    return Transposed(SymTensor(p))


def _with_axis(node: NodeProto, axis: int) -> NodeProto:
    out = NodeProto()
    out.CopyFrom(node)
    keep = [a for a in out.attribute if a.name != "axis"]
    del out.attribute[:]
    out.attribute.extend(keep + [helper.make_attribute("axis", axis)])
    return out


HANDLERS = {"Transpose": _transpose}
