"""Unrolled chains in big models are validated step by step: the forms a step's inputs take.

A big model's chain is validated per step (one step of the original against a one-step native op), not on
the whole model: a 100k-node masked chain took a minute and 700 MB to check whole. A masked step is fed its
mask: rows alternately valid and padded, so the check sees the cell at valid rows and the state carried
at padded ones, under the mask polarity the analysis found. A step reading a state with a leading unit
axis (torch dynamo's nn.RNN: ``[1, B, H]`` slices of h0 and of each layer's states) is fed it so. These tests
lower the size limit so small chains take that path: they fuse exactly, a wrong polarity fails the check,
and a step that cannot be checked alone falls back to the whole model instead of going unchecked.
"""

from __future__ import annotations

import numpy as np
import pytest

import builders as B
from helpers import check_case, exported_case, skewed_sessions
from rnnfuse import cell_check, rewrite


@pytest.fixture
def per_step(monkeypatch):
    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 0)  # (every chain is "big")
    monkeypatch.setattr(rewrite, "MASKED_WHOLE_MODEL_LIMIT", 0)


def _masked(op: str, mask: str = "where", direction: str = "forward", **kw) -> B.Opts:
    return B.default_reverse_form(B.Opts(op=op, front="chain", mask=mask, static_T=6, direction=direction, **kw))


@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("mask,direction", [("where", "forward"), ("mul", "reverse"), ("select", "forward")])
def test_masked_chain_is_validated_per_step_and_exact(op, mask, direction, per_step):
    out = B.run_case(_masked(op, mask, direction), batches=(1, 3))
    assert not out.fused_mismatch, out.fused_mismatch
    assert out.status == "fused", out.text()
    (f,) = [f for f in out.report.findings if f.status == "fused"]
    assert f.masked and "per step" in f.validation and f.validation.startswith("ok"), f.validation


# Keras' masked layers carry their previous output through padded steps beside h (and c): a value of its own,
# from zeros, a fill or a given input, stacked as Y (an 86k-node tf_keras Bidirectional GRU unrolled took 21 s
# validated whole; the carried output's select is proven by the analysis, the cell checked per step)
_CARRIED = {  # (each beside a given h0: from the same zeros as h, Dedupe merges the carried output into h)
    "zeros": dict(mask="where", carry_src="prev", init="input", outputs=("seq", "h", "c", "p")),
    "inputs": dict(mask="cast_sub", carry_src="prev", prev_init="input", init="input"),
    "reverse": dict(mask="cast_not", carry_src="prev", init="input", direction="reverse", out_time_order=False),
    "padding": dict(mask="pad_cast", carry_src="prev", init="input_h", outputs=("seq", "h", "c", "p")),
    "zero_filled_beside": dict(mask="where", carry_src="prev", extra_seq=True, init="input", mask_rank=2,
                               outputs=("seq",)),
}


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
@pytest.mark.parametrize("form", sorted(_CARRIED))
def test_a_chain_carrying_its_previous_output_is_validated_per_step_and_exact(op, form, per_step):
    out = B.run_case(_masked(op, **_CARRIED[form]), batches=(1, 3))
    assert not out.fused_mismatch, out.fused_mismatch
    assert out.status == "fused", out.text()
    fused = [f for f in out.report.findings if f.status == "fused" and f.pass_name == "unrolled"]
    assert fused and all("per step" in f.validation and f.validation.startswith("ok") for f in fused), out.text()


def _feed_inverted_masks(monkeypatch) -> None:
    """Step checks feed every mask the opposite of the rows they call valid."""
    feed = cell_check._feed_masks

    def inverted(chk, feeds, batch, run):
        valid = feed(chk, feeds, batch, run)
        for name in chk.masks:
            feeds[name] = (feeds[name] == 0).astype(feeds[name].dtype)
        return valid

    monkeypatch.setattr(cell_check, "_feed_masks", inverted)


@pytest.mark.parametrize("carried", [{}, _CARRIED["zeros"]], ids=["state", "carried_output"])
def test_a_wrong_mask_polarity_fails_the_step_check(carried, per_step, monkeypatch):
    """Feed each step the opposite of what the check expects (as if the analysis had the polarity wrong):
    the rows it calls padded are computed by the cell, so the check fails and the chain is declined."""
    _feed_inverted_masks(monkeypatch)
    out = B.run_case(_masked("GRU", **carried), batches=(1, 3))
    assert out.status == "declined", out.text()
    (f,) = out.report.findings
    assert f.validation == "failed" and "does not reproduce the step" in f.reason, f.line()


