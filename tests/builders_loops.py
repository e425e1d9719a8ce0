"""Hand-built ``Loop`` recurrences in the forms other exporters write (issue 14), with a numpy reference.

One tanh RNN step ``h = tanh(x_t @ W + h @ R + b)`` per iteration, varied along the axes the front end must
not care about:

* ``read``: how the body reads step t of x --
  ``gather0`` ``Gather(x, i)`` of time-major x (tf2onnx, jax2onnx);
  ``gather1`` ``Gather(x, i, axis=1)`` of batch-first x (TorchScript's ``x[:, t]``);
  ``slice0`` ``Squeeze(Slice(x, i, i + 1, axes=[0]), [0])``;
  ``slice1`` ``Squeeze(Slice(x, [0, i, 0], [B, i + 1, F]), [1])`` with B read from ``Shape(x)`` (jax's
  ``dynamic_index_in_dim``);
  ``gather2`` / ``slice2`` the same along axis 2 of x [B, F, T] (a Conv1d's output read as ``x[:, :, t]``);
* ``x_carried`` / ``w_carried``: x and the weights enter as loop-carried values passed on unchanged
  (jax2onnx) instead of outer-scope captures; ``passthrough`` = "identity" (an Identity node) or "direct";
* ``cast``: a float->float Cast on the new state (jax2onnx's "dtype fix");
* ``cond``: no trip count, the condition ``Cast(i + 1) < Cast(T)`` bounds the loop (int32; int16 is a near
  miss: it wraps past 32767);
* near misses (``miss``): ``next_step`` reads ``x[i + 1]``; ``two_steps`` slices ``[i, i + 2)``;
  ``part_batch`` slices only row 0 of the batch; ``x_changes`` carries x as ``x * 1.0001``.

The loop outputs the per-step h (scan output) and the final h.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F, H = 3, 4
INT_MAX = 2**63 - 1


@dataclass(frozen=True)
class LoopOpts:
    read: str = "gather0"  # gather0 | gather1 | slice0 | slice1 | gather2 | slice2 (x [B, F, T]: a Conv1d's output)
    x_carried: bool = True
    w_carried: bool = True
    passthrough: str = "identity"  # identity | direct
    cast: bool = True
    miss: str = ""  # "" | next_step | two_steps | part_batch | x_changes
    opset: int = 17
    cond: str = ""  # "": the trip count T bounds the loop; int32 | int16: no trip count, Cast(i + 1) < Cast(T) does

    @property
    def batch_first(self) -> bool:
        return self.read in ("gather1", "slice1")

    @property
    def time_axis(self) -> int:
        return int(self.read[-1])

    def x_of(self, steps: int, batch: int, rng: np.random.Generator) -> np.ndarray:
        """An input of ``steps`` time steps laid out as the loop reads it."""
        shape = [(steps, batch, F), (batch, steps, F), (batch, F, steps)][self.time_axis]
        return rng.standard_normal(shape).astype(np.float32)

    @property
    def name(self) -> str:
        parts = [self.read, "xcar" if self.x_carried else "xcap", "wcar" if self.w_carried else "wcap",
                 self.passthrough, "cast" if self.cast else "nocast", f"o{self.opset}"] + ([f"cond_{self.cond}"] if self.cond else [])
        return "-".join(parts + ([self.miss] if self.miss else []))


def _model(nodes: list, name: str, inputs: list, outputs: list, inits: list, opset: int = 17) -> onnx.ModelProto:
    """The graph as a checked model (IR version 8)."""
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _x_sizes(t_index: str = "i0", b_index: str | None = "i1") -> list:
    """Nodes reading x's time length ``T`` (a scalar) and, with ``b_index``, its batch size ``B1`` ([1]) from
    its shape; ``t_index`` / ``b_index`` name the [1] initializers holding their axes."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("Gather", ["xs", t_index], ["T1"], axis=0),
             helper.make_node("Squeeze", ["T1", "i0"], ["T"])]
    return nodes + ([helper.make_node("Gather", ["xs", b_index], ["B1"], axis=0)] if b_index else [])


def _zero_state(width: str = "iH", shape: str = "hshape", out: str = "h0") -> list:
    """Nodes making ``out`` = zeros [B, width] (``width``: a [1] initializer)."""
    return [helper.make_node("Concat", ["B1", width], [shape], axis=0),
            helper.make_node("Expand", ["zero", shape], [out])]


def _tanh_step(xt: str = "xt", W: str = "W", R: str = "R", b: str = "b") -> list:
    """Nodes of the tanh RNN step ``hn = tanh(xt @ W + h @ R + b)``."""
    return [helper.make_node("MatMul", [xt, W], ["xw"]), helper.make_node("MatMul", ["h", R], ["hr"]),
            helper.make_node("Add", ["xw", "hr"], ["s"]), helper.make_node("Add", ["s", b], ["s2"]),
            helper.make_node("Tanh", ["s2"], ["hn"])]


def _loop_counters() -> list:
    """A Loop body's first two inputs: the iteration number and the condition."""
    return [helper.make_tensor_value_info("it", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]


def weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((F, H)) * 0.5).astype(np.float32), (rng.standard_normal((H, H)) * 0.5).astype(np.float32),
            (rng.standard_normal(H) * 0.5).astype(np.float32))


def build(o: LoopOpts) -> onnx.ModelProto:
    W, R, b = weights()
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([1], np.int64), "i1"),
             numpy_helper.from_array(np.array([H], np.int64), "iH"),
             numpy_helper.from_array(np.array(True), "true")]
    t_ax, b_ax = [(0, 1), (1, 0), (2, 0)][o.time_axis]
    x_shape = [["T", "B", F], ["B", "T", F], ["B", F, "T"]][o.time_axis]
    nodes = _x_sizes("iT", "iB") + _zero_state()
    inits += [numpy_helper.from_array(np.array([t_ax], np.int64), "iT"),
              numpy_helper.from_array(np.array([b_ax], np.int64), "iB")]

    # ---- body
    carried = [("h", "h0")]
    if o.x_carried or o.miss == "x_changes":
        carried.append(("xc", "x"))
    if o.w_carried:
        carried += [("Wc", "W"), ("Rc", "R"), ("bc", "b")]
    names = dict(carried)
    xin = "xc" if ("xc" in names) else "x"
    Wn, Rn, bn = ("Wc", "Rc", "bc") if o.w_carried else ("W", "R", "b")
    body_inits = [numpy_helper.from_array(np.array([0], np.int64), "k0"),
                  numpy_helper.from_array(np.array([1], np.int64), "k1"),
                  numpy_helper.from_array(np.array([2], np.int64), "k2"),
                  numpy_helper.from_array(np.array([F], np.int64), "kF"),
                  numpy_helper.from_array(np.array([INT_MAX], np.int64), "kmax"),
                  numpy_helper.from_array(np.array(1, np.int64), "one")]
    bn_nodes = []
    idx = "it"
    if o.miss == "next_step":
        bn_nodes.append(helper.make_node("Add", ["it", "one"], ["itn"]))
        idx = "itn"
    if o.read.startswith("gather"):
        bn_nodes.append(helper.make_node("Gather", [xin, idx], ["xt"], axis=o.time_axis))
    elif o.read in ("slice0", "slice2"):
        ax = "k0" if o.read == "slice0" else "k2"
        bn_nodes += [helper.make_node("Unsqueeze", [idx, "k0"], ["st"]),
                     helper.make_node("Add", ["st", "k2" if o.miss == "two_steps" else "k1"], ["en"]),
                     helper.make_node("Slice", [xin, "st", "en", ax], ["xs1"]),
                     helper.make_node("Squeeze", ["xs1", ax], ["xt"])]
    else:  # slice1: starts [0, i, 0], ends [B (or 1), i + 1, F]
        bn_nodes += [helper.make_node("Unsqueeze", [idx, "k0"], ["st1"]),
                     helper.make_node("Concat", ["k0", "st1", "k0"], ["st"], axis=0),
                     helper.make_node("Shape", [xin], ["bxs"]),
                     helper.make_node("Gather", ["bxs", "k0"], ["bB"], axis=0)]
        first = "k1" if o.miss == "part_batch" else "bB"
        bn_nodes += [helper.make_node("Add", ["st1", "k2" if o.miss == "two_steps" else "k1"], ["en1"]),
                     helper.make_node("Concat", [first, "en1", "kF"], ["en"], axis=0),
                     helper.make_node("Slice", [xin, "st", "en"], ["xs1"]),
                     helper.make_node("Squeeze", ["xs1", "k1"], ["xt"])]
    bn_nodes += _tanh_step("xt", Wn, Rn, bn)
    h_out = "hn"
    if o.cast:
        bn_nodes.append(helper.make_node("Cast", ["hn"], ["hcast"], to=TensorProto.FLOAT))
        h_out = "hcast"
    outs = [h_out]
    for inner, _ in carried[1:]:
        if o.miss == "x_changes" and inner == "xc":
            body_inits.append(numpy_helper.from_array(np.array(1.0001, np.float32), "scale"))
            bn_nodes.append(helper.make_node("Mul", ["xc", "scale"], ["xc_out"]))
            outs.append("xc_out")
        elif o.passthrough == "identity":
            bn_nodes.append(helper.make_node("Identity", [inner], [f"{inner}_out"]))
            outs.append(f"{inner}_out")
        else:
            outs.append(inner)
    if o.cond:  # the condition i + 1 < T, compared in the type o.cond
        to = {"int32": TensorProto.INT32, "int16": TensorProto.INT16}[o.cond]
        bn_nodes += [helper.make_node("Add", ["it", "one"], ["it_next"]), helper.make_node("Cast", ["it_next"], ["it_c"], to=to),
                     helper.make_node("Cast", ["T"], ["T_c"], to=to), helper.make_node("Less", ["it_c", "T_c"], ["cond_out"])]
    else:
        bn_nodes.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
    bn_nodes.append(helper.make_node("Identity", ["hn"], ["y"]))
    shapes = {"h": [None, H], "xc": x_shape, "Wc": [F, H], "Rc": [H, H], "bc": [H]}
    body_inputs = _loop_counters() + [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n, _ in carried]
    body_outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])]
    body_outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outs]
    body_outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, H]))
    body = helper.make_graph(bn_nodes, "body", body_inputs, body_outputs, body_inits)
    loop_outs = ["h_last"] + [f"{n}_final" for n, _ in carried[1:]] + ["ys"]
    nodes.append(helper.make_node("Loop", ["" if o.cond else "T", "true"] + [init for _, init in carried], loop_outs, body=body))
    graph_outs = [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
                  helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])]
    return _model(nodes, "loops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)], graph_outs, inits,
                  o.opset)


def reference(o: LoopOpts, x: np.ndarray) -> list[np.ndarray]:
    """ys [T, B, H] (time-major, as the Loop stacks them) and the final h."""
    W, R, b = weights()
    xt = [x, np.swapaxes(x, 0, 1), np.transpose(x, (2, 0, 1))][o.time_axis]
    h = np.zeros((xt.shape[1], H), np.float32)
    ys = []
    for t in range(xt.shape[0]):
        h = np.tanh(xt[t] @ W + h @ R + b).astype(np.float32)
        ys.append(h)
    return [np.stack(ys), h]


