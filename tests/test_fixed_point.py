"""One run reaches the fixed point: optimizing an optimized model changes nothing (the same bytes), for every
model the real exporters write in this suite (Keras 3 and tf_keras through tf2onnx, torch trace / dynamo /
TorchScript) and the shipped example."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import rnnfuse

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from keras_cases import CASES as KERAS_CASES  # noqa: E402  (plain data)
from torch_cases import CASES as TORCH_CASES  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_masked_bigru_lstm.onnx"


def _twice(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.name} was not exported (see the generator's warnings)")
    original = onnx.load(path)
    once, first = rnnfuse.optimize(original)
    twice, second = rnnfuse.optimize(once)
    assert not second.fused, [f.line() for f in second.fused]
    assert twice.SerializeToString() == once.SerializeToString(), (
        f"a second run changed the model: {first.op_change_line()} then {second.op_change_line()}")


def test_example_fixed_point():
    _twice(EXAMPLE)


@pytest.mark.parametrize("backend", ["keras3", "tf_keras"])
@pytest.mark.parametrize("name", [c.name for c in KERAS_CASES])
def test_keras_fixed_point(request, backend, name):
    directory = request.getfixturevalue(f"{backend}_dir")
    _twice(directory / f"{name}.onnx")


@pytest.mark.parametrize("name", [c.name for c in TORCH_CASES if not c.slow])
def test_torch_fixed_point(torch_dir, name):
    if not (torch_dir / f"{name}.onnx").exists():
        pytest.skip(f"{name} was not exported (see the generator's warnings)")
    _twice(torch_dir / f"{name}.onnx")