def _light_sessions_skewed(monkeypatch, skew_deployed: bool = False) -> list:
    """Step-check sessions whose native outputs (``__Y*``) come out 0.01 off: light ones (no graph
    optimizations), and as-deployed ones too if ``skew_deployed``. Returns the list of each opened
    session's ``light``."""
    return skewed_sessions(monkeypatch, cell_check, lambda light: light or skew_deployed,
                           lambda name: name.rsplit("/", 1)[-1].startswith("__Y"))


@pytest.mark.parametrize("side_by_side", [False, True])
@pytest.mark.parametrize("skew_deployed", [False, True])
def test_a_step_failing_light_is_judged_as_deployed(per_step, monkeypatch, side_by_side, skew_deployed):
    """Step checks run first in light sessions (no onnxruntime graph optimizations: cheaper to set up); a
    failure there is checked again as onnxruntime runs by default, and only a failure there declines. One
    chain (checked alone) and six side by side (their checks sharing sessions)."""
    import rnnfuse

    opened = _light_sessions_skewed(monkeypatch, skew_deployed)
    if side_by_side:
        _, report = rnnfuse.optimize(_lanes_case())
    else:
        report = B.run_case(B.Opts(op="GRU", front="chain", static_T=6), batches=(1, 3)).report
    assert True in opened and False in opened, opened
    chains = [f for f in report.findings if f.pass_name == "unrolled"]
    assert len(chains) == (6 if side_by_side else 1), report.to_text()
    for f in chains:
        if skew_deployed:
            assert f.status == "declined" and "does not reproduce the step" in f.reason, f.line()
        else:
            assert f.status == "fused" and f.validation.startswith("ok (per step"), f.line()


def test_a_step_that_cannot_be_checked_alone_is_checked_whole(per_step, monkeypatch):
    """A cell check that cannot run (here: made to say so) leaves the chain to whole-model validation,
    never to no validation."""
    monkeypatch.setattr(cell_check, "_validate_cells_once",
                        lambda g, rec, seed, prepack: cell_check.ValidationResult(False, "cannot build the step"))
    for o in (_masked("LSTM"), B.Opts(op="GRU", front="chain", static_T=6)):
        out = B.run_case(o, batches=(1, 3))
        assert out.status == "fused", out.text()
        (f,) = [f for f in out.report.findings if f.status == "fused"]
        assert f.validation.startswith("ok") and "per step" not in f.validation, f.validation


def test_a_step_whose_inputs_cannot_be_made_is_checked_whole(per_step, monkeypatch):
    """Dims no array takes (a type onnx's data propagation got wrong: rank 99) were an internal error of the
    whole run; the step is left to whole-model validation, as one that cannot be checked alone."""
    import rnnfuse

    monkeypatch.setattr(cell_check, "_sized", lambda dims, batch: [1] * 99)
    for o in (_masked("LSTM"), B.Opts(op="GRU", front="chain", static_T=6)):
        out = B.run_case(o, batches=(1, 3))
        assert out.status == "fused", out.text()
        (f,) = [f for f in out.report.findings if f.status == "fused"]
        assert f.validation.startswith("ok") and "per step" not in f.validation, f.validation
    _, report = rnnfuse.optimize(_lanes_case())  # (six chains side by side: their checks would share sessions)
    chains = [f for f in report.findings if f.pass_name == "unrolled"]
    assert len(chains) == 6 and all(f.status == "fused" and "per step" not in f.validation for f in chains), \
        report.to_text()


