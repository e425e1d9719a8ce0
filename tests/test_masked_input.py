"""A masked cell that also zeroes its input at masked steps: ``step.analyse`` reads the input as itself only
where that is what the cell computes at valid steps, under the mask the states keep."""

from __future__ import annotations

import numpy as np
import pytest

from rnnfuse.errors import Decline
from rnnfuse.recurrence import Init
from rnnfuse.step import StepState, analyse
from rnnfuse.symbolic import MASKED_INPUT, STATE, Act, ConstRef, Lin, LinAtom, Mask, Poly, State, StepInput

F, H = 2, 3
rng = np.random.default_rng(0)
W = ConstRef.of(rng.standard_normal((F, H)).astype(np.float32), "W")
R = ConstRef.of(rng.standard_normal((H, H)).astype(np.float32), "R")


def _elman_step(input_key, states_mask: str | None):
    """``h' = tanh(input @ W + h @ R)``, kept where ``states_mask`` is false (when given)."""
    h = State("h", H)
    cell = Poly.atom(Act("Tanh", (), Poly.atom(LinAtom(Lin.make([(input_key, W), ((STATE, "h"), R)], [], H)))))
    if states_mask is None:
        new = cell
    else:
        m = Poly.atom(Mask(states_mask))
        new = m.mul(cell).add(Poly.const(1.0).sub(m).mul(Poly.atom(h)))
    return StepInput("x", F), [StepState("h", new, Init(), final="h_T")], {"h": h}


@pytest.mark.parametrize("a,b", [(0.0, 1.0), (0.5, 0.5)])  # x * m;  (0.5 + 0.5 m) * x
def test_input_zeroed_by_the_states_mask_reads_as_the_input(a, b):
    x, states, atoms = _elman_step((MASKED_INPUT, "m", "x", a, b), "m")
    an = analyse(x, states, [], atoms)
    assert an.masked and an.mask_sym == "m"
    assert an.rec.spec.op == "RNN"
    np.testing.assert_array_equal(an.rec.spec.weights()[0][0], W.arr.T)  # the plain input's weights


def test_input_zeroed_by_another_mask_is_declined():
    x, states, atoms = _elman_step((MASKED_INPUT, "other", "x", 0.0, 1.0), "m")
    with pytest.raises(Decline, match="other than the one the states keep"):
        analyse(x, states, [], atoms)


def test_input_zeroed_at_valid_steps_is_declined():
    x, states, atoms = _elman_step((MASKED_INPUT, "m", "x", 1.0, -1.0), "m")  # x * (1 - m)
    with pytest.raises(Decline, match="not itself at valid steps"):
        analyse(x, states, [], atoms)


def test_input_masked_beside_unmasked_states_is_declined():
    x, states, atoms = _elman_step((MASKED_INPUT, "m", "x", 0.0, 1.0), None)
    with pytest.raises(Decline, match="no state is masked"):
        analyse(x, states, [], atoms)
