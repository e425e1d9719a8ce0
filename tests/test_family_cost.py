"""Graphs of many step-sliced families that hold no chain cost the chain search no walk of the graph each.

A family (slices of one tensor along an axis, step by step) may be the steps of an unrolled recurrence. To
thread chains the search gives every node the span of steps it depends on (``intervals``), a walk of
everything downstream of the family. A graph of many families that hold no chain paid it per family:
a 600-layer transformer (each layer's q, k and v an ``unbind`` of one tensor) took 98 s, 1,500
``unbind``/``stack`` blocks 11 minutes. Now a family is walked only if its steps' own regions combine a
step's values with something that may come from another step (``family_filter.may_hold_chains``) and its source is
a ``[T, B, F]`` / ``[B, T, F]`` sequence. Counted, never timed; and the shortcut must never hide a chain:
every family whose chains the full search threads passes the pre-check, over the hand-built chain cases.
"""

from __future__ import annotations

import os
import sys

import pytest
from onnx import TensorProto

import builders as B
import rnnfuse
import rnnfuse.passes.unrolled.rule as rule
from rnnfuse.graph import Model
from rnnfuse.passes.unrolled.chains import find_chains, intervals
from rnnfuse.passes.unrolled.family_filter import may_hold_chains
from rnnfuse.passes.unrolled.derived_masks import derived_masks
from rnnfuse.passes.unrolled.families import find_families, is_row_family, length_masks, mask_leaves
from rnnfuse.passes.unrolled.whole_inputs import WholeInputs
from rnnfuse.signature import Signer

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from graphs import attention_model, cells_side_by_side, unbind_stack_model  # (the benchmark's generators, at a test's size)
finally:
    sys.path.remove(BENCHMARKS)


def _count_intervals(monkeypatch) -> list:
    walks = []
    walk = rule.intervals

    def counted(g, order, leaves):
        walks.append(len(order))
        return walk(g, order, leaves)

    monkeypatch.setattr(rule, "intervals", counted)
    return walks


@pytest.mark.parametrize("steps", [4, 12])  # (a Concat of up to 8 steps is looked at as a combining node)
def test_unbind_stack_blocks_cost_no_intervals_walk(steps, monkeypatch):
    walks = _count_intervals(monkeypatch)
    model = unbind_stack_model(12, steps)
    out, report = rnnfuse.optimize(model)
    assert not walks, walks
    assert not report.findings and out.SerializeToString() == model.SerializeToString(), report.to_text()


@pytest.mark.parametrize("rank_by_op", [True, False])
def test_attention_blocks_cost_no_intervals_walk_and_no_declines(rank_by_op, monkeypatch):
    """q, k and v combine, so each block's family could hold a "chain" -- over a rank-4 source, which no
    native op reads: not searched (it was 1,200 declines for a 600-layer transformer). Where the Transpose
    before the slices fixes the source's rank by its ``perm``, the family is dropped before any type is asked
    (dataflow.settled_rank); where it does not (no ``perm``: it reverses a tensor of unknown rank), the search
    learns the rank at the layout check and says so once, in a note."""
    walks = _count_intervals(monkeypatch)
    model = attention_model(10)
    if not rank_by_op:
        for n in model.graph.node:
            if n.op_type == "Transpose" and n.output[0].endswith("_t"):
                del n.attribute[:]
    fams = find_families(Model(model).graph)
    assert len([k for k in fams if k[0].endswith("_t")]) == (0 if rank_by_op else 10), fams
    out, report = rnnfuse.optimize(model)
    assert not walks, walks
    assert not report.declined and out.SerializeToString() == model.SerializeToString(), report.to_text()
    notes = [n for p in report.passes if p.name == "unrolled" for n in p.notes]
    assert any(n.startswith("10 tensor(s) sliced into steps") for n in notes) != rank_by_op, notes


def test_a_chain_family_is_still_walked_and_fused(monkeypatch):
    """A family that does hold a chain passes the pre-check: walked, threaded and fused."""
    walks = _count_intervals(monkeypatch)
    out = B.run_case(B.Opts(op="GRU", front="chain", static_T=6), batches=(1, 3))
    assert out.status == "fused" and len(walks) >= 1, out.text()