def test_padded_rows_expect_the_state_read():
    """The expected padded row is the state fed to the step, zero for a folded zero start, else the fill."""
    from rnnfuse.recurrence import CellCheck

    feeds = {"h_in": np.arange(6, dtype=np.float32).reshape(3, 2)}
    chk = CellCheck([], {"h_in": "h"}, {"h_out": "h"}, masks={"m": (9, (1,))})
    np.testing.assert_array_equal(cell_check._state_read(chk, "h", feeds, (3, 2)), feeds["h_in"])
    zero = CellCheck([], {}, {"h_out": "h"}, zero={"h"})
    assert not cell_check._state_read(zero, "h", feeds, (3, 2)).any()
    filled = CellCheck([], {}, {"h_out": "h"}, fills={"f": 0.5})
    np.testing.assert_array_equal(cell_check._state_read(filled, "h", feeds, (3, 2)), np.full((3, 2), 0.5, np.float32))
    valid = cell_check._feed_masks(chk, feeds, 3, 1)
    assert valid.tolist() == [False, True, False] and feeds["m"].dtype == np.bool_ and feeds["m"].shape == (3, 1)
    assert feeds["m"][:, 0].tolist() == [False, True, False]


@pytest.mark.parametrize("name", ["rnn_relu_L2_dynamo_h0", "rnn_tanh_L2_dynamo_bf", "rnn_tanh_bidir_dynamo"])
def test_dynamo_rnn_states_with_a_unit_lead_are_checked_per_step(torch_dir, name, per_step):
    """torch dynamo's nn.RNN: each layer's steps read [1, B, H] states (slices of h0, Unsqueezes): checked
    step by step, fed in that shape, the layers fuse and match torch's own outputs."""
    fused, report = check_case(exported_case(torch_dir, name))
    assert not report.declined, report.to_text()
    chains = [f for f in report.fused if f.pass_name == "unrolled"]
    assert chains and all("per step" in f.validation for f in chains), report.to_text()


def test_masked_chains_of_mid_size_models_are_still_checked_whole(monkeypatch):
    """Between the two limits (here: any size) a masked chain is validated on the whole model, which also
    checks its mask plumbing; an unmasked one step by step."""
    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 0)
    for o, per_step in ((_masked("GRU"), False), (B.Opts(op="GRU", front="chain", static_T=6), True)):
        out = B.run_case(o, batches=(1, 3))
        (f,) = [f for f in out.report.findings if f.status == "fused"]
        assert f.validation.startswith("ok") and ("per step" in f.validation) == per_step, f.validation


def test_a_failed_step_stands_when_a_later_one_cannot_be_checked(per_step, monkeypatch):
    """The first step check fails; the second cannot be built: the chain is declined (not handed to a
    whole-model validation that might be skipped), whether checked light or again as deployed."""
    build = cell_check._check_model
    built = []

    def second_unbuildable(g, cell, chk, weights):
        if not any(c is chk for c in built):
            built.append(chk)
        if chk is not built[0]:
            return cell_check.ValidationResult(False, "cannot build the step")
        return build(g, cell, chk, weights)

    monkeypatch.setattr(cell_check, "_check_model", second_unbuildable)
    _feed_inverted_masks(monkeypatch)
    out = B.run_case(_masked("LSTM"), batches=(1, 3))
    assert len(built) == 2 and out.status == "declined", out.text()
    (f,) = out.report.findings
    assert f.validation == "failed", f.line()


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_a_step_reading_the_batch_from_the_input_shape_is_checked_per_step(op, batch_first, per_step):
    """torch's trace of ``gates.view(x.size(1), 4, H)``: every step reads the batch from the whole input's
    shape. The step check is fed zeros of the input's dims (the batch its own), since only the shape is read;
    it used to be "not constant", and a 1,000-step chain (32k nodes) was validated whole: 3.5 s of loading."""
    o = B.default_reverse_form(B.Opts(op=op, front="chain", static_T=6, layout="fused_view_batch", batch_first=batch_first))
    out = B.run_case(o, batches=(1, 3))
    assert not out.fused_mismatch and out.status == "fused", out.text()
    (f,) = out.report.findings
    assert "per step" in f.validation and f.validation.startswith("ok"), f.validation


def test_a_wrong_cell_reading_the_input_shape_fails_its_step_check(per_step, monkeypatch):
    """The step check of such a step compares: a native op given slightly wrong weights fails it."""
    build = cell_check._check_model

    def wrong_weights(g, cell, chk, weights):
        W, R, Bias = weights
        return build(g, cell, chk, (W * np.float32(1.01), R, Bias))

    monkeypatch.setattr(cell_check, "_check_model", wrong_weights)
    out = B.run_case(B.default_reverse_form(B.Opts(op="LSTM", front="chain", static_T=6, layout="fused_view_batch")),
                     batches=(1, 3))
    assert out.status == "declined", out.text()
    (f,) = out.report.findings
    assert f.validation == "failed" and "does not reproduce the step" in f.reason, f.line()


