"""The index arithmetic a Loop body writes around its step read, read symbolically (rnnfuse/index_terms.py).

Terms: ``("i", k)`` is the iteration number + k (never below k), ``("c", v)`` a constant (booleans 0 / 1),
``("ge", "i", k)`` at least i + k, ``("?",)`` unknown. tf2onnx's strided slices need comparisons decided by
``i >= 0``, ``Where`` on constant conditions, ``Max`` with its "to the end" 1e9, and a shrunk axis written as a
step of 1e9; each rule is checked here, including where it must stay unknown.
"""

from __future__ import annotations

import pytest

from rnnfuse.index_terms import UNKNOWN, elementwise, one_element

I0, I1 = ("i", 0), ("i", 1)
BIG = 10**9


def c(v):
    return ("c", v)


@pytest.mark.parametrize("op, terms, want", [
    ("Less", [I1, c(0)], c(0)),  # i + 1 < 0 never holds
    ("Less", [I0, c(5)], UNKNOWN),  # depends on i
    ("Less", [c(1), c(0)], c(0)),
    ("GreaterOrEqual", [I0, c(0)], c(1)),
    ("Equal", [I1, c(0)], c(0)),
    ("Equal", [I1, I1], c(1)),
    ("Equal", [I1, c(BIG)], UNKNOWN),
    ("And", [c(0), UNKNOWN], c(0)),  # False absorbs
    ("And", [c(1), UNKNOWN], UNKNOWN),
    ("Or", [c(1), UNKNOWN], c(1)),
    ("Not", [c(0)], c(1)),
    ("Where", [c(1), I0, c(BIG)], I0),
    ("Where", [c(0), I0, c(BIG)], c(BIG)),
    ("Where", [UNKNOWN, I0, I0], I0),  # both branches equal
    ("Where", [UNKNOWN, I0, c(3)], UNKNOWN),
    ("Max", [I1, c(0)], I1),  # i + 1 >= 1 > 0
    ("Max", [I1, c(BIG)], ("ge", "i", 1)),  # either way, at least i + 1
    ("Min", [I1, c(0)], c(0)),
    ("Min", [I1, c(BIG)], UNKNOWN),
    ("Add", [I0, c(1)], I1),
    ("Add", [c(2), ("ge", "i", 1)], ("ge", "i", 3)),  # a lower bound shifted by a constant
    ("Sub", [("i", 3), I0], c(3)),
    ("Sub", [("ge", "i", 3), ("ge", "i", 1)], UNKNOWN),  # two lower bounds do not subtract
    ("Add", [I0, I0], UNKNOWN),
])
def test_elementwise(op, terms, want):
    assert elementwise(op, terms) == want


@pytest.mark.parametrize("end, step, want", [
    (I1, c(1), True),  # [i, i + 1)
    (c(BIG), c(BIG), True),  # tf2onnx's shrunk axis: from i, one step of 1e9
    (("ge", "i", 1), c(BIG), True),
    (("i", 2), c(BIG), True),
    (c(BIG), c(1), False),  # from i to the end: many elements
    (c(BIG), c(2), False),
    (c(5), c(BIG), False),  # empty once i >= 5
    (("i", 2), c(1), False),  # two elements
    (UNKNOWN, c(BIG), False),
])
def test_one_element(end, step, want):
    assert one_element(end, step) is want
