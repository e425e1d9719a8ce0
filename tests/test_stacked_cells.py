"""Several cells in one time step (issue 14, item 3), exported by the real exporters: one native op per cell.

Fixtures come from ``tests/exporters/stacked_cases.py`` during the test run: Keras 3 and tf_keras
``RNN([cell1, cell2])`` / ``StackedRNNCells`` through tf2onnx (one Loop body holding the whole stack; masked
with post-, pre-padded, gappy and fully masked rows, batch 1 and 4, go_backwards, return_state of every
cell), and torch loops calling two cells per step (TorchScript: one Loop; trace / dynamo: unrolled chains) or
one cell whose per-step h is read by more than a stack (item 4).
Each case: no Loop left, one LSTM/GRU/RNN per cell, full outputs equal to the framework's and to the original.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import rnnfuse
from conftest import generate
from helpers import check_case, exported_case, op_counts

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from stacked_cases import CASES, TF_SCAN_CASES, TORCH_CASES  # noqa: E402  (plain data; imports no framework)

@pytest.fixture(scope="module")
def stacked_keras3(tmp_path_factory):
    return generate(tmp_path_factory, "stacked_cases.py", ["--backend", "keras3"], "stacked-keras3")


@pytest.fixture(scope="module")
def stacked_tf_keras(tmp_path_factory):
    return generate(tmp_path_factory, "stacked_cases.py", ["--backend", "tf_keras"], "stacked-tf_keras")


@pytest.fixture(scope="module")
def stacked_torch(tmp_path_factory):
    return generate(tmp_path_factory, "stacked_cases.py", ["--backend", "torch"], "stacked-torch")


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name)


def _run(case: dict, findings: int = 1) -> None:
    fused, report = check_case(case)
    cells = [f for f in report.fused if f.status == "fused"]  # (besides: per-step maps merged, passes/step_maps.py)
    assert not report.declined and len(cells) == findings, report.to_text()
    if case.get("masked"):  # (exact for any mask; "lengths": a mask computed as t < lengths, post-padded by its maths)
        assert all(f.path in ("exact", "lengths") for f in report.fused), report.to_text()


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_keras3_stacked_cells(stacked_keras3, name):
    _run(_case(stacked_keras3, name))


@pytest.mark.parametrize("name", TF_SCAN_CASES)
def test_tf_functions(stacked_keras3, name):
    """TensorFlow functions through tf2onnx: tf.scan's per-step c read only at its last step is the native op's
    final c; tf.while_loop reading x[t] or x[:, t] with a strided slice (tf2onnx's own index arithmetic: 1e9 for
    "to the end", a shrunk axis as step 1e9) is a step input. Masked loops carry what they mask with through the
    loop unchanged: a bool ``sequence_mask`` read per step (its [B, 1] column viewed again by a whole-axes
    slice), the same mask cast to 0/1 floats and blended by hand, or the lengths compared (as floats) with t.
    Two loops (a bidirectional layer by hand): two fused, merged into one op."""
    _run(_case(stacked_keras3, name), 2 if name == "tfwhile_lstm_bidir_by_hand" else 1)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_tf_keras_stacked_cells(stacked_tf_keras, name):
    _run(_case(stacked_tf_keras, name))


@pytest.mark.parametrize("c", [c for c in TORCH_CASES if not c.declined], ids=lambda c: c.name)
def test_torch_stacked_cells(stacked_torch, c):
    """TorchScript: one Loop, one op per cell. trace / dynamo: one chain per cell, the upper chain reading the
    lower chain's per-step h (each given its step of the lower op's Y, then read as one sequence). Item 4: a
    head applied per step, outputs concatenated on features, stack(ys[1:]) read the per-step h the same way."""
    _run(_case(stacked_torch, c.name), c.n_findings)


@pytest.mark.parametrize("c", [c for c in TORCH_CASES if c.declined], ids=lambda c: c.name)
def test_torch_per_step_near_miss(stacked_torch, c):
    """A middle step's cell state read outside the chain: no native op outputs it; declined, left as it was."""
    case = _case(stacked_torch, c.name)
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    assert not report.fused and any(c.declined in f.reason for f in report.declined), report.to_text()
    assert op_counts(fused) == op_counts(original)


@pytest.mark.parametrize("name", [c.name for c in CASES if c.masked])
def test_keras3_stacked_cells_post_padded_option(stacked_keras3, name):
    """--post-padded: each layer's lean graph, exact on post-padded rows."""
    case = _case(stacked_keras3, name)
    fused, report = check_case(case, sets=[s for s in case["sets"] if s.startswith("post")], post_padded=True)
    assert len(report.fused) == 1 and all(f.path == "post-padded" for f in report.fused), report.to_text()


@pytest.mark.parametrize("name", ["trace_lstm_head", "dynamo_gru_head_bf", "trace_rnn_skip1_bf", "trace_gru_lstm_side",
                                  "trace_rnn_gru_side_head"])
def test_torch_per_step_maps_run_once(stacked_torch, name):
    """A head applied per step, stack(ys[1:]) or cat([h1, h2]) per step, stacked on time: once the chains are
    fused, the T copies become one map over the whole Y (no per-step Gather / Unsqueeze left)."""
    case = _case(stacked_torch, name)
    fused, report = check_case(case)
    assert [f for f in report.fused if f.pass_name == "step-maps"], report.to_text()
    ops = op_counts(fused)
    assert ops.get("Unsqueeze", 0) == 0 and ops.get("Gather", 0) <= 2 and ops.get("Gemm", 0) <= 1, ops
