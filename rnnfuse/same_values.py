"""Whether a node of a rewritten model reads, under other names, the very values its input's node read: what
lets the do-no-harm guard (:mod:`rnnfuse.changed_region`) count it as unchanged.

The optimizer's clean-ups rename what nodes read without changing what they compute: Dedupe merges equal
nodes and equal constants and drops a Cast to the type a value already has, and an Identity of a weight is read
through. Counted as changed, each such reader joined the guard's region with everything its outputs reach:
in a torch trace of 582 transformer blocks beside a fused LSTMCell loop, 6,008 readers of merged shape
arithmetic and of Identity'd LayerNorm weights made a region of 10,807 nodes, typed by inferring both
whole models (1.6 s) and loaded by onnxruntime (0.9 s), for one fused op.

Two values are taken to be the same by how they are computed in the input model, never by inferred types:
equal names; two constants of equal type, dims and bytes (initializers no graph input may override, or
Constant nodes of equal attributes); or outputs at the same position of two nodes of the same op, domain,
attributes and number of outputs reading values that are the same in turn (not a random op, not a Dropout,
not a node holding subgraphs); either way declared alike (or neither declared). Such values have the same
type, and onnxruntime's load knows the contents of both or of neither.

Copies are read through where that stays true: a Cast of a Cast to the same type. Reading past an Identity
(ONNX infers no contents through it) or past a Cast of a Shape or a constant (an onnxruntime release may pass
none through a Cast) could leave a value the load knows where it knew none, so those are read through only
for a reader whose inference neither reads an input's contents nor passes any on (a LayerNormalization
reading its scale, a MatMul its weight).
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, ModelProto, NodeProto, TensorProto

from .protos import ONNX_DOMAINS, UNREPEATABLE_OPS, fixed_initializers, has_subgraph

# how deep two computations are compared before they are taken to differ (the answer is then "changed": the
# guard's region grows, nothing unsound)
MAX_DEPTH = 48

# ops whose ONNX type inference reads no input's contents and infers none for its outputs: what they read
# may be known to the load in one model and not the other without any difference to them
_CONTENTS_BLIND = frozenset({
    "LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization", "MatMul", "Gemm",
    "Conv", "ConvTranspose", "PRelu", "LSTM", "GRU", "RNN", "Softmax", "LogSoftmax", "Relu", "Tanh", "Sigmoid",
    "Erf", "Gelu",
})

# the element type of an op's output, whatever it reads
_FIXED_ELEM_TYPE = {"Shape": TensorProto.INT64, "Size": TensorProto.INT64}


class SameValues:
    """The input model's values, to compare two of them by how they are computed (see the module); built once,
    each pair decided once."""

    def __init__(self, model: ModelProto):
        self._graph = model.graph
        nodes = list(self._graph.node)
        # the input's node of each first named output: whose node a rewritten node is, equal to it or not (the
        # fastest form of that map: 0.14 s over 100,000 nodes where a map of output tuples took 0.21 s)
        keys = [next(iter(n.output), "") for n in nodes]
        for i in [i for i, k in enumerate(keys) if not k]:  # (an LSTM whose Y is omitted: keyed by its Y_h)
            keys[i] = first_output(nodes[i])
        self.by_first_output: dict[str, NodeProto] = dict(zip(keys, nodes))
        self.by_first_output.pop("", None)  # (a node with no named output is compared with none)
        # (what comparing values reads, built at the first comparison (_index): most rewrites rename no read)
        self.producer: dict[str, NodeProto] | None = None
        self.constants: dict[str, TensorProto] = {}
        self.declared: dict[str, onnx.ValueInfoProto] = {}
        self._memo: dict[tuple[str, str], bool] = {}

    def _index(self) -> None:
        g = self._graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.producer.pop("", None)  # (an omitted optional output: no value)
        self.constants = fixed_initializers(g)
        # (a declared type is what inference starts from where it can tell less: two values computed alike
        # are the same to their readers only if declared alike)
        self.declared = {v.name: v for v in (*g.value_info, *g.output)}

    def _declared_alike(self, a: str, b: str) -> bool:
        da, db = self.declared.get(a), self.declared.get(b)
        return da is None and db is None or (da is not None and db is not None and da.type == db.type)

    def reads_alike(self, after: NodeProto, before: NodeProto) -> bool:
        """Whether ``after`` (a node of the rewritten model) is ``before`` (the input's node of its first output)
        but for reading the same values, some under other names: each name ``after`` reads is one of the
        input's, and the same value there as what ``before`` read at that place. The values ``after``
        reads may still differ from the input's by what the rewrite changed upstream; the guard follows
        those as it follows every reader."""
        if len(after.input) != len(before.input) or after.op_type != before.op_type:
            return False
        renamed = [(a, b) for a, b in zip(after.input, before.input) if a != b]
        if not renamed or not _equal_but_inputs(after, before):
            return False
        blind = after.op_type in _CONTENTS_BLIND and after.domain in ONNX_DOMAINS
        return all(self._same(a, b, MAX_DEPTH, blind) for a, b in renamed)  # (a name the input has not: unequal)

    def _same(self, a: str, b: str, depth: int, blind: bool = False) -> bool:
        """Whether ``a`` and ``b`` are the same value, for a reader ``blind`` to contents or not (within the
        values compared, always not: what a node computes from them may pass contents on)."""
        if self.producer is None:
            self._index()
        a, b = self._past_copies(a, blind), self._past_copies(b, blind)
        if a == b:
            return True
        if not a or not b or depth == 0 or not self._declared_alike(a, b):
            return False
        key = (a, b) if a < b else (b, a)
        known = self._memo.get(key)
        if known is None:
            known = self._memo[key] = self._computed_alike(a, b, depth)
        return known

    def _computed_alike(self, a: str, b: str, depth: int) -> bool:
        ta, tb = self.constants.get(a), self.constants.get(b)
        if ta is not None or tb is not None:
            return ta is not None and tb is not None and _same_tensor(ta, tb)
        na, nb = self.producer.get(a), self.producer.get(b)
        if na is None or nb is None or len(na.output) != len(nb.output) or list(na.output).index(a) != list(nb.output).index(b):
            return False  # (a graph input is only itself; a Split's outputs are sized by how many it has)
        if (na.op_type != nb.op_type or na.domain != nb.domain or na.overload != nb.overload
                or len(na.input) != len(nb.input) or na.attribute != nb.attribute):
            return False
        if na.op_type in UNREPEATABLE_OPS or has_subgraph(na):
            return False
        return all(x == y or self._same(x, y, depth - 1) for x, y in zip(na.input, nb.input))

    def _past_copies(self, name: str, blind: bool) -> str:
        """``name``, or what it copies: a Cast of a Cast to the same type; for a reader ``blind`` to contents,
        any Cast to the element type its input is known to have, and an Identity. (A Cast of a Shape read
        through would leave a value the load knows where it knew none if it passes no contents through a
        Cast, as ONNX does and an onnxruntime release might not; through a second Cast both know alike.)"""
        for _ in range(MAX_DEPTH):
            n = self.producer.get(name)
            if n is None:
                return name
            if n.domain not in ONNX_DOMAINS or len(n.input) != 1 or name in self.declared:
                return name  # (a declared copy may be declared otherwise than what it copies)
            if n.op_type == "Identity" and blind:
                name = n.input[0]
            elif n.op_type == "Cast" and (to := _cast_target(n)) is not None and len(n.attribute) == 1 \
                    and to == self._evident_elem_type(n.input[0], blind):
                name = n.input[0]
            else:
                return name
        return name

    def _evident_elem_type(self, name: str, blind: bool) -> int | None:
        """``name``'s element type as its definition fixes it, without inference: a Cast's target; for a
        reader ``blind`` to contents, also a constant's or a Shape's."""
        n = self.producer.get(name)
        n = None if n is None or n.domain not in ONNX_DOMAINS else n
        if n is not None and n.op_type == "Cast":
            return _cast_target(n)
        if not blind:
            return None
        t = self.constants.get(name)
        if t is not None:
            return t.data_type
        if n is not None and n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            return n.attribute[0].t.data_type
        return None if n is None else _FIXED_ELEM_TYPE.get(n.op_type)


def first_output(n: NodeProto) -> str:
    """A node's first named output ("" when it names none)."""
    return next((o for o in n.output if o), "")


def _cast_target(n: NodeProto) -> int | None:
    """A Cast's element type (None from Cast-1, which names it by a string)."""
    return next((a.i for a in n.attribute if a.name == "to" and a.type == AttributeProto.INT), None)


def _equal_but_inputs(after: NodeProto, before: NodeProto) -> bool:
    """Whether the two nodes are equal field for field but for the names they read."""
    copy = NodeProto()
    copy.CopyFrom(after)
    del copy.input[:]
    copy.input.extend(before.input)
    return copy == before


def _same_tensor(a: TensorProto, b: TensorProto) -> bool:
    """Whether two initializers hold the same tensor: type, dims and data, not names (data stored outside the
    file is compared by where it lies)."""
    if a.data_type != b.data_type or a.dims != b.dims or a.data_location != b.data_location:
        return False
    if a.data_location == TensorProto.EXTERNAL:
        return [(e.key, e.value) for e in a.external_data if e.key != "checksum"] == \
            [(e.key, e.value) for e in b.external_data if e.key != "checksum"]
    if a.HasField("segment") or b.HasField("segment"):
        return False
    return all(getattr(a, f) == getattr(b, f) for f in _TENSOR_DATA_FIELDS)


_TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