def test_the_search_takes_the_pre_checks_regions(tmp_path, monkeypatch):
    """The pre-check walks each step's x-local region; the chain search over the same graph, with the same
    (no) given constants and masks, takes those instead of walking them again: one walk a step."""
    import onnx

    import rnnfuse.passes.unrolled.chains as chains
    import rnnfuse.passes.unrolled.family_filter as family_filter

    walked = []
    real = chains.x_region

    def counted(g, x, *rest):
        walked.append(x)
        return real(g, x, *rest)

    monkeypatch.setattr(chains, "x_region", counted)
    monkeypatch.setattr(family_filter, "x_region", counted)
    path = str(tmp_path / "side.onnx")
    cells_side_by_side(path, 2000)
    out, report = rnnfuse.optimize(onnx.load(path))
    assert len([f for f in report.findings if f.status == "fused"]) >= 2, report.to_text()
    assert len(walked) == len(set(walked)) == 16, walked


def _chain_cases() -> list:
    import test_handbuilt as H

    return [p.values[0] for p in H._valid_cases() + H._near_miss_cases() if p.values[0].front == "chain"]


def test_every_family_the_search_threads_into_chains_passes_the_precheck():
    """The pre-check is necessary, never a guess: over the hand-built chain cases (valid cells and near
    misses, masked, bidirectional, stacked...), each family's chains as the full search finds them (with the
    pass's masks) exist only where may_hold_chains says they may, asked with those masks and without them."""
    threaded = 0
    for o in _chain_cases():
        model, _ = B.build(o)
        g = Model(model).graph
        g.prune()
        fams = find_families(g)
        signer = Signer(g)
        fams.update(WholeInputs(g).families(fams, signer))
        order, lengths = g.ordered_live_nodes(), length_masks(g)
        for (src, axis), fam in fams.items():
            if g.model.elem_type(src) == TensorProto.BOOL or is_row_family(g, src):
                continue
            leaves, mask_fam, _ = mask_leaves(g, fams, fam, lengths + derived_masks(g, fams, (src, axis), signer))
            if find_chains(g, fam, intervals(g, order, leaves), mask_fam):
                threaded += 1
                # (the pass asks without the masks first: that answer gates the masked one, and the input maps)
                assert may_hold_chains(g, fam) and may_hold_chains(g, fam, mask_fam), o.label()
    assert threaded >= 400, threaded


