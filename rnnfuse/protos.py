"""Small utilities on ONNX protos that several modules need (the bottom layer: no rnnfuse imports)."""

from __future__ import annotations

import re
from typing import Iterable, Iterator

from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper
from onnx import defs as onnx_defs


def attr(node: NodeProto, name: str, default=None):
    """The value of a node attribute (ints, floats, strings decoded, tensors as numpy)."""
    for a in node.attribute:
        if a.name == name:
            if a.type == AttributeProto.TENSOR:
                return numpy_helper.to_array(a.t)
            v = helper.get_attribute_value(a)
            if isinstance(v, bytes):
                return v.decode()
            if a.type == AttributeProto.STRINGS:
                return [s.decode() for s in v]
            if a.type in (AttributeProto.INTS, AttributeProto.FLOATS):
                return list(v)
            return v
    return default


def all_tensors(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor a model holds: initializers and tensor attributes (Constant values), in the main graph,
    every subgraph and every local function."""
    yield from _graph_tensors(model.graph)
    for f in model.functions:
        yield from _node_tensors(f.node)


def attribute_tensors(model: ModelProto) -> Iterator[TensorProto]:
    """The tensors nodes hold as attributes (Constant values, ConstantOfShape fills), in the main graph, every
    subgraph and every local function; no initializer."""
    yield from _node_tensors(model.graph.node, initializers=False)
    for f in model.functions:
        yield from _node_tensors(f.node, initializers=False)


def tensors_beyond_initializers(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor of :func:`all_tensors` but the main graph's initializers."""
    yield from _node_tensors(model.graph.node)
    for f in model.functions:
        yield from _node_tensors(f.node)


def _graph_tensors(g: GraphProto) -> Iterator[TensorProto]:
    yield from g.initializer
    yield from _node_tensors(g.node)


def _node_tensors(nodes: Iterable[NodeProto], initializers: bool = True) -> Iterator[TensorProto]:
    for n in nodes:
        # (only a node that may hold a tensor is asked for its attributes: most nodes have none, and the first
        # read of an empty field leaves a map on the node's object for as long as it lives, see node_field)
        if n.op_type not in TENSOR_ATTRIBUTE_OPS and n.domain in ONNX_DOMAINS:
            continue
        for a in n.attribute:
            if a.type == AttributeProto.TENSOR:
                yield a.t
            elif a.type == AttributeProto.TENSORS:
                yield from a.tensors
            elif a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                for sg in ([a.g] if a.type == AttributeProto.GRAPH else a.graphs):
                    if initializers:
                        yield from sg.initializer
                    yield from _node_tensors(sg.node, initializers)


# what a symbolic dimension's name says it is (exporters name them "batch", "seq_len", "T", "N", ...)
_BATCH_NAMES = re.compile(r"(batch|^b$|^n$|^bs$)", re.I)
_TIME_NAMES = re.compile(r"(time|seq|^t$|len|steps)", re.I)


def dim_role(name) -> str | None:
    """``"batch"``, ``"time"`` or None (not a name, or a name that says neither) for a symbolic dimension."""
    if not isinstance(name, str):
        return None
    if _BATCH_NAMES.search(name):
        return "batch"
    if _TIME_NAMES.search(name):
        return "time"
    return None


# -- subgraphs (Loop, Scan, If bodies, and graph attributes of other domains' nodes) --------------------
CONTROL_FLOW = frozenset({"Loop", "Scan", "If", "SequenceMap"})
ONNX_DOMAINS = ("", "ai.onnx")
# The ops of ONNX's own domain with an attribute that holds a tensor or a graph, in any opset (tests/
# test_protos.py pins the set to onnx's schemas). A node of another op of that domain holding one is invalid:
# onnx's checker and onnxruntime refuse an attribute the op's schema does not have.
TENSOR_ATTRIBUTE_OPS = frozenset({"Constant", "ConstantOfShape"}) | CONTROL_FLOW

_NODE_FIELDS = NodeProto.DESCRIPTOR.fields_by_name


def node_field(node: NodeProto, name: str):
    """A repeated field of a node (``"input"``, ``"attribute"``), without reading it when it is empty:
    protobuf's (upb's) first read of an empty repeated field gives the message's Python object a map of
    stand-ins for its unset fields, ~260 bytes it holds as long as it lives. The graph index holds every
    node's object: reading the attributes of each step node of a 6,000-step unrolled chain (most have none)
    and the inputs of its 18,000 Constants (none) left 30 MB of such maps. (Slower than reading the field:
    for the fields that are often empty.)"""
    want = _NODE_FIELDS[name]
    for field, value in node.ListFields():  # (the fields present)
        if field is want:
            return value
    return ()


_TAKES_ATTRIBUTES: dict[tuple[str, int | None], bool] = {}


def takes_attributes(op_type: str, domain: str, opsets: dict[str, int]) -> bool:
    """Whether the schema of ``op_type`` at the model's ``opsets`` (domain -> version) has any attribute; True
    for an op onnx has no schema of. A node of an op without attributes holds none, or the model is invalid
    (onnx's checker and onnxruntime refuse an attribute the schema lacks), so its attribute field need not
    be read (see node_field for why not reading it matters)."""
    if domain not in ONNX_DOMAINS or op_type in TENSOR_ATTRIBUTE_OPS:
        return True
    key = (op_type, opsets.get(""))
    known = _TAKES_ATTRIBUTES.get(key)
    if known is None:
        version = key[1]
        try:  # (no opset, or newer than onnx knows, whose op may have gained one: read as it is)
            known = version is None or version > onnx_defs.onnx_opset_version() or \
                bool(onnx_defs.get_schema(op_type, version, "").attributes)
        except Exception:  # (an op onnx has no schema of at that opset)
            known = True
        _TAKES_ATTRIBUTES[key] = known
    return known


def has_subgraph(node: NodeProto) -> bool:
    return node.op_type in CONTROL_FLOW or (node.domain not in ("", "ai.onnx") and any(True for _ in subgraphs(node)))


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    if node.domain in ("", "ai.onnx") and node.op_type not in CONTROL_FLOW:
        return
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def holds_op_type(node: NodeProto, op_types: frozenset[str]) -> bool:
    """Whether a node of one of ``op_types`` is in ``node``'s subgraphs, at any depth."""
    stack = list(subgraphs(node))
    while stack:
        for n in stack.pop().node:
            if n.op_type in op_types:
                return True
            if has_subgraph(n):
                stack.extend(subgraphs(n))
    return False


def free_names(g: GraphProto) -> set[str]:
    """Names a graph reads that it does not define (its captures from enclosing scopes)."""
    defined = {i.name for i in g.input}
    defined.update([i.name for i in g.initializer])
    defined.add("")
    used: set[str] = set()
    for n in g.node:
        used.update(n.input[:])  # (a slice: the names listed in one call)
        defined.update(n.output[:])
        if has_subgraph(n):  # (most nodes have none: no generator made for them)
            for sg in subgraphs(n):
                used |= free_names(sg)
    used.update([o.name for o in g.output])
    used -= defined
    return used


def reads_of(node: NodeProto) -> list[str]:
    """What ``node`` reads: its inputs, then the outer names its subgraphs capture, sorted (a node of a bare
    proto; a graph's own index keeps the captures: rnnfuse.graph_walks.Walks.reads)."""
    if not has_subgraph(node):
        return node.input[:]
    captured: set[str] = set()
    for sg in subgraphs(node):
        captured |= free_names(sg)
    return [*node.input, *sorted(captured)]


def rename_free(g: GraphProto, old: str, new: str) -> None:
    """Rename reads of an outer-scope name inside a subgraph (and its nested subgraphs)."""
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new
        for sg in subgraphs(n):
            rename_free(sg, old, new)
    for o in g.output:
        if o.name == old:
            o.name = new


def all_names(g: GraphProto, out: set[str]) -> None:
    """Add every tensor and node name of ``g`` and its subgraphs to ``out``."""
    out.update(i.name for i in g.input)
    out.update(i.name for i in g.output)
    out.update(i.name for i in g.initializer)
    out.update(v.name for v in g.value_info)
    for n in g.node:
        out.update(n.input)
        out.update(n.output)
        if n.name:
            out.add(n.name)
        if has_subgraph(n):
            for sg in subgraphs(n):
                all_names(sg, out)


def tensor_nbytes(t: TensorProto) -> int:
    """A tensor's data size from its type and dims (0 for strings and unknown types)."""
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 0
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    count = 1
    for d in t.dims:
        count *= d
    return count * itemsize


def external_length(t: TensorProto) -> int:
    """The bytes of an externally stored tensor: its ``length`` entry, or (the entry is optional) its dims
    times its element size; never "to the end of the file", which would take in every tensor stored after it."""
    for e in t.external_data:
        if e.key == "length" and e.value:
            return int(e.value)
    return tensor_nbytes(t)


def data_bytes(model: ModelProto) -> int:
    """The bytes of tensor data a model holds or names: every tensor of :func:`all_tensors`, stored inline
    (raw or typed values) or as external data."""
    total = 0
    for t in all_tensors(model):
        if t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"):
            total += external_length(t)
        else:
            total += len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data) + len(t.double_data))
    return total


def set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    """Point a tensor at ``length`` bytes of ``location`` from ``offset`` (no data in the proto)."""
    t.ClearField("raw_data")
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = TensorProto.EXTERNAL
