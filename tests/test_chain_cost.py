"""The unrolled-chain front end's work grows linearly with the chain: counted, never timed.

Counted at T, 2T and 4T steps of the same chain (hand-built LSTM, GRU and masked Keras-style LSTM): the
tensors the signer opens (each step's region is walked once, so twice the steps is at most twice the opens),
and the whole-graph scans (``live_nodes``) the pass makes, which must not depend on T at all (a scan per step
would make a 100k-node chain quadratic).
"""

from __future__ import annotations

import pytest

import builders as B
import rnnfuse.cone_types
import rnnfuse.model
from rnnfuse.graph import Graph, Model
from rnnfuse.pipeline import Options, Pipeline
from rnnfuse.signature import Signer


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

    def counted(self, root):
        nodes = cone(self, root)
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
    assert 0 < totals[1] <= totals[0] + 8, totals
