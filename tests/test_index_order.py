"""Index vectors read as 0 .. n-1 or n-1 .. 0 from how they are computed (rnnfuse/index_order.py), and the
Gathers they make no-ops (DropNoOps) or time flips; near misses are not read."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import session

from rnnfuse.model import Model
from rnnfuse.index_order import arithmetic_run, in_order, reversed_order
from rnnfuse.time_flips import time_flip_source
from rnnfuse.passes.cleanup import DropNoOps
from rnnfuse.findings import Options

F = 3


def _consts():
    vals = {"zero": 0, "one": 1, "two": 2, "minus_one": -1}
    out = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in vals.items()]
    return out + [numpy_helper.from_array(np.array([0], np.int64), "ax0"), numpy_helper.from_array(np.array([1], np.int64), "c1"),
                  numpy_helper.from_array(np.array([-1], np.int64), "flat")]


def _index_nodes(form: str) -> list:
    """Nodes computing ``idx`` from T = x.shape[0] (scalar ``T``): forms read as in order (``up_*``),
    reversed (``down_*``) or not read (``miss_*``)."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "zero"], ["T"], axis=0),
             helper.make_node("Range", ["zero", "T", "one"], ["iota"])]
    if form == "up_range":
        nodes.append(helper.make_node("Identity", ["iota"], ["idx"]))
    elif form in ("up_jax", "miss_jax_other_shape"):  # jax2onnx: ((T-1) + -1 * iota) reversed by a Gather, broadcast, flat
        nodes += [helper.make_node("Cast", ["iota"], ["iota_i32"], to=TensorProto.INT32),
                  helper.make_node("Cast", ["iota_i32"], ["iota64"], to=TensorProto.INT64),
                  helper.make_node("Mul", ["minus_one", "iota64"], ["neg"]),
                  helper.make_node("Sub", ["T", "one"], ["last"]),
                  helper.make_node("Add", ["last", "neg"], ["down"]),
                  helper.make_node("Shape", ["down"], ["ds"]), helper.make_node("Gather", ["ds", "zero"], ["n"], axis=0),
                  helper.make_node("Sub", ["n", "one"], ["nl"]), helper.make_node("Range", ["zero", "n", "one"], ["r"]),
                  helper.make_node("Sub", ["nl", "r"], ["rev"]),
                  helper.make_node("Gather", ["down", "rev"], ["up"], axis=0),
                  helper.make_node("Shape", ["up"], ["us"]), helper.make_node("Gather", ["us", "ax0"], ["n1"], axis=0),
                  helper.make_node("Concat", ["n1", "c1"], ["s1"], axis=0),
                  helper.make_node("Concat", ["n1", "c1" if form == "up_jax" else "n1"], ["s2"], axis=0),
                  helper.make_node("Reshape", ["up", "s1"], ["col"]), helper.make_node("Expand", ["col", "s2"], ["wide"]),
                  helper.make_node("Reshape", ["wide", "flat"], ["idx"])]
    elif form == "down_sub":  # (T - 1) - iota, written (T - iota) - 1
        nodes += [helper.make_node("Sub", ["T", "iota"], ["tm"]), helper.make_node("Sub", ["tm", "one"], ["idx"])]
    elif form == "miss_step2":
        nodes[-1] = helper.make_node("Range", ["zero", "T", "two"], ["idx"])
    elif form == "miss_from1":
        nodes[-1] = helper.make_node("Range", ["one", "T", "one"], ["iota1"])
        nodes.append(helper.make_node("Sub", ["iota1", "one"], ["idx0"]))  # 0 .. T-2: one short
        nodes.append(helper.make_node("Identity", ["idx0"], ["idx"]))
    elif form == "miss_column":  # in order, but [T, 1]: the Gather adds an axis
        nodes += [helper.make_node("Unsqueeze", ["iota", "c1"], ["idx"])]
    elif form == "miss_off_by_one":  # (T - 2) - iota
        nodes += [helper.make_node("Sub", ["T", "two"], ["t2"]), helper.make_node("Sub", ["t2", "iota"], ["idx"])]
    return nodes


def _model(form: str) -> onnx.ModelProto:
    nodes = _index_nodes(form) + [helper.make_node("Gather", ["x", "idx"], ["rows"], axis=0),
                                  helper.make_node("Neg", ["rows"], ["y"])]
    graph = helper.make_graph(nodes, "index", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1, None, F] if form == "miss_column"
                                                             else [None, None, F])], _consts())
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("form,order", [("up_range", "up"), ("up_jax", "up"), ("down_sub", "down"),
                                        ("miss_step2", None), ("miss_from1", None), ("miss_column", "up"),
                                        ("miss_off_by_one", None), ("miss_jax_other_shape", None)])
