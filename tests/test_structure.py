"""Engine rules that every pass relies on and no single pass test pins down."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import rnnfuse.model
from rnnfuse.graph import Model


def _relu_chain():
    """x [2, 3] -> Relu -> y (no declared type) -> Relu -> out."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["out"])],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_one_type_rule_small_model_infers():
    m = Model(_relu_chain())
    assert m.known_type("y") == (TensorProto.FLOAT, [2, 3])
    assert m.shape("y") == [2, 3] and m.rank("y") == 2 and m.elem_type("y") == TensorProto.FLOAT
    assert m.shape("x") == [2, 3]


@pytest.mark.parametrize("first", ["shape", "known_type"])
def test_one_type_rule_large_model_never_infers(first, monkeypatch):
    """A model too large to infer cheaply answers from declarations only, whichever query comes first (the
    type queries used to run whole-model inference for shape/rank/elem_type but not for known_type)."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 2)

    def no_inference(proto):
        raise AssertionError("whole-model inference ran on a large model")

    monkeypatch.setattr(rnnfuse.model, "infer_types", no_inference)
    m = Model(_relu_chain())
    getattr(m, first)("y")
    assert m.known_type("y") is None
    assert m.shape("y") is None and m.rank("y") is None and m.elem_type("y") is None
    assert m.shape("x") == [2, 3]  # declared: known at any size
    m.declare("y", (TensorProto.FLOAT, [2, 3]))  # what an edit declares counts like the file
    assert m.rank("y") == 2 and m.known_type("y") == (TensorProto.FLOAT, [2, 3])
