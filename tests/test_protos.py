"""The proto helpers' knowledge of ONNX's schemas: which ops hold tensors or graphs in their attributes, which
take attributes at all. The walks over every node rely on it to leave the attribute field of most nodes
unread (upb gives a node's object a map of stand-ins at the first read of an empty repeated field, held as
long as the object lives: 17 MB over a 100,000-node unrolled chain, read once per validation)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from onnx import AttributeProto, TensorProto, defs, helper, numpy_helper

from helpers import AttributeReads
from rnnfuse.protos import all_tensors, data_bytes, may_hold_tensors, takes_attributes

_HOLDING = {AttributeProto.TENSOR, AttributeProto.TENSORS, AttributeProto.SPARSE_TENSOR,
            AttributeProto.SPARSE_TENSORS, AttributeProto.GRAPH, AttributeProto.GRAPHS}


def test_what_a_node_may_hold_is_read_off_onnx_schemas():
    """For every op of ONNX's domain at every opset it has a schema for: a tensor or graph attribute may be
    held exactly where the schema has one, attributes taken exactly where it has any (whatever onnx release
    is installed: the answers come from its schemas)."""
    latest: dict[str, list] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain == "":
            latest.setdefault(schema.name, []).append(schema)
    checked = 0
    for name, versions in latest.items():
        for schema in versions:
            kinds = {a.type for a in schema.attributes.values()}
            opset = schema.since_version
            assert may_hold_tensors(name, opset) == bool(kinds & _HOLDING), (name, opset)
            assert takes_attributes(name, "", opset) == bool(kinds), (name, opset)
            checked += 1
    assert checked > 300
    assert may_hold_tensors("Constant", 17) and may_hold_tensors("Loop", 17) and not may_hold_tensors("Add", 17)


def test_takes_attributes_follows_the_schema_of_the_models_opset():
    assert not takes_attributes("Add", "", 17)
    assert takes_attributes("Add", "", 6)  # (Add had broadcast and axis until opset 7)
    assert not takes_attributes("Shape", "", 13) and takes_attributes("Shape", "", 15)
    assert takes_attributes("Gather", "ai.onnx", 17)
    # what onnx does not know is read as it is: another domain, an unknown op, an opset newer than onnx's
    assert takes_attributes("Add", "com.example", 17)
    assert takes_attributes("NoSuchOp", "", 17) and may_hold_tensors("NoSuchOp", 17)
    assert takes_attributes("Add", "", defs.onnx_opset_version() + 1)
    assert may_hold_tensors("Add", defs.onnx_opset_version() + 1) and may_hold_tensors("Add", None)
    assert takes_attributes("Add", "", None)


def _tensor(name: str, n: int):
    return numpy_helper.from_array(np.arange(n, dtype=np.float32), name)


def _model():
    body = helper.make_graph([helper.make_node("Constant", [], ["k"], value=_tensor("kv", 3)),
                              helper.make_node("Add", ["s", "k"], ["s2"]),
                              helper.make_node("Identity", ["c"], ["c2"])],
                             "body", [helper.make_tensor_value_info(n, t, None) for n, t in
                                      (("i", TensorProto.INT64), ("c", TensorProto.BOOL), ("s", TensorProto.FLOAT))],
                             [helper.make_tensor_value_info(n, t, None) for n, t in
                              (("c2", TensorProto.BOOL), ("s2", TensorProto.FLOAT))], [_tensor("bw", 5)])
    nodes = [helper.make_node("Constant", [], ["a"], value=_tensor("av", 2)),
             helper.make_node("Add", ["x", "a"], ["b"]),
             helper.make_node("ConstantOfShape", ["shape"], ["z"], value=_tensor("zv", 1)),
             helper.make_node("Loop", ["", "", "b"], ["y"], body=body),
             helper.make_node("Custom", ["y"], ["w"], domain="com.example", table=_tensor("tv", 7))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)], [_tensor("wi", 11)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])


def test_all_tensors_reads_the_attributes_of_nodes_that_may_hold_tensors_only():
    """Every tensor is found (an initializer, Constant and ConstantOfShape values, a Loop body's initializer
    and Constant, another domain's tensor attribute), and no Add's attribute field is read."""
    m = _model()
    assert sorted(t.name for t in all_tensors(m)) == ["av", "bw", "kv", "tv", "wi", "zv"]
    assert data_bytes(m) == 4 * (2 + 5 + 3 + 7 + 11 + 1)
    read: list = []
    proxy = SimpleNamespace(graph=SimpleNamespace(node=[AttributeReads(n, read) for n in m.graph.node],
                                                  initializer=m.graph.initializer), functions=[],
                            opset_import=m.opset_import)
    assert sorted(t.name for t in all_tensors(proxy)) == ["av", "bw", "kv", "tv", "wi", "zv"]
    assert read == ["Constant", "ConstantOfShape", "Loop", "Custom"]
