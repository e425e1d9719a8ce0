"""Graphs built op by op for the cost benchmark (benchmarks/scaling.py): each a shape of 100k-node graph that
once cost more than the LSTMCell chain and the elementwise chain of issue 16 (see benchmarks/README.md).

Every generator is ``f(path, nodes) -> the node count it wrote``: the graph sized to about ``nodes``. The
``*_model`` builders behind two of them are also the tests' (tests/test_family_cost.py), at a test's size."""

from __future__ import annotations

import os


def elementwise_chain(path: str, nodes: int, width: int = 16) -> int:
    """``nodes`` elementwise nodes in one chain (Add w, Mul w, Tanh, Sigmoid, repeated), nothing to fuse."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    g = onnx.GraphProto()
    g.name = "elementwise_chain"
    g.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", width]))
    cur = "x"
    for i in range(nodes):
        op = ("Add", "Mul", "Tanh", "Sigmoid")[i % 4]
        out = "y" if i == nodes - 1 else f"v{i}"
        n = g.node.add()
        n.op_type, n.name = op, f"{op}_{i}"
        n.input.append(cur)
        if op in ("Add", "Mul"):
            w = (rng.standard_normal(width) * 0.1 + (1.0 if op == "Mul" else 0.0)).astype(np.float32)
            g.initializer.append(numpy_helper.from_array(w, f"w{i}"))
            n.input.append(f"w{i}")
        n.output.append(out)
        cur = out
    g.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", width]))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    return nodes


def _save(path: str, nodes: list, name: str, inputs: list, outputs: list, inits: list) -> int:
    import onnx
    from onnx import helper

    m = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return len(nodes)


def steps_summed(path: str, nodes: int, width: int = 16) -> int:
    """Per step ``tanh(x[t] @ W)``, no state, all steps summed (4 nodes a step): a graph of time slices and
    matmuls with nothing to fuse, so the chain front end searches it all and declines nothing."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    T = max(2, nodes // 4)
    out, stacked = [], []
    for t in range(T):
        out.append(helper.make_node("Constant", [], [f"i{t}"], value=numpy_helper.from_array(np.array(t, np.int64))))
        out += [helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0),
                helper.make_node("MatMul", [f"x{t}", "W"], [f"m{t}"]), helper.make_node("Tanh", [f"m{t}"], [f"y{t}"])]
        stacked.append(f"y{t}")
    out.append(helper.make_node("Sum", stacked, ["y"]))
    W = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, width)).astype(np.float32) * 0.2, "W")
    return _save(path, out, "steps_summed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", 8])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", width])], [W])


