"""Graphs for the cost benchmark (benchmarks/scaling.py) whose nodes sit in subgraphs and functions, or behind
shape arithmetic: shapes of 100k-node graph that a survey of session 24 found over 5 s or growing faster than
the nodes (see benchmarks/README.md). Each holds a 16-step unrolled tanh RNN besides (so the run fuses
something and the do-no-harm guard judges the result: a model with nothing to fuse is copied as it came).

Every generator is ``f(path, nodes) -> the node count it wrote``, subgraphs' and function bodies' nodes
counted, sized to about ``nodes``."""

from __future__ import annotations

RNN_STEPS, FEATURES, HIDDEN = 16, 8, 16
RNN_NODES = 6 * RNN_STEPS + 1  # (per step: Gather, 2 MatMuls, 2 Adds, Tanh; one Concat of the steps)


def _rnn_chain(nodes: list, inits: list, inputs: list, outputs: list, batch="B") -> None:
    """Append the unrolled tanh RNN over ``rx`` [T, B, F] (an input of its own unless a node computes it), from
    ``rh_init`` [B, H], with output ``ry`` [B, T * H]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits += [numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
              for name, shape in (("rW", (FEATURES, HIDDEN)), ("rR", (HIDDEN, HIDDEN)), ("rb", (HIDDEN,)))]
    h, steps = "rh_init", []
    for t in range(RNN_STEPS):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"rt{t}"))
        nodes += [helper.make_node("Gather", ["rx", f"rt{t}"], [f"rx{t}"], axis=0),
                  helper.make_node("MatMul", [f"rx{t}", "rW"], [f"rxw{t}"]),
                  helper.make_node("MatMul", [h, "rR"], [f"rhr{t}"]),
                  helper.make_node("Add", [f"rxw{t}", f"rhr{t}"], [f"rs{t}"]),
                  helper.make_node("Add", [f"rs{t}", "rb"], [f"rp{t}"]),
                  helper.make_node("Tanh", [f"rp{t}"], [f"rh{t}"])]
        h = f"rh{t}"
        steps.append(h)
    nodes.append(helper.make_node("Concat", steps, ["ry"], axis=1))
    if not any(n.output[0] == "rx" for n in nodes):
        inputs.append(helper.make_tensor_value_info("rx", TensorProto.FLOAT, [RNN_STEPS, batch, FEATURES]))
    inputs.append(helper.make_tensor_value_info("rh_init", TensorProto.FLOAT, [batch, HIDDEN]))
    outputs.append(helper.make_tensor_value_info("ry", TensorProto.FLOAT, [batch, RNN_STEPS * HIDDEN]))


def _save(path: str, nodes: list, inputs: list, outputs: list, inits: list, functions=(), domains=(), batch="B") -> None:
    import onnx
    from onnx import helper

    _rnn_chain(nodes, inits, inputs, outputs, batch)
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(helper.make_graph(nodes, "scoped", inputs, outputs, inits), opset_imports=opsets,
                          functions=list(functions))
    m.ir_version = 8
    onnx.save(m, path)


def _branch_ops(n: int, src: str, prefix: str, weight: str = "W") -> tuple[list, str]:
    """``n`` nodes in a row from ``src`` (Add w, Tanh, MatMul W, Sigmoid, repeated), reading ``w`` and
    ``weight`` from outside (captured, in a subgraph); returns them and the last output."""
    from onnx import helper

    out, cur = [], src
    for j in range(n):
        op = ("Add", "Tanh", "MatMul", "Sigmoid")[j % 4]
        reads = [cur, "w"] if op == "Add" else [cur, weight] if op == "MatMul" else [cur]
        out.append(helper.make_node(op, reads, [f"{prefix}{j}"]))
        cur = f"{prefix}{j}"
    return out, cur


def _weights(inits: list) -> None:
    import numpy as np
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    inits += [numpy_helper.from_array(np.full(FEATURES, 0.5, np.float32), "w"),
              numpy_helper.from_array((rng.standard_normal((FEATURES, FEATURES)) * 0.3).astype(np.float32), "W"),
              numpy_helper.from_array(np.array(0.0, np.float32), "zero")]


def ifs_in_a_row(path: str, nodes: int, branch: int = 20, constant: bool = False) -> int:
    """Ifs one after the other, each choosing between two ``branch``-node branches that capture the If
    before's output and two weights; the condition computed from the data (ReduceSum > 0), or with
    ``constant`` a constant the optimizer inlines (an exporter's rank test)."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph, inits, cur, k = [], [], "x", 0
    _weights(inits)
    if constant:
        inits.append(numpy_helper.from_array(np.array(True), "yes"))
    per_if = (2 if constant else 4) + 2 * branch
    while (k + 1) * per_if + RNN_NODES <= nodes or k == 0:
        p = f"i{k}_"
        then, t_out = _branch_ops(branch, cur, p + "t")
        other, e_out = _branch_ops(branch, cur, p + "e")
        cond = "yes" if constant else p + "c"
        if not constant:
            graph += [helper.make_node("ReduceSum", [cur], [p + "s"], keepdims=0),
                      helper.make_node("Greater", [p + "s", "zero"], [cond])]
        graph += [helper.make_node("If", [cond], [p + "y"],
                                   then_branch=helper.make_graph(then, p + "then", [], [_float(t_out)]),
                                   else_branch=helper.make_graph(other, p + "else", [], [_float(e_out)])),
                  helper.make_node("Relu", [p + "y"], [p + "o"])]
        cur, k = p + "o", k + 1
    _save(path, graph, [_float("x")], [_float(cur)], inits)
    return k * per_if + RNN_NODES


def _float(name: str):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", FEATURES])


def scans_in_a_row(path: str, nodes: int, body: int = 20) -> int:
    """Scans one after the other over x [10, B, F], each carrying ``s' = s * w + x_t`` (an elementwise
    recurrence, no native op's cell) and giving ``body - 2`` more nodes of it per step: nothing to fuse."""
    from onnx import TensorProto, helper

    graph, inits, cur, k = [], [], "x", 0
    _weights(inits)
    while (k + 1) * (body + 2) + RNN_NODES <= nodes or k == 0:
        p = f"s{k}_"
        ops, last = _branch_ops(body - 2, "s_out", "b")
        step = [helper.make_node("Mul", ["s_in", "w"], ["sw"]), helper.make_node("Add", ["sw", "xt"], ["s_out"])] + ops
        g = helper.make_graph(step, p + "body", [_float("s_in"), _float("xt")], [_float("s_out"), _float(last)])
        graph += [helper.make_node("Scan", ["s0", cur], [p + "sN", p + "ys"], body=g, num_scan_inputs=1),
                  helper.make_node("Add", [p + "ys", "x"], [p + "o"])]
        cur, k = p + "o", k + 1
    seq = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [10, "B", FEATURES]) for n in ("x", cur)]
    _save(path, graph, [seq[0], _float("s0")], [seq[1]], inits)
    return k * (body + 2) + RNN_NODES


