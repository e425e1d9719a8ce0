"""Element types and ranks read off the ops (no inference): exact where they answer, and what lets a model too
big to infer whole answer the chain search's type filters without a cone inference each."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
import rnnfuse.cone_types as cone_types
from rnnfuse.dataflow import settled_rank
from rnnfuse.elem_types import op_elem_type
from rnnfuse.graph import Model
from rnnfuse.tensor_types import CHEAP_INFERENCE_NODES

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from graphs import unbind_stack_model  # (the benchmark's generator, at a test's size)
finally:
    sys.path.remove(BENCHMARKS)

F, I64, B, F16 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16


def _typed_ops_model() -> onnx.ModelProto:
    """One node of each kind of rule over float, float16, int64 and bool inputs, none of its values declared."""
    n = helper.make_node
    nodes = [
        n("Add", ["x", "x"], ["add"]), n("Tanh", ["add"], ["tanh"]), n("MatMul", ["tanh", "w"], ["mm"]),
        n("Transpose", ["mm"], ["tr"], perm=[1, 0, 2]), n("Split", ["tr", "two"], ["s0", "s1"], axis=0),
        n("Concat", ["s1", "s0"], ["cat"], axis=0), n("Gather", ["cat", "idx"], ["row"], axis=0),
        n("ReduceMean", ["row"], ["mean"], axes=[1]), n("Neg", ["h"], ["neg16"]), n("Relu", ["neg16"], ["relu16"]),
        n("Greater", ["x", "zero"], ["gt"]), n("Not", ["gt"], ["not"]), n("And", ["not", "m"], ["and"]),
        n("Where", ["and", "tanh", "x"], ["where"]), n("Cast", ["and"], ["as_float"], to=F),
        n("CastLike", ["t", "h"], ["like16"]),
        n("Shape", ["x"], ["shape"]), n("Mul", ["t", "t"], ["tok2"]), n("Size", ["x"], ["size"]),
        n("ConstantOfShape", ["shape"], ["zeros"]),
        n("ConstantOfShape", ["shape"], ["ones_i"], value=numpy_helper.from_array(np.array([1], np.int64))),
        n("Constant", [], ["ci"], value_int=3), n("Constant", [], ["cf"], value_floats=[1.0, 2.0]),
        n("Constant", [], ["ct"], value=numpy_helper.from_array(np.array([True]))),
        n("Unsqueeze", ["ci", "ax0"], ["ci1"]), n("Equal", ["tok2", "ci1"], ["eq"]),
        n("Reshape", ["tok2", "flat"], ["tok_flat"]), n("ArgMax", ["x"], ["arg"], axis=2),
    ]
    inits = [numpy_helper.from_array(np.ones((4, 5), np.float32), "w"), numpy_helper.from_array(np.array([1, 2], np.int64), "two"),
             numpy_helper.from_array(np.array(0, np.int64), "idx"), numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0"), numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    inputs = [helper.make_tensor_value_info("x", F, [2, 3, 4]), helper.make_tensor_value_info("h", F16, [3, 8]),
              helper.make_tensor_value_info("t", I64, [3, 2]), helper.make_tensor_value_info("m", B, [2, 3, 4])]
    outs = [o for node in nodes for o in node.output]
    graph = helper.make_graph(nodes, "types", inputs, [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_op_elem_type_is_exact_where_it_answers():
    """Every value of the model gets an element type from its ops (none is declared), and it is the one shape
    inference gives."""
    model = _typed_ops_model()
    g = _walked(model)
    got = {o: op_elem_type(g, o) for node in model.graph.node for o in node.output}
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    want = {v.name: v.type.tensor_type.elem_type for v in list(inferred.value_info) + list(inferred.output)}
    assert None not in got.values(), got
    assert got == {o: want[o] for o in got}
    assert got["gt"] == B and got["shape"] == I64 and got["like16"] == F16 and got["zeros"] == F and got["ones_i"] == I64


def _walked(model: onnx.ModelProto):
    """The main graph of ``model`` as a model too big to infer whole sees it: no type but the declared ones
    (what the walk reads is then its own rules, not a whole-model inference's answers)."""
    m = Model(model)
    m._may_infer = False
    return m.graph


def test_op_elem_type_gives_none_where_the_ops_do_not_say():
    """An op with no rule (TopK: values of the data's type, indices int64), and what is computed from it or
    from an untyped input, are not typed by the walk."""
    n = helper.make_node
    nodes = [n("TopK", ["x", "k"], ["vals", "inds"], axis=0), n("Relu", ["inds"], ["r"]), n("Add", ["unknown", "x"], ["a"])]
    graph = helper.make_graph(nodes, "open", [helper.make_tensor_value_info("x", F, [4]), helper.make_tensor_value_info("k", I64, [1]),
                                              helper.make_tensor_value_info("unknown", TensorProto.UNDEFINED, None)],
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in ("vals", "r", "a")])
    g = _walked(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [op_elem_type(g, o) for o in ("vals", "inds", "r", "a")] == [None, None, None, None]


def test_settled_rank_reads_a_split():
    model = _typed_ops_model()
    g = _walked(model)
    assert settled_rank(g, "s0") == settled_rank(g, "s1") == 3 and settled_rank(g, "cat") == 3


def test_a_big_model_types_its_step_sources_without_inference(monkeypatch):
    """A model too big to infer whole (unbind / stack blocks: Split, Squeeze, MatMul, Relu, Unsqueeze, Concat)
    asks the rank and element type of every block's source; the ops say both, so no cone is inferred (each
    was inferred before, block after block), and the model comes out as it went in."""
    inferred = []
    infer = cone_types.ConeTypes._infer

    def counted(self, cone):
        inferred.append(len(cone))
        return infer(self, cone)

    monkeypatch.setattr(cone_types.ConeTypes, "_infer", counted)
    model = unbind_stack_model(CHEAP_INFERENCE_NODES // 60, 16)
    assert len(model.graph.node) >= CHEAP_INFERENCE_NODES
    out, report = rnnfuse.optimize(model)
    assert not inferred, inferred
    assert not report.findings and out.SerializeToString() == model.SerializeToString()


def _in_elem_type(model: onnx.ModelProto, et: int) -> onnx.ModelProto:
    """``model`` (float32 throughout) computing in ``et`` instead: its float tensors, declarations, constants
    and casts to float, at every depth."""
    np_type = helper.tensor_dtype_to_np_dtype(et)
    out = onnx.ModelProto()
    out.CopyFrom(model)

    def tensor(t: TensorProto) -> TensorProto:
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np_type), t.name) if t.data_type == F else t

    def graph(g: onnx.GraphProto) -> None:
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(tensor(t))
        for v in [*g.input, *g.output, *g.value_info]:
            if v.type.tensor_type.elem_type == F:
                v.type.tensor_type.elem_type = et
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    a.t.CopyFrom(tensor(a.t))
                elif a.name == "to" and n.op_type == "Cast" and a.i == F:
                    a.i = et
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)
            if n.op_type == "Constant" and any(a.name == "value_float" for a in n.attribute):
                v = helper.get_attribute_value(n.attribute[0])
                del n.attribute[:]
                n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.array(v, np_type))))

    graph(out.graph)
    return out


@pytest.mark.parametrize("front", ["loop", "scan", "chain"])
@pytest.mark.parametrize("et", [F16, TensorProto.DOUBLE])
def test_a_recurrence_in_float16_or_double_is_declined_and_left_as_it_was(front, et):
    """The native ops are built with float32 weights, fills and states: a float16 or double recurrence is
    declined with that reason (its op bound X and W to two element types and did not load; where the original
    did not load in onnxruntime either, the rewrite was taken unvalidated), and the model comes out unchanged.
    The same recurrence in float32 fuses."""
    from builders import Opts, build

    base, _ = build(Opts(op="GRU", front=front, static_T=4 if front == "chain" else None))
    assert rnnfuse.optimize(base)[1].fused
    model = _in_elem_type(base, et)
    onnx.checker.check_model(model, full_check=True)
    out, report = rnnfuse.optimize(model)
    reasons = [f.reason for f in report.declined]
    name = TensorProto.DataType.Name(et).lower()
    assert not report.fused and reasons and all(f"computes in {name}" in r for r in reasons), reasons
    assert out.SerializeToString() == model.SerializeToString()
