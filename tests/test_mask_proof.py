"""A mask built for every step at once is proven equal to the masks the steps computed (rnnfuse.mask_proof).

An unrolled chain whose steps compute their own masks (``lengths > t``, ``(x_t != 0).any(-1)``, ``mask[t] > 0``)
is fused with one mask ``M`` built for all steps, each step then reading ``Gather(M, t)`` in place. Validation
compares the fused op with the steps *given* ``M`` (its patterns override ``M``), so a wrong ``M`` would pass it:
these tests build such wrong masks on purpose (a step index off by one, a mask negated) and check that the chain
is declined with the proof's reason and the model's outputs are the original's; and that the masks the passes
build are proven (the proof runs, and agrees) for each way of writing a step mask.
"""

from __future__ import annotations

import numpy as np
import pytest

import builders as B
from helpers import benchmark_graph
import rnnfuse
from builders_loops import XMASK_FORMS, build_lengths
from rnnfuse import check_session, mask_proof
from rnnfuse.passes import loop_masks, scan
from rnnfuse.passes.unrolled import derived_masks, families

O = B.Opts
LENGTHS = O(op="RNN", front="chain", static_T=5, mask="where", mask_rank=2, lengths="lt")
XMASK = O(op="GRU", lbr=1, front="chain", static_T=5, mask="where", mask_rank=2, lengths="xmask")
GT0 = O(op="GRU", lbr=1, front="chain", static_T=5, mask="where", mask_rank=2, lengths="gt0")


