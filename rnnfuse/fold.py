"""Constant folding of single nodes, used to see through exporter plumbing (Split of a bias, Squeeze, Cast...).

The common shape and arithmetic ops are evaluated with numpy, honouring the attribute-vs-input forms of older
opsets; anything else falls back to onnx's reference evaluator on a one-node model of the same opset.
Folding is lazy (only values someone asks for) and refuses very large results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import op_args
from .protos import RANDOM_OPS, attr, node_field

if TYPE_CHECKING:
    from .graph import Graph

MAX_FOLD_ELEMENTS = 1 << 26  # never materialise more than 64M elements while folding


def _np_dtype(onnx_type: int):
    return helper.tensor_dtype_to_np_dtype(onnx_type)


def evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray] | None:
    """Evaluate ``node`` on constant ``inputs``; None if the op is not foldable here."""
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        for step in (_constant, _layout, _arithmetic):
            out = step(node, inputs, opset)
            if out is not _NOT_HERE:
                return out
    except Exception:
        return None
    return _reference(node, inputs, opset)


_NOT_HERE = object()  # (an op these steps do not evaluate: onnx's reference evaluator may)


def _constant(node: onnx.NodeProto, inputs: list, opset: int):
    """A Constant's value, whichever attribute holds it."""
    op = node.op_type
    if op == "Constant":
        for a in node.attribute:
            if a.name == "value":
                return [numpy_helper.to_array(a.t)]
            if a.name == "value_float":
                return [np.array(a.f, dtype=np.float32)]
            if a.name == "value_floats":
                return [np.array(list(a.floats), dtype=np.float32)]
            if a.name == "value_int":
                return [np.array(a.i, dtype=np.int64)]
            if a.name == "value_ints":
                return [np.array(list(a.ints), dtype=np.int64)]
        return None
    return _NOT_HERE


def _layout(node: onnx.NodeProto, inputs: list, opset: int):
    """Ops that move, select or describe values (shape plumbing)."""
    op = node.op_type
    x = inputs[0] if inputs else None
    if op == "Identity":
        return [x]
    if op == "Cast":
        return [x.astype(_np_dtype(attr(node, "to")))]
    if op == "Transpose":
        perm = attr(node, "perm")
        return [np.transpose(x, perm) if perm is not None else np.transpose(x)]
    value = inputs.__getitem__  # (every input of a node folded here is a constant)
    if op == "Squeeze":
        axes = op_args.axes(node, opset, value)
        return [np.squeeze(x, axis=tuple(axes)) if axes else np.squeeze(x)]
    if op == "Unsqueeze":
        axes = op_args.axes(node, opset, value)
        out = x
        rank = x.ndim + len(axes)
        for a in sorted(a % rank for a in axes):
            out = np.expand_dims(out, a)
        return [out]
    if op == "Reshape":
        shape = [int(s) for s in inputs[1]]
        allowzero = attr(node, "allowzero", 0)
        shape = [x.shape[i] if (s == 0 and not allowzero) else s for i, s in enumerate(shape)]
        return [np.reshape(x, shape)]
    if op == "Flatten":
        axis = attr(node, "axis", 1) % max(x.ndim, 1)
        return [np.reshape(x, (int(np.prod(x.shape[:axis])), -1))]
    if op == "Concat":
        return [np.concatenate([np.asarray(i) for i in inputs], axis=attr(node, "axis"))]
    if op == "Split":
        axis = attr(node, "axis", 0)
        split = op_args.split_sizes(node, opset, value)
        if split is None:
            split = op_args.equal_split(x.shape[axis], len(node.output))
        idx = np.cumsum(split)[:-1]
        return list(np.split(x, idx, axis=axis))
    if op == "Slice":
        starts, ends, axes, steps = op_args.slice_args(node, opset, value)
        sl = [slice(None)] * x.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            dim = x.shape[a]
            sl[a] = slice(*slice(s, e, st).indices(dim)) if st > 0 else _neg_slice(s, e, st, dim)
        return [x[tuple(sl)]]
    if op == "Gather":
        return [np.take(x, inputs[1].astype(np.int64), axis=attr(node, "axis", 0))]
    if op == "Shape":
        shape = np.array(x.shape, dtype=np.int64)
        start, end = _shape_range(node)
        return [shape[start:end]]
    if op == "Size":
        return [np.array(x.size, dtype=np.int64)]
    return _NOT_HERE