def test_only_a_tensor_read_for_its_shape_with_known_dims_is_fed_as_zeros():
    """What the step check may feed as zeros: a tensor only ``Shape`` reads, with static dims but the batch."""
    from onnx import TensorProto, helper

    from rnnfuse.graph import Model
    from rnnfuse.recurrence import CellCheck

    def case(x_dims, reader="Shape", batch=None, xt_dims=("B", 3)):
        vi = helper.make_tensor_value_info
        nodes = [helper.make_node(reader, ["x"], ["s"]), helper.make_node("Identity", ["xt"], ["y"])]
        g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, x_dims), vi("xt", TensorProto.FLOAT, list(xt_dims))],
                              [vi("s", TensorProto.FLOAT, None), vi("y", TensorProto.FLOAT, list(xt_dims))])
        model = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
        chk = CellCheck(list(model.graph.nodes), {"xt": "x"}, {"y": "h"}, batch=batch)
        dims, shaped = {}, {}
        return cell_check._shape_source(model.graph, chk, "x", dims, shaped), dims.get("x")

    assert case([5, "B", 3]) == (True, (5, "B", 3))
    assert case([5, "B", 3], reader="Relu") == (False, None)  # (its values are read)
    assert case(["T", "B", 3]) == (False, None)  # (a dim not known: the step might read it)
    assert case([5, 2, 3], xt_dims=(2, 3)) == (False, None)  # (a static batch the runs do not keep)
    assert case([5, 2, 3], xt_dims=(2, 3), batch=2) == (True, (5, 2, 3))
    assert case([1 << 20, "B", 64]) == (False, None)  # (too big to feed)


def _lanes_case():
    from test_side_by_side import lanes_model

    return lanes_model(6, 5, shared_h0=False)[0]


def test_step_checks_of_several_chains_share_sessions_with_the_verdicts_of_checks_alone(per_step, monkeypatch):
    """Six cells side by side, each chain checked per step: their step checks run in shared sessions (far
    fewer than one a step), each chain getting the runs and errors it gets checked alone, and the same output."""
    import rnnfuse

    model = _lanes_case()
    opened = []
    open_session = cell_check.open_session
    monkeypatch.setattr(cell_check, "open_session", lambda *a, **k: opened.append(1) or open_session(*a, **k))
    shared, shared_report = rnnfuse.optimize(model)
    shared_sessions = len(opened)
    monkeypatch.setattr(cell_check, "STEPS_PER_SESSION", 1)
    opened.clear()
    alone, alone_report = rnnfuse.optimize(model)
    assert len(shared_report.fused) == 6 and not shared_report.declined, shared_report.to_text()
    checks = len(opened)
    assert checks >= 6 and shared_sessions <= checks // 3, (shared_sessions, checks)
    assert [f.validation for f in shared_report.fused] == [f.validation for f in alone_report.fused]
    assert all("per step" in f.validation for f in shared_report.fused)
    assert shared.SerializeToString() == alone.SerializeToString()


def test_a_chain_failing_its_shared_step_check_is_declined_and_the_others_kept(per_step, monkeypatch):
    """One chain's native cell is given wrong weights: checked with the others it fails, is checked alone
    (failing again: declined, its step kept), and the chains sharing its sessions fuse."""
    import rnnfuse

    build = cell_check._check_model

    def lane_two_wrong(g, cell, chk, weights):
        if any(n.output[0].startswith("c2_") for n in chk.nodes):
            W, R, Bias = weights
            weights = (W * np.float32(1.01), R, Bias)
        return build(g, cell, chk, weights)

    monkeypatch.setattr(cell_check, "_check_model", lane_two_wrong)
    _, report = rnnfuse.optimize(_lanes_case())
    (bad,) = report.declined
    assert bad.validation == "failed" and "does not reproduce the step" in bad.reason, bad.line()
    assert len(report.fused) == 5 and all(f.validation.startswith("ok (per step") for f in report.fused)


