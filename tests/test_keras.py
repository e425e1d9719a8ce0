"""Keras layers exported by tf2onnx (Keras 3 and tf_keras): fused, and equal to Keras' own outputs.

Models are built and exported during the test run by ``tests/exporters/keras_cases.py`` (see conftest).
Each case asserts: no Loop left, one native op per layer (one bidirectional op per Bidirectional layer, a
reverse op per go_backwards layer), onnx.checker full_check, IR/opsets/IO kept, and the full outputs -- padded
steps included, for post-padded, pre-padded, gappy and fully masked rows, batch 1 and 4 -- equal to Keras and
to onnxruntime on the original to 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import check_case, exported_case, op_counts

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from keras_cases import CASES  # noqa: E402  (plain data; does not import TensorFlow)

NAMES = [c.name for c in CASES]


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name)


@pytest.mark.parametrize("name", NAMES)
def test_keras3(keras3_dir, name):
    _run(_case(keras3_dir, name))


@pytest.mark.parametrize("name", NAMES)
def test_tf_keras(tf_keras_dir, name):
    _run(_case(tf_keras_dir, name))


def _run(case: dict) -> None:
    fused, report = check_case(case)
    assert not report.declined, report.to_text()
    if case.get("masked"):
        assert all(f.path == "exact" for f in report.fused if f.masked), report.to_text()


MASKED = [c.name for c in CASES if c.masked]


@pytest.mark.parametrize("name", MASKED)
def test_keras3_post_padded_option(keras3_dir, name):
    """--post-padded: the lean graph (no gather of valid steps), exact on post-padded inputs."""
    case = _case(keras3_dir, name)
    fused, report = check_case(case, sets=[s for s in case["sets"] if s.startswith("post")], post_padded=True)
    counts = op_counts(fused)
    assert counts.get("ScatterElements", 0) == 0 and counts.get("CumSum", 0) == 0, report.to_text()
    assert all(f.path == "post-padded" for f in report.fused if f.masked)
