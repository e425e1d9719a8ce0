"""The do-no-harm guard loads only what changed in a big rewritten model (rnnfuse.changed_region).

onnxruntime's session creation grows faster than the nodes (an elementwise chain of 25k / 50k / 100k nodes:
1.4 / 3.9 / 13 s), so a big model with a small fusion spent most of its run in the guard's whole-model load.
The region is the changed nodes and the unchanged ones a changed type reaches; these tests force the region
route on small models (``SCOPED_NODES``) and check what it includes, what it decides, and that the rewritten
model is the same either way.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.changed_region as region
import rnnfuse.region_types as region_types
import rnnfuse.guard as guard
from rnnfuse.pipeline import Pipeline

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def _example_with_a_head(extra: int, tmp_path) -> onnx.ModelProto:
    """The benchmark's 'head' graph: the shipped Keras model (two masked Loops and a bidirectional pair to
    fuse) with ``extra`` nodes reading its output, a model most of which the fusion does not touch."""
    sys.path.insert(0, BENCHMARKS)
    try:
        from graphs import recurrence_then_head
    finally:
        sys.path.remove(BENCHMARKS)
    recurrence_then_head(str(tmp_path / "head.onnx"), extra)
    return onnx.load(str(tmp_path / "head.onnx"))


def _loads(monkeypatch) -> list[int]:
    """The node counts of the models the guard hands onnxruntime."""
    seen: list[int] = []
    real = guard.onnxruntime_error

    def counted(data):
        m = onnx.load(data, load_external_data=False) if isinstance(data, str) else onnx.load_from_string(
            data if isinstance(data, bytes) else data.SerializeToString())
        seen.append(len(m.graph.node))
        return real(data)

    monkeypatch.setattr(guard, "onnxruntime_error", counted)
    return seen


def _outputs(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})


def test_a_big_model_with_a_small_fusion_loads_only_its_changed_region(monkeypatch, tmp_path):
    src = _example_with_a_head(200, tmp_path)
    whole, _ = Pipeline.default()(src)  # (the model is small: the guard loads it whole)
    monkeypatch.setattr(region, "SCOPED_NODES", 0)
    loads = _loads(monkeypatch)
    out, report = Pipeline.default()(src)
    assert report.fused
    assert out.SerializeToString() == whole.SerializeToString()
    assert loads and max(loads) < len(out.graph.node) // 4, (loads, len(out.graph.node))
    x = np.random.default_rng(1).standard_normal((2, 9, src.graph.input[0].type.tensor_type.shape.dim[-1].dim_value or 4))
    x[1, 6:] = 0.0  # (a padded row: the Keras model masks zero steps)
    x = x.astype(np.float32)
    for a, b in zip(_outputs(out, x), _outputs(src, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _add_ifs(m: onnx.ModelProto, count: int, branch_nodes: int) -> None:
    """Append to ``m`` ``count`` Ifs in a row on a computed condition, each branch ``branch_nodes`` Relus or
    Negs of what the If before gave (read by capture), the last one a new graph output: few main-graph nodes,
    many nodes in subgraphs."""
    g, prev = m.graph, m.graph.output[0].name
    g.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "ifs_zero"))
    for k in range(count):
        def branch(op: str) -> onnx.GraphProto:
            nodes, cur = [], prev
            for j in range(branch_nodes):
                nodes.append(helper.make_node(op, [cur], [f"if{k}_{op}{j}"]))
                cur = nodes[-1].output[0]
            return helper.make_graph(nodes, f"if{k}_{op}", [], [helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)])

        g.node.extend([helper.make_node("ReduceSum", [prev], [f"if{k}_sum"], keepdims=0),
                       helper.make_node("Greater", [f"if{k}_sum", "ifs_zero"], [f"if{k}_cond"]),
                       helper.make_node("If", [f"if{k}_cond"], [f"if{k}_out"], then_branch=branch("Relu"),
                                        else_branch=branch("Neg"))])
        prev = f"if{k}_out"
    g.output.append(helper.make_tensor_value_info(prev, TensorProto.FLOAT, None))


def test_a_model_big_by_its_subgraphs_loads_only_its_changed_region(monkeypatch, tmp_path):
    # onnxruntime sets every subgraph up: a model is big by the nodes its Ifs hold too (2,300 Ifs of 9,000
    # main-graph nodes were loaded whole, super-linearly: 0.8 / 1.8 / 5.1 s at 25k / 50k / 100k nodes)
    src = _example_with_a_head(200, tmp_path)
    _add_ifs(src, 30, 40)
    monkeypatch.setattr(region, "SCOPED_NODES", len(src.graph.node) + 1)  # (more than its main graph holds)
    loads = _loads(monkeypatch)
    out, report = Pipeline.default()(src)
    assert report.fused and not report.notes, report.notes
    assert len(out.graph.node) < region.SCOPED_NODES
    assert loads and max(loads) < len(out.graph.node) // 4, (loads, len(out.graph.node))
    x = np.random.default_rng(2).standard_normal((2, 9, src.graph.input[0].type.tensor_type.shape.dim[-1].dim_value or 4))
    x[1, 6:] = 0.0
    x = x.astype(np.float32)
    for a, b in zip(_outputs(out, x), _outputs(src, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_model_big_by_its_function_calls_is_judged_by_its_region(monkeypatch):
    # onnxruntime inlines every call of a model-local function: 9,700 calls of 11-node functions, 9,973
    # main-graph nodes, were checked and loaded whole (7.3 s of a 7.8 s run)
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    ten = helper.make_function("local", "Ten", ["a"], ["f9"],
                               [helper.make_node("Relu", ["a" if i == 0 else f"f{i - 1}"], [f"f{i}"]) for i in range(10)], ops)
    nodes = [helper.make_node("Ten", ["x" if k == 0 else f"c{k - 1}"], [f"c{k}"], domain="local") for k in range(40)]
    nodes.append(helper.make_node("Identity", ["c39"], ["y"]))
    g = helper.make_graph(nodes, "calls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    before = helper.make_model(g, opset_imports=ops, functions=[ten], ir_version=8)
    after = onnx.ModelProto()
    after.CopyFrom(before)
    after.graph.node[-1].op_type = "Neg"  # (the change: one node at the end)
    monkeypatch.setattr(region, "SCOPED_NODES", 200)  # (41 main-graph nodes, 441 set up)
    loads = _loads(monkeypatch)
    assert guard.harm(after, lambda: before) is None
    assert loads and max(loads) <= 2, loads  # (the region, never the whole model)


def _cast_then_tanh(to: int, tail: int = 60) -> onnx.ModelProto:
    """x -> Cast(to) -> Tanh -> Shape -> Reshape(x, that shape) -> ``tail`` Relus -> y: the Tanh reads the Cast,
    the Shape's type (int64 [2]) does not depend on what it reads the shape of."""
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=to), helper.make_node("Tanh", ["c"], ["t"]),
             helper.make_node("Shape", ["t"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r0"])]
    for i in range(tail):
        nodes.append(helper.make_node("Relu", [f"r{i}"], [f"r{i + 1}"]))
    g = helper.make_graph(nodes, "cast_tanh", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info(f"r{tail}", TensorProto.FLOAT, [3, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_the_region_follows_a_changed_type_until_the_types_agree():
    before = _cast_then_tanh(TensorProto.FLOAT)
    after = _cast_then_tanh(TensorProto.INT32)  # (Tanh takes no int32: onnxruntime refuses the node)
    sub = region.region_model(after, before)
    assert sub is not None
    # (the Shape's output is followed, its contents a Reshape's target; the Relus read what they read)
    assert [n.op_type for n in sub.graph.node] == ["Cast", "Tanh", "Shape", "Reshape"]
    with pytest.raises(Exception):
        ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_guard_refuses_a_rewrite_whose_region_does_not_load(monkeypatch):
    monkeypatch.setattr(region, "SCOPED_NODES", 0)
    before, after = _cast_then_tanh(TensorProto.FLOAT), _cast_then_tanh(TensorProto.INT32)
    assert guard.harm(after, lambda: before) is not None
    same = _cast_then_tanh(TensorProto.FLOAT)
    assert guard.harm(same, lambda: before) is None


def test_an_unchanged_model_has_an_empty_region_and_a_changed_interface_none():
    before = _cast_then_tanh(TensorProto.FLOAT)
    assert region.region_model(_cast_then_tanh(TensorProto.FLOAT), before) is None  # (nothing to load)
    renamed = _cast_then_tanh(TensorProto.FLOAT)
    renamed.graph.output[0].name = "r59"
    assert region.region_model(renamed, before) is None


def _reshaped(target: list[int], tail: int = 60) -> onnx.ModelProto:
    """x -> Reshape(x, Constant(target)) -> Shape (an output), and x -> ``tail`` Relus (the other output): the
    Reshape's inference reads the constant's value; the Shape's type (int64 [2]) does not depend on it."""
    nodes = [helper.make_node("Constant", [], ["target"], value=numpy_helper.from_array(np.array(target, np.int64))),
             helper.make_node("Reshape", ["x", "target"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Relu", ["x"], ["y0"])]
    for i in range(tail):
        nodes.append(helper.make_node("Relu", [f"y{i}"], [f"y{i + 1}"]))
    g = helper.make_graph(nodes, "reshaped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("s", TensorProto.INT64, None),
                           helper.make_tensor_value_info(f"y{tail}", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_changed_constant_is_followed_whatever_its_type():
    """int64 [2] before and after, but the Reshape reading it infers another shape, or fails (two -1s): it is
    taken in, not stopped at by the type comparison."""
    sub = region.region_model(_reshaped([-1, -1]), _reshaped([4, 3]))
    assert sub is not None
    assert [n.op_type for n in sub.graph.node] == ["Constant", "Reshape", "Shape"]
    with pytest.raises(Exception):
        ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    same = region.region_model(_reshaped([2, 6]), _reshaped([4, 3]))
    assert same is not None and [n.op_type for n in same.graph.node] == ["Constant", "Reshape", "Shape"]
    ort.InferenceSession(same.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_region_reading_a_constant_holds_the_constant_node():
    """onnxruntime makes a Constant an initializer, and a kernel may check its value when it is built: a
    changed Reshape reading an unchanged Constant takes the node in, not a typed input hiding its value."""
    before = _reshaped([4, 3])
    after = _reshaped([4, 3])
    after.graph.node[1].name = "renamed"  # (a changed node: not found among the input's, field for field)
    sub = region.region_model(after, before)
    assert sub is not None
    assert [n.op_type for n in sub.graph.node][:2] == ["Constant", "Reshape"]
    assert [v.name for v in sub.graph.input] == ["x"]


def _reshaped_by_a_weight(b_rows: int) -> onnx.ModelProto:
    """r = Reshape(x, Shape(w [6, 1])), read by MatMul(r, B [b_rows, 5]) after 40 unrelated Relus."""
    w = numpy_helper.from_array(np.zeros((6, 1), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((b_rows, 5), np.float32), f"B{b_rows}")
    chain = [helper.make_node("Relu", ["z" if i == 0 else f"q{i - 1}"], [f"q{i}"]) for i in range(40)]
    nodes = [helper.make_node("Shape", ["w"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]), *chain,
             helper.make_node("MatMul", ["r", b.name], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 2]) for n in ("x", "z")],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", 5]),
                           helper.make_tensor_value_info("q39", TensorProto.FLOAT, [3, 2])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_regions_inputs_are_typed_as_onnxruntimes_load_types_them():
    """Only the MatMul changed; the value it reads is [6, 1] to onnxruntime's load (it propagates Shape(w)),
    unknown dims to inference without data propagation: typed so, the region would load where the whole
    model does not."""
    before, after = _reshaped_by_a_weight(1), _reshaped_by_a_weight(4)
    assert guard.onnxruntime_error(after.SerializeToString()) is not None
    sub = region.region_model(after, before)
    assert [n.op_type for n in sub.graph.node] == ["MatMul"]
    r = next(i for i in sub.graph.input if i.name == "r")
    assert [d.dim_value for d in r.type.tensor_type.shape.dim] == [6, 1]
    assert not guard._region_passes(after, lambda: before, None, region.NodeScan(after))


def _behind_an_upstream(m: onnx.ModelProto, length: int) -> onnx.ModelProto:
    """``m`` reading, instead of its input x, the end of a chain of ``length`` Relus computing it from x."""
    chain = [helper.make_node("Relu", ["x" if i == 0 else f"u{i - 1}"], [f"u{i}"]) for i in range(length)]
    for n in m.graph.node:
        n.input[:] = [f"u{length - 1}" if i == "x" else i for i in n.input]
    nodes = chain + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _node_count(model) -> int:
    """The nodes of a model handed to inference (serialised: the cone's copy is let go before inference)."""
    return len((onnx.load_from_string(model) if isinstance(model, bytes) else model).graph.node)


def test_an_unchanged_upstream_is_typed_once_for_both_models(monkeypatch):
    """The input model's inference stops at the values both models compute alike and takes the rewritten
    model's types: the 300-Relu upstream is inferred in one of the two, and the region is what it was. A
    value whose declared type differs between the models is not taken over: inference goes past it."""
    inferred: list[int] = []
    real = region_types.inferred_types
    monkeypatch.setattr(region_types, "inferred_types", lambda m: inferred.append(_node_count(m)) or real(m))
    before = _behind_an_upstream(_cast_then_tanh(TensorProto.FLOAT), 300)
    after = _behind_an_upstream(_cast_then_tanh(TensorProto.INT32), 300)
    sub = region.region_model(after, before)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Cast", "Tanh", "Shape", "Reshape"]
    assert inferred[0] >= 300 and max(inferred[1:]) < 10, inferred
    assert [(i.name, i.type.tensor_type.elem_type) for i in sub.graph.input] == [("u299", TensorProto.FLOAT)]

    inferred.clear()
    redeclared = _behind_an_upstream(_cast_then_tanh(TensorProto.INT32), 300)
    redeclared.graph.value_info.append(helper.make_tensor_value_info("u150", TensorProto.FLOAT, [3, 4]))
    sub = region.region_model(redeclared, before)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Relu", "Cast", "Tanh", "Shape", "Reshape"]
    assert inferred[0] >= 300 and inferred[1] > 150, inferred  # (the input model inferred past u150)


def test_types_the_run_established_spare_inferring_an_unchanged_upstream(monkeypatch):
    """Types the optimizer already inferred (``established``) are taken for the values both models compute
    alike, and inference stops there: the 300-Relu upstream is inferred in neither model, and the region is
    what it was. They are not taken for a value the rewrite computes anew (the Cast's output), whose type the
    region's own inference decides."""
    inferred: list[int] = []
    real = region_types.inferred_types
    monkeypatch.setattr(region_types, "inferred_types", lambda m: inferred.append(_node_count(m)) or real(m))
    before = _behind_an_upstream(_cast_then_tanh(TensorProto.FLOAT), 300)
    after = _behind_an_upstream(_cast_then_tanh(TensorProto.INT32), 300)
    asked: list[str] = []
    cast_out = next(n.output[0] for n in after.graph.node if n.op_type == "Cast")

    def established(name):
        asked.append(name)
        return (TensorProto.DOUBLE, ["b", 4]) if name == cast_out else (TensorProto.FLOAT, ["b", 4])

    sub = region.region_model(after, before, established)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Cast", "Tanh", "Shape", "Reshape"]
    assert inferred and max(inferred) < 10, inferred  # (no inference reached into the upstream)
    assert cast_out not in asked
    # (nor for what is computed from it: the values the changed Cast reaches, walked forward)
    nodes = list(after.graph.node)
    cast_at = next(k for k, n in enumerate(nodes) if n.op_type == "Cast")
    downstream = {o for n in nodes[cast_at:] for o in n.output}
    assert {"t", "s", "r0", "r60"} <= downstream and not downstream & set(asked), asked
    (x,) = sub.graph.input
    assert x.name == "u299" and x.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim] == ["b", 4]

    inferred.clear()  # (a type of unknown rank is no answer: inference decides, as without)
    sub = region.region_model(after, before, lambda name: (TensorProto.FLOAT, None))
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Cast", "Tanh", "Shape", "Reshape"]
    assert inferred[0] >= 300, inferred


def test_types_the_optimizer_declared_are_not_established(monkeypatch):
    """What an edit declared (Model.declare: the optimizer's belief about a value it rewired readers to), and
    what a cone inferred from such a type, is no established type: the guard infers those values itself. A
    wrong declaration of an unchanged value must not let a region through that its own inference refuses."""
    def model(weight: str) -> onnx.ModelProto:
        nodes = [helper.make_node("Relu", ["x"], ["v"], name="r")]
        nodes += [helper.make_node("Neg", ["x" if k == 0 else f"f{k - 1}"], [f"f{k}"], name=f"f{k}") for k in range(30)]
        nodes.append(helper.make_node("MatMul", ["v", weight], ["y"], name=f"mm_{weight}"))
        inits = [numpy_helper.from_array(np.ones((3, 5), np.float32), "W3"),
                 numpy_helper.from_array(np.ones((4, 5), np.float32), "W4")]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5]),
                               helper.make_tensor_value_info("f29", TensorProto.FLOAT, [2, 4])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    from rnnfuse.cone_types import ConeTypes
    from rnnfuse.graph import Model

    monkeypatch.setattr(region, "SCOPED_NODES", 0)
    before, after = model("W4"), model("W3")  # (v is [2, 4]: v @ W3 cannot load)
    m = Model(after)
    m.declare("v", (TensorProto.FLOAT, [2, 3]))  # (a wrong belief about an unchanged value)
    assert m.established_type("v") is None
    assert guard.harm(after, lambda: before, m.established_type) is not None  # (refused, as without the types)
    assert guard.harm(after, lambda: before) is not None

    cones = ConeTypes(m)  # (a cone reading the declared type: what it infers is the optimizer's belief too)
    assert cones.type_of("y", one_piece=True) is not None and "y" in cones.from_edits
    assert cones.type_of("f29", one_piece=True) is not None and "f29" not in cones.from_edits


def _edited(m: onnx.ModelProto, nodes: list) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _relus(tail: int = 60) -> onnx.ModelProto:
    """x [3, 4] -> ``tail`` Relus -> y: every value typed float [3, 4]."""
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"r{i}"], [f"r{i + 1}"]) for i in range(tail)]
    g = helper.make_graph(nodes, "relus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info(f"r{tail}", TensorProto.FLOAT, [3, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_the_guard_checks_the_wiring_around_a_region_that_passes(monkeypatch):
    """A region that passes both checks on its own can still break the whole graph: its new node defines a
    name an untouched node defines too, or sits after a node reading what it computes. The wiring check sends
    the guard to the whole model, whose checks refuse both; a sound edit of the same size passes."""
    monkeypatch.setattr(region, "SCOPED_NODES", 0)
    checked = []
    real = guard.checker_error
    monkeypatch.setattr(guard, "checker_error", lambda data: checked.append(data) or real(data))
    before = _relus()
    nodes = list(before.graph.node)
    twice = _edited(before, [helper.make_node("Identity", ["x"], ["r30"])] + nodes)
    late = _edited(before, nodes[:10] + nodes[11:] + [helper.make_node("Sigmoid", ["r10"], ["r11"])])
    sound = _edited(before, nodes[:10] + [helper.make_node("Sigmoid", ["r10"], ["r11"])] + nodes[11:])
    assert region.wiring_error(twice) == "'r30' is defined twice"
    assert "reads 'r11' before it is defined" in region.wiring_error(late)
    for after in (twice, late, sound):
        sub = region.region_model(after, before)
        assert sub is not None and len(sub.graph.node) == 1 and guard.checker_error(sub.SerializeToString()) is None
    for after in (twice, late):
        assert guard.harm(after, lambda: before) is not None
    checked.clear()
    assert region.wiring_error(sound) is None and guard.harm(sound, lambda: before) is None
    assert [len(onnx.load_from_string(d).graph.node) for d in checked] == [1]  # (the region alone)


def test_wiring_errors_in_graph_outputs_and_subgraph_captures():
    before = _cast_then_tanh(TensorProto.FLOAT)
    assert region.wiring_error(before) is None
    lost = _edited(before, list(before.graph.node)[:-1])
    assert region.wiring_error(lost) == "graph output 'r60' is not defined"
    body = helper.make_graph([helper.make_node("Identity", ["r10"], ["o"])], "then",
                             [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    cond = helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True)))
    branch = helper.make_node("If", ["cond"], ["b"], then_branch=body, else_branch=body)
    nodes = list(before.graph.node)
    early = _edited(before, [cond, branch] + nodes)  # (the If captures r10 before the Relu computing it)
    assert "reads 'r10' before it is defined" in region.wiring_error(early)
    assert region.wiring_error(_edited(before, nodes + [cond, branch])) is None


@pytest.mark.parametrize("declared", [("W", TensorProto.FLOAT, [4, 3]), ("W", TensorProto.DOUBLE, [5, 3]),
                                      ("x", TensorProto.FLOAT, ["B", 7])])
def test_a_model_inferred_whole_types_as_its_cone_would(declared):
    """The whole model copied in bulk for inference (its values' cones are most of it) gives the types a copy of
    every node's cone gives: a declaration of an input's or a weight's, which the cone copy leaves out, is left
    out too (a stale one made the inference fail, or typed the input as declared instead of as given)."""
    W = numpy_helper.from_array(np.ones((5, 3), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["B", 5])], [vi("z", TensorProto.FLOAT, None)], [W],
                          value_info=[vi(*declared)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    types = region_types.InferredTypes(m)
    by_cone = region_types.inferred_types(types._cone_model(range(len(types.nodes)), ["y", "z"]))
    whole = region_types.inferred_types(types._whole_model().SerializeToString())
    assert by_cone is not None and whole is not None
    assert {k: whole.get(k) for k in ("x", "W", "y", "z")} == {k: by_cone.get(k) for k in ("x", "W", "y", "z")}


@pytest.mark.parametrize("removed, kept, whole", [(600, 300, True), (300, 600, False)])
def test_a_rewrite_that_removed_over_half_of_the_input_infers_it_whole_without_a_walk(monkeypatch, removed, kept, whole):
    """A rewrite that replaced two thirds of its input (a 600-node chain by one node) asks the input model the
    types of the values the chain computed, whose cones are the chain: it is inferred whole at once, no cone
    walked first (a walk gives up past half the model). One that replaced a third infers the chain's cone alone,
    not the 600 nodes after it. Either way the region and its types are what they were."""
    vi = helper.make_tensor_value_info
    last = f"u{removed - 1}"
    chain = [helper.make_node("Relu", ["x" if i == 0 else f"u{i - 1}"], [f"u{i}"]) for i in range(removed)]
    tail = [helper.make_node("Tanh", [last if i == 0 else f"t{i - 1}"], ["z" if i == kept - 1 else f"t{i}"])
            for i in range(kept)]
    io = ([vi("x", TensorProto.FLOAT, ["B", 4])], [vi("z", TensorProto.FLOAT, None)])
    before = helper.make_model(helper.make_graph(chain + tail, "g", *io), opset_imports=[helper.make_opsetid("", 17)])
    after = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], [last])] + tail, "g", *io),
                              opset_imports=[helper.make_opsetid("", 17)])
    walked, inferred_whole = [], []
    real_cone, real_whole = region_types.InferredTypes._cone, region_types.InferredTypes._whole_model
    monkeypatch.setattr(region_types.InferredTypes, "_cone", lambda self, names: walked.append(self.model is before) or real_cone(self, names))
    monkeypatch.setattr(region_types.InferredTypes, "_whole_model",
                        lambda self: inferred_whole.append(self.model is before) or real_whole(self))
    sub = region.region_model(after, before)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Relu"]
    assert (True in walked) is not whole and (True in inferred_whole) is whole, (walked, inferred_whole)


def test_a_model_inferred_whole_holds_its_subgraphs_as_skeletons():
    """The whole-model copy holds a node with subgraphs as a skeleton (a branch's weight without its data) and
    types what the cone copy types."""
    vi = helper.make_tensor_value_info
    branch = lambda name: helper.make_graph(  # noqa: E731
        [helper.make_node("MatMul", ["y", "k" + name], ["o" + name])], name, [], [vi("o" + name, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((64, 64), np.float32), "k" + name)])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["z"], then_branch=branch("t"), else_branch=branch("e"))]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2, 64])], [vi("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    types = region_types.InferredTypes(m)
    whole = types._whole_model()
    assert whole.ByteSize() < 4 * 64 * 64 // 2 < m.ByteSize()
    assert [n.op_type for n in whole.graph.node] == [n.op_type for n in m.graph.node]
    by_cone = region_types.inferred_types(types._cone_model(range(len(types.nodes)), ["z"]))
    got = region_types.inferred_types(whole.SerializeToString())
    assert by_cone is not None and got is not None and got.get("z") == by_cone.get("z") is not None


def _reshaped_to_assembled_shape(last: int, renamed: bool) -> onnx.ModelProto:
    """``reshape(relu(x), concat(unsqueeze(shape(x)[0]), k)) @ w`` (w [4, 5], then 20 Tanhs) with x [3, 4], k =
    [last]: a torch export's ``view(B, -1)``. ``renamed``: the Concat reads k under another name (as a merge of equal
    constants leaves it), so the Concat is a changed node whose reads are computed from a shape."""
    k = "k_merged" if renamed else "k"
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["d0"], axis=0),
             helper.make_node("Unsqueeze", ["d0", "axes"], ["u0"]), helper.make_node("Concat", ["u0", k], ["to"], axis=0),
             helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "to"], ["y"]),
             helper.make_node("MatMul", ["y", "w"], ["t0"])]
    nodes += [helper.make_node("Tanh", [f"t{i}"], ["z" if i == 19 else f"t{i + 1}"]) for i in range(20)]  # (a tail:
    # the region a small part of the model)
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("axes", [0]), (k, [last]))]
    inits.append(numpy_helper.from_array(np.ones((4, 5), np.float32), "w"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_region_reading_values_computed_from_a_shape_holds_what_computes_them():
    """A changed Concat reading a Shape's entry: a typed input would hide the entry's value from the region's
    inference, so the nodes computing it join the region, back to x (it was judged by loading the whole
    model: 5,000 such Concats in a torch transformer beside a fused loop, 3 s). The region passes where the
    model loads."""
    before, after = _reshaped_to_assembled_shape(-1, False), _reshaped_to_assembled_shape(-1, True)
    sub = region.region_model(after, before)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Shape", "Gather", "Unsqueeze", "Concat", "Reshape"]
    assert [i.name for i in sub.graph.input if i.name not in {t.name for t in sub.graph.initializer}] == ["x", "r"]
    assert guard._region_passes(after, lambda: before, None, region.NodeScan(after))


def _reshaped_to_a_shape(of_transposed: bool) -> onnx.ModelProto:
    """``reshape(relu(x), shape(s)) @ w`` (x [3, 4], w [4, 5], then 20 Tanhs), s = x, or x transposed."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("Shape", ["xt" if of_transposed else "x"], ["to"]), helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Reshape", ["r", "to"], ["y"]), helper.make_node("MatMul", ["y", "w"], ["t0"])]
    nodes += [helper.make_node("Tanh", [f"t{i}"], ["z" if i == 19 else f"t{i + 1}"]) for i in range(20)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.ones((4, 5), np.float32), "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_changed_shape_value_is_followed_to_its_readers():
    """A changed Shape whose output has the type it had (int64 [2]) but other contents ([4, 3] where it was
    [3, 4]): onnxruntime's load reads them into the Reshape's output, which the MatMul after it cannot take.
    The readers of such a value are followed like a constant's, and the region fails where the whole model
    does (its type unchanged, the change stopped at the Shape, and the region passed)."""
    before, after = _reshaped_to_a_shape(False), _reshaped_to_a_shape(True)
    assert guard.onnxruntime_error(before.SerializeToString()) is None
    assert guard.onnxruntime_error(after.SerializeToString()) is not None
    assert not guard._region_passes(after, lambda: before, None, region.NodeScan(after))


def _target_through(kind: str, src: str, tag: str) -> tuple[list, str]:
    """Nodes computing an int64 [2] Reshape target from Shape(src), through a float Cast and back, or an
    Unsqueeze to rank 2 and a Squeeze: onnxruntime's load carries the shape's entries through both."""
    nodes = [helper.make_node("Shape", [src], [f"{tag}_shape"])]
    if kind == "float":
        nodes += [helper.make_node("Cast", [f"{tag}_shape"], [f"{tag}_f"], to=TensorProto.FLOAT),
                  helper.make_node("Cast", [f"{tag}_f"], [f"{tag}_t"], to=TensorProto.INT64)]
    else:
        nodes += [helper.make_node("Unsqueeze", [f"{tag}_shape", "ax0"], [f"{tag}_u"]),
                  helper.make_node("Squeeze", [f"{tag}_u", "ax0"], [f"{tag}_t"])]
    return nodes, f"{tag}_t"


def _reshaped_through(kind: str, transposed: bool) -> onnx.ModelProto:
    """``reshape(relu(x), target(s)) @ w`` with s = relu(x) (the input) or transpose(x) (the rewrite: the only
    changed node), x [3, 4], w [4, 5], then 40 Tanhs from x."""
    src = (helper.make_node("Transpose", ["x"], ["s"], perm=[1, 0]) if transposed else helper.make_node("Relu", ["x"], ["s"]))
    target, to = _target_through(kind, "s", "c")
    nodes = [src, *target, helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", to], ["y"]),
             helper.make_node("MatMul", ["y", "w"], ["t0"])]
    nodes += [helper.make_node("Tanh", ["x" if i == 0 else f"q{i - 1}"], ["z" if i == 39 else f"q{i}"]) for i in range(40)]
    inits = [numpy_helper.from_array(np.ones((4, 5), np.float32), "w"), numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4]),
                           helper.make_tensor_value_info("t0", TensorProto.FLOAT, ["m", "n"])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("kind", ["float", "rank2"])
def test_shape_values_carried_through_a_float_or_a_higher_rank_are_followed(kind):
    """A shape's entries cast to a float and back, or unsqueezed to rank 2 and squeezed: onnxruntime's load
    still knows them (a review's probe), so they are no place to cut the region at, nor to stop following a
    change. The Shape's source transposed: same types all the way, other contents, a MatMul that refuses them;
    the region passed (the values were taken for shape-free and declared as a typed input)."""
    before, after = _reshaped_through(kind, False), _reshaped_through(kind, True)
    assert guard.onnxruntime_error(before.SerializeToString()) is None
    assert guard.onnxruntime_error(after.SerializeToString()) is not None
    assert not guard._region_passes(after, lambda: before, None, region.NodeScan(after))


def test_values_the_load_knows_are_computed_from_shapes_and_constants():
    """Which values a load may know the contents of (rnnfuse.load_time_values): a Shape's entries and what is
    computed from them and constants, through any op; not what reads a graph input's contents, nor an If's
    output. A 5,000-input Concat is decided in one walk."""
    from rnnfuse.load_time_values import LoadTimeValues

    branch = helper.make_graph([helper.make_node("Identity", ["d"], ["b"])], "b", [],
                               [helper.make_tensor_value_info("b", TensorProto.INT64, [])])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["d"], axis=0), helper.make_node("Add", ["d", "n"], ["mixed"]),
             helper.make_node("Cast", ["d"], ["f"], to=TensorProto.FLOAT), helper.make_node("Concat", ["f"] * 5000, ["wide"], axis=0),
             helper.make_node("If", ["c"], ["chosen"], then_branch=branch, else_branch=branch),
             helper.make_node("Mul", ["d", "zero"], ["scaled"])]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [3, 4]), vi("n", TensorProto.INT64, []), vi("c", TensorProto.BOOL, [])],
                          [], [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    at_load = LoadTimeValues(g, list(g.node), {o: i for i, n in enumerate(g.node) for o in n.output})
    assert {v: at_load.at_load(v) for v in ("r", "s", "d", "mixed", "f", "wide", "chosen", "scaled", "x", "zero")} == {
        "r": False, "s": True, "d": True, "mixed": False, "f": True, "wide": True, "chosen": False, "scaled": True,
        "x": False, "zero": True}


def test_a_cones_inferred_graph_is_let_go_and_a_whole_models_read_as_asked():
    """Each wave of a change infers a cone, which may hold a big shared upstream: its types are read at once
    and its inferred graph let go (keeping each took 720 MB over 300 waves of a 2,000-node upstream). A whole
    model is inferred once; its types are read as asked."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"r{i - 1}"], [f"r{i}"]) for i in range(40)]
    nodes.append(helper.make_node("Tanh", ["r39"], ["z"]))
    m = helper.make_model(helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["B", 4])], [vi("z", TensorProto.FLOAT, None)]),
                          opset_imports=[helper.make_opsetid("", 17)])
    cone = region_types.InferredTypes(m)
    assert cone.ask(["r5"]) is not None and not cone.whole
    assert cone.ask(["r9"]) is not None and not cone.whole
    assert all(isinstance(layer, dict) for layer in cone.types._layers)
    assert cone.types.get("r5") == cone.types.get("r9") is not None
    whole = region_types.InferredTypes(m, whole=True)
    assert whole.ask(["r30"]) is not None and whole.whole
    assert [type(layer) for layer in whole.types._layers] == [region_types.InferredGraphTypes]
    assert whole.types.get("r30") == cone.types.get("r5") and "z" in whole.types