def test_settled_rank_is_exact_where_it_answers():
    """The rank an op fixes (a Transpose's perm, Squeeze / Unsqueeze axes, a Reshape to a constant shape, an
    op keeping its input's rank) or the file declares; None where only the data would say (a Reshape to a
    runtime shape, a Squeeze of no axes). Where it answers, shape inference agrees."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from rnnfuse.dataflow import settled_rank

    nodes = [helper.make_node("Reshape", ["x", "runtime_shape"], ["r"]),  # rank unknown
             helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 1, 3]),
             helper.make_node("Squeeze", ["t", "ax0"], ["sq"]),
             helper.make_node("Unsqueeze", ["sq", "ax0"], ["usq"]),
             helper.make_node("Relu", ["usq"], ["relu"]),
             helper.make_node("Reshape", ["relu", "shape2"], ["flat"]),
             helper.make_node("Squeeze", ["flat"], ["all_units"]),
             helper.make_node("Tanh", ["x"], ["tx"]),
             helper.make_node("Transpose", ["r"], ["rev"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "ax0"), numpy_helper.from_array(np.array([4, -1], np.int64), "shape2")]
    outs = ["t", "sq", "usq", "relu", "flat", "all_units", "tx", "rev"]
    graph = helper.make_graph(nodes, "ranks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 4, 5]),
                                               helper.make_tensor_value_info("runtime_shape", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = Model(model).graph
    got = {o: settled_rank(g, o) for o in ["r"] + outs}
    assert got == {"r": None, "t": 4, "sq": 3, "usq": 4, "relu": 4, "flat": 2, "all_units": None, "tx": 4, "rev": None}
    inferred = onnx.shape_inference.infer_shapes(model).graph
    shapes = {v.name: len(v.type.tensor_type.shape.dim) for v in list(inferred.value_info) + list(inferred.output)
              if v.type.tensor_type.HasField("shape")}
    assert all(shapes[o] == r for o, r in got.items() if r is not None and o in shapes)


def test_settled_dim_is_exact_where_it_answers(monkeypatch):
    """An extent read from how a tensor was made (a Gemm's or MatMul's width from its weight, transposed or
    not, a broadcast's from the operand that has the axis, a Transpose's, a Slice's cut by its literal bounds,
    shape-keeping ops), no inference: torch's chunk
    bounds, ``Shape(x @ W.T + b)[1] // 3``, fold so. None where only the data would say; where it answers,
    shape inference agrees, and ``Gather(Shape(v), i)`` folds to it."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    import rnnfuse.model
    from rnnfuse.dataflow import settled_dim

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view: no inference at all)
    nodes = [helper.make_node("Reshape", ["x", "runtime_shape"], ["r"]),  # [?, ?]: from the data
             helper.make_node("Reshape", ["x", "any_shape"], ["any"]),  # rank not known
             helper.make_node("MatMul", ["any", "w2"], ["mm_any"]),  # [..., 6]
             helper.make_node("Gemm", ["r", "w", "b"], ["gt"], transB=1),  # [?, 12]
             helper.make_node("Gemm", ["r", "w2"], ["g"]),  # [?, 6]
             helper.make_node("MatMul", ["r", "w2"], ["mm"]),  # [?, 6]
             helper.make_node("Add", ["gt", "row"], ["add"]),  # [?, 12]
             helper.make_node("Mul", ["r", "one"], ["mul"]),  # [?, ?]: the scalar broadcasts, r says nothing
             helper.make_node("Sigmoid", ["add"], ["sig"]),
             helper.make_node("Shape", ["sig"], ["s"]), helper.make_node("Gather", ["s", "i1"], ["width"], axis=0),
             helper.make_node("Slice", ["x3", "st", "en", "ax"], ["step"]),  # x3[:, 2:3]: [?, 1, 4]
             helper.make_node("Transpose", ["step"], ["tm"], perm=[1, 0, 2]),  # [1, ?, 4]
             helper.make_node("Slice", ["x3", "st", "big", "axm"], ["tail"])]  # x3[..., 2:]: [?, 6, 2]
    inits = [numpy_helper.from_array(np.ones((12, 5), np.float32), "w"), numpy_helper.from_array(np.ones(12, np.float32), "b"),
             numpy_helper.from_array(np.ones((5, 6), np.float32), "w2"), numpy_helper.from_array(np.ones((1, 12), np.float32), "row"),
             numpy_helper.from_array(np.ones((), np.float32), "one"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
             numpy_helper.from_array(np.array([2], np.int64), "st"), numpy_helper.from_array(np.array([3], np.int64), "en"),
             numpy_helper.from_array(np.array([1], np.int64), "ax"), numpy_helper.from_array(np.array([2**62], np.int64), "big"),
             numpy_helper.from_array(np.array([-1], np.int64), "axm")]
    outs = ["gt", "g", "mm", "mm_any", "add", "mul", "sig", "step", "tm", "tail"]
    graph = helper.make_graph(nodes, "dims", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 5]),
                                              helper.make_tensor_value_info("x3", TensorProto.FLOAT, ["B", 6, 4]),
                                              helper.make_tensor_value_info("runtime_shape", TensorProto.INT64, [2]),
                                              helper.make_tensor_value_info("any_shape", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs + ["width"]], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = Model(model).graph
    got = {(o, ax): settled_dim(g, o, ax) for o in outs for ax in (0, 1, -1)}
    assert {k: v for k, v in got.items() if v is not None} == {
        ("gt", 1): 12, ("gt", -1): 12, ("g", 1): 6, ("g", -1): 6, ("mm", 1): 6, ("mm", -1): 6, ("mm_any", -1): 6, ("add", 1): 12, ("add", -1): 12,
        ("sig", 1): 12, ("sig", -1): 12, ("step", 1): 1, ("step", -1): 4, ("tm", 0): 1, ("tm", -1): 4,
        ("tail", 1): 6, ("tail", -1): 2}
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in list(inferred.value_info) + list(inferred.output) if v.type.tensor_type.HasField("shape")}
    assert all(dims[o][ax] == d for (o, ax), d in got.items() if d is not None and o in dims and dims[o][ax] is not None)
    assert g.const("width").tolist() == 12


