"""How an unrolled chain's steps may be read out of x (hand-built): ``p[0]`` of each piece of ``x.chunk(T)``
is step t only when every piece holds one step; x[:, :, t] of a ``[B, F, T]`` x is step t of x's time-major
copy; ``x[:, t:t+1]`` or ``x.split(1, 1)[t]`` of a ``[B, T]`` x, multiplied by weights, is step t of
``Unsqueeze(x, 2)``; ``Slice(x, [t, 0, 0], [t + 1, Shape(h)[0], F])`` (jax2onnx's ``for x_t in x``) is step t where the pieces
are typed as long as x on the other axes. Outputs are compared with the original's in onnxruntime; near misses
are not fused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import rnnfuse

T, F, H = 6, 3, 4


def _chain_model(read: str, parts: int = T) -> onnx.ModelProto:
    """A tanh-RNN chain over the steps ``read`` takes out of x, outputs stacked on a new axis 0.
    ``read``: "chunk" (Split(x, num_outputs=parts) on axis 0, each piece's element 0 gathered; "chunk_t" after
    a Transpose [1, 0, 2] of the piece, as jax2onnx writes ``p[0]``), "last_axis" (x is [B, F, T], step t =
    Gather(x, t, axis=2))."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((F, H)).astype(np.float32) * 0.5, "W"),
             nh.from_array(rng.standard_normal((H, H)).astype(np.float32) * 0.5, "R"),
             nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array([0], np.int64), "axis0")]
    inits += [nh.from_array(np.array(t, np.int64), f"i{t}") for t in range(T)]
    nodes = []
    if read.startswith("chunk"):
        pieces = [f"piece{k}" for k in range(parts)]
        nodes.append(oh.make_node("Split", ["x"], pieces, axis=0, num_outputs=parts))
        xs = []
        for k, p in enumerate(pieces):
            if read == "chunk_t":
                nodes.append(oh.make_node("Transpose", [p], [f"{p}_t"], perm=[1, 0, 2]))
            nodes.append(oh.make_node("Gather", [p if read == "chunk" else f"{p}_t", "zero"], [f"x{k}"],
                                      axis=0 if read == "chunk" else 1))
            xs.append(f"x{k}")
        x_info = oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])
    elif read.startswith("slice"):
        # jax2onnx's ``for x_t in x``: Slice(x, [t, 0, 0], [t + 1, Shape(h)[0], F]), h the state the step before
        # computed ("slice_other_batch": the batch end read off another input's length, a near miss)
        xs = [f"x{t}" for t in range(T)]
        inits += [nh.from_array(np.array([0, 1, 2], np.int64), "axes"), nh.from_array(np.array([F], np.int64), "F")]
        inits += [nh.from_array(np.array([t, 0, 0], np.int64), f"start{t}") for t in range(T)]
        inits += [nh.from_array(np.array([t + 1], np.int64), f"next{t}") for t in range(T)]
        x_info = oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])
    elif read.startswith(("columns", "split_columns")):
        # a [B, T] series, one [B, 1] column a step: Slice(x, t, t + 1, axis 1) or x.split(1, 1)
        xs = [f"x{t}" for t in range(T)]
        inits.append(nh.from_array(rng.standard_normal((1, H)).astype(np.float32), "W1"))
        if read == "split_columns":
            inits.append(nh.from_array(np.ones(T, np.int64), "ones"))
            nodes.append(oh.make_node("Split", ["x", "ones"], xs, axis=1))
        else:
            inits += [nh.from_array(np.array([t], np.int64), f"col{t}") for t in range(T + 1)]
            inits.append(nh.from_array(np.array([1], np.int64), "axis1"))
            nodes += [oh.make_node("Slice", ["x", f"col{t}", f"col{t + 1}", "axis1"], [xs[t]]) for t in range(T)]
        x_info = oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", T])
    else:
        xs = [f"x{t}" for t in range(T)]
        nodes += [oh.make_node("Gather", ["x", f"i{t}"], [xs[t]], axis=2) for t in range(T)]
        x_info = oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", F, T])
    h, ys = "h0", []
    for k, x_t in enumerate(xs):
        if read.startswith("slice"):
            nodes += [oh.make_node("Shape", [h if read == "slice" else "lim"], [f"shape{k}"]),
                      oh.make_node("Gather", [f"shape{k}", "axis0"], [f"rows{k}"]),
                      oh.make_node("Concat", [f"next{k}", f"rows{k}", "F"], [f"end{k}"], axis=0),
                      oh.make_node("Slice", ["x", f"start{k}", f"end{k}", "axes"], [f"piece{k}"]),
                      oh.make_node("Squeeze", [f"piece{k}", "axis0"], [x_t])]
        if read == "columns_scaled":  # (the column scales the cell's output: no input of a cell)
            nodes += [oh.make_node("MatMul", [h, "R"], [f"hr{k}"]), oh.make_node("Tanh", [f"hr{k}"], [f"th{k}"]),
                      oh.make_node("Mul", [f"th{k}", x_t], [f"h_{k}"])]
        else:
            w = "W1" if read.startswith(("columns", "split_columns")) else "W"
            nodes += [oh.make_node("MatMul", [x_t, w], [f"xw{k}"]), oh.make_node("MatMul", [h, "R"], [f"hr{k}"]),
                      oh.make_node("Add", [f"xw{k}", f"hr{k}"], [f"pre{k}"]), oh.make_node("Tanh", [f"pre{k}"], [f"h_{k}"])]
        nodes.append(oh.make_node("Unsqueeze", [f"h_{k}", "axis0"], [f"y{k}"]))
        h = f"h_{k}"
        ys.append(f"y{k}")
    nodes.append(oh.make_node("Concat", ys, ["y"], axis=0))
    inputs = [x_info, oh.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", H])]
    if read == "slice_other_batch":
        inputs.append(oh.make_tensor_value_info("lim", TensorProto.FLOAT, ["C"]))
    graph = oh.make_graph(nodes, "chain", inputs,
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [len(xs), "B", H])], inits)
    if read.startswith("slice"):  # (the pieces' types, as jax2onnx declares them: inference cannot tell)
        rows = "B" if read == "slice" else "C"
        graph.value_info.extend(oh.make_tensor_value_info(f"piece{k}", TensorProto.FLOAT, [1, rows, F]) for k in range(T))
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, x_shape) -> None:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for batch in (1, 3):
        rng = np.random.default_rng(batch)
        feeds = {"x": rng.standard_normal([batch if d == "B" else d for d in x_shape]).astype(np.float32),
                 "h0": rng.standard_normal((batch, H)).astype(np.float32)}
        feeds = {i.name: feeds[i.name] for i in a.graph.input}
        want, got = (ort.InferenceSession(m.SerializeToString(), opts).run(None, feeds) for m in (a, b))
        np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)


