"""Two unrolled chains reading values the exporter computed once for both (hand-built).

One cell run forward and backward over x from one given h0: a tracer's CSE (or rnnfuse's own dedupe)
computes each step's ``x_t @ W`` once, and ``h0 @ R`` once, for both chains. Such a value depends only on
what the chains are given, so it stays computed for the other reader when one chain is fused: both fuse and
merge into one bidirectional op. A value computed from a state (or from x_t and a state together) read
outside a chain is still declined.
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

T, F, H = 4, 3, 5


def _model(share_x: bool = True, share_h0: bool = True, leak: tuple[int, int] | None = None) -> onnx.ModelProto:
    """Forward and backward tanh-RNN chains over x [T, B, F] from the input h0, outputs concatenated on
    features. ``share_x``: one W for both (each x_t @ W computed once); ``share_h0``: one R for both (h0 @ R
    computed once, for both first steps); ``leak``: (chain, step) whose pre-activation is also a graph output."""
    rng = np.random.default_rng(0)
    weights = {f"{n}{k}": rng.standard_normal(shape).astype(np.float32) * 0.5
               for k in range(2) for n, shape in (("W", (F, H)), ("R", (H, H)))}
    inits = [nh.from_array(a, n) for n, a in weights.items()]
    inits += [nh.from_array(np.array(v, np.int64), f"i{v}") for v in range(T)]
    nodes, made, extra = [], {}, []

    def node(op: str, ins: list[str], **attrs) -> str:
        key = (op, tuple(ins), tuple(sorted(attrs.items())))  # (one node for one computation: as CSE leaves it)
        if key not in made:
            made[key] = f"v{len(nodes)}"
            nodes.append(oh.make_node(op, ins, [made[key]], **attrs))
        return made[key]

    xs = [node("Gather", ["x", f"i{t}"], axis=0) for t in range(T)]
    halves = []
    for k, order in enumerate((range(T), range(T - 1, -1, -1))):
        h, ys = "h0", {}
        for step, t in enumerate(order):
            w = "W0" if share_x else f"W{k}"
            r = "R0" if share_h0 else f"R{k}"
            pre = node("Add", [node("MatMul", [xs[t], w]), node("MatMul", [h, r])])
            if leak == (k, step):
                extra.append(oh.make_node("Identity", [pre], ["leak"]))
            h = node("Tanh", [pre])
            ys[t] = node("Unsqueeze", [h, "i0"])
        halves.append(node("Concat", [ys[t] for t in range(T)], axis=0))
    nodes.append(oh.make_node("Concat", halves, ["y"], axis=2))
    outputs = [oh.make_tensor_value_info("y", TensorProto.FLOAT, [T, "B", 2 * H])]
    if extra:
        nodes += extra
        outputs.append(oh.make_tensor_value_info("leak", TensorProto.FLOAT, ["B", H]))
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F]),
              oh.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", H])]
    graph = oh.make_graph(nodes, "two_chains", inputs, outputs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _outputs(model: onnx.ModelProto, batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(batch)
    feeds = {"x": rng.standard_normal((T, batch, F)).astype(np.float32),
             "h0": rng.standard_normal((batch, H)).astype(np.float32)}
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def _natives(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ("RNN", "GRU", "LSTM")]


@pytest.mark.parametrize("share", [dict(), dict(share_x=False), dict(share_h0=False)],
                         ids=["x_and_h0_shared", "h0_shared", "x_shared"])
def test_chains_sharing_given_values_fuse(share):
    model = _model(**share)
    fused, report = rnnfuse.optimize(model)
    natives = _natives(fused)
    assert len(natives) == 1 and not report.declined, report.to_text()
    assert oh.get_attribute_value(next(a for a in natives[0].attribute if a.name == "direction")) == b"bidirectional"
    assert len(fused.graph.node) < len(model.graph.node) / 3
    for batch in (1, 3):
        for want, got in zip(_outputs(model, batch), _outputs(fused, batch)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("leak", [(0, 0), (0, 1), (1, 0)], ids=["fw_first", "fw_second", "bw_first"])
def test_inner_value_reading_a_state_is_declined(leak):
    """A pre-activation (x_t @ W + h @ R) read outside: no native op outputs it. The leaking chain is
    declined with the reason, the other fused; outputs unchanged."""
    model = _model(leak=leak)
    fused, report = rnnfuse.optimize(model)
    assert len(_natives(fused)) == 1 and len(report.declined) == 1, report.to_text()
    for batch in (1, 3):
        for want, got in zip(_outputs(model, batch), _outputs(fused, batch)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