@pytest.mark.parametrize("init,kinds", [("input", 1), ("zeros", 2)])
def test_the_first_step_is_checked_apart_only_when_it_differs(init, kinds, per_step):
    """A first step signed as the reference step (a given h0: the same nodes and constants) would repeat the
    reference's check number for number; one that starts from a folded zero state is checked as well."""
    out = B.run_case(B.Opts(op="GRU", front="chain", static_T=6, init=init), batches=(1, 3))
    assert not out.fused_mismatch and out.status == "fused", out.text()
    (f,) = [f for f in out.report.findings if f.status == "fused"]
    assert f"per step, {kinds} step kinds" in f.validation, f.validation


def test_a_mask_rewritten_in_place_that_fails_to_run_declines_the_chain(monkeypatch):
    """A chain masked from lengths makes every step's comparison read its slice of the whole mask, in place:
    the original steps read it too, so when onnxruntime cannot run what was built, the check model of the
    original tensors alone fails as well. That is no sign the input model cannot run (validation skipped, the
    rewrite applied): the chain is declined. (Here each step reads a slice past the mask's end.)"""
    import rnnfuse
    from rnnfuse.passes.unrolled import families

    def out_of_range(self, g, b, mask, axis, length, computed):  # (and no proof of the mask: see test_mask_proof)
        for t, n in computed.items():
            g.rewrite_in_place(n, "Gather", [mask, b.const(np.array(t + 1000, np.int64), "t")], axis=axis)

    model, _ = B.build(B.Opts(op="RNN", front="chain", mask="where", mask_rank=2, lengths="lt", static_T=5))
    monkeypatch.setattr(families.StepMask, "read_steps", out_of_range)
    out, report = rnnfuse.optimize(model)
    chains = [f for f in report.findings if f.pass_name == "unrolled"]
    assert chains and all(f.status == "declined" for f in chains), report.to_text()
    assert not any(n.op_type == "RNN" for n in out.graph.node)


def test_an_input_that_cannot_run_still_skips_validation_past_other_edits():
    """An input model onnxruntime cannot run (a custom op feeding the recurrence), an Identity after the
    custom op that DropNoOps reads through: a node another pass rewired this round is no rewrite's own
    construction, so the check's failing is still the input's, and the rewrite rests on its symbolic proof
    (validation skipped) as without the Identity."""
    import onnx
    import rnnfuse
    from onnx import helper

    model, _ = B.build(B.Opts(op="GRU", lbr=1))
    g = model.graph
    x = g.input[0]
    raw, mid = x.name + "_raw", x.name + "_mid"
    g.node.insert(0, helper.make_node("Identity", [mid], [x.name], name="id_after_custom"))
    g.node.insert(0, helper.make_node("Mystery", [raw], [mid], domain="com.example.custom"))
    for name in (mid, x.name):
        g.value_info.add().CopyFrom(onnx.helper.make_tensor_value_info(name, x.type.tensor_type.elem_type, None))
        g.value_info[-1].type.CopyFrom(x.type)
    x.name = raw
    model.opset_import.append(helper.make_opsetid("com.example.custom", 1))
    out, report = rnnfuse.optimize(model)
    fused = [f for f in report.findings if f.status == "fused"]
    assert fused and "onnxruntime cannot run the original" in fused[0].validation, report.to_text()
    assert any(n.op_type == "GRU" for n in out.graph.node)


def test_a_cell_state_squared_is_no_coupled_gate():
    """``c' = c - c*c + i*g`` has the three terms of a coupled input-forget gate, but no gate multiplies c (it
    was an internal error, StopIteration: a review's repro): not read as one."""
    from rnnfuse.cells.lstm import _coupled_gates
    from rnnfuse.symbolic import Act, Poly, State

    c, h = State("s0", 4), State("s1", 4)
    i = Poly.atom(Act("Sigmoid", (), Poly.atom(h)))
    g = Poly.atom(Act("Tanh", (), Poly.atom(h).scale(2.0)))
    pc = Poly.atom(c).sub(Poly.atom(c).mul(Poly.atom(c))).add(i.mul(g))
    assert len(pc.terms) == 3
    assert _coupled_gates(pc, c) is None
