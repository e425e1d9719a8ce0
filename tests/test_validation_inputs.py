"""Validation compares a rewrite on the generated input sets the original itself can run.

An unrolled trace of a symbolic time axis reads a fixed number of steps: a generated set with fewer steps is no
input of the model (the original fails on it). Such a set used to end the check as "skipped" although others
had run, and the rewrite was then applied unvalidated (a probe of torch exports: a dynamic-T trace of 6 steps).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.graph import Model
from rnnfuse.validate import CONFIGS, validate


def _model(step: int, delta: float):
    """x [T, B, 2] with T symbolic; old = x[step] * 2 (needs T > step); new = x[step] + x[step] + delta."""
    nodes = [helper.make_node("Gather", ["x", "k"], ["xk"], axis=0),
             helper.make_node("Mul", ["xk", "two"], ["y_old"]),
             helper.make_node("Add", ["xk", "xk"], ["s"]),
             helper.make_node("Add", ["s", "d"], ["y_new"])]
    inits = [numpy_helper.from_array(np.array(step, np.int64), "k"), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(delta, np.float32), "d")]
    out = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", 2])  # noqa: E731
    graph = helper.make_graph(nodes, "steps", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", 2])],
                              [out("y_old"), out("y_new")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return Model(model)


def test_sets_the_original_cannot_run_are_left_out_of_the_comparison():
    """Step 5 read: the sets of 6 and 9 steps run and are compared; the 5- and 1-step sets are no inputs."""
    runnable = sum(1 for _, t, _ in CONFIGS if t > 5)
    assert 0 < runnable < len(CONFIGS)
    res = validate(_model(5, 0.0).graph, [("y_old", "y_new")], {})
    assert res.ran and res.runs == runnable, (res.ran, res.skipped_reason, res.runs)
    ok, _, detail = res.error_for([("y_old", "y_new")])
    assert ok, detail


def test_a_difference_on_the_sets_the_original_runs_fails():
    res = validate(_model(5, 0.1).graph, [("y_old", "y_new")], {})
    assert res.ran
    ok, _, _ = res.error_for([("y_old", "y_new")])
    assert not ok


def test_a_model_no_generated_set_runs_is_skipped_as_before():
    """Step 50 read: the original runs none of the sets; validation says it could not run, as it did."""
    res = validate(_model(50, 0.0).graph, [("y_old", "y_new")], {})
    assert not res.ran and "failed on generated inputs" in res.skipped_reason, res.skipped_reason
