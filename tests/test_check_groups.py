"""A big masked check model runs as groups of the parts it holds (rnnfuse.check_groups).

Masked Loops stacked and fused in one pass are validated in one check model that overrides every Loop's mask
with patterns, each input set run once per pattern kind: it cannot run in pieces, and one session of
thousands of them grew faster than the nodes. Past ``PIECEWISE_CHECK_NODES`` (lowered here) its parts (each
Loop and its RNN; what a node computes and another reads joins them, and so does a mask two read, but not an
old compared tensor: a stacked Loop reads the one below's output) run as groups of at most
``CHECK_PIECE_NODES`` nodes, one session after the other, each fed the outputs it reads from other groups as the
original computes them. These tests: the groups fuse what one session fuses, byte for byte, no group over its
share and no whole check beside them; a wrong rewrite in one group sends the check to the whole model, which
declines that one only; how parts are found, packed and fed.
"""

from __future__ import annotations


import onnx
import pytest
from onnx import TensorProto, helper

import rnnfuse
from helpers import agrees_on_x, benchmark_graph, emit_wrong_at, op_counts, same_bytes_split
from rnnfuse import piecewise_runs, validate
from rnnfuse.check_groups import independent_groups
from rnnfuse.protos import reads_of

LOOPS = 24
GROUP = 150  # nodes a group's check model holds at most, bodies counted


@pytest.fixture(scope="module")
def masked(tmp_path_factory) -> onnx.ModelProto:
    return benchmark_graph("growth_graphs", "masked_loops", tmp_path_factory.mktemp("masked") / "m.onnx", 3 + 13 * LOOPS)


@pytest.fixture
def checks(monkeypatch) -> list:
    """Masked check models over 100 nodes run in groups of GROUP; the check sessions opened are listed by
    node count (bodies counted), "whole" for one comparing every Loop."""
    monkeypatch.setattr(validate, "PIECEWISE_CHECK_NODES", 100)
    monkeypatch.setattr(validate, "CHECK_PIECE_NODES", GROUP)
    sizes: list = []
    build, opened = validate.build_check_model, validate.open_session
    compared: list = [0]

    def built(g, pairs, masks, start=None):
        compared[0] = len(pairs)
        return build(g, pairs, masks, start)

    def counted(ort, m, big, **k):
        if m.graph.name == "rnnfuse_check":
            sizes.append("whole" if compared[0] >= LOOPS else sum(piecewise_runs.weight(n) for n in m.graph.node))
        return opened(ort, m, big, **k)

    monkeypatch.setattr(validate, "build_check_model", built)
    monkeypatch.setattr(validate, "open_session", counted)
    return sizes


def test_masked_loops_checked_in_groups_fuse_as_with_one_session(masked, checks):
    fused, report = rnnfuse.optimize(masked)
    assert len(report.fused) == LOOPS and not report.declined, report.to_text()
    assert all(f.validation.startswith("ok") and "16 runs" in f.validation for f in report.fused), report.to_text()
    # the check model (24 Loops of 13 nodes, their RNNs and masks) ran as groups, none over its share
    assert "whole" not in checks and len(checks) >= 4 and max(checks) <= GROUP, checks
    assert op_counts(fused).get("Loop", 0) == 0 and op_counts(fused)["RNN"] == LOOPS
    agrees_on_x(fused, masked, zero_rows=0.4)


def test_the_groups_give_the_bytes_one_session_gives(masked, monkeypatch):
    same_bytes_split(masked, monkeypatch, "in_groups", GROUP)


def test_a_wrong_rewrite_in_one_group_is_judged_by_the_whole_check(masked, checks, monkeypatch):
    """One Loop's RNN is emitted with a clip its cell does not have: its group fails, so the groups' verdict
    is not taken, and the whole check model declines that Loop alone."""
    middle = f"h_last{LOOPS // 2}"
    emit_wrong_at(monkeypatch, middle)
    fused, report = rnnfuse.optimize(masked)
    assert len(report.fused) == LOOPS - 1, report.to_text()
    assert "whole" in checks and checks.index("whole") >= 1, checks  # (groups first, then the whole)
    (bad,) = report.declined
    assert bad.where == middle and bad.validation == "failed", bad.line()
    agrees_on_x(fused, masked, zero_rows=0.4)


def _n(op, ins, outs):
    return helper.make_node(op, ins, outs)


def _outputs(groups) -> list[list[str]]:
    return [[n.output[0] for n in g.nodes] for g in groups]


