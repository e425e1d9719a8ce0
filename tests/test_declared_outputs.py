"""What a fused model declares about the outputs it replaced (hand-built Loops).

A rewrite carries the file's declaration of each output it replaces over to the new tensor, except where
validation ran the original at another rank than the file declares: TorchScript declares what it stacks from
``x.unbind(a)`` one axis too many (its ``SplitToSequence`` with ``split=1``, whose chunks onnxruntime squeezes
by ``keepdims=0``), which strict shape inference refuses beside the native op. Then the output is restated; a
declaration that holds (a running sum from a ``[1, 1, H]`` start really is ``[1, B, H]``) is kept.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import rnnfuse

F, H = 3, 4


def _loop_model(read: str, out_dims: list) -> onnx.ModelProto:
    """A tanh-RNN Loop over x [T, B, F] from zeros. ``read``: "gather" (x[i]) with a running sum from a [1, 1, H]
    start as the second output; "unbind" (SequenceAt(SplitToSequence(x, 1, keepdims=0), i), T its
    SequenceLength) with the stacked h as the second output. ``out_dims``: what the file declares of it."""
    rng = np.random.default_rng(0)
    step = (oh.make_node("Gather", ["x", "i"], ["xt"], axis=0) if read == "gather"
            else oh.make_node("SequenceAt", ["seq", "i"], ["xt"]))
    second = (oh.make_node("Add", ["acc_in", "h_out"], ["acc_out"]) if read == "gather"
              else oh.make_node("Identity", ["h_out"], ["y_t"]))
    body_outs = [oh.make_tensor_value_info("cond_out", TP.BOOL, []), oh.make_tensor_value_info("h_out", TP.FLOAT, None),
                 oh.make_tensor_value_info("acc_out" if read == "gather" else "y_t", TP.FLOAT, None)]
    body_ins = [oh.make_tensor_value_info("i", TP.INT64, []), oh.make_tensor_value_info("cond_in", TP.BOOL, []),
                oh.make_tensor_value_info("h_in", TP.FLOAT, None)]
    if read == "gather":
        body_ins.append(oh.make_tensor_value_info("acc_in", TP.FLOAT, None))
    body = oh.make_graph([step, oh.make_node("MatMul", ["xt", "W"], ["a"]), oh.make_node("MatMul", ["h_in", "U"], ["b"]),
                          oh.make_node("Add", ["a", "b"], ["c"]), oh.make_node("Tanh", ["c"], ["h_out"]), second,
                          oh.make_node("Identity", ["cond_in"], ["cond_out"])], "body", body_ins, body_outs)
    nodes = [oh.make_node("Shape", ["x"], ["shp"]), oh.make_node("Gather", ["shp", "one"], ["B"], axis=0),
             oh.make_node("Unsqueeze", ["B", "ax0"], ["B1"]), oh.make_node("Concat", ["B1", "Hc"], ["h0shape"], axis=0),
             oh.make_node("ConstantOfShape", ["h0shape"], ["h0"], value=nh.from_array(np.zeros(1, np.float32)))]
    if read == "gather":
        nodes += [oh.make_node("Gather", ["shp", "zero"], ["T"], axis=0),
                  oh.make_node("Loop", ["T", "true", "h0", "acc0"], ["hT", "y"], body=body)]
    else:
        nodes += [oh.make_node("SplitToSequence", ["x", "one_split"], ["seq"], axis=0, keepdims=0),
                  oh.make_node("SequenceLength", ["seq"], ["T"]),
                  oh.make_node("Loop", ["T", "true", "h0"], ["hT", "y"], body=body)]
    inits = [nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one"),
             nh.from_array(np.array(1, np.int64), "one_split"), nh.from_array(np.array([0], np.int64), "ax0"),
             nh.from_array(np.array([H], np.int64), "Hc"), nh.from_array(np.array(True), "true"),
             nh.from_array(np.full((1, 1, H), 0.5, np.float32), "acc0"),
             nh.from_array(rng.standard_normal((F, H)).astype(np.float32), "W"),
             nh.from_array(rng.standard_normal((H, H)).astype(np.float32) * 0.5, "U")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["T", "B", F])],
                      [oh.make_tensor_value_info("hT", TP.FLOAT, ["B", H]), oh.make_tensor_value_info("y", TP.FLOAT, out_dims)],
                      inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


def _declared(model: onnx.ModelProto, name: str) -> list:
    vi = next(o for o in model.graph.output if o.name == name)
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _check_same(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for batch, T in ((1, 2), (3, 5)):
        feeds = {"x": np.random.default_rng(T).standard_normal((T, batch, F)).astype(np.float32)}
        want, got = (ort.InferenceSession(m.SerializeToString(), opts).run(None, feeds) for m in (a, b))
        for w, o in zip(want, got):
            assert w.shape == o.shape
            np.testing.assert_allclose(o, w, atol=1e-5, rtol=1e-5)


def test_a_declaration_that_holds_is_kept():
    model = _loop_model("gather", [1, "B", H])
    onnx.checker.check_model(model, full_check=True)
    fused, report = rnnfuse.optimize(model)
    assert [n.op_type for n in fused.graph.node].count("RNN") == 1 and not report.declined, report.to_text()
    assert _declared(fused, "y") == [1, "B", H]
    _check_same(model, fused)


def test_unbind_steps_declared_an_axis_too_many_are_restated():
    model = _loop_model("unbind", ["T", "B", 1, H])  # (as TorchScript declares: one axis too many)
    fused, report = rnnfuse.optimize(model)
    assert [n.op_type for n in fused.graph.node].count("RNN") == 1 and not report.declined, report.to_text()
    assert len(_declared(fused, "y")) == 3
    onnx.checker.check_model(fused, full_check=True)
    _check_same(model, fused)


def test_ranks_are_mapped_once_per_validation(monkeypatch, tmp_path):
    """Rewrites validated together share one map of the compared ranks (built per rewrite, 11,000 stacked
    Loops each mapped all 22,000 pairs: 25 s of the loop pass)."""
    import os
    import sys
    from functools import cached_property

    from rnnfuse.validate import ValidationResult

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    try:
        from graphs import stacked_loops
    finally:
        sys.path.pop(0)
    stacked_loops(str(tmp_path / "m.onnx"), 9 * 40)
    calls = []
    real = ValidationResult.ranks.func
    counted = cached_property(lambda self: calls.append(1) or real(self))
    counted.__set_name__(ValidationResult, "ranks")
    monkeypatch.setattr(ValidationResult, "ranks", counted)
    fused, report = rnnfuse.optimize(onnx.load(str(tmp_path / "m.onnx")))
    fused_loops = [f for f in report.fused if f.status == "fused" and f.pass_name == "loop"]
    assert len(fused_loops) >= 30, report.to_text()
    assert 1 <= len(calls) <= 3, len(calls)  # (one per validation run, not one per Loop)
