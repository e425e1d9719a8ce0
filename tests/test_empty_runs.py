"""A time length of 0 at run time: the fused model answers as the original does (rnnfuse/empty_runs.py).

onnxruntime's GRU without ``sequence_lens`` aborts the whole process on an empty sequence, and its LSTM, GRU
and RNN return zeros as final states where the original loop returns its initial states. Each model runs in a
child process (an abort there fails the test, not the test run): the fused model must answer for T = 0, and
give what the original gives where the original answers (onnxruntime's Scan refuses an empty sequence; some
exporters' graphs fail there too). A recurrence over a known number of steps gets none of these guards."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import onnx
import pytest
from builders import Opts, build

import rnnfuse

_RUN = """
import sys, numpy as np, onnxruntime as ort
path, feeds, out = sys.argv[1:4]
s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
f = dict(np.load(feeds))
np.savez(out, *s.run(None, {k: f[k] for k in (i.name for i in s.get_inputs())}))
"""


def _run_apart(tmp_path, name: str, model: onnx.ModelProto, feeds: dict):
    """The model's outputs on ``feeds``, computed in a child process: ``(0, outputs)``, or the child's return
    code and the end of what it wrote to stderr."""
    path, fpath, out = tmp_path / f"{name}.onnx", tmp_path / f"{name}_in.npz", tmp_path / f"{name}_out.npz"
    onnx.save(model, path)
    np.savez(fpath, **feeds)
    p = subprocess.run([sys.executable, "-c", _RUN, str(path), str(fpath), str(out)], capture_output=True, timeout=300)
    if p.returncode != 0:
        return p.returncode, p.stderr.decode(errors="replace")[-300:]
    z = np.load(out)
    return 0, [z[f"arr_{i}"] for i in range(len(z.files))]


CASES = [
    Opts(op="GRU", front="loop"),
    Opts(op="GRU", front="scan", lbr=1),
    Opts(op="GRU", front="loop", init="input"),
    Opts(op="GRU", front="loop", layers="bidir", direction="forward"),
    Opts(op="LSTM", front="loop", init="input"),
    Opts(op="LSTM", front="scan", init="fill"),
    Opts(op="RNN", front="scan", init="input"),
    Opts(op="RNN", front="loop", init="zeros"),
]


def _assert_same(got: list, want: list) -> None:
    """Equal outputs; an empty one equal to an empty one of the same rank (a Loop that ran no iteration
    stacks its outputs as [0, 0, H]: the size of a step it never saw is 0; the native op's is [0, B, H])."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w.size == 0:
            assert g.size == 0 and g.ndim == w.ndim
            continue
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=1e-6)


_PROBED: dict[str, bool] = {}


def _runtime_runs_no_steps(op: str, tmp_path) -> bool:
    """Whether this onnxruntime runs ``op`` as rnnfuse emits it (a GRU with ``sequence_lens``) over no step:
    before 1.26 its RNN crashes the process there (segmentation fault, with lengths or without), which no input
    of the op avoids; measured: 1.18-1.25.1 crash, 1.26.0-1.32.0 run."""
    if op not in _PROBED:
        from onnx import TensorProto, helper, numpy_helper

        gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
        inits = [numpy_helper.from_array(np.ones((1, gates * 2, 2), np.float32), "W"),
                 numpy_helper.from_array(np.ones((1, gates * 2, 2), np.float32), "R")]
        inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", 2]),
                  helper.make_tensor_value_info("L", TensorProto.INT32, ["B"])]
        node = helper.make_node(op, ["X", "W", "R", "", "L"], ["Y", "Y_h"], hidden_size=2)
        graph = helper.make_graph([node], "probe", inputs, [helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)],
                                  inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        feeds = {"X": np.zeros((0, 2, 2), np.float32), "L": np.zeros(2, np.int32)}
        _PROBED[op] = _run_apart(tmp_path, f"probe_{op}", model, feeds)[0] == 0
    return _PROBED[op]


@pytest.mark.parametrize("o", CASES, ids=lambda o: o.label())
def test_no_steps_answered_as_the_original(o, tmp_path):
    if not _runtime_runs_no_steps(o.op, tmp_path):
        import onnxruntime

        pytest.skip(f"onnxruntime {onnxruntime.__version__}'s own {o.op} crashes on no steps (fixed in 1.26)")
    model, feeds_fn = build(o)
    fused, _ = rnnfuse.optimize(model)
    natives = sum(Counter(n.op_type for n in fused.graph.node)[k] for k in ("LSTM", "GRU", "RNN"))
    assert natives >= 1 and not any(n.op_type in ("Loop", "Scan") for n in fused.graph.node)
    for batch in (1, 3):
        feeds = feeds_fn(np.random.default_rng(0), batch, 0, "none")
        rc, got = _run_apart(tmp_path, "fused", fused, feeds)
        assert rc == 0, f"the fused model fails on T = 0 (exit {rc}): {got}"
        rc, want = _run_apart(tmp_path, "original", model, feeds)
        if rc == 0:  # (onnxruntime's Scan cannot slice an empty sequence: the original raises, the fused answers)
            _assert_same(got, want)
        # and at a few steps the guards change nothing
        feeds = feeds_fn(np.random.default_rng(1), batch, 5, "none")
        _, want = _run_apart(tmp_path, "original", model, feeds)
        _, got = _run_apart(tmp_path, "fused", fused, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5)