def all_variants() -> list[LoopOpts]:
    out = []
    for read in ("gather0", "gather1", "slice0", "slice1"):
        for x_carried in (True, False):
            for w_carried in (True, False):
                for passthrough in (("identity", "direct") if (x_carried or w_carried) else ("identity",)):
                    out.append(LoopOpts(read, x_carried, w_carried, passthrough, cast=read != "slice0"))
    out.append(LoopOpts("gather0", opset=13, cast=False))
    out.append(LoopOpts("slice1", opset=21))
    out.append(LoopOpts("gather0", cond="int32"))
    out += [LoopOpts("gather2", False, False), LoopOpts("gather2"), LoopOpts("slice2", True, False, "direct")]
    return out


NEAR_MISSES = [
    LoopOpts("gather0", miss="next_step"),
    LoopOpts("slice0", miss="two_steps"),
    LoopOpts("slice1", miss="two_steps"),
    LoopOpts("slice1", miss="part_batch"),
    LoopOpts("gather0", miss="x_changes"),
    LoopOpts("gather1", x_carried=False, miss="next_step"),
    LoopOpts("gather0", cond="int16"),  # i + 1 < T in int16: wraps past 32767, so it is no proof of T steps
    LoopOpts("gather2", miss="next_step"),
    LoopOpts("slice2", miss="two_steps"),
]


# --------------------------------------------------------------------------- several cells per step (item 3)

STACK_H = (4, 3, 5)  # hidden sizes of the stacked cells, bottom first


@dataclass(frozen=True)
class StackOpts:
    """A Loop whose body runs ``cells`` tanh RNN cells per step, cell k reading cell k-1's new h.

    ``low_seq``: the bottom cell's per-step h is a loop output too. ``skip``: cell 2 reads ``concat(x_t, h1_new)``
    (a skip connection: its op reads the Y below beside x, unmasked only). ``fan`` (3 cells): cells 2 and 3 both
    read cell 1's new h, the per-step output concatenates theirs (two ops over one Y). Near misses (``miss``): ``old`` cell 2
    reads h1 of the previous step (the state, not the new output); ``feedback`` cell 1 also reads cell 2's state; ``mixed_old`` a per-step output concatenates
    cell 1's state before the step with the top cell's new h. ``mixed``: the per-step output concatenates the
    bottom and the top cell's new h (a head over two cells' Y), unmasked only.

    ``front="scan"`` writes the same step as a ``Scan`` body (x scanned, no iteration number), optionally
    ``masked`` (a scanned [T, B] bool: every cell keeps its h where it is false, the output is zero there) and
    ``reverse`` (``scan_input_directions=1``, outputs stacked in processing order); ``reads_kept`` (masked):
    cell k reads the kept h of the cell below, ``Where(m, new, old)``, as a jax step written by hand does
    (``miss="kept_swapped"``: ``Where(m, old, new)``, the input held where the mask is valid)."""

    cells: int = 2
    low_seq: bool = False
    miss: str = ""
    mixed: bool = False
    front: str = "loop"
    masked: bool = False
    reverse: bool = False
    reads_kept: bool = False  # (masked) cell k reads the kept h of the cell below, Where(m, new, old) (jax)
    skip: bool = False  # cell 2 reads concat(x_t, h1_new)
    fan: bool = False  # (3 cells) cell 3 reads cell 1's new h as cell 2 does; the output is concat(h2_new, h3_new)

    @property
    def name(self) -> str:
        opts = [self.front if self.front != "loop" else ""] + ["masked" if self.masked else "", "rev" if self.reverse else "",
                                                               "kept" if self.reads_kept else "",
                                                               "skip" if self.skip else "", "fan" if self.fan else ""]
        return "-".join([f"cells{self.cells}"] + [s for s in opts if s] + (["lowseq"] if self.low_seq else [])
                        + (["mixed"] if self.mixed else []) + ([self.miss] if self.miss else []))


def stack_weights(cells: int, skip: bool = False, fan: bool = False):
    rng = np.random.default_rng(7)
    out, width = [], F
    for k in range(cells):
        h = STACK_H[k]
        w_in = width + F if (k == 1 and skip) else STACK_H[0] if (k == 2 and fan) else width
        out.append([(rng.standard_normal(s) * 0.5).astype(np.float32) for s in ((w_in, h), (h, h), (h,))])
        width = h
    q = (rng.standard_normal((STACK_H[1], STACK_H[0])) * 0.5).astype(np.float32)  # feedback: h2 @ Q into cell 1
    return out, q


def build_stack(o: StackOpts) -> onnx.ModelProto:
    ws, q = stack_weights(o.cells, o.skip, o.fan)
    inits = [numpy_helper.from_array(np.array(True), "true"), numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1")]
    nodes = _x_sizes()
    body_inits = [numpy_helper.from_array(q, "Q")]
    bn = [helper.make_node("Gather", ["x", "it"], ["u0"], axis=0)]
    for k, (W, R, b) in enumerate(ws):
        h = STACK_H[k]
        inits.append(numpy_helper.from_array(np.array([h], np.int64), f"iH{k}"))
        nodes += _zero_state(f"iH{k}", f"hshape{k}", f"h0_{k}")
        body_inits += [numpy_helper.from_array(W, f"W{k}"), numpy_helper.from_array(R, f"R{k}"),
                       numpy_helper.from_array(b, f"b{k}")]
        u = f"u{k}"
        if k == 1 and o.skip:
            bn.append(helper.make_node("Concat", ["u0", "hn0"], ["u1"], axis=1))
        elif k == 1 and o.miss == "old":
            u = "h0s"
        elif k > 0 and o.reads_kept:  # the kept h of the cell below, Where(m, new, old), as a jax step writes it
            new_old = [f"hn{k - 1}", f"h{k - 1}s"][::-1 if o.miss == "kept_swapped" else 1]  # (a near miss: swapped)
            bn += [helper.make_node("Where", ["mu", *new_old], [f"hk{k - 1}"]),
                   helper.make_node("Identity", [f"hk{k - 1}"], [u])]
        elif k > 0:
            bn.append(helper.make_node("Identity", [f"hn{0 if (k == 2 and o.fan) else k - 1}"], [u]))
        bn += [helper.make_node("MatMul", [u, f"W{k}"], [f"xw{k}"]),
               helper.make_node("MatMul", [f"h{k}s", f"R{k}"], [f"hr{k}"]),
               helper.make_node("Add", [f"xw{k}", f"hr{k}"], [f"s{k}"])]
        pre = f"s{k}"
        if k == 0 and o.miss == "feedback":
            bn += [helper.make_node("MatMul", ["h1s", "Q"], ["fb"]), helper.make_node("Add", [pre, "fb"], ["sfb"])]
            pre = "sfb"
        bn += [helper.make_node("Add", [pre, f"b{k}"], [f"t{k}"]), helper.make_node("Tanh", [f"t{k}"], [f"hn{k}"])]
    top = f"hn{o.cells - 1}"
    if o.fan:  # (two cells over one: both read)
        bn.append(helper.make_node("Concat", ["hn1", "hn2"], ["yfan"], axis=1))
        top = "yfan"
    if o.front == "scan":
        return _stack_scan(o, nodes, inits, bn[1:], body_inits, top)
    ys = [top]
    if o.mixed or o.miss == "mixed_old":
        bn.append(helper.make_node("Concat", ["hn0" if o.mixed else "h0s", top], ["ymix"], axis=1))
        ys = ["ymix"]
    if o.low_seq:
        ys.append("hn0")
    bn.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
    for j, y in enumerate(ys):
        bn.append(helper.make_node("Identity", [y], [f"y{j}"]))
    body_inputs = _loop_counters()
    body_inputs += [helper.make_tensor_value_info(f"h{k}s", TensorProto.FLOAT, [None, STACK_H[k]]) for k in range(o.cells)]
    body_outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])]
    body_outputs += [helper.make_tensor_value_info(f"hn{k}", TensorProto.FLOAT, [None, STACK_H[k]]) for k in range(o.cells)]
    body_outputs += [helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, [None, None]) for j in range(len(ys))]
    body = helper.make_graph(bn, "body", body_inputs, body_outputs, body_inits)
    finals = [f"h_last{k}" for k in range(o.cells)]
    seqs = [f"ys{j}" for j in range(len(ys))]
    nodes.append(helper.make_node("Loop", ["T", "true"] + [f"h0_{k}" for k in range(o.cells)], finals + seqs, body=body))
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", "B", None]) for n in seqs]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", STACK_H[k]]) for k, n in enumerate(finals)]
    return _model(nodes, "stacked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])], outs, inits)


def _stack_scan(o: StackOpts, nodes: list, inits: list, bn: list, body_inits: list, top: str) -> onnx.ModelProto:
    """The stacked step (its nodes after the read of x_t, ``u0``) as a Scan body."""
    states = []
    made = {n.output[0] for n in bn}
    for k in range(o.cells):
        if o.masked and f"hk{k}" not in made:  # h kept where the mask is false
            bn.append(helper.make_node("Where", ["mu", f"hn{k}", f"h{k}s"], [f"hk{k}"]))
        states.append(f"hk{k}" if o.masked else f"hn{k}")
    ys = [top] + (["hn0"] if o.low_seq else [])
    if o.mixed or o.miss == "mixed_old":
        bn.append(helper.make_node("Concat", ["hn0" if o.mixed else "h0s", top], ["ymix"], axis=1))
        ys = ["ymix"]
    if o.masked:
        bn.insert(0, helper.make_node("Unsqueeze", ["m", "ax1"], ["mu"]))
        body_inits.append(numpy_helper.from_array(np.array([1], np.int64), "ax1"))
        body_inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zf"))
        ys_out = []
        for j, y in enumerate(ys):
            bn.append(helper.make_node("Where", ["mu", y, "zf"], [f"y{j}"]))
            ys_out.append(f"y{j}")
    else:
        for j, y in enumerate(ys):
            bn.append(helper.make_node("Identity", [y], [f"y{j}"]))
    body_inputs = [helper.make_tensor_value_info(f"h{k}s", TensorProto.FLOAT, [None, STACK_H[k]]) for k in range(o.cells)]
    body_inputs.append(helper.make_tensor_value_info("u0", TensorProto.FLOAT, [None, F]))
    if o.masked:
        body_inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [None]))
    body_outputs = [helper.make_tensor_value_info(s, TensorProto.FLOAT, [None, STACK_H[k]]) for k, s in enumerate(states)]
    body_outputs += [helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, [None, None]) for j in range(len(ys))]
    body = helper.make_graph(bn, "body", body_inputs, body_outputs, body_inits)
    finals = [f"h_last{k}" for k in range(o.cells)]
    seqs = [f"ys{j}" for j in range(len(ys))]
    scanned = ["x"] + (["mask"] if o.masked else [])
    attrs = dict(num_scan_inputs=len(scanned))
    if o.reverse:
        attrs.update(scan_input_directions=[1] * len(scanned), scan_output_directions=[1] * len(ys))
    nodes.append(helper.make_node("Scan", [f"h0_{k}" for k in range(o.cells)] + scanned, finals + seqs, body=body, **attrs))
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", "B", None]) for n in seqs]
    outs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", STACK_H[k]]) for k, n in enumerate(finals)]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])]
    if o.masked:
        ins.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T", "B"]))
    return _model(nodes, "stacked_scan", ins, outs, inits)


