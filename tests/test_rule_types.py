"""The float types rnnfuse works out itself (rnnfuse.rule_types) are ONNX shape inference's, and everything
else is left to inference: random elementwise graphs and matrix products compared with onnx.shape_inference,
near misses declined, and a big model's cone queries giving the same answers with the rule as with inference
alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.cone_types
import rnnfuse.model
from rnnfuse.rule_types import BINARY, UNARY, typed_by_rule
from rnnfuse.model import Model
from rnnfuse.tensor_types import declared_types, type_of

F, D, H16, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT64
_NP = {F: np.float32, D: np.float64, H16: np.float16, I64: np.int64}


def _inferred(m: onnx.ModelProto) -> dict:
    g = onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True).graph
    return {vi.name: type_of(vi) for vi in [*g.value_info, *g.output]}


def _random_model(rng, elem: int, dims: list, n: int) -> onnx.ModelProto:
    """A chain over x (type ``elem``, ``dims``) of random unary and binary ops, the second operand a constant
    (an initializer or a Constant node) of a shape that broadcasts against x's, or an earlier value."""
    nodes, inits, values = [], [], ["x"]
    for k in range(n):
        cur = values[-1]
        if rng.random() < 0.4:
            nodes.append(helper.make_node(str(rng.choice(sorted(UNARY))), [cur], [f"v{k}"]))
        else:
            op = str(rng.choice(sorted(BINARY)))
            r = int(rng.integers(0, len(dims) + 2))  # (one more than x's rank: a leading axis broadcast in)
            kept = dims[max(len(dims) - r, 0):]
            shape = [2] * (r - len(kept)) + [d if isinstance(d, int) and rng.random() < 0.5 else 1 for d in kept]
            arr = (rng.random(shape) + 0.5).astype(_NP[elem])
            choice = rng.random()
            if choice < 0.4:
                other = f"c{k}"
                inits.append(numpy_helper.from_array(arr, other))
            elif choice < 0.7:
                other = f"k{k}"
                nodes.append(helper.make_node("Constant", [], [other], value=numpy_helper.from_array(arr)))
            else:
                other = str(rng.choice(values))
            ins = [cur, other] if rng.random() < 0.7 else [other, cur]
            nodes.append(helper.make_node(op, ins, [f"v{k}"]))
        values.append(f"v{k}")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, dims)],
                          [helper.make_tensor_value_info(values[-1], elem, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(12))
def test_the_rule_gives_what_inference_gives(seed):
    rng = np.random.default_rng(seed)
    elem = [F, D, H16][seed % 3]
    dims = [["B", "T", 8], [4, "N"], [], [3, 1, 5], ["B", 1, "T", 2]][seed % 5]
    m = _random_model(rng, elem, dims, 40)
    declared = declared_types(m)
    typed, rest = typed_by_rule(list(m.graph.node), declared.get)
    inferred = _inferred(m)
    assert typed and not rest  # (every node of such a chain is the rule's)
    for name, t in typed.items():
        want = inferred.get(name) or declared.get(name)  # (a Constant's type is declared)
        assert want == t, (name, t, want)


@pytest.mark.parametrize("case", ["two-symbols", "number-vs-symbol", "unknown-dim", "int64", "grows-rank-unknown",
                                  "mixed-elem", "other-domain", "new-op", "unknown-rank"])
def test_near_misses_are_left_to_inference(case):
    x_type, c_shape, c_elem, op, domain = (F, ["B", 4]), [1, 4], F, "Add", ""
    y_type = None
    if case == "two-symbols":  # B against C: inference does not know they are one
        y_type = (F, ["C", 4])
    elif case == "number-vs-symbol":
        y_type = (F, [3, 4])
    elif case == "unknown-dim":  # inference names an unknown dim itself
        x_type = (F, [None, 4])
    elif case == "int64":  # shape arithmetic: inference propagates values too
        x_type, c_elem = (I64, ["B", 4]), I64
    elif case == "grows-rank-unknown":
        c_shape = [5, 1, 1]
        x_type = (F, ["B", None])
    elif case == "mixed-elem":
        c_elem = D
    elif case == "other-domain":
        domain = "my.ops"
    elif case == "new-op":  # (Gelu: ONNX's since opset 20 only)
        op = "Gelu"
    elif case == "unknown-rank":
        x_type = (F, None)
    inits = [numpy_helper.from_array(np.ones(c_shape, _NP[c_elem]), "c")]
    second = "y" if y_type is not None else "c"
    node = helper.make_node(op, ["x", second] if op != "Gelu" else ["x"], ["out"], domain=domain)
    ins = [helper.make_tensor_value_info("x", *x_type)]
    if y_type is not None:
        ins.append(helper.make_tensor_value_info("y", *y_type))
    m = helper.make_model(helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("out", F, None)], inits))
    declared = declared_types(m)
    typed, rest = typed_by_rule([node], declared.get)
    assert not typed and rest == [node]


