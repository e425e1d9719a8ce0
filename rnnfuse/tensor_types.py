"""What the file declares, and what ONNX shape inference adds, about each tensor's element type and shape.

A type is ``(elem_type, dims)``: dims are ints, strings for symbolic dimensions, None for unknown ones, or
None for an unknown rank. Inference runs on a skeleton of the model (no weight data), so it is cheap even
for models with gigabytes of weights.
"""

from __future__ import annotations

import itertools
import math

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto

from .protos import CONTROL_FLOW, subgraphs

# below this many nodes, shape inference (once per model) is cheaper than doing without the shapes it gives
CHEAP_INFERENCE_NODES = 20000
# ONNX's inference hands each subgraph the types of every value of the scopes around it, so its cost also grows
# as values x subgraphs: 8,000 Loops in a 16k-node graph took 7.9 s (6e-8 s a node a subgraph); 1,600 Loops of
# a tanh cell each, 1,600 nodes and 4,800 weights around them, 1.8 s. Below this product (nodes and
# initializers x subgraphs) it stays under ~0.3 s
CHEAP_INFERENCE_SCOPE_WORK = 5_000_000
# initializers up to this size keep their data in what inference sees (Reshape shapes, axes); bigger ones only their type
SKELETON_DATA_BYTES = 4096


def _skeleton(g: GraphProto, keep_bytes: int = SKELETON_DATA_BYTES) -> GraphProto:
    out = GraphProto()
    out.name = g.name
    out.input.extend(g.input)
    out.output.extend(g.output)
    out.value_info.extend(g.value_info)
    out.initializer.extend(skeleton_initializer(t, keep_bytes) for t in g.initializer)
    for n in g.node:
        m = out.node.add()
        m.CopyFrom(n) if not any(True for _ in subgraphs(n)) else copy_node_skeleton(n, m, keep_bytes)
    return out


def skeleton_initializer(t: TensorProto, keep_bytes: int = SKELETON_DATA_BYTES) -> TensorProto:
    """``t`` as shape inference needs it: whole when it is held inline and small (a Reshape's target, an
    axis), else only its name, type and dims (a weight, whose values no inference reads)."""
    s = TensorProto()
    if t.data_location != TensorProto.EXTERNAL and t.ByteSize() <= keep_bytes:
        s.CopyFrom(t)
    else:
        s.name, s.data_type = t.name, t.data_type
        s.dims.extend(t.dims)
    return s


def copy_node_skeleton(n: NodeProto, m: NodeProto, keep_bytes: int) -> None:
    m.op_type, m.domain, m.name, m.overload = n.op_type, n.domain, n.name, n.overload
    m.input.extend(n.input)
    m.output.extend(n.output)
    for a in n.attribute:
        b = m.attribute.add()
        if a.type == AttributeProto.GRAPH:
            b.name, b.type = a.name, a.type
            b.g.CopyFrom(_skeleton(a.g, keep_bytes))
        elif a.type == AttributeProto.GRAPHS:
            b.name, b.type = a.name, a.type
            for sg in a.graphs:
                b.graphs.append(_skeleton(sg, keep_bytes))
        else:
            b.CopyFrom(a)


# what a tensor of shape values can be on its way: onnxruntime's load carries a Shape's entries through a Cast
# to a float and back, and through an Unsqueeze to rank 2 and a Squeeze (a review probed onnxruntime 1.32)
_NOT_SHAPE_VALUES = frozenset({TensorProto.STRING, TensorProto.UNDEFINED})
# a tensor holding more elements than this is no shape's values (ranks stay far below it); but a vector of
# integers of any length may be sizes inference reads (a Split's: one entry a part)
SHAPE_VALUE_ELEMENTS = 64
_INTEGERS = frozenset({TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8,
                       TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL})


def may_carry_shape_values(serialized_type: bytes) -> bool:
    """Whether a value of this (serialised) type may be one whose contents inference reads or propagates as
    data (a ``Shape``, a ``Gather`` of it, a ``Concat`` of such, a Cast of those to float, an Unsqueeze of them;
    a Split's sizes): a numeric or bool tensor of unknown rank, of rank 0 or 1 (a vector of integers whatever its
    length: a Constant ``[1] * T`` splitting T steps), or of a known shape of at most ``SHAPE_VALUE_ELEMENTS``
    elements. onnxruntime's load knows such a value's contents when it is computed from shapes and constants;
    a part of the model that takes it as a typed input does not, and would accept what the whole refuses."""
    t = onnx.TypeProto()
    t.ParseFromString(serialized_type)
    if not t.HasField("tensor_type"):
        return False
    tt = t.tensor_type
    if tt.elem_type in _NOT_SHAPE_VALUES:
        return False
    if not tt.HasField("shape"):
        return True
    dims = tt.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return len(dims) <= 1
    return math.prod(d.dim_value for d in dims) <= SHAPE_VALUE_ELEMENTS or (len(dims) == 1 and tt.elem_type in _INTEGERS)