def _spreading_change(rewritten: bool, upstream: int, spread: int, declared: bool) -> onnx.ModelProto:
    """``upstream`` Relus, then one node the rewrite changed (a Relu made an Unsqueeze: rank 2 -> 3), then
    ``spread`` Relus whose type differs in the two models (one wave each), a ReduceSum to a float scalar
    in both (the change stops there) and a Neg; ``declared``: every value computed declared without a type."""
    mk, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [mk("Relu", ["x" if i == 0 else f"p{i - 1}"], [f"p{i}"]) for i in range(upstream)]
    last = f"p{upstream - 1}"
    nodes.append(mk("Unsqueeze", [last, "axes"], ["m"]) if rewritten else mk("Relu", [last], ["m"]))
    nodes += [mk("Relu", ["m" if i == 0 else f"k{i - 1}"], [f"k{i}"]) for i in range(spread)]
    nodes += [mk("ReduceSum", [f"k{spread - 1}"], ["s"], keepdims=0), mk("Neg", ["s"], ["z"])]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, ["B", 4])], [vi("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([0], np.int64), "axes")],
                          value_info=[vi(o, TensorProto.FLOAT, None) for n in nodes for o in n.output][:-1] if declared else None)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("declared", [False, True])
def test_a_change_spreading_wave_by_wave_infers_each_node_once(monkeypatch, declared):
    """Each wave of a change types the values it reaches by inferring their cone; a cone stops at the values an
    earlier wave typed (declared with those types), so 40 waves down a chain behind a 400-node upstream infer
    the upstream once per model, not once a wave (16,000 nodes: 40 waves of the whole cone). The region and
    the types it reads are those one inference of everything gives."""
    monkeypatch.setattr(region_types, "MAX_CONE_SHARE", 0.99)  # (cones, not whole models: the waves are what is tested)
    inferred: list[int] = []
    real = region_types.inferred_types
    monkeypatch.setattr(region_types, "inferred_types", lambda m: inferred.append(_node_count(m)) or real(m))
    after, before = (_spreading_change(rewritten, 400, 40, declared) for rewritten in (True, False))
    sub = region.region_model(after, before)
    assert sub is not None and [n.op_type for n in sub.graph.node] == ["Unsqueeze", *["Relu"] * 40, "ReduceSum"]
    assert len(inferred) > 40 and sum(inferred) < 2 * (400 + 40) + 3 * len(inferred), inferred
    assert [(i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]) for i in sub.graph.input] == [
        ("p399", ["B", 4])]
    outputs = {o.name: o.type.tensor_type for o in sub.graph.output}
    assert outputs["s"].elem_type == TensorProto.FLOAT and len(outputs["s"].shape.dim) == 0