def test_parts_are_joined_by_what_they_compute_and_by_a_mask_they_share():
    # a prologue p from x (free: copied into each group reading it), an old chain a -> b -> c whose outputs are
    # compared (links), d reading mask m like c, and e reading b
    nodes = [_n("Relu", ["x"], ["p"]), _n("Relu", ["p"], ["a"]), _n("Tanh", ["p"], ["a_new"]),
             _n("Relu", ["a"], ["b"]), _n("Tanh", ["a"], ["b_new"]), _n("Where", ["m", "b", "x"], ["c"]),
             _n("Where", ["m", "b", "p"], ["c_new"]), _n("Relu", ["b"], ["e"]), _n("Tanh", ["x"], ["e_new"])]
    pairs = [("a", "a_new"), ("b", "b_new"), ("c", "c_new"), ("e", "e_new")]
    groups = independent_groups(nodes, pairs, {"m": ("any", 0)}, reads_of, limit=2)
    assert _outputs(groups) == [["p", "a", "a_new"], ["b", "b_new"], ["p", "c", "c_new"], ["e", "e_new"]]
    assert [g.pairs for g in groups] == [[("a", "a_new")], [("b", "b_new")], [("c", "c_new")], [("e", "e_new")]]
    assert [g.masks for g in groups] == [{}, {}, {"m": ("any", 0)}, {}]
    assert [g.fed for g in groups] == [set(), {"a"}, {"b"}, {"b"}]
    # parts packed in order while a group has room; a link computed in the group is not fed
    packed = independent_groups(nodes, pairs, {"m": ("any", 0)}, reads_of, limit=4)
    assert _outputs(packed) == [["p", "a", "a_new", "b", "b_new"], ["p", "c", "c_new", "e", "e_new"]]
    assert [g.fed for g in packed] == [set(), {"b"}]
    # one group only, a pair no node computes, a mask nothing reads, a prologue bigger than a group: no groups
    assert independent_groups(nodes, pairs, {}, reads_of, limit=100) is None
    assert independent_groups(nodes, pairs + [("x", "y")], {}, reads_of, limit=2) is None
    assert independent_groups(nodes, pairs, {"unread": ("post", 0)}, reads_of, limit=2) is None
    big_prologue = [_n("Relu", ["x"], ["q0"]), _n("Relu", ["q0"], ["q1"]), _n("Relu", ["q1"], ["p"]), *nodes[1:]]
    assert independent_groups(big_prologue, pairs, {}, reads_of, limit=2) is None


def test_a_captured_value_joins_a_subgraph_reader_to_its_producer():
    body = helper.make_graph([_n("Add", ["v", "h"], ["o"])], "body", [helper.make_tensor_value_info("v", TensorProto.FLOAT, [])],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, [])])
    nodes = [_n("Relu", ["x"], ["h"]), _n("Relu", ["x"], ["b"]), _n("Tanh", ["x"], ["b_new"]),
             helper.make_node("Scan", ["x"], ["s"], body=body, num_scan_inputs=1), _n("Tanh", ["x"], ["s_new"])]
    groups = independent_groups(nodes, [("b", "b_new"), ("s", "s_new")], {}, reads_of, limit=2)
    # (h, read only inside the Scan's body, is free: copied into the group of the Scan that captures it)
    assert _outputs(groups) == [["b", "b_new"], ["h", "s", "s_new"]]


def test_each_group_session_is_asked_for_before_the_group_before_it_is_checked():
    """in_groups asks for the next group's session (``ahead``) before it checks the current one, so it opens
    while that one runs; each check gets its own group's opening; a failing group ends the check (None) and
    nothing past the next group is asked for."""
    from rnnfuse.check_groups import Group, in_groups
    from rnnfuse.check_results import PairResult, ValidationResult

    groups = []
    for k in range(3):
        grp = Group()
        grp.pairs = [(f"a{k}", f"b{k}")]
        groups.append(grp)
    calls = []

    def check(grp, opening, fail=None):
        calls.append(("check", groups.index(grp), opening))
        res = ValidationResult(grp is not fail)
        res.pairs = {p: PairResult(*p) for p in grp.pairs}
        res.runs = 16
        return res

    def ahead(grp):
        calls.append(("ahead", groups.index(grp)))
        return f"session {groups.index(grp)}"

    res = in_groups(groups, [p for grp in groups for p in grp.pairs], check, ahead)
    assert res is not None and res.ran and len(res.pairs) == 3
    assert calls == [("ahead", 0), ("ahead", 1), ("check", 0, "session 0"), ("ahead", 2), ("check", 1, "session 1"),
                     ("check", 2, "session 2")]
    calls.clear()
    assert in_groups(groups, [p for grp in groups for p in grp.pairs],
                     lambda grp, o: check(grp, o, fail=groups[0]), ahead) is None
    assert calls == [("ahead", 0), ("ahead", 1), ("check", 0, "session 0")]


def test_group_sessions_open_on_the_worker_while_the_group_before_runs(masked, monkeypatch):
    """The groups' check sessions are opened by the worker thread (rnnfuse.sessions_ahead), the fusion the
    same: every Loop fused and validated on every pattern kind."""
    import threading

    monkeypatch.setattr(validate, "PIECEWISE_CHECK_NODES", 100)
    monkeypatch.setattr(validate, "CHECK_PIECE_NODES", GROUP)
    opened, where = validate.open_session, []

    def recorded(ort, m, big, **k):
        if m.graph.name == "rnnfuse_check":
            where.append(threading.current_thread() is threading.main_thread())
        return opened(ort, m, big, **k)

    monkeypatch.setattr(validate, "open_session", recorded)
    fused, report = rnnfuse.optimize(masked)
    assert len(report.fused) == LOOPS and all("16 runs" in f.validation for f in report.fused), report.to_text()
    assert len(where) >= 4 and not any(where), where
