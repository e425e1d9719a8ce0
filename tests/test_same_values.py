"""A node whose reads a clean-up renamed to the same values counts as unchanged for the do-no-harm guard
(rnnfuse.same_values, used by rnnfuse.changed_region): merged duplicates, merged equal constants, a Cast to the
type its input has, an Identity of a weight read by an op whose inference reads no contents. Near misses, where
the renamed read may differ in type or in what onnxruntime's load knows of it, still count as changed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.changed_region as region
from rnnfuse.same_values import SameValues

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, initializers=(), extra_inputs=()) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", F, ["b", 4]), *extra_inputs],
        [helper.make_tensor_value_info("y", F, None)],
        initializer=list(initializers),
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _renamed(before: onnx.ModelProto, drop: set[str], renames: dict[str, str]) -> onnx.ModelProto:
    """``before`` without the nodes producing ``drop`` and its readers' reads renamed (what Dedupe does)."""
    after = onnx.ModelProto()
    after.CopyFrom(before)
    keep = [n for n in after.graph.node if not set(n.output) & drop]
    del after.graph.node[:]
    after.graph.node.extend(keep)
    for n in after.graph.node:
        n.input[:] = [renames.get(x, x) for x in n.input]
    return after


def _changed_ops(after: onnx.ModelProto, before: onnx.ModelProto) -> list[str]:
    nodes = list(after.graph.node)
    return [nodes[i].op_type for i in region._changed_nodes(nodes, before)]


def _twin_shapes(op: str = "Shape", **attrs) -> onnx.ModelProto:
    """Two equal ``op`` nodes of x, each gathered and used as a Reshape's target."""
    nodes = [helper.make_node(op, ["x"], [f"s{k}"], **attrs) for k in (1, 2)]
    nodes += [helper.make_node("Concat", [f"s{k}", f"s{k}"], [f"c{k}"], axis=0) for k in (1, 2)]
    nodes += [helper.make_node("Reshape", ["x", "c1"], ["r1"]), helper.make_node("Reshape", ["x", "c2"], ["r2"]),
              helper.make_node("Add", ["r1", "r2"], ["y"])]
    return _model(nodes)


def test_merged_duplicates_leave_their_readers_unchanged():
    before = _twin_shapes()
    after = _renamed(before, {"s2"}, {"s2": "s1"})
    assert _changed_ops(after, before) == []
    # a whole duplicated computation merged at its top: its readers read the same value
    after = _renamed(before, {"s2", "c2"}, {"s2": "s1", "c2": "c1"})
    assert _changed_ops(after, before) == []


@pytest.mark.parametrize("op, attrs", [("RandomNormalLike", {}), ("Dropout", {}), ("Shape", {"start": 1})])
def test_values_that_need_not_be_equal_are_not_taken_for_each_other(op, attrs):
    """Two random draws differ; a Shape with other attributes computes another value."""
    before = _twin_shapes(op)
    if attrs:  # (the second Shape starts at 1: not the first's value)
        before.graph.node[1].attribute.extend([helper.make_attribute(k, v) for k, v in attrs.items()])
    after = _renamed(before, {"s2"}, {"s2": "s1"})
    assert _changed_ops(after, before) == ["Concat"]


def _weights(same: bool, overridable: bool = False):
    w1 = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w1")
    w2 = numpy_helper.from_array(np.arange(4, dtype=np.float32) + (0 if same else 1), "w2")
    nodes = [helper.make_node("Mul", ["x", "w1"], ["m1"]), helper.make_node("Mul", ["x", "w2"], ["m2"]),
             helper.make_node("Add", ["m1", "m2"], ["y"])]
    extra = [helper.make_tensor_value_info("w2", F, [4])] if overridable else []
    return _model(nodes, [w1, w2], extra)


@pytest.mark.parametrize("same, overridable, changed", [(True, False, []), (False, False, ["Mul"]), (True, True, ["Mul"])])
def test_merged_constants_are_the_same_only_when_equal_and_fixed(same, overridable, changed):
    """Equal initializers merged: unchanged. Other values, or a weight a caller may feed (a graph input too):
    changed."""
    before = _weights(same, overridable)
    after = _renamed(before, set(), {"w2": "w1"})
    assert _changed_ops(after, before) == changed


