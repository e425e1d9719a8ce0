"""The bidirectional merge never makes an op read its own output.

A forward and a reverse native op over one X are merged into one op; when one of the two is computed from the
other, directly or through a pair merged before, the merged op would read its own output. A torch loop stepping
a forward and a backward cell together (x[t] and x[T-1-t]) was once fused as two half chains a direction, and
pairing them crossed: the first pair's reverse half starts from the second pair's reverse state while the second
pair's forward half starts from the first pair's forward state ("graph has a cycle after rewriting").
"""

from __future__ import annotations

import numpy as np
import pytest
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.graph import Model
from rnnfuse.passes.bidirectional import MergeBidirectional
from rnnfuse.pipeline import Options

T, B, F, H = 5, 2, 3, 4


def _gru(name: str, direction: str, h0: str, rng) -> tuple[onnx.NodeProto, list]:
    w = numpy_helper.from_array(rng.standard_normal((1, 3 * H, F)).astype(np.float32) * 0.5, f"{name}_W")
    r = numpy_helper.from_array(rng.standard_normal((1, 3 * H, H)).astype(np.float32) * 0.5, f"{name}_R")
    node = helper.make_node("GRU", ["X", w.name, r.name, "", "", h0], [f"{name}_Y", f"{name}_h"], name=name,
                            hidden_size=H, direction=direction, linear_before_reset=1)
    return node, [w, r]


def _crossed_pairs() -> onnx.ModelProto:
    """fw_b starts from fw_a's last state and rv_a from rv_b's, listed so that the pass pairs (fw_a, rv_a) and
    (fw_b, rv_b): each pair alone is independent, merged together they read each other."""
    rng = np.random.default_rng(0)
    made = [_gru("fw_a", "forward", "h0", rng), _gru("fw_b", "forward", "fw_a_h", rng),
            _gru("rv_a", "reverse", "rv_b_h", rng), _gru("rv_b", "reverse", "h0", rng)]
    nodes = [n for n, _ in made]
    inits = [t for _, ts in made for t in ts]
    nodes.append(helper.make_node("Concat", [f"{n.name}_Y" for n in nodes], ["Y"], axis=1))
    g = helper.make_graph(nodes, "crossed", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T, B, F]),
                                              helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, B, H])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [T, 4, B, H])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_merge_that_would_close_a_cycle_through_another_pair_is_declined():
    src = _crossed_pairs()
    feeds = {"X": np.random.default_rng(1).standard_normal((T, B, F)).astype(np.float32),
             "h0": np.random.default_rng(2).standard_normal((1, B, H)).astype(np.float32)}
    sorted_src = onnx.ModelProto()
    sorted_src.CopyFrom(src)  # (onnxruntime wants the nodes in order: rv_b before rv_a)
    order = [0, 1, 3, 2, 4]
    nodes = [sorted_src.graph.node[i] for i in order]
    copies = [onnx.NodeProto() for _ in nodes]
    for c, n in zip(copies, nodes):
        c.CopyFrom(n)
    del sorted_src.graph.node[:]
    sorted_src.graph.node.extend(copies)
    want = _run(sorted_src, feeds)

    model = Model(src)
    res = MergeBidirectional().run(model, Options())
    model.graph.finalize()  # (sorts: a cycle raised here)
    statuses = sorted((f.status, f.reason) for f in res.findings)
    assert [s for s, _ in statuses] == ["declined", "merged"], statuses
    assert "computed from the other" in statuses[0][1]
    assert sum(n.op_type == "GRU" and any(a.s == b"bidirectional" for a in n.attribute) for n in model.proto.graph.node) == 1
    np.testing.assert_allclose(_run(model.proto, feeds), want, rtol=1e-5, atol=1e-6)


def test_independent_pairs_are_all_merged():
    """The near miss: the same four ops with both reverse ops started from h0 merge into two bidirectional ops."""
    src = _crossed_pairs()
    for n in src.graph.node:
        if n.name == "rv_a":
            n.input[5] = "h0"
    feeds = {"X": np.random.default_rng(1).standard_normal((T, B, F)).astype(np.float32),
             "h0": np.random.default_rng(2).standard_normal((1, B, H)).astype(np.float32)}
    want = _run(src, feeds)
    model = Model(src)
    res = MergeBidirectional().run(model, Options())
    model.graph.finalize()
    assert [f.status for f in res.findings] == ["merged", "merged"], [(f.status, f.reason) for f in res.findings]
    np.testing.assert_allclose(_run(model.proto, feeds), want, rtol=1e-5, atol=1e-6)


def _behind_a_prologue(m: onnx.ModelProto, length: int) -> onnx.ModelProto:
    """``m`` with its X and h0 computed by ``length`` Identity nodes each from the graph's inputs X0, h00."""
    pre = []
    for name in ("X", "h0"):
        for i in range(length):
            src = f"{name}0" if i == 0 else f"{name}_pre{i - 1}"
            pre.append(helper.make_node("Identity", [src], [name if i == length - 1 else f"{name}_pre{i}"]))
    for vi in m.graph.input:
        vi.name += "0"
    nodes = pre + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


@pytest.mark.parametrize("walk", ["pruned", "whole"])
def test_cycles_are_found_behind_a_long_prologue_without_walking_it(monkeypatch, walk):
    """The ancestry walk goes up only through nodes computed from an op: behind 2 x 500 prologue nodes it
    visits the few nodes after the ops, and finds the same cycle as the walk over everything (the downstream
    too big to walk: DOWNSTREAM_WALK 0)."""
    import rnnfuse.passes.bidirectional as bidirectional

    if walk == "whole":
        monkeypatch.setattr(bidirectional, "DOWNSTREAM_WALK", 0)
    made = []
    init = bidirectional._OpAncestry.__init__
    monkeypatch.setattr(bidirectional._OpAncestry, "__init__", lambda self, *a: made.append(self) or init(self, *a))
    model = Model(_behind_a_prologue(_crossed_pairs(), 500))
    res = MergeBidirectional().run(model, Options())
    model.graph.finalize()
    statuses = sorted((f.status, f.reason) for f in res.findings)
    assert [s for s, _ in statuses] == ["declined", "merged"], statuses
    assert "computed from the other" in statuses[0][1]
    (ancestry,) = made
    assert (len(ancestry.memo) < 20) if walk == "pruned" else (len(ancestry.memo) > 1000), len(ancestry.memo)
