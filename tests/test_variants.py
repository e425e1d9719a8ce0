"""Cell maths beyond the textbook spelling (issue 15): fused exactly after weight algebra, near misses declined.

Models are exported during the test run by ``tests/exporters/variant_cases.py`` (hand-written torch cells in a
Python loop: trace and dynamo unroll them into chains, TorchScript writes a Loop), forward, reverse and
bidirectional, masked and unmasked, with weights large enough that every term's sign matters.

* ``test_variant_fused``: each exact variant becomes one native op of the expected kind, direction and
  attributes (a peephole LSTM carries ``P``), with outputs equal to torch's own and to onnxruntime on the
  original to 1e-5 on every input set (post-, pre-padded and gappy masks, a row with no valid step,
  batch 1 and 3). Variants not implemented yet are ``xfail(strict=True)``: the gap stays visible, and a
  case that starts to pass must have its mark removed.
* ``test_near_miss_declined``: each near miss is declined with a reason naming what differed, no native op
  is added, and the outputs are unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import rnnfuse
from helpers import assert_close, check_case, exported_case, load_sets, op_counts, session
from rnnfuse.graph import attr

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from variant_cases import CASES  # noqa: E402  (plain data; does not import torch)

NATIVE = ("LSTM", "GRU", "RNN")

# exact variants rnnfuse does not fuse yet: cell -> why (xfail, strict)
NOT_YET: dict[str, str] = {}
NOT_YET_CASES: dict[str, str] = {}
# near misses declined today, but for a reason that does not name what differed: case name -> why (xfail)
REASON_NOT_YET: dict[str, str] = {}


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name)


def _fused_param(c):
    why = NOT_YET_CASES.get(c.name) or NOT_YET.get(c.cell)
    marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
    return pytest.param(c.name, id=c.name, marks=marks)


@pytest.mark.parametrize("name", [_fused_param(c) for c in CASES if c.native is not None])
def test_variant_fused(variant_dir, name):
    case = _case(variant_dir, name)
    expect = case["expect"]
    fused, report = check_case(case)  # outputs vs original and vs torch on every set, ops, directions
    assert not report.declined, report.to_text()
    assert report.fused and all(f.validation.startswith("ok") for f in report.fused), report.to_text()
    natives = [n for n in fused.graph.node if n.op_type in NATIVE]
    (op,) = expect["ops"]
    assert [n.op_type for n in natives] == [op], report.to_text()
    node = natives[0]
    for key, want in expect["attrs"][op].items():
        got = attr(node, key)
        if key == "activations":
            per = len(want)
            got = list(got or [])
            assert got and all(got[k:k + per] == want for k in range(0, len(got), per)), (got, want)
        elif isinstance(want, float):
            assert got is not None and abs(got - want) < 1e-6, (key, got, want)
        else:
            assert (got or 0) == want, (key, got, want)
    has_p = len(node.input) > 7 and bool(node.input[7])
    assert has_p == expect["peephole"], f"P input {'missing' if expect['peephole'] else 'unexpected'}"
    if has_p:  # P is [D, 3H]: one row per direction
        inits = {t.name: t for t in fused.graph.initializer}
        arr = onnx.numpy_helper.to_array(inits[node.input[7]])
        dirs = 2 if expect["directions"][op] == ["bidirectional"] else 1
        assert arr.shape == (dirs, 3 * int(attr(node, "hidden_size"))), arr.shape


def _near(name, with_reason_marks=False):
    why = REASON_NOT_YET.get(name) if with_reason_marks else None
    return pytest.param(name, id=name, marks=[pytest.mark.xfail(reason=why, strict=True)] if why else [])


NEAR = [c.name for c in CASES if c.native is None]


@pytest.mark.parametrize("name", [_near(n) for n in NEAR])
def test_near_miss_declined(variant_dir, name):
    """Declined, nothing native added, outputs unchanged (against the original and against torch)."""
    case = _case(variant_dir, name)
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    text = report.to_text()
    assert report.declined and not report.fused, text
    counts = op_counts(fused)
    assert sum(counts.get(op, 0) for op in NATIVE) == 0, text
    s_orig, s_fused = session(original), session(fused)
    for set_name, (feeds, outs) in load_sets(case["npz"]).items():
        got = s_fused.run(None, feeds)
        assert_close(got[0], s_orig.run(None, feeds)[0], f"{name}/{set_name}: unchanged")
        assert_close(got[0], outs["0"], f"{name}/{set_name}: vs torch")


@pytest.mark.parametrize("name", [_near(n, with_reason_marks=True) for n in NEAR])
def test_near_miss_reason(variant_dir, name):
    """The reason names what differed (the words listed in the generator's DECLINE_WORDS)."""
    case = _case(variant_dir, name)
    _, report = rnnfuse.optimize(onnx.load(case["onnx"]))
    words = case["expect"]["reason_words"]
    assert report.declined, report.to_text()
    for f in report.declined:
        assert all(w in f.reason.lower() for w in words), f"reason does not name {words}: {f.reason}"


def test_generator_covers_every_item():
    """Each issue item (and 6, other spellings of the textbook cells) has an exact case in every direction and
    masked, plus near misses."""
    items = {c.item for c in CASES if c.native is not None}
    assert items == {1, 2, 3, 4, 5, 6}
    for item in items:
        cs = [c for c in CASES if c.item == item]
        assert {c.direction for c in cs} >= ({"forward", "bidirectional"} if item == 5 else {"forward", "reverse", "bidirectional"})
        assert any(c.masked for c in cs) and any(not c.masked for c in cs)
    assert len([c for c in CASES if c.native is None]) >= 6
    assert np.unique([c.name for c in CASES]).size == len(CASES)