def _cast_twice(inner_to: int) -> onnx.ModelProto:
    """x -> Shape -> Cast(inner_to) -> Cast(int64) -> Reshape's target."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["c1"], to=inner_to),
             helper.make_node("Cast", ["c1"], ["c2"], to=I64), helper.make_node("Reshape", ["x", "c2"], ["y"])]
    return _model(nodes)


@pytest.mark.parametrize("inner_to, changed", [(I64, []), (F, ["Reshape"])])
def test_a_cast_to_the_type_its_input_has_is_read_through(inner_to, changed):
    """Cast(Cast(s, int64), int64) is Cast(s, int64); after a Cast to float it is not (the types differ)."""
    before = _cast_twice(inner_to)
    after = _renamed(before, {"c2"}, {"c2": "c1"})
    assert _changed_ops(after, before) == changed


def _identity_read_by(op: str) -> onnx.ModelProto:
    """A weight (also a possible shape: 2 int64s / 4 floats) read through an Identity by ``op``."""
    if op == "Reshape":
        w = numpy_helper.from_array(np.array([-1, 2], dtype=np.int64), "w")
        reader = helper.make_node("Reshape", ["x", "wi"], ["y"])
    else:
        w = numpy_helper.from_array(np.ones(4, dtype=np.float32), "w")
        reader = helper.make_node("LayerNormalization", ["x", "wi"], ["y"], axis=-1)
    return _model([helper.make_node("Identity", ["w"], ["wi"]), reader], [w])


@pytest.mark.parametrize("op, changed", [("LayerNormalization", []), ("Reshape", ["Reshape"])])
def test_an_identity_is_read_through_only_by_ops_blind_to_contents(op, changed):
    """ONNX infers no contents through an Identity: a Reshape reading the weight itself has a target its load
    knows, where through the Identity it had none (so it counts as changed); a LayerNormalization reads no
    contents to infer its output."""
    before = _identity_read_by(op)
    after = _renamed(before, {"wi"}, {"wi": "w"})
    assert _changed_ops(after, before) == changed


def test_a_reader_of_a_new_value_or_another_node_is_changed():
    before = _twin_shapes()
    after = _renamed(before, set(), {"s2": "fresh"})
    assert _changed_ops(after, before) == ["Concat"]  # (a name the input has not)
    after = _renamed(before, set(), {})
    after.graph.node[3].attribute[0].i = 1  # (inputs renamed nowhere, an attribute changed)
    assert _changed_ops(after, before) == ["Concat"]


def test_comparisons_stop_at_a_depth_and_say_changed():
    """Two long equal chains: equal within the depth bound, 'changed' beyond it (never a guess)."""
    from rnnfuse import same_values

    def chains(length):
        nodes = []
        for k in (1, 2):
            prev = "x"
            for i in range(length):
                nodes.append(helper.make_node("Relu", [prev], [f"c{k}_{i}"]))
                prev = f"c{k}_{i}"
        nodes.append(helper.make_node("Add", [f"c1_{length - 1}", f"c2_{length - 1}"], ["y"]))
        return _model(nodes)

    short, deep = chains(same_values.MAX_DEPTH - 1), chains(same_values.MAX_DEPTH + 2)
    assert SameValues(short)._same(f"c1_{same_values.MAX_DEPTH - 2}", f"c2_{same_values.MAX_DEPTH - 2}", same_values.MAX_DEPTH)
    assert not SameValues(deep)._same(f"c1_{same_values.MAX_DEPTH + 1}", f"c2_{same_values.MAX_DEPTH + 1}", same_values.MAX_DEPTH)


@pytest.mark.parametrize("op, changed", [("LayerNormalization", []), ("Reshape", ["Reshape"])])
def test_a_cast_of_a_constant_is_read_through_only_by_ops_blind_to_contents(op, changed):
    """Cast(w, w's own type) is w, but a load that passes no contents through a Cast knew nothing of the first
    and knows the second: a Reshape reading it as its target counts as changed, a LayerNorm its scale not."""
    before = _identity_read_by(op)
    cast = before.graph.node[0]
    cast.op_type = "Cast"
    cast.attribute.append(helper.make_attribute("to", before.graph.initializer[0].data_type))
    after = _renamed(before, {"wi"}, {"wi": "w"})
    assert _changed_ops(after, before) == changed


def _reader_renamed(nodes, reads: str, renamed_to: str, initializers=(), value_info=(), opset: int = 18):
    """``nodes`` then ``Add(reads, c)`` -> y, and the same model with the Add reading ``renamed_to``."""
    c = numpy_helper.from_array(np.ones(2, np.float32), "c")
    before = _model([*nodes, helper.make_node("Add", [reads, "c"], ["y"])], [c, *initializers])
    before.graph.value_info.extend(value_info)
    before.opset_import[0].version = opset
    return _renamed(before, set(), {reads: renamed_to}), before


def test_outputs_at_one_place_of_nodes_with_other_output_counts_differ():
    """Output 0 of a 2-way Split of x and of a 3-way one: same op, attributes, input and place, other sizes."""
    nodes = [helper.make_node("Split", ["x"], ["p0", "p1"], axis=1), helper.make_node("Split", ["x"], ["q0", "q1", "q2"], axis=1)]
    after, before = _reader_renamed(nodes, "q0", "p0")
    assert _changed_ops(after, before) == ["Add"]
    after, before = _reader_renamed(nodes[:1], "p1", "p0")  # (another output of the same node)
    assert _changed_ops(after, before) == ["Add"]


def test_values_computed_alike_but_declared_otherwise_differ():
    """Two equal Reshapes by a runtime target, declared [2, 3] and [3, 2]; an Identity declared otherwise than
    the weight it copies, read by a MatMul (blind to contents, not to types)."""
    s = helper.make_tensor_value_info("s", I64, [2])
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r1"]), helper.make_node("Reshape", ["x", "s"], ["r2"])]
    declared = [helper.make_tensor_value_info("r1", F, [2, 3]), helper.make_tensor_value_info("r2", F, [3, 2])]
    after, before = _reader_renamed(nodes, "r2", "r1", value_info=declared)
    before.graph.input.append(s)
    after.graph.input.append(s)
    assert _changed_ops(after, before) == ["Add"]
    del before.graph.value_info[:]  # (neither declared: the same value)
    assert _changed_ops(after, before) == []

    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    before = _model([helper.make_node("Identity", ["w"], ["wi"]), helper.make_node("MatMul", ["x", "wi"], ["y"])], [w])
    before.graph.value_info.append(helper.make_tensor_value_info("wi", F, [4, 5]))
    after = _renamed(before, {"wi"}, {"wi": "w"})
    assert _changed_ops(after, before) == ["MatMul"]


def test_a_cast_naming_its_type_by_a_string_is_not_read_through():
    """Cast-1 names its target by a string: Cast(Cast(x, 'INT32'), 'FLOAT') is no Cast of a Cast to one type."""
    nodes = [helper.make_node("Cast", ["x"], ["ci"], to="INT32"), helper.make_node("Cast", ["ci"], ["cf"], to="FLOAT")]
    after, before = _reader_renamed(nodes, "cf", "ci", opset=5)
    assert _changed_ops(after, before) == ["Add"]


def test_other_ops_or_other_constants_differ():
    """Relu(x) is not Abs(x); equal bytes are not the same tensor under other dims or another element type."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Abs", ["x"], ["b"])]
    after, before = _reader_renamed(nodes, "b", "a")
    assert _changed_ops(after, before) == ["Add"]
    flat = numpy_helper.from_array(np.zeros(4, np.float32), "flat")
    for other in (numpy_helper.from_array(np.zeros((2, 2), np.float32), "other"),
                  numpy_helper.from_array(np.zeros(4, np.int32), "other")):
        after, before = _reader_renamed([], "other", "flat", initializers=[flat, other])
        assert _changed_ops(after, before) == ["Add"]


def test_omitted_outputs_and_inputs_are_no_values():
    """A node whose first output is omitted (an LSTM without Y) is found by its next one; a new node's omitted
    output is no value its renamed readers' omitted inputs would read."""
    w = numpy_helper.from_array(np.ones((1, 4, 4), np.float32), "W")
    before = _model([helper.make_node("LSTM", ["x", "W", "W"], ["", "h"], hidden_size=1),
                     helper.make_node("Relu", ["h"], ["y"])], [w])
    after = _renamed(before, set(), {})
    assert _changed_ops(after, before) == []

    scales = [helper.make_node("Constant", [], [f"s{k}"], value=numpy_helper.from_array(np.ones(2, np.float32), "v"))
              for k in (1, 2)]
    before = _model([*scales, helper.make_node("Resize", ["x", "", "s2"], ["y"])])
    after = _renamed(before, {"s2"}, {"s2": "s1"})
    after.graph.node.append(helper.make_node("Dropout", ["x"], ["d", ""]))  # (new: its mask omitted)
    assert _changed_ops(after, before) == ["Dropout"]