def test_index_orders(form, order):
    """What each index vector is read as; the model's own values agree (x's rows gathered, T of 1 and 5)."""
    model = _model(form)
    g = Model(onnx.ModelProto.FromString(model.SerializeToString())).graph
    up, down = in_order(g, "idx"), reversed_order(g, "idx")
    assert ("up" if up else "down" if down else None) == order, arithmetic_run(g, "idx")
    sess = session(model)
    for T in (1, 5):
        x = np.random.default_rng(T).standard_normal((T, 2, F)).astype(np.float32)
        try:
            y = sess.run(None, {"x": x})[0]
        except Exception:
            assert order is None  # (a near miss may index past the end)
            continue
        if order == "up" and form != "miss_column":
            np.testing.assert_array_equal(y, -x)
        if order == "down":
            np.testing.assert_array_equal(y, -x[::-1])


@pytest.mark.parametrize("form,dropped", [("up_range", True), ("up_jax", True), ("miss_column", False),
                                          ("miss_from1", False), ("miss_jax_other_shape", False)])
def test_gather_of_every_row_in_order_is_read_through(form, dropped):
    """DropNoOps reads a Gather of 0 .. T-1 along x's rows as x itself; not a [T, 1] index or a short one."""
    model = Model(_model(form))
    DropNoOps().run(model, Options())
    gathers = [n for n in model.graph.live_nodes() if n.op_type == "Gather" and n.input[0] == "x"]
    assert (not gathers) == dropped


def test_reversed_iota_is_a_time_flip():
    """(T - i) - 1 over i = 0 .. T-1 gathers x's rows backwards: a time flip of x."""
    g = Model(_model("down_sub")).graph
    assert time_flip_source(g, "rows", 0) == "x"
    g = Model(_model("miss_off_by_one")).graph
    assert time_flip_source(g, "rows", 0) is None


def test_rows_reordered_are_no_reversed_run():
    """0 .. n-1 viewed [n/2, 2] and its rows gathered backwards: 4, 5, 2, 3, 0, 1 for n = 6, no run (a rank-1
    Gather of the same values would be 5 .. 0)."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "zero"], ["n"], axis=0),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Reshape", ["r", "pairs"], ["v"]),
             helper.make_node("Shape", ["v"], ["vs"]), helper.make_node("Gather", ["vs", "zero"], ["m"], axis=0),
             helper.make_node("Sub", ["m", "one"], ["m1"]),
             helper.make_node("Range", ["m1", "minus_one", "minus_one"], ["back"]),
             helper.make_node("Gather", ["v", "back"], ["w"], axis=0),
             helper.make_node("Reshape", ["w", "flat"], ["idx"])]
    inits = _consts() + [numpy_helper.from_array(np.array([-1, 2], np.int64), "pairs")]
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, [None])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    so = ort.SessionOptions()  # (onnxruntime 1.32's graph optimizations make this model return [])
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": np.zeros(6, np.float32)})[0]
    assert got.tolist() == [4, 5, 2, 3, 0, 1]
    g = Model(model).graph
    assert reversed_order(g, "idx") is None and in_order(g, "idx") is None


def _graph_model(nodes, inputs, outputs, inits, value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, _consts() + inits, value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_shape_range_read_as_its_own_axes():
    """``Gather(Shape(p, end=1), -1)`` is p's dim 0 (not its last), ``Gather(Shape(p, start=-1), 0)`` its last
    (not its first), whether p's rank is known or not (then: not read)."""
    from rnnfuse.dims import dim_key
    nodes = [helper.make_node("Shape", ["p"], ["s_end"], end=1), helper.make_node("Gather", ["s_end", "minus_one"], ["a"], axis=0),
             helper.make_node("Shape", ["p"], ["s_start"], start=-1), helper.make_node("Gather", ["s_start", "zero"], ["b"], axis=0),
             helper.make_node("Reshape", ["pin", "shp"], ["q"]),
             helper.make_node("Shape", ["q"], ["q_start"], start=-1), helper.make_node("Gather", ["q_start", "zero"], ["c"], axis=0)]
    model = _graph_model(nodes, [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["A", "B", "C"]),
                                 helper.make_tensor_value_info("pin", TensorProto.FLOAT, [None]),
                                 helper.make_tensor_value_info("shp", TensorProto.INT64, [None])],
                         [helper.make_tensor_value_info(k, TensorProto.INT64, []) for k in "abc"], [])
    g = Model(model).graph
    assert dim_key(g, "a") == ("dim", "p", 0) and dim_key(g, "b") == ("dim", "p", 2) and dim_key(g, "c") is None


