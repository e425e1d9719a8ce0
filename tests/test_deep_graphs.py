"""Graphs deeper than Python's stack and bigger than whole-model shape inference is run for.

A recurrence is often not the whole model: an encoder of thousands of nodes computes its input, a head of
thousands reads its output. Two things broke there: constant folding walked back through the producers by
recursion (a Loop or Scan whose input is 3,000 nodes deep crashed the optimizer), and a model of
``CHEAP_INFERENCE_NODES`` nodes or more knew no type the file does not declare (a long masked unrolled chain
declined: its per-step mask slices had no type). These tests build such graphs and check the outcome: fused,
and the same outputs as the original on post-, pre-padded and gappy masks.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders as B
import rnnfuse
import rnnfuse.cone_types
from helpers import session
from rnnfuse.cone_types import ConeTypes
from rnnfuse.graph import Model

DEPTH = 3000  # nodes between an input and the recurrence: well past Python's default recursion limit


def _neg_chain(nodes: list, src: str, dst: str, depth: int, tag: str) -> None:
    """``depth`` Neg nodes from ``src`` to ``dst`` (an even depth: the value itself)."""
    cur = src
    for k in range(depth):
        nxt = dst if k == depth - 1 else f"{tag}_{k}"
        nodes.append(helper.make_node("Neg", [cur], [nxt], name=f"{tag}_neg{k}"))
        cur = nxt


def _behind_deep_chains(model: onnx.ModelProto, depth: int) -> onnx.ModelProto:
    """The model with every float input computed from a new input by ``depth`` nodes, and every float output
    read through ``depth`` more (no value_info for any of them, as many exporters write)."""
    g = model.graph
    before: list = []
    for inp in g.input:
        if inp.type.tensor_type.elem_type == TensorProto.FLOAT:
            name = inp.name
            inp.name = f"{name}_raw"
            _neg_chain(before, inp.name, name, depth, f"{name}_in")
    after: list = []
    for out in g.output:
        if out.type.tensor_type.elem_type == TensorProto.FLOAT:
            name = out.name
            out.name = f"{name}_read"
            _neg_chain(after, name, out.name, depth, f"{name}_out")
    nodes = before + list(g.node) + after
    del g.node[:]
    g.node.extend(nodes)
    return model


def _assert_fused_same(o: B.Opts, model: onnx.ModelProto, feeds_fn, rename: dict | None = None) -> onnx.ModelProto:
    fused, report = rnnfuse.optimize(model)
    assert any(n.op_type == o.op for n in fused.graph.node), report.to_text()
    assert not any(n.op_type in ("Loop", "Scan") for n in fused.graph.node), report.to_text()
    assert all(f.validation.startswith("ok") for f in report.findings if f.status == "fused"), report.to_text()
    s_orig, s_fused = session(model), session(fused)
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        for kind in (("post", "pre", "gappy") if o.masked() else ("none",)):
            feeds = feeds_fn(rng, batch, o.static_T or 7, kind)
            feeds = {(rename or {}).get(k, k): v for k, v in feeds.items()}
            for want, got in zip(s_orig.run(None, feeds), s_fused.run(None, feeds)):
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"batch {batch}, mask {kind}")
    return fused


@pytest.mark.parametrize("front", ["scan", "loop"])
@pytest.mark.parametrize("op,mask", [("GRU", "none"), ("LSTM", "where")])
def test_recurrence_between_deep_chains_is_fused(front, op, mask):
    o = B.default_reverse_form(B.Opts(op=op, front=front, mask=mask))
    model, feeds_fn = B.build(o)
    floats = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT}
    model = _behind_deep_chains(model, DEPTH)
    _assert_fused_same(o, model, feeds_fn, {n: f"{n}_raw" for n in floats})


def _deep_constant_graph(depth: int) -> onnx.ModelProto:
    """``v = c + depth`` by ``depth`` Adds of one, all foldable; ``w`` the same chain from the input x."""
    nodes: list = []
    for src, dst in (("c", "v"), ("x", "w")):
        cur = src
        for k in range(depth):
            nxt = dst if k == depth - 1 else f"{dst}{k}"
            nodes.append(helper.make_node("Add", [cur, "one"], [nxt]))
            cur = nxt
    inits = [numpy_helper.from_array(np.array([2.0, -1.0], np.float32), "c"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    g = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("v", "w")], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_constant_folding_reaches_through_a_chain_deeper_than_the_stack():
    depth = 5000
    g = Model(_deep_constant_graph(depth)).graph
    np.testing.assert_array_equal(g.const("v"), np.array([2.0 + depth, -1.0 + depth], np.float32))
    assert g.const("w") is None  # (computed from the input x)
    assert g.const("v2500") is not None and g.const("w2500") is None  # (what the walks met, remembered)


def _masked_chain(op: str, T: int = 6) -> tuple[B.Opts, onnx.ModelProto, object]:
    o = B.default_reverse_form(B.Opts(op=op, front="chain", mask="where", static_T=T))
    model, feeds_fn = B.build(o)
    assert not model.graph.value_info  # (the step slices' types are not declared: inference gives them)
    return o, model, feeds_fn


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_masked_chain_too_big_for_whole_inference_is_fused(op, monkeypatch):
    # the same chain as a model of 20,000+ nodes, without the cost of one: the threshold lowered to below it
    monkeypatch.setattr("rnnfuse.model.CHEAP_INFERENCE_NODES", 50)
    o, model, feeds_fn = _masked_chain(op)
    assert len(model.graph.node) > 50
    _assert_fused_same(o, model, feeds_fn)


def test_cone_types_infer_what_a_query_needs_once_within_the_budget():
    o, model, _ = _masked_chain("GRU", T=3)
    m = Model(model)
    cones = ConeTypes(m)
    mask_slice = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == "mask").output[0]
    assert cones.type_of(mask_slice) == (TensorProto.BOOL, ["B", 1])
    spent = cones.budget
    assert cones.type_of(mask_slice) == (TensorProto.BOOL, ["B", 1]) and cones.budget == spent  # (remembered)
    where = next(n for n in model.graph.node if n.op_type == "Where")
    assert cones.type_of(where.output[0])[0] == TensorProto.FLOAT
    assert cones.budget < spent  # (its cone was walked: the state before it had no declared type)
    # no budget: no type (and no walk), as a model without inference always had
    assert ConeTypes(m, budget=0).type_of(where.output[0]) is None
    poor = ConeTypes(m, budget=2)
    assert poor.type_of(where.output[0]) is None and poor.budget <= 0


def test_cone_types_read_shape_values_through_constants():
    """A zero state sized from the input, as torch's tracer writes ``torch.zeros(B, H)``: the shape values are
    Constants and shape-like tensors that the file may type; the cone reaches their values all the same."""
    def const(name, arr):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr)))

    nodes = [helper.make_node("Shape", ["x"], ["shape"]), const("one", np.array(1, np.int64)),
             helper.make_node("Gather", ["shape", "one"], ["b"]), const("ax", np.array([0], np.int64)),
             helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]), const("h", np.array([8], np.int64)),
             helper.make_node("Concat", ["b1", "h"], ["hshape"], axis=0),
             helper.make_node("ConstantOfShape", ["hshape"], ["h0"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
             helper.make_node("Tanh", ["h0"], ["y"])]
    g = helper.make_graph(nodes, "zeros", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, "B", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          value_info=[helper.make_tensor_value_info("hshape", TensorProto.INT64, [2])])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    cones = ConeTypes(m)
    assert cones.budget == 20000  # (at least a small model's whole inference; twice the nodes of a big one)
    assert cones.type_of("y") == (TensorProto.FLOAT, ["B", 8])


def test_deep_folding_in_several_threads_at_once():
    """The fold depth is counted per thread: concurrent optimizations do not see each other's walks."""
    import threading

    results, errors = [], []

    def fold():
        try:
            results.append(float(Model(_deep_constant_graph(400)).graph.const("v")[0]))
        except BaseException as e:  # (TooDeep leaking out would land here)
            errors.append(repr(e))

    threads = [threading.Thread(target=fold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [402.0] * 4


def test_cone_types_keep_the_dims_each_inference_invents_apart():
    """Two NonZero results have unknown counts: each inference calls its own 'unk__0', which must not make
    the two counts one dim."""
    nodes = [helper.make_node("NonZero", ["x"], ["nz1"]), helper.make_node("Transpose", ["nz1"], ["a"]),
             helper.make_node("NonZero", ["y"], ["nz2"]), helper.make_node("Transpose", ["nz2"], ["b"])]
    g = helper.make_graph(nodes, "nz", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("x", "y")],
                          [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("a", "b")])
    cones = ConeTypes(Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])))
    (ta, tb) = cones.type_of("a"), cones.type_of("b")
    assert ta[1][1] == 1 and tb[1][1] == 1 and ta[1][0] != tb[1][0], (ta, tb)