def masked_rnn_chain(path: str, nodes: int, features: int = 8, hidden: int = 16) -> int:
    """A loop over a tanh cell with a [T, B] bool mask, unrolled as torch's tracer writes it (11 nodes a step:
    the step's index, its slices of x and the mask, the cell, ``h = where(mask[t], h_new, h)``, the output
    stacked by Unsqueeze + Concat). rnnfuse fuses it into one masked RNN, validated step by step."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    T = max(2, nodes // 11)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("W", (features, hidden)), ("R", (hidden, hidden)), ("b", (hidden,)))]
    inits += [numpy_helper.from_array(np.array([a], np.int64), f"axis{a}") for a in (0, 1)]
    out, ys, h = [], [], "h0"
    for t in range(T):
        out += [helper.make_node("Constant", [], [f"t{t}"], value=numpy_helper.from_array(np.array(t, np.int64))),
                helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"], axis=0),
                helper.make_node("Gather", ["mask", f"t{t}"], [f"mb{t}"], axis=0),
                helper.make_node("Unsqueeze", [f"mb{t}", "axis1"], [f"m{t}"]),
                helper.make_node("MatMul", [f"x{t}", "W"], [f"xw{t}"]),
                helper.make_node("MatMul", [h, "R"], [f"hr{t}"]),
                helper.make_node("Add", [f"xw{t}", f"hr{t}"], [f"s{t}"]),
                helper.make_node("Add", [f"s{t}", "b"], [f"a{t}"]),
                helper.make_node("Tanh", [f"a{t}"], [f"hn{t}"]),
                helper.make_node("Where", [f"m{t}", f"hn{t}", h], [f"hs{t}"]),
                helper.make_node("Unsqueeze", [f"hs{t}", "axis0"], [f"y{t}"])]
        h = f"hs{t}"
        ys.append(f"y{t}")
    out.append(helper.make_node("Concat", ys, ["y"], axis=0))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", features]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, [T, "B"]),
              helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", hidden])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, "B", hidden]),
               helper.make_tensor_value_info(h, TensorProto.FLOAT, ["B", hidden])]
    return _save(path, out, "masked_rnn_chain", inputs, outputs, inits)


def loops_in_a_row(path: str, nodes: int, width: int = 4) -> int:
    """``nodes // 4`` Loops in a row (each a 2-node body that carries its value through a Tanh, a Mul
    between them): thousands of small subgraphs, nothing to fuse. Counts the bodies' nodes too."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    out, cur = [], "x"
    vi = helper.make_tensor_value_info
    for i in range(max(1, nodes // 4)):
        body = helper.make_graph(
            [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Tanh", ["v_in"], ["v_out"])], f"body{i}",
            [vi("it", TensorProto.INT64, []), vi("c_in", TensorProto.BOOL, []), vi("v_in", TensorProto.FLOAT, None)],
            [vi("c_out", TensorProto.BOOL, []), vi("v_out", TensorProto.FLOAT, None)])
        out += [helper.make_node("Loop", ["trip", "cond", cur], [f"l{i}"], body=body),
                helper.make_node("Mul", [f"l{i}", "w"], [f"m{i}"])]
        cur = f"m{i}"
    inits = [numpy_helper.from_array(np.array(2, np.int64), "trip"), numpy_helper.from_array(np.array(True), "cond"),
             numpy_helper.from_array(np.full(width, 0.9, np.float32), "w")]
    _save(path, out, "loops_in_a_row", [vi("x", TensorProto.FLOAT, ["B", width])], [vi(cur, TensorProto.FLOAT, ["B", width])],
          inits)
    return 2 * len(out)


def cells_side_by_side(path: str, nodes: int, steps: int = 16, features: int = 8, hidden: int = 16) -> int:
    """``nodes // (6 * steps)`` tanh cells over the same x, each its own weights and stacked output (a lane
    each, :mod:`rnnfuse.passes.unrolled.lanes`): many chains over one input."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    cells = max(2, nodes // (6 * steps))
    vi = helper.make_tensor_value_info
    out, inits, outputs = [], [numpy_helper.from_array(np.array([0], np.int64), "axis0")], []
    for t in range(steps):
        out += [helper.make_node("Constant", [], [f"t{t}"], value=numpy_helper.from_array(np.array(t, np.int64))),
                helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"], axis=0)]
    for c in range(cells):
        inits += [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), f"{n}{c}")
                  for n, s in (("W", (features, hidden)), ("R", (hidden, hidden)), ("b", (hidden,)))]
        h, ys = "h0", []
        for t in range(steps):
            p = f"c{c}_{t}_"
            out += [helper.make_node("MatMul", [f"x{t}", f"W{c}"], [p + "xw"]),
                    helper.make_node("MatMul", [h, f"R{c}"], [p + "hr"]),
                    helper.make_node("Add", [p + "xw", p + "hr"], [p + "s"]),
                    helper.make_node("Add", [p + "s", f"b{c}"], [p + "a"]),
                    helper.make_node("Tanh", [p + "a"], [p + "h"]),
                    helper.make_node("Unsqueeze", [p + "h", "axis0"], [p + "y"])]
            h = p + "h"
            ys.append(p + "y")
        out.append(helper.make_node("Concat", ys, [f"y{c}"], axis=0))
        outputs.append(vi(f"y{c}", TensorProto.FLOAT, [steps, "B", hidden]))
    return _save(path, out, "cells_side_by_side", [vi("x", TensorProto.FLOAT, [steps, "B", features]),
                                                   vi("h0", TensorProto.FLOAT, ["B", hidden])], outputs, inits)


def _gemm_tanh_cell(p: str, x: str, h: str, c: str) -> list:
    """torch's trace of ``nn.RNNCell``: ``tanh(x @ W.T + b_ih + h @ R.T + b_hh)`` as two Gemms (transB)."""
    from onnx import helper

    return [helper.make_node("Gemm", [x, f"W{c}", f"bi{c}"], [p + "xw"], transB=1),
            helper.make_node("Gemm", [h, f"R{c}", f"bh{c}"], [p + "hr"], transB=1),
            helper.make_node("Add", [p + "xw", p + "hr"], [p + "a"]),
            helper.make_node("Tanh", [p + "a"], [p + "h"])]


def two_cells_per_step(path: str, nodes: int, arrangement: str = "bidir", features: int = 8, hidden: int = 16) -> int:
    """Two tanh cells per step of a torch loop, as torch's tracer writes them (Gemm cells, no types declared
    inside the graph): ``bidir`` a forward cell over x[t] and a backward one over x[T-1-t], outputs
    ``cat([stack(yf), stack(yr[::-1])], -1)`` (one bidirectional RNN once fused); ``stacked`` the upper cell
    reading the lower one's new h at each step, ``stack(y2)`` (two RNNs, the upper reading the lower's Y).
    ~14 nodes a step."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    T = max(2, nodes // 14)
    inits = [numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    for c, f in enumerate((features, features if arrangement == "bidir" else hidden)):
        inits += [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), f"{n}{c}")
                  for n, s in ((("W", (hidden, f)), ("R", (hidden, hidden)), ("bi", (hidden,)), ("bh", (hidden,))))]
    out, ys, hs = [], ([], []), ["h0", "h0"]
    for t in range(T):
        below = None
        for c in range(2):
            p = f"c{c}_{t}_"
            if arrangement == "bidir" or c == 0:  # (torch's trace slices x where it is read, once per read)
                i = T - 1 - t if c == 1 else t
                out += [helper.make_node("Constant", [], [p + "t"], value=numpy_helper.from_array(np.array(i, np.int64))),
                        helper.make_node("Gather", ["x", p + "t"], [p + "x"], axis=0)]
                below = p + "x"
            out += _gemm_tanh_cell(p, below, hs[c], str(c))
            out.append(helper.make_node("Unsqueeze", [p + "h", "axis0"], [p + "y"]))
            below = hs[c] = p + "h"
            ys[c].append(p + "y")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, "B", hidden * (2 if arrangement == "bidir" else 1)])]
    if arrangement == "bidir":
        out += [helper.make_node("Concat", ys[0], ["yf"], axis=0), helper.make_node("Concat", ys[1][::-1], ["yr"], axis=0),
                helper.make_node("Concat", ["yf", "yr"], ["y"], axis=-1)]
    else:
        out.append(helper.make_node("Concat", ys[1], ["y"], axis=0))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", features]),
              helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["B", hidden])]
    return _save(path, out, f"{arrangement}_chain", inputs, outputs, inits)


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "keras_masked_bigru_lstm.onnx")


def loop_with_head(path: str, nodes: int, features: int = 3, hidden: int = 4) -> int:
    """A Loop over the steps of x whose body holds a tanh cell and a per-step head of ``nodes`` elementwise ops
    on its new h (``sigmoid(tanh(h * 0.5 + 0.5))``, repeated), its result the Loop's scan output: a head inside
    the loop, as a Keras layer's ``TimeDistributed`` or a JAX scan body writes it, grown to the graph's size
    (bodies counted). Fused: one RNN, the head applied once to every step (``rnnfuse.row_wise``); the
    validation and the do-no-harm guard each load a model holding the head in onnxruntime."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    body = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0), helper.make_node("MatMul", ["xt", "W"], ["xw"]),
            helper.make_node("MatMul", ["h", "R"], ["hr"]), helper.make_node("Add", ["xw", "hr"], ["s"]),
            helper.make_node("Add", ["s", "b"], ["s2"]), helper.make_node("Tanh", ["s2"], ["hn"]),
            helper.make_node("Identity", ["cond"], ["cond_out"])]
    prev = "hn"
    for k in range(max(4, nodes - 15)):
        op = ("Mul", "Add", "Tanh", "Sigmoid")[k % 4]
        body.append(helper.make_node(op, [prev, "half"] if op in ("Mul", "Add") else [prev], [f"e{k}"]))
        prev = f"e{k}"
    body.append(helper.make_node("Identity", [prev], ["yt"]))
    f = TensorProto.FLOAT
    body_graph = helper.make_graph(
        body, "body", [helper.make_tensor_value_info("it", TensorProto.INT64, []),
                       helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                       helper.make_tensor_value_info("h", f, ["B", hidden])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("hn", f, ["B", hidden]),
         helper.make_tensor_value_info("yt", f, ["B", hidden])])
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("W", (features, hidden)), ("R", (hidden, hidden)), ("b", (hidden,)))]
    inits += [numpy_helper.from_array(np.float32(0.5).reshape(()), "half"),
              numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
              numpy_helper.from_array(np.array([hidden], np.int64), "iH"),
              numpy_helper.from_array(np.zeros((1, 1), np.float32), "zero"), numpy_helper.from_array(np.array(True), "true")]
    top = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["T"], axis=0),
           helper.make_node("Gather", ["xs", "i1"], ["B1"], axis=0),
           helper.make_node("Reshape", ["B1", "one"], ["B2"]),
           helper.make_node("Concat", ["B2", "iH"], ["hshape"], axis=0), helper.make_node("Expand", ["zero", "hshape"], ["h0"]),
           helper.make_node("Loop", ["T", "true", "h0"], ["hT", "ys"], body=body_graph)]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    _save(path, top, "loop_with_head", [helper.make_tensor_value_info("x", f, ["T", "B", features])],
          [helper.make_tensor_value_info("ys", f, ["T", "B", hidden]), helper.make_tensor_value_info("hT", f, ["B", hidden])],
          inits)
    return len(top) + len(body)