def function_calls(path: str, nodes: int, body: int = 10, functions: int = 200) -> int:
    """Calls of model-local functions one after the other (``functions`` of them, ``body`` nodes each, called in
    turn): onnxruntime inlines every call, the main graph holds one node a call."""
    from onnx import helper

    opsets = [helper.make_opsetid("", 17)]
    funcs = []
    for f in range(functions):
        ops, last = _branch_ops(body, "a", "f")
        funcs.append(helper.make_function("local", f"F{f}", ["a", "w", "W"], [last], ops, opsets))
    graph, inits, cur, k = [], [], "x", 0
    _weights(inits)
    while (k + 1) * (body + 1) + RNN_NODES <= nodes or k == 0:
        graph.append(helper.make_node(f"F{k % functions}", [cur, "w", "W"], [f"c{k}"], domain="local"))
        cur, k = f"c{k}", k + 1
    _save(path, graph, [_float("x")], [_float(cur)], inits, funcs, ["local"])
    return k * (body + 1) + RNN_NODES


def shape_arithmetic(path: str, nodes: int) -> int:
    """Constant-foldable shape arithmetic (Expand, Reshape, Shape, Gather, Slice, Concat of Constants; 9 nodes a
    link) whose result the RNN's input is reshaped to: the RNN's input type is known only through it."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def const(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_v"))

    batch = 3
    graph = [const("k0", np.array([RNN_STEPS, batch, FEATURES], np.int64))]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "first"),
             numpy_helper.from_array(np.array([100], np.int64), "to_end")]
    cur, k = "k0", 0
    while len(graph) + 9 + RNN_NODES + 1 <= nodes or k == 0:
        p = f"k{k}_"
        graph += [const(p + "zeros", np.zeros(1, np.float32)), const(p + "one", np.array([1], np.int64)),
                  helper.make_node("Expand", [p + "zeros", cur], [p + "e"]),
                  helper.make_node("Reshape", [p + "e", cur], [p + "r"]),
                  helper.make_node("Shape", [p + "r"], [p + "sh"]),
                  helper.make_node("Gather", [p + "sh", "first"], [p + "d0"], axis=0),
                  helper.make_node("Slice", [p + "sh", p + "one", "to_end"], [p + "rest"]),
                  helper.make_node("Concat", [p + "d0", p + "rest"], [p + "cat"], axis=0),
                  helper.make_node("Mul", [p + "cat", p + "one"], [p + "next"])]
        cur, k = p + "next", k + 1
    graph.append(helper.make_node("Reshape", ["flat", cur], ["rx"]))
    count = len(graph) + RNN_NODES
    flat = helper.make_tensor_value_info("flat", TensorProto.FLOAT, [RNN_STEPS * batch * FEATURES])
    _save(path, graph, [flat], [], inits, batch=batch)
    return count
