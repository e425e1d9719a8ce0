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
    assert (rep["fused"], rep["merged"], rep["declined"]) == (3, 1, [])
    assert rep["ops_before"]["Loop"] == 3 and "Loop" not in rep["ops_after"]
    # the command's phases around the passes, in the order they ran (the passes' own time is "seconds")
    assert list(rep["phases"]) == ["load", "guard", "write"]
    assert all(isinstance(v, float) and v >= 0 for v in rep["phases"].values())
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
    assert "no recurrences found" in p.stdout and "byte-for-byte copy" in p.stdout
    assert (tmp_path / "o.onnx").read_bytes() == src.read_bytes()


def test_cleanups_alone_never_change_a_model(tmp_path):
    """A constant-condition If is inlined to expose recurrences; with nothing to fuse the input comes out as
    it went in, even though the clean-up pass changed the graph. (The MatMul, a weight product no recurrence
    uses, keeps the model from being copied unexamined: the passes must run.)"""
    out_shape = helper.make_tensor_value_info("v", TensorProto.FLOAT, [2])
    branch = lambda val: helper.make_graph(
        [helper.make_node("Constant", [], ["v"], value=helper.make_tensor("c", TensorProto.FLOAT, [2], val))], "b", [], [out_shape])
    g = helper.make_graph(
        [
            helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
            helper.make_node("If", ["cond"], ["v"], then_branch=branch([1.0, 2.0]), else_branch=branch([3.0, 4.0])),
            helper.make_node("Add", ["x", "v"], ["s"]),
            helper.make_node("MatMul", ["s", "w"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 0.5, -0.5, 2.0])],
    )
    src, rep = _optimized_report(tmp_path, g, "if.onnx")
    assert any(ps["modified"] for ps in rep["passes"] if ps["name"] == "inline-ifs"), rep["passes"]
    assert (tmp_path / "o.onnx").read_bytes() == src.read_bytes()
    assert rep["ops_after"] == rep["ops_before"]


def _state_named_like_its_input() -> onnx.ModelProto:
    """An unrolled tanh cell whose first step writes its state under the name of the initial-state input
    ('h0', as a generator numbering its steps from 0 would): not single-assignment, a cycle through step 0."""
    nodes, h = [], "h0"
    for t in range(3):
        nodes += [helper.make_node("Constant", [], [f"t{t}"], value=helper.make_tensor("i", TensorProto.INT64, [], [t])),
                  helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"]),
                  helper.make_node("MatMul", [f"x{t}", "w"], [f"xw{t}"]),
                  helper.make_node("MatMul", [h, "r"], [f"hr{t}"]),
                  helper.make_node("Add", [f"xw{t}", f"hr{t}"], [f"s{t}"]),
                  helper.make_node("Tanh", [f"s{t}"], [f"h{t}"])]
        h = f"h{t}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1, 2]),
                                       helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor(n, TensorProto.FLOAT, [2, 2], [0.5, -0.5, 0.25, 1.0]) for n in ("w", "r")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda d: d / "missing.onnx", ["not found", "missing.onnx"]),
        (lambda d: d, ["directory"]),
        (lambda d: _write(d / "empty.onnx", b""), ["empty"]),
        (lambda d: _write(d / "text.onnx", b"this is not a model\n" * 20), ["not a valid ONNX model"]),
        (lambda d: _write(d / "trunc.onnx", EXAMPLE.read_bytes()[: EXAMPLE.stat().st_size // 2]), ["not a valid ONNX model"]),
        (lambda d: _write(d / "graphless.onnx", onnx.ModelProto(ir_version=8).SerializeToString()), ["not an ONNX model"]),
        (lambda d: _save(d / "ssa.onnx", _state_named_like_its_input()), ["not a valid ONNX model", "'h0'"]),
    ],
    ids=["missing", "directory", "empty", "not-onnx", "truncated", "no-graph", "name-defined-twice"],
)
def test_bad_input(tmp_path, make, words):
    src = make(tmp_path)
    out = tmp_path / "out.onnx"
    out.write_bytes(b"precious")  # an existing output survives a failed run, even with --force
    p = run("optimize", src, out, "--force")
    assert_one_line_error(p, 3, *words)
    assert out.read_bytes() == b"precious"
    assert [f for f in os.listdir(tmp_path) if f.startswith(".rnnfuse")] == []


def _ml_only_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [3])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [3])
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_int64s=[1, 2], values_strings=["a", "b"],
                            default_string="?")
    m = helper.make_model(helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("ai.onnx.ml", 2)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: tiny_model(opset=5, ir=3), ["opset 5"]),
        (lambda: tiny_model(opset=1, ir=3), ["opset 1"]),
        (_ml_only_model, ["no default-domain"]),
        (lambda: tiny_model(opset=99), ["opset 99"]),
        (lambda: tiny_model(ir=99), ["IR version 99"]),
    ],
    ids=["opset-5", "opset-1", "ai.onnx.ml-only", "future-opset", "future-ir"],
)
def test_models_rnnfuse_cannot_work_on_pass_through(tmp_path, make, words):
    """A valid model rnnfuse cannot work on is not an error: it is copied unchanged, with a note (exit 0);
    --strict says it was not examined."""
    src = _save(tmp_path / "m.onnx", make())
    p = run("optimize", src, tmp_path / "o.onnx")
    assert p.returncode == 0, p.stderr
    assert "passed through unchanged" in p.stdout and all(w in p.stdout for w in words), p.stdout
    assert (tmp_path / "o.onnx").read_bytes() == src.read_bytes()
    p = run("inspect", src)
    assert p.returncode == 0 and "passed through unchanged" in p.stdout
    p = run("optimize", src, tmp_path / "o2.onnx", "--strict")
    assert_one_line_error(p, 5, "not examined")


