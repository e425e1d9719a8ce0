"""Index terms read from a graph (rnnfuse/index_terms.py): what each spelling of index arithmetic is read as,
and where a reading must refuse (a fraction, a cast that wraps, a bool that is not the value itself).

The term algebra itself (comparisons decided by bounds, Max / Min / Where) is checked in
tests/test_loop_index.py; here the reader: sizes from shapes, casts, Concat, a Loop body's iteration number
and a size the Loop carries unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.dims import dim_key
from rnnfuse.graph import Model
from rnnfuse.index_terms import UNKNOWN, scalar_term, size_term, terms


def _init(name, v, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(v, dtype), name)


def _graph(nodes, inits):
    """x [T, B, 3] with ``n`` = T read from its shape, ``n_minus_1`` = T - 1, and ``nodes`` after them."""
    shape = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero1"], ["n1"], axis=0),
             helper.make_node("Squeeze", ["n1", "ax0"], ["n"]),
             helper.make_node("Sub", ["n", "one"], ["n_minus_1"])]
    inits = [_init("zero1", [0]), _init("ax0", [0]), _init("one", 1)] + inits
    outs = [o for n in nodes for o in n.output] or ["n_minus_1"]
    graph = helper.make_graph(shape + nodes, "terms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", 3])],
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return Model(model).graph


def test_a_size_minus_one():
    g = _graph([], [])
    T = dim_key(g, "n")
    assert T[0] == "dim"
    assert terms(g, "n_minus_1") == [("d", T, -1)] == [size_term(T, -1)]
    assert scalar_term(g, "n") == size_term(T)


CASTS = {  # a cast of T - 1 (or of a constant) -> what it reads as; None: not read
    "to int32": (TensorProto.INT32, "n_minus_1", "T-1"),
    "to float": (TensorProto.FLOAT, "n_minus_1", "T-1"),
    "to int16 (wraps past 32767)": (TensorProto.INT16, "n_minus_1", None),
    "to float16 (rounds past 2048)": (TensorProto.FLOAT16, "n_minus_1", None),
    "to uint64 (wraps -1)": (TensorProto.UINT64, "n_minus_1", None),
    "to bool of T - 1: unknown, not T - 1": (TensorProto.BOOL, "n_minus_1", [UNKNOWN]),
    "to bool of [0, 3, -2]: v != 0": (TensorProto.BOOL, "c", [("c", 0), ("c", 1), ("c", 1)]),
}


@pytest.mark.parametrize("name", list(CASTS))
def test_casts(name):
    to, src, want = CASTS[name]
    g = _graph([helper.make_node("Cast", [src], ["cast"], to=to)], [_init("c", [0, 3, -2])])
    if want == "T-1":
        want = [size_term(dim_key(g, "n"), -1)]
    assert terms(g, "cast") == want


@pytest.mark.parametrize("to, same", [(TensorProto.INT32, True), (TensorProto.DOUBLE, True), (TensorProto.INT16, False),
                                      (TensorProto.UINT8, False), (TensorProto.BOOL, False)])
def test_a_size_through_a_cast(to, same):
    """dims.dim_key: a size cast to a type that holds it is the size; a narrower cast is no size at all."""
    g = _graph([helper.make_node("Cast", ["n"], ["n_cast"], to=to)], [])
    assert dim_key(g, "n_cast") == (dim_key(g, "n") if same else None)


@pytest.mark.parametrize("value, want", [
    (np.float32(2.0), [("c", 2)]),  # index arithmetic routed through float
    (np.float32(1.4), None),  # a fraction is no index
    (np.float32(np.inf), None),
    (np.array([[1]], np.int64), None),  # not a list of indices
    (np.array(True), [("c", 1)]),
])
def test_constants(value, want):
    g = _graph([helper.make_node("Identity", ["k"], ["y"])], [numpy_helper.from_array(np.asarray(value), "k")])
    assert terms(g, "y") == want


def test_concat_of_unsqueezed_scalars_and_sums():
    """starts = [0, T - 1], ends = starts + [2, 1]: every element its own term."""
    g = _graph([helper.make_node("Unsqueeze", ["n_minus_1", "ax0"], ["last1"]),
                helper.make_node("Concat", ["zero1", "last1"], ["starts"], axis=0),
                helper.make_node("Add", ["starts", "sizes"], ["ends"])], [_init("sizes", [2, 1])])
    T = dim_key(g, "n")
    assert terms(g, "starts") == [("c", 0), size_term(T, -1)]
    assert terms(g, "ends") == [("c", 2), size_term(T, 0)]
    assert scalar_term(g, "starts") is None  # two elements


def _loop_body(body_nodes, body_inits):
    """A Loop over x whose body carries T unchanged (``Tc``) and runs ``body_nodes``."""
    body = helper.make_graph(
        body_nodes + [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["Tc"], ["Tc_out"])],
        "body",
        [helper.make_tensor_value_info("it", TensorProto.INT64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("Tc", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("Tc_out", TensorProto.INT64, [])]
        + [helper.make_tensor_value_info(o, TensorProto.INT64, None) for n in body_nodes for o in n.output],
        body_inits)
    n_out = sum(len(n.output) for n in body_nodes)
    loop = helper.make_node("Loop", ["n", "true", "n"], ["T_final"] + [f"ys{k}" for k in range(n_out)], body=body)
    g = _graph([loop], [_init("true", True, np.bool_)])
    return g, g.subgraph(next(n for n in g.nodes if n.op_type == "Loop"))


def test_a_size_the_loop_carries_unchanged_and_the_iteration_number():
    """In the body, ``Tc - 1`` is T - 1 (the carried value is its initial value at every iteration) and jax's
    negative-index fix-up ``Where(i < 0, i + Tc, i)`` is i itself (i is never negative)."""
    g, body = _loop_body([helper.make_node("Sub", ["Tc", "one_b"], ["last"]),
                          helper.make_node("Less", ["it", "zero_b"], ["neg"]),
                          helper.make_node("Add", ["it", "Tc"], ["wrapped"]),
                          helper.make_node("Where", ["neg", "wrapped", "it"], ["fixed"])],
                         [_init("one_b", 1), _init("zero_b", 0)])
    T = dim_key(g, "n")
    assert terms(body, "last") == [size_term(T, -1)]
    assert terms(body, "fixed", {"it": 0}) == [("i", 0)]
    assert terms(body, "fixed") is None  # without the iteration number it is not understood


@pytest.mark.parametrize("op, axes, shape", [
    ("Squeeze", [1], (5, 1, 3, 2)), ("Squeeze", [0, 2], (1, 5, 1, 3)), ("Squeeze", [-1], (5, 3, 1)),
    ("Unsqueeze", [1], (5, 3, 2)), ("Unsqueeze", [0, -1], (5, 3)), ("Unsqueeze", [-2], (5, 3)),
])
def test_a_dim_seen_through_squeeze_and_unsqueeze(op, axes, shape):
    """root_dim carries each axis of a Squeeze / Unsqueeze output to the input axis of the same extent (the
    input's other axes have other sizes), and stops at an axis Unsqueeze adds."""
    from rnnfuse.dims import root_dim

    x = np.zeros(shape, np.float32)
    y = np.squeeze(x, tuple(axes)) if op == "Squeeze" else np.expand_dims(x, tuple(axes))
    graph = helper.make_graph([helper.make_node(op, ["x", "axes"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y.shape))],
                              [numpy_helper.from_array(np.array(axes, np.int64), "axes")])
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    added = {a % y.ndim for a in axes} if op == "Unsqueeze" else set()
    for out_axis in range(y.ndim):
        got = root_dim(g, "y", out_axis)
        if out_axis in added:
            assert got == ("y", out_axis)
        else:
            assert got[0] == "x" and shape[got[1]] == y.shape[out_axis] and shape.count(shape[got[1]]) == 1, got


@pytest.mark.parametrize("other, is_T", [("n", True), ("b", False), ("k", False)])
def test_the_least_of_a_size_and_a_max_of_it(other, is_T):
    """TF's dynamic_rnn runs min(T, max(1, T)) steps: a max of T and anything is never below T, so the least is
    T. A max of another size (B) says nothing of the least (unknown), and one of constants is a constant (the
    least of T and 4, not T)."""
    nodes = [helper.make_node("Gather", ["shape", "one1"], ["b1"], axis=0), helper.make_node("Squeeze", ["b1", "ax0"], ["b"]),
             helper.make_node("Max", ["one", other], ["mx"]), helper.make_node("Min", ["n", "mx"], ["least"])]
    g = _graph(nodes, [_init("one1", [1]), _init("k", 4)])
    key = dim_key(g, "least")
    assert (key == dim_key(g, "n")) == is_T and (is_T or other == "k" or key is None), key