@pytest.fixture
def proofs(monkeypatch) -> list:
    """The proof's verdicts, as the chain pass asks for them."""
    seen = []
    real = families.step_masks_differ

    def recorded(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(families, "step_masks_differ", recorded)
    return seen


@pytest.mark.parametrize("o", [LENGTHS, XMASK, GT0], ids=["lengths", "xmask", "gt0"])
def test_the_masks_built_are_proven(o, proofs, monkeypatch):
    ran = []
    opened = check_session.open_session
    monkeypatch.setattr(check_session, "open_session",
                        lambda ort, m, *a, **k: ran.append(m.graph.name) or opened(ort, m, *a, **k))
    out = B.run_case(o, batches=(1, 4))
    assert out.status == "fused" and not out.fused_mismatch, out.text()
    # (the proof ran in onnxruntime, not given up on, and agreed)
    assert proofs and all(p is None for p in proofs) and "rnnfuse_mask_proof" in ran, (proofs, ran)


class _ShiftedArange:
    """numpy, but ``arange`` one step on: a mask from lengths built for the wrong steps."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def arange(*a, **k):
        return np.arange(*a, **k) + 1


def test_a_mask_from_lengths_built_one_step_off_is_declined(proofs, monkeypatch):
    monkeypatch.setattr(families, "np", _ShiftedArange())
    out = B.run_case(LENGTHS, batches=(1, 4))
    assert out.status == "declined" and not out.fused_mismatch, out.text()
    assert any(p and "the mask built for every step is not the one step" in p for p in proofs), proofs
    assert any("the mask built for every step" in f.reason for f in out.report.declined), out.text()


def _negated(real):
    def negated(b, *a, **k):
        mask = real(b, *a, **k)
        wrong = b.op("Not", mask)
        b.g.model.declare(wrong, b.g.model.known_type(mask))  # (typed as the real one: nothing else tells them apart)
        return wrong

    return negated


@pytest.mark.parametrize("o", [XMASK, GT0], ids=["xmask", "gt0"])
def test_a_mask_from_the_steps_negated_is_declined(o, proofs, monkeypatch):
    monkeypatch.setattr(derived_masks, "mask_on_every_step", _negated(derived_masks.mask_on_every_step))
    out = B.run_case(o, batches=(1, 4))
    assert out.status == "declined" and not out.fused_mismatch, out.text()
    assert any(p and "the mask built for every step is not the one step" in p for p in proofs), proofs

def _named(model):
    """Every body node named, as exporters name them (a body replayed once per step must not repeat a name)."""
    for n in model.graph.node:
        for a in n.attribute:
            for k, b in enumerate(a.g.node):
                b.name = f"{b.op_type}_{k}"
    return model


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("o", [o for o in XMASK_FORMS if o.front in ("loop", "scan")][:4], ids=lambda o: o.name)
def test_a_loop_or_scan_body_mask_built_wrong_is_declined(o, named, monkeypatch):
    """The same for a mask a Loop or Scan body computes from x_t: built for every step beside the loop, it is
    proven against the body's own nodes replayed on each step's slice; a negated one declines the loop (its
    validation would have passed: it compares the op with the body given the built mask)."""
    model = _named(build_lengths(o)) if named else build_lengths(o)
    fused, report = rnnfuse.optimize(model)
    assert [f.status for f in report.findings] == ["fused"], report.to_text()
    for mod in (loop_masks, scan):
        monkeypatch.setattr(mod, "mask_on_every_step", _negated(mod.mask_on_every_step))
    kept, report = rnnfuse.optimize(model)
    (f,) = report.findings
    assert f.status == "declined" and f.reason.startswith("the mask built for every step is not the one step"), report.to_text()
    assert kept.SerializeToString() == model.SerializeToString()


def test_a_long_chain_masked_from_lengths_built_one_step_off_is_declined(monkeypatch):
    """Past 256 steps the proof compares 256 of them, with lengths ending at and beside each: an offset gone
    wrong shows only at the step a row's length ends at, and random lengths missed it at 433 steps."""
    monkeypatch.setattr(families, "np", _ShiftedArange())
    out = B.run_case(O(op="RNN", front="chain", static_T=433, mask="where", mask_rank=2, lengths="lt"), batches=(3,))
    assert out.status == "declined" and not out.fused_mismatch, out.text()


def _padded_steps(T: int, pad: float):
    """x [T, B, 3] whose step t's mask is any(x_t != pad), and M built from x rotated by one step (wrong)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    from rnnfuse.model import Model

    nodes = []

    def mask_of(x: str, tag, axis: int) -> str:
        nodes.extend([helper.make_node("Equal", [x, "pad"], [f"e{tag}"]), helper.make_node("Not", [f"e{tag}"], [f"n{tag}"]),
                      helper.make_node("Cast", [f"n{tag}"], [f"f{tag}"], to=TP.FLOAT),
                      helper.make_node("ReduceMax", [f"f{tag}"], [f"r{tag}"], axes=[axis], keepdims=0),
                      helper.make_node("Cast", [f"r{tag}"], [f"m{tag}"], to=TP.BOOL)])
        return f"m{tag}"

    inits = [numpy_helper.from_array(np.array(pad, np.float32), "pad")] + [
        numpy_helper.from_array(np.array(v, np.int64), k) for k, v in (("one", [1]), ("big", [2**40]), ("zero", [0]))]
    steps = {}
    for t in range(T):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"c{t}"))
        nodes.append(helper.make_node("Gather", ["x", f"c{t}"], [f"x{t}"], axis=0))
        steps[t] = mask_of(f"x{t}", t, 1)
    nodes += [helper.make_node("Slice", ["x", "one", "big", "zero"], ["xa"]),
              helper.make_node("Slice", ["x", "zero", "one", "zero"], ["xb"]), helper.make_node("Concat", ["xa", "xb"], ["xr"], axis=0)]
    wrong = mask_of("xr", "M", 2)
    outs = [helper.make_tensor_value_info(m, TP.BOOL, None) for m in [*steps.values(), wrong]]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [T, "B", 3])], outs, inits)
    return Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])).graph, wrong, steps


@pytest.mark.parametrize("pad", [0.0, -1.0, 1.0])
def test_rows_hold_the_values_a_step_mask_compares_with(pad):
    """A mask ``any(x_t != pad)``: the value sets' rows are filled with the pad value too, whatever it is
    (rows of 0 alone never flip a mask of pad -1: a mask built a step late passed)."""
    g, wrong, steps = _padded_steps(6, pad)
    why = mask_proof.step_masks_differ(g, wrong, 0, steps, "x", 6, 0)
    assert why is not None and why.startswith("the mask built for every step is not the one step"), why


def test_masks_built_alike_are_proven_once_and_one_built_wrong_among_them_is_declined(tmp_path, monkeypatch):
    """Loops stacked on one another, each masking its state by ``max(|x_t|) > 0`` of its own input: their proofs
    digest alike (the nodes, the constants' values, the value sets) and run once; a threshold of another value
    is a proof of its own; one Loop's mask built negated among them is declined alone (its proof is not the
    others', whatever they concluded)."""
    model = benchmark_graph("growth_graphs", "masked_loops", tmp_path / "m.onnx", 3 + 13 * 6)
    ran = []
    opened = check_session.open_session
    monkeypatch.setattr(check_session, "open_session",
                        lambda ort, m, *a, **k: ran.append(m.graph.name) or opened(ort, m, *a, **k))
    fused, report = rnnfuse.optimize(model)
    assert [f.status for f in report.findings] == ["fused"] * 6, report.to_text()
    assert ran.count("rnnfuse_mask_proof") == 1, ran
    # the fourth Loop compares with 0.5: a proof of its own
    import onnx
    from onnx import numpy_helper

    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    body = next(a.g for n in other.graph.node if n.op_type == "Loop" and n.output[0] == "h_last3" for a in n.attribute)
    (gt,) = [n for n in body.node if n.op_type == "Greater"]
    gt.input[1] = "half"
    ran.clear()
    fused, report = rnnfuse.optimize(other)
    assert [f.status for f in report.findings] == ["fused"] * 6 and ran.count("rnnfuse_mask_proof") == 2, (report.to_text(), ran)
    # the third Loop's mask built negated (in every round): declined, the others fused
    real = loop_masks.mask_on_every_step

    def third_negated(b, *a, **k):
        return (_negated(real) if b.anchor.output[0] == "h_last2" else real)(b, *a, **k)

    monkeypatch.setattr(loop_masks, "mask_on_every_step", third_negated)
    fused, report = rnnfuse.optimize(model)
    statuses = {f.where: f.status for f in report.findings}
    assert statuses.pop("h_last2") == "declined" and set(statuses.values()) == {"fused"}, report.to_text()
    (bad,) = report.declined
    assert bad.reason.startswith("the mask built for every step is not the one step"), bad.reason
