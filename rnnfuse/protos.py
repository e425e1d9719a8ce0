"""Small utilities on ONNX protos that several modules need (the bottom layer: no rnnfuse imports)."""

from __future__ import annotations

import re
from typing import Iterable, Iterator

from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper


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


def _graph_tensors(g: GraphProto) -> Iterator[TensorProto]:
    yield from g.initializer
    yield from _node_tensors(g.node)


def _node_tensors(nodes: Iterable[NodeProto]) -> Iterator[TensorProto]:
    for n in nodes:
        for a in n.attribute:
            if a.type == AttributeProto.TENSOR:
                yield a.t
            elif a.type == AttributeProto.TENSORS:
                yield from a.tensors
            elif a.type == AttributeProto.GRAPH:
                yield from _graph_tensors(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for sg in a.graphs:
                    yield from _graph_tensors(sg)


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