def _split_by_a_long_constant(rewritten: bool, steps: int = 100) -> onnx.ModelProto:
    """A Constant ``[1] * steps`` read by the changed node's cone (``m = x * Unsqueeze(Cast(C))``, was a
    Concat) and then, a wave later, by a Split as its sizes; the Split's first part is added to a [1, 5]
    weight. The rewritten ``m`` has 2 columns where the input's had 5: onnxruntime and the checker refuse the
    Add in the rewritten model only, and only their reading of C's 100 entries tells them so."""
    mk, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [mk("Constant", [], ["C"], value=numpy_helper.from_array(np.ones(steps, np.int64), "C")),
             mk("Cast", ["C"], ["Cf"], to=TensorProto.FLOAT), mk("Unsqueeze", ["Cf", "one"], ["Cu"]),
             mk("Mul", ["x", "Cu"], ["m"]) if rewritten else mk("Concat", ["x", "y"], ["m"], axis=1),
             mk("Split", ["m", "C"], [f"o{i}" for i in range(steps)], axis=0), mk("Add", ["o0", "B"], ["z"])]
    nodes += [mk("Relu", ["p" if i == 0 else f"p{i - 1}"], [f"p{i}"]) for i in range(14)]
    weights = [numpy_helper.from_array(np.array([1], np.int64), "one"), numpy_helper.from_array(np.zeros((1, 5), np.float32), "B")]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [steps, 2]), vi("y", TensorProto.FLOAT, [steps, 3]),
                                       vi("p", TensorProto.FLOAT, [3])],
                          [vi("z", TensorProto.FLOAT, ["a", "b"]), vi("p13", TensorProto.FLOAT, [3])], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_long_constant_a_split_reads_is_not_cut_at(monkeypatch):
    """A vector of any length computed at load time (here a Constant of 100 entries, a Split's sizes) is
    walked through, never declared as a cone's or the region's typed input: inference reads its contents,
    and the Add the rewrite broke is found. (A 64-entry limit on what counts as such let a later wave's cone
    stop at C, typed by the first, and the region passed.)"""
    monkeypatch.setattr(region, "SCOPED_NODES", 10)
    after, before = _split_by_a_long_constant(True), _split_by_a_long_constant(False)
    sub = region.region_model(after, before)
    assert sub is not None and "Add" in [n.op_type for n in sub.graph.node]
    assert "C" not in {i.name for i in sub.graph.input}
    assert "Incompatible dimensions" in (guard.harm(after, lambda: before) or "")
    assert guard.harm(_split_by_a_long_constant(False), lambda: before) is None