def test_a_cone_bigger_than_one_inference_is_inferred_in_pieces(monkeypatch):
    """The end of a long chain: its cone is the whole chain. It is inferred in pieces of at most ``max_cone``
    nodes, producers first, each piece reading the types those before it gave (one copy of the whole cone held
    ~150 MB at 100k nodes; given up on instead, a recurrence behind a 20,000-node prologue had an input of no
    type and was declined). The walk still stops at the model's budget."""
    pieces: list[int] = []
    infer = ConeTypes._infer

    def counted(self, cone):
        pieces.append(len(cone))
        return infer(self, cone)

    monkeypatch.setattr(ConeTypes, "_infer", counted)
    # (inference's pieces: the elementwise rule, which types this chain of Adds without any, is off here)
    monkeypatch.setattr(rnnfuse.cone_types, "typed_by_rule", lambda cone, *args: ({}, list(cone)))
    cones = ConeTypes(Model(_deep_constant_graph(300)))
    cones.max_cone = 100
    # a query that only filters (the default of Model.known_type) infers no more than one piece: a family
    # source of a 100k-node trace asked through its whole chain cost 1.1 s and 57 MB for a filter
    assert cones.type_of("w", one_piece=True) is None and pieces == []
    assert cones.type_of("w", one_piece=True) is None and pieces == []  # (and does not walk it again)
    assert cones.type_of("w") == (TensorProto.FLOAT, [2])
    assert pieces == [100, 100, 100], pieces
    assert cones.type_of("w150") == (TensorProto.FLOAT, [2]) and len(pieces) == 3  # (typed on the way)
    assert ConeTypes(Model(_deep_constant_graph(300)), budget=150).type_of("w") is None


