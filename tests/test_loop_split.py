"""Loops stepping two recurrences that never read each other (passes/loop_split.py): split into one Loop each,
fused, and a forward and a backward part merged; what does not split, or splits into parts none of which fuses,
is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_close, op_counts, session

import rnnfuse

F, H = 3, 4


def _weights(seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 0.5).astype(np.float32) for s in ((F, H), (H, H), (H,))]


def _cell(tag: str, xt: str, h: str, act: str = "Tanh", extra: str | None = None) -> list:
    """``h_{tag}n = act(xt @ W{tag} + (h [+ extra]) @ R{tag} + b{tag})``."""
    nodes = []
    if extra is not None:  # (the state read with another recurrence's: one recurrence then)
        nodes.append(helper.make_node("Add", [h, extra], [f"{h}_sum"]))
        h = f"{h}_sum"
    return nodes + [helper.make_node("MatMul", [xt, f"W{tag}"], [f"xw{tag}"]),
                    helper.make_node("MatMul", [h, f"R{tag}"], [f"hr{tag}"]),
                    helper.make_node("Add", [f"xw{tag}", f"hr{tag}"], [f"s{tag}"]),
                    helper.make_node("Add", [f"s{tag}", f"b{tag}"], [f"z{tag}"]),
                    helper.make_node(act, [f"z{tag}"], [f"h{tag}n"])]


def build(form: str, act: str = "Tanh", act_b: str | None = None) -> onnx.ModelProto:
    """A Loop over x's T steps carrying a forward state (x[i]) and a backward one (x[T - 1 - i]), each a tanh
    RNN cell, emitting both per step (the backward one in iteration order). Forms: ``bidir``; ``carried``
    (jax: the forward weight W carried through unchanged, and a counter k = k + 1 the forward step reads x
    by, both shared); near misses: ``coupled`` (the backward cell reads hf too), ``cond_reads_state`` (the
    condition stops on the forward state)."""
    (Wf, Rf, bf), (Wb, Rb, bb) = _weights(1), _weights(2)
    inits = [numpy_helper.from_array(v, n) for v, n in ((Wf, "Wf"), (Rf, "Rf"), (bf, "bf"), (Wb, "Wb"), (Rb, "Rb"),
                                                          (bb, "bb"))]
    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(True), "true"),
              numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1"),
              numpy_helper.from_array(np.array([H], np.int64), "iH"), numpy_helper.from_array(np.array(0, np.int64), "k0")]
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["T1"], axis=0),
             helper.make_node("Squeeze", ["T1", "i0"], ["T"]), helper.make_node("Gather", ["xs", "i1"], ["B1"], axis=0),
             helper.make_node("Concat", ["B1", "iH"], ["hshape"], axis=0),
             helper.make_node("Expand", ["zero", "hshape"], ["h0"])]
    body_inits = [numpy_helper.from_array(np.array(1, np.int64), "one"),
                  numpy_helper.from_array(np.array(100.0, np.float32), "big")]
    carried = form == "carried"
    step = "k" if carried else "it"
    bn = [helper.make_node("Gather", ["x", step], ["xf"], axis=0),
          helper.make_node("Sub", ["T", "it"], ["Tmi"]), helper.make_node("Sub", ["Tmi", "one"], ["j"]),
          helper.make_node("Gather", ["x", "j"], ["xb"], axis=0)]
    if carried:
        bn.append(helper.make_node("Add", ["k", "one"], ["kn"]))
    bn += _cell("f", "xf", "hf", act) + _cell("b", "xb", "hb", act_b or act, extra="hf" if form == "coupled" else None)
    if carried:  # (the forward cell's W read from the carried copy)
        bn[[n.output[0] for n in bn].index("xwf")].input[1] = "Wc"
    if form == "cond_reads_state":
        bn += [helper.make_node("ReduceMax", ["hfn"], ["hmax"], keepdims=0),
               helper.make_node("Less", ["hmax", "big"], ["cond_out"])]
    else:
        bn.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
    bn += [helper.make_node("Identity", ["hfn"], ["yf"]), helper.make_node("Identity", ["hbn"], ["yb"])]
    state = [helper.make_tensor_value_info("hf", TensorProto.FLOAT, [None, H]),
             helper.make_tensor_value_info("hb", TensorProto.FLOAT, [None, H])]
    state_out = [helper.make_tensor_value_info("hfn", TensorProto.FLOAT, [None, H]),
                 helper.make_tensor_value_info("hbn", TensorProto.FLOAT, [None, H])]
    inits_in, finals = ["h0", "h0"], ["hf_last", "hb_last"]
    if carried:  # (the weight first, the counter last: the states between them)
        state = [helper.make_tensor_value_info("Wc", TensorProto.FLOAT, [F, H])] + state + [
            helper.make_tensor_value_info("k", TensorProto.INT64, [])]
        state_out = [helper.make_tensor_value_info("Wc", TensorProto.FLOAT, [F, H])] + state_out + [
            helper.make_tensor_value_info("kn", TensorProto.INT64, [])]
        inits_in, finals = ["Wf"] + inits_in + ["k0"], ["W_last"] + finals + ["k_last"]
    body = helper.make_graph(
        bn, "body",
        [helper.make_tensor_value_info("it", TensorProto.INT64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])] + state,
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])] + state_out +
        [helper.make_tensor_value_info("yf", TensorProto.FLOAT, [None, H]),
         helper.make_tensor_value_info("yb", TensorProto.FLOAT, [None, H])], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true"] + inits_in, finals + ["ys_f", "ys_b"], body=body, name="loop"))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", "B", H]) for n in ("ys_f", "ys_b")]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", H]) for n in ("hf_last", "hb_last")]
    if carried:
        outputs.append(helper.make_tensor_value_info("k_last", TensorProto.INT64, []))
    graph = helper.make_graph(nodes, "two_recurrences", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def reference(x: np.ndarray) -> list[np.ndarray]:
    """ys_f, ys_b (iteration order), hf_last, hb_last of the ``bidir`` and ``carried`` forms."""
    (Wf, Rf, bf), (Wb, Rb, bb) = _weights(1), _weights(2)
    T, B = x.shape[:2]
    hf = hb = np.zeros((B, H), np.float32)
    yf, yb = [], []
    for i in range(T):
        hf = np.tanh(x[i] @ Wf + hf @ Rf + bf)
        hb = np.tanh(x[T - 1 - i] @ Wb + hb @ Rb + bb)
        yf.append(hf)
        yb.append(hb)
    return [np.stack(yf) if T else np.zeros((0, B, H), np.float32), np.stack(yb) if T else np.zeros((0, B, H), np.float32), hf, hb]


@pytest.mark.parametrize("form", ["bidir", "carried"])
def test_two_recurrences_in_one_loop_split_and_fused(form):
    """Each part is one recurrence; the forward and the backward one become one bidirectional RNN."""
    model = build(form)
    fused, report = rnnfuse.optimize(model)
    assert len([f for f in report.fused if f.front == "Loop"]) == 2 and not report.declined, report.to_text()
    left = op_counts(fused)
    assert left.get("Loop", 0) == 0 and left.get("RNN") == 1 and left.get("MatMul", 0) == 0, (left, report.to_text())
    rnn = next(n for n in fused.graph.node if n.op_type == "RNN")
    assert helper.get_attribute_value(next(a for a in rnn.attribute if a.name == "direction")) == b"bidirectional"
    s_orig, s_fused = session(model), session(fused)
    rng = np.random.default_rng(3)
    for T, B in ((1, 1), (6, 3), (9, 2)):
        x = rng.standard_normal((T, B, F)).astype(np.float32)
        want = reference(x) + ([np.array(T, np.int64)] if form == "carried" else [])
        got, orig = s_fused.run(None, {"x": x}), s_orig.run(None, {"x": x})
        for k, w in enumerate(want):
            assert_close(orig[k], w, f"{form}/{k}: original vs numpy")
            assert_close(got[k], w, f"{form}/{k}: fused vs numpy")


@pytest.mark.parametrize("form,reason", [("coupled", "orders"), ("cond_reads_state", "")])
def test_dependent_recurrences_not_split(form, reason):
    """One recurrence reading x both ways, or a condition every part would need: declined, left as it was."""
    model = build(form)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined and reason in report.declined[0].reason, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def _beside(other: onnx.ModelProto, prefixed: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """Two models side by side in one graph, each with its own inputs, the second's names prefixed."""
    renamed = onnx.compose.add_prefix(prefixed, prefix)
    graph = helper.make_graph(list(other.graph.node) + list(renamed.graph.node), "both",
                              list(other.graph.input) + list(renamed.graph.input),
                              list(other.graph.output) + list(renamed.graph.output),
                              list(other.graph.initializer) + list(renamed.graph.initializer))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _same_outputs(model: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    rng = np.random.default_rng(4)
    feeds = {i.name: rng.standard_normal((5, 2, F)).astype(np.float32) for i in model.graph.input}
    for a, b in zip(session(model).run(None, feeds), session(fused).run(None, feeds)):
        assert_close(b, a, "the original model vs the fused one")


@pytest.mark.parametrize("act,options", [("Sin", {}), ("HardSigmoid", {"portable": True})])
def test_parts_that_do_not_fuse_are_put_back(act, options):
    """A Loop that splits into two parts none of which is fused, in a model where another Loop fuses: the
    first Loop is left as it was, one node. Sin: no part is a native cell; HardSigmoid with ``portable``: each
    part is one, declined only when applied (OpenVINO compiles no HardSigmoid RNN)."""
    model = _beside(build("bidir"), build("bidir", act=act), "other_")
    fused, report = rnnfuse.optimize(model, **options)
    assert len([f for f in report.fused if f.front == "Loop"]) == 2 and report.declined, report.to_text()
    loops = [n for n in fused.graph.node if n.op_type == "Loop"]
    want = next(n for n in model.graph.node if n.op_type == "Loop" and n.name.startswith("other_"))
    assert len(loops) == 1 and loops[0].SerializeToString() == want.SerializeToString(), report.to_text()
    _same_outputs(model, fused)


def test_part_names_are_fresh():
    """A node already named as a part would be (``loop/part1``), the part left a Loop (a Sin cell): the part
    takes another name, so the model still loads and the other parts stay fused."""
    model = build("bidir", act_b="Sin")
    model.graph.node.append(helper.make_node("Identity", ["x"], ["x_copy"], name="loop/part1"))  # (stays: read)
    model.graph.output.append(helper.make_tensor_value_info("x_copy", TensorProto.FLOAT, ["T", "B", F]))
    model = _beside(model, build("bidir"), "other_")
    fused, report = rnnfuse.optimize(model)
    assert len([f for f in report.fused if f.front == "Loop"]) == 3, report.to_text()
    assert [n.op_type for n in fused.graph.node].count("Loop") == 1
    names = [n.name for n in fused.graph.node if n.name]
    assert len(names) == len(set(names))
    _same_outputs(model, fused)


def test_trip_count_named_like_another_axis_of_x():
    """x declared [N, N, F] and a Loop running x.shape[1] times over x's rows: the same name on two axes of x
    is no proof that the loop runs once per time step (onnxruntime runs T != B). The loop's forward half reads
    x[i] with a Gather, so it runs over x's first B steps whatever T is (a runtime trip count: past x's end the
    original fails): fused so. The reversed half reads x[B - 1 - i], which is x read backwards only where
    B = T: declined, kept as a Loop. The outputs are the original's at B = T and at B < T."""
    model = build("bidir")
    x = model.graph.input[0].type.tensor_type.shape.dim
    x[0].dim_param = x[1].dim_param = "N"
    body = next(a.g for a in model.graph.node[-1].attribute if a.name == "body")
    body.node[1].input[0] = "T"  # (the reversed read counts the same T)
    t_node = next(n for n in model.graph.node if n.output[0] == "T1")
    t_node.input[1] = "i1"  # T is x.shape[1] now
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and len(report.declined) == 1, report.to_text()
    assert "trip count" in report.declined[0].reason, report.to_text()
    assert op_counts(fused)["Loop"] == 1 and op_counts(fused)["RNN"] == 1
    rng = np.random.default_rng(1)
    for T, B in ((5, 5), (6, 3), (4, 1)):
        feeds = {"x": rng.standard_normal((T, B, F)).astype(np.float32)}
        for a, b in zip(session(model).run(None, feeds), session(fused).run(None, feeds)):
            assert a.shape == b.shape
            assert_close(b, a, f"T={T}, B={B}")
