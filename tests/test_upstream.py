"""Validation runs a big shared upstream apart, once per optimizer run (rnnfuse.upstream).

The check model of a rewrite computes old and new tensors from the model's inputs. The nodes both sides are
computed from (a prologue, a backbone), reading no overridden mask, run in a session of their own when big,
and their values are kept for later validations of the same run whose cones hold the same computation. These
tests: a recurrence behind a long prologue is validated three times with the prologue run once, and fuses
exactly; a wrong rewrite is still caught with the prologue cut off; a value computed from a mask the
validation overrides is never taken from what was kept; and the digests tell computations apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import AttributeReads, op_counts, session
from rnnfuse import check_session, rewrite, upstream
from rnnfuse.graph import Model

ROOT = Path(__file__).resolve().parents[1]
PROLOGUE_NODES = 2000


@pytest.fixture(scope="module")
def prologue_model(tmp_path_factory):
    """The shipped Keras model (a masked bidirectional GRU, an LSTM) behind a 2,000-node prologue."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from graphs import prologue_then_recurrence
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = tmp_path_factory.mktemp("prologue") / "prologue.onnx"
    prologue_then_recurrence(str(path), PROLOGUE_NODES)
    return onnx.load(str(path))


def _counting_upstream_runs(monkeypatch) -> list:
    runs = []
    run = upstream._run_upstream

    def counted(*a, **k):
        runs.append(len(a[2]))  # (the shared upstream's nodes)
        return run(*a, **k)

    monkeypatch.setattr(upstream, "_run_upstream", counted)
    return runs


def _feeds(model: onnx.ModelProto, rng, batch: int = 3, steps: int = 7) -> dict:
    (x,) = model.graph.input
    dims = [d.dim_value or {0: batch, 1: steps}[k] for k, d in enumerate(x.type.tensor_type.shape.dim)]
    a = rng.standard_normal(dims).astype(np.float32)
    a[1, 4:] = 0.0  # (a padded row: Keras masks the steps whose features are all zero)
    a[2, :2] = 0.0
    return {x.name: a}


def test_a_recurrence_behind_a_long_prologue_runs_the_prologue_once(prologue_model, monkeypatch):
    runs = _counting_upstream_runs(monkeypatch)
    validations = []
    validate = rewrite.validate
    monkeypatch.setattr(rewrite, "validate", lambda *a, **k: validations.append(1) or validate(*a, **k))
    fused, report = rnnfuse.optimize(prologue_model)
    assert len(report.fused) == 4 and not report.declined, report.to_text()  # (three Loops, a merged pair)
    assert all(f.validation.startswith("ok") for f in report.findings if f.status in ("fused", "merged"))
    assert op_counts(fused).get("Loop", 0) == 0
    assert len(validations) >= 3 and len(runs) == 1 and runs[0] >= 2000, (validations, runs)
    rng = np.random.default_rng(0)
    for _ in range(2):
        feeds = _feeds(prologue_model, rng)
        for a, b in zip(session(fused).run(None, feeds), session(prologue_model).run(None, feeds)):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_prologue_runs_in_pieces_with_the_values_of_one_session(prologue_model, monkeypatch):
    """With sessions of 300 nodes, the 2,000-node prologue runs in 7+ pieces, one after the other, each fed
    what the earlier ones computed: the boundary values are those of one session over it all, and the
    optimizer's output is the same bytes."""
    ort = pytest.importorskip("onnxruntime")
    sessions = []

    def counted(ort, m, big):
        sessions.append(len(m.graph.node))
        return check_session.open_session(ort, m, big)

    g = Model(prologue_model).graph
    prologue = [n for n in g.nodes if n.input[1:] and n.input[1] in ("pre_one", "pre_zero")]  # (x * 1 + 0)
    boundary = [prologue[-1].output[0]]
    rng = np.random.default_rng(1)
    inputs = [_feeds(prologue_model, rng, batch=b) for b in (3, 4)]
    whole = upstream._run_upstream(ort, g, prologue, boundary, {}, inputs, counted)
    monkeypatch.setattr(upstream, "PIECE_NODES", 300)
    pieces = upstream._run_upstream(ort, g, prologue, boundary, {}, inputs, counted)
    assert sessions[0] == len(prologue) >= 2000 and len(sessions) - 1 >= 7 and max(sessions[1:]) <= 300, sessions
    for a, b in zip(whole[boundary[0]], pieces[boundary[0]]):
        np.testing.assert_array_equal(a, b)
    whole_model, _ = rnnfuse.optimize(prologue_model)
    monkeypatch.setattr(upstream, "PIECE_NODES", 300)
    in_pieces, _ = rnnfuse.optimize(prologue_model)
    assert in_pieces.SerializeToString() == whole_model.SerializeToString()