def test_runs_not_read_where_a_size_could_round_or_copy():
    """A float Range cast back (float rounds past 2**24) and an Expand to [B - 1, 1] beside a Reshape to it
    (a 0 there is copied by the Reshape, not by the Expand) are no runs."""
    nodes = _index_nodes("up_range") + [
        helper.make_node("Cast", ["T"], ["Tf"], to=TensorProto.FLOAT),
        helper.make_node("Range", ["zf", "Tf", "of"], ["rf"]), helper.make_node("Cast", ["rf"], ["float_idx"], to=TensorProto.INT64),
        helper.make_node("Gather", ["xs", "one"], ["B"], axis=0), helper.make_node("Sub", ["B", "one"], ["B1"]),
        helper.make_node("Unsqueeze", ["B1", "ax0"], ["B1v"]), helper.make_node("Concat", ["B1v", "c1"], ["s"], axis=0),
        helper.make_node("Reshape", ["iota", "s"], ["col"]), helper.make_node("Expand", ["col", "s"], ["wide"]),
        helper.make_node("Reshape", ["wide", "flat"], ["expand_idx"])]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zf"), numpy_helper.from_array(np.array(1.0, np.float32), "of")]
    model = _graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                         [helper.make_tensor_value_info(k, TensorProto.INT64, [None]) for k in ("float_idx", "expand_idx")], inits)
    g = Model(model).graph
    assert arithmetic_run(g, "float_idx") is None and arithmetic_run(g, "expand_idx") is None


def test_a_stale_declared_extent_is_not_trusted():
    """q = Relu(x) declared [4, B, F] while x is [T, B, F]: a Gather of q's rows 0 .. 3 is kept (at T = 6 it
    takes four of six rows)."""
    nodes = [helper.make_node("Relu", ["x"], ["q"]), helper.make_node("Gather", ["q", "four"], ["rows"], axis=0),
             helper.make_node("Neg", ["rows"], ["y"])]
    model = _graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, None, F])],
                         [numpy_helper.from_array(np.arange(4, dtype=np.int64), "four")],
                         [helper.make_tensor_value_info("q", TensorProto.FLOAT, [4, None, F])])
    m = Model(model)
    DropNoOps().run(m, Options())
    assert any(n.op_type == "Gather" for n in m.graph.live_nodes())


def test_constant_indices_ask_no_type_inference(monkeypatch):
    """Gathers by constant indices of one element (a shape's dim, a step of x) are no whole-axis reads: DropNoOps
    decides that from the constants alone, asking no type (a rank asked there inferred the whole model's types:
    0.4 s of a 6,500-node graph of Loops whose trip count is Gather(Shape(x), [0]))."""
    import rnnfuse.model as model_module
    calls = []
    real = model_module.Model.rank
    monkeypatch.setattr(model_module.Model, "rank", lambda self, name: calls.append(name) or real(self, name))
    k0, k1 = (helper.make_node("Constant", [], [f"k{v}"], value=numpy_helper.from_array(np.array([v], np.int64)))
              for v in (0, 1))  # (Constant nodes: no declared type)
    nodes = [k0, k1, helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "k0"], ["T1"], axis=0),
             helper.make_node("Gather", ["x", "zero"], ["x0"], axis=0), helper.make_node("Gather", ["x", "k1"], ["x1"], axis=0)]
    nodes += [helper.make_node("Neg", [v], [f"{v}_out"]) for v in ("T1", "x0", "x1")]  # (no Gather is an output)
    model = _graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                         [helper.make_tensor_value_info("T1_out", TensorProto.INT64, [1]),
                          helper.make_tensor_value_info("x0_out", TensorProto.FLOAT, ["B", F]),
                          helper.make_tensor_value_info("x1_out", TensorProto.FLOAT, [1, "B", F])], [])
    m = Model(model)
    DropNoOps().run(m, Options())
    assert not calls and len([n for n in m.graph.live_nodes() if n.op_type == "Gather"]) == 3
