"""Gemm of constants folds at any size (a first unrolled step's ``Gemm(zeros, W)`` at hidden 1024 has a 4M-element
weight, beyond what onnx's reference evaluator takes), and equals onnx's own definition where both work."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from rnnfuse import fold


def _gemm(inputs, **attrs):
    node = helper.make_node("Gemm", [f"i{k}" for k in range(len(inputs))], ["o"], **attrs)
    return fold.evaluate(node, inputs, 17), fold._reference(node, inputs, 17)


@pytest.mark.parametrize("attrs", [{}, dict(transA=1), dict(transB=1), dict(alpha=0.5, beta=2.0), dict(transA=1, transB=1, alpha=-1.5)])
@pytest.mark.parametrize("with_c", ["none", "vector", "matrix"])
def test_gemm_folds_as_onnx_defines_it(attrs, with_c):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 3) if attrs.get("transA") else (3, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4) if attrs.get("transB") else (4, 5)).astype(np.float32)
    c = {"none": [], "vector": [rng.standard_normal(5).astype(np.float32)],
         "matrix": [rng.standard_normal((3, 5)).astype(np.float32)]}[with_c]
    ours, reference = _gemm([a, b] + c, **attrs)
    assert ours[0].dtype == np.float32 and ours[0].shape == (3, 5)
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6, atol=1e-6)


def test_a_large_gemm_folds():
    w = np.ones((1024, 4096), np.float32)
    ours, reference = _gemm([np.zeros((2, 1024), np.float32), w, np.arange(4096, dtype=np.float32)], transB=0)
    assert reference is None  # onnx's evaluator is not asked above 1M elements
    np.testing.assert_array_equal(ours[0], np.broadcast_to(np.arange(4096, dtype=np.float32), (2, 4096)))
