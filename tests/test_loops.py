"""Hand-built Loop recurrences in other exporters' forms (tests/builders_loops.py): fused exactly, near misses
declined and left unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders_loops import (
    HEAD_FORMS,
    HEAD_MISSES,
    NEAR_MISSES,
    STACK_FORMS,
    STACK_MISSES,
    LoopOpts,
    HeadOpts,
    StackOpts,
    all_variants,
    build,
    build_head,
    build_stack,
    head_reference,
    reference,
    stack_reference,
)
from helpers import assert_close, op_counts, session

import rnnfuse


@pytest.mark.parametrize("o", all_variants(), ids=lambda o: o.name)
def test_loop_forms_fused(o: LoopOpts):
    model = build(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.declined and len(report.fused) == 1, report.to_text()
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    counts = op_counts(fused)
    assert counts.get("Loop", 0) == 0 and counts.get("RNN") == 1, (counts, report.to_text())
    onnx.checker.check_model(fused, full_check=True)
    s_orig, s_fused = session(model), session(fused)
    rng = np.random.default_rng(1)
    for batch, steps in ((1, 5), (3, 7), (2, 1)):
        shape = (batch, steps, 3) if o.batch_first else (steps, batch, 3)
        x = rng.standard_normal(shape).astype(np.float32)
        want = reference(o, x)
        got, orig = s_fused.run(None, {"x": x}), s_orig.run(None, {"x": x})
        for k in range(2):
            assert_close(orig[k], want[k], f"{o.name}: original vs numpy")
            assert_close(got[k], want[k], f"{o.name}: fused vs numpy")


@pytest.mark.parametrize("o", NEAR_MISSES, ids=lambda o: o.name)
def test_loop_near_misses_declined(o: LoopOpts):
    model = build(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert op_counts(fused) == op_counts(model)


@pytest.mark.parametrize("o", STACK_FORMS, ids=lambda o: o.name)
def test_stacked_cells_one_op_per_cell(o: StackOpts):
    """Several cells per step: one native op per cell, the one above fed by the Y of the one below."""
    model = build_stack(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.declined and len(report.fused) == 1, report.to_text()
    counts = op_counts(fused)
    assert counts.get("Loop", 0) == 0 and counts.get("RNN") == o.cells, (counts, report.to_text())
    rnns = [n for n in fused.graph.node if n.op_type == "RNN"]
    producers = {out: n for n in fused.graph.node for out in n.output}
    for upper in rnns[1:]:  # each op above the first reads another RNN's Y (through a Squeeze at most)
        src = producers[upper.input[0]]
        while src.op_type != "RNN":
            src = producers[src.input[0]]
        assert src in rnns and src is not upper
    s_orig, s_fused = session(model), session(fused)
    rng = np.random.default_rng(2)
    for batch, steps in ((1, 5), (3, 7), (2, 1)):
        x = rng.standard_normal((steps, batch, 3)).astype(np.float32)
        want = stack_reference(o, x)
        got, orig = s_fused.run(None, {"x": x}), s_orig.run(None, {"x": x})
        for k, w in enumerate(want):
            assert_close(orig[k], w, f"{o.name}/{k}: original vs numpy")
            assert_close(got[k], w, f"{o.name}/{k}: fused vs numpy")


@pytest.mark.parametrize("o", STACK_MISSES, ids=lambda o: o.name)
def test_stacked_cells_near_misses_declined(o: StackOpts):
    model = build_stack(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert op_counts(fused) == op_counts(model)



@pytest.mark.parametrize("o", HEAD_FORMS, ids=lambda o: o.name)
def test_head_in_step_fused(o: HeadOpts):
    """A per-step output computed from h inside the body: one RNN, the head applied to all of Y after it."""
    model = build_head(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.declined and len(report.fused) == 1, report.to_text()
    counts = op_counts(fused)
    assert counts.get("Loop", 0) == 0 and counts.get("RNN") == 1, (counts, report.to_text())
    onnx.checker.check_model(fused, full_check=True)
    s_orig, s_fused = session(model), session(fused)
    rng = np.random.default_rng(3)
    for batch, steps in ((1, 5), (3, 7), (2, 1)):
        x = rng.standard_normal((steps, batch, 3)).astype(np.float32)
        want = head_reference(o, x)
        got, orig = s_fused.run(None, {"x": x}), s_orig.run(None, {"x": x})
        for k, w in enumerate(want):
            assert_close(orig[k], w, f"{o.name}/{k}: original vs numpy")
            assert_close(got[k], w, f"{o.name}/{k}: fused vs numpy")


HEAD_REASONS = {"rows_mean": "not a row-wise op", "transpose": "not a row-wise op", "counter": "iteration number",
                "prev_h": "before the step updates it"}


@pytest.mark.parametrize("o", HEAD_MISSES, ids=lambda o: o.name)
def test_head_near_misses_declined(o: HeadOpts):
    model = build_head(o)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert HEAD_REASONS[o.miss] in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)
