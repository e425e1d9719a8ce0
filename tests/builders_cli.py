"""Tiny hand-built models for CLI tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def loop_with_runtime_weights(F: int = 3, H: int = 4) -> onnx.ModelProto:
    """A Loop computing an Elman RNN whose input weight is a graph input (so it cannot be fused)."""
    rng = np.random.default_rng(0)
    R = numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), "R")
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    body = helper.make_graph(
        [
            helper.make_node("Gather", ["x", "i"], ["xt"], axis=0),
            helper.make_node("MatMul", ["xt", "W"], ["xw"]),
            helper.make_node("MatMul", ["h", "R"], ["hr"]),
            helper.make_node("Add", ["xw", "hr"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h2"]),
            helper.make_node("Identity", ["cond"], ["cond2"]),
            helper.make_node("Identity", ["h2"], ["y"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", H]),
        ],
        [
            helper.make_tensor_value_info("cond2", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h2", TensorProto.FLOAT, ["B", H]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", H]),
        ],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["T"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["B"], axis=0),
        helper.make_node("Unsqueeze", ["B", "ax0"], ["B1"]),
        helper.make_node("Concat", ["B1", "Hs"], ["hshape"], axis=0),
        helper.make_node("ConstantOfShape", ["hshape"], ["h0"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        helper.make_node("Loop", ["T", "true", "h0"], ["hT", "ys"], body=body),
    ]
    g = helper.make_graph(
        nodes,
        "rt",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F]),
            helper.make_tensor_value_info("W", TensorProto.FLOAT, [F, H]),
        ],
        [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H])],
        [
            R,
            one,
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array([0], np.int64), "ax0"),
            numpy_helper.from_array(np.array([H], np.int64), "Hs"),
            numpy_helper.from_array(np.array(True), "true"),
        ],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m