def test_initial_states_are_kept_on_no_steps(tmp_path):
    """The case the guard is for: given initial states (not zeros) come back as the final states."""
    o = Opts(op="LSTM", front="loop", init="input")
    model, feeds_fn = build(o)
    fused, _ = rnnfuse.optimize(model)
    feeds = feeds_fn(np.random.default_rng(0), 2, 0, "none")
    assert any(np.abs(v).max() > 0 for k, v in feeds.items() if k != "X")  # (the states fed are not zeros)
    _, got = _run_apart(tmp_path, "fused", fused, feeds)
    _, want = _run_apart(tmp_path, "original", model, feeds)
    assert any(w.size and np.abs(w).max() > 0 for w in want)
    _assert_same(got, want)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_known_length_adds_no_guard(op):
    """A recurrence over a declared number of steps gets no lengths and no guard."""
    o = Opts(op=op, front="loop", init="input", static_T=5)
    model, _ = build(o)
    fused, _ = rnnfuse.optimize(model)
    natives = [n for n in fused.graph.node if n.op_type == op]
    assert len(natives) == 1
    assert len(natives[0].input) <= 4 or not natives[0].input[4]
    assert not any(n.op_type == "Greater" for n in fused.graph.node)


@pytest.mark.parametrize("reverse_form", ["flip", "revseq", "index", "negindex"])
def test_bidirectional_gru_halves_still_pair(reverse_form, tmp_path):
    """Both halves read full lengths of one x (built alike, merged by Dedupe): one bidirectional GRU, which
    answers on no steps as the original does and matches it on some."""
    o = Opts(op="GRU", front="loop", layers="bidir", reverse_form=reverse_form)
    model, feeds_fn = build(o)
    fused, _ = rnnfuse.optimize(model)
    grus = [n for n in fused.graph.node if n.op_type == "GRU"]
    assert len(grus) == 1 and not any(n.op_type == "Loop" for n in fused.graph.node)
    assert [a.s for a in grus[0].attribute if a.name == "direction"] == [b"bidirectional"]
    assert len(grus[0].input) > 4 and grus[0].input[4]
    for T in (0, 4):
        feeds = feeds_fn(np.random.default_rng(T), 2, T, "none")
        rc, got = _run_apart(tmp_path, "fused", fused, feeds)
        assert rc == 0, got
        rc, want = _run_apart(tmp_path, "original", model, feeds)
        if rc == 0:
            _assert_same(got, want)


def _flipped_rnn(lengths: str) -> onnx.ModelProto:
    """An RNN over x read backwards (a Slice with step -1), given ``sequence_lens``: ``"full"`` x's time length
    for every row, as an exporter builds it from x's shape (Expand(Cast(Shape(x)[0:1]), Shape(x)[1:2])),
    ``"short"`` the same less one (every row but its last step), or ``"input"`` a graph input (any lengths)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(1, 3, 2)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(size=(1, 3, 3)).astype(np.float32), "R"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.array([np.iinfo(np.int64).min], np.int64), "start_of_time"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([2], np.int64), "two")]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", 2])]
    nodes = [helper.make_node("Slice", ["X", "minus1", "start_of_time", "zero", "minus1"], ["X_flipped"])]
    if lengths in ("full", "short"):
        nodes += [helper.make_node("Shape", ["X"], ["shape"]),
                  helper.make_node("Slice", ["shape", "zero", "one"], ["all_steps"]),
                  helper.make_node("Sub" if lengths == "short" else "Identity",
                                   ["all_steps", "one"] if lengths == "short" else ["all_steps"], ["steps64"]),
                  helper.make_node("Cast", ["steps64"], ["steps"], to=TensorProto.INT32),
                  helper.make_node("Slice", ["shape", "one", "two"], ["batch"]),
                  helper.make_node("Expand", ["steps", "batch"], ["L"])]
    else:
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, ["B"]))
    nodes.append(helper.make_node("RNN", ["X_flipped", "W", "R", "", "L"], ["Y", "Y_h"], hidden_size=3))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "Y_h")]
    graph = helper.make_graph(nodes, "flipped_rnn", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_full_lengths_any_exporter_wrote_are_turned_around():
    """An op reading its input backwards with lengths that run every row whole becomes the op of the other
    direction reading the input as it is, whoever built the lengths (known from the graph, not from a record
    of what rnnfuse emitted); any other lengths are kept as they are (reversing the whole axis is no per-row
    reversal then)."""
    import onnxruntime as ort

    model = _flipped_rnn("full")
    fused, report = rnnfuse.optimize(model)
    rnns = [n for n in fused.graph.node if n.op_type == "RNN"]
    assert len(rnns) == 1 and rnns[0].input[0] == "X"
    assert [a.s for a in rnns[0].attribute if a.name == "direction"] == [b"reverse"]
    x = np.random.default_rng(1).normal(size=(5, 3, 2)).astype(np.float32)
    run = lambda m, f: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)
    for got, want in zip(run(fused, {"X": x}), run(model, {"X": x})):
        np.testing.assert_allclose(got, want, atol=1e-6)

    for lengths in ("input", "short"):
        kept = _flipped_rnn(lengths)
        out, _ = rnnfuse.optimize(kept)
        assert out.SerializeToString() == kept.SerializeToString(), lengths  # (nothing fused: handed back as given)