def stacked_loops(path: str, nodes: int, hidden: int = 4) -> int:
    """Loops stacked on one another (``nodes // 9`` of them, bodies counted): each a tanh cell over the stacked
    per-step outputs of the Loop below, all with the trip count ``x.shape[0]`` (TorchScript's loop per layer,
    a deep stack of them). Fused: one RNN per Loop, every one validated in one check model; every Loop reads
    the one trip count and captures the output of the one below."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    inits = [numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.zeros((1, hidden), np.float32), "h0")]
    top = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["T1"], axis=0),
           helper.make_node("Squeeze", ["T1", "i0"], ["T"])]
    cur = "x"
    for k in range(max(1, (nodes - 3) // 9)):
        inits += [numpy_helper.from_array((0.4 * rng.standard_normal(s)).astype(np.float32), f"{n}{k}")
                  for n, s in (("W", (hidden, hidden)), ("R", (hidden, hidden)), ("b", (hidden,)))]
        body = [helper.make_node("Gather", [cur, "it"], ["xt"], axis=0), helper.make_node("MatMul", ["xt", f"W{k}"], ["xw"]),
                helper.make_node("MatMul", ["h", f"R{k}"], ["hr"]), helper.make_node("Add", ["xw", "hr"], ["s"]),
                helper.make_node("Add", ["s", f"b{k}"], ["s2"]), helper.make_node("Tanh", ["s2"], ["hn"]),
                helper.make_node("Identity", ["hn"], ["yt"]), helper.make_node("Identity", ["cond"], ["cond_out"])]
        graph = helper.make_graph(body, f"body{k}", [vi("it", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, []),
                                                     vi("h", f, [1, hidden])],
                                  [vi("cond_out", TensorProto.BOOL, []), vi("hn", f, [1, hidden]), vi("yt", f, [1, hidden])])
        top.append(helper.make_node("Loop", ["T", "true", "h0"], [f"h_last{k}", f"ys{k}"], body=graph))
        cur = f"ys{k}"
    _save(path, top, "stacked_loops", [vi("x", f, ["T", 1, hidden])], [vi(cur, f, ["S", 1, hidden])], inits)
    return 3 + 9 * (len(top) - 3)


def recurrence_then_head(path: str, nodes: int) -> int:
    """The shipped Keras model (a masked bidirectional GRU and an LSTM: two Loops to fuse, a pair to merge)
    followed by ``nodes`` nodes reading its output (MatMul, Tanh, Add, Sigmoid, repeated): a big model with a
    small fusion. The do-no-harm check loaded all of it in onnxruntime (whose load grows faster than the
    nodes)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(EXAMPLE)
    g = m.graph
    out = g.output[0]
    width = out.type.tensor_type.shape.dim[-1].dim_value
    g.initializer.append(numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((width, width)) * 0.1).astype(np.float32), "head_W"))
    x = out.name
    for i in range(max(1, nodes // 4)):
        p = f"head{i}_"
        g.node.extend([helper.make_node("MatMul", [x, "head_W"], [p + "a"]), helper.make_node("Tanh", [p + "a"], [p + "b"]),
                       helper.make_node("Add", [p + "b", x], [p + "c"]), helper.make_node("Sigmoid", [p + "c"], [p + "d"])])
        x = p + "d"
    elem = out.type.tensor_type.elem_type
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(x, elem, None))
    onnx.save(m, path)
    return len(g.node)


def prologue_then_recurrence(path: str, nodes: int) -> int:
    """The shipped Keras model with its input computed by ``nodes`` nodes (``x * 1 + 0``, repeated): a
    recurrence behind a long prologue. Past 20,000 nodes the Loops' inputs had no type (their cone was given
    up on) and the Loops were declined; every validation runs the prologue too."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(EXAMPLE)
    g = m.graph
    x = g.input[0].name
    g.input[0].name = "raw_x"
    g.initializer.extend([numpy_helper.from_array(np.array(1.0, np.float32), "pre_one"),
                          numpy_helper.from_array(np.array(0.0, np.float32), "pre_zero")])
    cur, pre = "raw_x", []
    half = max(1, nodes // 2)
    for i in range(half):
        out = x if i == half - 1 else f"pre{i}_a"
        pre += [helper.make_node("Mul", [cur, "pre_one"], [f"pre{i}_m"]), helper.make_node("Add", [f"pre{i}_m", "pre_zero"], [out])]
        cur = out
    body = list(g.node)
    del g.node[:]
    g.node.extend(pre + body)
    onnx.save(m, path)
    return len(g.node)


def _blocks_model(nodes, inits, x_shape, out, out_shape, extra_inputs=()):
    from onnx import TensorProto, helper

    g = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape), *extra_inputs],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def unbind_stack_model(blocks: int, steps: int = 16, width: int = 4):
    """torch's ``torch.stack([relu(x_t @ W) for x_t in x.unbind(1)], 1)``, block after block over [B, S, F]:
    every block a family of ``steps`` slices, no step reading another."""
    import numpy as np
    from onnx import helper, numpy_helper

    F = width
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "ax1"))
    for b in range(blocks):
        w = f"w{b}"
        inits.append(numpy_helper.from_array(rng.standard_normal((F, F)).astype(np.float32), w))
        parts = [f"b{b}_s{t}" for t in range(steps)]
        nodes.append(helper.make_node("Split", [cur], parts, axis=1))
        outs = []
        for t, p in enumerate(parts):
            nodes += [helper.make_node("Squeeze", [p, "ax1"], [f"{p}_x"]),
                      helper.make_node("MatMul", [f"{p}_x", w], [f"{p}_m"]),
                      helper.make_node("Relu", [f"{p}_m"], [f"{p}_r"]),
                      helper.make_node("Unsqueeze", [f"{p}_r", "ax1"], [f"{p}_u"])]
            outs.append(f"{p}_u")
        cur = f"b{b}_y"
        nodes.append(helper.make_node("Concat", outs, [cur], axis=1))
    return _blocks_model(nodes, inits, ["B", steps, F], cur, ["B", steps, F])


def attention_model(blocks: int, width: int = 4):
    """Self-attention, block after block over [B, T, F]: q, k, v the slices of one [3, B, T, F] tensor (a
    family of three steps of a 4-d source, whose "steps" combine: q @ k^T, then @ v), as torch traces
    nn.MultiheadAttention."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    F = width
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    inits += [numpy_helper.from_array(np.array(i, np.int64), f"i{i}") for i in range(3)]
    for b in range(blocks):
        w = f"w{b}"
        inits.append(numpy_helper.from_array(rng.standard_normal((F, 3 * F)).astype(np.float32), w))
        p = f"b{b}_"
        nodes += [helper.make_node("MatMul", [cur, w], [p + "qkv"]),
                  helper.make_node("Reshape", [p + "qkv", "qkv_shape"], [p + "r"]),
                  helper.make_node("Transpose", [p + "r"], [p + "t"], perm=[2, 0, 1, 3])]
        # (torch's trace of ``q, k, v = qkv.unbind(0)``: a Gather of each index)
        nodes += [helper.make_node("Gather", [p + "t", f"i{i}"], [p + s], axis=0) for i, s in enumerate("qkv")]
        nodes += [helper.make_node("Transpose", [p + "k"], [p + "kt"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", [p + "q", p + "kt"], [p + "s"]),
                  helper.make_node("Softmax", [p + "s"], [p + "a"], axis=-1),
                  helper.make_node("MatMul", [p + "a", p + "v"], [p + "o"]),
                  helper.make_node("Add", [cur, p + "o"], [p + "y"])]
        cur = p + "y"
    # (the view's shape a runtime value: the source's rank is not known, as in the trace of a 600-layer
    # transformer, whose every layer's family was searched and its "chains" declined for their layout)
    shape = helper.make_tensor_value_info("qkv_shape", TensorProto.INT64, ["n"])
    return _blocks_model(nodes, inits, ["B", "T", F], cur, ["B", "T", F], [shape])


def unbind_stack_blocks(path: str, nodes: int, steps: int = 16) -> int:
    """:func:`unbind_stack_model` of about ``nodes`` nodes (4 a step and a Split and a Concat a block)."""
    import onnx

    m = unbind_stack_model(max(1, nodes // (4 * steps + 2)), steps)
    onnx.save(m, path)
    return len(m.graph.node)


def attention_blocks(path: str, nodes: int) -> int:
    """:func:`attention_model` of about ``nodes`` nodes (11 a block)."""
    import onnx

    m = attention_model(max(1, nodes // 11))
    onnx.save(m, path)
    return len(m.graph.node)


def layer_called_per_step(path: str, nodes: int, features: int = 8, hidden: int = 16) -> int:
    """torch's trace of a 2-layer ``nn.LSTM(batch_first=True)`` called once per step with the state carried by
    hand (``y_t, (h, c) = lstm(x[:, t:t+1], (h, c))``, outputs ``cat(ys, 1)``), as torch 2.13 writes it: per
    call an Identity of each weight, the [2, B, H] states sliced per layer and put together again, the step
    input transposed to time-major, each layer's Y squeezed, the output piece transposed back, a Constant per
    bound (~30 nodes a step). The per-call merge (passes/step_chains.py) leaves one LSTM per layer."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    T = max(2, nodes // 30)
    inits, out = [], []
    for layer, width in enumerate((features, hidden)):
        for k, shape in (("W", (1, 4 * hidden, width)), ("R", (1, 4 * hidden, hidden)), ("B", (1, 8 * hidden))):
            inits.append(numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), f"{k}{layer}"))
    k = 0

    def const(v) -> str:
        nonlocal k
        k += 1
        out.append(helper.make_node("Constant", [], [f"k{k}"], value=numpy_helper.from_array(np.array(v, np.int64))))
        return f"k{k}"

    out += [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", const(0)], ["batch"], axis=0),
            helper.make_node("Unsqueeze", ["batch", const([0])], ["batch1"]),
            helper.make_node("Concat", [const([2]), "batch1", const([hidden])], ["state_shape"], axis=0),
            helper.make_node("ConstantOfShape", ["state_shape"], ["zeros"],
                             value=numpy_helper.from_array(np.zeros(1, np.float32)))]
    h, c, pieces = "zeros", "zeros", []
    for t in range(T):
        out += [helper.make_node("Slice", ["x", const([t]), const([t + 1]), const([1])], [f"x{t}"]),
                helper.make_node("Transpose", [f"x{t}"], [f"xt{t}"], perm=[1, 0, 2])]
        inp, hs, cs = f"xt{t}", [], []
        for layer in range(2):
            ws = []
            for w in "WRB":
                out.append(helper.make_node("Identity", [f"{w}{layer}"], [f"{w}{layer}_{t}"]))
                ws.append(f"{w}{layer}_{t}")
            bounds = (const([layer]), const([layer + 1]), const([0]))
            out += [helper.make_node("Slice", [h, *bounds], [f"h{t}_{layer}"]),
                    helper.make_node("Slice", [c, *bounds], [f"c{t}_{layer}"]),
                    helper.make_node("LSTM", [inp, *ws, "", f"h{t}_{layer}", f"c{t}_{layer}"],
                                     [f"y{t}_{layer}", f"yh{t}_{layer}", f"yc{t}_{layer}"], hidden_size=hidden),
                    helper.make_node("Squeeze", [f"y{t}_{layer}", const([1])], [f"ys{t}_{layer}"])]
            inp = f"ys{t}_{layer}"
            hs.append(f"yh{t}_{layer}")
            cs.append(f"yc{t}_{layer}")
        out += [helper.make_node("Concat", hs, [f"hcat{t}"], axis=0), helper.make_node("Concat", cs, [f"ccat{t}"], axis=0),
                helper.make_node("Transpose", [inp], [f"piece{t}"], perm=[1, 0, 2])]
        h, c = f"hcat{t}", f"ccat{t}"
        pieces.append(f"piece{t}")
    out += [helper.make_node("Concat", pieces, ["y"], axis=1), helper.make_node("Identity", [h], ["h_n"]),
            helper.make_node("Identity", [c], ["c_n"])]
    return _save(path, out, "layer_called_per_step",
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", T, features])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", T, hidden]),
                  helper.make_tensor_value_info("h_n", TensorProto.FLOAT, [2, "B", hidden]),
                  helper.make_tensor_value_info("c_n", TensorProto.FLOAT, [2, "B", hidden])], inits)


def backward_loop_read_stacked(path: str, nodes: int, features: int = 8, hidden: int = 16) -> int:
    """torch's trace of a hand-written bidirectional relu RNN: a loop over the steps with one cell, a second loop
    over them backward with another, the outputs ``stack([cat([hf[t], hb[t]], 1) for t], 1)`` (14 nodes a
    step). Fused: one bidirectional RNN, and the per-step cat read from its output once (passes/step_maps.py:
    the backward states are read in the forward order, step T-1-k by the k-th step of the loop)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    T = max(2, nodes // 14)
    inits = [numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32), name)
             for name, shape in (("Wf", (features, hidden)), ("Rf", (hidden, hidden)), ("bf", (hidden,)),
                                 ("Wb", (features, hidden)), ("Rb", (hidden, hidden)), ("bb", (hidden,)))]
    inits += [numpy_helper.from_array(np.array([0], np.int64), "ax0"), numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array([hidden], np.int64), "width")]
    out = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["batch"], axis=0),
           helper.make_node("Unsqueeze", ["batch", "ax0"], ["batch1"]),
           helper.make_node("Concat", ["batch1", "width"], ["state_shape"], axis=0),
           helper.make_node("ConstantOfShape", ["state_shape"], ["zeros"],
                            value=numpy_helper.from_array(np.zeros(1, np.float32)))]
    for t in range(T):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"i{t}"))
    states = {}
    for d, steps in (("f", range(T)), ("b", range(T - 1, -1, -1))):
        h = "zeros"
        for t in steps:
            p = f"{d}{t}_"
            out += [helper.make_node("Gather", ["x", f"i{t}"], [p + "x"], axis=1),
                    helper.make_node("MatMul", [p + "x", f"W{d}"], [p + "xw"]),
                    helper.make_node("MatMul", [h, f"R{d}"], [p + "hr"]),
                    helper.make_node("Add", [p + "xw", p + "hr"], [p + "s"]),
                    helper.make_node("Add", [p + "s", f"b{d}"], [p + "a"]),
                    helper.make_node("Relu", [p + "a"], [p + "h"])]
            h = states[d, t] = p + "h"
    for t in range(T):
        out += [helper.make_node("Concat", [states["f", t], states["b", t]], [f"cat{t}"], axis=1),
                helper.make_node("Unsqueeze", [f"cat{t}", "ax1"], [f"u{t}"])]
    out.append(helper.make_node("Concat", [f"u{t}" for t in range(T)], ["y"], axis=1))
    return _save(path, out, "backward_loop_read_stacked",
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", T, features])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", T, 2 * hidden])], inits)
