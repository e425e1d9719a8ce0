"""Graphs of many step-sliced families that hold no chain cost the chain search no walk of the graph each.

A family (slices of one tensor along an axis, step by step) may be the steps of an unrolled recurrence. To
thread chains the search gives every node the span of steps it depends on (``intervals``), a walk of
everything downstream of the family. A graph of many families that hold no chain paid it per family:
a 600-layer transformer (each layer's q, k and v an ``unbind`` of one tensor) took 98 s, 1,500
``unbind``/``stack`` blocks 11 minutes. Now a family is walked only if its steps' own regions combine a
step's values with something that may come from another step (``family_filter.may_hold_chains``) and its source is
a ``[T, B, F]`` / ``[B, T, F]`` sequence. Counted, never timed; and the shortcut must never hide a chain:
every family whose chains the full search threads passes the pre-check, over the hand-built chain cases.
"""

from __future__ import annotations

import os
import sys

import pytest
from onnx import TensorProto

import builders as B
import rnnfuse
import rnnfuse.passes.unrolled.rule as rule
from rnnfuse.graph import Model
from rnnfuse.passes.unrolled.chains import find_chains, intervals
from rnnfuse.passes.unrolled.family_filter import may_hold_chains
from rnnfuse.passes.unrolled.derived_masks import derived_masks
from rnnfuse.passes.unrolled.families import find_families, is_row_family, length_masks, mask_leaves
from rnnfuse.passes.unrolled.whole_inputs import WholeInputs
from rnnfuse.signature import Signer

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from graphs import attention_model, unbind_stack_model  # (the benchmark's generators, at a test's size)
finally:
    sys.path.remove(BENCHMARKS)


def _count_intervals(monkeypatch) -> list:
    walks = []
    walk = rule.intervals

    def counted(g, order, leaves):
        walks.append(len(order))
        return walk(g, order, leaves)

    monkeypatch.setattr(rule, "intervals", counted)
    return walks


@pytest.mark.parametrize("steps", [4, 12])  # (a Concat of up to 8 steps is looked at as a combining node)
def test_unbind_stack_blocks_cost_no_intervals_walk(steps, monkeypatch):
    walks = _count_intervals(monkeypatch)
    model = unbind_stack_model(12, steps)
    out, report = rnnfuse.optimize(model)
    assert not walks, walks
    assert not report.findings and out.SerializeToString() == model.SerializeToString(), report.to_text()


def test_attention_blocks_cost_no_intervals_walk_and_no_declines(monkeypatch):
    """q, k and v combine, so each block's family could hold a "chain" -- over a rank-4 source, which no
    native op reads: not searched (it was 1,200 declines for a 600-layer transformer), said once in a note."""
    walks = _count_intervals(monkeypatch)
    model = attention_model(10)
    out, report = rnnfuse.optimize(model)
    assert not walks, walks
    assert not report.declined and out.SerializeToString() == model.SerializeToString(), report.to_text()
    notes = [n for p in report.passes if p.name == "unrolled" for n in p.notes]
    assert any(n.startswith("10 tensor(s) sliced into steps") for n in notes), notes


def test_a_chain_family_is_still_walked_and_fused(monkeypatch):
    """A family that does hold a chain passes the pre-check: walked, threaded and fused."""
    walks = _count_intervals(monkeypatch)
    out = B.run_case(B.Opts(op="GRU", front="chain", static_T=6), batches=(1, 3))
    assert out.status == "fused" and len(walks) >= 1, out.text()


def _chain_cases() -> list:
    import test_handbuilt as H

    return [p.values[0] for p in H._valid_cases() + H._near_miss_cases() if p.values[0].front == "chain"]


def test_every_family_the_search_threads_into_chains_passes_the_precheck():
    """The pre-check is necessary, never a guess: over the hand-built chain cases (valid cells and near
    misses, masked, bidirectional, stacked...), each family's chains as the full search finds them (with the
    pass's masks) exist only where may_hold_chains says they may, asked with those masks and without them."""
    threaded = 0
    for o in _chain_cases():
        model, _ = B.build(o)
        g = Model(model).graph
        g.prune()
        fams = find_families(g)
        signer = Signer(g)
        fams.update(WholeInputs(g).families(fams, signer))
        order, lengths = g.ordered_live_nodes(), length_masks(g)
        for (src, axis), fam in fams.items():
            if g.model.elem_type(src) == TensorProto.BOOL or is_row_family(g, src):
                continue
            leaves, mask_fam, _ = mask_leaves(g, fams, fam, lengths + derived_masks(g, fams, (src, axis), signer))
            if find_chains(g, fam, intervals(g, order, leaves), mask_fam):
                threaded += 1
                # (the pass asks without the masks first: that answer gates the masked one, and the input maps)
                assert may_hold_chains(g, fam) and may_hold_chains(g, fam, mask_fam), o.label()
    assert threaded >= 400, threaded
