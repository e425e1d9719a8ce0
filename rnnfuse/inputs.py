"""Per-step inputs that exporters computed outside the recurrence.

dynamo's ``nn.RNN``, Keras on the torch backend and hand-written code apply the input weight to the whole
sequence at once (``X0 @ K + b``) and feed slices of the result to each step. The step then adds the
recurrent part to a slice of that projection; reading it as ``x0_t @ K + b`` (exact slices of K and b)
lets the native op take ``X0`` with ``W = K^T``.
"""

from __future__ import annotations

from .graph import Graph, attr
from .symbolic import StepInput, ConstRef, Lin, LinAtom, Poly, SymTensor


def input_projection(g: Graph, src: str, axis: int = 0):
    """``src = X0 @ K (+ b)`` with constant K, b (an input projection hoisted out of the loop, as dynamo's
    nn.RNN and Keras' torch backend do): (X0, K, b or None). A time flip of a projection is the projection
    of the flipped input (dynamo's backward nn.RNN direction)."""
    from rnnfuse.dims import time_flip_source

    inner = time_flip_source(g, src, axis)
    if inner is not None:
        proj = input_projection(g, inner, axis)
        if proj is None:
            return None
        x0, K, bias = proj
        flip = g.producer[src]
        if flip.op_type == "ReverseSequence":
            flipped = g.add_node("ReverseSequence", [x0, flip.input[1]], 1, name="rnnfuse/ReverseSequence", anchor=flip,
                                 time_axis=attr(flip, "time_axis", 0), batch_axis=attr(flip, "batch_axis", 1))[0]
        elif flip.op_type == "Gather":  # the indices T-1 .. 0 hold for X0 too (same time length)
            flipped = g.add_node("Gather", [x0, flip.input[1]], 1, name="rnnfuse/Gather", anchor=flip,
                                 axis=attr(flip, "axis", 0))[0]
        else:
            flipped = g.add_node("Slice", [x0] + list(flip.input[1:]), 1, name="rnnfuse/Slice", anchor=flip)[0]
        return flipped, K, bias
    p = g.producer.get(src)
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
    if p is None or p.op_type != "MatMul":
        return None
    K = g.const(p.input[1])
    if K is None or K.ndim != 2 or g.model.rank(p.input[0]) != 3:
        return None
    if bias is not None and bias.shape[0] != K.shape[1]:
        return None
    return p.input[0], K, bias



def projected_leaf(proj) -> tuple[StepInput, SymTensor]:
    """The step-input atom (width of X0) and the symbolic value of one projected step ``x0 @ K + b``."""
    _, K, bias = proj
    x_atom = StepInput("x", int(K.shape[0]))
    lin = Lin.make([(x_atom.key, ConstRef.of(K))], [ConstRef.of(bias)] if bias is not None else [], int(K.shape[1]))
    return x_atom, SymTensor(Poly.atom(LinAtom(lin)))
