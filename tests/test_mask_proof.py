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
import rnnfuse
from builders_loops import XMASK_FORMS, build_lengths
from rnnfuse import check_session
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


@pytest.mark.parametrize("o", [XMASK, GT0], ids=["xmask", "gt0"])
def test_a_mask_from_the_steps_negated_is_declined(o, proofs, monkeypatch):
    monkeypatch.setattr(derived_masks, "mask_on_every_step", _negated(derived_masks.mask_on_every_step))
    out = B.run_case(o, batches=(1, 4))
    assert out.status == "declined" and not out.fused_mismatch, out.text()
    assert any(p and "the mask built for every step is not the one step" in p for p in proofs), proofs

def _negated(real):
    def negated(b, *a, **k):
        mask = real(b, *a, **k)
        wrong = b.op("Not", mask)
        b.g.model.declare(wrong, b.g.model.known_type(mask))  # (typed as the real one: nothing else tells them apart)
        return wrong

    return negated


@pytest.mark.parametrize("o", [o for o in XMASK_FORMS if o.front in ("loop", "scan")][:4], ids=lambda o: o.name)
def test_a_loop_or_scan_body_mask_built_wrong_is_declined(o, monkeypatch):
    """The same for a mask a Loop or Scan body computes from x_t: built for every step beside the loop, it is
    proven against the body's own nodes replayed on each step's slice; a negated one declines the loop (its
    validation would have passed: it compares the op with the body given the built mask)."""
    model = build_lengths(o)
    fused, report = rnnfuse.optimize(model)
    assert [f.status for f in report.findings] == ["fused"], report.to_text()
    for mod in (loop_masks, scan):
        monkeypatch.setattr(mod, "mask_on_every_step", _negated(mod.mask_on_every_step))
    kept, report = rnnfuse.optimize(model)
    (f,) = report.findings
    assert f.status == "declined" and f.reason.startswith("the mask built for every step is not the one step"), report.to_text()
    assert kept.SerializeToString() == model.SerializeToString()