def test_existing_output_is_replaced_only_with_force(tmp_path):
    """Swapped arguments (optimize fused.onnx model.onnx) must not destroy the user's model."""
    fused = tmp_path / "fused.onnx"
    assert run("optimize", EXAMPLE, fused).returncode == 0
    original = _write(tmp_path / "model.onnx", EXAMPLE.read_bytes())
    p = run("optimize", fused, original)
    assert_one_line_error(p, 4, "already exists", "--force")
    assert original.read_bytes() == EXAMPLE.read_bytes()
    p = run("optimize", EXAMPLE, fused)
    assert_one_line_error(p, 4, "already exists")
    for flag in ("--force", "-f"):
        p = run("optimize", EXAMPLE, fused, flag)
        assert p.returncode == 0, p.stderr
    assert op_counts(onnx.load(fused)).get("Loop", 0) == 0


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _optimized_report(tmp_path: Path, graph: onnx.GraphProto, name: str) -> tuple[Path, dict]:
    """The model of ``graph`` (opset 17) saved as ``name``, optimized by the CLI to o.onnx: its path and the
    JSON report."""
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    src = _save(tmp_path / name, m)
    p = run("optimize", src, tmp_path / "o.onnx", "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    return src, json.loads((tmp_path / "r.json").read_text())


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


def test_an_output_data_file_is_never_the_inputs_nor_replaced_without_force(tmp_path):
    """``optimize a.onnx b.onnx`` where a.onnx keeps its tensors in b.onnx.data: the output's tensors would go to
    b.onnx.data, corrupting a.onnx, so the run refuses (--force or not), writes nothing and leaves a.onnx as it
    was; an unrelated existing OUT.onnx.data is replaced only with --force; --in-place replaces the input's
    own data file."""
    m = onnx.load(EXAMPLE)
    src = tmp_path / "a.onnx"
    onnx.save(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="b.onnx.data",
              size_threshold=64)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    x = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)
    x[1, 3:] = 0.0  # (a padded row: the model masks zero steps)
    feeds = {m.graph.input[0].name: x}
    want = session(onnx.load(str(src))).run(None, feeds)
    for flags in ((), ("--force",)):
        p = run("optimize", src, tmp_path / "b.onnx", *flags)
        assert_one_line_error(p, 4, "b.onnx.data", "input's tensors", "corrupt")
        assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before
    decoy = _write(tmp_path / "c.onnx.data", b"someone else's file")
    p = run("optimize", src, tmp_path / "c.onnx")
    assert_one_line_error(p, 4, "c.onnx.data", "already exists", "--force")
    assert decoy.read_bytes() == b"someone else's file" and not (tmp_path / "c.onnx").exists()
    for out in (tmp_path / "c.onnx", src):  # (replaced with --force; the input's own files with --in-place)
        p = run("optimize", src, out, "--force", *(("--in-place",) if out == src else ()))
        assert p.returncode == 0, p.stderr
        got = session(onnx.load(str(out))).run(None, feeds)
        assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(got, want))