def test_an_initializer_named_twice_is_a_wiring_fault(monkeypatch):
    """A rewrite adding a second initializer of a name the input has: the checker refuses the model, so the
    region (which copies one of them) does not judge it; the whole model's checks do."""
    monkeypatch.setattr(region, "SCOPED_NODES", 10)
    mk, vi = helper.make_node, helper.make_tensor_value_info

    def model(weights):
        nodes = [mk("Relu", ["w"], ["wr"]), mk("ReduceSum", ["wr"], ["s"], keepdims=0), mk("Neg", ["s"], ["z"])]
        nodes += [mk("Relu", ["p" if i == 0 else f"p{i - 1}"], [f"p{i}"]) for i in range(14)]
        g = helper.make_graph(nodes, "g", [vi("p", TensorProto.FLOAT, [3])],
                              [vi("z", TensorProto.FLOAT, []), vi("p13", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(np.zeros(shape, np.float32), "w") for shape in weights])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    before = model([(2, 3)])
    for added in [(2, 5), (2, 3)]:
        after = model([added, (2, 3)])
        assert region.NodeScan(after).fault == "two initializers are named 'w'"
        assert "not unique" in (guard.harm(after, lambda: before) or "")
    assert region.NodeScan(before).fault is None and guard.harm(model([(2, 3)]), lambda: before) is None


@pytest.mark.parametrize("elem_type, dims, carries", [
    (TensorProto.INT64, [100], True),  # (a Split's sizes, one a step)
    (TensorProto.BOOL, [1000], True),
    (TensorProto.FLOAT, [64], True),  # (a Shape's entries cast to float)
    (TensorProto.FLOAT, [65], False),  # (a bias: no inference reads a float vector that long)
    (TensorProto.INT64, ["T"], True),
    (TensorProto.INT64, [2, 3], True),
    (TensorProto.INT64, [2, 100], False),
    (TensorProto.INT64, ["B", 3], False),
    (TensorProto.INT64, None, True),
    (TensorProto.STRING, [2], False),
])
def test_which_types_may_hold_contents_inference_reads(elem_type, dims, carries):
    from rnnfuse.tensor_types import may_carry_shape_values

    t = helper.make_tensor_type_proto(elem_type, dims)
    assert may_carry_shape_values(t.SerializeToString()) is carries


def test_a_skeleton_of_a_node_with_subgraphs_calls_the_same_function_overload():
    """A node holding a subgraph keeps the function overload it calls in its skeleton: without it, inference of
    the skeleton would resolve the call to another overload of the same function (or to none)."""
    from rnnfuse.tensor_types import copy_node_skeleton
    body = helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "body", [],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    n = helper.make_node("Apply", ["a"], ["c"], domain="local", body=body)
    n.overload = "v2"
    m = onnx.NodeProto()
    copy_node_skeleton(n, m, 0)
    assert (m.domain, m.op_type, m.overload) == ("local", "Apply", "v2")
    assert [nn.op_type for nn in m.attribute[0].g.node] == ["Identity"]