def stack_reference(o: StackOpts, x: np.ndarray, mask: np.ndarray | None = None) -> list[np.ndarray]:
    """The loop's outputs: the per-step outputs [T, B, .], then every cell's final h. A Scan with
    ``reverse`` runs from the last step to the first and stacks its outputs in that order (as x reads)."""
    ws, _ = stack_weights(o.cells, o.skip, o.fan)
    hs = [np.zeros((x.shape[1], STACK_H[k]), np.float32) for k in range(o.cells)]
    tops, lows = [], []
    order = range(x.shape[0] - 1, -1, -1) if o.reverse else range(x.shape[0])
    for t in order:
        u = x[t]
        m = np.ones((x.shape[1], 1), bool) if mask is None else mask[t][:, None]
        news = []
        for k, (W, R, b) in enumerate(ws):
            new = np.tanh((news[0] if (k == 2 and o.fan) else u) @ W + hs[k] @ R + b).astype(np.float32)
            news.append(new)
            hs[k] = np.where(m, new, hs[k])
            u = np.concatenate([x[t], new], -1) if (o.skip and k == 0) else new
            if k == 0:
                lows.append(np.where(m, new, 0.0).astype(np.float32))
        top = np.concatenate([lows[-1], u], -1) if o.mixed else np.concatenate(news[1:], -1) if o.fan else u
        tops.append(np.where(m, top, 0.0).astype(np.float32))
    if o.reverse:  # scan_output_directions=1: the outputs land back in time order
        tops, lows = tops[::-1], lows[::-1]
    return [np.stack(tops)] + ([np.stack(lows)] if o.low_seq else []) + hs


STACK_FORMS = [StackOpts(2), StackOpts(3), StackOpts(2, low_seq=True), StackOpts(3, low_seq=True),
               StackOpts(2, mixed=True), StackOpts(3, mixed=True), StackOpts(2, skip=True),
               StackOpts(3, skip=True, low_seq=True), StackOpts(3, fan=True), StackOpts(3, skip=True, fan=True)]
STACK_MISSES = [StackOpts(2, miss="old"), StackOpts(2, miss="feedback"), StackOpts(2, miss="mixed_old")]
# several cells in one Scan body (issue 14 item 3 for Scan)
SCAN_STACK_FORMS = [StackOpts(2, front="scan"), StackOpts(3, front="scan", low_seq=True),
                    StackOpts(2, front="scan", masked=True), StackOpts(3, front="scan", masked=True, low_seq=True),
                    StackOpts(2, front="scan", reverse=True), StackOpts(2, front="scan", masked=True, reverse=True),
                    StackOpts(3, front="scan", mixed=True), StackOpts(2, front="scan", reverse=True, mixed=True),
                    StackOpts(2, front="scan", masked=True, reads_kept=True),
                    StackOpts(3, front="scan", masked=True, reverse=True, reads_kept=True, low_seq=True),
                    StackOpts(2, front="scan", skip=True), StackOpts(2, front="scan", reverse=True, skip=True),
                    StackOpts(3, front="scan", fan=True, low_seq=True), StackOpts(3, front="scan", reverse=True, fan=True)]
SCAN_STACK_MISSES = [StackOpts(2, front="scan", miss=m) for m in ("old", "feedback", "mixed_old")] + [
    StackOpts(2, front="scan", masked=True, reads_kept=True, miss="kept_swapped")]


# --------------------------------------------------------------------------- a head on h inside the step (item 4)

HEAD_K = 2  # the head's output width


@dataclass(frozen=True)
class HeadOpts:
    """A Loop whose scan output is ``head(h_t)`` (and the final h), h the tanh RNN step above.

    Heads fused (one RNN, the head applied to Y after it): ``gemm_relu`` Relu(Gemm(h, D, d));
    ``softmax`` Softmax(MatMul(h, D) + d, axis=-1); ``concat_x`` MatMul(Concat([h, x_t], 1), E) (reads x_t too);
    ``glu`` a = Split(h @ G) in two, a0 * Sigmoid(a1); ``layernorm`` LayerNormalization(h) (opset 17);
    ``prev_h`` Relu(Gemm(h_{t-1}, D, d)), the head on the state before the update (Y one step later, h0 first).
    Near misses (``miss``): ``rows_mean`` h - ReduceMean(h, axis 0) (mixes batch rows); ``transpose``
    MatMul(Transpose(h), h) (mixes rows); ``counter`` h * Cast(i) (reads the iteration number);
    ``reverse_rows`` h read through a batch reversal."""

    head: str = "gemm_relu"
    miss: str = ""
    reverse: bool = False  # x read from its last step to its first (Gather(x, T - 1 - i); a Scan's direction)
    front: str = "loop"  # or "scan": the same step as a Scan body

    @property
    def name(self) -> str:
        return (self.miss or self.head) + ("-rev" if self.reverse else "") + ("-scan" if self.front == "scan" else "")


def head_weights():
    rng = np.random.default_rng(11)
    g = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)  # noqa: E731
    return dict(D=g(H, HEAD_K), d=g(HEAD_K), E=g(H + F, HEAD_K), G=g(H, 2 * HEAD_K), scale=g(H), bias=g(H))


