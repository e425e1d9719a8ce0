"""A big check model without masks runs in pieces (rnnfuse.validate._compare_in_pieces, rnnfuse.piecewise_runs).

Loops stacked on one another are validated in one check model that holds every original Loop and every RNN.
Past ``PIECEWISE_CHECK_NODES`` (lowered here) its nodes run as consecutive pieces of at most
``CHECK_PIECE_NODES``, one session after the other, each fed what the earlier ones computed. These tests: the
pieces give the output one session gives, byte for byte, every piece holds at most its share, and no whole
check model runs beside them; a wrong rewrite is caught in pieces, and only that one (its failure checked
again as deployed, in one session); an old tensor fed to the check is compared as fed; pieces that cannot run
(a failing piece, too many bytes waiting) leave the check to one session, which decides as before; a masked
check never runs in pieces (its patterns run the model several times).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import rnnfuse
from helpers import agrees_on_x, benchmark_graph, emit_wrong_at, op_counts, same_bytes_split, session
from rnnfuse import check_session, piecewise_runs, validate

ROOT = Path(__file__).resolve().parents[1]
LOOPS = 40
PIECE = 60  # nodes a piece holds at most, bodies counted (a Loop and its body are 9)


@pytest.fixture(scope="module")
def stacked(tmp_path_factory) -> onnx.ModelProto:
    return benchmark_graph("graphs", "stacked_loops", tmp_path_factory.mktemp("stacked") / "stacked.onnx", 3 + 9 * LOOPS)


@pytest.fixture
def pieces(monkeypatch) -> list[int]:
    """Check models of more than 100 nodes run in pieces of PIECE; the sessions of the pieces, by node count
    (bodies counted), are listed."""
    monkeypatch.setattr(validate, "PIECEWISE_CHECK_NODES", 100)
    monkeypatch.setattr(validate, "CHECK_PIECE_NODES", PIECE)
    sizes: list[int] = []
    opened = validate.open_session

    def counted(ort, m, big, **k):
        if m.graph.name == "rnnfuse_piece":
            sizes.append(sum(piecewise_runs.weight(n) for n in m.graph.node))
        elif m.graph.name == "rnnfuse_check":
            sizes.append("whole")  # (a check model run in one session: the pieces' verdict was not taken)
        return opened(ort, m, big, **k)

    monkeypatch.setattr(validate, "open_session", counted)
    return sizes


def test_stacked_loops_checked_in_pieces_fuse_as_with_one_session(stacked, pieces):
    in_pieces, report = rnnfuse.optimize(stacked)
    assert len(report.fused) == LOOPS and not report.declined, report.to_text()
    assert all(f.validation.startswith("ok") for f in report.fused)
    # the check model (40 Loops of 9 nodes and the RNNs) ran as many pieces, none over its share
    assert "whole" not in pieces and len(pieces) >= 8 and max(pieces) <= PIECE, pieces
    assert op_counts(in_pieces).get("Loop", 0) == 0 and op_counts(in_pieces)["RNN"] == LOOPS
    agrees_on_x(in_pieces, stacked)


def test_the_pieces_give_the_bytes_one_session_gives(stacked, monkeypatch):
    same_bytes_split(stacked, monkeypatch, "run_in_pieces", PIECE)


def test_a_wrong_rewrite_is_caught_in_pieces(stacked, pieces, monkeypatch):
    """The RNN of one Loop in the middle of the stack is emitted with a clip its cell does not have: the check,
    in pieces, fails that one; the others fuse."""
    middle = f"h_last{LOOPS // 2}"  # (the Loop's first output names it)
    emit_wrong_at(monkeypatch, middle)
    fused, report = rnnfuse.optimize(stacked)
    assert len(report.fused) == LOOPS - 1, report.to_text()
    # the first check, of all 40, ran in pieces
    # (and the failure was checked again as deployed, in one session: "whole")
    assert "whole" in pieces and len(pieces[:pieces.index("whole")]) >= 8, pieces
    (bad,) = report.declined
    assert bad.where == middle and bad.validation == "failed", bad.line()
    assert op_counts(fused)["Loop"] == 1
    agrees_on_x(fused, stacked)


def test_a_pair_whose_old_tensor_is_fed_is_compared_with_the_fed_value():
    """A check model may be fed the old tensor itself (an earlier validation kept it: ``start.given``): the
    pieces compare the new tensor with that value, and a value off by 0.01 fails the pair."""
    import onnxruntime as ort

    from rnnfuse.graph import Model
    from rnnfuse.upstream import Cut

    f = onnx.TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Tanh", ["a"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["old"]), helper.make_node("Sigmoid", ["b"], ["new0"]),
             helper.make_node("Identity", ["new0"], ["new"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["T", "B", 3])],
                              [helper.make_tensor_value_info("old", f, None), helper.make_tensor_value_info("new", f, None)])
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])).graph
    inputs = validate.InputSets(g, 0)
    a = [np.maximum(s["x"], 0) for s in inputs]
    old = [(1 / (1 + np.exp(-np.tanh(x)))).astype(np.float32) for x in a]
    by = {n.output[0]: n for n in g.nodes}
    for off, ok in ((0.0, True), (0.01, False)):
        start = Cut([by["b"], by["new0"], by["new"]], {"a": a, "old": [o + np.float32(off) for o in old]})
        res = validate._compare_in_pieces(ort, g, [("old", "new")], start, inputs)
        assert res.pairs[("old", "new")].ok == ok, res.pairs


@pytest.mark.parametrize("why", ["a piece fails", "too much held"])
def test_pieces_that_cannot_run_leave_the_check_to_one_session(stacked, pieces, monkeypatch, why):
    """A piece's session that fails to load, or old tensors waiting for their partners past
    ``CHECK_HELD_BYTES``: the whole check model runs instead, and decides."""
    if why == "a piece fails":
        def failing(*a, **k):
            raise RuntimeError("a piece does not load")

        monkeypatch.setattr(validate, "run_in_pieces", failing)
    else:
        monkeypatch.setattr(validate, "CHECK_HELD_BYTES", 0)
    fused, report = rnnfuse.optimize(stacked)
    assert len(report.fused) == LOOPS and "whole" in pieces, report.to_text()
    agrees_on_x(fused, stacked)


def test_a_masked_check_never_runs_in_pieces(pieces, monkeypatch):
    """The shipped Keras model's masked Loops are checked with mask patterns, each input set run several
    times: in one session, however low the bound; its unmasked checks may run in pieces."""
    masked_checks, piece_checks = [], []
    once, check, compare = validate._validate_once, validate._check_session, validate._compare_in_pieces
    current: list = [None]

    def validate_once(ort, g, pairs, masks, *a, **k):
        current[0] = masks
        return once(ort, g, pairs, masks, *a, **k)

    monkeypatch.setattr(validate, "_validate_once", validate_once)
    monkeypatch.setattr(validate, "_check_session",
                        lambda *a, **k: masked_checks.append(bool(current[0])) or check(*a, **k))
    monkeypatch.setattr(validate, "_compare_in_pieces",
                        lambda *a, **k: piece_checks.append(dict(current[0])) or compare(*a, **k))
    monkeypatch.setattr(validate, "PIECEWISE_CHECK_NODES", 0)
    fused, report = rnnfuse.optimize(onnx.load(str(ROOT / "examples" / "keras_masked_bigru_lstm.onnx")))
    assert len(report.fused) >= 3 and any(masked_checks), report.to_text()
    assert all(not masks for masks in piece_checks)


def test_run_in_pieces_hands_each_wanted_value_once_and_holds_it_while_read(stacked):
    """The values of the stack's every Loop output, from pieces of 20 nodes, are those of one session; with
    ``take`` each is handed over once, and nothing is returned."""
    import onnxruntime as ort

    from rnnfuse.graph import Model

    g = Model(stacked).graph
    nodes = list(g.nodes)
    wanted = [n.output[1] for n in nodes if n.op_type == "Loop"]
    inputs = [{"x": np.random.default_rng(s).standard_normal((5, 1, 4)).astype(np.float32)} for s in range(2)]
    opened = []

    def open_(ort_, m, big):
        opened.append(len(m.graph.node))
        return check_session.open_session(ort_, m, big)

    whole = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, inputs, open_, 10**6, 1 << 30)
    assert opened == [len(nodes)]
    taken: dict[str, list] = {}
    got = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, inputs, open_, 20, 1 << 30,
                                       take=lambda name, values: taken.setdefault(name, []).append(values))
    assert got == {} and len(opened) > 1 + LOOPS * 9 // 20 and max(opened[1:]) <= 20 // 9 + 3
    assert sorted(taken) == sorted(wanted) and all(len(v) == 1 for v in taken.values())
    for name in wanted:
        for a, b in zip(whole[name], taken[name][0]):
            np.testing.assert_array_equal(a, b)


def test_input_sets_are_made_once_for_all_pieces_when_small(stacked):
    """Every piece feeds every input set; a sequence that makes each set again when asked (validate.InputSets)
    is asked once per set for the whole run when the sets together fit ``max_bytes`` (made again per piece, a
    model of thousands of graph inputs generated them all per piece), and per piece otherwise; the values are
    the same either way."""
    import onnxruntime as ort

    from rnnfuse.graph import Model

    class Sets:
        def __init__(self):
            self.made = 0

        def __len__(self):
            return 3

        def __getitem__(self, k):
            self.made += 1
            return {"x": np.random.default_rng(k).standard_normal((5, 1, 4)).astype(np.float32)}

        def __iter__(self):
            return (self[k] for k in range(len(self)))

    g = Model(stacked).graph
    nodes = list(g.nodes)
    wanted = [n.output[1] for n in nodes if n.op_type == "Loop"]
    opened = []

    def open_(ort_, m, big):
        opened.append(1)
        return check_session.open_session(ort_, m, big)

    small, tight = Sets(), Sets()
    got = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, small, open_, 20, 1 << 30)
    pieces = len(opened)
    assert pieces > 2 and small.made == 3
    again = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, tight, open_, 20, 100)
    assert again is None or all(np.array_equal(a, b) for w in wanted for a, b in zip(got[w], again[w]))
    assert tight.made > 3  # (80 bytes a set: over the budget, made again when a piece asks)


def _with_functions(model: onnx.ModelProto, unused: int) -> onnx.ModelProto:
    """``model`` with ``unused`` local functions nothing calls, and ``Outer`` (which calls ``Inner``, a Relu)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    opset = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.functions.extend(helper.make_function("local", f"Unused{i}", ["a"], ["b"], [helper.make_node("Neg", ["a"], ["b"])],
                                            opset) for i in range(unused))
    m.functions.append(helper.make_function("local", "Inner", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], opset))
    m.functions.append(helper.make_function("local", "Outer", ["a"], ["b"],
                                            [helper.make_node("Inner", ["a"], ["b"], domain="local")], opset))
    return m