def test_a_wrong_rewrite_is_caught_with_the_prologue_cut_off(prologue_model, monkeypatch):
    """The native LSTM is emitted with a clip its cell does not have: the check model, fed the prologue's
    values, fails it; the GRUs, emitted right, fuse."""
    runs = _counting_upstream_runs(monkeypatch)
    emit = rewrite.emit

    def clipped(g, rec, *a, **k):
        em = emit(g, rec, *a, **k)
        if em.native.op_type == "LSTM":
            em.native.attribute.append(helper.make_attribute("clip", 0.05))
        return em

    monkeypatch.setattr(rewrite, "emit", clipped)
    fused, report = rnnfuse.optimize(prologue_model)
    (bad,) = report.declined
    assert bad.validation == "failed" and "LSTM" in bad.cell, bad.line()
    assert runs and op_counts(fused).get("GRU", 0) >= 1 and op_counts(fused).get("Loop", 0) == 1


def _graph(nodes, inputs, outputs, inits=()):
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi(n, TensorProto.FLOAT, ["B", 4]) for n in inputs],
                          [vi(n, TensorProto.FLOAT, None) for n in outputs], list(inits))
    return Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).graph


def test_a_value_computed_from_an_overridden_mask_is_computed_again():
    """``y`` reads the mask ``m``; ``z`` does not. Both were kept by an earlier validation: one that overrides
    ``m`` is given ``z`` and computes ``y`` again from the override, one that does not is given both."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["m"]),
             helper.make_node("Where", ["m", "x", "zero"], ["y"]),
             helper.make_node("Relu", ["x"], ["z"]),
             helper.make_node("Add", ["y", "z"], ["old"]),
             helper.make_node("Add", ["z", "y"], ["new"])]
    g = _graph(nodes, ["x"], ["old", "new"], [numpy_helper.from_array(np.zeros(1, np.float32), "zero")])
    inputs = [{"x": np.ones((2, 4), np.float32)}]
    digests, _ = upstream._digests(g, list(g.nodes), set())
    kept = upstream.kept_values(g)
    fed = upstream._inputs_digest(inputs[0])
    for name in ("y", "z"):
        kept.put((digests[name], fed), np.ones((2, 4), np.float32))

    def given(masks):
        c = upstream.cut(None, g, [("old", "new")], masks, inputs, None)
        return sorted(c.given), sorted(n.output[0] for n in c.nodes)

    assert given(["m"]) == (["z"], ["m", "new", "old", "y"])
    assert given([]) == (["y", "z"], ["new", "old"])


def test_later_validations_take_the_upstream_run_without_walking_it(prologue_model, monkeypatch):
    """The Loops' validation runs the 2,000-node prologue and digests it; the bidirectional merge's and the
    clean-up's validations, later in the round, none of the prologue's nodes edited since, take its values
    and digest only the few nodes after them. The output is the same bytes as with every cone digested."""
    digested: list[int] = []
    digests = upstream._digests
    monkeypatch.setattr(upstream, "_digests", lambda g, cone, *a: digested.append(len(cone)) or digests(g, cone, *a))
    fused, report = rnnfuse.optimize(prologue_model)
    assert len(report.fused) == 4 and len(digested) >= 3, (digested, report.to_text())
    assert digested[0] >= PROLOGUE_NODES and max(digested[1:]) < 300, digested
    monkeypatch.setattr(upstream._UpstreamRun, "standing", lambda self, g, masks: {})
    walked, _ = rnnfuse.optimize(prologue_model)
    assert walked.SerializeToString() == fused.SerializeToString()


def _upstream_run(nodes, boundary):
    g = _graph(nodes, ["x"], ["out"], [numpy_helper.from_array(np.zeros(1, np.float32), "zero")])
    run = upstream._UpstreamRun(g, [n for n in g.nodes if n.output[0] != "out"], {b: b.encode() for b in boundary})
    return g, run


def test_an_upstream_run_stands_until_one_of_its_nodes_is_rewired_or_recomputed():
    """m = x > 0, y = where(m, x, 0), z = relu(x), all run apart; out reads them. The run stands as long as
    the edit log shows none of its nodes rewired and no new node computing one of its values; a node of it
    removed as dead does not end it. A mask it computes: what reads the mask is not taken (a validation
    overriding it computes that again), the mask itself is."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["m"]), helper.make_node("Where", ["m", "x", "zero"], ["y"]),
             helper.make_node("Relu", ["x"], ["z"]), helper.make_node("Tanh", ["x"], ["dead"]),
             helper.make_node("Sum", ["y", "z"], ["out"])]
    g, run = _upstream_run(nodes, ["m", "y", "z"])
    assert sorted(run.standing(g, [])) == ["m", "y", "z"]
    assert sorted(run.standing(g, ["m"])) == ["m", "z"]
    assert run.standing(g, ["x"]) == {}  # (a graph input every one of them is computed from)
    g.remove_node(g.producer["dead"])
    assert sorted(run.standing(g, [])) == ["m", "y", "z"]
    (abs_x,) = g.add_node("Abs", ["x"])
    g.replace_reads([g.producer["z"]], "x", abs_x)  # (z's node rewired: its value is another)
    assert run.standing(g, []) == {}

    g, run = _upstream_run(nodes, ["m", "y", "z"])
    g.remove_node(g.producer["z"])
    g.add_node("Neg", ["x"], outputs=["z"])  # (z computed anew under its name)
    assert run.standing(g, []) == {}
    g.finalize()
    g2, run2 = _upstream_run(nodes, ["m"])
    g2.finalize()  # (a new round: the log the run was marked on is gone)
    assert run2.standing(g2, []) == {}