def build_head(o: HeadOpts) -> onnx.ModelProto:
    W, R, b = weights()
    hw = head_weights()
    inits = [numpy_helper.from_array(v, k) for k, v in dict(W=W, R=R, b=b, **hw).items()]
    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(True), "true"),
              numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1"),
              numpy_helper.from_array(np.array([H], np.int64), "iH")]
    nodes = _x_sizes() + _zero_state()
    body_inits = [numpy_helper.from_array(np.array([0], np.int64), "k0"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    bn = []
    idx = "it"
    if o.reverse:
        bn += [helper.make_node("Sub", ["T", "one"], ["tm1"]), helper.make_node("Sub", ["tm1", "it"], ["rit"])]
        idx = "rit"
    bn += [helper.make_node("Gather", ["x", idx], ["xt"], axis=0)] + _tanh_step()
    kind = o.miss or o.head
    src = "h" if kind == "prev_h" else "hn"
    if kind in ("gemm_relu", "prev_h"):
        bn += [helper.make_node("Gemm", [src, "D", "d"], ["g"]), helper.make_node("Relu", ["g"], ["y"])]
    elif kind == "softmax":
        bn += [helper.make_node("MatMul", ["hn", "D"], ["m"]), helper.make_node("Add", ["m", "d"], ["a"]),
               helper.make_node("Softmax", ["a"], ["y"], axis=-1)]
    elif kind == "concat_x":
        bn += [helper.make_node("Concat", ["hn", "xt"], ["hx"], axis=1), helper.make_node("MatMul", ["hx", "E"], ["y"])]
    elif kind == "glu":
        bn += [helper.make_node("MatMul", ["hn", "G"], ["gg"]),
               helper.make_node("Split", ["gg"], ["a0", "a1"], axis=1, num_outputs=2),
               helper.make_node("Sigmoid", ["a1"], ["sa"]), helper.make_node("Mul", ["a0", "sa"], ["y"])]
    elif kind == "layernorm":
        bn += [helper.make_node("LayerNormalization", ["hn", "scale", "bias"], ["y"], axis=-1)]
    elif kind == "rows_mean":
        bn += [helper.make_node("ReduceMean", ["hn", "k0"], ["mu"], keepdims=1), helper.make_node("Sub", ["hn", "mu"], ["y"])]
    elif kind == "transpose":
        bn += [helper.make_node("Transpose", ["hn"], ["ht"], perm=[1, 0]), helper.make_node("MatMul", ["hn", "ht"], ["hh"]),
               helper.make_node("MatMul", ["hh", "hn"], ["y"])]
    elif kind == "counter":
        bn += [helper.make_node("Cast", ["it"], ["itf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["hn", "itf"], ["y"])]
    else:
        raise ValueError(kind)
    if o.front == "scan":
        return _head_scan(o, nodes, inits, [n for n in bn if "xt" not in n.output and n.output[0] not in ("tm1", "rit")],
                          body_inits)
    bn += [helper.make_node("Identity", ["cond"], ["cond_out"])]
    body = helper.make_graph(
        bn, "body", _loop_counters() + [helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, H])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("hn", TensorProto.FLOAT, [None, H]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0"], ["h_last", "ys"], body=body))
    return _head_model(nodes, "head", inits)


def _head_scan(o: HeadOpts, nodes: list, inits: list, bn: list, body_inits: list) -> onnx.ModelProto:
    """The head step as a Scan body: x scanned (backwards with ``reverse``), ys stacked in processing order."""
    body = helper.make_graph(
        bn, "body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, H]), helper.make_tensor_value_info("xt", TensorProto.FLOAT, [None, F])],
        [helper.make_tensor_value_info("hn", TensorProto.FLOAT, [None, H]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        body_inits)
    attrs = dict(num_scan_inputs=1)
    if o.reverse:
        attrs["scan_input_directions"] = [1]
    nodes.append(helper.make_node("Scan", ["h0", "x"], ["h_last", "ys"], body=body, **attrs))
    return _head_model(nodes, "head_scan", inits)


def _head_model(nodes: list, name: str, inits: list) -> onnx.ModelProto:
    """x [T, B, F] -> ys (the head of every step's h) and the final h (opset 18: LayerNormalization)."""
    return _model(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", None]),
                   helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])], inits, 18)


def head_reference(o: HeadOpts, x: np.ndarray) -> list[np.ndarray]:
    """ys (head of every step's h, in iteration order) and the final h."""
    W, R, b = weights()
    w = head_weights()
    h = np.zeros((x.shape[1], H), np.float32)
    ys = []
    for i in range(x.shape[0]):
        xt = x[x.shape[0] - 1 - i] if o.reverse else x[i]
        h_read, h = h, np.tanh(xt @ W + h @ R + b).astype(np.float32)
        if o.head in ("gemm_relu", "prev_h"):
            y = np.maximum((h if o.head == "gemm_relu" else h_read) @ w["D"] + w["d"], 0)
        elif o.head == "softmax":
            a = h @ w["D"] + w["d"]
            e = np.exp(a - a.max(-1, keepdims=True))
            y = e / e.sum(-1, keepdims=True)
        elif o.head == "concat_x":
            y = np.concatenate([h, xt], 1) @ w["E"]
        elif o.head == "glu":
            a0, a1 = np.split(h @ w["G"], 2, axis=1)
            y = a0 / (1 + np.exp(-a1))
        else:  # layernorm
            mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
            y = (h - mu) / np.sqrt(var + 1e-5) * w["scale"] + w["bias"]
        ys.append(y.astype(np.float32))
    return [np.stack(ys), h]


HEAD_FORMS = [HeadOpts(h) for h in ("gemm_relu", "softmax", "concat_x", "glu", "layernorm")] + [
    HeadOpts("concat_x", reverse=True), HeadOpts("gemm_relu", reverse=True)] + [
    HeadOpts(h, front="scan") for h in ("gemm_relu", "concat_x", "glu", "prev_h")] + [
    HeadOpts("concat_x", reverse=True, front="scan"), HeadOpts("prev_h"), HeadOpts("prev_h", reverse=True),
    HeadOpts("prev_h", reverse=True, front="scan")]
HEAD_MISSES = [HeadOpts(miss=m) for m in ("rows_mean", "transpose", "counter")] + [
    HeadOpts(miss=m, front="scan") for m in ("rows_mean",)]


# --------------------------------------------------------------------------- length masks written by hand (item 8)


@dataclass(frozen=True)
class LengthOpts:
    """A Loop over the tanh RNN step whose state is kept where a hand-written mask is false; the mask compares
    the iteration number with a graph input ``L`` of per-row lengths.

    ``cmp``: ``lt`` Less(i, L); ``gt`` Greater(L, i); ``le1`` LessOrEqual(i + 1, L); ``le`` LessOrEqual(i, L);
    ``ge`` GreaterOrEqual(i, L)
    (valid *from* step L on: pre-padded rows); ``xmask`` no comparison with L: the step's mask is computed from
    x_t, ``ReduceMax(Cast(x_t != 0), axis 1)`` (a row is padding where its features are all 0). ``dtype`` int64, or int32 (i cast to int32); ``unit``: L is
    [B, 1]; ``keep``: ``muladd`` m*new + (1-m)*h with m cast to float, or ``where`` Where(m, new, h); ``out``:
    ``zero`` the new h where valid, zeros elsewhere, or ``carry`` the kept h. Near misses (``miss``):
    ``reset`` h = m * new (not kept); ``input_only`` the mask multiplies x_t only; ``lengths_change`` L is
    carried and decremented every step; ``batch_rows`` (xmask) one mask for all rows, reduced over the batch.
    ``counter``: the compared i is a carried counter starting there, not the iteration number (a jax carry's
    ``t`` from 1, compared as ``t <= L``). ``l_expr``: the compared lengths are computed in the body, ``5-L``
    (jax's pre-padded ``t >= T - lengths``), ``L+1`` or ``L-1``; ``T-L``: ``Neg(L) + T``, T x's time length
    read outside the loop (TorchScript's pre-padded mask)."""

    cmp: str = "lt"
    dtype: str = "int64"
    unit: bool = False
    keep: str = "muladd"
    out: str = "zero"
    miss: str = ""
    front: str = "loop"  # or "scan" (xmask only: x scanned, the mask computed in the body)
    pre: bool = False  # the cell reads tanh(x_t * P + Q), P and Q per feature: a map of x_t inside the step
    counter: int | None = None
    l_expr: str = ""
    carried: bool = False  # L passed through the loop as a carried value the body returns as it is (tf.while_loop)
    # i and L cast to this type before they are compared: "float" (tf2onnx), "int64" (of int32 lengths); near misses
    # "int16", and "int32" of int64 lengths (each wraps: L = 2**31 compares as -2**31)
    cast: str = ""
    # "time": x read at t = T - 1 - i and t compared with L (a TorchScript backward loop; outputs in processing order)
    reverse: str = ""

    @property
    def name(self) -> str:
        parts = [self.cmp, self.dtype, "unit" if self.unit else "vec", self.keep, self.out]
        parts += [] if self.counter is None else [f"from{self.counter}"]
        parts += [self.l_expr] if self.l_expr else []
        parts += (["carried"] if self.carried else []) + ([f"as_{self.cast}"] if self.cast else [])
        parts += [f"reverse_{self.reverse}"] if self.reverse else []
        return "-".join(parts + ([self.miss] if self.miss else []) + (["pre"] if self.pre else [])
                        + (["scan"] if self.front == "scan" else []))


def _valid(o: LengthOpts, t: int, L: np.ndarray, x: np.ndarray) -> np.ndarray:
    if o.cmp == "xmask":
        return (x[t] != 0).any(-1)
    L = {"": L, "5-L": 5 - L, "L+1": L + 1, "L-1": L - 1, "T-L": x.shape[0] - L}[o.l_expr].reshape(-1)
    t += o.counter or 0
    return {"lt": t < L, "gt": L > t, "le1": t + 1 <= L, "le": t <= L, "ge": t >= L}[o.cmp]


def build_lengths(o: LengthOpts) -> onnx.ModelProto:
    W, R, b = weights()
    it = TensorProto.INT64 if o.dtype == "int64" else TensorProto.INT32
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1"),
             numpy_helper.from_array(np.array([H], np.int64), "iH")]
    nodes = _x_sizes() + _zero_state()
    body_inits = [numpy_helper.from_array(np.array(1, np.int64 if o.dtype == "int64" else np.int32), "one"),
                  numpy_helper.from_array(np.array(1.0, np.float32), "onef"),
                  numpy_helper.from_array(np.array(0.0, np.float32), "zerof")]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)]
    i = "it"
    if o.reverse:  # x read at t = (T - 1) - i
        body_inits.append(numpy_helper.from_array(np.array(1, np.int64), "one64"))
        bn = [helper.make_node("Sub", ["T", "one64"], ["Tm1"]), helper.make_node("Sub", ["Tm1", "it"], ["t_rev"]),
              helper.make_node("Gather", ["x", "t_rev"], ["xt"], axis=0)]
        i = "t_rev"
    if o.counter is not None:
        i = "tc"
        bn.append(helper.make_node("Add", ["tc", "one"], ["tn"]))
        inits.append(numpy_helper.from_array(np.array(o.counter, np.int64 if o.dtype == "int64" else np.int32), "t0"))
    elif o.dtype == "int32":
        bn.append(helper.make_node("Cast", [i], ["it32"], to=TensorProto.INT32))
        i = "it32"
    L = "Lc" if o.miss == "lengths_change" else ("Lp" if o.carried else "L")
    if o.l_expr == "T-L":  # Neg(L) + T, T x's time length read outside (TorchScript's pre-padded t >= T - lengths)
        T_l = "T"
        if o.dtype == "int32":
            nodes.append(helper.make_node("Cast", ["T"], ["T32"], to=TensorProto.INT32))
            T_l = "T32"
        bn += [helper.make_node("Neg", [L], ["Ln"]), helper.make_node("Add", ["Ln", T_l], ["Lx"])]
        L = "Lx"
    elif o.l_expr:  # the compared lengths computed in the body from L and a constant
        c = np.array(5 if o.l_expr == "5-L" else 1, np.int64 if o.dtype == "int64" else np.int32)
        body_inits.append(numpy_helper.from_array(c, "lc"))
        ins = ["lc", L] if o.l_expr == "5-L" else [L, "lc"]
        bn.append(helper.make_node("Add" if o.l_expr == "L+1" else "Sub", ins, ["Lx"]))
        L = "Lx"
    if o.cast:  # (i and L compared in another type)
        to = {"float": TensorProto.FLOAT, "int16": TensorProto.INT16, "int32": TensorProto.INT32, "int64": TensorProto.INT64}[o.cast]
        bn += [helper.make_node("Cast", [i], ["i_as"], to=to), helper.make_node("Cast", [L], ["L_as"], to=to)]
        i, L = "i_as", "L_as"
    if o.cmp == "xmask":
        bn += [helper.make_node("Equal", ["xt", "zerof"], ["x0"]), helper.make_node("Not", ["x0"], ["xn"]),
               helper.make_node("Cast", ["xn"], ["xnf"], to=TensorProto.FLOAT),
               helper.make_node("ReduceMax", ["xnf"], ["xany"], axes=[1], keepdims=int(o.unit))]
        if o.miss == "batch_rows":
            bn.append(helper.make_node("ReduceMin", ["xany"], ["xall"], axes=[0], keepdims=1))
        bn.append(helper.make_node("Cast", ["xall" if o.miss == "batch_rows" else "xany"], ["m"], to=TensorProto.BOOL))
    elif o.cmp == "lt":
        bn.append(helper.make_node("Less", [i, L], ["m"]))
    elif o.cmp == "gt":
        bn.append(helper.make_node("Greater", [L, i], ["m"]))
    elif o.cmp == "le1":
        bn += [helper.make_node("Add", [i, "one"], ["i1p"]), helper.make_node("LessOrEqual", ["i1p", L], ["m"])]
    elif o.cmp == "le":
        bn.append(helper.make_node("LessOrEqual", [i, L], ["m"]))
    else:
        bn.append(helper.make_node("GreaterOrEqual", [i, L], ["m"]))
    m = "m"
    if not o.unit:  # [B] -> [B, 1]
        bn.append(helper.make_node("Unsqueeze", ["m", "k1"], ["mu"]))
        body_inits.append(numpy_helper.from_array(np.array([1], np.int64), "k1"))
        m = "mu"
    bn.append(helper.make_node("Cast", [m], ["mf"], to=TensorProto.FLOAT))
    xt = "xt"
    if o.miss == "input_only":
        bn.append(helper.make_node("Mul", ["xt", "mf"], ["xm"]))
        xt = "xm"
    if o.pre:
        P, Q = _pre_map()
        body_inits += [numpy_helper.from_array(P, "P"), numpy_helper.from_array(Q, "Q")]
        bn += [helper.make_node("Mul", [xt, "P"], ["xp"]), helper.make_node("Add", ["xp", "Q"], ["xq"]),
               helper.make_node("Tanh", ["xq"], ["xmap"])]
        xt = "xmap"
    bn += _tanh_step(xt)
    if o.miss == "input_only":
        bn.append(helper.make_node("Identity", ["hn"], ["hk"]))
    elif o.miss == "reset":
        bn.append(helper.make_node("Mul", ["mf", "hn"], ["hk"]))
    elif o.keep == "where":
        bn.append(helper.make_node("Where", [m, "hn", "h"], ["hk"]))
    else:
        bn += [helper.make_node("Mul", ["mf", "hn"], ["a1"]), helper.make_node("Sub", ["onef", "mf"], ["nm"]),
               helper.make_node("Mul", ["nm", "h"], ["a2"]), helper.make_node("Add", ["a1", "a2"], ["hk"])]
    if o.out == "zero":
        bn.append(helper.make_node("Where", [m, "hn", "zerof"], ["y"]) if o.keep == "where"
                  else helper.make_node("Mul", ["hn", "mf"], ["y"]))
    else:
        bn.append(helper.make_node("Identity", ["hk"], ["y"]))
    if o.front == "scan":
        return _xmask_scan(o, nodes, inits, [n for n in bn if n.output[0] != "xt"], body_inits)
    bn.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
    lshape = ["B", 1] if o.unit else ["B"]
    carried_in = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, H])]
    carried_out = [helper.make_tensor_value_info("hk", TensorProto.FLOAT, [None, H])]
    loop_in, loop_out = ["T", "true", "h0"], ["h_last"]
    if o.counter is not None:
        carried_in.append(helper.make_tensor_value_info("tc", it, []))
        carried_out.append(helper.make_tensor_value_info("tn", it, []))
        loop_in.append("t0")
        loop_out.append("t_last")
    if o.carried:  # (passed on as it came: the body's output is its input)
        carried_in.append(helper.make_tensor_value_info("Lp", it, lshape))
        carried_out.append(helper.make_tensor_value_info("Lp", it, lshape))
        loop_in.append("L")
        loop_out.append("L_out")
    if o.miss == "lengths_change":
        bn.append(helper.make_node("Sub", ["Lc", "one"], ["Lnext"]))
        carried_in.append(helper.make_tensor_value_info("Lc", it, lshape))
        carried_out.append(helper.make_tensor_value_info("Lnext", it, lshape))
        loop_in.append("L")
        loop_out.append("L_last")
    body = helper.make_graph(
        bn, "body", _loop_counters() + carried_in,
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])] + carried_out
        + [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, H])],
        body_inits)
    nodes.append(helper.make_node("Loop", loop_in, loop_out + ["ys"], body=body))
    return _model(nodes, "lengths", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F]),
                                     helper.make_tensor_value_info("L", it, lshape)],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
                   helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])], inits)


def _xmask_scan(o: LengthOpts, nodes: list, inits: list, bn: list, body_inits: list) -> onnx.ModelProto:
    """The step with its mask computed from x_t as a Scan body (x scanned; L unused, kept as an input)."""
    if o.cmp != "xmask" or o.miss in ("lengths_change", "input_only"):
        raise ValueError("a Scan: the mask computed from x_t")
    body = helper.make_graph(
        bn, "body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, H]), helper.make_tensor_value_info("xt", TensorProto.FLOAT, [None, F])],
        [helper.make_tensor_value_info("hk", TensorProto.FLOAT, [None, H]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, H])],
        body_inits)
    nodes.append(helper.make_node("Scan", ["h0", "x"], ["h_last", "ys"], body=body, num_scan_inputs=1))
    return _model(nodes, "xmask_scan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F]),
                                        helper.make_tensor_value_info("L", TensorProto.INT64, ["B", 1] if o.unit else ["B"])],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
                   helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])], inits)


