"""Step values read outside an unrolled chain, recomputed from what the native op keeps (hand-built).

A head per step that reads the cell's own ``cat(x_t, h_{t-1})`` (PyTorch's char-RNN tutorial) is fused: the
head keeps a copy of the concatenation, reading the op's Y at the step before. A head reading a value computed
from the cell state c before the step is no such read (a native op outputs only the last c): declined, the
model handed back unchanged, also when another head of the same chain could be recomputed. A cell without
activation (``h = cat(x_t, h) @ W + b``, the tutorial as first written) is an RNN with an Affine activation.
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

T, B, F, H, O = 5, 3, 4, 6, 2


def _model(cell: str, heads: tuple[str, ...], reverse: bool = False) -> onnx.ModelProto:
    """An unrolled chain over x [T, B, F] (x[t] by Gather; from the last step to the first with ``reverse``),
    h0 = 0; outputs: the stacked per-step ``heads`` (in time order) and the last h computed. ``cell``: "rnn" (tanh of cat(x_t, h) @ W + b), "linear" (no activation) or "lstm" (one
    matmul over cat(x_t, h), gates i, f, g, o). ``heads``: "cat" (cat(x_t, h_{t-1}) @ Wo), "forget"
    (sigmoid(f_t) * c_{t-1} @ Wc, LSTM only)."""
    rng = np.random.default_rng(1)
    gates = 4 if cell == "lstm" else 1
    inits = [nh.from_array((rng.standard_normal((F + H, gates * H)) * 0.4).astype(np.float32), "W"),
             nh.from_array((rng.standard_normal(gates * H) * 0.1).astype(np.float32), "b"),
             nh.from_array((rng.standard_normal((F + H, O)) * 0.5).astype(np.float32), "Wo"),
             nh.from_array((rng.standard_normal((H, O)) * 0.5).astype(np.float32), "Wc"),
             nh.from_array(np.zeros((1, H), np.float32), "zrow"), nh.from_array(np.array([0], np.int64), "ax0"),
             nh.from_array(np.array([B, H], np.int64), "bh")]
    inits += [nh.from_array(np.array(t, np.int64), f"idx{t}") for t in range(T)]
    nodes = [oh.make_node("Expand", ["zrow", "bh"], ["h_init"])]
    h = c = "h_init"
    outs: dict[str, list[str]] = {k: [] for k in heads}
    for t in reversed(range(T)) if reverse else range(T):
        nodes.append(oh.make_node("Gather", ["x", f"idx{t}"], [f"x{t}"], axis=0))
        nodes.append(oh.make_node("Concat", [f"x{t}", h], [f"cat{t}"], axis=1))
        nodes.append(oh.make_node("MatMul", [f"cat{t}", "W"], [f"mm{t}"]))
        nodes.append(oh.make_node("Add", [f"mm{t}", "b"], [f"pre{t}"]))
        if "cat" in heads:
            nodes.append(oh.make_node("MatMul", [f"cat{t}", "Wo"], [f"cat_out{t}"]))
            outs["cat"].append(f"cat_out{t}")
        if cell == "lstm":
            nodes.append(oh.make_node("Split", [f"pre{t}"], [f"{g}{t}" for g in "ifgo"], axis=1, num_outputs=4))
            for g in "ifo":
                nodes.append(oh.make_node("Sigmoid", [f"{g}{t}"], [f"s{g}{t}"]))
            nodes += [oh.make_node("Tanh", [f"g{t}"], [f"tg{t}"]),
                      oh.make_node("Mul", [f"sf{t}", c], [f"fc{t}"]),
                      oh.make_node("Mul", [f"si{t}", f"tg{t}"], [f"ig{t}"]),
                      oh.make_node("Add", [f"fc{t}", f"ig{t}"], [f"c{t}"]),
                      oh.make_node("Tanh", [f"c{t}"], [f"tc{t}"]),
                      oh.make_node("Mul", [f"so{t}", f"tc{t}"], [f"h{t}"])]
            if "forget" in heads:
                nodes.append(oh.make_node("MatMul", [f"fc{t}", "Wc"], [f"forget_out{t}"]))
                outs["forget"].append(f"forget_out{t}")
            c = f"c{t}"
        elif cell == "rnn":
            nodes.append(oh.make_node("Tanh", [f"pre{t}"], [f"h{t}"]))
        else:
            nodes.append(oh.make_node("Identity", [f"pre{t}"], [f"h{t}"]))
        h = f"h{t}"
    graph_outs = []
    for k, names in outs.items():
        names = sorted(names, key=lambda n: int(n.rsplit("_out", 1)[1]))  # (time order)
        nodes += [oh.make_node("Unsqueeze", [n, "ax0"], [f"{n}_u"]) for n in names]
        nodes.append(oh.make_node("Concat", [f"{n}_u" for n in names], [f"{k}_seq"], axis=0))
        graph_outs.append(oh.make_tensor_value_info(f"{k}_seq", TensorProto.FLOAT, [T, B, O]))
    graph_outs.append(oh.make_tensor_value_info(h, TensorProto.FLOAT, [B, H]))
    graph = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, F])],
                          graph_outs, inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in model.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


@pytest.mark.parametrize("cell,op,reverse", [("rnn", "RNN", False), ("linear", "RNN", False), ("lstm", "LSTM", False),
                                            ("rnn", "RNN", True), ("lstm", "LSTM", True)])
def test_head_reading_the_cells_concatenation_is_fused(cell, op, reverse):
    """(Backwards, the h a step read is the one of the step after it in time: the op's Y one step later in
    processing order.)"""
    model = _model(cell, ("cat",), reverse)
    fused, report = rnnfuse.optimize(model)
    assert not report.declined and len(report.fused) == 1, report.to_text()
    ops = _ops(fused)
    assert ops.get(op) == 1 and ops.get("Tanh", 0) == 0 and ops.get("Sigmoid", 0) == 0, ops
    assert ops.get("MatMul") == T, ops  # (the head's, per step; the cell's matmuls are in the op)
    if cell == "linear":
        rnn = next(n for n in fused.graph.node if n.op_type == "RNN")
        assert [a.strings for a in rnn.attribute if a.name == "activations"] == [[b"Affine"]]
    x = np.random.default_rng(2).standard_normal((T, B, F)).astype(np.float32)
    for got, want in zip(_run(fused, x), _run(model, x)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [("forget",), ("cat", "forget")])
def test_head_reading_the_cell_state_before_the_step_is_declined(heads):
    """``sigmoid(f_t) * c_{t-1}`` needs c at every step: no native op outputs it. With a recomputable head
    beside it, the retry declines too and its copies are removed: the model comes back as it went in."""
    model = _model("lstm", heads)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()
