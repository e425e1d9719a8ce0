"""The do-no-harm guard loads a big model in pieces (rnnfuse.load_in_pieces).

onnxruntime's session set-up grows faster than the nodes; a fused Loop whose body held a 100,000-op head
hands the guard a model it cannot judge by its changed region, and the whole-model load was a third of the
run. These tests cut small models (``PIECE_NODES`` lowered) and check what each piece holds, that a model
whose pieces load passes without a whole load, and that anything the pieces cannot settle is loaded whole.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.guard as guard
import rnnfuse.load_in_pieces as pieces_mod
from rnnfuse.changed_region import NodeScan
from rnnfuse.load_in_pieces import Pieces
from rnnfuse.model_parts import Frame
from rnnfuse.piecewise_runs import weight
from rnnfuse.protos import call_sizes, nodes_within
from rnnfuse.pipeline import Pipeline

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
OPSET = [helper.make_opsetid("", 17)]


def _model(nodes, inputs=("x",), outputs=(("y", TensorProto.FLOAT),), initializers=(), value_info=(),
           input_types=None) -> onnx.ModelProto:
    input_types = input_types or {}
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(i, input_types.get(i, TensorProto.FLOAT), [2, 3]) for i in inputs],
        [helper.make_tensor_value_info(o, t, [2, 3]) for o, t in outputs], list(initializers), value_info=list(value_info))
    return helper.make_model(g, opset_imports=OPSET, ir_version=8)


def _relu_chain(n: int, src: str = "x", prefix: str = "r") -> list:
    nodes, prev = [], src
    for i in range(n):
        nodes.append(helper.make_node("Relu", [prev], [f"{prefix}{i}"]))
        prev = f"{prefix}{i}"
    return nodes


def _loads(monkeypatch) -> list[int]:
    """The node counts of the models handed to onnxruntime (the guard's and the pieces' loads)."""
    seen: list[int] = []
    real = guard.onnxruntime_error

    def counted(data):
        m = onnx.load_from_string(data if isinstance(data, bytes) else data.SerializeToString())
        seen.append(len(m.graph.node))
        return real(data)

    monkeypatch.setattr(guard, "onnxruntime_error", counted)
    return seen


def _types(model: onnx.ModelProto, p: Pieces) -> dict | None:
    err, types = guard._checker_error_typing(model.SerializeToString(), p)
    assert err is None, err
    return types


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces_mod, "PIECE_NODES", 100)
    monkeypatch.setattr(pieces_mod, "MIN_CUT_NODES", 200)


def test_a_chain_is_cut_into_pieces_that_each_load(small_pieces, monkeypatch):
    nodes = _relu_chain(1000)
    nodes.append(helper.make_node("Identity", ["r999"], ["y"]))
    m = _model(nodes)
    p = Pieces.cut(m)
    assert p is not None and len(p.spans) == 11
    assert all(stop - start <= 100 for start, stop in p.spans)
    assert p.crossing == {f"r{i}" for i in range(99, 1000, 100)}
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, _types(m, p)) is None
    assert len(loads) == 11 and max(loads) <= 100  # (never the whole model)


def test_a_piece_reads_far_back_keeps_unread_values_and_outputs_read_inside(small_pieces):
    # x -> 450 Relus; a Mul at the end reads r5 (four pieces back); r200 is a graph output also read in its
    # own piece; a Neg of r300 is read by nothing
    nodes = _relu_chain(450)
    nodes += [helper.make_node("Neg", ["r300"], ["dead"]), helper.make_node("Mul", ["r449", "r5"], ["y"]),
              helper.make_node("Add", ["y", "w"], ["z"])]
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    m = _model(nodes, outputs=(("y", TensorProto.FLOAT), ("z", TensorProto.FLOAT), ("r200", TensorProto.FLOAT)),
               initializers=[w])
    p = Pieces.cut(m)
    last = len(p.spans) - 1
    assert "r5" in p.reads[last] and "w" in p.reads[last]
    k200 = next(k for k, (a, b) in enumerate(p.spans) if a <= 200 < b)
    k300 = next(k for k, (a, b) in enumerate(p.spans) if a <= 300 < b)
    assert "r200" in p.outputs[k200]
    assert "dead" in p.outputs[last] or "dead" in p.outputs[k300]
    types = _types(m, p)
    assert types is not None and p.load(types)
    piece = pieces_mod._piece_model(m, Frame(m.graph), NodeScan(m).nodes[slice(*p.spans[last])],
                                    p.reads[last], p.outputs[last], types)
    assert [t.name for t in piece.graph.initializer] == ["w"]
    assert {v.name for v in piece.graph.input} >= {"r5", f"r{p.spans[last][0] - 1}"}


def test_an_input_with_a_default_stays_an_input_in_its_piece(small_pieces):
    nodes = _relu_chain(300)
    nodes.append(helper.make_node("Add", ["r299", "bias"], ["y"]))
    bias = numpy_helper.from_array(np.zeros((2, 3), np.float32), "bias")
    m = _model(nodes, inputs=("x", "bias"), initializers=[bias])
    p = Pieces.cut(m)
    last = len(p.spans) - 1
    piece = pieces_mod._piece_model(m, Frame(m.graph), NodeScan(m).nodes[slice(*p.spans[last])],
                                    p.reads[last], p.outputs[last], _types(m, p))
    assert "bias" in {v.name for v in piece.graph.input} and "bias" in {t.name for t in piece.graph.initializer}


def test_a_subgraph_capture_crosses_pieces(small_pieces):
    # an If at the end of the chain whose branches read r10, two pieces back, by capture
    nodes = _relu_chain(250)
    then = helper.make_graph([helper.make_node("Add", ["r10", "r249"], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2, 3])])
    other = helper.make_graph([helper.make_node("Sub", ["r10", "r249"], ["e_out"])], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2, 3])])
    nodes.append(helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other))
    m = _model(nodes, inputs=("x", "cond"), input_types={"cond": TensorProto.BOOL})
    m.graph.input[1].type.tensor_type.shape.Clear()
    p = Pieces.cut(m)
    assert "r10" in p.crossing and "r10" in p.reads[-1]
    types = _types(m, p)
    assert types is not None and p.load(types)


def test_a_piece_that_does_not_load_sends_the_guard_to_the_whole_model(small_pieces, monkeypatch):
    # a declared type deep in the chain that onnxruntime's inference contradicts: the piece holding it fails,
    # and what is reported is the whole model's load
    nodes = _relu_chain(500)
    nodes.append(helper.make_node("Identity", ["r499"], ["y"]))
    m = _model(nodes, value_info=[helper.make_tensor_value_info("r250", TensorProto.FLOAT, [2, 3])])
    p = Pieces.cut(m)
    types = _types(m, p)
    m.graph.value_info[0].type.tensor_type.elem_type = TensorProto.INT64  # (after inference: the checker would refuse it)
    p = Pieces.cut(m)
    assert not p.load(types)
    loads = _loads(monkeypatch)
    err = guard._load_error(m.SerializeToString(), p, types)
    assert err is not None and loads[-1] == len(m.graph.node)


def test_a_crossing_value_inference_cannot_type_is_loaded_whole(small_pieces, monkeypatch):
    nodes = _relu_chain(150)
    nodes.append(helper.make_node("Mystery", ["r149"], ["u"], domain="custom.unknown"))
    nodes += _relu_chain(150, "u", "s")
    nodes.append(helper.make_node("Identity", ["s149"], ["y"]))
    m = _model(nodes)
    m.opset_import.append(helper.make_opsetid("custom.unknown", 1))
    p = Pieces.cut(m)
    inferred = onnx.shape_inference.infer_shapes(m)
    # (no type after the unknown op: the pieces after it cannot be declared)
    assert any(name.startswith("s") for name in p.crossing) and p.types_of(inferred) is None
    err, types = guard._checker_error_typing(m.SerializeToString(), p)
    assert err is None and types is None  # (the checker takes an op of a domain it does not know)
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, types) is not None  # (onnxruntime has no Mystery)
    assert loads == [len(m.graph.node)]


def test_a_model_with_faulty_wiring_or_too_small_is_not_cut(small_pieces):
    assert Pieces.cut(_model(_relu_chain(150) + [helper.make_node("Identity", ["r149"], ["y"])])) is None
    nodes = _relu_chain(500) + [helper.make_node("Identity", ["r499"], ["y"])]
    nodes[300].input[0] = "r400"  # (read before it is defined)
    assert Pieces.cut(_model(nodes)) is None


def test_a_model_big_by_its_subgraphs_is_cut(small_pieces, monkeypatch):
    # 150 main-graph nodes (fewer than MIN_CUT_NODES) of which 10 Ifs hold 20 nodes a branch: cut all the same,
    # by the nodes onnxruntime sets up, each piece at most PIECE_NODES of them
    nodes = _relu_chain(100)
    for k in range(10):
        cur = f"r{99 + 4 * k}" if k == 0 else f"if{k - 1}"
        branches = [helper.make_graph(_relu_chain(20, cur, f"b{k}{side}_"), f"b{k}{side}", [],
                                      [helper.make_tensor_value_info(f"b{k}{side}_19", TensorProto.FLOAT, [2, 3])])
                    for side in ("t", "e")]
        nodes.append(helper.make_node("If", ["cond"], [f"if{k}"], then_branch=branches[0], else_branch=branches[1]))
    nodes += _relu_chain(39, "if9", "z") + [helper.make_node("Identity", ["z38"], ["y"])]
    m = _model(nodes, inputs=("x", "cond"), input_types={"cond": TensorProto.BOOL})
    m.graph.input[1].type.tensor_type.shape.Clear()
    assert len(m.graph.node) < pieces_mod.MIN_CUT_NODES
    p = Pieces.cut(m)
    assert p is not None and len(p.spans) > 1
    assert all(sum(weight(n) for n in m.graph.node[a:b]) <= pieces_mod.PIECE_NODES for a, b in p.spans)
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, _types(m, p)) is None
    assert len(loads) == len(p.spans)  # (never the whole model)


def _relu_function(name: str, n: int, calls: str | None = None) -> onnx.FunctionProto:
    """A model-local function of ``n`` Relus in a row (and a call of ``calls`` after them)."""
    nodes = _relu_chain(n, "a", "f")
    out = f"f{n - 1}"
    if calls:
        nodes.append(helper.make_node(calls, [out], ["g"], domain="local"))
        out = "g"
    return helper.make_function("local", name, ["a"], [out], nodes, OPSET + [helper.make_opsetid("local", 1)])


def test_a_call_counts_the_nodes_its_function_expands_to():
    m = _model([helper.make_node("Outer", ["x"], ["y"], domain="local")])
    m.functions.extend([_relu_function("Inner", 3), _relu_function("Outer", 2, calls="Inner")])
    assert call_sizes(m) == {("local", "Inner", ""): 3, ("local", "Outer", ""): 6}  # (2 Relus, a call, 3 Relus)
    assert nodes_within(m.graph) == 1 and nodes_within(m.graph, calls=call_sizes(m)) == 7


def test_call_sizes_count_calls_in_subgraphs_and_deep_nesting():
    # a call inside a function's If counts what it expands to; a chain of 400 nested functions is sized
    # without recursion (Python's limit was hit at ~330)
    ops = OPSET + [helper.make_opsetid("local", 1)]
    branches = [helper.make_graph([helper.make_node("Inner", ["a"], [f"{side}_out"], domain="local")], side, [],
                                  [helper.make_tensor_value_info(f"{side}_out", TensorProto.FLOAT, [2, 3])])
                for side in ("then", "else")]
    outer = helper.make_function("local", "Outer", ["a", "c"], ["o"],
                                 [helper.make_node("If", ["c"], ["o"], then_branch=branches[0], else_branch=branches[1])], ops)
    m = _model([])
    m.functions.extend([outer, _relu_function("Inner", 10)])
    assert call_sizes(m)[("local", "Outer", "")] == 1 + 2 * (1 + 10)
    deep = _model([])
    deep.functions.extend(helper.make_function("local", f"F{k}", ["a"], ["f0"], [helper.make_node(
        f"F{k + 1}", ["a"], ["f0"], domain="local") if k < 399 else helper.make_node("Relu", ["a"], ["f0"])], ops)
        for k in range(400))
    sizes = call_sizes(deep)
    assert sizes[("local", "F0", "")] == 400 and sizes[("local", "F399", "")] == 1


def test_a_model_big_by_its_function_calls_is_cut(small_pieces, monkeypatch):
    # 40 calls of a 10-node local function: 40 main-graph nodes (fewer than MIN_CUT_NODES), 440 as onnxruntime
    # sets them up (it inlines each call): cut, each piece at most PIECE_NODES of those
    nodes, cur = [], "x"
    for k in range(40):
        nodes.append(helper.make_node("Ten", [cur], [f"c{k}"], domain="local"))
        cur = f"c{k}"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    m = _model(nodes)
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.functions.append(_relu_function("Ten", 10))
    calls = call_sizes(m)
    assert len(m.graph.node) < pieces_mod.MIN_CUT_NODES
    p = Pieces.cut(m)
    assert p is not None and len(p.spans) > 1
    assert all(sum(weight(n, calls) for n in m.graph.node[a:b]) <= pieces_mod.PIECE_NODES for a, b in p.spans)
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, _types(m, p)) is None
    assert len(loads) == len(p.spans)  # (never the whole model)


def test_a_piece_holds_only_the_functions_its_nodes_need(small_pieces, monkeypatch):
    """Each piece copies the local functions its nodes call, in subgraphs too, and those these call in turn,
    in the model's order; not every function of the model (100 pieces of a model of 5,000 functions each
    copying all made the load quadratic). The pieces still load."""
    from rnnfuse.model_parts import LocalFunctions

    ops = OPSET + [helper.make_opsetid("local", 1)]
    nodes, cur = [], "x"
    for k in range(40):
        nodes.append(helper.make_node(f"Ten{k}", [cur], [f"c{k}"], domain="local"))
        cur = f"c{k}"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    m = _model(nodes)
    m.opset_import.append(helper.make_opsetid("local", 1))
    branches = [helper.make_graph([helper.make_node("Inner", ["a"], [f"{side}_out"], domain="local")], side, [],
                                  [helper.make_tensor_value_info(f"{side}_out", TensorProto.FLOAT, [2, 3])])
                for side in ("then", "else")]
    m.functions.append(helper.make_function("local", "Ten0", ["a"], ["o"], [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True), "c")),
        helper.make_node("If", ["c"], ["o"], then_branch=branches[0], else_branch=branches[1])], ops))
    m.functions.extend([_relu_function(f"Ten{k}", 10) for k in range(1, 40)] + [_relu_function("Inner", 3),
                                                                                  _relu_function("Unused", 3)])
    needed = LocalFunctions(m.functions).needed_by(m.graph.node[:2])
    assert [f.name for f in needed] == ["Ten0", "Ten1", "Inner"]
    p = Pieces.cut(m)
    assert p is not None and len(p.spans) > 2
    built = []
    real = pieces_mod._piece_model
    monkeypatch.setattr(pieces_mod, "_piece_model", lambda *a: built.append(real(*a)) or built[-1])
    assert guard._load_error(m.SerializeToString(), p, _types(m, p)) is None
    assert len(built) == len(p.spans)
    for piece in built:
        called = {n.op_type for n in piece.graph.node if n.domain == "local"}
        assert {f.name for f in piece.functions} == called | ({"Inner"} if "Ten0" in called else set())


def test_a_fused_loop_with_a_big_head_is_guarded_in_pieces(monkeypatch, tmp_path):
    """The benchmark's ``loophead`` graph: the fused model replays the head outside the loop; the guard takes
    it in pieces and hands back the same model as a whole load would."""
    sys.path.insert(0, BENCHMARKS)
    try:
        from graphs import loop_with_head
    finally:
        sys.path.remove(BENCHMARKS)
    path = str(tmp_path / "loophead.onnx")
    loop_with_head(path, 3000)
    src = onnx.load(path)
    whole, report = Pipeline.default()(src)
    assert report.fused
    monkeypatch.setattr(pieces_mod, "PIECE_NODES", 500)
    monkeypatch.setattr(pieces_mod, "MIN_CUT_NODES", 1000)
    loads = _loads(monkeypatch)
    out, report = Pipeline.default()(src)
    assert report.fused and out.SerializeToString() == whole.SerializeToString()
    assert len(out.graph.node) > 2000
    guard_loads = [n for n in loads if n <= 500]
    assert len(guard_loads) >= len(out.graph.node) // 500 and len(out.graph.node) not in loads
    x = np.random.default_rng(0).standard_normal([d.dim_value or 2 for d in src.graph.input[0].type.tensor_type.shape.dim])
    feeds = {src.graph.input[0].name: x.astype(np.float32)}
    a = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


# -- what the pieces alone cannot see: each case passes piece by piece where the whole load fails -------------

def _pieces_verdict(m: onnx.ModelProto) -> bool:
    """Whether the guard would take the model as loading from its pieces alone."""
    data = m.SerializeToString()
    p = Pieces.cut(m)
    if p is None:
        return False
    err, types = guard._checker_error_typing(data, p)
    return err is None and types is not None and p.load(types)


def test_two_nodes_of_one_name_are_loaded_whole(small_pieces):
    # onnxruntime refuses two nodes of one name, the checker does not; in two pieces each loads
    nodes = [helper.make_node("Relu", [f"r{i - 1}" if i else "x"], [f"r{i}"], name=f"n{i}") for i in range(250)]
    nodes.append(helper.make_node("Identity", ["r249"], ["y"], name="n5"))
    m = _model(nodes)
    assert guard.checker_error(m.SerializeToString()) is None
    assert Pieces.cut(m) is None and not _pieces_verdict(m)
    assert guard.onnxruntime_error(m.SerializeToString()) is not None


def test_a_constant_read_across_a_cut_is_copied_into_the_reading_piece(small_pieces):
    # onnxruntime checks a Resize's constant scales when it builds the kernel (each must be > 0): read as a
    # typed input of a later piece, the bad scale would load
    const = helper.make_node("Constant", [], ["sc"], value=helper.make_tensor("v", TensorProto.FLOAT, [4], [1.0, 1.0, 0.0, 2.0]))
    nodes = [const, *_relu_chain(250), helper.make_node("Resize", ["r249", "", "sc"], ["y"])]
    m = _model(nodes)
    for v in (m.graph.input[0], m.graph.output[0]):
        v.type.tensor_type.shape.Clear()
        for d in ([1, 1, 2, 2] if v.name == "x" else ["n", "c", "h", "w"]):
            dim = v.type.tensor_type.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            else:
                dim.dim_param = d
    p = Pieces.cut(m)
    assert "sc" not in p.crossing and any(c.output[0] == "sc" for c in p.constants[-1])
    assert not _pieces_verdict(m)
    assert guard.onnxruntime_error(m.SerializeToString()) is not None
    # a good scale loads, piece by piece
    m.graph.node[0].attribute[0].t.CopyFrom(helper.make_tensor("v", TensorProto.FLOAT, [4], [1.0, 1.0, 1.0, 2.0]))
    assert _pieces_verdict(m)


def test_crossing_types_carry_what_data_propagation_knows(small_pieces):
    # Reshape(x, Shape(w)) is [6, 1] to onnxruntime's load (it propagates shape values), [unk, unk] to plain
    # inference: declared so, a later piece would accept a MatMul with a [4, 5] weight
    w = numpy_helper.from_array(np.zeros((6, 1), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((4, 5), np.float32), "B")
    nodes = [helper.make_node("Shape", ["w"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
             *_relu_chain(249, "r", "q"), helper.make_node("MatMul", ["q248", "B"], ["y"])]
    m = _model(nodes, initializers=[w, b])
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3
    m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    del m.graph.output[0].type.tensor_type.shape.dim[:]
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_param = "a"
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 5
    p = Pieces.cut(m)
    _, types = guard._checker_error_typing(m.SerializeToString(), p)
    crossing = onnx.TypeProto()
    crossing.ParseFromString(types[sorted(p.crossing)[0]])
    assert [d.dim_value for d in crossing.tensor_type.shape.dim] == [6, 1]
    assert not _pieces_verdict(m)
    assert guard.onnxruntime_error(m.SerializeToString()) is not None


def test_a_shape_value_crossing_a_cut_loads_the_whole_model(small_pieces, monkeypatch):
    # Shape(w) is [6, 1] to onnxruntime's load, which carries the contents of small integer tensors; a later
    # piece taking it as a typed int64 [2] input would accept the Reshape and the MatMul the whole refuses
    w = numpy_helper.from_array(np.zeros((6, 1), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((4, 5), np.float32), "B")
    nodes = [helper.make_node("Shape", ["w"], ["s"]), *_relu_chain(249, "x", "q"),
             helper.make_node("Reshape", ["q248", "s"], ["r"]), helper.make_node("MatMul", ["r", "B"], ["y"])]
    m = _model(nodes, initializers=[w, b])
    del m.graph.output[0].type.tensor_type.shape.dim[:]
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_param = "a"
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 5
    p = Pieces.cut(m)
    assert "s" in p.crossing
    err, types = guard._checker_error_typing(m.SerializeToString(), p)
    assert err is None and types is None
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, types) is not None and loads == [len(m.graph.node)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pieces_loaded_side_by_side_give_the_verdict_of_one_by_one(small_pieces, monkeypatch, threads):
    # a chain of 21 pieces loaded on 1-3 threads: each piece once, never the whole; then a declared type the
    # seventh piece contradicts: False however many load at once, and no piece built or loaded past those
    # being checked beside it
    monkeypatch.setattr(pieces_mod, "load_threads", lambda: threads)
    given: list[int] = []
    real_all_pass = pieces_mod.all_pass
    monkeypatch.setattr(pieces_mod, "all_pass", lambda items, check, n: given.append(n) or real_all_pass(items, check, n))
    built: list[int] = []
    real_build = pieces_mod._piece_model
    monkeypatch.setattr(pieces_mod, "_piece_model", lambda *a: built.append(1) or real_build(*a))
    nodes = _relu_chain(2000)
    nodes.append(helper.make_node("Identity", ["r1999"], ["y"]))
    m = _model(nodes, value_info=[helper.make_tensor_value_info("r650", TensorProto.FLOAT, [2, 3])])
    p = Pieces.cut(m)
    types = _types(m, p)
    loads = _loads(monkeypatch)
    assert p.load(types) and given == [threads]
    assert sorted(loads) == sorted(stop - start for start, stop in p.spans) and len(loads) == 21 == len(built)
    m.graph.value_info[0].type.tensor_type.elem_type = TensorProto.INT64
    p = Pieces.cut(m)
    loads.clear()
    built.clear()
    assert not p.load(types)
    assert 7 <= len(loads) <= 7 + (threads > 1) * threads and len(built) <= 8 + threads


def _items(n: int, drawn: list, bad=(), broken=(), size: int = 1):
    for i in range(n):
        if i in broken:
            raise MemoryError(f"building item {i}")
        drawn.append(i)
        yield bytes([i % 256]) * size if i not in bad else b"bad" + bytes(size)


def _checker(seen: list, running: list, peak: list, pause: float = 0.0):
    import threading
    import time

    lock = threading.Lock()

    def check(item: bytes):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(pause)
        seen.append(item)
        with lock:
            running[0] -= 1
        if item.startswith(b"bad"):
            return "bad"
        if item.startswith(b"raise"):
            raise RuntimeError("the check itself failed")
        return None

    return check


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_all_pass_draws_lazily_and_stops_at_the_first_complaint(threads):
    drawn, seen, running, peak = [], [], [0], [0]
    check = _checker(seen, running, peak, pause=0.01)
    assert pieces_mod.all_pass(_items(12, drawn), check, threads) and len(seen) == 12
    assert peak[0] == threads  # (they do run side by side, as many as asked)
    drawn.clear()
    seen.clear()
    assert not pieces_mod.all_pass(_items(100, drawn, bad={5}), check, threads)
    assert 5 in drawn and len(drawn) <= 7 + threads and len(seen) <= 6 + (threads > 1) * threads
    assert not pieces_mod.all_pass(iter([b"bad", b"", b""]), check, threads)
    assert pieces_mod.all_pass(iter([]), check, threads)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_all_pass_raises_what_check_raises_and_judges_before_a_failed_draw(threads):
    check = _checker([], [0], [0])
    with pytest.raises(RuntimeError, match="check itself"):
        pieces_mod.all_pass(iter([b"", b"raise", b""]), check, threads)
    # an item that cannot be built after one that fails: the answer is the complaint, as one by one
    assert not pieces_mod.all_pass(_items(10, [], bad={1}, broken={2}), check, threads)
    with pytest.raises(MemoryError):
        pieces_mod.all_pass(_items(10, [], broken={2}), check, threads)


def test_big_items_are_checked_one_at_a_time():
    # items whose bytes pass the budget together never wait or load side by side (their sessions each hold
    # a copy of what they read): one at a time, as on one thread
    seen, running, peak = [], [0], [0]
    check = _checker(seen, running, peak, pause=0.01)
    assert pieces_mod.all_pass(_items(6, [], size=3000), check, 4, max_bytes=5000)
    assert peak[0] == 1 and len(seen) == 6
    peak[0] = 0
    assert pieces_mod.all_pass(_items(6, [], size=3000), check, 4, max_bytes=7000)
    assert peak[0] == 2


def test_load_threads_follow_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert pieces_mod.load_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert pieces_mod.load_threads() == pieces_mod.MAX_LOAD_THREADS


def test_a_cut_moves_off_a_shape_computed_in_one_piece_and_read_in_the_next(small_pieces, monkeypatch):
    # units of 7 nodes, each reshaping its value to a shape it took 4 nodes earlier (a fused masked op's
    # lengths and step indices are such local shape computations): cut at every 100th node, 100 = 7 * 14 + 2
    # falls between a Shape and its Reshape, and the whole model was loaded
    nodes, prev = [], "x"
    for k in range(40):
        u = f"u{k}_"
        nodes += [helper.make_node("Relu", [prev], [u + "a"]), helper.make_node("Shape", [u + "a"], [u + "s"]),
                  helper.make_node("Relu", [u + "a"], [u + "b"]), helper.make_node("Relu", [u + "b"], [u + "c"]),
                  helper.make_node("Relu", [u + "c"], [u + "d"]), helper.make_node("Reshape", [u + "d", u + "s"], [u + "e"]),
                  helper.make_node("Relu", [u + "e"], [u + "f"])]
        prev = u + "f"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    m = _model(nodes)
    scan = NodeScan(m)
    assert scan.computed_at_load == {f"u{k}_s" for k in range(40)}
    p = Pieces.cut(m, scan)
    assert len(p.spans) == 3 and all(stop - start <= 120 for start, stop in p.spans)
    assert p.crossing and not any(name.endswith("_s") for name in p.crossing)
    loads = _loads(monkeypatch)
    assert guard._load_error(m.SerializeToString(), p, _types(m, p)) is None
    assert len(loads) == 3 and max(loads) < len(m.graph.node)  # (in pieces, not whole)
    # where no cut within reach is free of it (a shape read 150 nodes later), the cut stays and the whole loads
    far = [helper.make_node("Shape", ["x"], ["s0"]), *_relu_chain(150), helper.make_node("Reshape", ["r149", "s0"], ["q"]),
           *_relu_chain(100, "q", "t"), helper.make_node("Identity", ["t99"], ["y"])]
    m = _model(far)
    p = Pieces.cut(m)
    assert "s0" in p.crossing and p.spans[1][0] == 100


def test_values_computed_at_load_are_those_load_time_values_decides():
    # the scan's forward pass and rnnfuse.load_time_values' walk agree on every value of a mixed graph
    from rnnfuse.load_time_values import LoadTimeValues

    w = numpy_helper.from_array(np.zeros((6, 1), np.float32), "w")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Shape", ["w"], ["sw"]),
             helper.make_node("Concat", ["sx", "sw"], ["both"], axis=0), helper.make_node("Unsqueeze", ["both", "axes"], ["u"]),
             helper.make_node("Cast", ["u"], ["uf"], to=TensorProto.FLOAT), helper.make_node("Add", ["uf", "x"], ["mixed"]),
             helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([2], np.int64))),
             helper.make_node("Mul", ["k", "axes"], ["k2"]), helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("RandomNormal", [], ["rnd"], shape=[2]), helper.make_node("Abs", ["rnd"], ["rnd2"]),
             helper.make_node("Dropout", ["uf"], ["dr", ""])]  # (an optional output left unnamed: no value)
    m = _model(nodes, initializers=[w, axes])
    scan = NodeScan(m)
    walk = LoadTimeValues(m.graph, scan.nodes, scan.producer)
    assert scan.computed_at_load == {name for name in scan.producer if walk.at_load(name)}
    assert scan.computed_at_load == {"sx", "sw", "both", "u", "uf", "k", "k2", "dr"}
