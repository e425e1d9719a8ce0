"""Validation and the do-no-harm checks of weight-heavy models, without copies of the weights.

Check models whose big tensors hold ``FILE_ROUTE_BYTES`` or more are written to a temporary directory with
their weights as external data (and arrays handed to onnxruntime as they are); the guard's whole-model checks
read a copy without weights. Both must reach the same verdicts as the in-memory route: the tests force the file
route on small hand-built models (including near misses that must be declined) and compare, and build a
weight-heavy model whose old and new weights differ by a small error that must be caught.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rnnfuse import check_session, guard
from rnnfuse.graph import Model
from rnnfuse.validate import validate

from builders import Opts, run_case


@pytest.fixture
def file_route(monkeypatch):
    """Every tensor of 64 bytes or more takes the file route; counts the check models written."""
    monkeypatch.setattr(check_session, "BIG_TENSOR_BYTES", 64)
    monkeypatch.setattr(check_session, "FILE_ROUTE_BYTES", 0)
    written = []
    real = check_session._write_weights

    def counting(*a, **k):
        written.append(1)
        return real(*a, **k)

    monkeypatch.setattr(check_session, "_write_weights", counting)
    return written


CASES = [
    Opts(op="LSTM", H=8),
    Opts(op="GRU", H=8, front="loop", lbr=1),
    Opts(op="RNN", H=8, front="loop", mask="where"),
    Opts(op="LSTM", H=8, front="chain", matmul="gemm_t", static_T=5),
    Opts(op="GRU", H=8, layers="bidir"),
    Opts(op="LSTM", H=8, weights="body_init"),
]
NEAR_MISSES = ["extra_scale", "state_leak", "lstm_wrong_gate", "peephole", "mask_zero_state", "lstm_c_unmasked"]


def _outcome(o: Opts):
    out = run_case(o, batches=(1, 3), Ts=(1, 5))
    return out.status, [(f.status, f.cell) for f in out.report.findings], out.fused_err


@pytest.mark.parametrize("o", CASES, ids=lambda o: o.label())
def test_file_route_reaches_the_same_verdict(o, file_route, monkeypatch):
    forced = _outcome(o)
    assert file_route, "the file route was not taken"
    monkeypatch.undo()
    usual = _outcome(o)
    assert forced[:2] == usual[:2]
    assert forced[0] == "fused" and forced[2] < 1e-4


@pytest.mark.parametrize("mutation", NEAR_MISSES)
def test_file_route_declines_near_misses(mutation, file_route):
    from builders import MUTATIONS, mutation_applies

    o = Opts(op="LSTM", H=8, mutation=mutation, mask="where" if MUTATIONS[mutation][2] else "none")
    if not mutation_applies(mutation, o):
        pytest.skip(f"{mutation} does not apply to {o.label()}")
    out = run_case(o, batches=(1, 3), Ts=(1, 5), check_reference=False)
    assert out.status != "fused" or out.fused_err < 1e-4, out.text()
    assert out.fused_mismatch == "", out.text()


def _pair_model(H: int, error: float):
    """y_old = x . transpose(Wt) and y_new = x . W2, with W2 = Wt^T (+ error in one element): 2 x 4 MB of
    weights, one read through a Transpose that onnxruntime folds while loading (from the data file)."""
    rng = np.random.default_rng(0)
    wt = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
    w2 = np.ascontiguousarray(wt.T)
    w2[3, 5] += error
    nodes = [
        helper.make_node("Transpose", ["Wt"], ["W"]),
        helper.make_node("MatMul", ["x", "W"], ["y_old"]),
        helper.make_node("MatMul", ["x", "W2"], ["y_new"]),
    ]
    g = helper.make_graph(
        nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", H])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", H]) for n in ("y_old", "y_new")],
        [numpy_helper.from_array(wt, "Wt"), numpy_helper.from_array(w2, "W2")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("error, ok", [(0.0, True), (1e-2, False)])
def test_file_route_compares_real_weights(error, ok, monkeypatch):
    written = []
    real = check_session._write_weights
    monkeypatch.setattr(check_session, "_write_weights", lambda *a, **k: written.append(1) or real(*a, **k))
    monkeypatch.setattr(check_session, "FILE_ROUTE_BYTES", 4 << 20)
    model = Model(_pair_model(1024, error))
    res = validate(model.graph, [("y_old", "y_new")], {})
    assert written, "the 8 MB check model did not take the file route"
    assert res.ran and res.runs > 0
    assert res.pairs[("y_old", "y_new")].ok is ok, res.pairs


def test_guard_checks_a_weight_heavy_model_without_its_weights(monkeypatch):
    """The whole-model checks run on a copy without weights and still catch a model onnxruntime refuses."""
    monkeypatch.setattr(check_session, "FILE_ROUTE_BYTES", 4 << 20)
    good = _pair_model(1024, 0.0)
    assert check_session.weight_heavy(good)
    assert guard.harm(good, lambda: good) is None
    bad = onnx.ModelProto()
    bad.CopyFrom(good)
    bad.graph.node[2].input[1] = "Wt_missing"  # reads a tensor nothing produces
    reason = guard.harm(bad, lambda: good)
    assert reason is not None and "Wt_missing" in reason, reason


def test_sessions_without_prepacking_plan_no_memory_pattern(monkeypatch):
    """Every session rnnfuse opens with pre-packing off (the guard's weightless copy, the file route of a check)
    has the memory pattern off too: onnxruntime then lays initializers out by the pattern's planner, whose
    cost grows with the square of the initializers (a 50k-node model with 25k weights took 20 s to load)."""
    import onnxruntime as ort

    opened = []
    real = ort.InferenceSession

    def recording(model, so=None, *a, **k):
        try:
            prepacking_off = so.get_session_config_entry("session.disable_prepacking") == "1"
        except Exception:  # (onnxruntime raises for an entry never set)
            prepacking_off = False
        opened.append((prepacking_off, so.enable_mem_pattern))
        return real(model, so, *a, **k)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    monkeypatch.setattr(check_session, "FILE_ROUTE_BYTES", 4 << 20)
    model = _pair_model(1024, 0.0)
    assert check_session.weight_heavy(model)
    assert guard.harm(model, lambda: model) is None  # (the guard's whole-model load: a copy without weights)
    m = Model(model)
    res = validate(m.graph, [("y_old", "y_new")], {})
    assert res.ran, res  # (a check on the file route)
    without = [pattern for prepacking_off, pattern in opened if prepacking_off]
    assert len(without) >= 2, opened
    assert not any(without), opened


def test_cell_checks_take_the_file_route(file_route, monkeypatch):
    """A chain too big for whole-model validation is checked cell by cell, through the file route."""
    from rnnfuse import rewrite

    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 10)
    out = run_case(Opts(op="GRU", H=8, front="chain", static_T=6), batches=(1, 3))
    assert out.status == "fused", out.text()
    assert file_route
    assert all("per step" in f.validation for f in out.report.findings), [f.validation for f in out.report.findings]


def test_weight_heavy_fusion_is_validated_and_exact():
    """An LSTM of 2 x 8 MB weights fuses through the file route with a validation error in tolerance."""
    o = Opts(op="LSTM", H=512, F=512)
    out = run_case(o, batches=(1, 2), Ts=(1, 4), check_reference=False)
    assert out.status == "fused", out.text()
    found = out.report.findings
    assert found and all(f.validation.startswith("ok") for f in found), [f.validation for f in found]
    assert out.fused_err < 1e-4


MEASURE = r"""
import json, resource, subprocess, sys
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps([p.returncode, p.stderr[-400:], resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))
"""
LIBRARIES = "import numpy, onnx, onnxruntime, rnnfuse.cli, rnnfuse.pipeline, rnnfuse.validate, rnnfuse.passes"


def _peak_mb(*cmd: str) -> tuple[int, str, float]:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, *cmd], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout))


def test_weight_heavy_model_peak_memory_within_3x(tmp_path):
    """Issue 16's memory goal on a weight-heavy single file (a 72 MB Scan LSTM, input = hidden = 1536): fused
    and validated through the command line with a peak resident set, above what the libraries take, of at
    most 3x the file (2.4x when written; ~9x before its weights were borrowed and validation stopped copying
    them). The output matches the original."""
    import os

    import onnxruntime as ort

    from builders import build

    o = Opts(op="LSTM", H=1536, F=1536)
    model, feeds_fn = build(o)
    src, dst = str(tmp_path / "heavy.onnx"), str(tmp_path / "out.onnx")
    onnx.save(model, src)
    size_mb = os.path.getsize(src) / 2**20
    rc, err, peak = _peak_mb("-m", "rnnfuse", "optimize", src, dst)
    assert rc == 0, err
    libraries = _peak_mb("-c", LIBRARIES)[2]
    assert peak - libraries <= 3 * size_mb, f"peak {peak:.0f} MB, libraries {libraries:.0f} MB, file {size_mb:.0f} MB"
    fused = onnx.load(dst)
    assert [n.op_type for n in fused.graph.node].count("LSTM") == 1 and not any(n.op_type == "Scan" for n in fused.graph.node)
    feeds = feeds_fn(np.random.default_rng(1), 2, 5, "none")
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(dst, providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


def _cli(*args: str, cwd=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "rnnfuse", *args], capture_output=True, text=True, cwd=cwd, env=env)


@pytest.mark.parametrize("from_model_dir", [True, False], ids=["from-its-directory", "from-elsewhere"])
def test_nested_external_weights_are_validated(from_model_dir, tmp_path):
    """An external-data model whose Loop body holds the weights (subgraph initializers, relative locations):
    the check model, written elsewhere, reads them in, so the rewrite is validated from any working directory
    (it was declined from the model's directory, and fused unvalidated from elsewhere)."""
    import json

    from builders import build

    model, _ = build(Opts(op="LSTM", front="loop", F=512, H=1024, weights="body_init"))
    d = tmp_path / "m"
    d.mkdir()
    onnx.save(model, str(d / "m.onnx"), save_as_external_data=True, location="m.bin", size_threshold=1024)
    out, rep = str(tmp_path / "o.onnx"), str(tmp_path / "r.json")
    r = _cli("optimize", "m.onnx" if from_model_dir else str(d / "m.onnx"), out, "--json", rep,
             cwd=str(d) if from_model_dir else str(tmp_path))
    assert r.returncode == 0, r.stderr
    found = [f for p in json.load(open(rep))["passes"] for f in p["findings"]]
    assert [f["status"] for f in found] == ["fused"], found
    assert found[0]["validation"].startswith("ok"), found[0]["validation"]


def test_prefer_faster_on_external_data(tmp_path):
    """--prefer-faster times models whose weights are external (the input's) or spilled (new, absolute paths
    onnxruntime refuses in a model given as bytes): both sides load, from the model's directory."""
    import os

    from builders import build

    model, _ = build(Opts(op="LSTM", front="scan", F=512, H=1024, mask="where"))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.bin", size_threshold=1024)
    os.mkdir(tmp_path / "out")
    r = _cli("optimize", "m.onnx", "out/o.onnx", "--prefer-faster", "1", "--seq-len", "5", "-q", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["o.onnx", "o.onnx.data"]


def test_a_verdict_without_prepacking_is_checked_with_it(tmp_path):
    """Weights stored as int8 and cast in the body: without pre-packing the original's matrix products sum in
    another order (3e-5 apart at these magnitudes); a failure seen there is checked again as onnxruntime runs
    by default, where the rewrite is exact, so it is fused (it was declined)."""
    from onnx import numpy_helper

    from builders import build

    model, feeds_fn = build(Opts(op="LSTM", front="scan", F=512, H=1024, weight_cast=True, mask="where"))
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == TensorProto.DOUBLE:  # float64 storage -> int8 storage (the body's Cast to float stays)
            a = np.clip(np.round(numpy_helper.to_array(t) * 50), -127, 127).astype(np.int8)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(a, t.name))
    fused, report = rnnfuse_optimize(model)
    assert [f.status for f in report.findings] == ["fused"], report.to_text()
    assert report.findings[0].validation.startswith("ok"), report.findings[0].validation


def rnnfuse_optimize(model):
    import rnnfuse

    return rnnfuse.optimize(model)


def _strip_lengths(path: str) -> None:
    """Drop the optional ``length`` entry of every external tensor (offsets stay)."""
    from rnnfuse.protos import all_tensors

    m = onnx.load(path, load_external_data=False)
    for t in all_tensors(m):
        kept = [(e.key, e.value) for e in t.external_data if e.key != "length"]
        del t.external_data[:]
        for k, v in kept:
            e = t.external_data.add()
            e.key, e.value = k, v
    with open(path, "wb") as f:
        f.write(m.SerializeToString())


def _two_matmuls():
    """y = (x . A) . B with A (an initializer) and B (a Constant's value) of 64 KiB: nothing to fuse; both stay
    in the output as they were."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((128, 128)).astype(np.float32) for _ in range(2))
    g = helper.make_graph(
        [helper.make_node("Constant", [], ["B"], value=numpy_helper.from_array(b, "B")),
         helper.make_node("MatMul", ["x", "A"], ["xa"]), helper.make_node("MatMul", ["xa", "B"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 128])],
        [numpy_helper.from_array(a, "A")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m, lambda rng: {"x": rng.standard_normal((3, 128)).astype(np.float32)}


@pytest.mark.parametrize("external", ["auto", "never"])
@pytest.mark.parametrize("kind", ["fused", "nothing-to-fuse"])
def test_external_data_without_lengths(kind, external, tmp_path):
    """``length`` is optional in external data: a tensor then takes its dims times its element size, not the
    rest of the file (every tensor but the last took in all those after it: the output did not load)."""
    import onnxruntime as ort

    from builders import build

    if kind == "fused":
        model, feeds_fn = build(Opts(op="LSTM", front="scan", F=64, H=128, mask="where"))
        feeds = feeds_fn(np.random.default_rng(1), 3, 5, "gappy")
    else:
        model, feeds_fn = _two_matmuls()
        feeds = feeds_fn(np.random.default_rng(1))
    src = str(tmp_path / "m.onnx")
    onnx.save(model, src, save_as_external_data=True, location="m.bin", size_threshold=1024, convert_attribute=True)
    _strip_lengths(src)
    out = str(tmp_path / "o.onnx")
    r = _cli("optimize", src, out, "--external-data", external)
    assert r.returncode == 0, r.stderr
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


def test_truncated_external_data_without_lengths(tmp_path):
    """A data file too short for the tensors' dims is bad input (exit 3, one line), not an internal error."""
    import os

    from builders import build

    model, _ = build(Opts(op="LSTM", front="scan", F=64, H=128))
    src = str(tmp_path / "m.onnx")
    onnx.save(model, src, save_as_external_data=True, location="m.bin", size_threshold=1024)
    _strip_lengths(src)
    data = str(tmp_path / "m.bin")
    os.truncate(data, os.path.getsize(data) - 100)
    r = _cli("optimize", src, str(tmp_path / "o.onnx"))
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "truncated" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o.onnx")


def test_terminated_run_leaves_no_temporary_files(tmp_path):
    """SIGTERM while validation's check model (or a spilled weight) sits in the temporary directory: the run
    stops with 143, removes them, and writes no output."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from builders import build

    model, _ = build(Opts(op="LSTM", H=1536, F=1536))
    src, dst, tmp = str(tmp_path / "m.onnx"), str(tmp_path / "o.onnx"), tmp_path / "tmp"
    onnx.save(model, src)
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONWARNINGS="ignore")
    p = subprocess.Popen([sys.executable, "-m", "rnnfuse", "optimize", src, dst, "-q"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(n.startswith("rnnfuse-") for n in os.listdir(tmp)) and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert p.poll() is None, "the run ended before it wrote a temporary file"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err)
    assert os.listdir(tmp) == [], os.listdir(tmp)
    assert not os.path.exists(dst)


@pytest.mark.parametrize("dtype", ["float16", "bool", "int64", "float32", "bfloat16"])
def test_check_model_data_file_holds_any_element_type(dtype):
    """The data file gets every element type's bytes as they are (bfloat16 has no buffer format of its own)."""
    import io

    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        a = np.arange(12).astype(ml_dtypes.bfloat16).reshape(3, 4)
    else:
        a = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    f = io.BytesIO()
    check_session._write_array(f, a)
    assert f.getvalue() == a.tobytes()


def test_the_all_true_mask_patterns_grow_along_each_axis_alone():
    """The run that learns each overridden mask's [T, B] feeds an all-true pattern at least as long as the
    mask along each axis: a static T of 200,000 made it square, 37 GiB; now T by the generated sizes' bound
    where the batch is named, and the longest static extent where an axis is unknown."""
    from rnnfuse import validate as V

    class Shapes:
        @staticmethod
        def shape(name):
            return {"m": [3000, "B", 1], "n": ["B", 5000], "u": [None, "B"]}[name]

    class G:
        model = Shapes()

    fed = {}

    class Session:
        def run(self, _, feeds):
            fed.update((k, v.shape) for k, v in feeds.items())
            return [np.array([3000, 2]), np.array([2, 5000]), np.array([4000, 2])]

    names = ["__rnnfuse_mask_0/shape2", "__rnnfuse_mask_1/shape2", "__rnnfuse_mask_2/shape2"]
    got = V._mask_shapes(G(), Session(), names, {}, {"m": "p0", "n": "p1", "u": "p2"}, None, 7, None)
    least = 4 * 7 + 64
    # (an axis of unknown extent may be as long as any mask's static one: as long as the longest)
    assert fed == {"p0": (3000, least), "p1": (least, 5000), "p2": (5000, least)}
    assert got == {"m": (3000, 2), "n": (2, 5000), "u": (4000, 2)}
    # a group of a bigger check's parts (rnnfuse.check_groups) takes the longest extent of all its masks
    V._mask_shapes(G(), Session(), names, {}, {"m": "p0", "n": "p1", "u": "p2"}, 8000, 7, None)
    assert fed["p2"] == (8000, least)
