"""No-ops torch's dynamo exporter writes without its optimizer (passes/cleanup.py: DropNoOps), read through
only where they are exact, each checked against onnxruntime on the original:

* a ``ScatterND`` writing every row of its data once, in order (indices ``Unsqueeze(Range(0, n, 1), -1)``, n
  the data's first extent): its result is its updates (``outs[:, t] = h`` writes the whole of ``outs``);
* a ``Cast`` to the element type its input has by the ops that compute it, from a graph input, a weight or
  an op that fixes it (a value_info is never trusted: an earlier tool may have left it stale).

And one thing the step-chains pass now sees: native ops over consecutive stretches whose weights are equal
values under different names (dynamo computes each call's gate-reordered weights anew, slicing them at
``Shape(state, start=2, end=3)``) merge into one op."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from rnnfuse.passes.cleanup import DropNoOps

from helpers import after_pass, run_model

F = TensorProto.FLOAT


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    return run_model(model, feeds)


def _rewritten(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    return after_pass(DropNoOps(), proto)


def _scatter_model(form: str) -> onnx.ModelProto:
    """``y = ScatterND(d, idx, u)`` with d = x * 2 [N, 3] (N dynamic) and u = x + 1, idx built per ``form``;
    y is read by a Tanh (``form`` ending in ``_output``: y is the graph output itself)."""
    i64 = lambda v, n: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    inits = [i64(0, "zero"), i64(1, "one"), i64([-1], "last"), i64([0], "first"),
             numpy_helper.from_array(np.float32(2.0).reshape(()), "f2"),
             numpy_helper.from_array(np.float32(1.0).reshape(()), "f1")]
    nodes = [helper.make_node("Mul", ["x", "f2"], ["d"]), helper.make_node("Add", ["x", "f1"], ["u"]),
             helper.make_node("Shape", ["d"], ["ds"]), helper.make_node("Gather", ["ds", "zero"], ["n"], axis=0)]
    start, limit, reduction = "zero", "n", "none"
    if form == "other_tensor":  # (the extent of another tensor: the same length only when they agree)
        nodes += [helper.make_node("Shape", ["w"], ["ws"]), helper.make_node("Gather", ["ws", "zero"], ["n2"], axis=0)]
        limit = "n2"
    if form == "from_one":
        start = "one"
    if form == "one_short":
        nodes.append(helper.make_node("Sub", ["n", "one"], ["n1"]))
        limit = "n1"
    if form == "reduced":
        reduction = "add"
    nodes.append(helper.make_node("Range", [start, limit, "one"], ["r"]))
    nodes.append(helper.make_node("Unsqueeze", ["r", "last"], ["idx"]))
    u = "u"
    if form in ("from_one", "one_short"):  # (the update has the rows the indices write)
        bounds = ("one", "n") if form == "from_one" else ("zero", "n1")
        for b in bounds:
            nodes.append(helper.make_node("Unsqueeze", [b, "first"], [f"{b}_1d"]))
        nodes.append(helper.make_node("Slice", ["u", f"{bounds[0]}_1d", f"{bounds[1]}_1d", "first"], ["us"]))
        u = "us"
    out = "y" if form.endswith("_output") else "s"
    nodes.append(helper.make_node("ScatterND", ["d", "idx", u], [out],
                                  **({"reduction": reduction} if reduction != "none" else {})))
    if out == "s":
        nodes.append(helper.make_node("Tanh", ["s"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", F, ["N", 3])]
    if form == "other_tensor":
        inputs.append(helper.make_tensor_value_info("w", F, ["M", 3]))
    graph = helper.make_graph(nodes, "whole_write", inputs, [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("form,read_through", [
    ("every_row", True),
    ("every_row_output", True),  # (the graph output keeps its name: an Identity of the updates)
    ("other_tensor", False),
    ("from_one", False),
    ("one_short", False),
    ("reduced", False),
])
def test_scatters_writing_every_row_are_their_updates(form, read_through):
    proto = _scatter_model(form)
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    feeds = {"x": x, "w": np.zeros((5, 3), np.float32)} if form == "other_tensor" else {"x": x}
    expected = _run(proto, feeds)
    after, ops = _rewritten(proto)
    assert ("ScatterND" not in ops) == read_through, ops
    for want, got in zip(expected, _run(after, feeds)):
        np.testing.assert_array_equal(want, got)
    if read_through and form == "every_row_output":
        assert [o.name for o in after.graph.output] == ["y"]


def _cast_model(declared: int | None, source: str) -> onnx.ModelProto:
    """``y = Tanh(Cast(v, to=FLOAT))``, v computed from ``source``: a float input through Mul and Sigmoid, an
    int input through Mul (declared ``declared`` by a value_info, stale when it says float)."""
    if source == "float":
        inputs = [helper.make_tensor_value_info("x", F, [2, 3])]
        nodes = [helper.make_node("Mul", ["x", "x"], ["m"]), helper.make_node("Sigmoid", ["m"], ["v"])]
    else:
        inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])]
        nodes = [helper.make_node("Mul", ["x", "x"], ["v"])]
    nodes += [helper.make_node("Cast", ["v"], ["c"], to=F), helper.make_node("Tanh", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "casts", inputs, [helper.make_tensor_value_info("y", F, None)])
    if declared is not None:
        graph.value_info.append(helper.make_tensor_value_info("v", declared, [2, 3]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("source,declared,dropped", [
    ("float", None, True),  # the ops say float: a float input, Mul, Sigmoid
    ("float", F, True),
    ("int", F, False),  # a stale declaration: the ops say int64, the Cast is real (onnxruntime refuses v's)
    ("int", None, False),
])
def test_casts_to_the_type_the_ops_give_are_read_through(source, declared, dropped):
    proto = _cast_model(declared, source)
    after, ops = _rewritten(proto)
    assert ("Cast" not in ops) == dropped, ops
    if source == "int" and declared == F:
        return  # (a model no runtime loads as it is: the point is that the Cast stays)
    if source == "float":
        x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    else:
        x = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.testing.assert_array_equal(_run(proto, {"x": x})[0], _run(after, {"x": x})[0])


def _stretch_model(shared_weights: bool, hidden: int = 4, features: int = 3, calls: int = 3,
                   viewed: bool = False, stretch: int = 1, stacked_in_order: bool = True,
                   weights_read_elsewhere: bool = False, batch_first: bool = False) -> onnx.ModelProto:
    """``calls`` native GRUs over ``stretch`` steps of x each, the state carried by hand; each call's W is
    ``Slice(Wfull, 0, Shape(state, start=2, end=3) * 3)`` of its own initial state (dynamo's per-call
    weights: equal values, one name each); ``shared_weights=False``: the last call reads other weights.
    ``viewed``: each call's Y ([stretch, 1, B, H]) is stacked as dynamo without its optimizer hands it on,
    transposed to [stretch, B, 1, H] and reshaped to [stretch, B, H] by a shape computed from its own;
    ``stacked_in_order=False``: the views concatenated last call first. ``weights_read_elsewhere``: the full
    weight is read by one more node, whose sum is a graph output. ``batch_first``: each view then transposed to
    ``[B, stretch, H]`` and the views concatenated on axis 1 (a batch-first layer's ``torch.cat(ys, 1)``)."""
    rng = np.random.default_rng(3)
    i64 = lambda v, n: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    inits = [numpy_helper.from_array(rng.standard_normal((1, 3 * hidden + 5, features)).astype(np.float32), "Wfull"),
             numpy_helper.from_array(rng.standard_normal((1, 3 * hidden, hidden)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.standard_normal((1, 3 * hidden, features)).astype(np.float32), "W_other"),
             i64([0], "zero"), i64([1], "one"), i64([2], "two"), i64([3], "three"), i64([4], "four")]
    nodes, h = [], "h0"
    for k in range(calls):
        nodes += [helper.make_node("Slice", ["x", i64_name(k * stretch, inits), i64_name((k + 1) * stretch, inits),
                                             "zero"], [f"x{k}"]),
                  helper.make_node("Shape", [h], [f"hs{k}"], start=2, end=3),
                  helper.make_node("Mul", [f"hs{k}", "three"], [f"rows{k}"]),
                  helper.make_node("Slice", ["Wfull", "zero", f"rows{k}", "one"], [f"W{k}"])]
        w = "W_other" if (not shared_weights and k == calls - 1) else f"W{k}"
        nodes.append(helper.make_node("GRU", [f"x{k}", w, "R", "", "", h], [f"y{k}", f"h{k + 1}"], hidden_size=hidden))
        h = f"h{k + 1}"
        if viewed:
            nodes += [helper.make_node("Transpose", [f"y{k}"], [f"t{k}"], perm=[0, 2, 1, 3]),
                      helper.make_node("Shape", [f"t{k}"], [f"ts{k}"]),
                      helper.make_node("Slice", [f"ts{k}", "zero", "one"], [f"d0_{k}"]),
                      helper.make_node("Slice", [f"ts{k}", "one", "two"], [f"d1_{k}"]),
                      helper.make_node("Slice", [f"ts{k}", "two", "three"], [f"d2_{k}"]),
                      helper.make_node("Slice", [f"ts{k}", "three", "four"], [f"d3_{k}"]),
                      helper.make_node("Mul", [f"d2_{k}", f"d3_{k}"], [f"w{k}"]),
                      helper.make_node("Concat", [f"d0_{k}", f"d1_{k}", f"w{k}"], [f"shape{k}"], axis=0),
                      helper.make_node("Reshape", [f"t{k}", f"shape{k}"], [f"v{k}" if not batch_first else f"r{k}"])]
            if batch_first:
                nodes.append(helper.make_node("Transpose", [f"r{k}"], [f"v{k}"], perm=[1, 0, 2]))
    parts = [f"v{k}" if viewed else f"y{k}" for k in range(calls)][::1 if stacked_in_order else -1]
    nodes.append(helper.make_node("Concat", parts, ["ys"], axis=1 if batch_first else 0))
    outputs = [helper.make_tensor_value_info("ys", F, None), helper.make_tensor_value_info(h, F, None)]
    if weights_read_elsewhere:
        nodes.append(helper.make_node("ReduceSum", ["Wfull"], ["wsum"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("wsum", F, None))
    graph = helper.make_graph(
        nodes, "stretches", [helper.make_tensor_value_info("x", F, [calls * stretch, "B", features]),
                             helper.make_tensor_value_info("h0", F, [1, "B", hidden])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def i64_name(v: int, inits: list) -> str:
    """The name of an int64 [v] initializer (added once)."""
    name = f"at{v}"
    if all(t.name != name for t in inits):
        inits.append(numpy_helper.from_array(np.array([v], np.int64), name))
    return name


@pytest.mark.parametrize("shared_weights", [True, False])
def test_stretches_with_equal_weights_under_several_names_merge(shared_weights):
    proto = _stretch_model(shared_weights)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((3, 2, 3)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, 4)).astype(np.float32)}
    expected = _run(proto, feeds)
    fused, report = rnnfuse.optimize(proto)
    grus = [n for n in fused.graph.node if n.op_type == "GRU"]
    # (the last call's other weights: the first two still merge, the third stays its own op)
    assert len(grus) == (1 if shared_weights else 2), report.to_text()
    for want, got in zip(expected, _run(fused, feeds)):
        np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_the_merged_op_reads_its_weights_folded_where_that_moves_them(read_elsewhere):
    """The merged op's W, computed per call (a Slice of the full weight at the state's shape), is an
    initializer of its value: the per-call computations and the full weight go. Not where another node reads
    the full weight: folding would keep both, so the first call's computation stays."""
    hidden = 32  # (the full weight 101 x 3 floats: over the 1 KB below which a weight counts as moved for free)
    proto = _stretch_model(True, hidden=hidden, weights_read_elsewhere=read_elsewhere)
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 2, 3)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, hidden)).astype(np.float32)}
    expected = _run(proto, feeds)
    fused, report = rnnfuse.optimize(proto)
    grus = [n for n in fused.graph.node if n.op_type == "GRU"]
    assert len(grus) == 1, report.to_text()
    inits = {t.name: t for t in fused.graph.initializer}
    ops = [n.op_type for n in fused.graph.node]
    if read_elsewhere:
        assert grus[0].input[1] not in inits and "Wfull" in inits
        assert ops.count("Slice") >= 2  # (the first call's computation of W beside the cut of x)
    else:
        assert grus[0].input[1] in inits and "Wfull" not in inits
        assert "Shape" not in ops and "Mul" not in ops, ops
        w = onnx.numpy_helper.to_array(inits[grus[0].input[1]])
        full = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == "Wfull"))
        np.testing.assert_array_equal(w, full[:, :3 * hidden])
    for want, got in zip(expected, _run(fused, feeds)):
        np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stretch,in_order,merged", [(1, True, True), (2, True, True), (1, False, True),
                                                     (2, False, False)])