def _arithmetic(node: onnx.NodeProto, inputs: list, opset: int):
    """Elementwise arithmetic, fills, ranges and matrix products."""
    op = node.op_type
    x = inputs[0] if inputs else None
    if op in _BINARY:
        a, b = inputs[0], inputs[1]
        res = _BINARY[op](a, b)
        if op in ("Add", "Sub", "Mul", "Div") and np.issubdtype(np.asarray(a).dtype, np.integer):
            res = (np.trunc(a / b) if op == "Div" else res).astype(np.asarray(a).dtype)
        else:
            res = np.asarray(res)
            if res.dtype != np.bool_ and np.asarray(a).dtype != res.dtype:
                res = res.astype(np.asarray(a).dtype)
        return [res]
    if op == "Neg":
        return [-x]
    if op == "Not":
        return [np.logical_not(x)]
    if op == "Sqrt":
        return [np.sqrt(x)]
    if op == "Reciprocal":
        return [(1 / x).astype(x.dtype)]
    if op == "ConstantOfShape":
        v = attr(node, "value")
        v = np.zeros(1, np.float32) if v is None else np.asarray(v)
        shape = [int(s) for s in x]
        if int(np.prod(shape)) > MAX_FOLD_ELEMENTS:
            return None
        return [np.full(shape, v.ravel()[0], dtype=v.dtype)]
    if op == "Expand":
        shape = np.broadcast_shapes(x.shape, tuple(int(s) for s in inputs[1]))
        if int(np.prod(shape)) > MAX_FOLD_ELEMENTS:
            return None
        return [np.broadcast_to(x, shape).copy()]
    if op == "Range":
        return [np.arange(inputs[0], inputs[1], inputs[2]).astype(inputs[0].dtype)]
    if op == "MatMul":
        return [np.matmul(inputs[0], inputs[1])]
    if op == "Gemm":  # (here rather than in onnx's reference evaluator, which takes nothing over 1M elements)
        a = inputs[0].T if attr(node, "transA", 0) else inputs[0]
        b = inputs[1].T if attr(node, "transB", 0) else inputs[1]
        res = attr(node, "alpha", 1.0) * np.matmul(a, b)
        if len(inputs) > 2 and inputs[2] is not None:
            res = res + attr(node, "beta", 1.0) * np.asarray(inputs[2])
        return [np.asarray(res, dtype=np.asarray(inputs[0]).dtype)]
    return _NOT_HERE


def _neg_slice(s, e, st, dim):
    s = max(-1, min(dim - 1, s + dim if s < 0 else s))
    e = e + dim if e < 0 else e
    e = max(-1, min(dim - 1, e))
    return slice(s, None if e < 0 else e, st)


_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Max": np.maximum,
    "Min": np.minimum,
    "Pow": np.power,
}