def test_a_check_model_holds_the_functions_its_nodes_call_only():
    """A check model or piece copies the local functions its nodes call, and those these call, in the model's
    order: not every function of the model (each of 40 pieces copying 5,000 was pieces x functions)."""
    from rnnfuse.graph import Model

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Outer", ["x"], ["y"], domain="local"), helper.make_node("Neg", ["y"], ["z"])],
                              "g", [x], [z])
    m = _with_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), unused=30)
    g = Model(m).graph
    calls, neg = g.nodes
    assert not check_session.model_of(g, [neg], [z], {"y": [np.zeros((2, 3), np.float32)]}, "part")[0].functions
    part, _ = check_session.model_of(g, [calls], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], {},
                                     "part")
    assert [f.name for f in part.functions] == ["Inner", "Outer"]
    xv = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    (got,) = session(part).run(None, {"x": xv})
    np.testing.assert_array_equal(got, np.maximum(xv, 0))


def test_pieces_of_a_model_with_many_functions_copy_none_they_do_not_call(stacked, pieces, monkeypatch):
    """Stacked Loops beside 200 local functions nothing calls: checked in pieces as before, every piece (and the
    fused model) free of the unused functions' copies, the output as the original's."""
    model = _with_functions(stacked, unused=200)
    held = []
    opened = validate.open_session
    monkeypatch.setattr(validate, "open_session", lambda ort, m, big, **k: held.append(len(m.functions)) or opened(ort, m, big, **k))
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == LOOPS and not report.declined, report.to_text()
    assert "whole" not in pieces and len(pieces) >= 8 and held and not any(held), (pieces, held)
    agrees_on_x(fused, stacked)


