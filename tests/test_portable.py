"""What rnnfuse writes on native ops for other runtimes (issue 18), without needing OpenVINO itself.

* Activation attributes: a native op rnnfuse writes carries ``activations`` / ``activation_alpha`` /
  ``activation_beta`` / ``clip`` only when they differ from ONNX's defaults (OpenVINO runs an op with an
  explicit list, even a default one, as a generic loop instead of its sequence kernel). Also for native ops
  rnnfuse rewrites (a merged pair, a reversed input) that the exporter wrote with explicit defaults.
* ``--portable``: a fusion whose native op OpenVINO cannot compile (activations other than Sigmoid, Tanh,
  Relu; tests/test_openvino.py checks that list against OpenVINO itself) is declined with that reason and the
  recurrence keeps its form; without it the fusion is applied and its finding warns, in the text report and
  the JSON.
* Masks under ``--portable``: OpenVINO's sequence kernel ignores ``sequence_lens`` (dynamic shapes), so a
  masked reverse layer becomes a forward op over each row's valid steps reversed, and a masked LSTM whose
  final cell state is used (only ``Y_c`` holds it) is declined; without ``--portable`` both warn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import builders as B
import rnnfuse
from helpers import assert_close, session
from rnnfuse.graph import attr

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ACT_ATTRS = ("activations", "activation_alpha", "activation_beta", "clip")
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_NAMES = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
HS = ("HardSigmoid", (0.3, 0.4))


def _natives(model: onnx.ModelProto) -> list:
    return [n for n in model.graph.node if n.op_type in ("LSTM", "GRU", "RNN")]


def _act_attrs(node) -> dict:
    return {k: attr(node, k) for k in ACT_ATTRS if attr(node, k) is not None}


# ------------------------------------------------------------------------------------------------------
# ops rnnfuse fuses from Scan / Loop recurrences

_FUSED = {
    "lstm_default": (B.Opts(op="LSTM"), {}),
    "gru_default": (B.Opts(op="GRU", lbr=1, front="loop"), {}),
    "rnn_default": (B.Opts(op="RNN"), {}),
    "lstm_default_masked_reverse": (B.Opts(op="LSTM", mask="where", direction="reverse"), {}),
    "rnn_relu": (B.Opts(op="RNN", acts=(("Relu", ()),)), {"activations": ["Relu"]}),
    "gru_relu": (B.Opts(op="GRU", acts=(("Sigmoid", ()), ("Relu", ()))), {"activations": ["Sigmoid", "Relu"]}),
    "lstm_hard_sigmoid": (
        B.Opts(op="LSTM", acts=(HS, ("Tanh", ()), ("Tanh", ()))),
        {"activations": ["HardSigmoid", "Tanh", "Tanh"], "activation_alpha": [0.3], "activation_beta": [0.4]},
    ),
    "lstm_clip": (B.Opts(op="LSTM", clip=0.9), {"clip": 0.9}),
}


@pytest.mark.parametrize("name", list(_FUSED))
def test_fused_op_writes_only_non_default_activations(name):
    o, want = _FUSED[name]
    out = B.run_case(o)
    assert out.status == "fused", out.text()
    assert not out.fused_mismatch, out.fused_mismatch
    (node,) = _natives(out.fused)
    got = _act_attrs(node)
    assert set(got) == set(want), f"{node.op_type} attributes {got}, expected {want}\n{out.text()}"
    assert got.get("activations") == want.get("activations")
    for k in ("activation_alpha", "activation_beta", "clip"):
        if k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


# ------------------------------------------------------------------------------------------------------
# native ops the exporter wrote (tf2onnx spells out the defaults), rewritten by rnnfuse


def _native_pair_model(op: str, names: list | None, alphas=None, betas=None, reversed_input: bool = False, seed=0):
    """Native ops over the same X written with explicit ``activations``: a forward and a reverse one (merged
    into one bidirectional op), or with ``reversed_input`` one forward op reading X flipped in time (turned
    into a reverse op)."""
    rng = np.random.default_rng(seed)
    T, F, H = 5, 3, 4
    G = GATES[op]
    inits, nodes, outs = [], [], []
    x = "X"
    if reversed_input:
        for k, v in (("starts", -1), ("ends", -(2**63)), ("axes", 0), ("steps", -1)):
            inits.append(helper.make_tensor(k, TensorProto.INT64, [1], [v]))
        nodes.append(helper.make_node("Slice", ["X", "starts", "ends", "axes", "steps"], ["Xr"]))
        x = "Xr"
    dirs = ["forward"] if reversed_input else ["forward", "reverse"]
    for d in dirs:
        W = (0.5 * rng.standard_normal((1, G * H, F))).astype(np.float32)
        R = (0.5 * rng.standard_normal((1, G * H, H))).astype(np.float32)
        Bv = (0.5 * rng.standard_normal((1, 2 * G * H))).astype(np.float32)
        for k, a in (("W", W), ("R", R), ("B", Bv)):
            inits.append(helper.make_tensor(f"{k}_{d}", TensorProto.FLOAT, a.shape, a.ravel()))
        attrs = dict(hidden_size=H, direction=d)
        if names is not None:
            attrs["activations"] = names
        if alphas:
            attrs["activation_alpha"] = alphas
        if betas:
            attrs["activation_beta"] = betas
        n_out = 3 if op == "LSTM" else 2
        o = [f"{d}_{k}" for k in range(n_out)]
        nodes.append(helper.make_node(op, [x, f"W_{d}", f"R_{d}", f"B_{d}"], o, name=f"{op}_{d}", **attrs))
        outs += o
    g = helper.make_graph(
        nodes, "native", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", 2, F])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None] * (4 if o.endswith("_0") else 3)) for o in outs], inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _check_rewritten(model, want_ops: int):
    fused, report = rnnfuse.optimize(model)
    onnx.checker.check_model(fused, full_check=True)
    nodes = _natives(fused)
    assert len(nodes) == want_ops, report.to_text()
    x = np.random.default_rng(1).standard_normal((5, 2, 3)).astype(np.float32)
    ref = session(model).run(None, {"X": x})
    got = session(fused).run(None, {"X": x})
    for k, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, f"output {k}")
    return nodes, report


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_merged_pair_drops_explicit_default_activations(op):
    nodes, report = _check_rewritten(_native_pair_model(op, DEFAULT_NAMES[op]), 1)
    assert attr(nodes[0], "direction") == "bidirectional", report.to_text()
    assert _act_attrs(nodes[0]) == {}, report.to_text()


def test_merged_pair_mixed_explicit_and_implicit_defaults():
    """One half spelled the defaults out, the other did not: the same cell, so they still merge."""
    m = _native_pair_model("GRU", DEFAULT_NAMES["GRU"])
    for n in m.graph.node:
        if attr(n, "direction") == "reverse":
            del n.attribute[[a.name for a in n.attribute].index("activations")]
    nodes, report = _check_rewritten(m, 1)
    assert attr(nodes[0], "direction") == "bidirectional" and _act_attrs(nodes[0]) == {}, report.to_text()


def test_merged_pair_keeps_non_default_activations():
    nodes, report = _check_rewritten(_native_pair_model("LSTM", ["HardSigmoid", "Tanh", "Tanh"], [0.3], [0.4]), 1)
    got = _act_attrs(nodes[0])
    assert got["activations"] == ["HardSigmoid", "Tanh", "Tanh"] * 2, report.to_text()
    np.testing.assert_allclose(got["activation_alpha"], [0.3, 0.3], rtol=1e-6)
    np.testing.assert_allclose(got["activation_beta"], [0.4, 0.4], rtol=1e-6)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_reversed_input_drops_explicit_default_activations(op):
    nodes, report = _check_rewritten(_native_pair_model(op, DEFAULT_NAMES[op], reversed_input=True), 1)
    assert attr(nodes[0], "direction") == "reverse", report.to_text()
    assert _act_attrs(nodes[0]) == {}, report.to_text()


def test_untouched_native_op_keeps_its_attributes():
    """Do no harm: a native op rnnfuse does not rewrite comes out as it went in, explicit defaults and all."""
    m = _native_pair_model("LSTM", DEFAULT_NAMES["LSTM"])
    m.graph.node.pop()  # only the forward op: nothing to merge
    m.graph.output.pop(), m.graph.output.pop(), m.graph.output.pop()
    fused, _ = rnnfuse.optimize(m)
    assert _act_attrs(_natives(fused)[0]) == {"activations": DEFAULT_NAMES["LSTM"]}


# ------------------------------------------------------------------------------------------------------
# --portable

_UNPORTABLE = {
    "lstm_hard_sigmoid": B.Opts(op="LSTM", acts=(HS, ("Tanh", ()), ("Tanh", ()))),
    "gru_softsign_loop": B.Opts(op="GRU", front="loop", acts=(("Softsign", ()), ("Tanh", ()))),
    "rnn_elu_masked": B.Opts(op="RNN", acts=(("Elu", (0.7,)),), mask="where"),
}
_PORTABLE = {
    "lstm_default": B.Opts(op="LSTM"),
    "gru_relu": B.Opts(op="GRU", acts=(("Sigmoid", ()), ("Relu", ()))),
    "rnn_relu_masked": B.Opts(op="RNN", acts=(("Relu", ()),), mask="where"),
    "lstm_clip": B.Opts(op="LSTM", clip=0.9),  # compiles on OpenVINO (as a generic loop)
}


@pytest.mark.parametrize("name", list(_UNPORTABLE))
def test_unportable_fusion_warns_by_default(name):
    o = _UNPORTABLE[name]
    out = B.run_case(o)
    assert out.status == "fused" and not out.fused_mismatch, out.text()
    (f,) = out.report.fused
    bad = o.activations()[0][0]
    assert any("OpenVINO" in w and bad in w for w in f.warnings), out.text()
    assert "will not compile on OpenVINO" in out.report.to_text() and bad in out.report.to_text()
    assert any("OpenVINO" in w for p in out.report.to_dict()["passes"] for g in p["findings"] for w in g["warnings"])


@pytest.mark.parametrize("name", list(_UNPORTABLE))
def test_unportable_fusion_declined_with_portable(name):
    o = _UNPORTABLE[name]
    out = B.run_case(o, portable=True, always_compare=True)
    assert out.status == "declined", out.text()
    assert not out.fused_mismatch, out.fused_mismatch
    (f,) = out.report.declined
    assert "OpenVINO" in f.reason and o.activations()[0][0] in f.reason and "--portable" in f.reason, out.text()
    assert not _natives(out.fused), out.text()


@pytest.mark.parametrize("name", list(_PORTABLE))
@pytest.mark.parametrize("portable", [False, True])
def test_portable_fusion_unaffected(name, portable):
    out = B.run_case(_PORTABLE[name], portable=portable)
    assert out.status == "fused" and not out.fused_mismatch, out.text()
    assert all(not f.warnings for f in out.report.findings), out.text()


def test_merged_unportable_native_pair_only_warns():
    """Exporter-written native ops that already use HardSigmoid: merging them changes nothing for OpenVINO,
    so --portable does not decline the merge; the report still says the op will not compile."""
    m = _native_pair_model("GRU", ["HardSigmoid", "Tanh"], [0.3], [0.4])
    for portable in (False, True):
        fused, report = rnnfuse.optimize(m, portable=portable)
        (f,) = report.fused
        assert f.status == "merged" and any("HardSigmoid" in w for w in f.warnings), report.to_text()


def test_cli_portable_flag(tmp_path):
    model, _ = B.build(_UNPORTABLE["lstm_hard_sigmoid"])
    src = tmp_path / "hs.onnx"
    onnx.save(model, src)
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "rnnfuse", *map(str, args)], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        return p.stdout

    text = cli("inspect", src, "--json", tmp_path / "a.json")
    assert "will not compile on OpenVINO" in text and "HardSigmoid" in text, text
    (f,) = [f for p in json.loads((tmp_path / "a.json").read_text())["passes"] for f in p["findings"]]
    assert f["status"] == "fused" and any("HardSigmoid" in w for w in f["warnings"])
    text = cli("optimize", src, tmp_path / "out.onnx", "--portable", "--json", tmp_path / "b.json")
    assert "declined" in text and "--portable" in text, text
    (f,) = [f for p in json.loads((tmp_path / "b.json").read_text())["passes"] for f in p["findings"]]
    assert f["status"] == "declined" and "OpenVINO" in f["reason"]
    assert op_counts_of(onnx.load(tmp_path / "out.onnx")).get("Scan") == 1
    assert "--portable" in subprocess.run([sys.executable, "-m", "rnnfuse", "inspect", "--help"], capture_output=True, text=True, env=env).stdout


def op_counts_of(model):
    from helpers import op_counts

    return op_counts(model)


# ------------------------------------------------------------------------------------------------------
# masks under --portable


def _reverse_sequences(model) -> int:
    return sum(n.op_type == "ReverseSequence" for n in model.graph.node)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("front", ["scan", "loop"])
def test_masked_reverse_portable_runs_forward_over_reversed_rows(op, front):
    o = B.default_reverse_form(B.Opts(op=op, front=front, mask="where", direction="reverse", outputs=("seq", "h"),
                                      lbr=1 if op == "GRU" else 0))
    default = B.run_case(o)
    assert default.status == "fused" and not default.fused_mismatch, default.text()
    assert default.native == {op: ["reverse"]}, default.text()
    assert any("wrong on OpenVINO" in w for f in default.report.fused for w in f.warnings), default.text()
    out = B.run_case(o, portable=True)  # post-, pre-padded and gappy masks, batch 1 and 4 (one empty row)
    assert out.status == "fused" and not out.fused_mismatch, out.fused_mismatch or out.text()
    assert out.native == {op: ["forward"]}, out.text()
    assert _reverse_sequences(out.fused) == 2, out.text()
    assert all(not f.warnings for f in out.report.fused), out.text()
    assert all(f.direction == "reverse" for f in out.report.fused), out.text()


def test_masked_reverse_portable_post_padded():
    o = B.Opts(op="GRU", lbr=1, mask="where", direction="reverse", fill="zero")
    out = B.run_case(o, portable=True, post_padded=True, kinds=("post",))
    assert out.status == "fused" and not out.fused_mismatch, out.fused_mismatch or out.text()
    assert out.native == {"GRU": ["forward"]} and out.report.fused[0].path == "post-padded", out.text()


def test_masked_lstm_final_cell_state():
    o = B.Opts(op="LSTM", mask="where", outputs=("seq", "h", "c"))
    default = B.run_case(o)
    assert default.status == "fused" and not default.fused_mismatch, default.text()
    assert any("final cell state wrong on OpenVINO" in w for w in default.report.fused[0].warnings), default.text()
    out = B.run_case(o, portable=True, always_compare=True)
    assert out.status == "declined" and not out.fused_mismatch, out.text()
    assert "Y_c" in out.report.declined[0].reason and "--portable" in out.report.declined[0].reason
    # without the cell state there is nothing to decline
    out = B.run_case(o.replace(outputs=("seq", "h")), portable=True)
    assert out.status == "fused" and not out.fused_mismatch and not out.report.fused[0].warnings, out.text()