@pytest.mark.parametrize("linked", [False, True], ids=["file", "symlink"])
def test_every_tensor_stored_externally_fuses_as_if_held_inline(tmp_path, linked):
    """``onnx.save(size_threshold=0)`` puts every initializer in the data file, an Unsqueeze's axes and a
    Reshape's target too. Shape inference reads no file, so the masks' rank was unknown and every masked layer
    of the example was declined; the small tensors are now read in on load. The fused model gives the
    original's outputs, and loads where the input does not (onnxruntime's inference cannot read those
    tensors either). ``symlink``: the data file is a link to another file, as in a Hugging Face cache (onnx's
    own reader refuses links: the run crashed)."""
    m = onnx.load(EXAMPLE)
    src = tmp_path / "in.onnx"
    onnx.save(onnx.load(EXAMPLE), str(src), save_as_external_data=True, all_tensors_to_one_file=True,
              location="in.onnx.data", size_threshold=0)
    if linked:
        os.replace(tmp_path / "in.onnx.data", tmp_path / "blob")
        os.symlink(tmp_path / "blob", tmp_path / "in.onnx.data")
    stored = onnx.load(str(src), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in stored.graph.initializer)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4)).astype(np.float32)
    x[1, 3:] = 0.0  # (post-padded, pre-padded and gappy rows: the model masks zero steps)
    x[2, :2] = 0.0
    x[0, 2] = 0.0
    feeds = {m.graph.input[0].name: x}
    want = session(m).run(None, feeds)
    out = tmp_path / "out.onnx"
    p = run("optimize", src, out, "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    before, after = op_counts(m), op_counts(onnx.load(str(out)))
    assert before.get("Loop", 0) > 0 and after.get("Loop", 0) == 0, after
    got = session(onnx.load(str(out))).run(None, feeds)
    assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(got, want))