def test_the_next_piece_opens_on_a_worker_while_one_runs_two_at_most(stacked):
    """Each piece's session after the first is opened on the worker thread (rnnfuse.sessions_ahead) while the
    one before it runs; no more than two are ever open; the values are those of one session. A piece whose
    session cannot open raises out of the run, as when it opened in this thread."""
    import threading
    import weakref

    import onnxruntime as ort

    from rnnfuse.graph import Model

    g = Model(stacked).graph
    nodes = list(g.nodes)
    wanted = [n.output[1] for n in nodes if n.op_type == "Loop"]
    inputs = [{"x": np.random.default_rng(s).standard_normal((5, 1, 4)).astype(np.float32)} for s in range(2)]
    live, most, threads = weakref.WeakSet(), [0], []

    def open_(ort_, m, big):
        sess = check_session.open_session(ort_, m, big)
        threads.append(threading.current_thread() is threading.main_thread())
        live.add(sess)
        most[0] = max(most[0], len(live))
        return sess

    whole = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, inputs, open_, 10**6, 1 << 30)
    assert threads == [True]  # (one piece: opened here, no worker)
    threads.clear()
    got = piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, inputs, open_, 20, 1 << 30)
    assert len(threads) > 10 and not any(threads) and most[0] <= 2 and not live
    for name in wanted:
        for a, b in zip(whole[name], got[name]):
            np.testing.assert_array_equal(a, b)

    def fails_third(ort_, m, big, seen=[]):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("cannot open piece 3")
        return check_session.open_session(ort_, m, big)

    with pytest.raises(RuntimeError, match="piece 3"):
        piecewise_runs.run_in_pieces(ort, g, nodes, wanted, {}, inputs, fails_third, 20, 1 << 30)


@pytest.mark.parametrize("threaded", [True, False])
def test_an_opening_raises_what_building_or_opening_raised_when_taken(threaded):
    """A session opened ahead says what went wrong where it is taken, not where it was asked for: a model
    that cannot be built or a session that cannot open raises then, as the call made there would have."""
    from rnnfuse.sessions_ahead import SessionsAhead

    def refuses(model, big):
        raise RuntimeError(f"onnxruntime refuses {model}")

    with SessionsAhead(threaded=threaded) as ahead:
        unbuilt = ahead.open(lambda: 1 / 0, lambda model, big: model)
        unopened = ahead.open(lambda: ("m1", None, "extra"), refuses)
        opened = ahead.open(lambda: ("m2", "+big", "extra"), lambda model, big: model + big)
        with pytest.raises(ZeroDivisionError):
            unbuilt.result()
        with pytest.raises(RuntimeError, match="refuses m1"):
            unopened.result()
        assert opened.result() == ("m2+big", "extra")
