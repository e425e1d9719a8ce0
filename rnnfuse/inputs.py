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
    bias = None
    if p is not None and p.op_type == "Add":
        a, c = p.input
        if g.const(a) is not None:
            a, c = c, a
        bias = g.const(c)
        if bias is None or bias.ndim < 1 or (bias.ndim > 1 and bias.size != bias.shape[-1]):
            return None
        bias = bias.reshape(-1)
        p = g.producer.get(a)
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
