"""Shapes the ops fix (rnnfuse/op_shapes.py): every tensor's dims read from the declared types and the ops'
shape rules, no inference. Exact where it answers (ONNX shape inference agrees on every number, and a symbol
is only said where inference cannot give a number either), and it spares a big model's folds their cone
inferences: torch's ``where(m, h, zeros_like(h))`` asks each step whether ``Shape(h)`` is a constant."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.model
from rnnfuse.cone_types import ConeTypes
from rnnfuse.graph import Model
from rnnfuse.op_shapes import op_dims, op_rank, shape_value


def _i64(name, v):
    return numpy_helper.from_array(np.asarray(v, np.int64), name)


def _mixed_model():
    """One graph using every rule: x [B, 6, 4], a [B, 1] mask, an LSTM, shape arithmetic on x's shape."""
    H = 3
    w = [numpy_helper.from_array(np.ones((4, 5), np.float32), "w"), numpy_helper.from_array(np.ones((5,), np.float32), "b"),
         numpy_helper.from_array(np.ones((1, 4 * H, 4), np.float32), "W"),
         numpy_helper.from_array(np.ones((1, 4 * H, H), np.float32), "R"),
         _i64("i0", 0), _i64("i1", [1]), _i64("i2", [2]), _i64("ax0", [0]), _i64("ax1", [1]), _i64("ax_1", [-1]),
         _i64("five", [5]), _i64("big", [2**40]), _i64("shape0m1", [0, -1]), _i64("shape_r", [6, -1]), _i64("two", 2)]
    nodes = [
        helper.make_node("Transpose", ["x"], ["tx"], perm=[1, 0, 2]),  # [6, B, 4]
        helper.make_node("Transpose", ["x"], ["tx3"], perm=[2, 0, 1]),  # [4, B, 6]
        helper.make_node("MatMul", ["x", "w"], ["mm"]),  # [B, 6, 5]
        helper.make_node("Add", ["mm", "b"], ["mmb"]),  # [B, 6, 5]
        helper.make_node("Gather", ["x", "two"], ["x2"], axis=1),  # [B, 4]
        helper.make_node("Gemm", ["x2", "w"], ["g"]),  # [B, 5]
        helper.make_node("Where", ["m", "g", "zero"], ["wh"]),  # [B, 5]
        helper.make_node("Slice", ["x", "i1", "i2", "ax1"], ["sl"]),  # [B, 1, 4]
        helper.make_node("Slice", ["x", "i1", "big", "ax0"], ["sl_b"]),  # [?, 6, 4]: a symbolic extent cut
        helper.make_node("Squeeze", ["sl", "ax1"], ["sq"]),  # [B, 4]
        helper.make_node("Unsqueeze", ["sq", "ax_1"], ["usq"]),  # [B, 4, 1]
        helper.make_node("Concat", ["sl", "x"], ["cat"], axis=1),  # [B, 7, 4]
        helper.make_node("Concat", ["sl", "runtime3"], ["cat_r"], axis=1),  # [B, ?, 4]
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "i0"], ["batch"], axis=0),  # B
        helper.make_node("Unsqueeze", ["batch", "ax0"], ["batch1"]),  # [B]
        helper.make_node("Concat", ["batch1", "five"], ["zshape"], axis=0),  # [B, 5]
        helper.make_node("ConstantOfShape", ["zshape"], ["zeros"]),  # [B, 5]
        helper.make_node("Expand", ["b", "zshape"], ["bx"]),  # [B, 5]
        helper.make_node("Reshape", ["x", "shape0m1"], ["flat"]),  # [B, 24]: -1 not read here
        helper.make_node("Reshape", ["x", "zshape"], ["rs"]),  # [B, 5]: (not run: a shape read only)
        helper.make_node("Shape", ["x"], ["xs_tail"], start=-2),  # [2]
        helper.make_node("Transpose", ["x"], ["xtt"], perm=[1, 0, 2]),
        helper.make_node("LSTM", ["xtt", "W", "R"], ["y", "yh", "yc"], hidden_size=H),  # [6, 1, B, 3], [1, B, 3]
        # only the rank known: a shape of runtime values but known length, a perm of an input of unknown shape,
        # a Slice of runtime axes
        helper.make_node("Reshape", ["x", "runtime_shape"], ["rs_rt"]),  # [?, ?, ?]
        helper.make_node("Transpose", ["runtime3"], ["t_rt"], perm=[1, 0, 2]),  # [?, ?, ?]
        helper.make_node("Slice", ["x", "i1", "i2", "runtime_axes"], ["sl_rt"]),  # [?, ?, ?]
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 6, 4]),
              helper.make_tensor_value_info("m", TensorProto.BOOL, ["B", 1]),
              helper.make_tensor_value_info("zero", TensorProto.FLOAT, []),
              helper.make_tensor_value_info("runtime3", TensorProto.FLOAT, None),
              helper.make_tensor_value_info("runtime_shape", TensorProto.INT64, [3]),
              helper.make_tensor_value_info("runtime_axes", TensorProto.INT64, [1])]
    outs = ["tx", "tx3", "mm", "mmb", "x2", "g", "wh", "sl", "sl_b", "sq", "usq", "cat", "cat_r", "zeros", "bx", "flat", "rs",
            "xs_tail", "y", "yh", "yc", "rs_rt", "t_rt", "sl_rt"]
    graph = helper.make_graph(nodes, "mixed", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                        for o in outs], w)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), outs


