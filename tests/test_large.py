"""A model over 2 GB (external data) optimizes within rnnfuse's memory bound and keeps its outputs.

Heavy (writes ~2.3 GB twice): runs when RNNFUSE_LARGE=1 (CI sets it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.skipif(os.environ.get("RNNFUSE_LARGE") != "1", reason="set RNNFUSE_LARGE=1 to run")

H = 24_600  # R is H*H float32 = 2.42 GB
F = 8

MEASURE = r"""
import resource, subprocess, sys, json
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr, "maxrss_mb": ru.ru_maxrss / 1024}))
"""


def _external(name: str, shape: tuple, location: str, offset: int) -> onnx.TensorProto:
    from rnnfuse.graph import set_external

    t = onnx.TensorProto()
    t.name, t.data_type = name, TensorProto.FLOAT
    t.dims.extend(shape)
    set_external(t, location, offset, int(np.prod(shape)) * 4)
    return t


def build(path: str) -> None:
    """An Elman RNN as a Scan whose R is 2.4 GB, written straight to external data (never one proto)."""
    rng = np.random.default_rng(0)
    location = os.path.basename(path) + ".data"
    tensors = []
    with open(path + ".data", "wb") as f:
        for name, shape, scale in (("W", (F, H), 0.3), ("R", (H, H), 1.0 / np.sqrt(H)), ("b", (H,), 0.1)):
            off = f.tell()
            rows = shape[0] if len(shape) == 2 else 1
            for i in range(0, rows, 2048):  # chunked, to keep the builder's own memory down
                n = min(2048, rows - i)
                part_shape = (n,) + shape[1:] if len(shape) == 2 else shape
                f.write((rng.standard_normal(part_shape, dtype=np.float32) * scale).astype(np.float32).tobytes())
            tensors.append(_external(name, shape, location, off))
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
            helper.make_node("MatMul", ["h", "R"], ["hr"]),
            helper.make_node("Add", ["xw", "hr"], ["s"]),
            helper.make_node("Add", ["s", "b"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h2"]),
            helper.make_node("Identity", ["h2"], ["y"]),
        ],
        "body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", H]), helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["B", F])],
        [helper.make_tensor_value_info("h2", TensorProto.FLOAT, ["B", H]), helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", H])],
    )
    g = helper.make_graph(
        [helper.make_node("Scan", ["h0", "x"], ["hT", "ys"], body=body, num_scan_inputs=1)],
        "big",
        [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", H]), helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
        [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]), helper.make_tensor_value_info("hT", TensorProto.FLOAT, ["B", H])],
        tensors,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with open(path, "wb") as f:
        f.write(m.SerializeToString())


@pytest.fixture
def big_dir(tmp_path):
    """A directory for the test's ~5 GB of models, emptied when it ends (pytest keeps its last three runs'
    temporary directories: 15 GB of a disk for models nobody reads again)."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_over_2gb_with_external_data(big_dir):
    tmp_path = big_dir
    src, out = str(tmp_path / "big.onnx"), str(tmp_path / "big.fused.onnx")
    build(src)
    size = os.path.getsize(src) + os.path.getsize(src + ".data")
    assert size > 2**31
    p = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "rnnfuse", "optimize", src, out, "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True)
    res = json.loads(p.stdout)
    assert res["rc"] == 0, res["err"]
    report = json.loads((tmp_path / "r.json").read_text())
    fused = [f for ps in report["passes"] for f in ps["findings"] if f["status"] == "fused"]
    assert len(fused) == 1 and fused[0]["cell"].startswith("RNN"), report
    assert "memory bound" in fused[0]["validation"]  # too big to run twice: proven from the maths
    peak = res["maxrss_mb"] * 2**20
    print(f"\nmodel {size / 2**30:.2f} GB, rnnfuse peak RSS {res['maxrss_mb'] / 1024:.2f} GB ({peak / size:.2f}x)")
    assert peak <= 2 * size, f"peak RSS {peak / 2**30:.2f} GB > 2x the model ({size / 2**30:.2f} GB)"
    assert os.path.exists(out + ".data")
    onnx.checker.check_model(out, full_check=True)
    m = onnx.load(out, load_external_data=False)
    assert m.ir_version == 8 and [n.op_type for n in m.graph.node].count("RNN") == 1
    assert not any(n.op_type == "Scan" for n in m.graph.node)
    # outputs unchanged
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((3, 2, F)).astype(np.float32), "h0": rng.standard_normal((2, H)).astype(np.float32) * 0.1}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    a = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(out, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, atol=1e-4, rtol=1e-4)