def test_nothing_to_fuse_stored_externally_keeps_its_small_tensors_where_they_were(tmp_path):
    """A model with nothing to fuse whose every tensor is external data comes out as it went in: the small
    tensors the run reads in (to infer types) stay in the output's data file, each tensor with its bytes."""
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
                          [onnx.numpy_helper.from_array(np.array([3, 4], np.int64), "shape"),
                           onnx.numpy_helper.from_array(np.arange(20, dtype=np.float32).reshape(4, 5), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    src = tmp_path / "in.onnx"
    onnx.save(onnx.ModelProto.FromString(m.SerializeToString()), str(src), save_as_external_data=True,
              all_tensors_to_one_file=True, location="in.onnx.data", size_threshold=0)
    p = run("optimize", src, tmp_path / "out.onnx")
    assert p.returncode == 0, p.stderr
    out = onnx.load(str(tmp_path / "out.onnx"), load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in out.graph.initializer)
    whole = onnx.load(str(tmp_path / "out.onnx"))
    assert [onnx.numpy_helper.to_array(t).tolist() for t in whole.graph.initializer] == \
        [onnx.numpy_helper.to_array(t).tolist() for t in m.graph.initializer]


def test_integer_tensors_written_with_external_data_stay_inline(tmp_path):
    """With external data, a tensor of EXTERNAL_THRESHOLD bytes or more goes to the data file, but not an
    integer one an op reads as sizes: onnxruntime's load infers shapes from its data and cannot read it from a
    file (a merged 1,000-step chain's Split sizes: the output did not load). A float weight as big still goes."""
    import onnxruntime as ort

    from rnnfuse import model_io

    steps = 300  # (2,400 bytes of split sizes)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 300)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]),
         helper.make_node("Split", ["xw", "sizes"], [f"p{k}" for k in range(steps)], axis=1),
         helper.make_node("Concat", [f"p{k}" for k in reversed(range(steps))], ["y"], axis=1)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, steps])],
        [onnx.numpy_helper.from_array(np.ones(steps, np.int64), "sizes"), onnx.numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    out = tmp_path / "out.onnx"
    model_io.save(onnx.ModelProto.FromString(m.SerializeToString()), str(out), external=True)
    stored = {t.name: t.data_location for t in onnx.load(str(out), load_external_data=False).graph.initializer}
    assert stored == {"sizes": TensorProto.DEFAULT, "w": TensorProto.EXTERNAL}
    x = rng.standard_normal((2, 4)).astype(np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, (x @ w)[:, ::-1], rtol=1e-6, atol=1e-6)


def test_initializers_that_are_inputs_are_no_weights_and_the_report_says_so(tmp_path):
    """An unrolled chain whose weights are also graph inputs (torch's keep_initializers_as_inputs=True): a
    caller may feed other weights, so nothing is fused, the output is the input's bytes, and the report says
    why (the chain front end has no decline of its own to give: it finds no recurrence over runtime weights).
    The same chain without them as inputs fuses, and its report has no such note."""
    import builders as B

    m, _ = B.build(B.Opts(op="RNN", front="chain", static_T=4))
    plain = _save(tmp_path / "plain.onnx", m)
    weights = [t.name for t in m.graph.initializer if len(t.dims) >= 2]
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                         for t in m.graph.initializer if t.name in weights)
    exposed = _save(tmp_path / "exposed.onnx", m)
    p = run("optimize", exposed, tmp_path / "out.onnx")
    assert p.returncode == 0, p.stderr
    assert "initializer(s) are also graph inputs" in p.stdout and "keep_initializers_as_inputs=False" in p.stdout
    assert (tmp_path / "out.onnx").read_bytes() == exposed.read_bytes()
    p = run("optimize", plain, tmp_path / "fused.onnx")
    assert p.returncode == 0 and "graph inputs" not in p.stdout, p.stdout
    assert op_counts(onnx.load(str(tmp_path / "fused.onnx")))["RNN"] == 1


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
    assert "already native (LSTM 1, GRU 1)" in p.stdout
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


def _onnxruntime_loads(model: onnx.ModelProto) -> bool:
    import onnxruntime as ort

    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:
        return False