def test_digests_tell_computations_apart():
    """Same ops on the same inputs: the same digest, whatever the tensors are called; another op, another
    attribute, another weight value or another input: another digest."""
    def digest(op="Relu", src="x", w=1.0, alpha=None, out="a"):
        attrs = {"alpha": alpha} if alpha is not None else {}
        nodes = [helper.make_node("Mul", [src, "w"], ["t"]), helper.make_node(op, ["t"], [out], **attrs)]
        g = _graph(nodes, ["x", "x2"], [out], [numpy_helper.from_array(np.full(4, w, np.float32), "w")])
        return upstream._digests(g, list(g.nodes), set())[0][out]

    base = digest()
    assert digest(out="renamed") == base
    assert len({base, digest(op="Sigmoid"), digest(src="x2"), digest(w=2.0), digest("LeakyRelu", alpha=0.1),
                digest("LeakyRelu", alpha=0.2)}) == 6


def test_digests_read_the_attributes_of_ops_that_take_some_only():
    """At opset 17 Add, Mul and MatMul take no attribute: their field is not read. Gather's axis is, and
    still tells two Gathers apart."""
    def digests(axis):
        nodes = [helper.make_node("Mul", ["x", "w"], ["t"]), helper.make_node("MatMul", ["t", "t"], ["u"]),
                 helper.make_node("Add", ["u", "x"], ["v"]), helper.make_node("Gather", ["v", "i"], ["y"], axis=axis)]
        g = _graph(nodes, ["x"], ["y"], [numpy_helper.from_array(np.ones(4, np.float32), "w"),
                                         numpy_helper.from_array(np.zeros(1, np.int64), "i")])
        read: list = []
        cone = [AttributeReads(n, read) for n in g.nodes]
        return upstream._digests(g, cone, set(), reads=lambda n: list(n.input))[0]["y"], read

    (d0, read), (d1, _) = digests(0), digests(1)
    assert read == ["Gather"]
    assert d0 != d1


def test_what_onnxruntime_cannot_run_is_judged_as_with_the_whole_check_model(monkeypatch):
    """With every shared upstream run apart: a model whose prologue onnxruntime cannot load (a custom op) is
    still left unvalidated for that reason, and a rewrite onnxruntime cannot run where the original runs is
    still declined for it (the original alone is tried on every input it reads, graph inputs included)."""
    import test_loops
    from builders import Opts, build
    from test_cli import _with_custom_op

    monkeypatch.setattr(upstream, "MIN_NODES", 1)
    runs = _counting_upstream_runs(monkeypatch)
    model, _ = build(Opts(op="GRU", lbr=1))
    _, report = rnnfuse.optimize(_with_custom_op(model))
    (f,) = report.fused
    assert f.validation.startswith("skipped") and "onnxruntime cannot run the original" in f.validation, f.line()
    assert runs, "the custom op's prologue was not tried apart"
    runs.clear()
    test_loops.test_rewrite_onnxruntime_cannot_run_is_declined("GRU")
    assert runs, "the mask's prologue was not run apart"