def _pre_map() -> tuple[np.ndarray, np.ndarray]:
    """P and Q of ``LengthOpts.pre``'s map tanh(x_t * P + Q) (per feature)."""
    return np.array([0.5, -1.5, 2.0], np.float32), np.array([0.1, 0.0, -0.3], np.float32)


def lengths_reference(o: LengthOpts, x: np.ndarray, L: np.ndarray) -> list[np.ndarray]:
    W, R, b = weights()
    h = np.zeros((x.shape[1], H), np.float32)
    ys = []
    for i in range(x.shape[0]):  # (outputs in processing order)
        t = x.shape[0] - 1 - i if o.reverse else i
        m = _valid(o, t, L, x)[:, None]
        xt = np.tanh(x[t] * _pre_map()[0] + _pre_map()[1]) if o.pre else x[t]
        hn = np.tanh(xt @ W + h @ R + b).astype(np.float32)
        h = np.where(m, hn, h)
        ys.append(np.where(m, hn, 0.0).astype(np.float32) if o.out == "zero" else h)
    return [np.stack(ys), h]


LENGTH_FORMS = [LengthOpts(), LengthOpts("gt", out="carry"), LengthOpts("le1", "int32", unit=True),
                LengthOpts("lt", keep="where", out="carry"), LengthOpts("gt", "int32", keep="where"),
                LengthOpts("ge"), LengthOpts("ge", keep="where", out="carry", unit=True),
                LengthOpts("lt", keep="where", pre=True), LengthOpts("le", counter=1),
                LengthOpts("lt", "int32", keep="where", out="carry", counter=2), LengthOpts("ge", counter=-1),
                LengthOpts("ge", "int32", keep="where", l_expr="5-L"), LengthOpts("lt", l_expr="L+1", out="carry"),
                LengthOpts("gt", l_expr="L-1", unit=True), LengthOpts("lt", l_expr="5-L"),
                LengthOpts("le", l_expr="T-L"), LengthOpts("lt", "int32", keep="where", out="carry", l_expr="T-L"),
                LengthOpts("gt", "int32", keep="where", carried=True, cast="float"), LengthOpts("lt", carried=True),
                LengthOpts("ge", cast="float", unit=True), LengthOpts("le", "int32", l_expr="5-L", carried=True, cast="float"),
                LengthOpts("gt", keep="where", reverse="time"), LengthOpts("lt", "int32", out="carry", reverse="time"),
                LengthOpts("gt", "int32", cast="int64"),
                LengthOpts("ge", unit=True, reverse="time"), LengthOpts("le", "int32", keep="where", carried=True, cast="float",
                                                                        reverse="time")]
LENGTH_MISSES = [LengthOpts(miss="reset"), LengthOpts(miss="input_only"), LengthOpts(miss="lengths_change"),
                 LengthOpts("gt", keep="where", cast="int16"), LengthOpts("lt", cast="int32"),
                 LengthOpts("ge", cast="int32", reverse="time")]
# the mask computed in the step from x_t itself
XMASK_FORMS = [LengthOpts("xmask", keep="where", out="carry"), LengthOpts("xmask", unit=True),
               LengthOpts("xmask", keep="where", unit=True), LengthOpts("xmask", front="scan"),
               LengthOpts("xmask", keep="where", out="carry", unit=True, front="scan"),
               LengthOpts("xmask", keep="where", pre=True), LengthOpts("xmask", pre=True, front="scan")]
XMASK_MISSES = [LengthOpts("xmask", miss="reset"), LengthOpts("xmask", miss="batch_rows", unit=True),
                LengthOpts("xmask", miss="input_only"), LengthOpts("xmask", miss="reset", front="scan"),
                LengthOpts("xmask", miss="batch_rows", front="scan")]


# --------------------------------------------------------------------------- transposed matmuls (item 9)


@dataclass(frozen=True)
class TransposedOpts:
    """The tanh RNN step with its matmuls written for one example and batched by a transpose pair, as jax.vmap
    writes Equinox cells: ``Transpose(op(W.T, Transpose(v)))`` for v = x_t and h (x is [T, 3, F], batch 3).

    ``op``: ``matmul``, ``gemm``, or ``gemm_ta`` (Gemm(W, Transpose(v), transA=1)). Near miss ``mix_rows``:
    the recurrent term is ``Transpose(h) @ C`` with C [B, B] (it mixes the batch rows)."""

    op: str = "matmul"
    miss: str = ""

    @property
    def name(self) -> str:
        return self.miss or self.op


TB = 3  # the static batch of the transposed-layout models


def build_transposed(o: TransposedOpts) -> onnx.ModelProto:
    W, R, b = weights()
    C = (np.random.default_rng(5).standard_normal((TB, TB)) * 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(W.T), "Wt"), numpy_helper.from_array(np.ascontiguousarray(R.T), "Rt"),
             numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(C, "C"), numpy_helper.from_array(np.zeros((TB, H), np.float32), "h0"),
             numpy_helper.from_array(np.array(True), "true"), numpy_helper.from_array(np.array([0], np.int64), "i0")]
    nodes = _x_sizes(b_index=None)
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)]

    def term(v, Wt, W_, out):
        bn.append(helper.make_node("Transpose", [v], [f"{v}T"], perm=[1, 0]))
        if o.op == "matmul":
            bn.append(helper.make_node("MatMul", [Wt, f"{v}T"], [f"{out}T"]))
        elif o.op == "gemm":
            bn.append(helper.make_node("Gemm", [Wt, f"{v}T"], [f"{out}T"]))
        else:
            bn.append(helper.make_node("Gemm", [W_, f"{v}T"], [f"{out}T"], transA=1))
        bn.append(helper.make_node("Transpose", [f"{out}T"], [out], perm=[1, 0]))

    term("xt", "Wt", "W", "xw")
    if o.miss == "mix_rows":
        bn += [helper.make_node("Transpose", ["h"], ["hT"], perm=[1, 0]), helper.make_node("MatMul", ["hT", "C"], ["hcT"]),
               helper.make_node("Transpose", ["hcT"], ["hc"], perm=[1, 0]), helper.make_node("MatMul", ["hc", "R"], ["hr"])]
    else:
        term("h", "Rt", "R", "hr")
    bn += [helper.make_node("Add", ["xw", "hr"], ["s"]), helper.make_node("Add", ["s", "b"], ["s2"]),
           helper.make_node("Tanh", ["s2"], ["hn"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
           helper.make_node("Identity", ["hn"], ["y"])]
    body = helper.make_graph(
        bn, "body", _loop_counters() + [helper.make_tensor_value_info("h", TensorProto.FLOAT, [TB, H])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("hn", TensorProto.FLOAT, [TB, H]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [TB, H])])
    nodes.append(helper.make_node("Loop", ["T", "true", "h0"], ["h_last", "ys"], body=body))
    return _model(nodes, "transposed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", TB, F])],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", TB, H]),
                   helper.make_tensor_value_info("h_last", TensorProto.FLOAT, [TB, H])], inits)


TRANSPOSED_FORMS = [TransposedOpts(op) for op in ("matmul", "gemm", "gemm_ta")]
TRANSPOSED_MISSES = [TransposedOpts(miss="mix_rows")]


# --------------------------------------------------------------------------- outputs written into a buffer


def build_buffer_loop(miss: str = "") -> onnx.ModelProto:
    """A Loop over the tanh RNN step that writes each step's h into a carried buffer ``outs`` (zeros [T, B, H])
    at its iteration's row, as TorchScript writes ``outs[t] = h``: ``ScatterND(outs, [[i]], Unsqueeze(h))``.
    Near misses (``miss``): ``reads_previous`` the step adds 0.5 * outs[i - 1] to its input's projection (the
    buffer read for its values); ``row_shifted`` the write goes to row i + 1 (the last value falls off)."""
    W, R, b = weights()
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1"),
             numpy_helper.from_array(np.array([H], np.int64), "iH")]
    nodes = _x_sizes() + _zero_state() + [helper.make_node("Concat", ["T1", "B1", "iH"], ["bshape"], axis=0),
                                          helper.make_node("Expand", ["zero", "bshape"], ["outs0"])]
    body_inits = [numpy_helper.from_array(np.array([0, 1], np.int64), "ax01"),
                  numpy_helper.from_array(np.array(1, np.int64), "one"),
                  numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)]
    if miss == "reads_previous":  # outs[i - 1] (row -1 at the first step: the buffer's last row, zeros then)
        bn += [helper.make_node("Sub", ["it", "one"], ["prev"]), helper.make_node("Gather", ["outs", "prev"], ["op"], axis=0),
               helper.make_node("Mul", ["op", "half"], ["oph"])]
    bn += _tanh_step()
    h_new = "hn"
    if miss == "reads_previous":
        bn.append(helper.make_node("Add", ["hn", "oph"], ["hnp"]))
        h_new = "hnp"
    row = "it"
    if miss == "row_shifted":
        bn.append(helper.make_node("Add", ["it", "one"], ["it1"]))
        row = "it1"
    bn += [helper.make_node("Unsqueeze", [row, "ax01"], ["idx"]),
           helper.make_node("Unsqueeze", [h_new, "i0"], ["hrow"]),
           helper.make_node("ScatterND", ["outs", "idx", "hrow"], ["outs_next"]),
           helper.make_node("Identity", ["cond"], ["cond_out"])]
    body = helper.make_graph(
        bn, "body", _loop_counters() + [helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, H]),
                                        helper.make_tensor_value_info("outs", TensorProto.FLOAT, [None, None, H])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info(h_new, TensorProto.FLOAT, [None, H]),
         helper.make_tensor_value_info("outs_next", TensorProto.FLOAT, [None, None, H])], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0", "outs0"], ["h_last", "ys"], body=body))
    return _model(nodes, "buffer_loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
                   helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])], inits)


def build_deep_loop(head_ops: int = 0, cell_tanhs: int = 1) -> onnx.ModelProto:
    """A Loop over the tanh cell (``h' = tanh(x_t W + h R + b)``, its tanh applied ``cell_tanhs`` times over)
    whose per-step output is h' through ``head_ops`` elementwise ops (Mul, Add, Tanh, Sigmoid in turn)."""
    W, R, b = weights()
    body = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0), *_tanh_step(),
            helper.make_node("Identity", ["cond"], ["cond_out"])]
    cur = "hn"
    for k in range(1, cell_tanhs):
        body.append(helper.make_node("Tanh", [cur], [f"hn{k}"]))
        cur = f"hn{k}"
    state = cur
    for k in range(head_ops):
        op = ("Mul", "Add", "Tanh", "Sigmoid")[k % 4]
        body.append(helper.make_node(op, [cur, "half"] if op in ("Mul", "Add") else [cur], [f"e{k}"]))
        cur = f"e{k}"
    body.append(helper.make_node("Identity", [cur], ["yt"]))
    graph = helper.make_graph(body, "body", _loop_counters() + [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", H])],
                              [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                               helper.make_tensor_value_info(state, TensorProto.FLOAT, ["B", H]),
                               helper.make_tensor_value_info("yt", TensorProto.FLOAT, ["B", H])])
    nodes = _x_sizes() + _zero_state() + [helper.make_node("Loop", ["T", "true", "h0"], ["hT", "ys"], body=graph)]
    inits = [numpy_helper.from_array(v, n) for n, v in (("W", W), ("R", R), ("b", b))]
    inits += [numpy_helper.from_array(v, n) for n, v in (
        ("half", np.float32(0.5)), ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)),
        ("iH", np.array([H], np.int64)), ("zero", np.zeros(1, np.float32)), ("true", np.array(True)))]
    return _model(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                  [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
                   helper.make_tensor_value_info("hT", TensorProto.FLOAT, ["B", H])], inits)