def test_newest_ir_version_is_kept_whatever_onnxruntime_accepts(tmp_path):
    """The newest IR version this onnx writes: onnxruntime 1.31 refuses IR 14, 1.32 loads it. Either way the
    rewrite happens and the IR version is kept; validation ran exactly when onnxruntime can load the model."""
    from builders import Opts, build

    model, _ = build(Opts(op="GRU", lbr=1))
    model.ir_version = onnx.IR_VERSION
    src = _save(tmp_path / "newest_ir.onnx", model)
    p = run("optimize", src, tmp_path / "o.onnx", "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    fused = [f for ps in rep["passes"] for f in ps["findings"] if f["status"] == "fused"]
    assert fused
    if _onnxruntime_loads(model):
        assert fused[0]["validation"].startswith("ok"), fused[0]
    else:
        assert fused[0]["validation"].startswith("skipped") and "onnxruntime" in fused[0]["validation"], fused[0]
    assert onnx.load(tmp_path / "o.onnx").ir_version == onnx.IR_VERSION


def _with_custom_op(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its sequence input computed by a node of a domain no runtime implements (a custom op
    feeding the recurrence): onnxruntime cannot run the original at all."""
    g = model.graph
    x = g.input[0]
    raw = x.name + "_raw"
    g.node.insert(0, helper.make_node("Mystery", [raw], [x.name], domain="com.example.custom"))
    declared = g.value_info.add()
    declared.CopyFrom(x)  # the custom op's output type is declared, as exporters do
    x.name = raw
    model.opset_import.append(helper.make_opsetid("com.example.custom", 1))
    return model


def test_model_onnxruntime_cannot_load(tmp_path):
    """A model with a custom op onnxruntime does not know: the rewrite rests on the symbolic proof, validation
    says it was skipped and why, and the custom op is kept."""
    from builders import Opts, build

    model, _ = build(Opts(op="GRU", lbr=1))
    model = _with_custom_op(model)
    assert not _onnxruntime_loads(model)
    src = _save(tmp_path / "custom.onnx", model)
    p = run("optimize", src, tmp_path / "o.onnx", "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    fused = [f for ps in rep["passes"] for f in ps["findings"] if f["status"] == "fused"]
    assert fused and fused[0]["validation"].startswith("skipped"), fused
    assert "onnxruntime cannot run the original" in fused[0]["validation"], fused[0]
    out = onnx.load(tmp_path / "o.onnx")
    assert op_counts(out)["GRU"] == 1 and op_counts(out)["Mystery"] == 1



def _external_constant_model(tmp_path: Path, fusable: bool) -> tuple[Path, dict, list]:
    """Every weight a Constant whose tensor ``onnx.save(convert_attribute=True)`` stores as external data
    (valid ONNX), and a Constant read by two identical MatMuls (Dedupe asks its value); ``fusable``: an
    unrolled RNN chain whose weights are such Constants (the signer and the emitter read them). Returns the
    saved path, feeds, and onnxruntime's outputs."""
    import builders as B
    from onnx import numpy_helper

    if fusable:
        m, feeds_fn = B.build(B.Opts(op="RNN", front="chain", static_T=4))
        feeds, src = feeds_fn(np.random.default_rng(0), 3, 4), "h_T"
    else:
        m = helper.make_model(helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])], []),
                              opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        feeds, src = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}, "x"
    g = m.graph
    consts = [helper.make_node("Constant", [], [t.name], value=t) for t in g.initializer]
    del g.initializer[:]
    c = numpy_helper.from_array(np.arange(512, dtype=np.float32).reshape(4, 128) * 0.01, "Cval")
    consts.append(helper.make_node("Constant", [], ["C"], value=c))
    nodes = consts + list(g.node) + [helper.make_node("MatMul", [src, "C"], ["e1"]), helper.make_node("MatMul", [src, "C"], ["e2"]),
                                     helper.make_node("Add", ["e1", "e2"], ["E"])]
    del g.node[:]
    g.node.extend(nodes)
    g.output.extend([helper.make_tensor_value_info("E", TensorProto.FLOAT, None)])
    ref = session(m).run(None, feeds)
    d = tmp_path / "model"
    d.mkdir()
    onnx.save(m, str(d / "in.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="in.data",
              size_threshold=0, convert_attribute=True)
    stored = onnx.load(str(d / "in.onnx"), load_external_data=False)
    assert all(n.attribute[0].t.data_location == TensorProto.EXTERNAL for n in stored.graph.node if n.op_type == "Constant")
    return d / "in.onnx", feeds, ref


@pytest.mark.parametrize("decoy", [False, True], ids=["plain", "decoy"])
@pytest.mark.parametrize("fusable", [False, True], ids=["nothing-to-fuse", "chain"])
def test_constant_stored_externally_is_read_from_the_models_directory(tmp_path, fusable, decoy):
    """Its values come from the model's directory whatever the working directory is (reading it there crashed
    the run), also when the working directory holds a file of the same name with other values."""
    import onnxruntime as ort

    path, feeds, ref = _external_constant_model(tmp_path, fusable)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if decoy:
        (elsewhere / "in.data").write_bytes(np.full(1 << 14, 7, np.float32).tobytes())
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    p = run("optimize", path, out, cwd=elsewhere)
    assert p.returncode == 0, p.stdout + p.stderr
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=1e-5)
    fused = onnx.load(str(out), load_external_data=False)
    assert op_counts(fused).get("RNN", 0) == (1 if fusable else 0), p.stdout


