"""Step inputs that add a projection of the model input to another sequence's step (hand-built).

A residual stack's upper cell reads ``y1_t + x_t @ P`` (GNMT): ``y1`` is the lower layer's sequence, a native
RNN's output already. The projection is preparation, not the
cell's own input product, because the cell's product reads it: the chain is fused over the stacked inputs and
the per-step projections become one over the whole sequence. Near misses: the "projection" multiplies the
state (``y1_t + (x_t @ P) * h``: no native op), or its weight is a runtime value; neither may change an
output. A head reading ``y1_t`` again beside the cell's new h (``h_t + y1_t``) keeps ``y1_t`` the step's.

The same stack in one Scan step (both cells carried; ``h1' + x_t @ P`` read by the upper cell) is two native
ops, the upper reading ``cat(Y1, x)`` (time-major or batch-first x); with ``h1' * (x_t @ P)`` it is declined.
Three cells a step, the third reading the outputs of both below and x (GNMT's deeper residual stack,
``(h2' + x_t @ P + h1') @ W3``) are three ops, the third reading ``cat(Y2, Y1, x)``; the third reading the
first cell's h before the step updates it is declined.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import rnnfuse

T, B, F, H = 5, 3, 4, 6


def _model(mix: str = "residual", head: bool = False) -> onnx.ModelProto:
    """h_t = tanh(u_t @ W + h_{t-1} @ U + b), h_0 = 0, over x [T, B, F] and y1 = a native RNN over x, [T, B, H];
    outputs the stacked
    h_t (``head``: h_t + y1_t). ``mix``: "residual" u_t = y1_t + x_t @ P; "state" u_t = y1_t + (x_t @ P) * h_{t-1};
    "runtime" u_t = y1_t + x_t @ Pr, Pr a model input."""
    rng = np.random.default_rng(3)
    inits = [nh.from_array((rng.standard_normal((F, H)) * 0.5).astype(np.float32), "P"),
             nh.from_array((rng.standard_normal((H, H)) * 0.4).astype(np.float32), "W"),
             nh.from_array((rng.standard_normal((H, H)) * 0.4).astype(np.float32), "U"),
             nh.from_array((rng.standard_normal(H) * 0.1).astype(np.float32), "b"),
             nh.from_array((rng.standard_normal((1, H, F)) * 0.5).astype(np.float32), "W1"),
             nh.from_array((rng.standard_normal((1, H, H)) * 0.4).astype(np.float32), "R1"),
             nh.from_array(np.zeros((1, H), np.float32), "zrow"), nh.from_array(np.array([B, H], np.int64), "bh"),
             nh.from_array(np.array([1], np.int64), "ax1")]
    inits += [nh.from_array(np.array(t, np.int64), f"idx{t}") for t in range(T)]
    nodes = [oh.make_node("Expand", ["zrow", "bh"], ["h_init"]),
             oh.make_node("RNN", ["x", "W1", "R1"], ["Y1"], hidden_size=H),
             oh.make_node("Squeeze", ["Y1", "ax1"], ["y1"])]
    h, outs = "h_init", []
    for t in range(T):
        nodes += [oh.make_node("Gather", ["x", f"idx{t}"], [f"x{t}"], axis=0),
                  oh.make_node("Gather", ["y1", f"idx{t}"], [f"ys{t}"], axis=0),
                  oh.make_node("MatMul", [f"x{t}", "Pr" if mix == "runtime" else "P"], [f"p{t}"])]
        proj = f"p{t}"
        if mix == "state":
            nodes.append(oh.make_node("Mul", [f"p{t}", h], [f"ph{t}"]))
            proj = f"ph{t}"
        nodes += [oh.make_node("Add", [f"ys{t}", proj], [f"u{t}"]),
                  oh.make_node("MatMul", [f"u{t}", "W"], [f"wu{t}"]),
                  oh.make_node("MatMul", [h, "U"], [f"uh{t}"]),
                  oh.make_node("Add", [f"wu{t}", f"uh{t}"], [f"s{t}"]),
                  oh.make_node("Add", [f"s{t}", "b"], [f"pre{t}"]),
                  oh.make_node("Tanh", [f"pre{t}"], [f"h{t}"])]
        h = f"h{t}"
        out = h
        if head:
            nodes.append(oh.make_node("Add", [h, f"ys{t}"], [f"o{t}"]))
            out = f"o{t}"
        nodes.append(oh.make_node("Unsqueeze", [out, "ax0"], [f"ou{t}"]))
        outs.append(f"ou{t}")
    inits.append(nh.from_array(np.array([0], np.int64), "ax0"))
    nodes.append(oh.make_node("Concat", outs, ["out"], axis=0))
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, F])]
    if mix == "runtime":
        inputs.append(oh.make_tensor_value_info("Pr", TensorProto.FLOAT, [F, H]))
    graph = oh.make_graph(nodes, "residual", inputs, [oh.make_tensor_value_info("out", TensorProto.FLOAT, [T, B, H])],
                          inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def _feeds(model: onnx.ModelProto, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("head", [False, True])
def test_residual_projection_fused_once_over_the_sequence(head):
    model = _model("residual", head=head)
    fused, report = rnnfuse.optimize(model)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("RNN") == 2 and not report.declined, report.to_text()
    # (the five per-step projections and sums, one over the whole sequence once fused)
    assert ops.count("MatMul") + ops.count("Gemm") == 1 and "Tanh" not in ops, ops
    for seed in range(3):
        feeds = _feeds(model, seed)
        np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


@pytest.mark.parametrize("mix", ["state", "runtime"])
def test_projection_of_the_state_or_by_a_runtime_weight_changes_nothing(mix):
    model = _model(mix)
    fused, report = rnnfuse.optimize(model)
    ops = [n.op_type for n in fused.graph.node]
    if mix == "state":  # (no native op reads its input multiplied by its state)
        assert ops.count("RNN") == 1, report.to_text()
        assert fused.SerializeToString() == model.SerializeToString()
    for seed in range(3):
        feeds = _feeds(model, seed)
        np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


def _scan_model(combine: str = "Add", batch_first: bool = False) -> onnx.ModelProto:
    """A Scan stepping h1' = tanh(x_t @ W1 + h1 @ U1) and h2' = tanh((h1' <combine> x_t @ P) @ W2 + h2 @ U2 + b2),
    both from zeros; outputs the stacked h2'."""
    rng = np.random.default_rng(5)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    inits = [nh.from_array(a, n) for a, n in [(w(F, H), "W1"), (w(H, H), "U1"), (w(F, H), "P"), (w(H, H), "W2"),
                                              (w(H, H), "U2"), (w(H), "b2"), (np.zeros((B, H), np.float32), "z")]]
    body = oh.make_graph([
        oh.make_node("MatMul", ["xt", "W1"], ["a"]), oh.make_node("MatMul", ["h1", "U1"], ["b"]),
        oh.make_node("Add", ["a", "b"], ["s"]), oh.make_node("Tanh", ["s"], ["h1n"]),
        oh.make_node("MatMul", ["xt", "P"], ["px"]), oh.make_node(combine, ["h1n", "px"], ["u"]),
        oh.make_node("MatMul", ["u", "W2"], ["c"]), oh.make_node("MatMul", ["h2", "U2"], ["d"]),
        oh.make_node("Add", ["c", "d"], ["e"]), oh.make_node("Add", ["e", "b2"], ["f"]),
        oh.make_node("Tanh", ["f"], ["h2n"]), oh.make_node("Identity", ["h2n"], ["y"])], "body",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("h1", "h2")]
        + [oh.make_tensor_value_info("xt", TensorProto.FLOAT, [B, F])],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("h1n", "h2n", "y")])
    return _scan_over_x(body, 2, inits, batch_first)


