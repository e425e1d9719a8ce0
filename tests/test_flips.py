"""Spellings of a full time reversal that ``rnnfuse.time_flips.time_flip_source`` must see, and near misses it must not.

``jnp.flip`` on a dynamic axis (flax ``nn.Bidirectional``, hand-written backward scans) is exported by jax2onnx as
``Gather(x, (T-1) - Range(0, T, 1))`` with T read from ``Shape(x)``; other writers use ``Range(T-1, -1, -1)`` or
constant indices. Each positive case is also run in onnxruntime to show it *is* ``x[::-1]``, and each near miss
to show it is not, so the table cannot drift from the maths.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.time_flips import time_flip_source
from rnnfuse.graph import Model

T, B, F = 5, 3, 2


def _i64(name, v):
    return numpy_helper.from_array(np.asarray(v, np.int64), name)


def _model(index_nodes, index_inits, gather_axis=0, static_time=False):
    """x [T, B, F] -> Gather(x, idx, axis) with idx built by ``index_nodes``; T read from Shape(x)[0] (``n``),
    the batch size as ``nb``."""
    shape_nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero1"], ["n1"], axis=0),
        helper.make_node("Squeeze", ["n1", "ax0"], ["n"]),
        helper.make_node("Gather", ["shape", "one1"], ["nb1"], axis=0),
        helper.make_node("Squeeze", ["nb1", "ax0"], ["nb"]),
        helper.make_node("Sub", ["n", "one"], ["n_minus_1"]),
    ]
    inits = [_i64("zero1", [0]), _i64("one1", [1]), _i64("ax0", [0]), _i64("one", 1), _i64("zero", 0),
             _i64("minus_one", -1), _i64("two", 2)] + index_inits
    nodes = shape_nodes + index_nodes + [helper.make_node("Gather", ["x", "idx"], ["y"], axis=gather_axis)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [T if static_time else "T", "B", F])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "flip", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model):
    x = np.random.default_rng(0).standard_normal((T, B, F)).astype(np.float32)
    # ONNX semantics, not onnxruntime's graph rewrites: onnxruntime 1.32 at ORT_ENABLE_ALL turns
    # Gather(x, Range(T-1, -1, -1)) into an empty tensor (a Slice whose end -1 means "the last element")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return x, sess.run(None, {"x": x})[0]


SUB_OF_RANGE = [helper.make_node("Range", ["zero", "n", "one"], ["r"]),
                helper.make_node("Sub", ["n_minus_1", "r"], ["idx"])]
DESCENDING_RANGE = [helper.make_node("Range", ["n_minus_1", "minus_one", "minus_one"], ["idx"])]
CAST_RANGE = [helper.make_node("Range", ["n_minus_1", "minus_one", "minus_one"], ["r64"]),
              helper.make_node("Cast", ["r64"], ["idx"], to=TensorProto.INT32)]

FLIPS = {
    "jax2onnx: (T-1) - Range(0, T, 1)": dict(index_nodes=SUB_OF_RANGE, index_inits=[]),
    "Range(T-1, -1, -1)": dict(index_nodes=DESCENDING_RANGE, index_inits=[]),
    "Range(T-1, -1, -1) cast to int32": dict(index_nodes=CAST_RANGE, index_inits=[]),
    "constant [T-1 .. 0], static T": dict(index_nodes=[], index_inits=[_i64("idx", list(range(T - 1, -1, -1)))],
                                         static_time=True),
}

NEAR_MISSES = {
    "Range(T-2, -1, -1): drops a step": dict(index_nodes=[
        helper.make_node("Sub", ["n_minus_1", "one"], ["n_minus_2"]),
        helper.make_node("Range", ["n_minus_2", "minus_one", "minus_one"], ["idx"])], index_inits=[]),
    "Range(T-1, -1, -2): every other step": dict(index_nodes=[
        helper.make_node("Sub", ["zero", "two"], ["minus_two"]),
        helper.make_node("Range", ["n_minus_1", "minus_one", "minus_two"], ["idx"])], index_inits=[]),
    "(B-1) - Range(0, B, 1) on the time axis": dict(index_nodes=[
        helper.make_node("Sub", ["nb", "one"], ["nb_minus_1"]),
        helper.make_node("Range", ["zero", "nb", "one"], ["r"]),
        helper.make_node("Sub", ["nb_minus_1", "r"], ["idx"])], index_inits=[]),
    "Range(0, T, 1): no reversal": dict(index_nodes=[helper.make_node("Range", ["zero", "n", "one"], ["idx"])],
                                        index_inits=[]),
    "constant with a repeated step": dict(index_nodes=[], index_inits=[_i64("idx", [4, 3, 2, 1, 1])],
                                          static_time=True),
    "constant [T-1 .. 0] but T unknown": dict(index_nodes=[], index_inits=[_i64("idx", list(range(T - 1, -1, -1)))]),
    "float arithmetic: (T - 1.4) - Range(0., T, 1.)": dict(index_nodes=[
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["nf", "f1_4"], ["nf_minus"]),
        helper.make_node("Range", ["f0", "nf", "f1"], ["rf"]),
        helper.make_node("Sub", ["nf_minus", "rf"], ["idxf"]),
        helper.make_node("Cast", ["idxf"], ["idx"], to=TensorProto.INT64)],
        index_inits=[numpy_helper.from_array(np.float32(v), k) for k, v in (("f1_4", 1.4), ("f0", 0.0), ("f1", 1.0))]),
    "a [1, 1] start: Gather adds an axis": dict(index_nodes=[
        helper.make_node("Unsqueeze", ["n_minus_1", "ax01"], ["n_minus_1_2d"]),
        helper.make_node("Range", ["zero", "n", "one"], ["r"]),
        helper.make_node("Sub", ["n_minus_1_2d", "r"], ["idx"])], index_inits=[_i64("ax01", [0, 1])]),
}


@pytest.mark.parametrize("name", list(FLIPS))
def test_flip_spelling_is_seen(name):
    model = _model(**FLIPS[name])
    x, y = _run(model)
    np.testing.assert_array_equal(y, x[::-1])  # the spelling really is a reversal
    m = Model(model)
    assert time_flip_source(m.graph, "y", 0) == "x"
    assert time_flip_source(m.graph, "y", 1) is None  # a flip of time, not of the batch axis


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_is_not_a_flip(name):
    model = _model(**NEAR_MISSES[name])
    m = Model(model)
    assert time_flip_source(m.graph, "y", 0) is None
    if name != "constant [T-1 .. 0] but T unknown":  # (with T = 5 at run time it happens to be one)
        x, y = _run(model)
        assert y.shape != x.shape or not np.array_equal(y, x[::-1])


def test_gather_on_another_axis_is_not_a_time_flip():
    model = _model(SUB_OF_RANGE, [], gather_axis=1)
    m = Model(model)
    assert time_flip_source(m.graph, "y", 0) is None
