"""The unrolled-chain front end's work grows linearly with the chain: counted, never timed.

Counted at T, 2T and 4T steps of the same chain (hand-built LSTM, GRU and masked Keras-style LSTM): the
tensors the signer opens (each step's region is walked once, so twice the steps is at most twice the opens),
and the whole-graph scans (``live_nodes``) the pass makes, which must not depend on T at all (a scan per step
would make a 100k-node chain quadratic).
"""

from __future__ import annotations

import numpy as np
import pytest

import builders as B
import rnnfuse.cone_types
import rnnfuse.model
import rnnfuse.passes.unrolled.rule
from rnnfuse.graph import Graph, Model
from rnnfuse.passes.dedupe import Dedupe
from rnnfuse.passes.unrolled.rule import FuseChains
from rnnfuse.pipeline import Options, Pipeline
from rnnfuse.signature import Signer
from helpers import session


class _Counts:
    def __init__(self, monkeypatch):
        self.opens = self.scans = 0
        open_, live = Signer._open, Graph.live_nodes

        def counted_open(signer, *a, **k):
            self.opens += 1
            return open_(signer, *a, **k)

        def counted_live(g):
            self.scans += 1
            return live(g)

        monkeypatch.setattr(Signer, "_open", counted_open)
        monkeypatch.setattr(Graph, "live_nodes", counted_live)


@pytest.mark.parametrize("opts", [
    B.Opts(op="LSTM", front="chain"),
    B.Opts(op="GRU", front="chain"),
    B.Opts(op="LSTM", front="chain", mask=True),
    # a bidirectional layer: the last step of each half shares its interval end with every step of the other
    # half; finding its output walked each of those (opens 9,784 / 27,480 / 85,912 for the LSTM)
    B.Opts(op="LSTM", front="chain", layers="bidir"),
    B.Opts(op="GRU", front="chain", layers="bidir"),
], ids=["lstm", "gru", "lstm-masked", "lstm-bidir", "gru-bidir"])
def test_chain_front_end_work_is_linear(opts, monkeypatch):
    runs = []
    for T in (6, 12, 24):
        counts = _Counts(monkeypatch)
        model, _ = B.build(B.default_reverse_form(B.Opts(**{**opts.__dict__, "static_T": T})))
        report = Pipeline.default().run(Model(model), Options(validate=False))
        assert any(f.status == "fused" for f in report.findings), report.to_text()
        runs.append((T, counts.opens, counts.scans))
    (t1, o1, s1), (t2, o2, s2), (t3, o3, s3) = runs
    assert o1 > 0
    # per step the same region: the opens grow by the same amount per added step (no step walked twice)
    assert o2 - o1 == pytest.approx((o3 - o2) / 2, abs=4)
    assert o3 <= 2.2 * o2 and o2 <= 2.2 * o1
    assert s1 == s2 == s3, runs


