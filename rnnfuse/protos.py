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
    opset = default_opset(model)
    yield from _graph_tensors(model.graph, opset)
    for f in model.functions:
        yield from _node_tensors(f.node, opset)


def attribute_tensors(model: ModelProto) -> Iterator[TensorProto]:
    """The tensors nodes hold as attributes (Constant values, ConstantOfShape fills), in the main graph, every
    subgraph and every local function; no initializer."""
    opset = default_opset(model)
    yield from _node_tensors(model.graph.node, opset, initializers=False)
    for f in model.functions:
        yield from _node_tensors(f.node, opset, initializers=False)


def tensors_beyond_initializers(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor of :func:`all_tensors` but the main graph's initializers."""
    opset = default_opset(model)
    yield from _node_tensors(model.graph.node, opset)
    for f in model.functions:
        yield from _node_tensors(f.node, opset)


def default_opset(model: ModelProto) -> int | None:
    """The default-domain opset a model imports (IR < 3 models imported opset 1 implicitly)."""
    for imp in model.opset_import:
        if imp.domain in ONNX_DOMAINS:
            return imp.version
    return 1 if model.ir_version < 3 else None


def _graph_tensors(g: GraphProto, opset: int | None) -> Iterator[TensorProto]:
    yield from g.initializer
    yield from _node_tensors(g.node, opset)


def _node_tensors(nodes: Iterable[NodeProto], opset: int | None, initializers: bool = True) -> Iterator[TensorProto]:
    holds: dict[str, bool] = {}  # op type -> may_hold_tensors (asked once a walk: a 100k-node walk took 70 ms, 35 now)
    for n in nodes:
        # (only a node that may hold a tensor is asked for its attributes: most nodes have none, and the first
        # read of an empty field leaves a map on the node's object for as long as it lives, see node_field)
        op = n.op_type
        may = holds.get(op)
        if may is None:
            may = holds[op] = may_hold_tensors(op, opset)
        if not may and n.domain in ONNX_DOMAINS:
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
                    yield from _node_tensors(sg.node, opset, initializers)


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
# ops whose two calls on the same inputs need not give the same values
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
# ... and with Dropout (random in training mode): ops no two calls of which are taken to compute the same values
UNREPEATABLE_OPS = RANDOM_OPS | {"Dropout"}
ONNX_DOMAINS = ("", "ai.onnx")

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


# What a node of ONNX's domain may hold, by op type and opset, from onnx's schemas: a node whose op's schema has
# no such attribute holds none, or the model is invalid (onnx's checker and onnxruntime refuse an attribute
# the schema does not have), so its attribute field need not be read (see node_field for why that matters).
# An op onnx has no schema of at that opset (a model-local function called in ONNX's domain, a newer opset's
# op) is read as it is.
_HOLDING = frozenset({AttributeProto.TENSOR, AttributeProto.TENSORS, AttributeProto.SPARSE_TENSOR,
                      AttributeProto.SPARSE_TENSORS, AttributeProto.GRAPH, AttributeProto.GRAPHS})
_SCHEMA_ATTRIBUTES: dict[tuple[str, int | None], tuple[bool, bool] | None] = {}


def _schema_attributes(op_type: str, opset: int | None) -> tuple[bool, bool] | None:
    """(whether the op's schema at ``opset`` has any attribute, whether one holds a tensor or a graph); None
    when onnx has no schema of it there."""
    key = (op_type, opset)
    if key not in _SCHEMA_ATTRIBUTES:
        found = None
        if opset is not None and opset <= onnx_defs.onnx_opset_version():
            try:
                kinds = {a.type for a in onnx_defs.get_schema(op_type, opset, "").attributes.values()}
                found = (bool(kinds), bool(kinds & _HOLDING))
            except Exception:  # (no schema of that op at that opset)
                pass
        _SCHEMA_ATTRIBUTES[key] = found
    return _SCHEMA_ATTRIBUTES[key]


def may_hold_tensors(op_type: str, opset: int | None) -> bool:
    """Whether a node of ONNX's domain may hold a tensor or a graph in its attributes at ``opset``."""
    known = _schema_attributes(op_type, opset)
    return known is None or known[1]


def takes_attributes(op_type: str, domain: str, opset: int | None) -> bool:
    """Whether a node may have attributes: any of another domain, one of ONNX's whose op's schema at
    ``opset`` (the model's, of ONNX's domain) has some."""
    if domain not in ONNX_DOMAINS:
        return True
    known = _schema_attributes(op_type, opset)
    return known is None or known[0]


def has_subgraph(node: NodeProto) -> bool:
    return node.op_type in CONTROL_FLOW or (node.domain not in ONNX_DOMAINS and any(True for _ in subgraphs(node)))


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    if node.domain in ONNX_DOMAINS and node.op_type not in CONTROL_FLOW:
        return
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def holds_op_type(node: NodeProto, op_types: frozenset[str]) -> bool:
    """Whether a node of one of ``op_types`` is in ``node``'s subgraphs, at any depth."""
    return any(n.op_type in op_types for sg in subgraphs(node) for n in nodes_under(sg))


def carried_layout(node: NodeProto) -> tuple[int, int]:
    """(where a Loop's or Scan's body outputs its carried values, how many it carries): a Loop's body outputs
    its condition first and carries the inputs after the trip count and condition; a Scan (opset 9+) carries
    the inputs before its ``num_scan_inputs`` scanned ones. Its scan outputs follow the carried ones."""
    if node.op_type == "Loop":
        return 1, len(node.input) - 2
    return 0, len(node.input) - attr(node, "num_scan_inputs", 0)


def scan_output_layout(node: NodeProto, n_scans: int) -> tuple[list[int], list[int]]:
    """A Scan's ``scan_output_axes`` and ``scan_output_directions`` as given, each all 0 where left out (a
    Loop stacks every scan output along axis 0, forward: all 0 too)."""
    if node.op_type != "Scan":
        return [0] * n_scans, [0] * n_scans
    return (list(attr(node, "scan_output_axes", None) or [0] * n_scans),
            list(attr(node, "scan_output_directions", None) or [0] * n_scans))


def nodes_within(g: GraphProto, limit: int | None = None, calls: dict | None = None) -> int:
    """How many nodes ``g`` holds, its subgraphs' at any depth included; counting stops past ``limit``.
    ``calls`` (:func:`call_sizes`): a call of a model-local function counts the nodes it expands to too."""
    count, stack = 0, [g]
    while stack:
        nodes = stack.pop().node
        count += len(nodes)
        if calls:
            count += sum(calls.get(call_key(n), 0) for n in nodes)
        if limit is not None and count > limit:
            return count
        for n in nodes:
            if has_subgraph(n):
                stack.extend(subgraphs(n))
    return count


def call_key(n: NodeProto) -> tuple[str, str, str]:
    """What names the function a node calls: domain, name, overload."""
    return n.domain, n.op_type, n.overload


def call_sizes(model: ModelProto) -> dict[tuple[str, str, str], int]:
    """Each model-local function (by :func:`call_key`) -> the nodes a call of it expands to: its body's, the
    subgraphs' in it and what the local functions it calls (there too) expand to (onnxruntime inlines them all
    at a load). Callees are sized first, on a stack of its own (a chain of 400 nested functions is no
    recursion); a call back into a function being sized (a cycle, which ONNX forbids) counts nothing more."""
    bodies = {(f.domain, f.name, f.overload): f for f in model.functions}
    sizes: dict[tuple[str, str, str], int] = {}
    for root in bodies:
        stack, open_ = [(root, False)], set()
        while stack:
            key, callees_sized = stack.pop()
            if callees_sized:
                sizes[key] = nodes_within(bodies[key], calls=sizes)  # (a FunctionProto holds .node as a graph does)
                open_.discard(key)
                continue
            if key in sizes or key in open_:
                continue
            open_.add(key)
            stack.append((key, True))
            stack.extend((k, False) for k in map(call_key, nodes_under(bodies[key])) if k in bodies and k not in sizes)
    return sizes


def nodes_under(g) -> Iterator[NodeProto]:
    """The nodes of ``g`` (a graph or a function) and of its subgraphs at any depth."""
    stack = [g]
    while stack:
        for n in stack.pop().node:
            yield n
            if has_subgraph(n):
                stack.extend(subgraphs(n))


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


def fixed_initializers(g: GraphProto) -> dict[str, TensorProto]:
    """A graph's initializers by name, but those that are also graph inputs: such an initializer is a default a
    caller may override, runtime data rather than a constant."""
    inputs = {v.name for v in g.input}
    return {t.name: t for t in g.initializer if t.name not in inputs}


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
    rename_reads([g], {old: new})


def rename_reads(graphs, renames: dict[str, str], nodes=()) -> None:
    """Rename, by ``renames``, what ``nodes`` read and what the subgraphs ``graphs`` (and theirs) read and
    output: one walk for all the names (a walk per name was quadratic for many masks over a big check model)."""
    stack = [(None, nodes), *((g, g.node) for g in graphs)]
    while stack:
        g, ns = stack.pop()
        for n in ns:
            for i, x in enumerate(n.input):
                if x in renames:
                    n.input[i] = renames[x]
            if has_subgraph(n):
                stack.extend((sg, sg.node) for sg in subgraphs(n))
        if g is not None:
            for o in g.output:
                if o.name in renames:
                    o.name = renames[o.name]


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

