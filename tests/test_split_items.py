"""Items of a ``SplitToSequence`` list taken at a constant position (passes/cleanup.py: DropNoOps) become the
``Slice`` or ``Gather`` they are, computing what onnxruntime computes for the original; forms where the standard
and onnxruntime disagree, or the position is not a constant, are left as they are.

torch's dynamo exporter without its optimizer writes each step's gate chunks so (tests/test_torch.py's
``*_dynamo_unoptimized`` cases fuse through this); the other spellings here are the ones the op allows."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.findings import Options
from rnnfuse.model import Model
from rnnfuse.passes.cleanup import DropNoOps

from helpers import after_pass, run_model


def _model(split, keepdims: int | None, positions, axis: int = 1, extent=7, position_input: bool = False):
    """x [2, extent, 3] cut along ``axis`` (``split``: None, a scalar or a list), items at ``positions`` read
    (each an output ``y<k>``); ``position_input``: the first position is a graph input, not a constant."""
    inits, ins = [], ["x"]
    if split is not None:
        inits.append(numpy_helper.from_array(np.array(split, np.int64), "split"))
        ins.append("split")
    attrs = {"axis": axis} if keepdims is None else {"axis": axis, "keepdims": keepdims}
    nodes = [helper.make_node("SplitToSequence", ins, ["seq"], **attrs)]
    outputs = []
    for k, pos in enumerate(positions):
        name = f"pos{k}"
        if not (position_input and k == 0):
            inits.append(numpy_helper.from_array(np.array(pos, np.int64), name))
        nodes.append(helper.make_node("SequenceAt", ["seq", name], [f"y{k}"]))
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, extent, 3])]
    if position_input:
        inputs.append(helper.make_tensor_value_info("pos0", TensorProto.INT64, []))
    graph = helper.make_graph(nodes, "split_items", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    return run_model(model, feeds)


def _rewritten(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    return after_pass(DropNoOps(), proto)


@pytest.mark.parametrize("split,keepdims,positions,axis,op", [
    (3, None, [0, 1, 2], 1, "Slice"),  # chunks of 3 of 7: the last one shorter
    (2, 1, [0, 3], -2, "Slice"),
    ([2, 5], None, [0, 1, -1, -2], 1, "Slice"),
    ([2, 5], 0, [1, -2], 1, "Slice"),  # (a list of sizes: keepdims ignored, by onnxruntime too)
    ([1, 1, 1], None, [0, 2], 2, "Slice"),
    (None, 1, [0, 3, -1, -7], 1, "Slice"),  # chunks of one, kept
    (None, 0, [0, 6, -1, -4], 1, "Gather"),  # chunks of one, squeezed
    (None, None, [1, -2], 0, "Slice"),
])
def test_items_at_constant_positions_become_slices(split, keepdims, positions, axis, op):
    proto = _model(split, keepdims, positions, axis)
    x = np.random.default_rng(0).standard_normal((2, 7, 3)).astype(np.float32)
    expected = _run(proto, {"x": x})
    after, ops = _rewritten(proto)
    assert "SequenceAt" not in ops and "SplitToSequence" not in ops, ops
    assert ops.count(op) == len(positions), ops
    for want, got in zip(expected, _run(after, {"x": x})):
        assert want.shape == got.shape
        np.testing.assert_array_equal(want, got)


@pytest.mark.parametrize("form", ["scalar_split_squeezed", "position_input", "past_the_end", "chunk_from_the_end",
                                  "sizes_not_the_extent"])
def test_near_misses_are_left_as_they_are(form):
    """A scalar split with keepdims=0 (the standard ignores keepdims there, onnxruntime squeezes: no rewrite
    matches both), a position that is an input, a position past the last item or sizes that do not add up to
    the axis (the original fails there), and a position from the end of a scalar split (the chunks' count
    takes the axis' length, which a declaration may state wrongly): not rewritten."""
    proto = {
        "scalar_split_squeezed": lambda: _model(1, 0, [2]),
        "position_input": lambda: _model(3, None, [1], position_input=True),
        "past_the_end": lambda: _model(3, None, [3]),
        "chunk_from_the_end": lambda: _model(3, None, [-1]),
        "sizes_not_the_extent": lambda: _model([2, 4], None, [0]),
    }[form]()
    _, ops = _rewritten(proto)
    assert ops.count("SequenceAt") == 1 and "SplitToSequence" in ops, ops


def test_positions_share_their_constants():
    """Every step of an unrolled chain reads its chunks at the same positions: one initializer per distinct
    position vector, not one per item."""
    proto = _model([4, 3], None, [0, 1, 0, 1, -1])
    after, _ = _rewritten(proto)
    added = [t for t in after.graph.initializer if t.name.startswith("rnnfuse/position")]
    values = {tuple(numpy_helper.to_array(t).tolist()) for t in added}
    assert len(added) == len(values) == 4, [numpy_helper.to_array(t).tolist() for t in added]  # [0] [4] [7] [1]


def test_items_rewritten_are_found_by_op_type():
    """The passes after DropNoOps in the round look nodes up by op type: the items rewritten in place are
    Slices there (in node order), no longer SequenceAts (a step of x read so was no step: nothing fused)."""
    model = Model(_model(3, None, [2, 0, 1]))
    DropNoOps().run(model, Options())
    g = model.graph
    slices = g.nodes_of("Slice")
    assert not g.nodes_of("SequenceAt") and [n.output[0] for n in slices] == ["y0", "y1", "y2"]
    assert [n.op_type for n in g.nodes_of("Slice", "SplitToSequence")] == ["SplitToSequence", "Slice", "Slice", "Slice"]


def _cast_like_model(target_op: str):
    """``y = x * CastLike(half, t)``, ``t = target_op(x)``: the constant cast like a value computed from x."""
    domain = "" if target_op == "Tanh" else "custom.domain"
    nodes = [helper.make_node(target_op, ["x"], ["t"], domain=domain),
             helper.make_node("CastLike", ["half", "t"], ["h"]), helper.make_node("Mul", ["x", "h"], ["y"])]
    graph = helper.make_graph(nodes, "cast_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.array(0.5, np.float64), "half")])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_cast_like_of_a_fixed_type_is_a_cast():
    """CastLike(c, t) with t's element type fixed by its op is Cast(c, to=that type): t is no longer read
    (its values do not matter); the same outputs. A target typed by an op rnnfuse has no rule for (another
    domain's) keeps the CastLike."""
    proto = _cast_like_model("Tanh")
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    expected = _run(proto, {"x": x})
    after, ops = _rewritten(proto)
    cast = next(n for n in after.graph.node if n.op_type == "Cast")
    assert "CastLike" not in ops and list(cast.input) == ["half"], ops
    assert helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT
    np.testing.assert_array_equal(expected[0], _run(after, {"x": x})[0])
    _, ops = _rewritten(_cast_like_model("Mystery"))
    assert "CastLike" in ops and "Cast" not in ops, ops


@pytest.mark.parametrize("ends,steps,read_through", [([2**63 - 1, 2**63 - 1], [1, 1], True),
                                                     ([2**31 - 1, 2**63 - 1], None, True),
                                                     ([2**63 - 1, 5], [1, 1], False),  # (an end inside: a cut)
                                                     ([2**63 - 1, 2**63 - 1], [1, 2], False)])
def test_slices_of_whole_axes_are_read_through(ends, steps, read_through):
    """``x[:, ...]`` written as a Slice from 0 to an end past any extent, step 1, is x; a Slice that ends
    inside an axis, or steps over it, is not."""
    ins = ["x", "starts", "ends", "axes"] + (["steps"] if steps else [])
    inits = [numpy_helper.from_array(np.array(v, np.int64), k)
             for k, v in (("starts", [0, 0]), ("ends", ends), ("axes", [0, 2]), ("steps", steps)) if v is not None]
    nodes = [helper.make_node("Slice", ins, ["s"]), helper.make_node("Tanh", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "whole", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 7, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(2).standard_normal((3, 7, 6)).astype(np.float32)
    expected = _run(proto, {"x": x})[0]
    after, ops = _rewritten(proto)
    assert ("Slice" not in ops) == read_through, ops
    np.testing.assert_array_equal(expected, _run(after, {"x": x})[0])