@pytest.mark.parametrize("batch_first", [False, True])
def test_stacked_viewed_steps_of_merged_calls_are_the_sequence(stretch, in_order, merged, batch_first):
    """Each call's Y viewed as [steps, B, H] (Transpose, then Reshape to a shape computed from its own) and
    the views concatenated on time: once the calls merge, that Concat is the merged op's Y, direction axis
    squeezed (passes/step_maps.py), and the per-call views are gone. One-step views last call first are Y
    reversed; stretches of two last first are no slice of Y, and stay. Batch-first views ([B, steps, H],
    concatenated on axis 1) are the same stretch transposed once."""
    proto = _stretch_model(True, calls=5, viewed=True, stretch=stretch, stacked_in_order=in_order,
                           batch_first=batch_first)
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((5 * stretch, 2, 3)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, 4)).astype(np.float32)}
    expected = _run(proto, feeds)
    fused, report = rnnfuse.optimize(proto)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GRU") == 1, report.to_text()
    assert ("Reshape" not in ops and ops.count("Transpose") == int(batch_first)) == merged, (ops, report.to_text())
    for want, got in zip(expected, _run(fused, feeds)):
        np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-6)


def test_batch_first_views_concatenated_on_the_batch_stay():
    """The batch-first views concatenated on axis 0 put each call's steps below the other's rows: no stretch
    of Y, never tried as one (not left to validation to refuse), so the Concat and the views stay (the calls
    still merge)."""
    proto = _stretch_model(True, calls=5, viewed=True, batch_first=True)
    cat = next(n for n in proto.graph.node if n.op_type == "Concat" and n.output[0] == "ys")
    next(a for a in cat.attribute if a.name == "axis").i = 0
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((5, 2, 3)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, 4)).astype(np.float32)}
    expected = _run(proto, feeds)
    fused, report = rnnfuse.optimize(proto)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GRU") == 1 and ops.count("Reshape") == 5, (ops, report.to_text())
    assert not [f for f in report.findings if f.pass_name == "step-maps"], report.to_text()
    for want, got in zip(expected, _run(fused, feeds)):
        np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-6)