def test_a_constant_an_earlier_piece_inferred_is_read_by_value():
    """Shape arithmetic too long for one inference: each link slices a shape from a Constant start. A start
    made by a node of an earlier piece was declared to the next piece by its type alone, and onnx's data
    propagation then takes a Slice of unknown starts for the whole shape: the Reshape at the end was typed
    rank 22, not 3 (in 30-node pieces). The Constant is copied into the piece that reads it."""
    def const(name, arr):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr)))

    nodes, cur = [const("k0", np.array([4, 3, 2], np.int64))], "k0"
    for i in range(20):
        p = f"k{i}_"
        nodes += [const(p + "zeros", np.zeros(1, np.float32)), const(p + "one", np.array([1], np.int64)),
                  helper.make_node("Expand", [p + "zeros", cur], [p + "e"]),
                  helper.make_node("Reshape", [p + "e", cur], [p + "r"]),
                  helper.make_node("Shape", [p + "r"], [p + "sh"]),
                  helper.make_node("Gather", [p + "sh", "z1"], [p + "d0"], axis=0),
                  helper.make_node("Slice", [p + "sh", p + "one", "big"], [p + "rest"]),
                  helper.make_node("Concat", [p + "d0", p + "rest"], [p + "nxt"], axis=0)]
        cur = p + "nxt"
    nodes.append(helper.make_node("Reshape", ["xraw", cur], ["x"]))
    g = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("xraw", TensorProto.FLOAT, [24])],
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([0], np.int64), "z1"),
                           numpy_helper.from_array(np.array([100], np.int64), "big")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    whole = ConeTypes(Model(model)).type_of("x")
    assert whole is not None and len(whole[1]) == 3, whole
    cones = ConeTypes(Model(model))
    cones.max_cone = 30
    t = cones.type_of("x")
    assert cones.cones > 1 and t is not None and len(t[1]) == 3, t