def _scan_over_x(body: onnx.GraphProto, states: int, inits: list, batch_first: bool) -> onnx.ModelProto:
    """A model running ``body`` as a Scan over x ([T, B, F], or [B, T, F]), its ``states`` carried values all
    starting from the initializer ``z``; outputs the stacked last body output."""
    axis = 1 if batch_first else 0
    scan = oh.make_node("Scan", ["z"] * states + ["x"], [f"S{k}" for k in range(states)] + ["Y"], body=body,
                        num_scan_inputs=1, scan_input_axes=[axis], scan_output_axes=[axis])
    graph = oh.make_graph([scan], "residual_scan",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, F] if batch_first else [T, B, F])],
                          [oh.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("batch_first", [False, True])
def test_residual_stack_in_one_scan_step_is_two_ops(batch_first):
    model = _scan_model(batch_first=batch_first)
    fused, report = rnnfuse.optimize(model)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("RNN") == 2 and "Scan" not in ops and "MatMul" not in ops, report.to_text()
    for seed in range(3):
        feeds = _feeds(model, seed)
        np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


def test_residual_product_in_a_scan_step_declined():
    model = _scan_model(combine="Mul")
    fused, report = rnnfuse.optimize(model)
    assert report.declined and not report.fused, report.to_text()
    assert "left operand is not a step input or state" in report.declined[0].reason
    assert fused.SerializeToString() == model.SerializeToString()


def _gnmt_scan_model(old_h1: bool = False, batch_first: bool = False) -> onnx.ModelProto:
    """A Scan stepping h1' = tanh(x_t @ W1 + h1 @ U1), h2' = tanh(h1' @ W2 + h2 @ U2) and
    h3' = tanh((h2' + x_t @ P + h1') @ W3 + h3 @ U3 + b3) from zeros (``old_h1``: h1 in place of h1');
    outputs the stacked h3'."""
    rng = np.random.default_rng(7)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    inits = [nh.from_array(a, n) for a, n in [(w(F, H), "W1"), (w(H, H), "U1"), (w(H, H), "W2"), (w(H, H), "U2"),
                                              (w(F, H), "P"), (w(H, H), "W3"), (w(H, H), "U3"), (w(H), "b3"),
                                              (np.zeros((B, H), np.float32), "z")]]
    body = oh.make_graph([
        oh.make_node("MatMul", ["xt", "W1"], ["a1"]), oh.make_node("MatMul", ["h1", "U1"], ["b1"]),
        oh.make_node("Add", ["a1", "b1"], ["s1"]), oh.make_node("Tanh", ["s1"], ["h1n"]),
        oh.make_node("MatMul", ["h1n", "W2"], ["a2"]), oh.make_node("MatMul", ["h2", "U2"], ["b2"]),
        oh.make_node("Add", ["b2", "a2"], ["s2"]), oh.make_node("Tanh", ["s2"], ["h2n"]),
        oh.make_node("MatMul", ["xt", "P"], ["px"]), oh.make_node("Add", ["h2n", "px"], ["u0"]),
        oh.make_node("Add", ["u0", "h1" if old_h1 else "h1n"], ["u"]),
        oh.make_node("MatMul", ["u", "W3"], ["a3"]), oh.make_node("MatMul", ["h3", "U3"], ["b3n"]),
        oh.make_node("Add", ["a3", "b3n"], ["e"]), oh.make_node("Add", ["e", "b3"], ["f"]),
        oh.make_node("Tanh", ["f"], ["h3n"]), oh.make_node("Identity", ["h3n"], ["y"])], "body",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("h1", "h2", "h3")]
        + [oh.make_tensor_value_info("xt", TensorProto.FLOAT, [B, F])],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("h1n", "h2n", "h3n", "y")])
    return _scan_over_x(body, 3, inits, batch_first)


@pytest.mark.parametrize("batch_first", [False, True])
def test_cell_reading_two_cells_below_and_x_is_one_op_over_their_ys_and_x(batch_first):
    model = _gnmt_scan_model(batch_first=batch_first)
    fused, report = rnnfuse.optimize(model)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("RNN") == 3 and "Scan" not in ops and "MatMul" not in ops, report.to_text()
    top = [n for n in fused.graph.node if n.op_type == "RNN"][-1]
    weights = {t.name: t for t in fused.graph.initializer}
    assert nh.to_array(weights[top.input[1]]).shape == (1, H, H + H + F)  # (the input weight over Y2, Y1, x)
    for seed in range(3):
        feeds = _feeds(model, seed)
        np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


def test_cell_reading_the_state_of_a_cell_below_before_its_update_declined():
    model = _gnmt_scan_model(old_h1=True)
    fused, report = rnnfuse.optimize(model)
    assert report.declined and not report.fused, report.to_text()
    assert "reads the states" in report.declined[0].reason, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()
