"""Element types the ops fix: a tensor's element type read from how it is made, with no shape inference.

In a model too big to infer whole, an element type asked of a tensor the file does not type was a cone
inference each (:meth:`rnnfuse.model.Model.elem_type`): the chain search asks it of every tensor sliced into
steps, only to filter, and a model of 3,000 unbind / stack blocks inferred block after block (2 s of a 4.5 s
pass that found nothing). Most ops say their output's element type outright: it is their data input's
(arithmetic, movement, activations, reductions, the native recurrent ops), bool (comparisons, logic), int64
(Shape, Size, ArgMax ...), or an attribute's (Cast, Constant, ConstantOfShape). One bottom-up walk over what
the tensor is computed from, from the types known without a new inference (what the file or an edit
declares, what an inference already run established), memoised for the run like :mod:`rnnfuse.op_shapes`
(names are never reused, and a rewrite replaces a tensor by one of the same values). Exact where it answers:
None for an op it has no rule for, or an input it cannot type.
"""

from __future__ import annotations

from onnx import AttributeProto, NodeProto, TensorProto

from .dataflow import post_order
from .graph import Graph
from .op_shapes import loop_output_type
from .protos import attr

# ops whose output has the element type of their first input
_AS_FIRST = frozenset((
    "Identity", "Neg", "Abs", "Relu", "LeakyRelu", "Elu", "Selu", "Tanh", "Sigmoid", "HardSigmoid", "Softplus",
    "Softsign", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Gelu",
    "Softmax", "LogSoftmax", "Clip", "Not", "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean",
    "MatMul", "Gemm", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Split", "Concat",
    "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "ReverseSequence", "CumSum",
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "LSTM", "GRU", "RNN",
))
_BOOL_OUT = frozenset(("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "IsNaN", "IsInf"))
_INT64_OUT = frozenset(("Shape", "Size", "ArgMax", "ArgMin", "NonZero"))


def op_elem_type(g: Graph, name: str) -> int | None:
    """The element type of main-graph tensor ``name`` as its ops fix it (see the module's docstring), or None."""
    if not name or g.parent is not None:
        return None
    memo = g.model.facts.elem_types
    return post_order(name, memo, lambda cur: _open(g, cur, memo), lambda cur: _close(g, cur, memo))


def _open(g: Graph, cur: str, memo: dict):
    t = g.model.settled_type(cur)
    if t is not None and t[0]:
        memo[cur] = t[0]
        return None
    w = g.initializers.get(cur)
    if w is not None:
        memo[cur] = w.data_type or None
        return None
    p = g.producer.get(cur)
    if p is None or p.domain not in ("", "ai.onnx"):
        memo[cur] = None
        return None
    src = typed_like(p)
    if src:
        return [src]
    if p.op_type in ("Loop", "Scan"):  # (as its body declares the value)
        declared = loop_output_type(g, p, cur)
        memo[cur] = declared[0] if declared is not None else None
        return None
    memo[cur] = fixed_by_op(p)
    return None


def _close(g: Graph, cur: str, memo: dict):
    return memo.get(typed_like(g.producer[cur]))


def typed_like(p: NodeProto) -> str | None:
    """The input whose element type the op's outputs have (None: the op fixes it, or no rule)."""
    op, ins = p.op_type, p.input
    if op in _AS_FIRST and ins:
        return ins[0]
    if (op == "Where" and len(ins) == 3) or (op == "CastLike" and len(ins) == 2):
        return ins[1]
    return None


def fixed_by_op(p: NodeProto) -> int | None:
    """The element type an op gives whatever its inputs' (None when it does not say)."""
    op = p.op_type
    if op in _BOOL_OUT:
        return TensorProto.BOOL
    if op in _INT64_OUT:
        return TensorProto.INT64
    if op == "Cast":
        return attr(p, "to", None) or None
    if op == "ConstantOfShape":
        v = _tensor_attr(p, "value")
        return (v.data_type or None) if v is not None else TensorProto.FLOAT  # (no value: float zeros)
    if op == "Constant":
        if len(p.attribute) != 1:
            return None
        a = p.attribute[0]
        if a.type == AttributeProto.TENSOR:
            return a.t.data_type or None
        return {"value_float": TensorProto.FLOAT, "value_floats": TensorProto.FLOAT, "value_int": TensorProto.INT64,
                "value_ints": TensorProto.INT64, "value_string": TensorProto.STRING,
                "value_strings": TensorProto.STRING}.get(a.name)
    return None


def _tensor_attr(p: NodeProto, name: str):
    for a in p.attribute:
        if a.name == name and a.type == AttributeProto.TENSOR:
            return a.t
    return None

