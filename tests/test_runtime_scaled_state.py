"""An unrolled cell whose state is scaled elementwise by a model input, ``h = relu(x_t @ W + u * h)`` with ``u``
fed at run time (IndRNN's recurrent vector as an input, not a weight): no native op reads a runtime weight, so
the chain is declined with a reason and the model comes back as it went in. (rnnfuse once took ``u``, read by
every step beside h, for an LSTM's cell state and stopped with a KeyError.) With ``u`` a constant the same chain
is an RNN whose R is ``diag(u)``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse

T, B, F, H = 4, 2, 3, 5


def _chain(u_is_input: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((F, H)) * 0.5).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros((B, H), np.float32), "hinit")]
    if not u_is_input:
        inits.append(numpy_helper.from_array(rng.uniform(-0.9, 0.9, H).astype(np.float32), "u"))
    nodes, h = [], "hinit"
    for t in range(T):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"i{t}"))
        nodes += [helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0),
                  helper.make_node("MatMul", [f"x{t}", "W"], [f"a{t}"]),
                  helper.make_node("Mul", ["u", h], [f"s{t}"]),
                  helper.make_node("Add", [f"a{t}", f"s{t}"], [f"p{t}"]),
                  helper.make_node("Relu", [f"p{t}"], [f"h{t}"]),
                  helper.make_node("Unsqueeze", [f"h{t}", "ax0"], [f"y{t}"])]
        h = f"h{t}"
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "ax0"))
    nodes.append(helper.make_node("Concat", [f"y{t}" for t in range(T)], ["Y"], axis=0))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, F])]
    if u_is_input:
        inputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, [H]))
    graph = helper.make_graph(nodes, "scaled_state", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [T, B, H])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("u_is_input", [True, False])
def test_state_scaled_by_a_model_input_is_declined_by_a_constant_fused(u_is_input):
    model = _chain(u_is_input)
    fused, report = rnnfuse.optimize(model)
    ops = [n.op_type for n in fused.graph.node]
    if u_is_input:
        assert report.declined and not report.fused, report.to_text()
        assert "'u'" in report.declined[0].reason, report.to_text()
        assert fused.SerializeToString() == model.SerializeToString()
    else:
        assert ops.count("RNN") == 1 and not report.declined, report.to_text()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((T, B, F)).astype(np.float32)}
    if u_is_input:
        feeds["u"] = rng.uniform(-0.9, 0.9, H).astype(np.float32)
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
           for m in (model, fused)]
    np.testing.assert_allclose(run[1], run[0], atol=1e-5)