def build_stacked_loops(layers: int, stop_after: int | None = None) -> onnx.ModelProto:
    """``layers`` tanh-cell Loops, each over the one before's stacked outputs, all with the trip count
    ``x.shape[0]`` read once (TorchScript's ``steps = x.size(0)`` before stacked loops); x is [T, 1, H].
    ``stop_after``: the first Loop's condition turns false after that many iterations (its outputs are then
    shorter than x)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("i0", np.array([0], np.int64)), ("true", np.array(True)), ("h0", np.zeros((1, H), np.float32)),
        ("stop", np.int64(stop_after or 0)), ("one", np.int64(1)))]
    nodes = _x_sizes(b_index=None)
    inp = "x"
    for k in range(layers):
        inits += [numpy_helper.from_array((0.4 * rng.standard_normal(s)).astype(np.float32), f"{n}{k}")
                  for n, s in (("W", (H, H)), ("R", (H, H)), ("b", (H,)))]
        body = [helper.make_node("Gather", [inp, "it"], ["xt"], axis=0), *_tanh_step(W=f"W{k}", R=f"R{k}", b=f"b{k}"),
                helper.make_node("Identity", ["hn"], ["yt"])]
        if stop_after and k == 0:
            body += [helper.make_node("Add", ["it", "one"], ["next"]), helper.make_node("Less", ["next", "stop"], ["cond_out"])]
        else:
            body.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
        graph = helper.make_graph(body, f"body{k}", _loop_counters() + [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, H])],
                                  [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                                   helper.make_tensor_value_info("hn", TensorProto.FLOAT, [1, H]),
                                   helper.make_tensor_value_info("yt", TensorProto.FLOAT, [1, H])])
        nodes.append(helper.make_node("Loop", ["T", "true", "h0"], [f"h_last{k}", f"ys{k}"], body=graph))
        inp = f"ys{k}"
    return _model(nodes, "stacked_loops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 1, H])],
                  [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["S", 1, H])], inits)


# --------------------------------------------------------------------------- a running sum carried beside the cell


RUNNING_SUM_FORMS = ("h", "head", "cast", "sum_first")
RUNNING_SUM_MISSES = ("reads_sum", "partial_sums", "scaled")


def build_running_sum(form: str) -> onnx.ModelProto:
    """The tanh RNN step over x [T, B, F] carrying ``acc``, a running sum beside h (a jax carry ``(h, acc)``, a
    TorchScript ``acc = acc + h``); outputs the stacked h, the last h and the last acc. Forms: ``h`` acc + h;
    ``head`` acc + relu(h @ D); ``cast`` acc + h cast to float (jax2onnx's carried-output casts);
    ``sum_first`` h + acc. Near misses: ``reads_sum`` the new state adds 0.1 * acc; ``partial_sums`` the sum after every
    step is a per-step output too; ``scaled`` acc = 0.9 * acc + h."""
    W, R, b = weights()
    D = (np.random.default_rng(3).standard_normal((H, 2)) * 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("D", D), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)),
        ("iA", np.array([2 if form == "head" else H], np.int64)))]
    nodes = _x_sizes() + _zero_state() + _zero_state("iA", "ashape", "acc0")
    body_inits = [numpy_helper.from_array(np.array(0.1, np.float32), "k"), numpy_helper.from_array(np.array(0.9, np.float32), "decay")]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step()
    h_new = "hn"
    if form == "reads_sum":  # the new state reads the sum: tanh(..) + 0.1 * acc
        bn += [helper.make_node("Mul", ["acc", "k"], ["ka"]), helper.make_node("Add", ["hn", "ka"], ["hr_"])]
        h_new = "hr_"
    y = h_new
    if form == "head":
        bn += [helper.make_node("MatMul", ["hn", "D"], ["hd"]), helper.make_node("Relu", ["hd"], ["hy"])]
        y = "hy"
    acc = "acc"
    if form == "scaled":
        bn.append(helper.make_node("Mul", ["acc", "decay"], ["acc_d"]))
        acc = "acc_d"
    bn.append(helper.make_node("Add", [y, acc] if form == "sum_first" else [acc, y], ["acc_n"]))
    acc_out = "acc_n"
    if form == "cast":
        bn.append(helper.make_node("Cast", ["acc_n"], ["acc_c"], to=TensorProto.FLOAT))
        acc_out = "acc_c"
    bn += [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", [h_new], ["yt"])]
    A = 2 if form == "head" else H
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    outs = [vi(acc_out, None, A), vi("yt", None, H)]
    if form == "partial_sums":
        bn.append(helper.make_node("Identity", [acc_out], ["acc_t"]))
        outs.append(vi("acc_t", None, A))
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H), vi("acc", None, A)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi(h_new, None, H)] + outs,
                             body_inits)
    loop_outs = ["h_last", "acc_last", "ys"] + (["accs"] if form == "partial_sums" else [])
    nodes.append(helper.make_node("Loop", ["T", "true", "h0", "acc0"], loop_outs, body=body))
    return _model(nodes, "running_sum", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                  [vi("h_last", None, H), vi("acc_last", None, A), vi("ys", None, None, H)]
                  + ([vi("accs", None, None, A)] if form == "partial_sums" else []), inits)


COUNTER_FORMS = ("int64", "int32_from_1", "shape_1", "scaled_by_h")
COUNTER_MISSES = ("steps_by_2", "runtime_start", "float")


def build_counted_loop(form: str) -> onnx.ModelProto:
    """The tanh RNN step over x [T, B, F] carrying a counter ``t = t + 1`` beside h (a jax carry ``(h, t)``)
    whose final value the graph uses; outputs the stacked h, the last h and the final counter (``scaled_by_h``:
    the last h times the counter, as a mean by hand). Forms: ``int64`` from 0, ``int32_from_1`` int32 from 1,
    ``shape_1`` int64 [1] from 0. Near misses: ``steps_by_2`` t = t + 2 (no counter of steps: its final value is
    no state a native op gives); ``runtime_start`` t starts at a graph input; ``float`` float from 0.0 (a float
    stops counting where its integers run out: float16 at 2048, float32 at 2**24)."""
    W, R, b = weights()
    dtype = {"int32_from_1": np.int32, "float": np.float32}.get(form, np.int64)
    start = np.array([0] if form == "shape_1" else 1 if form == "int32_from_1" else 0, dtype)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)))]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])]
    if form == "runtime_start":
        inputs.append(helper.make_tensor_value_info("t0", TensorProto.INT64, []))
    else:
        inits.append(numpy_helper.from_array(start, "t0"))
    et = helper.np_dtype_to_tensor_dtype(start.dtype)
    step = np.array(2 if form == "steps_by_2" else 1, dtype).reshape(start.shape)
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step() + [
        helper.make_node("Add", ["t", "one"], ["tn"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
        helper.make_node("Identity", ["hn"], ["yt"])]
    vi = lambda n, *dims, t=TensorProto.FLOAT: helper.make_tensor_value_info(n, t, list(dims))  # noqa: E731
    tdims = list(start.shape)
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H), vi("t", *tdims, t=et)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("tn", *tdims, t=et), vi("yt", None, H)],
                             [numpy_helper.from_array(step, "one")])
    nodes = _x_sizes() + _zero_state() + [helper.make_node("Loop", ["T", "true", "h0", "t0"], ["h_last", "t_last", "ys"],
                                                            body=body)]
    outs = [vi("ys", None, None, H), vi("h_last", None, H)]
    if form == "scaled_by_h":  # h * float(t)
        nodes += [helper.make_node("Cast", ["t_last"], ["t_f"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["h_last", "t_f"], ["h_t"])]
        outs.append(vi("h_t", None, H))
    else:
        outs.append(vi("t_last", *tdims, t=et))
    return _model(nodes, "counted", inputs, outs, inits)


TWO_SEQUENCE_FORMS = ("sum", "cat", "cat_h_between", "batch_first", "static_T")
TWO_SEQUENCE_MISSES = ("lengths_apart", "squared", "unknown_width", "batch_apart")
Z = 2  # the second sequence's features


def build_two_sequences(form: str, front: str = "loop") -> onnx.ModelProto:
    """A tanh RNN step reading two sequences side by side, x [T, B, F] and z [T, B, 2] (``lax.scan`` over
    ``(x, z)``): ``tanh(x_t @ W + z_t @ V + h @ R + b)``. Forms: ``sum`` two matmuls; ``cat`` one matmul of
    ``concat([x_t, z_t])``; ``cat_h_between`` of ``concat([z_t, h, x_t])``; ``batch_first`` both [B, T, .] read
    on axis 1; ``static_T`` both 6 steps long. Near misses: ``lengths_apart`` z declared with a time length of
    its own (``T2``); ``squared`` the cell reads ``(z_t * z_t) @ V``; ``unknown_width`` z's width is a name;
    ``batch_apart`` z's batch is a name of its own (N = 1 broadcasts in the step).
    ``front="scan"``: the same step as a Scan body scanning x and z (``reversed``: both backwards;
    ``directions_apart``: z backwards only, a near miss)."""
    W, R, b = weights()
    V = (np.random.default_rng(5).standard_normal((Z, H)) * 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("V", V), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)))]
    if form == "cat_h_between":
        inits.append(numpy_helper.from_array(np.concatenate([V, R, W]), "M"))
    elif form == "cat":
        inits.append(numpy_helper.from_array(np.concatenate([W, V]), "M"))
    bf = form == "batch_first"
    T = 6 if form == "static_T" else "T"
    x_shape, z_shape = ["B", T, F] if bf else [T, "B", F], ["B", T, Z] if bf else [T, "B", Z]
    if form == "lengths_apart":
        z_shape[0] = "T2"
    if form == "unknown_width":
        z_shape[2] = "Zw"
    if form == "batch_apart":  # (a batch of 1 broadcasts beside x's in the step: the concatenation would not)
        z_shape[1] = "N"
    nodes = _x_sizes("i1" if bf else "i0", "i0" if bf else "i1") + _zero_state()
    bn = [] if front == "scan" else [helper.make_node("Gather", ["x", "it"], ["xt"], axis=int(bf)),
                                     helper.make_node("Gather", ["z", "it"], ["zt"], axis=int(bf))]
    if form in ("cat", "cat_h_between"):
        parts = ["xt", "zt"] if form == "cat" else ["zt", "h", "xt"]
        bn += [helper.make_node("Concat", parts, ["xz"], axis=1), helper.make_node("MatMul", ["xz", "M"], ["xw"])]
        bn += [helper.make_node("Identity", ["xw"], ["s"])] if form == "cat_h_between" else [
            helper.make_node("MatMul", ["h", "R"], ["hr"]), helper.make_node("Add", ["xw", "hr"], ["s"])]
        bn += [helper.make_node("Add", ["s", "b"], ["s2"]), helper.make_node("Tanh", ["s2"], ["hn"])]
    else:
        z_in = "zt"
        if form == "squared":
            bn.append(helper.make_node("Mul", ["zt", "zt"], ["zz"]))
            z_in = "zz"
        bn += [helper.make_node("MatMul", [z_in, "V"], ["zv"]), helper.make_node("MatMul", ["xt", "W"], ["xw0"]),
               helper.make_node("Add", ["xw0", "zv"], ["xw"]), helper.make_node("MatMul", ["h", "R"], ["hr"]),
               helper.make_node("Add", ["xw", "hr"], ["s"]), helper.make_node("Add", ["s", "b"], ["s2"]),
               helper.make_node("Tanh", ["s2"], ["hn"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    if front == "scan":
        bn.append(helper.make_node("Identity", ["hn"], ["yt"]))
        body = helper.make_graph(bn, "body", [vi("h", None, H), vi("xt", None, F), vi("zt", None, Z)],
                                 [vi("hn", None, H), vi("yt", None, H)])
        attrs = dict(num_scan_inputs=2, scan_input_axes=[int(bf)] * 2)
        if form in ("reversed", "directions_apart"):
            attrs["scan_input_directions"] = [int(form == "reversed"), 1]
        nodes.append(helper.make_node("Scan", ["h0", "x", "z"], ["h_last", "ys"], body=body, **attrs))
        return _model(nodes, "two_sequences_scan", [vi("x", *x_shape), vi("z", *z_shape)],
                      [vi("h_last", None, H), vi("ys", None, None, H)], inits)
    bn += [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["hn"], ["yt"])]
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("yt", None, H)])
    nodes.append(helper.make_node("Loop", ["T", "true", "h0"], ["h_last", "ys"], body=body))
    return _model(nodes, "two_sequences", [vi("x", *x_shape), vi("z", *z_shape)],
                  [vi("ys", None, None, H), vi("h_last", None, H)], inits)


def build_batch_sliced(end: int, batch: int = 3) -> onnx.ModelProto:
    """The tanh RNN step over x [T, batch, F] (the batch size fixed, as a static export fixes it) whose
    pre-activation is sliced ``[0:end]`` on the batch axis and ``[0:H]`` on units, every axis named (jax2onnx's
    ``gx[:, :H]`` at a static batch): the whole batch when ``end >= batch``; else rows dropped, a near miss."""
    W, R, b = weights()
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("h0", np.zeros((batch, H), np.float32)), ("true", np.array(True)),
        ("T", np.array(6, np.int64)), ("st", np.array([0, 0], np.int64)), ("en", np.array([end, H], np.int64)),
        ("ax", np.array([0, 1], np.int64)))]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step()
    bn[-1] = helper.make_node("Slice", ["s2", "st", "en", "ax"], ["s3"])
    bn += [helper.make_node("Tanh", ["s3"], ["hn"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
           helper.make_node("Identity", ["hn"], ["yt"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("yt", None, H)])
    nodes = [helper.make_node("Loop", ["T", "true", "h0"], ["h_last", "ys"], body=body)]
    return _model(nodes, "batch_sliced", [vi("x", 6, batch, F)], [vi("ys", 6, None, H), vi("h_last", None, H)], inits)


TRACED_READ_FORMS = ("batch_first", "time_major_expand")
TRACED_READ_MISSES = ("perm_mixes_axes", "next_step")


def build_traced_read(form: str) -> onnx.ModelProto:
    """The tanh RNN step reading x_t as jax2onnx writes ``x[:, t]`` with a traced t: ``Gather(Transpose(x, perm),
    Reshape(Expand(Where(i < 0, i + T, i), [1]), []))``, x carried through the loop unchanged. Forms:
    ``batch_first`` x [B, T, F], perm [1, 0, 2]; ``time_major_expand`` x [T, B, F], perm [0, 1, 2]. Near misses:
    ``perm_mixes_axes`` perm [1, 2, 0] (x_t would be [F, B]); ``next_step`` the index is ``i + 1``."""
    W, R, b = weights()
    bf = form != "time_major_expand"
    perm = {"batch_first": [1, 0, 2], "time_major_expand": [0, 1, 2], "perm_mixes_axes": [1, 2, 0],
            "next_step": [1, 0, 2]}[form]
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)))]
    nodes = _x_sizes("i1" if bf else "i0", "i0" if bf else "i1") + _zero_state()
    body_inits = [numpy_helper.from_array(v, n) for n, v in (
        ("c0", np.array(0, np.int64)), ("cT", np.array(6, np.int64)), ("c1", np.array(1, np.int64)),
        ("one_shape", np.array([1], np.int64)), ("scalar_shape", np.zeros(0, np.int64)))]
    t = "it"
    bn = []
    if form == "next_step":
        bn.append(helper.make_node("Add", ["it", "c1"], ["it1"]))
        t = "it1"
    bn += [helper.make_node("Less", [t, "c0"], ["neg"]), helper.make_node("Add", [t, "cT"], ["wrapped"]),
           helper.make_node("Where", ["neg", "wrapped", t], ["fixed"]),
           helper.make_node("Expand", ["fixed", "one_shape"], ["fixed1"]),
           helper.make_node("Reshape", ["fixed1", "scalar_shape"], ["idx"]),
           helper.make_node("Transpose", ["xc"], ["xT"], perm=perm),
           helper.make_node("Gather", ["xT", "idx"], ["xt"], axis=0)] + _tanh_step()
    bn += [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["xc"], ["xc_out"]),
           helper.make_node("Identity", ["hn"], ["yt"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    x_shape = ["B", 6, F] if bf else [6, "B", F]
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H), vi("xc", *x_shape)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("xc_out", *x_shape), vi("yt", None, H)], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0", "x"], ["h_last", "x_last", "ys"], body=body))
    return _model(nodes, "traced_read", [vi("x", *x_shape)], [vi("ys", None, None, H), vi("h_last", None, H)], inits)


WHERE_ELU_FORMS = ("exp_of_x", "exp_of_min0")
WHERE_ELU_MISSES = ("offset_not_alpha", "above_one")


def build_where_elu(form: str) -> onnx.ModelProto:
    """The RNN step with its activation written out as an elu, ``Where(a > 0, a, 1.3 * (exp(a) - 1))``
    (``exp_of_min0``: exp of ``Where(a > 0, 0, a)``, as jax's own elu writes its expm1). Near misses:
    ``offset_not_alpha`` 1.3 * exp(a) - 1; ``above_one`` the comparison a > 1."""
    W, R, b = weights()
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)))]
    body_inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (
        ("c0", 0.0), ("c1", 1.0), ("alpha", 1.3), ("t", 1.0 if form == "above_one" else 0.0))]
    nodes = _x_sizes() + _zero_state()
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step()[:-1]  # s2 = x W + h R + b
    bn.append(helper.make_node("Greater", ["s2", "t"], ["pos"]))
    e_in = "s2"
    if form == "exp_of_min0":
        bn.append(helper.make_node("Where", ["pos", "c0", "s2"], ["neg_part"]))
        e_in = "neg_part"
    bn += [helper.make_node("Exp", [e_in], ["e"])]
    if form == "offset_not_alpha":
        bn += [helper.make_node("Mul", ["e", "alpha"], ["ae"]), helper.make_node("Sub", ["ae", "c1"], ["below"])]
    else:
        bn += [helper.make_node("Sub", ["e", "c1"], ["em1"]), helper.make_node("Mul", ["alpha", "em1"], ["below"])]
    bn += [helper.make_node("Where", ["pos", "s2", "below"], ["hn"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
           helper.make_node("Identity", ["hn"], ["yt"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("yt", None, H)], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0"], ["h_last", "ys"], body=body))
    return _model(nodes, "where_elu", [vi("x", "T", "B", F)], [vi("ys", None, None, H), vi("h_last", None, H)], inits)


GROWN_FORMS = ("time_major", "batch_first")
GROWN_MISSES = ("starts_with_a_row", "prepends")


def build_grown_buffer(form: str) -> onnx.ModelProto:
    """The tanh RNN step over x [T, B, F] whose outputs are collected by growing a carried tensor, ``out =
    Concat([out, Unsqueeze(h, a)], a)`` from an empty one (TorchScript's ``out = torch.cat([out, h.unsqueeze(1)],
    1)``): ``time_major`` a = 0 from zeros [0, B, H]; ``batch_first`` a = 1 from zeros [B, 0, H]. Near misses:
    ``starts_with_a_row`` from zeros [1, B, H] (a row no step wrote); ``prepends`` Concat([h[None], out])."""
    W, R, b = weights()
    a = 1 if form == "batch_first" else 0
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)),
        ("rows0", np.array([1 if form == "starts_with_a_row" else 0], np.int64)))]
    nodes = _x_sizes() + _zero_state()
    nodes += [helper.make_node("Concat", ["B1", "rows0", "iH"] if a else ["rows0", "B1", "iH"], ["oshape"], axis=0),
              helper.make_node("Expand", ["zero", "oshape"], ["out0"])]
    body_inits = [numpy_helper.from_array(np.array([a], np.int64), "ax")]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step() + [
        helper.make_node("Unsqueeze", ["hn", "ax"], ["row"]),
        helper.make_node("Concat", ["row", "out"] if form == "prepends" else ["out", "row"], ["out_n"], axis=a),
        helper.make_node("Identity", ["cond"], ["cond_out"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H), vi("out", None, None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("out_n", None, None, H)], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0", "out0"], ["h_last", "ys"], body=body))
    return _model(nodes, "grown", [vi("x", "T", "B", F)], [vi("ys", None, None, H), vi("h_last", None, H)], inits)


def build_scattered_buffer(form: str) -> onnx.ModelProto:
    """The tanh RNN step over x [T, B, F] writing each step's h into a batch-first buffer ``outs`` (zeros [B, T,
    H]) by one ScatterND over an index grid built from the iteration number and the buffer's shape: ``idx =
    Concat([Range(0, B)[:, None], Expand(i, [B, 1])], 1)`` ([B, 2]: row b, slot i), the updates h itself
    (``outs[:, i] = h``); ``reversed`` the slot is T - 1 - i (read from the buffer's shape: fused, Y flipped).
    Near misses: ``data_index`` the slot is ArgMax of h's first row (computed from a value, not from i); ``adds`` the
    ScatterND adds h to the slot (reduction add); ``scaled`` the updates are 2 * h (a value no state holds);
    ``clamped`` the slot is Min(i, 15) (i at every length up to 16, not after), ``reduced`` the same as
    ReduceMin(Concat([i], [15])), ``wrapped`` Cast(Cast(i, INT8), INT64); ``wider`` the buffer is H + 1
    wide (the grid fills its first H columns). ``unused``: the buffer's final value is no output (fused)."""
    W, R, b = weights()
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)),
        ("iW", np.array([H + 1 if form == "wider" else H], np.int64)))]
    nodes = _x_sizes() + _zero_state() + [helper.make_node("Concat", ["B1", "T1", "iW"], ["oshape"], axis=0),
                                          helper.make_node("Expand", ["zero", "oshape"], ["outs0"])]
    body_inits = [numpy_helper.from_array(v, n) for n, v in (
        ("s0", np.array(0, np.int64)), ("s1", np.array(1, np.int64)), ("a0", np.array([0], np.int64)),
        ("a1", np.array([1], np.int64)), ("one1", np.array([1], np.int64)), ("two", np.array(2.0, np.float32)),
        ("s15", np.array(15, np.int64)))]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0)] + _tanh_step() + [
        helper.make_node("Shape", ["outs"], ["os"]),
        helper.make_node("Gather", ["os", "s0"], ["Bn"], axis=0),
        helper.make_node("Range", ["s0", "Bn", "s1"], ["rows"]),
        helper.make_node("Unsqueeze", ["rows", "a1"], ["rows2"]),
        helper.make_node("Unsqueeze", ["Bn", "a0"], ["Bn1"]),
        helper.make_node("Concat", ["Bn1", "one1"], ["colshape"], axis=0)]
    slot = "it"
    if form == "reversed":  # T - 1 - i
        bn += [helper.make_node("Gather", ["os", "s1"], ["Tn"], axis=0), helper.make_node("Sub", ["Tn", "s1"], ["Tm1"]),
               helper.make_node("Sub", ["Tm1", "it"], ["rev"])]
        slot = "rev"
    elif form == "clamped":
        bn.append(helper.make_node("Min", ["it", "s15"], ["clamp"]))
        slot = "clamp"
    elif form == "reduced":  # Min(i, 15) as ReduceMin(Concat([i], [15])): the 15 hidden from the arithmetic
        bn += [helper.make_node("Unsqueeze", ["it", "a0"], ["it1"]), helper.make_node("Unsqueeze", ["s15", "a0"], ["c15"]),
               helper.make_node("Concat", ["it1", "c15"], ["both"], axis=0),
               helper.make_node("ReduceMin", ["both"], ["rmin"], keepdims=0)]
        slot = "rmin"
    elif form == "wrapped":  # Cast(Cast(i, INT8), INT64): i for 128 steps, then negative
        bn += [helper.make_node("Cast", ["it"], ["it8"], to=TensorProto.INT8),
               helper.make_node("Cast", ["it8"], ["itw"], to=TensorProto.INT64)]
        slot = "itw"
    elif form == "data_index":  # ArgMax of h's first row: a slot in [0, H) read from a value
        bn += [helper.make_node("Gather", ["hn", "s0"], ["h0row"], axis=0),
               helper.make_node("ArgMax", ["h0row"], ["am"], axis=0, keepdims=0)]
        slot = "am"
    upd = "hn"
    if form == "scaled":
        bn.append(helper.make_node("Mul", ["hn", "two"], ["hn2"]))
        upd = "hn2"
    bn += [helper.make_node("Unsqueeze", [slot, "a0"], ["slot1"]),
           helper.make_node("Unsqueeze", ["slot1", "a0"], ["slot2"]),
           helper.make_node("Expand", ["slot2", "colshape"], ["col"]),
           helper.make_node("Concat", ["rows2", "col"], ["idx"], axis=1),
           helper.make_node("ScatterND", ["outs", "idx", upd], ["outs_next"],
                            **({"reduction": "add"} if form == "adds" else {})),
           helper.make_node("Identity", ["cond"], ["cond_out"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H), vi("outs", None, None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hn", None, H),
                              vi("outs_next", None, None, H)], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "h0", "outs0"], ["h_last", "ys"], body=body))
    outs = [vi("h_last", "B", H)] if form == "unused" else [vi("ys", "B", "T", None), vi("h_last", "B", H)]
    return _model(nodes, "scattered", [vi("x", "T", "B", F)], outs, inits, opset=18)