def _reference(node, inputs, opset) -> list[np.ndarray] | None:
    if any(i is None for i in inputs) or any(np.asarray(i).size > (1 << 20) for i in inputs):
        return None
    try:
        from onnx.reference import ReferenceEvaluator

        names = [f"i{k}" for k in range(len(inputs))]
        n2 = onnx.NodeProto()
        n2.CopyFrom(node)
        del n2.input[:]
        n2.input.extend(names if node.input else [])
        del n2.output[:]
        outs = [f"o{k}" for k in range(len(node.output))]
        n2.output.extend(outs)
        g = helper.make_graph(
            [n2],
            "fold",
            [helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), None) for nm, v in zip(names, inputs)],
            [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        res = ReferenceEvaluator(m).run(None, {nm: np.asarray(v) for nm, v in zip(names, inputs)})
        return [np.asarray(r) for r in res]
    except Exception:
        return None


def _shape_range(shape_node: onnx.NodeProto) -> tuple[int, int | None]:
    """A Shape node's ``start`` and ``end`` (opset 15), read without touching an empty attribute list (see
    protos.node_field: Dedupe folds the shapes of every step of a chain)."""
    start, end = 0, None
    for a in node_field(shape_node, "attribute"):
        if a.name == "start":
            start = a.i
        elif a.name == "end":
            end = a.i
    return start, end


def _known_shape(graph: "Graph", name: str) -> list | None:
    """The shape of ``name`` as far as it is known: a fold decides on it, so a big model infers the whole of
    the tensor's cone if it must (see Model.known_type)."""
    t = graph.model.known_type(name, whole_cone=True)
    return t[1] if t else None


def _static_shape(graph: "Graph", name: str) -> list | None:
    """``name``'s shape when every extent is a number, else None; a shape its ops fix (numbers, or a symbol
    somewhere) is not inferred to learn that (:func:`rnnfuse.op_shapes.op_dims`)."""
    from .op_shapes import op_dims  # (its walks build on the graph index, which folds through here)

    t = graph.model.settled_type(name)  # (what is known already costs nothing: a 100k-node prologue's walk)
    fixed = tuple(t[1]) if t is not None and t[1] is not None else op_dims(graph, name)
    if fixed is not None and any(isinstance(d, str) for d in fixed):
        return None
    if fixed is not None and all(isinstance(d, int) for d in fixed):
        return list(fixed)
    shape = _known_shape(graph, name)
    return shape if shape is not None and all(isinstance(d, int) for d in shape) else None


def _fixed_picks(graph: "Graph", name: str) -> np.ndarray | None:
    """A pick of a Shape's entries (``Gather(Shape(x), i)``, a Slice of it) where the ops fix them all as
    numbers (:func:`rnnfuse.op_shapes.shape_value`; None: not known so)."""
    from .op_shapes import shape_value

    v = shape_value(graph, name)
    if isinstance(v, int) or (isinstance(v, tuple) and all(isinstance(d, int) for d in v)):
        return np.array(v, dtype=np.int64)
    return None


def fold_output(graph: "Graph", node: onnx.NodeProto, name: str) -> np.ndarray | None:
    """Fold the output ``name`` of ``node`` if all of the node's inputs are constants."""
    if node.op_type in ("Loop", "Scan", "If") or node.op_type in RANDOM_OPS:
        return None
    if node.op_type == "Shape":
        # Shape of a tensor with a fully static declared shape is constant even if the tensor is not
        shape = _static_shape(graph, node.input[0])
        if shape is not None and graph.const(node.input[0]) is None:
            start, end = _shape_range(node)
            return np.array(shape, dtype=np.int64)[start:end]
        # the extents Shape(x, start, end) picks, where those are numbers and others are not: dynamo's
        # nn.LSTM slices its gates' weights at ``Shape(h, start=2, end=3)``, h a native op's Y_h (its hidden
        # size) or an input declared [1, batch, H]
        picks = _fixed_picks(graph, name) if _shape_range(node) != (0, None) else None
        if picks is not None:
            return picks
    if node.op_type in ("Gather", "Slice") and len(node.input) >= 2:
        # static entries of the shape of a tensor whose other dims are dynamic (torch's chunk sizes,
        # Keras' time-step count): Gather/Slice of Shape(x) where the entries picked are known
        p = graph.producer.get(node.input[0])
        settled = _fixed_picks(graph, name) if p is not None and p.op_type == "Shape" else None
        if settled is not None:
            return settled
        if p is not None and p.op_type == "Shape":
            shape = _known_shape(graph, p.input[0])
            if shape is not None:
                start, end = _shape_range(p)
                dims = list(shape)[start:end]
                idx = [graph.const(i) if i else None for i in node.input[1:]]
                if node.op_type == "Gather" and idx[0] is not None and attr(node, "axis", 0) == 0:
                    try:
                        picked = np.take(np.array(dims, dtype=object), idx[0].astype(np.int64))
                    except IndexError:  # (an index past the rank: the model is invalid; leave it to the runtime)
                        picked = None
                else:
                    picked = None
                    if node.op_type == "Slice" and all(v is not None for v in idx):
                        sl = evaluate(node, [np.arange(len(dims), dtype=np.int64)] + idx, graph.model.opset)
                        if sl is not None:
                            picked = np.array(dims, dtype=object)[sl[0]]
                if picked is not None:
                    picked = np.asarray(picked, dtype=object)
                    if all(isinstance(d, (int, np.integer)) for d in picked.ravel()):
                        return picked.astype(np.int64)
    if node.op_type == "Size":
        # the size of a tensor of static shape (e.g. Shape(x) of a tensor of known rank) is constant
        shape = _static_shape(graph, node.input[0])
        if shape is not None and graph.const(node.input[0]) is None:
            return np.array(int(np.prod(shape)), dtype=np.int64)
    vals = []
    for i in node.input:
        if not i:
            vals.append(None)
            continue
        v = graph.const(i)
        if v is None:
            return None
        vals.append(v)
    outs = evaluate(node, vals, graph.model.opset)
    if outs is None:
        return None
    for o, v in zip(node.output, outs):
        if o == name:
            return np.asarray(v)
    return None