def test_dims_fixed_by_the_ops_agree_with_shape_inference(monkeypatch):
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view)
    model, outs = _mixed_model()
    g = Model(model).graph
    got = {o: op_dims(g, o) for o in outs}
    assert got == {
        "tx": (6, "B", 4), "tx3": (4, "B", 6), "mm": ("B", 6, 5), "mmb": ("B", 6, 5), "x2": ("B", 4), "g": ("B", 5), "wh": ("B", 5),
        "sl": ("B", 1, 4), "sl_b": (None, 6, 4), "sq": ("B", 4), "usq": ("B", 4, 1), "cat": ("B", 7, 4),
        "cat_r": ("B", None, 4), "zeros": ("B", 5), "bx": ("B", 5), "flat": ("B", None), "rs": ("B", 5),
        "xs_tail": (2,), "y": (6, 1, "B", 3), "yh": (1, "B", 3), "yc": (1, "B", 3),
        "rs_rt": (None,) * 3, "t_rt": (None,) * 3, "sl_rt": (None,) * 3}
    assert shape_value(g, "zshape") == ("B", 5) and shape_value(g, "batch") == "B"
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in v.type.tensor_type.shape.dim]
            for v in list(inferred.value_info) + list(inferred.output) if v.type.tensor_type.HasField("shape")}
    checked = 0
    for o, ds in got.items():
        if o not in dims or ds is None:
            continue
        assert len(dims[o]) == len(ds), o
        for mine, theirs in zip(ds, dims[o]):
            if isinstance(mine, int):
                assert theirs == mine, (o, ds, dims[o])
                checked += 1
            elif isinstance(mine, str):
                assert not isinstance(theirs, int), (o, ds, dims[o])  # (a symbol: inference has no number either)
    assert checked > 20