@pytest.mark.parametrize("matmul", ["gemm", "matmul"])
@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_types_of_a_big_chain_are_not_inferred_along_it(op, matmul, monkeypatch):
    """In a model too big to infer whole (forced here), a type query infers the nodes the tensor is computed
    from: asked about a late step's value (a Gemm's rank, or a replaced stacked output's type at commit) it
    walked the chain back to its start. The nodes inferred must not grow with the chain (a bidirectional torch
    trace of 1,000 steps: two cones of 16,000-20,000 nodes, 1.3 of its 4 s)."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    inferred: list[int] = []
    cone = rnnfuse.cone_types.ConeTypes._cone

    def counted(self, root, *limit):
        nodes = cone(self, root, *limit)
        inferred.append(len(nodes) if nodes else 0)
        return nodes

    monkeypatch.setattr(rnnfuse.cone_types.ConeTypes, "_cone", counted)
    totals = []
    for T in (8, 32):
        inferred.clear()
        model, _ = B.build(B.default_reverse_form(B.Opts(op=op, front="chain", layers="bidir", static_T=T,
                                                         matmul=matmul, outputs=("seq",))))
        report = Pipeline.default().run(Model(model), Options(validate=False))
        assert [f.status for f in report.findings].count("fused") == 2, report.to_text()
        totals.append(sum(inferred))
    # (the ranks and element types these queries ask are now read off the ops, no cone inferred at all; a
    # query that does infer must still not walk the chain)
    assert totals[1] <= totals[0] + 8, totals


def _stacked_per_step_model(T: int, F: int = 3, H: int = 4):
    """Two tanh cells per step, the upper one reading the lower one's new h as its input (torch's trace of a
    loop calling two cells): the lower chain's h is read step by step, not as a stack."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(T)
    inits = [numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    for c, f in enumerate((F, H)):
        inits += [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), f"{n}{c}")
                  for n, s in (("W", (f, H)), ("R", (H, H)), ("b", (H,)))]
    nodes, ys, hs = [], [], ["h0", "h0"]
    for t in range(T):
        nodes += [helper.make_node("Constant", [], [f"t{t}"], value=numpy_helper.from_array(np.array(t, np.int64))),
                  helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"], axis=0)]
        below = f"x{t}"
        for c in range(2):
            p = f"c{c}_{t}_"
            nodes += [helper.make_node("MatMul", [below, f"W{c}"], [p + "xw"]),
                      helper.make_node("MatMul", [hs[c], f"R{c}"], [p + "hr"]),
                      helper.make_node("Add", [p + "xw", p + "hr"], [p + "s"]),
                      helper.make_node("Add", [p + "s", f"b{c}"], [p + "a"]),
                      helper.make_node("Tanh", [p + "a"], [p + "h"])]
            below = hs[c] = p + "h"
        nodes.append(helper.make_node("Unsqueeze", [below, "axis0"], [f"y{t}"]))
        ys.append(f"y{t}")
    nodes.append(helper.make_node("Concat", ys, ["y"], axis=0))
    graph = helper.make_graph(nodes, "stacked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F]),
                                                 helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, "B", H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_lower_cells_per_step_reads_are_typed_once(monkeypatch):
    """The upper cell of a stacked step reads the lower cell's h at every step: each such read is given its
    step of the lower op's Y, with its leading unit axes. Asked per step in a big model (forced here), that was
    a type inference per step (1,000 for a torch trace of 1,000 steps); steps computed alike have one answer."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    inferences = []
    cone = rnnfuse.cone_types.ConeTypes._cone

    def counted(self, root, *limit):
        inferences.append(root.output[0])
        return cone(self, root, *limit)

    monkeypatch.setattr(rnnfuse.cone_types.ConeTypes, "_cone", counted)
    counts = []
    for T in (8, 32):
        inferences.clear()
        model = Model(_stacked_per_step_model(T))
        report = Pipeline.default().run(model, Options(validate=False))
        assert [f.status for f in report.findings].count("fused") == 2, report.to_text()
        counts.append(len(inferences))
        rng = np.random.default_rng(0)
        feeds = {"x": rng.standard_normal((T, 3, 3)).astype(np.float32), "h0": rng.standard_normal((3, 4)).astype(np.float32)}
        want = session(_stacked_per_step_model(T)).run(None, feeds)[0]
        np.testing.assert_allclose(session(model.proto).run(None, feeds)[0], want, atol=1e-5)
    assert counts[1] == counts[0], counts


def test_a_stacked_masked_chain_is_searched_once_per_step(monkeypatch):
    """Two masked layers, the upper reading the lower's stacked output: the lower layer's last cell state is
    dead, so no tensor of its last step matches the reference step's; the tensors of the upper layer, which
    share that step's interval end, were each signed in vain, walking up the stack (opens per step 300, 370,
    520 at 12, 24, 48 steps). Only what the step's h computes is signed now, and the work per step is flat."""
    runs = []
    for T in (12, 24, 48):
        counts = _Counts(monkeypatch)
        model, _ = B.build(B.default_reverse_form(B.Opts(op="LSTM", front="chain", static_T=T, layers="stack", mask="where")))
        report = Pipeline.default().run(Model(model), Options(validate=False))
        assert [f.status for f in report.findings].count("fused") == 2, report.to_text()
        runs.append(counts.opens)
    o1, o2, o3 = runs
    assert o2 - o1 == pytest.approx((o3 - o2) / 2, abs=4), runs


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_gate_views_are_no_families_to_search(op, monkeypatch):
    """A cell's gates viewed as [B, G, W] (``gates.view(B, 4, H)``) and sliced per gate look like a family of G
    steps, one or two per step: each was tried as a chain, with a walk of the whole graph for its intervals
    (17 / 33 / 65 walks at 8 / 16 / 32 steps). Values of a long family's steps are not searched as sequences."""
    walks = []
    intervals = rnnfuse.passes.unrolled.rule.intervals

    def counted(*args, **kw):
        walks.append(1)
        return intervals(*args, **kw)

    monkeypatch.setattr(rnnfuse.passes.unrolled.rule, "intervals", counted)
    counts = []
    for T in (8, 32):
        walks.clear()
        model, _ = B.build(B.default_reverse_form(B.Opts(op=op, front="chain", static_T=T, layout="fused_view_batch")))
        report = Pipeline.default().run(Model(model), Options(validate=False))
        assert [f.status for f in report.findings] == ["fused"], report.to_text()
        counts.append(len(walks))
    assert counts[0] == counts[1] <= 4, counts


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_gate_views_cost_no_type_inference_per_step(op, monkeypatch):
    """In a model too big to infer whole (forced here), a type asked is a cone inferred: two a step were asked
    for the [B, G, W] gate views while families were filtered by type (before they were known as values of a
    step), and the final h's leading axes, asked alone, walked the chain back to its start (as far as the
    biggest cone, for each value ``lead_of`` followed). Neither grows with the steps now."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    monkeypatch.setattr(rnnfuse.cone_types, "CHEAP_INFERENCE_NODES", 2000)  # (the biggest cone: past 32 steps)
    cones, walked = [], []
    cone = rnnfuse.cone_types.ConeTypes._cone

    def counted(self, root, *limit):
        budget = self.budget
        nodes = cone(self, root, *limit)
        cones.append(root.output[0])
        walked.append(budget - self.budget)
        return nodes

    monkeypatch.setattr(rnnfuse.cone_types.ConeTypes, "_cone", counted)
    work = []
    for T in (32, 64):
        cones.clear()
        walked.clear()
        model, _ = B.build(B.default_reverse_form(B.Opts(op=op, front="chain", static_T=T, layout="fused_view_batch")))
        report = Pipeline.default().run(Model(model), Options(validate=False))
        assert [f.status for f in report.findings] == ["fused"], report.to_text()
        work.append((len(cones), sum(walked)))
    assert work[1] == work[0] and work[0][0] <= 8, work


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_a_round_that_fused_is_searched_again_only_where_it_may_have_made_a_chain(op, monkeypatch):
    """After a round fuses chains, the unrolled pass searches the whole graph again only where the fusion may
    have made a new chain: a stacked layer's cells read the fused layer's steps (both layers fused in one run of
    the pass); without dedupe, the backward chain's own slices of x become the family once the forward chain's
    are gone. A bidirectional layer read by no cell is searched once: its 14,000 per-step reads (the benchmarks'
    ``backreads``) wait for the pipeline's next round, merged by then."""
    searches = []

    class CountedSigner(Signer):  # one signer a search of the graph
        def __init__(self, *a, **k):
            searches.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(rnnfuse.passes.unrolled.rule, "Signer", CountedSigner)

    def run(layers: str, dedupe: bool) -> tuple[list, int]:
        searches.clear()
        model, _ = B.build(B.default_reverse_form(B.Opts(op=op, front="chain", static_T=8, layers=layers)))
        m = Model(model)
        if dedupe:
            Dedupe().run(m, Options(validate=False))
        found = FuseChains().run(m, Options(validate=False)).findings
        return [(f.status, f.direction) for f in found], len(searches)

    assert run("bidir", dedupe=True) == ([("fused", "forward"), ("fused", "reverse")], 1)
    assert run("bidir", dedupe=False) == ([("fused", "forward"), ("fused", "reverse")], 2)
    stacked, searched = run("stack", dedupe=True)
    assert stacked == [("fused", "forward")] * 2 and searched == 2
