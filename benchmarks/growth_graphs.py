"""Graphs that once made a pass's cost grow faster than the graph (a helper's audit, session 2026-12-01):
each repeats one small unit, so 25k / 50k / 100k / 200k nodes show whether the optimizer's cost is linear in
the units. Registered in ``scaling.py`` (``--graphs lengths,maskloops,flips,loopouts,sideinputs``).

* ``lengths``: a tanh RNN unrolled over T steps, each step's state kept where ``L > t`` (L: an int64 lengths
  input, compared with each step's constant index): 10 nodes a step, one masked RNN once fused.
* ``maskloops``: Loops stacked on one trip count, each body masking its state by ``max(|x_t|) > 0``: 13 nodes a
  Loop (body counted), one masked RNN per Loop, every mask overridden in one check model.
* ``flips``: independent double time reversals (two ``Slice(step=-1)`` reading the same bound constants), each
  of its own product of x: 4 nodes each, cancelled by CancelFlips.
* ``loopouts``: ``stacked_loops`` (9 nodes a Loop) with every Loop's final state a graph output.
* ``sideinputs``: tanh cells side by side, each unrolled over 16 steps of an input of its own (7 nodes a cell a
  step): one RNN per cell.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper, save

F, I64 = TensorProto.FLOAT, TensorProto.INT64
_vi = helper.make_tensor_value_info
_rng = np.random.default_rng(0)


def _w(name: str, shape) -> TensorProto:
    return numpy_helper.from_array((_rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _cell(p: str, x: str, h: str, k: str) -> list:
    """``tanh(x @ W{k} + h @ R{k} + b{k})`` into ``{p}hn``."""
    mk = helper.make_node
    return [mk("MatMul", [x, f"W{k}"], [p + "xw"]), mk("MatMul", [h, f"R{k}"], [p + "hr"]),
            mk("Add", [p + "xw", p + "hr"], [p + "s"]), mk("Add", [p + "s", f"b{k}"], [p + "a"]),
            mk("Tanh", [p + "a"], [p + "hn"])]


def _weights(k, features: int = 4, hidden: int = 4) -> list:
    return [_w(f"W{k}", (features, hidden)), _w(f"R{k}", (hidden, hidden)), _w(f"b{k}", (hidden,))]


def _save(path: str, nodes, inputs, outputs, inits, name: str, opset: int = 17) -> int:
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)
    return len(nodes)


def length_masked_chain(path: str, nodes: int) -> int:
    mk, steps = helper.make_node, max(2, nodes // 10)
    out, h, ys = [], "h0", []
    for t in range(steps):
        p = f"s{t}_"
        out += [mk("Constant", [], [p + "t"], value=numpy_helper.from_array(np.array(t, np.int64))),
                mk("Gather", ["x", p + "t"], [p + "x"], axis=0), mk("Greater", ["L", p + "t"], [p + "m"]),
                *_cell(p, p + "x", h, ""), mk("Where", [p + "m", p + "hn", h], [p + "h"]),
                mk("Unsqueeze", [p + "h", "axis0"], [p + "y"])]
        h = p + "h"
        ys.append(p + "y")
    out.append(mk("Concat", ys, ["y"], axis=0))
    inputs = [_vi("x", F, [steps, "B", 4]), _vi("L", I64, ["B", 1]), _vi("h0", F, ["B", 4])]
    inits = _weights("") + [numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    return _save(path, out, inputs, [_vi("y", F, [steps, "B", 4])], inits, "length_masked")


def _loops(nodes: int, per: int, body_of, outs: bool, name: str, opset: int) -> tuple:
    """Loops stacked on x, all on one trip count; ``body_of(k, cur)`` -> (body nodes, name of the step's h)."""
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.zeros((1, 4), np.float32), "h0"),
             numpy_helper.from_array(np.array(0.0, np.float32), "fz"), numpy_helper.from_array(np.array([-1], np.int64), "ax")]
    top = [mk("Shape", ["x"], ["xs"]), mk("Gather", ["xs", "i0"], ["T1"], axis=0), mk("Squeeze", ["T1", "i0"], ["T"])]
    cur, finals = "x", []
    for k in range(max(1, (nodes - 3) // per)):
        inits += _weights(k)
        body, h = body_of(k, cur)
        body += [mk("Identity", [h], ["yt"]), mk("Identity", ["cond"], ["cond_out"])]
        graph = helper.make_graph(body, f"body{k}", [_vi("it", I64, []), _vi("cond", TensorProto.BOOL, []), _vi("h", F, [1, 4])],
                                  [_vi("cond_out", TensorProto.BOOL, []), _vi(h, F, [1, 4]), _vi("yt", F, [1, 4])])
        top.append(mk("Loop", ["T", "true", "h0"], [f"h_last{k}", f"ys{k}"], body=graph))
        finals.append(_vi(f"h_last{k}", F, [1, 4]))
        cur = f"ys{k}"
    outputs = [_vi(cur, F, ["S", 1, 4])] + (finals if outs else [])
    return top, [_vi("x", F, ["T", 1, 4])], outputs, inits, name, opset


def masked_loops(path: str, nodes: int) -> int:
    mk = helper.make_node

    def body(k, cur):
        return [mk("Gather", [cur, "it"], ["xt"], axis=0), *_cell("", "xt", "h", k), mk("Abs", ["xt"], ["ab"]),
                mk("ReduceMax", ["ab", "ax"], ["mx"], keepdims=1), mk("Greater", ["mx", "fz"], ["m"]),
                mk("Where", ["m", "hn", "h"], ["hm"])], "hm"

    return _save(path, *_loops(nodes, 13, body, False, "masked_loops", 18))


def loops_with_outputs(path: str, nodes: int) -> int:
    def body(k, cur):
        return [helper.make_node("Gather", [cur, "it"], ["xt"], axis=0), *_cell("", "xt", "h", k)], "hn"

    return _save(path, *_loops(nodes, 9, body, True, "loops_with_outputs", 17))


def double_flips(path: str, nodes: int) -> int:
    mk, count = helper.make_node, max(1, (nodes - 2) // 4)
    inits = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in (("s", -1), ("e", -(2**63)), ("ax", 0), ("st", -1))]
    inits.append(_w("M", (4, 4)))
    out, sums = [mk("MatMul", ["x", "M"], ["xm"])], []
    for i in range(count):
        inits.append(_w(f"w{i}", (4,)))
        out += [mk("Mul", ["xm", f"w{i}"], [f"a{i}"]), mk("Slice", [f"a{i}", "s", "e", "ax", "st"], [f"f{i}"]),
                mk("Slice", [f"f{i}", "s", "e", "ax", "st"], [f"g{i}"]), mk("Tanh", [f"g{i}"], [f"o{i}"])]
        sums.append(f"o{i}")
    out.append(mk("Sum", sums, ["y"]))
    return _save(path, out, [_vi("x", F, ["T", "B", 4])], [_vi("y", F, ["T", "B", 4])], inits, "double_flips")


def cells_on_inputs_of_their_own(path: str, nodes: int, steps: int = 16) -> int:
    mk, cells = helper.make_node, max(1, nodes // (7 * steps))
    inits, inputs, outputs = [numpy_helper.from_array(np.array([0], np.int64), "axis0")], [], []
    out = [mk("Constant", [], [f"t{t}"], value=numpy_helper.from_array(np.array(t, np.int64))) for t in range(steps)]
    for c in range(cells):
        x, h, ys = f"x{c}", f"h0_{c}", []
        inputs += [_vi(x, F, [steps, "B", 4]), _vi(h, F, ["B", 4])]
        inits += _weights(c)
        for t in range(steps):
            p = f"c{c}_{t}_"
            out += [mk("Gather", [x, f"t{t}"], [p + "x"], axis=0), *_cell(p, p + "x", h, c),
                    mk("Unsqueeze", [p + "hn", "axis0"], [p + "y"])]
            h = p + "hn"
            ys.append(p + "y")
        out.append(mk("Concat", ys, [f"y{c}"], axis=0))
        outputs.append(_vi(f"y{c}", F, [steps, "B", 4]))
    return _save(path, out, inputs, outputs, inits, "cells_on_own_inputs")


GROWTH_GENERATORS = {"lengths": length_masked_chain, "maskloops": masked_loops, "flips": double_flips,
                     "loopouts": loops_with_outputs, "sideinputs": cells_on_inputs_of_their_own}