def test_ranks_fixed_by_the_ops_are_the_dims_length_without_the_walk(monkeypatch):
    """``op_rank`` reads the same rules for the rank alone: the length of every dims ``op_dims`` gives (asked on
    a fresh view, so no answer of one serves the other), and a Transpose's ``perm`` answers without its input,
    which is never asked (9,000 attention families walked back through every block before theirs)."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    model, outs = _mixed_model()
    dims = {o: op_dims(Model(model).graph, o) for o in outs}
    g = Model(model).graph
    ranks = {o: op_rank(g, o) for o in outs}
    assert ranks == {o: None if d is None else len(d) for o, d in dims.items()}
    asked = []
    real = rnnfuse.model.Model.settled_type
    monkeypatch.setattr(rnnfuse.model.Model, "settled_type", lambda self, name: asked.append(name) or real(self, name))
    tx = helper.make_node("Transpose", ["deep"], ["t"], perm=[1, 0, 2])
    chain = [helper.make_node("Relu", [f"r{k}"], [f"r{k + 1}"]) for k in range(50)]
    graph = helper.make_graph(chain + [helper.make_node("Identity", ["r50"], ["deep"]), tx], "deep",
                              [helper.make_tensor_value_info("r0", TensorProto.FLOAT, ["B", 2, 3])],
                              [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    assert op_rank(g, "t") == 3 and asked == ["t"]
    assert op_rank(g, "r50") == 3 and len(asked) == 52  # (no perm to say it: the walk to r0)


def _masked_chain(T: int, batch="B"):
    """torch's trace of ``h = where(m[:, t:t+1], tanh(x[:, t] @ W + h @ U), zeros_like(h))``, T steps, h0 =
    zeros(x.size(0), H): each step's ``zeros_like(h)`` is ``ConstantOfShape(Shape(h))``."""
    H, F = 4, 3
    inits = [numpy_helper.from_array(np.full((F, H), 0.1, np.float32), "W"),
             numpy_helper.from_array(np.full((H, H), 0.1, np.float32), "U"),
             _i64("i0", 0), _i64("ax0", [0]), _i64("Hs", [H])]
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["bat0"], axis=0),
             helper.make_node("Unsqueeze", ["bat0", "ax0"], ["bat1"]),
             helper.make_node("Concat", ["bat1", "Hs"], ["hshape"], axis=0),
             helper.make_node("ConstantOfShape", ["hshape"], ["hinit"])]
    h = "hinit"
    for t in range(T):
        inits += [_i64(f"t{t}", t), _i64(f"s{t}", [t]), _i64(f"e{t}", [t + 1])]
        nodes += [helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"], axis=1),
                  helper.make_node("MatMul", [f"x{t}", "W"], [f"a{t}"]), helper.make_node("MatMul", [h, "U"], [f"b{t}"]),
                  helper.make_node("Add", [f"a{t}", f"b{t}"], [f"c{t}"]), helper.make_node("Tanh", [f"c{t}"], [f"n{t}"]),
                  helper.make_node("Slice", ["m", f"s{t}", f"e{t}", "ax1"], [f"m{t}"]),
                  helper.make_node("Shape", [f"n{t}"], [f"ns{t}"]),
                  helper.make_node("ConstantOfShape", [f"ns{t}"], [f"z{t}"]),
                  helper.make_node("Where", [f"m{t}", f"n{t}", f"z{t}"], [f"h{t}"])]
        h = f"h{t}"
    inits.append(_i64("ax1", [1]))
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, T, F]),
                                                helper.make_tensor_value_info("m", TensorProto.BOOL, [batch, T])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _big_model_cone_queries(monkeypatch) -> list[str]:
    """A big model's view (no whole inference), and the list every cone inference's question is added to."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    asked: list[str] = []
    real = ConeTypes.type_of
    monkeypatch.setattr(ConeTypes, "type_of", lambda self, name, one_piece=False: asked.append(name) or
                        real(self, name, one_piece))
    return asked


def test_a_symbolic_shape_is_not_inferred_to_be_declined_as_a_constant(monkeypatch):
    """Deep in a 2,000-step chain, each step's ``zeros_like(h)`` is no constant (the batch is symbolic): the
    ops say so, every step, and not one cone inference is started (each was one a step: 1,640 in a torch
    export). With a static batch, the same zeros fold to a constant of the right shape, also without one."""
    asked = _big_model_cone_queries(monkeypatch)
    T = 2000
    g = Model(_masked_chain(T)).graph
    assert all(g.const(f"z{t}") is None for t in (T - 1, 0, T // 2))
    assert op_dims(g, f"h{T - 1}") == ("B", 4)
    g = Model(_masked_chain(T, batch=2)).graph
    z = g.const(f"z{T - 1}")
    assert z is not None and z.shape == (2, 4) and not z.any()
    assert asked == []


def test_rank_of_reads_the_ops_where_inference_gives_no_rank():
    """dataflow.rank_of (the Loop front end's rank question): the known rank, else what the ops fix. Behind an
    op inference knows nothing of (another domain's), a Transpose's perm, a same-rank op on it, a Reshape to a
    constant shape and a broadcast still say their ranks; nothing says the custom op's own."""
    from rnnfuse.dataflow import rank_of

    nodes = [helper.make_node("Mystery", ["x"], ["u"], domain="custom"),
             helper.make_node("Transpose", ["u"], ["t"], perm=[1, 0, 2]),
             helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Reshape", ["u", "shape4"], ["re"]),
             helper.make_node("Add", ["r", "bias"], ["a"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("a", "re")],
                              [_i64("shape4", [2, 3, -1, 1]), numpy_helper.from_array(np.ones(5, np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    g = Model(model).graph
    assert all(g.model.rank(n) is None for n in ("u", "t", "r", "re", "a"))  # (inference says nothing here)
    assert [rank_of(g, n) for n in ("u", "t", "r", "re", "a")] == [None, 3, 3, 4, 3]
    assert rank_of(g, "x") == 2


def test_squeezed_and_unsqueezed_dims():
    """The axis arithmetic of Squeeze and Unsqueeze that the shape, layout and extent readers share: negative
    axes count from the end (of the output, for Unsqueeze); an axis out of range or named twice is None."""
    from rnnfuse.op_args import squeezed, unsqueezed

    assert squeezed(["t", 1, "b", 1], [1, -1]) == ["t", "b"]
    assert squeezed(list(range(3)), [0]) == [1, 2]
    assert squeezed([1, 2], [2]) is None and squeezed([1, 1], [0, -2]) is None
    assert unsqueezed(["b", "h"], [0]) == [1, "b", "h"]
    assert unsqueezed(["b", "h"], [-1, 1]) == ["b", 1, "h", 1]
    assert unsqueezed(list(range(2)), [0, 2], fill=None) == [None, 0, None, 1]
    assert unsqueezed(["b"], [2]) is None and unsqueezed(["b"], [0, -3]) is None


def _loop_and_scan_model(opset: int = 17) -> onnx.ModelProto:
    """A Loop carrying c [2, S] (a body symbol) and stacking y [3, 4]; a Scan carrying s [5] and stacking
    z [B, 6] along axis -1 and w [7] (doubles) along axis 0."""
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    loop_body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Identity", ["y0"], ["y"])], "lb",
        [vi("it", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, []), vi("c_in", f, [2, "S"])],
        [vi("cond_out", TensorProto.BOOL, []), vi("c_out", f, [2, "S"]), vi("y", f, [3, 4])])
    scan_body = helper.make_graph(
        [helper.make_node("Identity", ["s_in"], ["s_out"]), helper.make_node("Identity", ["xt"], ["z"]),
         helper.make_node("Cast", ["k7"], ["w"], to=TensorProto.DOUBLE)], "sb",
        [vi("s_in", f, [5]), vi("xt", f, ["B", 6])],
        [vi("s_out", f, [5]), vi("z", f, ["B", 6]), vi("w", TensorProto.DOUBLE, [7])],
        [numpy_helper.from_array(np.zeros(7, np.float32), "k7")])
    nodes = [helper.make_node("Loop", ["T", "", "c0"], ["c_last", "ys"], body=loop_body),
             helper.make_node("Scan", ["s0", "xs"], ["s_last", "zs", "ws"], body=scan_body, num_scan_inputs=1,
                              scan_output_axes=[-1, 0])]
    g = helper.make_graph(nodes, "loops", [vi("T", TensorProto.INT64, []), vi("c0", f, [2, 8]), vi("s0", f, [5]),
                                           vi("xs", f, [10, 2, 6])],
                          [vi(o, f, None) for o in ("c_last", "ys", "s_last", "zs")] + [vi("ws", TensorProto.DOUBLE, None)],
                          [numpy_helper.from_array(np.zeros((3, 4), np.float32), "y0")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_loop_and_scan_outputs_have_their_bodies_declared_dims(monkeypatch):
    """A carried value has the body output's rank (a loop that runs no iteration outputs its initial value: its
    dims are not said), a scan output the body output's dims and an axis more where it is stacked (its extent
    not said); a body's symbols are not the outer graph's (no symbol is said), nor is a Scan-8's layout. Every
    number is ONNX inference's too. (A stack of 1,600 Loops asked each one's input rank of a cone inference
    through every Loop below it, and ran out of budget.)"""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view)
    model = _loop_and_scan_model()
    done = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    inferred = {v.name: v for v in [*done.value_info, *done.output] if v.type.tensor_type.HasField("shape")}
    assert set(inferred) >= {"ys", "s_last", "zs", "ws"}  # (c_last: inference says no shape)
    g = Model(model).graph
    want = {"c_last": (None, None), "ys": (None, 3, 4), "s_last": (None,), "zs": (None, 6, None), "ws": (None, 7)}
    for name, dims in want.items():
        assert op_dims(g, name) == dims and op_rank(g, name) == len(dims), (name, op_dims(g, name))
        if name in inferred:
            known = [d.dim_value if d.HasField("dim_value") else None for d in inferred[name].type.tensor_type.shape.dim]
            assert len(known) == len(dims) and all(d is None or d == k for d, k in zip(dims, known)), (name, known)
    assert g.model.elem_type("ws") == TensorProto.DOUBLE and g.model.elem_type("ys") == TensorProto.FLOAT
    old = Model(_loop_and_scan_model(opset=8)).graph
    assert op_dims(old, "zs") is None and op_rank(old, "zs") is None


def _arithmetic_model():
    """Shape arithmetic on x [B, 6, 4]'s shape, as torch's traces write it (``x.size(1) * 2``, ``x.size(0) + 0``,
    ``numel // 4``), each result a graph output; the values onnxruntime computes are the oracle."""
    i = lambda name, v: _i64(name, v)  # noqa: E731
    inits = [i("i0", 0), i("i1", 1), i("i2", 2), i("one", [1]), i("zero", [0]), i("two", 2), i("four", 4), i("three", 3),
             i("huge", 1 << 23), i("pair", [2, 3]), i("triple", [1, 2, 3]), i("to_end", [2**63 - 1])]
    nodes = [helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("Gather", ["xs", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["xs", "i1"], ["t"], axis=0),
             helper.make_node("Mul", ["t", "two"], ["t2"]),  # 12
             helper.make_node("Add", ["t2", "four"], ["t2p4"]),  # 16
             helper.make_node("Sub", ["t2p4", "t"], ["t2p4mt"]),  # 10
             helper.make_node("Div", ["t2", "four"], ["t2d4"]),  # 3: exact
             helper.make_node("Div", ["t", "four"], ["td4"]),  # 1 in int64, 1.5 in float: not said
             helper.make_node("Mul", ["xs", "one"], ["xs1"]),  # (B, 6, 4): the symbol kept
             helper.make_node("Add", ["zero", "xs"], ["xs0"]),  # (B, 6, 4)
             helper.make_node("Mul", ["b", "two"], ["b2"]),  # 2B: not known
             helper.make_node("Mul", ["xs", "pair"], ["bad"]),  # lengths 3 and 2: no broadcast
             helper.make_node("Mul", ["xs", "triple"], ["xs123"]),  # (B, 12, 12)
             helper.make_node("Mul", ["t", "huge"], ["big"]),  # 6 * 2^23: past float32's exact integers
             helper.make_node("Cast", ["t2"], ["t2f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["three"], ["three_f"], to=TensorProto.FLOAT),
             helper.make_node("Div", ["t2f", "three_f"], ["t2f3"]),  # 4.0
             helper.make_node("Div", ["t2f", "half"], ["t2h"]),  # a float literal: not a shape value
             helper.make_node("Cast", ["t"], ["tbool"], to=TensorProto.BOOL),  # True: not the number 6
             helper.make_node("Cast", ["to_end"], ["to_end32"], to=TensorProto.INT32),  # -1: not the int64 maximum
             helper.make_node("Sub", ["u3", "u5"], ["u_diff"]),  # uint8: 254, not -2
             helper.make_node("Cast", ["u_diff"], ["u_diff64"], to=TensorProto.INT64),
             helper.make_node("Cast", ["xs"], ["xsf"], to=TensorProto.FLOAT)]  # (B, 6, 4): B past 2^24 is not B
    inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    inits += [numpy_helper.from_array(np.array([3], np.uint8), "u3"), numpy_helper.from_array(np.array([5], np.uint8), "u5")]
    outs = {"t2": 12, "t2p4": 16, "t2p4mt": 10, "t2d4": 3, "td4": None, "xs1": ("B", 6, 4), "xs0": ("B", 6, 4),
            "b2": None, "bad": None, "xs123": ("B", 12, 12), "big": None, "t2f3": 4, "t2h": None,
            "tbool": None, "to_end32": (None,),
            "u_diff64": None, "xsf": (None, 6, 4)}
    elem = {"t2f3": TensorProto.FLOAT, "t2h": TensorProto.FLOAT, "tbool": TensorProto.BOOL, "to_end32": TensorProto.INT32,
            "xsf": TensorProto.FLOAT}
    graph = helper.make_graph(nodes, "arith", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 6, 4])],
                              [helper.make_tensor_value_info(o, elem.get(o, TensorProto.INT64), None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), outs


def test_shape_arithmetic_values_are_what_onnxruntime_computes(monkeypatch):
    """Add, Sub, Mul and Div on shape values: a number where both sides are numbers and every type the value
    may be held in computes it exactly (a Div only where it divides: int64 truncates where float does not);
    the other side kept where one is the operation's identity (``x * 1``: the symbolic batch too); nothing
    where a length does not broadcast, a product leaves float32's exact integers, a Cast changes the
    numbers (to bool) or a float holds a symbol (exact only below 2^24), nor for values held in a narrow or
    unsigned int (uint8 3 - 5 is 254). Every number said is the one onnxruntime computes, for two batch sizes."""
    import onnxruntime as ort

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    model, want = _arithmetic_model()
    g = Model(model).graph
    got = {o: shape_value(g, o) for o in want}
    assert got == want
    runnable = onnx.ModelProto()
    runnable.CopyFrom(model)  # (without the Mul of lengths 3 and 2: onnxruntime refuses the model)
    del runnable.graph.node[[n.output[0] for n in runnable.graph.node].index("bad")]
    del runnable.graph.output[[o.name for o in runnable.graph.output].index("bad")]
    sess = ort.InferenceSession(runnable.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o for o in want if o != "bad"]
    for batch in (1, 5):
        ran = dict(zip(names, sess.run(names, {"x": np.zeros((batch, 6, 4), np.float32)})))
        for o, v in got.items():
            if v is None or o == "bad":
                continue
            said = v if isinstance(v, tuple) else (v,)
            assert np.ravel(ran[o]).shape == (len(said),), (o, ran[o], v)
            for d, computed in zip(said, np.ravel(ran[o]).tolist()):
                assert d is None or computed == (batch if d == "B" else d), (o, ran[o], v)


def test_a_chain_of_shape_arithmetic_folds_without_inference(monkeypatch):
    """A tensor reshaped to the end of 3,000 links of shape arithmetic (``Shape(Reshape(Expand(0, s), s))`` cut
    and joined again, times one: each link's values the one before's): its Shape folds from the ops alone,
    no cone inferred (each link's fold of a Shape inferred a cone through every link before it: the benchmark's
    100k-node ``shapes`` graph spent 8 of its 11 s there)."""
    asked = _big_model_cone_queries(monkeypatch)
    links = 3000
    inits = [_i64("first", [0]), _i64("to_end", [100]), _i64("one", [1]), _i64("k0", [4, 3, 2]),
             numpy_helper.from_array(np.zeros(1, np.float32), "zeros")]
    nodes, cur = [], "k0"
    for k in range(links):
        p = f"k{k}_"
        nodes += [helper.make_node("Expand", ["zeros", cur], [p + "e"]), helper.make_node("Reshape", [p + "e", cur], [p + "r"]),
                  helper.make_node("Shape", [p + "r"], [p + "sh"]),
                  helper.make_node("Gather", [p + "sh", "first"], [p + "d0"], axis=0),
                  helper.make_node("Slice", [p + "sh", "one", "to_end"], [p + "rest"]),
                  helper.make_node("Concat", [p + "d0", p + "rest"], [p + "cat"], axis=0),
                  helper.make_node("Mul", [p + "cat", "one"], [p + "next"])]
        cur = p + "next"
    nodes.append(helper.make_node("Reshape", ["flat", cur], ["rx"]))
    nodes.append(helper.make_node("Shape", ["rx"], ["rx_shape"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("flat", TensorProto.FLOAT, [24])],
                              [helper.make_tensor_value_info("rx_shape", TensorProto.INT64, None)], inits)
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    assert op_dims(g, "rx") == (4, 3, 2)
    assert g.const("rx_shape").tolist() == [4, 3, 2]
    assert asked == []


def test_a_walk_through_arithmetic_reads_no_weight(monkeypatch):
    """A shape computed from a float tensor (``Cast(Mul(h, W))``: arithmetic that is no shape's) is no shape
    value, and the walk that learns it does not read the weight it meets (a walk into a network's maths read
    every weight there into memory to find each too big to be one)."""
    read = []
    real = rnnfuse.model.Model.tensor_array
    monkeypatch.setattr(rnnfuse.model.Model, "tensor_array", lambda self, t, *a, **k: read.append(t.name) or real(self, t, *a, **k))
    inits = [numpy_helper.from_array(np.ones((4, 3), np.float32), "W"), numpy_helper.from_array(np.ones(3, np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Mul", ["hw", "b"], ["hwb"]),
             helper.make_node("ReduceMax", ["hwb"], ["m"], keepdims=0),
             helper.make_node("Mul", ["hwb", "W2"], ["scaled"]), helper.make_node("Cast", ["scaled"], ["shape"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["x", "shape"], ["r"])]
    inits.append(numpy_helper.from_array(np.ones((2, 3), np.float32), "W2"))
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [vi("h", TensorProto.FLOAT, [2, 4]), vi("x", TensorProto.FLOAT, [6])],
                              [vi("r", TensorProto.FLOAT, None)], inits)
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    assert shape_value(g, "shape") is None
    assert op_dims(g, "r") in (None, (None, None))
    assert "W2" not in read and "W" not in read, read


def test_a_reshape_declared_without_dims_has_the_extents_its_computed_shape_fixes():
    """dynamo without its optimizer views each call's ``[1, 1, B, H]`` output as ``[1, B, H]`` by a shape
    computed from its own (``Shape``, Slices of it, ``Reshape(d2 * d3, [-1])``, Concat) and declares the result
    with no dims: the extents the shape's positive entries fix are read all the same (the batch stays
    unknown), and the shape's value is what onnxruntime computes."""
    from rnnfuse.dataflow import settled_dim

    nodes = [helper.make_node("Transpose", ["y"], ["t"], perm=[0, 2, 1, 3]),  # [1, B, 1, 4]
             helper.make_node("Shape", ["t"], ["s"])]
    inits = [_i64("minus1", [-1])]
    for k in range(4):
        inits += [_i64(f"at{k}", [k]), _i64(f"at{k + 1}b", [k + 1])]
        nodes.append(helper.make_node("Slice", ["s", f"at{k}", f"at{k + 1}b"], [f"d{k}"]))
    nodes += [helper.make_node("Mul", ["d2", "d3"], ["w"]), helper.make_node("Reshape", ["w", "minus1"], ["wf"]),
              helper.make_node("Concat", ["d0", "d1", "wf"], ["shape"], axis=0),
              helper.make_node("Reshape", ["t", "shape"], ["v"])]
    undims = helper.make_tensor_value_info("v", TensorProto.FLOAT, None)
    undims.type.tensor_type.shape.dim.add()
    undims.type.tensor_type.shape.dim.add()
    undims.type.tensor_type.shape.dim.add()  # (rank 3, no dim known: as dynamo declares it)
    graph = helper.make_graph(nodes, "views", [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, "B", 4])],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, None)], inits,
                              value_info=[undims])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = Model(proto).graph
    assert shape_value(g, "wf") == (4,)
    assert shape_value(g, "shape")[0] == 1 and shape_value(g, "shape")[2] == 4
    assert [settled_dim(g, "v", k) for k in range(3)] == [1, None, 4]
    import onnxruntime as ort

    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    v, shape = sess.run(None, {"y": np.ones((1, 1, 3, 4), np.float32)})
    assert v.shape == (1, 3, 4) and list(shape) == [1, 3, 4]
