"""The real command line: bad inputs, safe writes, reports, stability. Every test runs the CLI as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers import op_counts, session

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_masked_bigru_lstm.onnx"


def run(*args, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RNNFUSE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "rnnfuse", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def assert_one_line_error(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert len(err.splitlines()) == 1, err
    assert err.startswith("rnnfuse: error:"), err
    for w in words:
        assert w in err, (w, err)


def tiny_model(opset: int = 17, ir: int = 8) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def test_help_explains_every_option():
    p = run("optimize", "--help")
    assert p.returncode == 0
    for opt in ("--post-padded", "--no-validate", "--json", "--quiet", "--verbose", "--in-place", "--external-data", "--strict"):
        assert opt in p.stdout
    assert run("--help").returncode == 0
    assert "exit codes" in run("--help").stdout


def test_optimize_example(tmp_path):
    out = tmp_path / "out.onnx"
    p = run("optimize", EXAMPLE, out, "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    assert "fused Loop" in p.stdout and "merged" in p.stdout
    m = onnx.load(out)
    c = op_counts(m)
    assert c.get("Loop", 0) == 0 and c["GRU"] == 1 and c["LSTM"] == 1
    rep = json.loads((tmp_path / "r.json").read_text())
    statuses = [f["status"] for p_ in rep["passes"] for f in p_["findings"]]
    assert statuses.count("fused") == 3 and statuses.count("merged") == 1
    assert rep["ops_before"]["Loop"] == 3 and "Loop" not in rep["ops_after"]
    # the example ships with Keras' own answer on a pre-padded and a post-padded row
    d = np.load(EXAMPLE.with_suffix(".npz"))
    y = session(m).run(None, {"features": d["features"]})[0]
    np.testing.assert_allclose(y, d["expected"], atol=1e-5, rtol=1e-5)


def test_quiet_and_verbose(tmp_path):
    q = run("optimize", EXAMPLE, tmp_path / "a.onnx", "-q")
    assert q.returncode == 0 and q.stdout == "" and q.stderr == ""
    v = run("optimize", EXAMPLE, tmp_path / "b.onnx", "-v")
    assert "pass loop" in v.stdout and "max abs error" in v.stdout


def test_inspect_writes_nothing(tmp_path):
    before = set(os.listdir(tmp_path))
    p = run("inspect", EXAMPLE, cwd=tmp_path)
    assert p.returncode == 0
    assert "would fuse" in p.stdout
    assert set(os.listdir(tmp_path)) == before


def test_nothing_to_fuse_is_success(tmp_path):
    src = tmp_path / "relu.onnx"
    onnx.save(tiny_model(), src)
    p = run("optimize", src, tmp_path / "o.onnx")
    assert p.returncode == 0, p.stderr
    assert "no recurrences found" in p.stdout
    assert onnx.load(tmp_path / "o.onnx").ir_version == 8


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda d: d / "missing.onnx", ["not found", "missing.onnx"]),
        (lambda d: d, ["directory"]),
        (lambda d: _write(d / "empty.onnx", b""), ["empty"]),
        (lambda d: _write(d / "text.onnx", b"this is not a model\n" * 20), ["not a valid ONNX model"]),
        (lambda d: _write(d / "trunc.onnx", EXAMPLE.read_bytes()[: EXAMPLE.stat().st_size // 2]), ["not a valid ONNX model"]),
        (lambda d: _save(d / "old.onnx", tiny_model(opset=5, ir=3)), ["opset 5"]),
        (lambda d: _save(d / "new.onnx", tiny_model(opset=99)), ["opset 99"]),
        (lambda d: _save(d / "ir.onnx", tiny_model(ir=99)), ["IR version 99"]),
    ],
    ids=["missing", "directory", "empty", "not-onnx", "truncated", "ancient-opset", "future-opset", "future-ir"],
)
def test_bad_input(tmp_path, make, words):
    src = make(tmp_path)
    out = tmp_path / "out.onnx"
    out.write_bytes(b"precious")  # an existing output survives a failed run
    p = run("optimize", src, out)
    assert_one_line_error(p, 3, *words)
    assert out.read_bytes() == b"precious"
    assert [f for f in os.listdir(tmp_path) if f.startswith(".rnnfuse")] == []


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _save(path: Path, m: onnx.ModelProto) -> Path:
    path.write_bytes(m.SerializeToString())
    return path


def test_unwritable_output(tmp_path):
    p = run("optimize", EXAMPLE, tmp_path / "no" / "such" / "dir" / "out.onnx")
    assert_one_line_error(p, 4, "does not exist")
    p = run("optimize", EXAMPLE, "/proc/rnnfuse-out.onnx")
    assert p.returncode == 4 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run("optimize", EXAMPLE, tmp_path)
    assert_one_line_error(p, 4, "directory")


def test_refuses_to_overwrite_input(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(EXAMPLE.read_bytes())
    p = run("optimize", src, src)
    assert_one_line_error(p, 4, "overwrite the input", "--in-place")
    assert src.read_bytes() == EXAMPLE.read_bytes()
    p = run("optimize", src, src, "--in-place")
    assert p.returncode == 0
    assert op_counts(onnx.load(src)).get("Loop", 0) == 0


def test_usage_error():
    p = run("optimize", EXAMPLE)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr


def test_deterministic_and_idempotent(tmp_path):
    a, b, c = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.onnx"
    assert run("optimize", EXAMPLE, a).returncode == 0
    assert run("optimize", EXAMPLE, b).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    p = run("optimize", a, c)
    assert p.returncode == 0
    assert "no recurrences found" in p.stdout
    assert c.read_bytes() == a.read_bytes()
    m = onnx.load(a)
    onnx.checker.check_model(m, full_check=True)
    src = onnx.load(EXAMPLE)
    assert m.ir_version == src.ir_version
    assert [(o.domain, o.version) for o in m.opset_import] == [(o.domain, o.version) for o in src.opset_import]


def test_strict(tmp_path):
    # a Loop whose weights are a graph input cannot be fused: --strict turns that into exit 5
    from builders_cli import loop_with_runtime_weights

    src = tmp_path / "rt.onnx"
    onnx.save(loop_with_runtime_weights(), src)
    p = run("optimize", src, tmp_path / "o.onnx")
    assert p.returncode == 0 and "declined" in p.stdout
    p = run("optimize", src, tmp_path / "o2.onnx", "--strict")
    assert_one_line_error(p, 5, "declined")


def test_ir_version_onnxruntime_cannot_load(tmp_path):
    """IR 14 (what onnx 1.23 writes by default) is valid ONNX that onnxruntime 1.31 refuses: the rewrite still
    happens (proven from the maths), validation says it was skipped and why, the IR version is kept."""
    from builders import Opts, build

    model, _ = build(Opts(op="GRU", lbr=1))
    model.ir_version = 14
    src = tmp_path / "ir14.onnx"
    onnx.save(model, src)
    p = run("optimize", src, tmp_path / "o.onnx", "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    fused = [f for ps in rep["passes"] for f in ps["findings"] if f["status"] == "fused"]
    assert fused and fused[0]["validation"].startswith("skipped") and "onnxruntime" in fused[0]["validation"]
    assert onnx.load(tmp_path / "o.onnx").ir_version == 14
