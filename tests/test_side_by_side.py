"""Cells side by side over one input: ``h_i = cell_i(x[t], h_i)`` for several cells in each unrolled step.

Every step of the chain over x reads all the cells' states; each cell is its own native op (one lane each,
:mod:`rnnfuse.passes.unrolled.lanes`). Real exports (torch trace and dynamo, a GRU beside an LSTM, a head on
both) are in ``test_stacked_cells``; here hand-built graphs of many lanes, masked and read backwards, checked
against numpy, and the work of a graph of many lanes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import op_counts, session
from rnnfuse.passes.unrolled.chains import Intervals

F, H = 3, 4


def lanes_model(lanes: int, T: int, masked: bool = False, reverse: bool = False, shared_h0: bool = True,
                coupled: bool = False):
    """``lanes`` tanh cells over x (time-major), each its own weights, each stacking its per-step h; masked:
    ``h = where(mask[t], new, h)`` (torch's tracer form); reverse: the steps read x from its last step;
    coupled: cell 0 reads h0 + h1 as its state (no native cell: the two states mix)."""
    rng = np.random.default_rng(lanes * 100 + T)
    nodes, inits, outs, weights = [], [], [], []
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    order = list(range(T))[::-1] if reverse else list(range(T))
    for t in order:
        nodes += [helper.make_node("Constant", [], [f"t{t}"], value=numpy_helper.from_array(np.array(t, np.int64))),
                  helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"], axis=0)]
        if masked:
            nodes += [helper.make_node("Gather", ["mask", f"t{t}"], [f"mb{t}"], axis=0),
                      helper.make_node("Unsqueeze", [f"mb{t}", "axis1"], [f"m{t}"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])]
    if masked:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [T, "B"]))
    hs = {c: "h0" if shared_h0 else f"h0_{c}" for c in range(lanes)}
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", H]) for n in sorted(set(hs.values()))]
    ys: dict[int, list] = {c: [] for c in range(lanes)}
    for c in range(lanes):
        w = [(rng.standard_normal(s) * 0.5).astype(np.float32) for s in ((F, H), (H, H), (H,))]
        weights.append(w)
        inits += [numpy_helper.from_array(a, f"{n}{c}") for n, a in zip("WRb", w)]
    for t in order:
        new = {}
        for c in range(lanes):
            p, h = f"c{c}_{t}_", hs[c]
            if coupled and c == 0:
                nodes.append(helper.make_node("Add", [hs[0], hs[1]], [p + "mix"]))
                h = p + "mix"
            nodes += [helper.make_node("MatMul", [f"x{t}", f"W{c}"], [p + "xw"]),
                      helper.make_node("MatMul", [h, f"R{c}"], [p + "hr"]),
                      helper.make_node("Add", [p + "xw", p + "hr"], [p + "s"]),
                      helper.make_node("Add", [p + "s", f"b{c}"], [p + "a"]),
                      helper.make_node("Tanh", [p + "a"], [p + "n"])]
            if masked:
                nodes.append(helper.make_node("Where", [f"m{t}", p + "n", hs[c]], [p + "h"]))
            else:
                nodes.append(helper.make_node("Identity", [p + "n"], [p + "h"]))
            nodes.append(helper.make_node("Unsqueeze", [p + "h", "axis0"], [p + "y"]))
            new[c] = p + "h"
            ys[c].append(p + "y")
        hs = new
    for c in range(lanes):
        nodes.append(helper.make_node("Concat", ys[c], [f"y{c}"], axis=0))
        outs.append(helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT, [T, "B", H]))
    g = helper.make_graph(nodes, "lanes", inputs, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), weights


def reference(weights, x, h0s, mask=None, reverse=False):
    out = []
    for c, (W, R, b) in enumerate(weights):
        h, ys = h0s[c], []
        for t in (range(len(x)) if not reverse else range(len(x) - 1, -1, -1)):
            n = np.tanh(x[t] @ W + h @ R + b)
            h = np.where(mask[t][:, None], n, h) if mask is not None else n
            ys.append(h)
        out.append(np.stack(ys))
    return out


def run_model(model, feeds):
    return session(model).run(None, feeds)


def _feeds(model, rng, T, B, masked, mask_kind):
    feeds = {"x": rng.standard_normal((T, B, F)).astype(np.float32)}
    if masked:
        lengths = rng.integers(1, T + 1, size=B)
        m = np.arange(T)[:, None] < lengths[None, :]  # post-padded
        if mask_kind == "pre":
            m = m[::-1]
        elif mask_kind == "gappy":
            m = rng.random((T, B)) < 0.6
        feeds["mask"] = m
    for i in model.graph.input[1 + masked:]:
        feeds[i.name] = rng.standard_normal((B, H)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("masked,reverse,shared_h0", [(False, False, True), (False, True, False), (True, False, False),
                                                      (True, True, True)])
def test_each_cell_beside_the_others_is_its_own_native_op(masked, reverse, shared_h0):
    T, lanes = 6, 4
    model, weights = lanes_model(lanes, T, masked, reverse, shared_h0)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == lanes and not report.declined, report.to_text()
    assert op_counts(fused).get("RNN", 0) == lanes and "Tanh" not in op_counts(fused)
    assert len({f.where for f in report.fused}) == lanes  # each lane named by the state it reads
    # a shared h0 is viewed as [1, B, H] once for all the cells (not once a cell, the copies merged after)
    h0_views = [n for n in fused.graph.node if n.op_type == "Unsqueeze" and n.input[0] == "h0"]
    assert len(h0_views) == (1 if shared_h0 else 0), h0_views
    if not masked:  # (nothing for Dedupe to merge: no copies of the view were made)
        assert not any(n.startswith("merged") for p in report.passes if p.name == "dedupe" for n in p.notes), report.to_text()
    rng = np.random.default_rng(7)
    for B, kind in ((1, "post"), (5, "pre"), (5, "gappy")):
        feeds = _feeds(model, rng, T, B, masked, kind)
        got = run_model(fused, feeds)
        h0s = [feeds["h0" if shared_h0 else f"h0_{c}"] for c in range(lanes)]
        want = reference(weights, feeds["x"], h0s, feeds.get("mask"), reverse)
        for c in range(lanes):
            np.testing.assert_allclose(got[c], want[c], atol=1e-5)
        for a, b in zip(got, run_model(model, feeds)):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_cells_whose_states_mix_are_declined():
    """Cell 0 reads h0 + h1: its update reads two states, no native cell; the chain declines, untouched."""
    model, _ = lanes_model(2, 5, coupled=True)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and any("carried values" in f.reason for f in report.declined), report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_work_of_many_cells_side_by_side_grows_with_the_cells(monkeypatch):
    """Each lane's step queries list its own nodes, not every lane's: 4x the lanes, ~4x the values listed (a
    query per lane over the whole step was 16x; 1,000 lanes of 16 steps took 52 s, 12 s now)."""
    listed = {"n": 0}
    in_order = Intervals.in_order

    def counted(iv, end, t, nodes=None):
        for item in in_order(iv, end, t, nodes):
            listed["n"] += 1
            yield item

    monkeypatch.setattr(Intervals, "in_order", counted)
    for lanes in (5, 20):
        listed["n"] = 0
        model, _ = lanes_model(lanes, 4)
        _, report = rnnfuse.optimize(model, validate=False)
        assert len(report.fused) == lanes, report.to_text()
        listed[lanes] = listed["n"]
    assert 0 < listed[20] < 6 * listed[5], listed


def test_lanes_list_their_own_nodes_even_from_a_shared_initial_state(monkeypatch):
    """One h0 read by every cell: what its first step computes from h0 is still each lane's own (the lanes'
    node lists together grow with the cells, not with their square: 1,000 cells held 6.9M entries)."""
    from rnnfuse.passes.unrolled import chains as chains_mod

    split = chains_mod.split_lanes
    sizes = {}

    def recorded(g, chain, iv):
        out = split(g, chain, iv)
        sizes[len(out)] = sum(len(st.lane_nodes or ()) for lane in out for st in lane.steps)
        return out

    monkeypatch.setattr(chains_mod, "split_lanes", recorded)
    for lanes in (5, 20):
        model, _ = lanes_model(lanes, 4, shared_h0=True)
        rnnfuse.optimize(model, validate=False)
    assert sizes[5] > 0 and sizes[20] < 5 * sizes[5], sizes


def test_lanes_come_out_in_the_same_order_whatever_the_hash_seed(tmp_path):
    """The same input gives the same output, byte for byte: the lanes were listed in the order of a set of
    state names, which Python's string hashing changes from one process to the next."""
    model, _ = lanes_model(6, 4)
    src = tmp_path / "lanes.onnx"
    src.write_bytes(model.SerializeToString())
    outs = []
    for seed in ("1", "2", "3"):
        out = tmp_path / f"out{seed}.onnx"
        subprocess.run([sys.executable, "-m", "rnnfuse", "optimize", "-q", str(src), str(out)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    assert op_counts(onnx.load_from_string(outs[0])).get("RNN", 0) >= 1