def type_of(vi: onnx.ValueInfoProto) -> tuple[int, list | None] | None:
    t = vi.type
    if not t.HasField("tensor_type"):
        return None
    tt = t.tensor_type
    if not tt.HasField("shape"):
        return (tt.elem_type, None)
    dims: list = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return (tt.elem_type, dims)


class SharedDims(list):
    """The dims of every declared value of one type, held once: an exporter that declares each value's type
    (torch's dynamo, jax2onnx, onnx's inference saved) writes 126,000 of them for a 108k-node unrolled LSTM,
    of five distinct types, and a list each held 18 MB at the run's peak. Read-only, since a change would
    change every value's type: copy them (``list(dims)``) to build on them."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a declared type's dims are shared by every value of that type: copy them to change them")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __copy__(self) -> list:  # (a copy is made to be changed: a plain list, like a slice)
        return list(self)

    def __deepcopy__(self, memo) -> list:
        return list(self)

    def __reduce__(self):
        return SharedDims, (list(self),)


def _shared(alike: dict, elem_type: int, dims) -> tuple[int, SharedDims | None]:
    """The one ``(elem_type, SharedDims)`` of that type in ``alike`` (made on first sight)."""
    key = (elem_type, None if dims is None else tuple(dims))
    found = alike.get(key)
    if found is None:
        found = alike[key] = (elem_type, None if dims is None else SharedDims(dims))
    return found


def _collect_types(g: GraphProto, out: dict, top: bool = True, nodes=None, alike: dict | None = None) -> None:
    """Types of every name; a subgraph's names never override the main graph's or each other's. ``nodes``:
    the graph's Constants and nodes with subgraphs, in node order, when a caller knows them (else every node
    is looked at). The values of one declared type share one ``(elem_type, SharedDims)``."""
    alike = {} if alike is None else alike  # (type -> its one shared form, for every scope of the model)
    for vi in itertools.chain(g.input, g.output, g.value_info):
        t = type_of(vi)
        if t is not None and (vi.name not in out or (top and out[vi.name][1] is None and t[1] is not None)):
            out[vi.name] = _shared(alike, t[0], t[1])
    for t in g.initializer:
        out[t.name] = _shared(alike, t.data_type, t.dims)
    for n in g.node if nodes is None else nodes:
        op = n.op_type
        if op == "Constant":
            for a in n.attribute:  # (the tensor's declared type: its data is never decoded for this)
                if a.name == "value" and a.type == AttributeProto.TENSOR and n.output:
                    out[n.output[0]] = _shared(alike, a.t.data_type, a.t.dims)
        elif op in CONTROL_FLOW or n.domain not in ("", "ai.onnx"):
            for sg in subgraphs(n):
                _collect_types(sg, out, False, alike=alike)


def declared_types(proto: ModelProto, index=None) -> dict[str, tuple[int, list | None]]:
    """Types the file itself declares (inputs, outputs, value_info, initializers, Constants): no inference.
    ``index``: the main graph's GraphIndex, whose op-type index names the Constants and control-flow nodes
    while the graph is as loaded (the other 100,000 nodes of an unrolled export are not read: 0.2 s)."""
    out: dict = {}
    nodes = index.nodes_as_loaded("Constant", *CONTROL_FLOW) if index is not None else None
    _collect_types(proto.graph, out, nodes=nodes)
    return out


def infer_types(proto: ModelProto) -> dict[str, tuple[int, list | None]]:
    sk = ModelProto()
    sk.ir_version = proto.ir_version
    sk.opset_import.extend(proto.opset_import)
    sk.graph.CopyFrom(_skeleton(proto.graph))
    try:
        sk = onnx.shape_inference.infer_shapes(sk, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # inference is a convenience; fall back to what the file declares
        pass
    out: dict[str, tuple[int, list | None]] = {}
    _collect_types(sk.graph, out)
    return out