def _natives(model: onnx.ModelProto) -> int:
    return sum(n.op_type in ("RNN", "GRU", "LSTM") for n in model.graph.node)


@pytest.mark.parametrize("read,x_shape", [("chunk", [T, "B", F]), ("chunk_t", [T, "B", F]), ("last_axis", ["B", F, T]),
                                         ("slice", [T, "B", F]), ("columns", ["B", T]), ("split_columns", ["B", T])])
def test_steps_read_so_fuse(read, x_shape):
    model = _chain_model(read)
    fused, report = rnnfuse.optimize(model)
    assert _natives(fused) == 1 and not report.declined, report.to_text()
    assert len(fused.graph.node) <= 6, [n.op_type for n in fused.graph.node]
    _same_outputs(model, fused, x_shape)


def test_pieces_of_two_steps_are_no_steps():
    """x.chunk(T / 2): each piece holds two steps, so its element 0 is every other step of x: no chain over
    x (a native op over x would read every step)."""
    model = _chain_model("chunk", parts=T // 2)
    fused, report = rnnfuse.optimize(model)
    assert _natives(fused) == 0, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_a_column_that_scales_the_state_is_no_step_input():
    """A [B, T] tensor read one column a step that multiplies the cell's output (a float mask's way) is no
    sequence of cell inputs: nothing is fused, the model comes out as it went in."""
    model = _chain_model("columns_scaled")
    fused, report = rnnfuse.optimize(model)
    assert _natives(fused) == 0, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_a_slice_whose_batch_end_is_not_proven_whole_is_no_step():
    """Slice(x, [t, 0, 0], [t + 1, len(lim), F]), ``lim`` an input of its own length C (the pieces declared
    [1, C, F]): a piece may hold fewer rows than x has (C < B), so no step of x; nothing is fused and the model
    comes out as it went in."""
    model = _chain_model("slice_other_batch")
    fused, report = rnnfuse.optimize(model)
    assert _natives(fused) == 0, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_a_float_mask_blend_is_declined_with_why():
    """``h = m_t * tanh(x_t W + h R) + (1 - m_t) * h`` with m a float [B, T] input read one column a step: no
    bool, no comparison cast to float, so nothing proves m 0 or 1 and it is no mask: declined, and the reason
    says so; the model comes out as it went in."""
    rng = np.random.default_rng(3)
    inits = [nh.from_array(rng.standard_normal((F, H)).astype(np.float32), "W"),
             nh.from_array(rng.standard_normal((H, H)).astype(np.float32), "R"),
             nh.from_array(np.array(1.0, np.float32), "one"), nh.from_array(np.array([0], np.int64), "axis0"),
             nh.from_array(np.array([1], np.int64), "axis1")]
    inits += [nh.from_array(np.array(t, np.int64), f"i{t}") for t in range(T)]
    inits += [nh.from_array(np.array([t], np.int64), f"col{t}") for t in range(T + 1)]
    nodes, h, ys = [], "h0", []
    for t in range(T):
        nodes += [oh.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0),
                  oh.make_node("Slice", ["m", f"col{t}", f"col{t + 1}", "axis1"], [f"m{t}"]),
                  oh.make_node("MatMul", [f"x{t}", "W"], [f"xw{t}"]), oh.make_node("MatMul", [h, "R"], [f"hr{t}"]),
                  oh.make_node("Add", [f"xw{t}", f"hr{t}"], [f"pre{t}"]), oh.make_node("Tanh", [f"pre{t}"], [f"new{t}"]),
                  oh.make_node("Mul", [f"m{t}", f"new{t}"], [f"kept{t}"]), oh.make_node("Sub", ["one", f"m{t}"], [f"inv{t}"]),
                  oh.make_node("Mul", [f"inv{t}", h], [f"held{t}"]), oh.make_node("Add", [f"kept{t}", f"held{t}"], [f"h_{t}"]),
                  oh.make_node("Unsqueeze", [f"h_{t}", "axis0"], [f"y{t}"])]
        h = f"h_{t}"
        ys.append(f"y{t}")
    nodes.append(oh.make_node("Concat", ys, ["y"], axis=0))
    graph = oh.make_graph(nodes, "blend", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F]),
                                           oh.make_tensor_value_info("m", TensorProto.FLOAT, ["B", T]),
                                           oh.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", H])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [T, "B", H])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    fused, report = rnnfuse.optimize(model)
    assert _natives(fused) == 0 and report.declined, report.to_text()
    assert any("'m' one column a step" in f.reason and "0 and 1" in f.reason for f in report.declined), report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()