READ_AHEAD_FORMS = ("ahead1", "ahead2_counted_twice")
READ_AHEAD_MISSES = {"ahead_full_count": "does not run exactly once per time step from step 1",
                     "ahead_beside_mask": "beside a mask",
                     "ahead_two_offsets": "different offsets"}


def build_read_ahead(form: str) -> onnx.ModelProto:
    """The tanh RNN step over ``x[i + s]`` (x [T, B, F], time dynamic, captured), the Loop running ``T - s``
    times (``Sub(T, s)``): an RNN over ``x[s:]``. Forms: ``ahead1`` s = 1, the index ``Add(i, 1)``;
    ``ahead2_counted_twice`` s = 2, the index ``(i + 3) - 1``. Near misses: ``ahead_full_count`` s = 1 but T
    iterations (its last read is past x's end); ``ahead_beside_mask`` a bool mask [T, B] read at step i beside
    x at i + 1 (h kept where the mask is false); ``ahead_two_offsets`` the step reads ``x[i + 1] + x[i]``."""
    W, R, b = weights()
    s = 2 if form == "ahead2_counted_twice" else 1
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)),
        ("steps_ahead", np.array(s, np.int64)))]
    nodes = _x_sizes() + _zero_state()
    nodes.append(helper.make_node("Identity", ["T"], ["M"]) if form == "ahead_full_count"
                 else helper.make_node("Sub", ["T", "steps_ahead"], ["M"]))
    body_inits = [numpy_helper.from_array(v, n) for n, v in (
        ("c1", np.array(1, np.int64)), ("c3", np.array(3, np.int64)))]
    if form == "ahead2_counted_twice":
        bn = [helper.make_node("Add", ["it", "c3"], ["it3"]), helper.make_node("Sub", ["it3", "c1"], ["idx"])]
    else:
        bn = [helper.make_node("Add", ["c1", "it"], ["idx"])]
    bn.append(helper.make_node("Gather", ["x", "idx"], ["xa"], axis=0))
    if form == "ahead_two_offsets":
        bn += [helper.make_node("Gather", ["x", "it"], ["xi"], axis=0), helper.make_node("Add", ["xa", "xi"], ["xt"])]
    else:
        bn.append(helper.make_node("Identity", ["xa"], ["xt"]))
    bn += _tanh_step()
    if form == "ahead_beside_mask":
        bn += [helper.make_node("Gather", ["m", "it"], ["mt"], axis=0),
               helper.make_node("Unsqueeze", ["mt", "ax1"], ["mt1"]),
               helper.make_node("Where", ["mt1", "hn", "h"], ["hk"])]
        body_inits.append(numpy_helper.from_array(np.array([1], np.int64), "ax1"))
    else:
        bn.append(helper.make_node("Identity", ["hn"], ["hk"]))
    bn += [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["hk"], ["yt"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("h", None, H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hk", None, H),
                              vi("yt", None, H)], body_inits)
    nodes.append(helper.make_node("Loop", ["M", "true", "h0"], ["h_last", "ys"], body=body))
    inputs = [vi("x", "T", "B", F)]
    if form == "ahead_beside_mask":
        inputs.append(helper.make_tensor_value_info("m", TensorProto.BOOL, ["T", "B"]))
    return _model(nodes, f"read_{form}", inputs, [vi("ys", None, None, H), vi("h_last", None, H)], inits)


def build_piece_carry(form: str) -> onnx.ModelProto:
    """Two tanh RNN steps over x [T, B, F] carried as one tensor ``hh`` [B, 2H] (jax's ``carry =
    concatenate([h1, h2])``): the step cuts it with Slices ``[:, :H]`` and ``[:, H:]``, steps each half with
    weights of its own and joins the new halves with a Concat; outputs the stacked new carry and the last one.
    Forms: ``pieces`` as said (fused: two RNNs); ``negative_bounds`` the cuts written ``[:, :-H]`` and
    ``[:, -H:]``. Near miss: ``swapped`` the new halves joined the other way round ([h2', h1']: each step
    swaps what the halves hold, no native cell)."""
    W, R, b = weights()
    W2, R2, b2 = weights(5)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("W2", W2), ("R2", R2), ("b2", b2), ("zero", np.array(0.0, np.float32)),
        ("true", np.array(True)), ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)),
        ("i2H", np.array([2 * H], np.int64)))]
    nodes = _x_sizes() + _zero_state("i2H", "hhshape", "hh0")
    neg = form == "negative_bounds"
    body_inits = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (
        ("c0", 0), ("cH", -H if neg else H), ("cEnd", 2**63 - 1 if neg else 2 * H), ("cAxis", -1 if neg else 1))]
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0),
          helper.make_node("Slice", ["hh", "c0", "cH", "cAxis"], ["h"]),
          helper.make_node("Slice", ["hh", "cH", "cEnd", "cAxis"], ["h2"])] + _tanh_step()
    bn += [helper.make_node("MatMul", ["xt", "W2"], ["xw2"]), helper.make_node("MatMul", ["h2", "R2"], ["hr2"]),
           helper.make_node("Add", ["xw2", "hr2"], ["s_2"]), helper.make_node("Add", ["s_2", "b2"], ["s2_2"]),
           helper.make_node("Tanh", ["s2_2"], ["hn2"]),
           helper.make_node("Concat", ["hn2", "hn"] if form == "swapped" else ["hn", "hn2"], ["hh_n"], axis=1),
           helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["hh_n"], ["yt"])]
    vi = lambda n, *dims: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(dims))  # noqa: E731
    body = helper.make_graph(bn, "body", _loop_counters() + [vi("hh", None, 2 * H)],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), vi("hh_n", None, 2 * H),
                              vi("yt", None, 2 * H)], body_inits)
    nodes.append(helper.make_node("Loop", ["T", "true", "hh0"], ["hh_last", "ys"], body=body))
    return _model(nodes, "piece_carry", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                  [vi("hh_last", None, 2 * H), vi("ys", None, None, 2 * H)], inits)