def test_settled_dims_of_native_ops_concats_and_unit_axes(monkeypatch):
    """What the ONNX spec fixes of a native recurrent op's outputs (directions and ``hidden_size`` from the
    attributes, else the hidden size from ``R``; the sequence and the batch from ``X``, by ``layout``), a
    Concat's (the inputs' extents summed on its axis, shared on the others) and a Squeeze's or an Unsqueeze's
    with literal axes: a per-step state ``Concat(Y_h of layer 1, Y_h of layer 2)`` sliced per layer is read
    so in a model too big to type it (torch's nn.LSTM called per step: its chain broke where the type budget
    ran out). Exact where it answers: shape inference agrees."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    import rnnfuse.model
    from rnnfuse.dataflow import settled_dim, settled_rank

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view: no inference at all)
    H, F = 4, 3
    w = {f"{k}{d}": numpy_helper.from_array(np.ones(s, np.float32), f"{k}{d}") for d in (1, 2)
         for k, s in (("W", (d, 4 * H, F)), ("R", (d, 4 * H, H)))}
    nodes = [helper.make_node("LSTM", ["x", "W1", "R1"], ["y", "yh", "yc"], hidden_size=H),  # x [5, B, 3]
             helper.make_node("LSTM", ["xb", "W2", "R2"], ["yb", "yhb"], hidden_size=H, layout=1,
                              direction="bidirectional"),  # xb [B, 6, 3]
             helper.make_node("LSTM", ["x", "W1", "R1"], ["yn", "yhn"]),  # (no hidden_size: R's)
             helper.make_node("Concat", ["yh", "yc"], ["cat0"], axis=0),  # [2, B, 4]
             helper.make_node("Concat", ["yh", "runtime"], ["catr"], axis=-1),  # [1, B, ?]
             helper.make_node("Squeeze", ["y", "ax1"], ["sq"]),  # [5, B, 4]
             helper.make_node("Unsqueeze", ["sq", "axes_u"], ["usq"])]  # [5, 1, B, 1, 4]
    inits = list(w.values()) + [numpy_helper.from_array(np.array([1], np.int64), "ax1"),
                                numpy_helper.from_array(np.array([1, -2], np.int64), "axes_u")]
    outs = ["y", "yh", "yc", "yb", "yhb", "yn", "yhn", "cat0", "catr", "sq", "usq"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, "B", F]),
              helper.make_tensor_value_info("xb", TensorProto.FLOAT, ["B", 6, F]),
              helper.make_tensor_value_info("runtime", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "native", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                          for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = Model(model).graph
    ranks = {o: settled_rank(g, o) for o in outs}
    assert ranks == {"y": 4, "yh": 3, "yc": 3, "yb": 4, "yhb": 3, "yn": 4, "yhn": 3, "cat0": 3, "catr": 3, "sq": 3,
                     "usq": 5}
    got = {(o, ax): settled_dim(g, o, ax) for o in outs for ax in range(-ranks[o], ranks[o])}
    assert {k: v for k, v in got.items() if v is not None and k[1] >= 0} == {
        ("y", 0): 5, ("y", 1): 1, ("y", 3): 4, ("yh", 0): 1, ("yh", 2): 4, ("yc", 0): 1, ("yc", 2): 4,
        ("yb", 1): 6, ("yb", 2): 2, ("yb", 3): 4, ("yhb", 1): 2, ("yhb", 2): 4,
        ("yn", 0): 5, ("yn", 1): 1, ("yn", 3): 4, ("yhn", 0): 1, ("yhn", 2): 4,
        ("cat0", 0): 2, ("cat0", 2): 4, ("catr", 0): 1,
        ("sq", 0): 5, ("sq", 2): 4, ("usq", 0): 5, ("usq", 1): 1, ("usq", 3): 1, ("usq", 4): 4}
    assert got[("usq", -2)] == 1 and got[("yb", -1)] == 4 and got[("catr", -1)] is None
    inferred = onnx.shape_inference.infer_shapes(model).graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in list(inferred.value_info) + list(inferred.output) if v.type.tensor_type.HasField("shape")}
    assert all(len(dims[o]) == r for o, r in ranks.items() if o in dims)
    assert all(dims[o][ax] == d for (o, ax), d in got.items() if d is not None and o in dims and dims[o][ax] is not None)


def test_a_sequence_too_deep_to_infer_as_a_filter_keeps_its_layout(monkeypatch):
    """A stacked layer's input (the layer below's outputs, transposed) has a cone too big for a filter's type
    query in a big model; its rank is what its op fixes (``settled_rank``): the family is searched, not
    declined as a "rank-None" tensor (a tf_keras LSTM -> SimpleRNN of 99k nodes fused the second layer only in
    a second round, after an unrelated fold had typed the first layer)."""
    import onnx
    from onnx import helper

    import rnnfuse.cone_types
    import rnnfuse.model
    from rnnfuse.passes.unrolled.family_filter import layout_decline

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    monkeypatch.setattr(rnnfuse.cone_types, "CHEAP_INFERENCE_NODES", 8)  # (a filter infers 8 nodes at most)
    nodes = [helper.make_node("Tanh", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(40)]
    nodes.append(helper.make_node("Transpose", ["t39"], ["seq"], perm=[1, 0, 2]))
    graph = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 7, 3])],
                              [helper.make_tensor_value_info("seq", onnx.TensorProto.FLOAT, None)])
    inferred = []
    monkeypatch.setattr(rnnfuse.cone_types.ConeTypes, "_infer", lambda self, cone: inferred.append(len(cone)))
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    assert g.model.rank("seq") == 3 and not inferred  # (no cone inferred: the Transpose's perm says it)
    assert layout_decline(g, "seq", 0) is None
    assert "rank-3" in layout_decline(g, "seq", 2)


def test_settled_rank_and_dim_walk_a_branching_chain_once_a_level(monkeypatch):
    """A GRU step's ``(1 - z) * n + z * h`` reads the step before twice: asked of a late step, the op-by-op
    answer reaches each value once for the run and question (the plain recursion: once per path, doubling with
    each step reached), at any depth."""
    from onnx import helper

    import rnnfuse.model
    from rnnfuse.dataflow import settled_dim, settled_rank
    from rnnfuse.model import Model as M

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    nodes = []
    for k in range(30):
        h = "h" if k == 0 else f"s{k - 1}"
        nodes += [helper.make_node("Tanh", [h], [f"a{k}"]), helper.make_node("Sigmoid", [h], [f"b{k}"]),
                  helper.make_node("Add", [f"a{k}", f"b{k}"], [f"s{k}"])]
    graph = helper.make_graph(nodes, "branching", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", 4])],
                              [helper.make_tensor_value_info("s29", TensorProto.FLOAT, None)])
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    asked = []
    real = M.settled_type
    monkeypatch.setattr(M, "settled_type", lambda self, name: asked.append(name) or real(self, name))
    assert settled_rank(g, "s5") == 2 and settled_dim(g, "s5", 1) == 4
    assert settled_rank(g, "s29") == 2 and settled_dim(g, "s29", 1) == 4  # (90 ops on: no depth limit)
    # (each value once a question: its rank, its dims)
    assert len(set(asked)) == 91 and max(asked.count(v) for v in set(asked)) == 2, len(asked)


def test_an_intervals_walk_reads_only_what_its_family_computes(monkeypatch):
    """Cells side by side, each unrolled over an input of its own: each family's intervals walk reads the
    nodes computed from its slices, not every node of the graph (800 cells: 90,000 nodes walked 800 times,
    76 s). The chains are those a walk of the whole graph finds: one RNN per cell."""
    import tempfile

    import onnx

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    try:
        from growth_graphs import cells_on_inputs_of_their_own
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory() as d:
        cells_on_inputs_of_their_own(os.path.join(d, "m.onnx"), 12 * 7 * 16)
        model = onnx.load(os.path.join(d, "m.onnx"))
    walked = []
    real = rule.intervals
    monkeypatch.setattr(rule, "intervals", lambda g, order, leaves: walked.append(len(order)) or real(g, order, leaves))
    out, report = rnnfuse.optimize(model)
    assert sum(n.op_type == "RNN" for n in out.graph.node) == 12, report.to_text()
    assert len(walked) >= 12 and max(walked) < 7 * 16 + 16, walked  # (one cell's nodes, not the 12 cells')