def test_a_node_after_one_left_to_inference_is_left_too():
    # Transpose is inference's; the Add reading it cannot be typed before inference has run
    b = numpy_helper.from_array(np.ones((1,), np.float32), "b")
    nodes = [helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Tanh", ["x"], ["t"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", 4])],
                                            [helper.make_tensor_value_info("a", F, None)], [b]))
    typed, rest = typed_by_rule(list(m.graph.node), declared_types(m).get)
    assert typed == {"t": (F, ["B", 4])} and [n.op_type for n in rest] == ["Transpose", "Add"]


def _product_model(op: str, a: list, b: list, elem: int = F, **attrs) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info("a", elem, a), helper.make_tensor_value_info("b", elem, b)]
    node = helper.make_node(op, ["a", "b"], ["y"], **attrs)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _strictly_inferred(m: onnx.ModelProto):
    """The output's type strict inference gives, or "error" when it rejects the model."""
    try:
        g = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph
    except onnx.shape_inference.InferenceError:
        return "error"
    return type_of(g.output[0])


@pytest.mark.parametrize("seed", range(4))
def test_matrix_products_are_typed_as_inference_types_them(seed):
    """Random MatMul and Gemm operands (numbers, symbols, ones, ranks 1-4): where the rule answers it is
    inference's answer, and it answers wherever the operands plainly agree (K the same dim, the leading dims
    equal or 1)."""
    rng = np.random.default_rng(seed)
    pool = [1, 3, 8, "B", "T"]
    answered = 0
    for _ in range(150):
        op = "Gemm" if rng.random() < 0.3 else "MatMul"
        rank_a, rank_b = (2, 2) if op == "Gemm" else (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        a = [pool[int(rng.integers(len(pool)))] for _ in range(rank_a)]
        b = [pool[int(rng.integers(len(pool)))] for _ in range(rank_b)]
        attrs = {}
        if op == "Gemm":
            attrs = {"transA": int(rng.integers(2)), "transB": int(rng.integers(2))}
            k_at = (0 if attrs["transA"] else 1, 1 if attrs["transB"] else 0)
        else:
            k_at = (rank_a - 1, max(rank_b - 2, 0))
        if rng.random() < 0.7:  # (mostly products that agree)
            b[k_at[1]] = a[k_at[0]]
        m = _product_model(op, a, b, [F, D, H16][int(rng.integers(3))], **attrs)
        typed, rest = typed_by_rule(list(m.graph.node), declared_types(m).get)
        want = _strictly_inferred(m)
        if "y" in typed:
            answered += 1
            assert typed["y"] == want, (op, a, b, attrs, typed["y"], want)
        elif want != "error" and rank_a >= 2 and rank_b >= 2 and a[k_at[0]] == b[k_at[1]] and all(
                x == y or 1 in (x, y) for x, y in zip(a[-3::-1], b[-3::-1])):
            raise AssertionError(f"left to inference: {op} {a} {b} {attrs} -> {want}")
    assert answered >= 40


@pytest.mark.parametrize("case", ["k-differs", "k-symbol-vs-number", "rank-1", "gemm-rank-3", "mixed-elem",
                                  "gemm-trans-as-float", "lead-number-vs-symbol"])
def test_matrix_product_near_misses_are_left_to_inference(case):
    op, a, b, elem_b, attrs = "MatMul", ["B", 8], [8, 16], F, {}
    if case == "k-differs":  # (inference rejects it)
        b = [9, 16]
    elif case == "k-symbol-vs-number":
        a = ["B", "K"]
    elif case == "rank-1":
        b = [8]
    elif case == "gemm-rank-3":
        op, a = "Gemm", [2, "B", 8]
    elif case == "mixed-elem":
        elem_b = D
    elif case == "gemm-trans-as-float":
        op, attrs = "Gemm", {"transB": 1.0}
        b = [16, 8]
    elif case == "lead-number-vs-symbol":  # (inference takes the number; the rule does not guess)
        a, b = [3, "B", 8], ["T", 8, 16]
    ins = [helper.make_tensor_value_info("a", F, a), helper.make_tensor_value_info("b", elem_b, b)]
    node = helper.make_node(op, ["a", "b"], ["y"], **attrs)
    m = helper.make_model(helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", F, None)]))
    typed, rest = typed_by_rule([node], declared_types(m).get)
    assert not typed and rest == [node]


def test_a_cells_first_step_is_typed_by_the_rule():
    """tanh(x_0 @ W + h0 @ R + b) and a Gemm beside it: what each of 1,041 cells side by side had inferred."""
    inits = [numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in
             [("W", (8, 16)), ("R", (16, 16)), ("b", (16,)), ("Wt", (16, 8))]]
    nodes = [helper.make_node("MatMul", ["x0", "W"], ["xw"]), helper.make_node("MatMul", ["h0", "R"], ["hr"]),
             helper.make_node("Add", ["xw", "hr"], ["s"]), helper.make_node("Add", ["s", "b"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h"]),
             helper.make_node("Gemm", ["x0", "Wt", "b"], ["g"], transB=1, alpha=0.5)]
    ins = [helper.make_tensor_value_info("x0", F, ["B", 8]), helper.make_tensor_value_info("h0", F, ["B", 16])]
    m = helper.make_model(helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("h", F, None)], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    typed, rest = typed_by_rule(list(m.graph.node), declared_types(m).get)
    assert not rest and typed == {k: (F, ["B", 16]) for k in ("xw", "hr", "s", "a", "h", "g")}
    inferred = _inferred(m)
    assert all(inferred[k] == t for k, t in typed.items() if k in inferred)


def _prologue_model(n: int) -> onnx.ModelProto:
    """x * s + b repeated, then a MatMul and a Tanh: a big model's cone of rule and inference nodes."""
    nodes, prev = [], "x"
    for k in range(n):
        op = ("Mul", "Add", "Sigmoid")[k % 3]
        nodes.append(helper.make_node(op, [prev] if op == "Sigmoid" else [prev, "s" if op == "Mul" else "b"], [f"p{k}"]))
        prev = f"p{k}"
    nodes += [helper.make_node("MatMul", [prev, "w"], ["m"]), helper.make_node("Add", ["m", "b2"], ["a"]),
              helper.make_node("Reshape", ["a", "shape"], ["r"]), helper.make_node("Tanh", ["r"], ["y"]),
              # a float Constant made a shape by a Cast: were its value propagated, only inference could say so
              helper.make_node("Constant", [], ["fshape"], value=numpy_helper.from_array(np.array([0, 0, 5], np.float32))),
              helper.make_node("Mul", ["fshape", "s"], ["fshape2"]),
              helper.make_node("Cast", ["fshape2"], ["ishape"], to=TensorProto.INT64),
              helper.make_node("Reshape", ["a", "ishape"], ["r2"])]
    inits = [numpy_helper.from_array(np.float32(2.0).reshape(()), "s"),
             numpy_helper.from_array(np.ones((8,), np.float32), "b"),
             numpy_helper.from_array(np.ones((8, 5), np.float32), "w"),
             numpy_helper.from_array(np.ones((5,), np.float32), "b2"),
             numpy_helper.from_array(np.array([0, 0, 5], np.int64), "shape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", "T", 8])],
                          [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _named_alike(types: dict) -> dict:
    """The types with the dims inference invented (``unk__0@cone3``: named after the inference that made
    them, whose count differs when fewer run) renamed in order of first appearance."""
    names: dict[str, str] = {}
    out = {}
    for k in sorted(types):
        t = types[k]
        if t is not None and t[1] is not None:
            t = (t[0], [names.setdefault(d, f"invented{len(names)}") if isinstance(d, str) and "@cone" in d else d
                        for d in t[1]])
        out[k] = t
    return out


def test_a_big_models_cone_queries_answer_as_inference_alone_does(monkeypatch):
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view: cone inference)
    monkeypatch.setattr(rnnfuse.cone_types, "CHEAP_INFERENCE_NODES", 100)  # (pieces of 100 nodes)
    proto = _prologue_model(450)
    names = [o for n in proto.graph.node for o in n.output]
    inferred_nodes: list[int] = []
    infer = rnnfuse.cone_types.ConeTypes._infer

    def counted(self, cone):
        inferred_nodes.append(len(cone))
        return infer(self, cone)

    monkeypatch.setattr(rnnfuse.cone_types.ConeTypes, "_infer", counted)
    with_rule = Model(onnx.ModelProto.FromString(proto.SerializeToString()))
    got = {name: with_rule.known_type(name, whole_cone=True) for name in reversed(names)}
    rule_inferred = sum(inferred_nodes)
    inferred_nodes.clear()
    monkeypatch.setattr(rnnfuse.cone_types, "typed_by_rule", lambda cone, *args: ({}, list(cone)))
    alone = Model(onnx.ModelProto.FromString(proto.SerializeToString()))
    want = {name: alone.known_type(name, whole_cone=True) for name in reversed(names)}
    assert _named_alike(got) == _named_alike(want)
    assert got["p449"] == (F, ["B", "T", 8]) and got["fshape2"] == (F, [3])
    assert rule_inferred < 10 and sum(inferred_nodes) >= 450  # the prologue typed by the rule, not inferred