def piece_carry_reference(form: str, x: np.ndarray) -> list[np.ndarray]:
    """What :func:`build_piece_carry` computes: the last carry and the stacked ones."""
    (W, R, b), (W2, R2, b2) = weights(), weights(5)
    hh = np.zeros((x.shape[1], 2 * H), np.float32)
    ys = []
    for t in range(x.shape[0]):
        h1, h2 = np.tanh(x[t] @ W + hh[:, :H] @ R + b), np.tanh(x[t] @ W2 + hh[:, H:] @ R2 + b2)
        hh = np.concatenate([h2, h1] if form == "swapped" else [h1, h2], axis=1)
        ys.append(hh)
    return [hh, np.stack(ys)]


def build_held_head() -> onnx.ModelProto:
    """A masked tanh step ``h = where(m, tanh(x_t W + h R + b), h)`` whose per-step output is a head on the new
    h, ``tanh(h V)`` (2 wide), carried through the loop and held at masked steps, ``o = where(m, head, o)``:
    Keras' ``RNN`` over a custom cell whose output is not its state. x [T, B, F], mask [T, B] bool; outputs the
    stacked held heads."""
    W, R, b = weights()
    V = np.random.default_rng(1).standard_normal((H, 2)).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", W), ("R", R), ("b", b), ("V", V), ("zero", np.array(0.0, np.float32)), ("true", np.array(True)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)), ("iH", np.array([H], np.int64)),
        ("i2", np.array([2], np.int64)))]
    vi = lambda n, *dims, t=TensorProto.FLOAT: helper.make_tensor_value_info(n, t, list(dims))  # noqa: E731
    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0), helper.make_node("Gather", ["mask", "it"], ["mt"], axis=0),
         helper.make_node("Unsqueeze", ["mt", "i1"], ["m"]), *_tanh_step(),
         helper.make_node("Where", ["m", "hn", "h"], ["h_new"]),
         helper.make_node("MatMul", ["h_new", "V"], ["hv"]), helper.make_node("Tanh", ["hv"], ["o"]),
         helper.make_node("Where", ["m", "o", "o_prev"], ["o_new"]), helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Identity", ["o_new"], ["y"])],
        "body", _loop_counters() + [vi("h", None, H), vi("o_prev", None, 2)],
        [vi("cond_out", t=TensorProto.BOOL), vi("h_new", None, H), vi("o_new", None, 2), vi("y", None, 2)])
    nodes = _x_sizes() + _zero_state() + _zero_state("i2", "oshape", "o0") + [
        helper.make_node("Loop", ["T", "true", "h0", "o0"], ["h_last", "o_last", "ys"], body=body)]
    return _model(nodes, "held_head", [vi("x", "T", "B", F), vi("mask", "T", "B", t=TensorProto.BOOL)],
                  [vi("ys", "T", "B", 2)], inits)
