"""Per-step inputs that exporters computed outside the recurrence.

dynamo's ``nn.RNN``, Keras on the torch backend and hand-written code apply the input weight to the whole
sequence at once (``X0 @ K + b``) and feed slices of the result to each step. The step then adds the
recurrent part to a slice of that projection; reading it as ``x0_t @ K + b`` (exact slices of K and b)
lets the native op take ``X0`` with ``W = K^T``.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import numpy as np

from .dims import extent_key, filled_extent, restores_extents
from .errors import ProjectedAgain
from .graph import Graph, attr
from .op_args import einsum_matmul, einsum_terms
from .symbolic import StepInput, ConstRef, Lin, LinAtom, Poly, SymTensor


@dataclass
class Projection:
    """``x0 @ K (+ bias)``, computed outside the recurrence; the steps read its slices."""

    x0: str  # [T, B, F]
    K: np.ndarray  # [F, N]
    bias: np.ndarray | None  # [N]
    # the steps read the projection time-flipped by these nodes (innermost first): the recurrence reads x0
    # flipped the same way (an InputPrep the emitter builds)
    flips: tuple = ()
    # x0's time axis (0: [T, B, F]; 1: batch-first): the steps read the projection along another axis when
    # it was transposed after the matmul (Keras 3 on the JAX backend projects [B, T, F] and transposes)
    time_axis: int = 0


# set while a front end analyses a step again reading a projection as the op's input as computed
_AS_COMPUTED = contextvars.ContextVar("rnnfuse_projection_as_computed", default=False)


def reading_projections(analyse):
    """``analyse()``, reading an input projection computed before the steps as one (the op reads X0, the
    projection's weights go into its W); when the step multiplies the projected value by weights again (a
    Linear over the sequence, then an LSTMCell: the cell's own input matmul), ``analyse()`` once more with
    the projection read as the op's input, as computed."""
    try:
        return analyse()
    except ProjectedAgain:
        token = _AS_COMPUTED.set(True)
        try:
            return analyse()
        finally:
            _AS_COMPUTED.reset(token)


def input_projection(g: Graph, src: str, axis: int = 0) -> Projection | None:
    """``src = X0 @ K (+ b)`` with constant K, b (an input projection hoisted out of the loop, as dynamo's
    nn.RNN and Keras' torch backend do). A time flip of a projection is the projection of the flipped input
    (dynamo's backward nn.RNN direction): the flip is recorded, not built. None while
    :func:`reading_projections` reads projections as computed."""
    from rnnfuse.time_flips import time_flip_source

    if _AS_COMPUTED.get():
        return None

    inner = time_flip_source(g, src, axis)
    if inner is not None:
        proj = input_projection(g, inner, axis)
        if proj is None:
            return None
        return Projection(proj.x0, proj.K, proj.bias, proj.flips + (g.producer[src],))
    p = g.producer.get(src)
    if p is not None and p.op_type == "Transpose" and attr(p, "perm", None) in ([1, 0, 2], (1, 0, 2)):
        proj = input_projection(g, p.input[0], 1 - axis)  # (time and batch swapped: a projection of X0 all the same)
        return None if proj is None or proj.flips else proj
    if p is not None and p.op_type == "Reshape":
        found = _flattened_projection(g, p)
        return None if found is None else Projection(found[0], found[1], found[2], time_axis=axis)
    under = _under_bias(g, p)
    if under is None:
        return None
    p, bias = under
    if p is not None and p.op_type == "Einsum":
        found = _einsum_projection(g, p)
        if found is None:
            return None
        x0, K = found
    elif p is not None and p.op_type == "MatMul":
        x0, K = p.input[0], g.const(p.input[1])
    else:
        return None
    if K is None or K.ndim != 2 or g.model.rank(x0) != 3:
        return None
    if bias is not None and bias.shape[0] != K.shape[1]:
        return None
    return Projection(x0, K, bias, time_axis=axis)


def _flattened_projection(g: Graph, outer) -> tuple[str, np.ndarray, np.ndarray | None] | None:
    """``(X0, K, b)`` when Reshape ``outer`` restores ``Gemm(Reshape(X0, [-1, F]), K, b)`` (or a MatMul and an
    Add) to X0's leading axes: the projection of a [T, B, F] X0 computed on its rows flattened, as onnx-simplifier
    writes ``X0 @ K + b`` (and TF's tensordot). Its leading extents must be X0's, read from the shape: one a
    number or a computed extent equal to X0's on that axis and the other -1 (a 0, which copies the flattened
    input's dim, is not X0's)."""
    under = _under_bias(g, g.producer.get(outer.input[0]))
    if under is None:
        return None
    q, bias = under
    if q is None or q.op_type not in ("Gemm", "MatMul"):
        return None
    K = g.const(q.input[1])
    if q.op_type == "Gemm":
        if attr(q, "transA", 0) or attr(q, "alpha", 1.0) != 1.0 or (len(q.input) > 2 and q.input[2] and attr(q, "beta", 1.0) != 1.0):
            return None
        if K is not None and attr(q, "transB", 0):
            K = np.ascontiguousarray(K.T)
        if len(q.input) > 2 and q.input[2]:
            if bias is not None:
                return None  # (two biases: their sum would round differently)
            bias = _bias_vector(g.const(q.input[2]))
            if bias is None:
                return None
    inner = g.producer.get(q.input[0])
    if K is None or K.ndim != 2 or inner is None or inner.op_type != "Reshape":
        return None
    x0, flat, F, N = inner.input[0], g.const(inner.input[1]), K.shape[0], K.shape[1]
    if g.model.rank(x0) != 3 or g.model.rank(outer.output[0]) != 3 or flat is None or list(np.ravel(flat)) != [-1, F]:
        return None
    if extent_key(g, x0, 2) != ("const", F):  # (rows of another width would be cut anew by the flattening)
        return None
    # the restored shape's entries (constant, or pieces of a computed shape): X0's leading extents, then N (a 0
    # would copy the flattened rows' count)
    if filled_extent(g, outer.input[1], 2) != ("const", N) or not restores_extents(g, outer.input[1], x0, 2):
        return None
    if bias is not None and bias.shape[0] != N:
        return None
    return x0, K, bias


def _under_bias(g: Graph, p):
    """``(the producer of v, b)`` when node ``p`` is ``Add(v, b)`` (either operand order) with b a constant
    vector ([N], or [1, .., N]); ``(p, None)`` when it is no Add; None for an Add of anything else."""
    if p is None or p.op_type != "Add":
        return p, None
    a, c = p.input
    if g.const(a) is not None:
        a, c = c, a
    bias = _bias_vector(g.const(c))
    return None if bias is None else (g.producer.get(a), bias)


def _bias_vector(c: np.ndarray | None) -> np.ndarray | None:
    """A constant of one row ([N], [1, N], ...) as a vector; None for any other."""
    return c.reshape(-1) if c is not None and c.ndim >= 1 and c.size == c.shape[-1] else None


def _einsum_projection(g: Graph, p) -> tuple[str, np.ndarray] | None:
    """``(X0, K)`` when Einsum ``p`` is ``X0 @ K`` for a [.., .., F] X0 and a constant matrix (jnp's
    ``x @ W`` of a 3-D x: ``abc,cd->abd``; ``abc,dc->abd`` reads the weight transposed; either operand first)."""
    terms = einsum_terms(p)
    if len(p.input) != 2 or terms is None or len(terms[0]) != 2:
        return None
    k = 1 if len(terms[0][0]) == 2 else 0  # (the 3-D operand)
    W = g.const(p.input[1 - k])
    transposed = einsum_matmul(p, k) if len(terms[0][k]) == 3 else None
    if W is None or W.ndim != 2 or transposed is None:
        return None
    return p.input[k], (np.ascontiguousarray(W.T) if transposed else W)


def projected_leaf(proj: Projection) -> tuple[StepInput, SymTensor]:
    """The step-input atom (width of X0) and the symbolic value of one projected step ``x0 @ K + b``."""
    K, bias = proj.K, proj.bias
    x_atom = StepInput("x", int(K.shape[0]))
    lin = Lin.make([(x_atom.key, ConstRef.of(K))], [ConstRef.of(bias)] if bias is not None else [], int(K.shape[1]))
    return x_atom, SymTensor(Poly.atom(LinAtom(lin)))