def test_a_loop_behind_a_prologue_too_big_to_infer_at_once_is_fused(monkeypatch):
    """The shipped Keras model (two masked Loops and a bidirectional pair) whose input is computed by a chain
    of ``x * 1 + 0`` nodes longer than one inference may take (forced small here; 20,000 nodes otherwise): the
    Loops' inputs have types only through their cone, inferred in pieces. Given up on, the Loops were declined
    ('two different per-step inputs are read'); the analysis asks its inputs' types whole before deciding
    (Model.settle_types), not relying on an earlier fold to have inferred them."""
    import os

    import rnnfuse.cone_types
    import rnnfuse.model

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 300)
    monkeypatch.setattr(rnnfuse.cone_types, "CHEAP_INFERENCE_NODES", 300)
    m = onnx.load(os.path.join(os.path.dirname(__file__), "..", "examples", "keras_masked_bigru_lstm.onnx"))
    g = m.graph
    x = g.input[0].name
    g.input[0].name = "raw_x"
    g.initializer.extend([numpy_helper.from_array(np.array(1.0, np.float32), "p_one"),
                          numpy_helper.from_array(np.array(0.0, np.float32), "p_zero")])
    prologue, cur = [], "raw_x"
    for i in range(400):
        out = x if i == 399 else f"p{i}_a"
        prologue += [helper.make_node("Mul", [cur, "p_one"], [f"p{i}_m"]), helper.make_node("Add", [f"p{i}_m", "p_zero"], [out])]
        cur = out
    body = list(g.node)
    del g.node[:]
    g.node.extend(prologue + body)
    src = onnx.ModelProto()
    src.CopyFrom(m)
    out, report = rnnfuse.optimize(m)
    assert sorted(f.status for f in report.findings) == ["fused", "fused", "fused", "merged"], report.to_text()
    feats = m.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    xv = np.random.default_rng(0).standard_normal((3, 7, feats)).astype(np.float32)
    xv[1, 5:] = 0.0  # (post-padded)
    xv[2, :2] = 0.0  # (pre-padded)
    want = session(src).run(None, {"raw_x": xv})
    got = session(out).run(None, {"raw_x": xv})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_next_round_keeps_the_types_of_what_the_round_left_alone(monkeypatch):
    """x -> 60 Relus (r0..r59) -> Tanh (t) -> NonZero (nz) -> Transpose (y), in a model too big for whole
    inference (forced small). The round replaces the Tanh: the next round's view keeps the inferred types of
    the Relus' values, which it would otherwise infer again (a 100,000-node prologue, each round), and not
    those of the values computed from the replacement. Its count of cones carries over, so a dim a later cone
    invents is not named like one an earlier cone invented (the two NonZero counts stay two dims)."""
    monkeypatch.setattr("rnnfuse.model.CHEAP_INFERENCE_NODES", 10)
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"r{i - 1}"], [f"r{i}"]) for i in range(60)]
    nodes += [helper.make_node("Tanh", ["r59"], ["t"]), helper.make_node("NonZero", ["t"], ["nz"]),
              helper.make_node("Transpose", ["nz"], ["y"])]
    g = helper.make_graph(nodes, "relus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    before = m.known_type("y", whole_cone=True)
    assert m.known_type("r30") == (TensorProto.FLOAT, [4]) and before[1][1] == 1
    graph = m.graph
    (sig,) = graph.add_node("Sigmoid", ["r59"])
    graph.replace_uses("t", sig)
    graph.prune()
    graph.finalize()
    assert "t" in graph.redefined and "r59" not in graph.redefined  # (the Tanh went: t is defined anew)
    cones = m._cones.cones
    nxt = m.next_round()
    carried = nxt._cones.types
    assert all(f"r{i}" in carried for i in range(60)) and "nz" not in carried and "y" not in carried
    assert nxt._cones.cones == cones >= 1 and m._cones is None  # (the finished view lets its types go)
    after = nxt.known_type("y", whole_cone=True)
    assert after[1][1] == 1 and after[1][0] != before[1][0], (before, after)


def test_the_next_round_keeps_no_types_when_finding_them_would_walk_a_big_downstream(monkeypatch):
    """x -> 50 Relus (a0..a49, typed) and x -> Tanh (t) -> 1,500 Relus (a head). The round replaces the Tanh:
    telling which types still hold walks what is computed from it, the whole head, to keep 50 types; the walk
    stops past max(types, 1,000) values and the next round keeps none (it infers again what it asks)."""
    monkeypatch.setattr("rnnfuse.model.CHEAP_INFERENCE_NODES", 10)
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"a{i - 1}"], [f"a{i}"]) for i in range(50)]
    nodes.append(helper.make_node("Tanh", ["x"], ["t"]))
    nodes += [helper.make_node("Relu", ["t" if i == 0 else f"h{i - 1}"], [f"h{i}"]) for i in range(1500)]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a49", "h1499")])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert m.known_type("a49") == (TensorProto.FLOAT, [4])
    graph = m.graph
    (sig,) = graph.add_node("Sigmoid", ["x"])
    graph.replace_uses("t", sig)
    graph.prune()
    graph.finalize()
    nxt = m.next_round()
    assert nxt._cones.types == {} and nxt.known_type("a49") == (TensorProto.FLOAT, [4])
