"""Fused models on OpenVINO (CPU plugin): they load, compile, give the framework's outputs, and unmasked ones
run on OpenVINO's sequence kernel (issue 18). Needs the ``openvino`` extra; skipped without it.

* ``test_activation_support``: the list in :mod:`rnnfuse.portability` is what OpenVINO really compiles (one-op
  RNN models with every ONNX activation).
* ``test_keras3`` / ``test_tf_keras`` / ``test_torch``: every exporter fixture (tests/exporters/), optimized
  as by default. A fused model compiles unless its report says it will not (a warning on the finding) -- and
  then it really does not; its outputs equal the framework's (every input set: padded steps, pre-padded and
  gappy masks, batch 1 and many) unless the report warns that they are wrong on OpenVINO (masked reverse ops,
  a masked LSTM's final cell state). When it warns, the same model optimized with ``portable=True`` must
  compile and be right. An unmasked fused model whose native ops use the default activations runs every one
  of them on the sequence kernel (runtime ``layerType`` ``RNNSeq``; a generic loop shows as
  ``TensorIterator``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ov = pytest.importorskip("openvino")

import rnnfuse  # noqa: E402
from helpers import exported_case, load_sets  # noqa: E402
from rnnfuse.graph import attr  # noqa: E402
from rnnfuse.portability import OPENVINO_ACTIVATIONS  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from keras_cases import CASES as KERAS_CASES  # noqa: E402
from torch_cases import CASES as TORCH_CASES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ATOL = RTOL = 1e-5
SEQUENCE_KERNEL = "RNNSeq"
GENERIC_LOOPS = ("TensorIterator", "Loop")
ALL_ACTIVATIONS = {  # ONNX activation -> parameters (alpha, beta)
    "Sigmoid": (), "Tanh": (), "Relu": (), "HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.1,), "ThresholdedRelu": (1.0,),
    "Elu": (1.0,), "Softsign": (), "Softplus": (), "Affine": (1.0, 0.0), "ScaledTanh": (1.0, 1.0),
}


@pytest.fixture(scope="module")
def core():
    return ov.Core()


def compile_model(core, model: onnx.ModelProto):
    # f32: OpenVINO's CPU default on bf16-capable CPUs is bf16, which would differ at ~1e-2
    return core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def layer_types(compiled) -> dict:
    out: dict = {}
    for op in compiled.get_runtime_model().get_ops():
        t = op.get_rt_info()["layerType"].astype(str)
        out[t] = out.get(t, 0) + 1
    return out


# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", list(ALL_ACTIVATIONS))
def test_activation_support(core, act):
    H, F = 3, 2
    params = ALL_ACTIVATIONS[act]
    attrs = dict(hidden_size=H, activations=[act])
    if len(params) >= 1:
        attrs["activation_alpha"] = [params[0]]
    if len(params) == 2:
        attrs["activation_beta"] = [params[1]]
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(k, TensorProto.FLOAT, s, rng.standard_normal(s).astype(np.float32).ravel())
             for k, s in (("W", [1, H, F]), ("R", [1, H, H]))]
    node = helper.make_node("RNN", ["X", "W", "R"], ["Y", "Yh"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 2, F])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("Y", "Yh")], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    try:
        compile_model(core, m)
        compiles = True
    except Exception:  # noqa: BLE001 - OpenVINO raises its own exception types
        compiles = False
    assert compiles == (act in OPENVINO_ACTIVATIONS), f"OpenVINO {'compiles' if compiles else 'rejects'} {act}"


# ------------------------------------------------------------------------------------------------------


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name, if_missing=pytest.skip)


def _compare(core, case: dict, model: onnx.ModelProto, compiled) -> None:
    names = [o.name for o in model.graph.output]
    for set_name, (feeds, outs) in load_sets(case["npz"]).items():
        res = compiled(feeds)
        for k, name in enumerate(names):
            if str(k) not in outs:
                continue
            got = np.asarray(res[compiled.outputs[k]])
            np.testing.assert_allclose(got, outs[str(k)], atol=ATOL, rtol=RTOL,
                                       err_msg=f"{case['name']}/{set_name}/{name}: OpenVINO on the fused model vs the framework")


def _native_defaults(model: onnx.ModelProto) -> bool:
    """Whether every native recurrent op uses ONNX's default activations and no clip."""
    return all(attr(n, "activations") is None and attr(n, "clip") is None
               for n in model.graph.node if n.op_type in ("LSTM", "GRU", "RNN"))


def _masked(model: onnx.ModelProto) -> bool:
    return any(len(n.input) > 4 and n.input[4] for n in model.graph.node if n.op_type in ("LSTM", "GRU", "RNN"))


def _run(core, case: dict) -> None:
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    text = report.to_text()
    warnings = [w for f in report.fused for w in f.warnings]
    if not report.fused:
        pytest.skip("nothing fused: rnnfuse hands back the input model")
    if any("will not compile on OpenVINO" in w for w in warnings):
        with pytest.raises(Exception):  # noqa: B017 - OpenVINO raises its own exception types
            compile_model(core, fused)
    else:
        compiled = compile_model(core, fused)
        if any("wrong on OpenVINO" in w for w in warnings):
            pass  # the report says so; the portable model below must be right
        else:
            _compare(core, case, fused, compiled)
            if not _masked(fused) and _native_defaults(fused):
                types = layer_types(compiled)
                n_native = sum(n.op_type in ("LSTM", "GRU", "RNN") for n in fused.graph.node)
                assert types.get(SEQUENCE_KERNEL, 0) >= n_native, (types, text)
                assert not any(types.get(t) for t in GENERIC_LOOPS), (types, text)
    if warnings:
        portable, _ = rnnfuse.optimize(original, portable=True)
        _compare(core, case, portable, compile_model(core, portable))


KERAS_NAMES = [c.name for c in KERAS_CASES]


@pytest.mark.parametrize("name", KERAS_NAMES)
def test_keras3(core, keras3_dir, name):
    _run(core, _case(keras3_dir, name))


@pytest.mark.parametrize("name", KERAS_NAMES)
def test_tf_keras(core, tf_keras_dir, name):
    _run(core, _case(tf_keras_dir, name))


@pytest.mark.parametrize("name", [c.name for c in TORCH_CASES if not c.slow])
def test_torch(core, torch_dir, name):
    _run(core, _case(torch_dir, name))
