"""JAX / Flax recurrences exported by jax2onnx: fused, and equal to JAX's own outputs.

Models are exported during the test run by ``tests/exporters/jax_cases.py`` (see conftest). jax2onnx writes
every scan as a ``Loop`` that carries the weights *and the scanned sequence* through unchanged; each case
asserts no Loop left, one native op per recurrence (kind and count from the case table), onnx.checker
full_check, IR/opsets/IO kept, and the full outputs equal to JAX and to onnxruntime on the original (1e-5)
on every input set (batch 1 and 3; a second time length for dynamic-time exports; post-, pre-padded and
gappy masks for masked steps). Near misses must be declined with the reason given in the table, and the
model must come out unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import rnnfuse
from helpers import check_case, exported_case, op_counts

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from jax_cases import CASES  # noqa: E402  (plain data; does not import JAX)

# families of issue 14 that the front ends do not fuse yet (strict: a fix must remove the entry)
KNOWN_GAPS: dict[str, str] = {}


def _p(c):
    if c.name in KNOWN_GAPS:
        return pytest.param(c.name, marks=pytest.mark.xfail(reason=KNOWN_GAPS[c.name], strict=True))
    return c.name


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name)


@pytest.mark.parametrize("name", [_p(c) for c in CASES if not c.declined])
def test_jax(jax_dir, name):
    case = _case(jax_dir, name)
    fused, report = check_case(case)
    assert not report.declined, report.to_text()
    assert all(f.validation.startswith("ok") for f in report.fused), report.to_text()
    assert op_counts(fused).get("Loop", 0) == 0, report.to_text()


@pytest.mark.parametrize("name", [c.name for c in CASES if c.declined])
def test_jax_near_miss_declined(jax_dir, name):
    case = _case(jax_dir, name)
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    assert not report.fused and report.declined, report.to_text()
    assert any(case["expect"]["declined"] in f.reason for f in report.declined), report.to_text()
    assert op_counts(fused) == op_counts(original)