def test_json_report_of_many_findings_is_the_report_one_finding_a_line(tmp_path):
    """A model of many Loops with no cell: each is declined with its reason; the JSON report holds every
    finding (the report's own fields), one a line, and parses to what json's own encoder gives."""
    from dataclasses import fields

    import rnnfuse.cli as cli
    from rnnfuse.findings import Finding, Report

    vi = helper.make_tensor_value_info
    nodes, cur = [], "x"
    for i in range(30):
        body = helper.make_graph(
            [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Tanh", ["v_in"], ["v_out"])],
            f"body{i}", [vi("it", TensorProto.INT64, []), vi("c_in", TensorProto.BOOL, []), vi("v_in", TensorProto.FLOAT, None)],
            [vi("c_out", TensorProto.BOOL, []), vi("v_out", TensorProto.FLOAT, None)])
        nodes.append(helper.make_node("Loop", ["trip", "cond", cur], [f"l{i}"], body=body))
        cur = f"l{i}"
    inits = [onnx.numpy_helper.from_array(np.array(2, np.int64), "trip"),
             onnx.numpy_helper.from_array(np.array(True), "cond")]
    m = helper.make_model(helper.make_graph(nodes, "loops", [vi("x", TensorProto.FLOAT, ["B", 4])],
                                            [vi(cur, TensorProto.FLOAT, ["B", 4])], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    src, out, js = tmp_path / "loops.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(m, src)
    assert cli.main(["optimize", str(src), str(out), "-q", "--json", str(js)]) == 0
    text = js.read_text()
    d = json.loads(text)
    found = [f for p in d["passes"] for f in p["findings"]]
    assert len(found) >= 30 and {f["where"] for f in found} >= {f"l{i}" for i in range(30)}
    assert all(f["status"] == "declined" and f["reason"] for f in found)
    assert set(found[0]) == {f.name for f in fields(Finding)}
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith('{"pass_name"')) == len(found)
    # every decline and its reason also at the top, one a line, for a tool that reads no pass
    assert d["fused"] == d["merged"] == 0
    assert d["declined"] == [{"front": f["front"], "where": f["where"], "reason": f["reason"]} for f in found]
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith('{"front"')) == len(found)
    # strings that look like the writer's own markers, quotes, newlines, non-ASCII: the same JSON either way
    r = Report()
    r.notes = ['"rnnfuse-findings-0"', "a\nb", "ü"]
    d2 = r.to_dict()
    d2["passes"] = [{"name": "p", "findings": [Finding("p", "Loop", 'w"}, {', "declined", "x\ny").to_dict()]},
                    {"name": "q", "findings": []}]
    d2["declined"] = [{"front": "Loop", "where": 'w"}, {', "reason": "x\ny"}]
    assert json.loads(cli._json_text(d2)) == json.loads(json.dumps(d2))


def test_a_model_with_nothing_to_fuse_reports_no_phases(tmp_path):
    # its bytes say no pass has anything to do: it is copied, nothing is loaded, guarded or written anew
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    src, rep = _optimized_report(tmp_path, g, "relu.onnx")
    assert "phases" not in rep and (tmp_path / "o.onnx").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("original_wins", [False, True])
def test_prefer_faster_reports_every_phase_whichever_form_wins(tmp_path, monkeypatch, original_wins):
    # a form kept as it was runs the passes again and hands back a new report: the load is still in it
    import builders as B
    from rnnfuse import bench, cli

    m, _ = B.build(B.Opts(op="LSTM", front="scan", F=4, H=8, mask="where"))
    src = _save(tmp_path / "m.onnx", m)
    times = {"native": [2.0], "original": [1.0]} if original_wins else {"native": [1.0], "original": [2.0]}
    monkeypatch.setattr(bench, "time_side_by_side", lambda sessions, feeds, runs, warmup: times)
    assert cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), "--prefer-faster", "1", "--seq-len", "3",
                     "--json", str(tmp_path / "r.json"), "-q"]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert list(rep["phases"]) == ["load", "timing", "guard", "write"]
    kept = op_counts(onnx.load(str(tmp_path / "o.onnx"))).get("LSTM", 0) == 0
    assert kept == original_wins
