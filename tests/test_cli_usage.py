"""The command line's handling of user mistakes and pipes (issue 12 items 5, 7, 8): every bad size or path is a
one-line usage error (exit 2) before any work, a closed pipe ends the run quietly, ``--json -`` puts only JSON
on stdout, and a benchmark smoke run does not overwrite the committed results."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_masked_bigru_lstm.onnx"


def run(*args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RNNFUSE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "rnnfuse", *map(str, args)], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=env)


def assert_usage_error(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("rnnfuse: error:"), err
    assert "internal error" not in err and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


# The input path does not exist: were the arguments checked after loading, the exit would be 3 (bad input);
# exit 2 proves the check comes before any work.
MISSING = "no-such-model.onnx"


@pytest.mark.parametrize("args,words", [
    (["bench", MISSING, "--batch", "0"], ["--batch", "0"]),
    (["bench", MISSING, "--batch", "-1"], ["--batch", "-1"]),
    (["bench", MISSING, "--batch", "1,x"], ["--batch"]),
    (["bench", MISSING, "--runs", "0"], ["--runs", "at least 1"]),
    (["bench", MISSING, "--seq-len", "0"], ["--seq-len", "at least 1"]),
    (["bench", MISSING, "--threads", "0"], ["--threads"]),
    (["bench", MISSING, "--warmup", "-1"], ["--warmup"]),
    (["bench", MISSING, "--plot", "x.txt"], ["--plot", "x.txt"]),
    (["optimize", MISSING, "out.onnx", "--prefer-faster", "0"], ["--prefer-faster"]),
    (["optimize", MISSING, "out.onnx", "--prefer-faster", "16", "--seq-len", "0"], ["--seq-len"]),
    (["optimize", MISSING], ["output"]),
])
def test_bad_sizes_are_usage_errors_before_any_work(args, words):
    assert_usage_error(run(*args), *words)


def test_bench_batch_zero_does_not_reach_onnxruntime():
    # on a real model (it used to end in a segmentation fault inside onnxruntime)
    assert_usage_error(run("bench", EXAMPLE, "--batch", "0", "--runs", "1"), "--batch")


def test_closed_pipe_exits_quietly():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RNNFUSE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "rnnfuse", "inspect", str(EXAMPLE)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader is gone before rnnfuse writes (as `| head -0` would)
    err = p.stderr.read().decode()
    assert p.wait() == 0, err
    assert err == "", err


@pytest.mark.parametrize("command", ["inspect", "optimize"])
def test_json_dash_puts_only_json_on_stdout(tmp_path, command):
    args = [command, EXAMPLE] + ([tmp_path / "o.onnx"] if command == "optimize" else []) + ["--json", "-"]
    p = run(*args)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)  # nothing but JSON
    assert d["command"] == command and d["nodes_before"] > d["nodes_after"]
    assert "fuse" in p.stderr  # the text report went to stderr


def static_model(batch: int = 2, T: int = 7, F: int = 3) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, T, F])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, T, F])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_bench_json_dash_and_reports_the_sizes_that_ran(tmp_path):
    """A model with a static batch 2 and T 7 runs once, at batch 2 and T 7, and says --batch/--seq-len were not used."""
    m = tmp_path / "static.onnx"
    onnx.save(static_model(), m)
    p = run("bench", m, m, "--batch", "1,16", "--seq-len", "100", "--runs", "2", "--warmup", "0", "--json", "-")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert [(r["batch"], r["seq_len"], r["batch_static"], r["seq_len_static"]) for r in d["results"]] == [(2, 7, True, True)]
    assert any("--batch 1,16 not used" in n for n in d["decisions"])
    assert any("--seq-len 100 not used" in n for n in d["decisions"])
    assert "| 2 (static) | 7 (static) |" in p.stderr
    assert "| 16 |" not in p.stderr and "| 100 |" not in p.stderr


@pytest.mark.parametrize("free_axis,expect,note", [
    (0, [(1, 7), (3, 7)], "--seq-len 100 not used"),   # [?, 7, F]: batch from --batch, T is the model's 7
    (1, [(2, 100)], "--batch 1,3 not used"),           # [2, ?, F]: the model's batch 2 (once), T from --seq-len
])
def test_bench_partly_static_model(tmp_path, free_axis, expect, note):
    m = static_model()
    for vi in (m.graph.input[0], m.graph.output[0]):
        vi.type.tensor_type.shape.dim[free_axis].dim_param = "unk__0"
    path = tmp_path / "partly.onnx"
    onnx.save(m, path)
    p = run("bench", path, path, "--batch", "1,3", "--runs", "2", "--warmup", "0", "--json", "-")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert [(r["batch"], r["seq_len"]) for r in d["results"]] == expect
    assert [n for n in d["decisions"] if n.startswith("--")] == [n for n in d["decisions"] if note in n]
    assert any(note in n for n in d["decisions"])


def test_bench_plot_says_where_it_was_written(tmp_path):
    pytest.importorskip("matplotlib")
    m = tmp_path / "static.onnx"
    onnx.save(static_model(), m)
    png = tmp_path / "latency.png"
    p = run("bench", m, m, "--runs", "2", "--warmup", "0", "--plot", png)
    assert p.returncode == 0, p.stderr
    assert png.stat().st_size > 1000
    assert f"plot written to {png}" in p.stdout


def test_benchmark_smoke_run_does_not_target_the_committed_results():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_run"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("bench_run", None)
    committed = (ROOT / "benchmarks" / "results").resolve()
    assert mod.parse_args([]).out.resolve() == committed
    for argv in (["--quick"], ["--seq-len", "20"]):
        out = mod.parse_args(argv).out.resolve()
        assert out != committed and committed not in out.parents
    assert mod.parse_args(["--quick", "--out", "x"]).out == Path("x")


def test_plot_without_matplotlib_is_a_usage_error_before_any_work(tmp_path):
    """matplotlib is an extra: without it, --plot says how to install it before loading or timing anything."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "rnnfuse", "bench", MISSING, "--plot", str(tmp_path / "p.png")],
                       capture_output=True, text=True, env=env)
    assert_usage_error(p, 'pip install "rnnfuse[plot]"')
