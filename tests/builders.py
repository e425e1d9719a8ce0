"""Hand-written ONNX recurrences (``Scan`` and ``Loop`` bodies computing one LSTM / GRU / RNN step).

``build(opts) -> (model, feeds_fn)`` writes one model from an :class:`Opts`; ``feeds_fn(rng, batch, T,
mask_kind)`` makes its inputs (``mask_kind`` in ``post``, ``pre``, ``gappy``, ``none``).

The *maths* are fixed by the seeded ONNX-layout weights (:func:`math_weights`) and the cell options (op,
activations, clip, linear_before_reset, direction, masking semantics). Everything else in ``Opts`` only
changes how the same maths are *written*: Gemm vs MatMul+Add, fused weights + Split / Slice vs per-gate
weights, ``Concat([x, h])·W`` vs ``x·W + h·R``, one or two bias vectors, activations as ONNX ops or
algebraic forms, the GRU update in three forms, weights as outer initializers / body Constant nodes / body
initializers / pass-through states, the order in which gates are stored in fused weights, and so on.
:func:`expected` computes what a correct model outputs with the numpy reference (:mod:`reference`), so the
builders themselves are checked.

``Opts.mutation`` turns the cell into a *near miss* (see :data:`MUTATIONS`): a model that looks like a
recurrent cell but is not one a native op computes. A few (:func:`mutation_expressible`) are computed by a
native op with *derived* weights (e.g. ``1 - sigmoid(a) = sigmoid(-a)``); fusing those is allowed if exact.

Models use IR version 8 and opset 17 (onnxruntime refuses onnx 1.23's default IR version).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

try:
    from .reference import GATES, rnn_reference, split_weights
except ImportError:  # imported as a top-level module (tests/ on sys.path)
    from reference import GATES, rnn_reference, split_weights

OPSET = 17
IR_VERSION = 8
FLOAT = TensorProto.FLOAT
INT64, BOOL = TensorProto.INT64, TensorProto.BOOL
INT64_MIN = -(2**63)

DEFAULT_ACTS = {
    "LSTM": (("Sigmoid", ()), ("Tanh", ()), ("Tanh", ())),
    "GRU": (("Sigmoid", ()), ("Tanh", ())),
    "RNN": (("Tanh", ()),),
}
# activations written as ONNX ops in the body: kind -> attribute names and ONNX defaults
ACT_ATTRS = {
    "Sigmoid": ((), ()),
    "Tanh": ((), ()),
    "Relu": ((), ()),
    "HardSigmoid": (("alpha", "beta"), (0.2, 0.5)),
    "LeakyRelu": (("alpha",), (0.01,)),
    "ThresholdedRelu": (("alpha",), (1.0,)),
    "Elu": (("alpha",), (1.0,)),
    "Softsign": ((), ()),
    "Softplus": ((), ()),
}
# f(a*x) = a*f(x) (up to a parameter change): an extra scale of the state could be folded into weights
HOMOGENEOUS = {"Relu", "LeakyRelu", "ThresholdedRelu", "Affine"}

# near-miss mutations: name -> (ops, fronts, needs a mask, description)
MUTATIONS = {
    "lstm_wrong_gate": ("LSTM", "scan loop chain", False, "output and cell-candidate gates swap places (o feeds c, g gates h)"),
    "lstm_o_as_f": ("LSTM", "scan loop chain", False, "the output gate is also used as the forget gate (f unused)"),
    "extra_scale": ("LSTM GRU RNN", "scan loop chain", False, "the new hidden state is multiplied by 1.5 before it is carried"),
    "extra_tanh": ("LSTM GRU RNN", "scan loop chain", False, "an extra Tanh on the new hidden state"),
    "peephole": ("LSTM", "scan loop chain", False, "peephole terms P*c added to the i, f (old c) and o (new c) gates"),
    "weight_input": ("LSTM GRU RNN", "scan loop chain", False, "a recurrent weight is a graph input"),
    "weight_computed": ("LSTM GRU RNN", "scan loop chain", False, "a recurrent weight is computed from a graph input"),
    "weight_overridable": ("LSTM GRU RNN", "scan loop chain", False, "a recurrent weight is an initializer that is also a graph input"),
    "state_leak": ("LSTM GRU RNN", "scan loop chain", False, "the carried state is cell + 0.1 * h_prev"),
    "output_is_cell": ("LSTM", "scan loop chain", False, "the per-step output is the cell state c"),
    "output_prev_h": ("LSTM GRU RNN", "scan loop chain", False, "the per-step output is the previous hidden state"),
    "coupled_if": ("LSTM", "scan loop chain", False, "coupled input-forget gate f = 1 - i"),
    "mixed_acts": ("LSTM GRU", "scan loop chain", False, "the forget (LSTM) / reset (GRU) gate uses another activation"),
    "h_from_old_c": ("LSTM", "scan loop chain", False, "h = o * act(c_prev) instead of act(c_new)"),
    "asym_clip": ("LSTM GRU RNN", "scan loop chain", False, "gate inputs clipped to [-2, 3]"),
    "gru_swapped_update": ("GRU", "scan loop chain", False, "h_new = z*n + (1-z)*h (z and 1-z swapped)"),
    "mask_zero_state": ("LSTM GRU RNN", "scan loop chain", True, "at masked steps the carried h becomes 0 (and is read back)"),
    "lstm_c_unmasked": ("LSTM", "scan loop chain", True, "the cell state c ignores the mask (h is kept, c is updated)"),
    "inverted_mask_c": ("LSTM", "scan loop chain", True, "the cell state is updated where the mask is false"),
    "state_unmasked_output_masked": ("LSTM GRU RNN", "scan loop chain", True, "states update at masked steps; only the output holds"),
    "loop_short": ("LSTM GRU RNN", "loop", False, "the Loop runs max(T-1, 1) iterations (over x's first steps)"),
    "float_mask": ("LSTM GRU RNN", "scan loop chain", True, "the mask is a float input used as m*new + (1-m)*old (not provably 0/1)"),
    "mask_dir_mismatch": ("LSTM GRU RNN", "scan", True, "the mask is scanned in the opposite direction from the input"),
    "loop_shifted_input": ("LSTM GRU RNN", "loop", False, "the step reads X[min(i+1, T-1)] instead of X[i]"),
    "loop_fixed_input": ("LSTM GRU RNN", "loop", False, "every step reads X[0]"),
    "gru_reset_on_input": ("GRU", "scan loop chain", False, "the reset gate multiplies the input part of the candidate"),
    "lstm_c_tanh": ("LSTM", "scan loop chain", False, "the carried cell state is tanh(c_new)"),
    "mask_on_input": ("LSTM GRU RNN", "scan loop chain", True, "the mask zeroes the step input; states update at every step"),
    "mask_input_inverted": ("LSTM GRU RNN", "scan loop chain", True,
                            "states are masked, and the step input is zeroed at valid steps (multiplied by the negated mask)"),
    "partial_clip": ("LSTM GRU", "scan loop chain", False, "every gate but the candidate is clipped"),
    "loop_trip_other_dim": ("LSTM GRU RNN", "loop", False, "trip count M = batch size while the condition bounds i by T (min(B, T) steps)"),
    "loop_cond_short": ("LSTM GRU RNN", "loop", False, "trip count T, but the condition stops after T-1 steps"),
    "unmasked_copy_final": ("LSTM GRU RNN", "scan loop chain", True,
                            "a carried copy of the cell output ignores the mask, and its final value is returned"),
    "chain_mask_shifted": ("LSTM GRU RNN", "chain", True, "step t reads the mask of step t+1 (the last step: of step 0)"),
    "xmask_prev_step": ("LSTM GRU RNN", "chain", True, "the mask computed from the step input: step t's from x_{t-1} (step 0's from x_0)"),
    "xmask_batch_rows": ("LSTM GRU RNN", "chain", True,
                         "the mask computed from the step input is one value for all rows (every row's step valid)"),
    "chain_state_read_midway": ("LSTM GRU RNN", "chain", False, "the middle step's hidden state is also a graph output"),
    "chain_input_reads_state": ("LSTM GRU RNN", "chain", False, "each step's input is 2 * x_t times the mean of h (not state-independent)"),
    "second_output_reads_prev": ("LSTM GRU RNN", "scan loop chain", True,
                                 "beside the carried output, the zero-filled second output adds 0.25 * the previous carried output"),
}


@dataclass(frozen=True)
class Opts:
    """One hand-written recurrence. Cell maths first, then formulation choices, then the near-miss knob."""

    op: str = "LSTM"  # LSTM | GRU | RNN
    front: str = "scan"  # scan | loop
    F: int = 3
    H: int = 4
    seed: int = 0
    acts: tuple | None = None  # ((kind, params), ...) in ONNX order; None = defaults; RNN may use ("Affine", (1.0, 0.0))
    clip: float | None = None
    lbr: int = 0  # GRU linear_before_reset
    bias: str = "one"  # none | one (b_ih + b_hh as one vector) | two (b_ih and b_hh apart)
    uniform_bias: bool = False  # every gate's bias vector holds one value (e.g. Keras unit_forget_bias)
    forget_bias: float = 0.0  # LSTM: a scalar added to the forget gate (TF BasicLSTMCell style)
    direction: str = "forward"  # forward | reverse
    reverse_form: str = "native"  # native: scan_input_directions=1 (Scan); Loop: flip (Slice step -1 outside) | revseq (ReverseSequence) | index (Gather(X, T-1-i)) | negindex (Gather(X, -1-i))
    out_time_order: bool = True  # reverse only: per-step outputs in time order (else in processing order)
    flip_out: bool = False  # additionally reverse the per-step output along time (scan_output_directions)
    batch_first: bool = False
    init: str = "zeros"  # zeros | input | input_h (h0 an input, c0 zeros) | fill (a constant 0.25 fill) | learned (Expand of a [1, H] row)
    init_form: str = "cos"  # cos: ConstantOfShape;  expand: Expand(scalar, shape)
    # none | where | where_not | cast_not | cast_sub | delta; a padding mask (the input is True at padding):
    # pad (Where(pad, old, new)) | pad_cast (Cast(pad) * old + (1 - Cast(pad)) * new);
    # reduce_all: Where(Cast(ReduceMin(Cast(Not(m), int64), -1), bool), old, new) (Keras 3 on the JAX backend)
    mask: str = "none"
    mask_rank: int = 3  # 3: bool [T, B, 1];  2: bool [T, B] (Unsqueeze in the body)
    fill: str = "carry"  # carry | zero: what the per-step output holds at masked steps
    carry_src: str = "state"  # carry: the output is the masked h state (from h0) | prev (a separate carried output)
    prev_init: str = "zeros"  # carry_src=prev: initial previous output: zeros | fill (0.25) | input (graph input p0)
    zero_form: str = "const"  # zeros at masked steps (Where forms): const | cos (ConstantOfShape(Shape)) | sub (y - y) | mul0
    outputs: tuple = ("seq", "h", "c")  # which of Y, final h, final c (and "p", the final carried output) to return
    extra_seq: bool = False  # a second per-step output with the other masked-step fill (single layer only)
    # matmul (MatMul + Add) | gemm | gemm_t (Gemm transB=1) | gemm_ab (alpha=2, beta=0.5) | einsum (bk,kn->bn)
    # | einsum_t (nk,bk->bn: the weight transposed, first)
    matmul: str = "matmul"
    layout: str = "separate"  # separate | fused_split | fused_slice | fused_view (Reshape [-1, G, H] + Split + Squeeze) | fused_view_gather
    # | fused_view_batch (the view's batch read from X's shape)
    concat: bool = False  # Concat([x, h]) . [W; R] instead of x.W + h.R (GRU: separate layout only; lbr=0 uses Concat([x, r*h]))
    act_form: str = "op"  # op | clip | maxmin | minmax | relu6: how HardSigmoid / Relu are written; exp: Sigmoid as 1/(1+exp(-x)); clip0: a clipped Relu as Clip(x, 0, clip)
    clip_form: str = "op"  # op | minmax
    gru_update: str = "a"  # a: (1-z)*n + z*h;  b: n + z*(h-n);  c: z*h + n - z*n;  lerp: torch.lerp(n, h, z)
    weights: str = "outer"  # outer | body_const | body_init | carried
    perm: tuple | None = None  # storage order of gates in fused weights (names of GATES[op]); None = ONNX order
    state_order: str = "hc"  # LSTM: order of the carried states (hc | ch)
    noise: bool = False  # harmless Reshape / Unsqueeze+Squeeze / Identity nodes on the recurrent path
    direct_out: bool = False  # graph outputs are the Scan/Loop (or adapter) outputs themselves, no Identity
    mask_input_too: bool = False  # masked cells: the step input is also multiplied by the mask (same maths)
    dropout: bool = False  # an inference-mode Dropout (identity) on the step input
    weight_cast: bool = False  # weights stored as float64 and Cast to float32 in the body
    loop_counter: bool = False  # Loop: index the step input with a carried int64 counter instead of the iteration number
    # Loop counter: what it adds each step, when not the constant 1 in the body: "carried" a 1 carried through the
    # loop unchanged (TF autograph's range/delta), "carried_2" a 2 so carried (a near miss: it skips steps)
    loop_counter_delta: str = ""
    # Loop, masked: what is done to the mask outside the body, in any combination (tf.while_loop writes all three):
    # float (cast to 0/1 floats: the body's select casts or blends those), carried (passed through the loop as a
    # carried value the body returns unchanged), view (the body views the read row again by a whole-axes Slice)
    mask_outside: tuple = ()
    mask_time_name: str = ""  # the mask input's time axis declared by this name (not x's): its length unproven
    mask_batch_name: str = ""  # the mask input's batch axis declared by this name (not x's): a broadcast one row may be
    mask_read_bf: bool = False  # Loop, forward, time-major x: the mask input is [B, T(, 1)], read in the body as mask[:, t]
    loop_bound: str = "M"  # Loop: M (trip count Shape(X)[0]) | cond (condition i+1 < T) | both | const (M a constant, static_T)
    static_T: int = 0  # declare a fixed number of time steps (0: dynamic)
    static_B: int = 0  # declare a fixed batch size (0: dynamic)
    xproj: bool = False  # probe: x.W (+b) computed outside the recurrence for all steps, the body adds it
    xproj_transposed: bool = False  # xproj computed on the batch-first input and transposed back (Keras 3 on JAX)
    layers: str = "single"  # single | bidir (forward + reverse over X, outputs concatenated) | stack (two layers)
    # | side (two cells side by side over X in the same direction, outputs concatenated: one chain, two lanes)
    step_slice: str = "gather"  # chain: each step's input as gather (Gather(X, t)) | slice (Squeeze(Slice)) | split (Split + Squeeze)
    step_inputs: str = ""  # chain (forward, unmasked, one layer): what step k reads instead of x_k: double (2 * x_k) |
    # diff (x_k - x_{k-1}, x_0 first) | stride2 (x_0, x_2, ...) | perm (odd steps, then even ones) | first_other (x_k,
    # the first step through a cell with other weights)
    lengths: str = ""  # chain, masked: the step mask written from an int64 input `lengths` [B] (no `mask` input):
    # lt: Greater(lengths, t) (torch's `t < lengths`) | le: LessOrEqual(t + 1, lengths) | start: LessOrEqual(T - lengths, t) (pre-padded rows)
    # | arange: one [T, B] mask Less(Range(T)[:, None], lengths[None, :]) sliced per step | arange_float: its Cast to float
    # | xmask: no lengths input either: each step's mask is computed from its own x_t, ``(x_t != 0).any(-1)`` (the
    # input sets zero X at padded steps) | gt0: the mask input (laid out as without lengths) is float 0/1, each step's
    # mask its slice compared with 0 (torch's ``mask[:, t] > 0``)
    mutation: str | None = None

    def activations(self) -> tuple:
        return tuple(self.acts) if self.acts is not None else DEFAULT_ACTS[self.op]

    def gate_order(self) -> tuple:
        return tuple(self.perm) if self.perm is not None else GATES[self.op]

    def replace(self, **kw) -> "Opts":
        return dataclasses.replace(self, **kw)

    def label(self) -> str:
        """The options that differ from the defaults, as ``Opts(...)`` keyword arguments."""
        base = Opts()
        bits = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != getattr(base, f.name) or f.name == "op":
                bits.append(f"{f.name}={v!r}")
        return "Opts(" + ", ".join(bits) + ")"

    def masked(self) -> bool:
        return self.mask != "none"

    def padding(self) -> bool:
        """Whether the mask input is True at padded steps."""
        return self.mask in ("pad", "pad_cast")

    def wants(self, what: str) -> bool:
        if what == "c" and self.op != "LSTM":
            return False
        if what == "p" and not has_prev(self):
            return False
        return what in self.outputs


def has_prev(o: Opts) -> bool:
    """Whether the recurrence carries a separate previous-output state."""
    return o.masked() and o.fill == "carry" and o.carry_src == "prev"


# mutations written for a mask that is true at valid steps: with a padding mask they are no near miss (the
# cell state kept where the padding mask is true is the padding mask's cell) or need a float mask
PADDING_SENSE_MUTATIONS = ("inverted_mask_c", "float_mask")


def mutation_fixup(name: str, o: Opts) -> Opts:
    """Adjust ``o`` (mask, outputs, activations) so that mutation ``name`` applies to it and shows."""
    ops, fronts, needs_mask, _ = MUTATIONS[name]
    o = o.replace(mutation=name)
    if needs_mask and not o.masked():
        o = o.replace(mask="where")
    if name.startswith("xmask_"):
        o = o.replace(mask="where", mask_rank=2, lengths="xmask")
    if o.padding() and name in PADDING_SENSE_MUTATIONS:
        o = o.replace(mask="where")
    if name == "unmasked_copy_final":
        o = o.replace(fill="carry", carry_src="prev", outputs=tuple(sorted(set(o.outputs) | {"p"})))
    if name == "second_output_reads_prev":
        o = o.replace(fill="carry", carry_src="prev", extra_seq=True, outputs=tuple(sorted(set(o.outputs) | {"seq"})))
    if name in ("output_is_cell", "output_prev_h", "state_unmasked_output_masked") and "seq" not in o.outputs:
        o = o.replace(outputs=tuple(sorted(set(o.outputs) | {"seq"})))
    acts = o.activations()
    if name == "lstm_wrong_gate" and acts[0] == acts[1]:
        o = o.replace(acts=None)
    if name == "extra_scale" and any(a[0] in HOMOGENEOUS for a in acts):
        o = o.replace(acts=None)
    if name == "extra_tanh" and o.op == "RNN" and acts[0][0] == "Affine":
        o = o.replace(acts=None)
    return o


def mutation_applies(name: str, o: Opts) -> bool:
    ops, fronts, needs_mask, _ = MUTATIONS[name]
    if o.op not in ops.split() or o.front not in fronts.split() or o.layers != "single":
        return False
    if needs_mask and not o.masked():
        return False
    if name.startswith("xmask_") and (o.lengths != "xmask" or o.xproj or o.step_inputs):
        return False
    if name == "float_mask" and o.lengths:
        return False  # (the mask is an input of its own)
    acts = o.activations()
    if name == "lstm_wrong_gate" and acts[0] == acts[1]:
        return False  # with f == g the swap is a relabelling of gates
    if name == "extra_scale" and any(a[0] in HOMOGENEOUS for a in acts):
        return False
    if name == "extra_tanh" and o.op == "RNN" and acts[0][0] == "Affine":
        return False
    if name == "mixed_acts" and acts[0] == ("HardSigmoid", (0.25, 0.5)):
        return False
    if name in ("output_is_cell", "output_prev_h", "state_unmasked_output_masked") and "seq" not in o.outputs:
        return False
    if name == "unmasked_copy_final" and not (has_prev(o) and "p" in o.outputs):
        return False
    if name == "second_output_reads_prev" and not (has_prev(o) and o.extra_seq and "seq" in o.outputs):
        return False
    return True


def mutation_expressible(name: str, o: Opts) -> bool:
    """Whether a native op with *derived* weights computes the mutated cell exactly (then fusing is fine)."""
    f = o.activations()[0]
    if name == "lstm_o_as_f":
        return True  # W_f := W_o
    if name == "peephole":
        return True  # ONNX LSTM input P (i, f read the old c, o the new one)
    if name == "extra_scale" and o.op == "RNN" and f[0] == "Tanh":
        return True  # 1.5 * tanh(a) is ScaledTanh(1.5, 1)(a)
    if name == "mask_input_inverted":
        return True  # the input is zero at every valid step: a native op with zero input weights computes it
    if name in ("mask_on_input", "loop_shifted_input", "loop_fixed_input"):
        return True  # an unmasked native op over a transformed X (computed outside the recurrence)
    if name in ("loop_short", "loop_trip_other_dim") and o.front == "loop":
        # max(T - 1, 1) iterations, or min(B, T) (the trip count B, the condition i < T), reading x[i] with a
        # Gather (which fails past x's end): a native op over x's first M steps, M a runtime trip count
        # (passes/loop_counts.check_trip_count), clamped to x's length as the condition clamps it
        return True
    if o.front == "chain" and name in ("output_prev_h", "chain_state_read_midway", "state_unmasked_output_masked"):
        # an unrolled chain's h read step by step: each reader gets its step of the native op's Y (issue 14
        # item 4) and computes from it what it did (the previous h stacked, a graph output, the output's select)
        return True
    if name == "output_prev_h" and o.front in ("loop", "scan"):
        # a per-step head on the h the step read: the op's Y one step later, h0 first (step_heads); under a
        # mask the Y carried through masked steps, as the kept state is (passes/loop_heads)
        return True
    if name == "asym_clip" and o.op == "RNN" and f[0] == "Relu":
        return True  # relu(clip(a, -2, 3)) = relu(clip(a, -3, 3)): a native op's clip 3 (cells/recognise.canonical_clips)
    if name in ("coupled_if", "gru_swapped_update"):
        # 1 - sigmoid(a) = sigmoid(-a);  1 - hard_sigmoid(alpha, 0.5)(a) = hard_sigmoid(alpha, 0.5)(-a)
        return f[0] == "Sigmoid" or (f[0] == "HardSigmoid" and abs(f[1][1] - 0.5) < 1e-12)
    return False


# ------------------------------------------------------------------------------------------------------
# weights


def math_weights(o: Opts):
    """ONNX-layout ``W [G*H, F]``, ``R [G*H, H]``, ``B [2*G*H]`` of the maths (forget_bias included)."""
    rng = np.random.default_rng(1000 + o.seed)
    G = len(GATES[o.op])
    H = o.H
    k = 1.0 / np.sqrt(H)
    W = rng.uniform(-k, k, (G * H, o.F)).astype(np.float32)
    R = rng.uniform(-k, k, (G * H, H)).astype(np.float32)
    B = rng.uniform(-k, k, 2 * G * H).astype(np.float32)
    if o.uniform_bias:
        B = np.repeat(B[::H][: 2 * G], H).astype(np.float32)
    if o.bias == "none":
        B[:] = 0
    if o.op == "LSTM" and o.forget_bias:
        fi = GATES["LSTM"].index("f")
        B[fi * H : (fi + 1) * H] += np.float32(o.forget_bias)
    return W, R, B


def _written(o: Opts) -> dict:
    """Per-gate ``(Wx [F,H], Wh [H,H], bx [H], bh [H])`` as written into the graph (forget_bias apart)."""
    W, R, B = math_weights(o)
    sw = split_weights(o.op, W, R, B)
    if o.op == "LSTM" and o.forget_bias:
        Wx, Wh, bx, bh = sw["f"]
        sw["f"] = (Wx, Wh, (bx - np.float32(o.forget_bias)).astype(np.float32), bh)
    return sw


# ------------------------------------------------------------------------------------------------------
# graph writing helpers


class Scope:
    """Nodes and initializers of one graph (the main graph or a body) with fresh names."""

    def __init__(self, prefix: str, counter: list):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._counter = counter

    def fresh(self, hint: str) -> str:
        self._counter[0] += 1
        return f"{self.prefix}{hint}_{self._counter[0]}"

    def op(self, op_type: str, *inputs: str, n: int = 1, hint: str | None = None, **attrs):
        outs = [self.fresh(hint or op_type.lower()) for _ in range(n)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh("n_" + op_type), **attrs))
        return outs if n > 1 else outs[0]

    def init(self, arr, hint: str) -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def constant(self, arr, hint: str = "k") -> str:
        name = self.fresh(hint)
        value = numpy_helper.from_array(np.asarray(arr), name + "_v")
        self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh("n_Constant"), value=value))
        return name

    def f(self, v: float, hint: str = "s") -> str:
        return self.constant(np.array(v, np.float32), hint)

    def i64(self, *vals) -> str:
        return self.constant(np.array(vals, np.int64), "i")


class ModelBuilder:
    """Main-graph state shared by the layers of one model."""

    def __init__(self, o: Opts):
        self.o = o
        self.counter = [0]
        self.main = Scope("", self.counter)
        self.inputs: list = []
        self.outputs: list = []
        self.extra_inputs: list = []  # graph inputs a mutation adds (ValueInfo)
        self.input_values: dict = {}  # feed values for those inputs
        self.overridable: list = []  # initializers that are also graph inputs

    def inputs_names(self) -> set:
        return {v.name for v in self.inputs + self.extra_inputs + self.overridable}


@dataclass
class Ctx:
    """One layer being written: its options (``o``), body scope and pass-through weights."""

    o: Opts
    mb: ModelBuilder
    body: Scope
    carried: list = field(default_factory=list)  # (outer init name, body input name) for pass-through weights
    recurrent_weight_done: bool = False
    mutated_weight: str | None = None  # chains: the mutated recurrent weight, read by every step
    step_recurrent: int = 0  # chains: recurrent weights asked for in the current step so far

    @property
    def main(self) -> Scope:
        return self.mb.main

    def weight(self, arr, hint: str, recurrent: bool = False) -> str:
        arr = np.ascontiguousarray(np.asarray(arr, np.float32))
        mut = self.o.mutation
        if recurrent and self.o.front == "chain":
            self.step_recurrent += 1
            if self.step_recurrent == 1 and self.mutated_weight is not None:
                return self.mutated_weight  # every step reads the same (mutated) first recurrent weight
        if recurrent and not self.recurrent_weight_done and mut in ("weight_input", "weight_computed", "weight_overridable"):
            self.recurrent_weight_done = True
            self.mutated_weight = self._mutated_weight(arr)
            return self.mutated_weight
        where = self.o.weights
        stored = arr.astype(np.float64) if self.o.weight_cast else arr
        if where == "body_const":
            name = self.body.constant(stored, hint)
        elif where == "body_init":
            name = self.body.init(stored, hint)
        else:
            name = self._bring(self.main.init(stored, hint), arr.shape, stored.dtype)
        if self.o.weight_cast:
            name = self.body.op("Cast", name, to=FLOAT, hint=hint + "_f32")
        return name

    def _mutated_weight(self, arr) -> str:
        """The first recurrent weight as the mutation has it: a graph input, computed from one, or overridable."""
        mut, mb = self.o.mutation, self.mb
        if mut == "weight_input":
            name = self.main.fresh("W_in")
            mb.extra_inputs.append(helper.make_tensor_value_info(name, FLOAT, list(arr.shape)))
            mb.input_values[name] = arr
            return self._bring(name, arr.shape)
        if mut == "weight_computed":
            s = self.main.fresh("w_scale")
            mb.extra_inputs.append(helper.make_tensor_value_info(s, FLOAT, [1]))
            mb.input_values[s] = np.ones(1, np.float32)
            name = self.main.op("Mul", self.main.init(arr, "W_base"), s, hint="W_scaled")
            return self._bring(name, arr.shape)
        name = self.main.init(arr, "W_over")
        mb.overridable.append(helper.make_tensor_value_info(name, FLOAT, list(arr.shape)))
        return self._bring(name, arr.shape)

    def _bring(self, outer: str, shape, dtype=np.float32) -> str:
        """An outer tensor in the body: captured, or a pass-through state when ``weights='carried'``."""
        if self.o.weights != "carried":
            return outer
        inner = self.body.fresh("wc")
        self.carried.append((outer, inner, list(shape), helper.np_dtype_to_tensor_dtype(np.dtype(dtype))))
        return inner


# ------------------------------------------------------------------------------------------------------
# the step


def _mm(ctx: Ctx, a: str, w: np.ndarray, bias: np.ndarray | None, hint: str, recurrent: bool = False) -> str:
    """``a @ w (+ bias)`` in the chosen matmul form."""
    b, o = ctx.body, ctx.o
    if o.matmul == "matmul":
        y = b.op("MatMul", a, ctx.weight(w, hint, recurrent), hint="mm")
        if bias is not None:
            y = b.op("Add", y, ctx.weight(bias, hint + "_b"), hint="addb")
        return y
    if o.matmul in ("einsum", "einsum_t"):  # (jnp.einsum, torch.einsum); einsum_t: the weight stored [N, K], first
        if o.matmul == "einsum":
            y = b.op("Einsum", a, ctx.weight(w, hint, recurrent), equation="bk,kn->bn", hint="einsum")
        else:
            y = b.op("Einsum", ctx.weight(np.ascontiguousarray(w.T), hint + "T", recurrent), a, equation="nk,bk->bn", hint="einsum")
        return y if bias is None else b.op("Add", y, ctx.weight(bias, hint + "_b"), hint="addb")
    attrs = {}
    if o.matmul == "gemm":
        ins = [a, ctx.weight(w, hint, recurrent)]
    elif o.matmul == "gemm_t":
        ins = [a, ctx.weight(np.ascontiguousarray(w.T), hint + "T", recurrent)]
        attrs["transB"] = 1
    else:  # gemm_ab: alpha * a @ (w / alpha) + beta * (bias / beta)
        ins = [a, ctx.weight(w / 2.0, hint + "half", recurrent)]
        attrs["alpha"] = 2.0
        if bias is not None:
            attrs["beta"] = 0.5
            bias = bias * 2.0
    if bias is not None:
        ins.append(ctx.weight(bias, hint + "_b"))
    return b.op("Gemm", *ins, hint="gemm", **attrs)


def _add(b: Scope, *xs: str) -> str:
    y = xs[0]
    for x in xs[1:]:
        y = b.op("Add", y, x)
    return y


def _split_cols(ctx: Ctx, y: str, n: int, H: int) -> list[str]:
    b, o = ctx.body, ctx.o
    if n == 1:
        return [y]
    if o.layout == "fused_split":
        return b.op("Split", y, b.i64(*([H] * n)), n=n, axis=-1)
    if o.layout in ("fused_view", "fused_view_gather", "fused_view_batch"):  # torch: gates.view(-1, n, H).unbind(1)
        if o.layout == "fused_view_batch":  # view(x.size(1), n, H) as torch trace writes it: the batch read from X
            batch = b.op("Gather", b.op("Shape", "X"), b.constant(np.array(0 if o.batch_first else 1, np.int64), "bax"))
            v = b.op("Reshape", y, b.op("Concat", b.op("Unsqueeze", batch, b.i64(0)), b.i64(n), b.i64(H), axis=0))
        else:
            v = b.op("Reshape", y, b.i64(-1, n, H))
        if o.layout == "fused_view_gather":
            return [b.op("Gather", v, b.constant(np.array(k, np.int64), "k"), axis=1) for k in range(n)]
        return [b.op("Squeeze", p, b.i64(1)) for p in b.op("Split", v, b.i64(*([1] * n)), n=n, axis=1)]
    return [b.op("Slice", y, b.i64(k * H), b.i64((k + 1) * H), b.i64(1)) for k in range(n)]


def _clip(ctx: Ctx, x: str, lo: float, hi: float) -> str:
    b = ctx.body
    if ctx.o.clip_form == "minmax":
        return b.op("Min", b.op("Max", x, b.f(lo)), b.f(hi))
    return b.op("Clip", x, b.f(lo), b.f(hi))


def _act(ctx: Ctx, kind: str, params: tuple, x: str, clip: bool = True) -> str:
    """An activation of a gate pre-activation (clipped first when the cell has a clip)."""
    b, o = ctx.body, ctx.o
    if kind == "Relu" and o.act_form == "clip0" and clip and o.clip is not None and not o.mutation:
        return b.op("Clip", x, b.f(0.0), b.f(o.clip))  # Relu(clip(x, -c, c)) as one Clip (Keras' relu6)
    if clip:
        if o.mutation == "asym_clip":
            x = _clip(ctx, x, -2.0, 3.0)
        elif o.clip is not None:
            x = _clip(ctx, x, -o.clip, o.clip)
        elif o.mutation == "partial_clip":
            x = _clip(ctx, x, -1.0, 1.0)
    form = o.act_form
    if kind == "HardSigmoid" and form not in ("op", "exp"):
        a, be = params
        if form == "relu6":
            y = b.op("Add", b.op("Mul", x, b.f(6 * a)), b.f(6 * be))
            return b.op("Div", b.op("Clip", y, b.f(0.0), b.f(6.0)), b.f(6.0))
        y = b.op("Add", b.op("Mul", x, b.f(a)), b.f(be))
        if form == "clip":
            return b.op("Clip", y, b.f(0.0), b.f(1.0))
        if form == "maxmin":
            return b.op("Max", b.op("Min", y, b.f(1.0)), b.f(0.0))
        return b.op("Min", b.op("Max", y, b.f(0.0)), b.f(1.0))
    if kind == "Sigmoid" and form == "exp":
        return b.op("Reciprocal", b.op("Add", b.f(1.0), b.op("Exp", b.op("Neg", x))))
    if kind == "Relu" and form not in ("op", "exp"):
        if form == "clip":
            return b.op("Clip", x, b.f(0.0))
        return b.op("Max", x, b.f(0.0))
    if kind == "Affine":
        a, be = params
        if (a, be) == (1.0, 0.0):
            return b.op("Identity", x)
        return b.op("Add", b.op("Mul", x, b.f(a)), b.f(be))
    names, defaults = ACT_ATTRS[kind]
    attrs = {} if tuple(params) == tuple(defaults) else dict(zip(names, params))
    y = b.op(kind, x, **attrs)
    if o.noise:
        y = b.op("Identity", y)
    return y


def _preacts(ctx: Ctx, x: str, h: str, xw: dict | None) -> tuple[dict, dict]:
    """Pre-activations of the gates that read x and h linearly; for GRU also the candidate's parts.

    Returns ``(pre, gru)``: ``pre[g]`` for LSTM/RNN gates and GRU z, r; ``gru`` has ``xh`` (x part of the
    candidate, with its bias) and either ``hh`` (lbr=1: ``h @ Rh + Rbh``) or ``Wh``/``bh`` (lbr=0).
    """
    o = ctx.o
    sw = _written(o)
    order = o.gate_order()
    H = o.H
    std = [g for g in order if not (o.op == "GRU" and g == "h")]  # gates of the form x.W + h.R + b
    b = ctx.body
    pre: dict = {}
    gru: dict = {}
    has_b = o.bias != "none"
    one = o.bias == "one" and xw is None  # with xproj the x side already carries b_ih

    if o.layout == "separate" or xw is not None:
        row = b.op("Concat", x, h, axis=-1) if (o.concat and xw is None) else None
        for g in std:
            Wx, Wh, bx, bh = sw[g]
            if xw is not None:
                pre[g] = _add(b, xw[g], _mm(ctx, h, Wh, (bh if has_b else None), f"R{g}", recurrent=True))
            elif o.concat:
                y = _mm(ctx, row, np.concatenate([Wx, Wh], 0), (bx + bh) if one else (bx if has_b else None), f"WR{g}", recurrent=True)
                pre[g] = b.op("Add", y, ctx.weight(bh, f"b{g}h")) if o.bias == "two" else y
            else:
                xp = _mm(ctx, x, Wx, (bx if has_b else None) if not one else None, f"W{g}")
                hp = _mm(ctx, h, Wh, (bh if has_b else None) if not one else None, f"R{g}", recurrent=True)
                y = _add(b, xp, hp)
                pre[g] = b.op("Add", y, ctx.weight(bx + bh, f"b{g}")) if one else y
        if o.op == "GRU":
            Wx, Wh, bx, bh = sw["h"]
            if xw is not None:
                gru["xh"] = xw["h"]
            elif o.lbr == 0 and one:
                gru["xh"] = _mm(ctx, x, Wx, bx + bh, "Wh")
            else:
                gru["xh"] = _mm(ctx, x, Wx, bx if has_b else None, "Wh")
            if o.lbr == 1:
                gru["hh"] = _mm(ctx, h, Wh, bh if has_b else None, "Rh", recurrent=True)
            else:
                gru["Wh"] = Wh
                gru["bh"] = bh if (has_b and not one) else None
        return pre, gru

    # fused layouts: one x matrix for every gate (storage order), one h matrix for the standard gates
    # (plus the candidate for GRU lbr=1, torch style)
    xg = list(order)
    hg = [g for g in order if g in std or (o.op == "GRU" and o.lbr == 1)]
    Wx_all = np.concatenate([sw[g][0] for g in xg], 1)
    Wh_all = np.concatenate([sw[g][1] for g in hg], 1)
    if one:
        # the x side gets b_ih + b_hh of every gate except the GRU lbr=1 candidate (its b_hh is inside r*(...))
        inside = lambda g: o.op == "GRU" and g == "h" and o.lbr == 1  # noqa: E731
        bx_all = np.concatenate([sw[g][2] + (0 if inside(g) else sw[g][3]) for g in xg])
        bh_all = None
        if o.op == "GRU" and o.lbr == 1:
            bh_all = np.concatenate([sw[g][3] if g == "h" else np.zeros(H, np.float32) for g in hg])
    elif has_b:
        bx_all = np.concatenate([sw[g][2] for g in xg])
        bh_all = np.concatenate([sw[g][3] for g in hg])
    else:
        bx_all = bh_all = None
    if o.concat and o.op != "GRU":
        row = b.op("Concat", x, h, axis=-1)
        y = _mm(ctx, row, np.concatenate([Wx_all, Wh_all], 0), bx_all, "WR", recurrent=True)
        if bh_all is not None:
            y = b.op("Add", y, ctx.weight(bh_all, "bh"))
        return dict(zip(xg, _split_cols(ctx, y, len(xg), H))), gru
    xs = _split_cols(ctx, _mm(ctx, x, Wx_all, bx_all, "W"), len(xg), H)
    hs = _split_cols(ctx, _mm(ctx, h, Wh_all, bh_all, "R", recurrent=True), len(hg), H)
    xd, hd = dict(zip(xg, xs)), dict(zip(hg, hs))
    for g in std:
        pre[g] = b.op("Add", xd[g], hd[g])
    if o.op == "GRU":
        gru["xh"] = xd["h"]
        if o.lbr == 1:
            gru["hh"] = hd["h"]
        else:
            gru["Wh"] = sw["h"][1]
            gru["bh"] = sw["h"][3] if (has_b and not one) else None
    return pre, gru


def _cell(ctx: Ctx, x: str, h: str, c: str | None, xw: dict | None) -> tuple[str, str | None]:
    """The unmasked new states ``(h_cell, c_cell)`` of one step."""
    o, b = ctx.o, ctx.body
    acts = o.activations()
    mut = o.mutation
    if o.noise:
        if xw is None:
            x = b.op("Reshape", x, b.i64(-1, o.F))
        h = b.op("Squeeze", b.op("Unsqueeze", h, b.i64(0)), b.i64(0))
    pre, gru = _preacts(ctx, x, h, xw)
    fk, fp = acts[0]
    if o.op == "RNN":
        return _act(ctx, fk, fp, pre["i"]), None
    if o.op == "LSTM":
        gk, gp = acts[1]
        hk, hp = acts[2]
        if o.forget_bias:
            pre["f"] = b.op("Add", pre["f"], b.f(o.forget_bias))
        if mut == "peephole":
            rng = np.random.default_rng(7)
            P = [rng.uniform(-0.5, 0.5, o.H).astype(np.float32) for _ in range(3)]
            pre["i"] = b.op("Add", pre["i"], b.op("Mul", c, ctx.weight(P[0], "Pi")))
            pre["f"] = b.op("Add", pre["f"], b.op("Mul", c, ctx.weight(P[1], "Pf")))
        i = _act(ctx, fk, fp, pre["i"])
        f = _act(ctx, fk, fp, pre["f"])
        g = _act(ctx, gk, gp, pre["c"], clip=mut != "partial_clip")
        o_gate = None
        if mut == "mixed_acts":
            f = _act(ctx, "HardSigmoid", (0.25, 0.5), pre["f"])
        elif mut == "coupled_if":
            f = b.op("Sub", b.f(1.0), i)
        elif mut == "lstm_wrong_gate":
            g, o_gate = _act(ctx, fk, fp, pre["o"]), _act(ctx, gk, gp, pre["c"])
        elif mut == "lstm_o_as_f":
            f = _act(ctx, fk, fp, pre["o"])
        c_new = b.op("Add", b.op("Mul", f, c), b.op("Mul", i, g))
        if mut == "peephole":
            pre["o"] = b.op("Add", pre["o"], b.op("Mul", c_new, ctx.weight(P[2], "Po")))
        if o_gate is None:
            o_gate = _act(ctx, fk, fp, pre["o"])
        c_for_h = c if mut == "h_from_old_c" else c_new
        h_new = b.op("Mul", o_gate, _act(ctx, hk, hp, c_for_h, clip=False))
        return h_new, c_new
    # GRU
    gk, gp = acts[1]
    z = _act(ctx, fk, fp, pre["z"])
    r = _act(ctx, "HardSigmoid", (0.25, 0.5), pre["r"]) if mut == "mixed_acts" else _act(ctx, fk, fp, pre["r"])
    if mut == "gru_reset_on_input":
        hh = gru["hh"] if o.lbr == 1 else _mm(ctx, h, gru["Wh"], gru["bh"], "Rh", recurrent=True)
        n_pre = b.op("Add", b.op("Mul", r, gru["xh"]), hh)
    elif o.lbr == 1:
        n_pre = b.op("Add", gru["xh"], b.op("Mul", r, gru["hh"]))
    else:
        rh = b.op("Mul", r, h)
        if o.concat and o.layout == "separate" and xw is None:
            # Concat([x, r*h]) . [Wh; Rh]
            Wx, Wh, bx, bh = _written(o)["h"]
            bias = None if o.bias == "none" else (bx + bh)
            cat = b.op("Concat", x, rh, axis=-1)
            n_pre = _mm(ctx, cat, np.concatenate([Wx, Wh], 0), bias, "WRh", recurrent=True)
        else:
            n_pre = b.op("Add", gru["xh"], _mm(ctx, rh, gru["Wh"], gru["bh"], "Rh", recurrent=True))
    n = _act(ctx, gk, gp, n_pre, clip=mut != "partial_clip")
    if mut == "gru_swapped_update":
        return _add(b, b.op("Mul", z, n), b.op("Mul", b.op("Sub", b.f(1.0), z), h)), None
    if o.gru_update == "a":
        return b.op("Add", b.op("Mul", b.op("Sub", b.f(1.0), z), n), b.op("Mul", z, h)), None
    if o.gru_update == "b":
        return b.op("Add", n, b.op("Mul", z, b.op("Sub", h, n))), None
    if o.gru_update == "lerp":  # torch.lerp(n, h, z) as torch.onnx writes it
        d = b.op("Sub", h, n)
        near = b.op("Less", b.op("Abs", z), b.f(0.5))
        return b.op("Where", near, b.op("Add", n, b.op("Mul", z, d)), b.op("Sub", h, b.op("Mul", d, b.op("Sub", b.f(1.0), z)))), None
    return b.op("Sub", b.op("Add", b.op("Mul", z, h), n), b.op("Mul", z, n)), None


def _zeros(ctx: Ctx, like: str) -> str:
    b, form = ctx.body, ctx.o.zero_form
    if form == "cos":
        return b.op("ConstantOfShape", b.op("Shape", like), value=numpy_helper.from_array(np.zeros(1, np.float32)))
    if form == "sub":
        return b.op("Sub", like, like)
    if form == "mul0":
        return b.op("Mul", like, b.f(0.0))
    return b.f(0.0)


def _select(ctx: Ctx, m: str, new: str, old: str | None) -> str:
    """``m ? new : old`` in the chosen mask form (``old=None`` means zeros)."""
    b, o = ctx.body, ctx.o
    zero = old is None
    if o.mutation == "float_mask":
        if zero:
            return b.op("Mul", new, m)
        return b.op("Add", b.op("Mul", new, m), b.op("Mul", old, b.op("Sub", b.f(1.0), m)))
    if o.mask == "where":
        return b.op("Where", m, new, _zeros(ctx, new) if zero else old)
    if o.mask == "pad":
        return b.op("Where", m, _zeros(ctx, new) if zero else old, new)
    if o.mask == "where_not":
        return b.op("Where", b.op("Not", m), _zeros(ctx, new) if zero else old, new)
    if o.mask == "reduce_all":  # Keras 3 on JAX: is_masked = all(not m, axis=-1, keepdims=True) through int64
        nm = b.op("Cast", b.op("ReduceMin", b.op("Cast", b.op("Not", m), to=INT64), axes=[-1], keepdims=1), to=BOOL)
        return b.op("Where", nm, _zeros(ctx, new) if zero else old, new)
    mf = b.op("Cast", m, to=FLOAT)
    if o.mask == "pad_cast":
        kept = b.op("Mul", mf, old) if not zero else None
        fresh = b.op("Mul", b.op("Sub", b.f(1.0), mf), new)
        return fresh if zero else b.op("Add", kept, fresh)
    if zero:
        return b.op("Mul", new, mf)
    if o.mask == "cast_not":
        nm = b.op("Cast", b.op("Not", m), to=FLOAT)
        return b.op("Add", b.op("Mul", new, mf), b.op("Mul", old, nm))
    if o.mask == "cast_sub":
        return b.op("Add", b.op("Mul", mf, new), b.op("Mul", b.op("Sub", b.f(1.0), mf), old))
    return b.op("Add", old, b.op("Mul", mf, b.op("Sub", new, old)))  # delta


def _step(ctx: Ctx, x: str, h: str, c: str | None, p: str | None, m: str | None, xw) -> dict:
    """One step with masking and the per-step output: names of the new h, c, p and the output y."""
    o, b = ctx.o, ctx.body
    mut = o.mutation
    if o.dropout:
        x = b.op("Dropout", x, seed=3)
    if o.mask_input_too and m is not None and mut != "mask_on_input":
        mm = b.op("Unsqueeze", m, b.i64(1)) if o.mask_rank == 2 else m
        if o.padding():
            mm = b.op("Not", mm)
        x = b.op("Mul", x, b.op("Cast", mm, to=FLOAT))
    if mut == "mask_input_inverted":
        mm = b.op("Unsqueeze", m, b.i64(1)) if o.mask_rank == 2 else m
        if not o.padding():
            mm = b.op("Not", mm)
        x = b.op("Mul", x, b.op("Cast", mm, to=FLOAT))
    if mut == "mask_on_input":
        mm = b.op("Unsqueeze", m, b.i64(1)) if o.mask_rank == 2 else m
        x = b.op("Mul", x, b.op("Cast", mm, to=FLOAT))
        m = None  # the states ignore the mask
    h_cell, c_cell = _cell(ctx, x, h, c, xw)
    if mut == "lstm_c_tanh":
        c_cell = b.op("Tanh", c_cell)
    if mut == "extra_scale":
        h_cell = b.op("Mul", h_cell, b.f(1.5))
    elif mut == "extra_tanh":
        h_cell = b.op("Tanh", h_cell)
    elif mut == "state_leak":
        h_cell = b.op("Add", h_cell, b.op("Mul", h, b.f(0.1)))
    out: dict = {}
    y2 = None
    if m is None:
        out["h"], out["c"] = h_cell, c_cell
        y = h_cell
        y2 = h_cell
        if p is not None:  # (mask_on_input: the mask only touches the input)
            out["p"] = h_cell
    else:
        if o.mask_rank == 2:
            m = b.op("Unsqueeze", m, b.i64(1))
        if mut == "state_unmasked_output_masked":
            out["h"], out["c"] = h_cell, c_cell
            y = _select(ctx, m, h_cell, p if o.carry_src == "prev" else h)
            if o.carry_src == "prev":
                out["p"] = y
        else:
            out["h"] = _select(ctx, m, h_cell, None if mut == "mask_zero_state" else h)
            if c is None:
                out["c"] = None
            elif mut == "lstm_c_unmasked":
                out["c"] = c_cell
            elif mut == "inverted_mask_c":
                out["c"] = b.op("Where", m, c, c_cell)
            else:
                out["c"] = _select(ctx, m, c_cell, c)
            if o.fill == "zero":
                y = _select(ctx, m, h_cell, None)
                y2 = out["h"]
            else:
                y2 = _select(ctx, m, h_cell, None)
                if mut == "second_output_reads_prev":
                    y2 = b.op("Add", y2, b.op("Mul", p, b.f(0.25)))
                if o.carry_src == "prev":
                    y = _select(ctx, m, h_cell, p)
                    out["p"] = y
                else:
                    y = out["h"]
    if mut == "unmasked_copy_final" and "p" in out:
        out["p"] = h_cell
    if mut == "output_is_cell":
        y = out["c"]
    elif mut == "output_prev_h":
        y = b.op("Identity", h)
    out["y"] = b.op("Identity", y)  # a body output of its own
    if o.extra_seq and y2 is not None:
        out["y2"] = b.op("Identity", y2)
    return out


# ------------------------------------------------------------------------------------------------------
# layers (one Scan or Loop each)


def _vi(name, et, shape):
    return helper.make_tensor_value_info(name, et, shape)


def _state_list(o: Opts) -> list[str]:
    s = ["h", "c"] if o.op == "LSTM" else ["h"]
    if o.op == "LSTM" and o.state_order == "ch":
        s = ["c", "h"]
    if has_prev(o):
        s.append("p")
    return s


def _initial(ctx: Ctx, which: str, X: str, suffix: str) -> str:
    """Outer initial value of a state: a graph input or a constant fill of shape [B, H]."""
    o, g = ctx.o, ctx.main
    if (which in ("h", "c") and o.init == "input") or (which == "h" and o.init == "input_h"):
        return which + "0" + suffix
    if which == "p" and o.prev_init == "input":
        return "p0" + suffix
    if which == "p":
        value = 0.25 if o.prev_init == "fill" else 0.0
    else:
        value = 0.25 if o.init == "fill" else 0.0
    ax = 0 if o.batch_first else 1
    B = g.op("Slice", g.op("Shape", X), g.i64(ax), g.i64(ax + 1), g.i64(0))
    shape = g.op("Concat", B, g.i64(o.H), axis=0)
    if which in ("h", "c") and o.init == "learned":
        row = learned_init(o)[which][None]
        return g.op("Expand", g.init(row, f"{which}0_learned"), shape)
    if o.init_form == "expand":
        return g.op("Expand", g.f(value), shape)
    return g.op("ConstantOfShape", shape, value=numpy_helper.from_array(np.array([value], np.float32)))


def learned_init(o: Opts) -> dict:
    rng = np.random.default_rng(500 + o.seed)
    v = rng.uniform(-0.5, 0.5, (2, o.H)).astype(np.float32)
    return {"h": v[0], "c": v[1]}


def _xproj(ctx: Ctx, X: str) -> tuple[str, int]:
    """Probe formulation: ``x.W + b_ih`` for all steps outside the recurrence; returns (tensor, width)."""
    o = ctx.o
    sw = _written(o)
    order = o.gate_order()
    Wx = np.concatenate([sw[g][0] for g in order], 1)
    if o.xproj_transposed:  # projected batch-first, then transposed to the time axis the steps read
        X = ctx.main.op("Transpose", X, perm=[1, 0, 2])
    y = ctx.main.op("MatMul", X, ctx.main.init(Wx, "Wproj"))
    if o.bias != "none":
        y = ctx.main.op("Add", y, ctx.main.init(np.concatenate([sw[g][2] for g in order]), "bproj"))
    if o.xproj_transposed:
        y = ctx.main.op("Transpose", y, perm=[1, 0, 2])
    return y, len(order) * o.H


def _xw_split(ctx: Ctx, xp: str) -> dict:
    o, b = ctx.o, ctx.body
    order = o.gate_order()
    return {g: b.op("Slice", xp, b.i64(k * o.H), b.i64((k + 1) * o.H), b.i64(1)) for k, g in enumerate(order)}


def _flip0(g: Scope, x: str, form: str = "flip") -> str:
    """Reverse the time axis (0): Slice with step -1, or ReverseSequence with every length equal to T."""
    if form == "revseq":
        shape = g.op("Shape", x)
        T = g.op("Slice", shape, g.i64(0), g.i64(1), g.i64(0))
        B = g.op("Slice", shape, g.i64(1), g.i64(2), g.i64(0))
        lens = g.op("Expand", T, B)
        return g.op("ReverseSequence", x, lens, batch_axis=1, time_axis=0, hint="revseq")
    return g.op("Slice", x, g.i64(-1), g.i64(INT64_MIN), g.i64(0), g.i64(-1), hint="flip")


def _seq_names(o: Opts, res: dict, want_seq: bool) -> list[str]:
    """Body tensors stacked as per-step outputs: Y, and Y2 when ``extra_seq``."""
    names = []
    if want_seq:
        names.append(res["y"])
        if o.extra_seq and "y2" in res:
            names.append(res["y2"])
    return names


def _scan_layer(mb: ModelBuilder, o: Opts, X: str, mask: str | None, F: int, suffix: str, want_seq: bool) -> dict:
    ctx = Ctx(o, mb, Scope(f"b{suffix}_", mb.counter))
    main, body = mb.main, ctx.body
    scanned_x, width = X, F
    if o.xproj:
        scanned_x, width = _xproj(ctx, X)
    states = _state_list(o)
    st_in = {s: body.fresh(f"{s}_prev") for s in states}
    x_in = body.fresh("x_t")
    m_in = body.fresh("m_t") if mask else None
    xw = _xw_split(ctx, x_in) if o.xproj else None
    res = _step(ctx, x_in, st_in["h"], st_in.get("c"), st_in.get("p"), m_in, xw)
    b_inputs = [_vi(st_in[s], FLOAT, ["B", o.H]) for s in states]
    b_outputs = [_vi(body.op("Identity", res[s], hint=f"{s}_out"), FLOAT, ["B", o.H]) for s in states]
    outer_states = [_initial(ctx, s, X, suffix) for s in states]
    for outer, inner, shape, et in ctx.carried:
        b_inputs.append(_vi(inner, et, shape))
        b_outputs.append(_vi(body.op("Identity", inner, hint="wpass"), et, shape))
        outer_states.append(outer)
    b_inputs.append(_vi(x_in, FLOAT, ["B", width]))
    if mask:
        m_et = FLOAT if o.mutation == "float_mask" else TensorProto.BOOL
        b_inputs.append(_vi(m_in, m_et, ["B", 1][: o.mask_rank - 1]))
    seqs = _seq_names(o, res, want_seq)
    b_outputs += [_vi(y, FLOAT, ["B", o.H]) for y in seqs]
    body_graph = helper.make_graph(body.nodes, f"scan_body{suffix}", b_inputs, b_outputs, body.inits)
    n_scan_in = 2 if mask else 1
    rev = o.direction == "reverse"
    attrs: dict = dict(body=body_graph, num_scan_inputs=n_scan_in)
    if o.batch_first:
        attrs["scan_input_axes"] = [1] * n_scan_in
        if seqs:
            attrs["scan_output_axes"] = [1] * len(seqs)
    if rev:
        attrs["scan_input_directions"] = [1] * n_scan_in
    if o.mutation == "mask_dir_mismatch" and mask:
        attrs["scan_input_directions"] = [1 if rev else 0, 0 if rev else 1]
    if seqs and ((rev and o.out_time_order) != o.flip_out):
        attrs["scan_output_directions"] = [1] * len(seqs)
    finals = [main.fresh(f"{s}_final") for s in states] + [main.fresh("w_final") for _ in ctx.carried]
    ys = [main.fresh("Y_scan") for _ in seqs]
    ins = outer_states + [scanned_x] + ([mask] if mask else [])
    main.nodes.append(helper.make_node("Scan", ins, finals + ys, name=f"the_scan{suffix}", **attrs))
    r = {s: f for s, f in zip(states, finals)}
    r["Y"] = ys[0] if ys else None
    r["Y2"] = ys[1] if len(ys) > 1 else None
    return r


def _loop_layer(mb: ModelBuilder, o: Opts, X: str, mask: str | None, F: int, suffix: str, want_seq: bool) -> dict:
    ctx = Ctx(o, mb, Scope(f"b{suffix}_", mb.counter))
    main, body = mb.main, ctx.body
    Xt, Mt = X, mask
    if o.batch_first:
        Xt = main.op("Transpose", X, perm=[1, 0, 2])
        if mask:
            Mt = main.op("Transpose", mask, perm=[1, 0, 2][: o.mask_rank])
    width = F
    if o.xproj:
        Xt, width = _xproj(ctx, Xt)
    rev = o.direction == "reverse"
    if rev and o.reverse_form not in ("index", "negindex"):
        Xt = _flip0(main, Xt, o.reverse_form)
        if Mt:
            Mt = _flip0(main, Mt, o.reverse_form)
    T = main.op("Gather", main.op("Shape", Xt), main.constant(np.array(0, np.int64), "zero"), axis=0, hint="T")
    M = T
    if o.mutation == "loop_trip_other_dim":
        M = main.op("Gather", main.op("Shape", Xt), main.constant(np.array(1, np.int64), "one"), axis=0, hint="Bdim")
    if o.mutation == "loop_short":
        one = main.constant(np.array(1, np.int64), "one")
        M = main.op("Max", main.op("Sub", T, one), one)
    states = _state_list(o)
    it, cond = body.fresh("iter"), body.fresh("cond")
    st_in = {s: body.fresh(f"{s}_prev") for s in states}
    counter_in = body.fresh("k") if o.loop_counter else None
    step_no = counter_in if o.loop_counter else it
    if rev and o.reverse_form == "index":
        Tb = body.op("Gather", body.op("Shape", Xt), body.constant(np.array(0, np.int64), "zero"), axis=0)
        idx = body.op("Sub", body.op("Sub", Tb, body.constant(np.array(1, np.int64), "one")), step_no)
    elif rev and o.reverse_form == "negindex":  # a negative index counts from the end
        idx = body.op("Sub", body.constant(np.array(-1, np.int64), "minus_one"), step_no)
    else:
        idx = step_no
    x_idx = idx
    if o.mutation == "loop_shifted_input":
        Tb = body.op("Gather", body.op("Shape", Xt), body.constant(np.array(0, np.int64), "zero"), axis=0)
        one = body.constant(np.array(1, np.int64), "one")
        x_idx = body.op("Min", body.op("Add", idx, one), body.op("Sub", Tb, one))
    elif o.mutation == "loop_fixed_input":
        x_idx = body.constant(np.array(0, np.int64), "zero")
    if mask and "float" in o.mask_outside:
        Mt = main.op("Cast", Mt, to=FLOAT)
    if mask and "carried" in o.mask_outside:
        inner = body.fresh("mask_c")
        ctx.carried.append((Mt, inner, ["T", "B", 1][: o.mask_rank], FLOAT if "float" in o.mask_outside else TensorProto.BOOL))
        Mt = inner
    x_t = body.op("Gather", Xt, x_idx, axis=0, hint="x_t")
    m_t = body.op("Gather", Mt, idx, axis=1 if o.mask_read_bf else 0, hint="m_t") if mask else None
    if mask and "view" in o.mask_outside:  # (tf2onnx's m[:, None] after a kept column: starts 0, ends 1e9)
        k = o.mask_rank - 1
        m_t = body.op("Slice", m_t, body.constant(np.zeros(k, np.int64), "zeros"),
                      body.constant(np.full(k, 10**9, np.int64), "to_end"), body.constant(np.arange(k, dtype=np.int64), "axes"))
    xw = _xw_split(ctx, x_t) if o.xproj else None
    res = _step(ctx, x_t, st_in["h"], st_in.get("c"), st_in.get("p"), m_t, xw)
    delta = body.constant(np.array(1, np.int64), "one")
    if o.loop_counter_delta:  # (the counter's step carried through the loop unchanged)
        delta = body.fresh("delta_c")
        k = 2 if o.loop_counter_delta == "carried_2" else 1
        ctx.carried.append((main.constant(np.array(k, np.int64), "delta"), delta, [], TensorProto.INT64))
    nxt = body.op("Add", step_no, delta, hint="next")
    if o.mutation == "loop_cond_short":
        cond_out = body.op("Less", body.op("Add", nxt, body.constant(np.array(1, np.int64), "one")), T)
        cond0 = ""
    elif o.loop_bound in ("cond", "both") or o.mutation == "loop_trip_other_dim":
        cond_out = body.op("Less", nxt, T)
        cond0 = main.op("Less", main.constant(np.array(0, np.int64), "zero"), T)
    else:
        cond_out = body.op("Identity", cond, hint="cond_out")
        cond0 = ""
    b_inputs = [_vi(it, TensorProto.INT64, []), _vi(cond, TensorProto.BOOL, [])]
    b_inputs += [_vi(st_in[s], FLOAT, ["B", o.H]) for s in states]
    b_outputs = [_vi(cond_out, TensorProto.BOOL, [])]
    b_outputs += [_vi(body.op("Identity", res[s], hint=f"{s}_out"), FLOAT, ["B", o.H]) for s in states]
    outer_states = [_initial(ctx, s, X, suffix) for s in states]
    if o.loop_counter:
        b_inputs.append(_vi(counter_in, TensorProto.INT64, []))
        b_outputs.append(_vi(nxt, TensorProto.INT64, []))
        outer_states.append(main.constant(np.array(0, np.int64), "k0"))
    for outer, inner, shape, et in ctx.carried:
        b_inputs.append(_vi(inner, et, shape))
        b_outputs.append(_vi(body.op("Identity", inner, hint="wpass"), et, shape))
        outer_states.append(outer)
    seqs = _seq_names(o, res, want_seq)
    b_outputs += [_vi(y, FLOAT, ["B", o.H]) for y in seqs]
    body_graph = helper.make_graph(body.nodes, f"loop_body{suffix}", b_inputs, b_outputs, body.inits)
    n_fin = len(states) + (1 if o.loop_counter else 0) + len(ctx.carried)
    finals = [main.fresh(f"{s}_final") for s in states] + [main.fresh("aux_final") for _ in range(n_fin - len(states))]
    ys = [main.fresh("Y_loop") for _ in seqs]
    if o.loop_bound == "const" and o.mutation is None:
        M = main.constant(np.array(o.static_T, np.int64), "T_const")
    trip = M if o.loop_bound in ("M", "both", "const") or o.mutation in ("loop_short", "loop_trip_other_dim", "loop_cond_short") else ""
    main.nodes.append(helper.make_node("Loop", [trip, cond0] + outer_states, finals + ys, name=f"the_loop{suffix}", body=body_graph))
    outs = []
    for y in ys:
        if (rev and o.out_time_order) != o.flip_out:
            y = _flip0(main, y, o.reverse_form if rev else "flip")
        if o.batch_first:
            y = main.op("Transpose", y, perm=[1, 0, 2])
        outs.append(y)
    r = {s: f for s, f in zip(states, finals)}
    r["Y"] = outs[0] if outs else None
    r["Y2"] = outs[1] if len(outs) > 1 else None
    return r


def _chain_layer(mb: ModelBuilder, o: Opts, X: str, mask: str | None, F: int, suffix: str, want_seq: bool) -> dict:
    """The recurrence unrolled: one cell per time step in the main graph (static T), per-step outputs
    stacked with Unsqueeze + Concat (torch trace / Keras unroll=True style)."""
    ctx = Ctx(o, mb, mb.main)
    main = mb.main
    T = o.static_T
    tax = 1 if o.batch_first else 0
    Xt = _xproj(ctx, X)[0] if o.xproj else X

    def slices(src: str) -> list[str]:
        if o.step_slice == "split":
            parts = main.op("Split", src, main.i64(*([1] * T)), axis=tax, n=T)
            return [main.op("Squeeze", p, main.i64(tax)) for p in (parts if T > 1 else [parts])]
        if o.step_slice == "slice":
            return [main.op("Squeeze", main.op("Slice", src, main.i64(t), main.i64(t + 1), main.i64(tax)), main.i64(tax)) for t in range(T)]
        return [main.op("Gather", src, main.constant(np.array(t, np.int64), "t"), axis=tax) for t in range(T)]

    xs = step_input_order(o, slices(Xt), main)
    T = len(xs)
    ms = slices(mask) if mask and not o.lengths else [None] * T
    if mask and o.lengths in ("arange", "arange_float"):  # torch: m = arange(T)[:, None] < lengths[None, :], sliced per step
        n = main.op("Gather", main.op("Shape", X), main.constant(np.array(tax, np.int64), "tax"))
        steps = main.op("Range", main.constant(np.array(0, np.int64), "zero"), n, main.constant(np.array(1, np.int64), "one"))
        m_all = main.op("Less", main.op("Unsqueeze", steps, main.i64(1 - tax)), main.op("Unsqueeze", mask, main.i64(tax)))
        ms = slices(main.op("Cast", m_all, to=FLOAT) if o.lengths == "arange_float" else m_all)
    elif mask and o.lengths == "xmask":  # a step is padding where its features are all 0: Keras' Masking, per step
        zero = main.constant(np.array(0.0, np.float32), "zero")
        x_steps = slices(mask)  # (the model's input "X": a stacked layer's steps keep to the first one's padding)
        for t in range(T):
            x_t = x_steps[max(t - 1, 0)] if o.mutation == "xmask_prev_step" else x_steps[t]
            nonzero = main.op("ReduceMax", main.op("Cast", main.op("Not", main.op("Equal", x_t, zero)), to=FLOAT),
                              axes=[-1], keepdims=0)
            if o.mutation == "xmask_batch_rows":
                nonzero = main.op("ReduceMin", nonzero, axes=[0], keepdims=1)
            ms[t] = main.op("Cast", nonzero, to=TensorProto.BOOL)
    elif mask and o.lengths == "gt0":  # a float 0/1 mask input: each step's mask is its slice > 0
        zero = main.constant(np.array(0.0, np.float32), "zero")
        ms = [main.op("Greater", m_t, zero) for m_t in slices(mask)]
    elif mask and o.lengths:  # the mask of step t compares the lengths with t
        first = main.op("Sub", main.constant(np.array(T, np.int64), "T"), mask) if o.lengths == "start" else None
        for t in range(T):
            if o.lengths == "lt":
                ms[t] = main.op("Greater", mask, main.constant(np.array(t, np.int64), "t"))
            elif o.lengths == "le":
                ms[t] = main.op("LessOrEqual", main.constant(np.array(t + 1, np.int64), "t"), mask)
            else:
                ms[t] = main.op("LessOrEqual", first, main.constant(np.array(t, np.int64), "t"))
    if o.mutation == "chain_mask_shifted":
        ms = ms[1:] + ms[:1]
    states = _state_list(o)
    cur = {s: _initial(ctx, s, X, suffix) for s in states}
    rev = o.direction == "reverse"
    ys: dict[int, dict] = {}
    ctx0 = Ctx(o.replace(seed=o.seed + 100), mb, main) if o.step_inputs == "first_other" else ctx
    for t in (range(T - 1, -1, -1) if rev else range(T)):
        xw = _xw_split(ctx, xs[t]) if o.xproj else None
        x_t = xs[t]
        if o.mutation == "chain_input_reads_state":
            x_t = main.op("Mul", main.op("Mul", x_t, main.constant(np.array(2.0, np.float32), "two")),
                          main.op("ReduceMean", cur["h"], axes=[-1], keepdims=1))
        ctx.step_recurrent = 0
        res = _step(ctx0 if t == 0 else ctx, x_t, cur["h"], cur.get("c"), cur.get("p"), ms[t], xw)
        cur.update({s: res[s] for s in states})
        ys[t] = res
        if t == T // 2:
            mid = res["h"]
    order = list(range(T))
    if (rev and not o.out_time_order) != o.flip_out:
        order = order[::-1]
    r = dict(cur)
    r["mid"] = mid
    for key, name in (("y", "Y"), ("y2", "Y2")):
        if want_seq and key in ys[0] and (key == "y" or o.extra_seq):
            r[name] = main.op("Concat", *[main.op("Unsqueeze", ys[t][key], main.i64(tax)) for t in order], axis=tax)
        else:
            r[name] = None
    return r


def step_input_order(o: Opts, xs: list, g=None) -> list:
    """What the steps of a chain read, in processing order (``o.step_inputs``), from the slices ``xs``: names
    (with ``g``, nodes are added for 2 * x and differences) or arrays (without)."""
    form = o.step_inputs
    if form == "double":
        return [g.op("Mul", x, g.constant(np.array(2.0, np.float32), "two")) if g else 2 * x for x in xs]
    if form == "diff":
        return xs[:1] + [g.op("Sub", b, a) if g else b - a for a, b in zip(xs, xs[1:])]
    if form == "stride2":
        return xs[::2]
    if form == "perm":
        return xs[1::2] + xs[::2]
    return list(xs)


def _layer_opts(o: Opts) -> list[Opts]:
    """The per-layer options of a model: one layer, a forward + reverse pair, or a stack of two."""
    if o.layers == "single":
        return [o]
    o = o.replace(extra_seq=False)
    if o.layers == "bidir":
        fw = o.replace(direction="forward", flip_out=False, layers="single")
        form = ("flip" if o.reverse_form == "native" else o.reverse_form) if o.front == "loop" else "native"
        bw = o.replace(direction="reverse", reverse_form=form, out_time_order=True, flip_out=False, seed=o.seed + 1, layers="single")
        return [fw, bw]
    if o.layers == "stack":
        l1 = o.replace(layers="single", outputs=("seq",))
        l2 = o.replace(layers="single", seed=o.seed + 1, F=o.H)
        return [l1, l2]
    if o.layers == "side":
        return [o.replace(layers="single"), o.replace(layers="single", seed=o.seed + 1)]
    raise ValueError(o.layers)


def _build(o: Opts) -> tuple[onnx.ModelProto, ModelBuilder]:
    mb = ModelBuilder(o)
    main = mb.main
    T, Bd = (o.static_T or "T"), (o.static_B or "B")
    xs = [Bd, T, o.F] if o.batch_first else [T, Bd, o.F]
    mb.inputs.append(_vi("X", FLOAT, xs))
    mask = None
    if o.masked() and o.lengths == "xmask":
        mask = "X"
    elif o.masked() and o.lengths not in ("", "gt0"):
        mb.inputs.append(_vi("lengths", TensorProto.INT64, [Bd]))
        mask = "lengths"
    elif o.masked():
        Tm, Bm = o.mask_time_name or T, o.mask_batch_name or Bd
        ms = [Bm, Tm, 1] if o.batch_first or o.mask_read_bf else [Tm, Bm, 1]
        m_et = FLOAT if o.mutation == "float_mask" or o.lengths == "gt0" else TensorProto.BOOL
        mb.inputs.append(_vi("mask", m_et, ms[: o.mask_rank]))
        mask = "mask"
    los = _layer_opts(o)
    for k, lo in enumerate(los):
        sfx = "" if k == 0 else "_b"
        if o.init in ("input", "input_h"):
            mb.inputs.append(_vi("h0" + sfx, FLOAT, [Bd, lo.H]))
            if lo.op == "LSTM" and o.init == "input":
                mb.inputs.append(_vi("c0" + sfx, FLOAT, [Bd, lo.H]))
        if has_prev(lo) and lo.prev_init == "input":
            mb.inputs.append(_vi("p0" + sfx, FLOAT, [Bd, lo.H]))
    layer = {"scan": _scan_layer, "loop": _loop_layer, "chain": _chain_layer}[o.front]
    results = []
    x, F = "X", o.F
    for k, lo in enumerate(los):
        sfx = "" if k == 0 else "_b"
        r = layer(mb, lo, x, mask, F, sfx, "seq" in lo.outputs)
        results.append(r)
        if o.layers == "stack":
            x, F = r["Y"], lo.H
    if o.step_inputs:
        T = len(step_input_order(o, list(range(o.static_T))))
    ys = [Bd, T, o.H] if o.batch_first else [T, Bd, o.H]
    outs = []

    used_directly: set = set()
    renamed: dict = {}  # (an unrolled chain may return one tensor twice, e.g. as h and as p)

    def out(src: str, name: str, shape):
        if o.direct_out and src not in used_directly and src not in mb.inputs_names():
            # rename the producer's output to the graph output name (and every reader of it)
            used_directly.add(src)
            for n in main.nodes:
                for i, v in enumerate(n.output):
                    if v == src:
                        n.output[i] = name
                for i, v in enumerate(n.input):
                    if v == src:
                        n.input[i] = name
            used_directly.add(name)
            renamed[src] = name
        else:
            main.nodes.append(helper.make_node("Identity", [renamed.get(src, src)], [name], name=f"out_{name}"))
        outs.append(_vi(name, FLOAT, shape))

    last = results[-1]
    if "seq" in o.outputs:
        if o.layers in ("bidir", "side"):
            ycat = main.op("Concat", results[0]["Y"], results[1]["Y"], axis=-1)
            out(ycat, "Y", ys[:2] + [2 * o.H])
        else:
            out(last["Y"], "Y", ys)
            if last.get("Y2"):
                out(last["Y2"], "Y2", ys)
    finals_from = results if o.layers in ("bidir", "side") else [last]
    for k, r in enumerate(finals_from):
        sfx = "" if k == 0 else "_b"
        for s in ("h", "c", "p"):
            if o.wants(s):
                out(r[s], f"{s}_T{sfx}", [Bd, o.H])
    if o.mutation == "chain_state_read_midway":
        out(last["mid"], "h_mid", [Bd, o.H])
    if not outs:
        raise ValueError("the model must return something")
    graph = helper.make_graph(
        main.nodes,
        f"{o.op.lower()}_{o.front}",
        mb.inputs + mb.extra_inputs + mb.overridable,
        outs,
        main.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="rnnfuse-tests")
    model.ir_version = IR_VERSION
    return model, mb


# ------------------------------------------------------------------------------------------------------
# inputs and expected outputs


MASK_KINDS = ("post", "pre", "gappy", "none")


def mask_pattern(kind: str, T: int, B: int, rng: np.random.Generator) -> np.ndarray:
    """A [T, B] bool mask. Batch >= 2: row 0 is full and row 1 empty (zero length); batch 1 is never empty."""
    P = np.zeros((T, B), dtype=bool)
    if kind == "none":
        P[:] = True
        return P
    for b in range(B):
        if B > 1 and b == 0:
            L = T
        elif B > 1 and b == 1:
            L = 0
        else:
            L = int(rng.integers(1 if B == 1 else 0, T + 1))
        if kind == "post":
            P[:L, b] = True
        elif kind == "pre":
            P[T - L :, b] = True
        elif kind == "gappy":
            if B > 1 and b in (0, 1):
                P[:, b] = b == 0
            else:
                P[:, b] = rng.random(T) < 0.55
                if B == 1 and not P[:, b].any():
                    P[rng.integers(0, T), b] = True
        else:
            raise ValueError(kind)
    return P


def make_feeds(o: Opts, mb: ModelBuilder, rng: np.random.Generator, batch: int, T: int, mask_kind: str = "post") -> dict:
    X = rng.standard_normal((T, batch, o.F)).astype(np.float32)
    if o.masked() and o.lengths == "xmask":
        X[~mask_pattern(mask_kind, T, batch, rng)] = 0.0
    feeds = {"X": np.ascontiguousarray(X.transpose(1, 0, 2)) if o.batch_first else X}
    if o.masked() and o.lengths == "xmask":
        pass
    elif o.masked() and o.lengths not in ("", "gt0"):  # only post-padded (pre-padded for "start") masks are written with lengths
        P = mask_pattern("pre" if o.lengths == "start" else "post", T, batch, rng)
        feeds["lengths"] = P.sum(0).astype(np.int64)
    elif o.masked():
        P = mask_pattern(mask_kind, T, batch, rng)
        if o.batch_first or o.mask_read_bf:
            P = P.T
        if o.padding():
            P = ~P
        P = np.ascontiguousarray(P[..., None] if o.mask_rank == 3 else P)
        feeds["mask"] = P.astype(np.float32) if o.mutation == "float_mask" or o.lengths == "gt0" else P
    for k, lo in enumerate(_layer_opts(o)):
        sfx = "" if k == 0 else "_b"
        if o.init in ("input", "input_h"):
            feeds["h0" + sfx] = rng.standard_normal((batch, lo.H)).astype(np.float32)
            if lo.op == "LSTM" and o.init == "input":
                feeds["c0" + sfx] = rng.standard_normal((batch, lo.H)).astype(np.float32)
        if has_prev(lo) and lo.prev_init == "input":
            feeds["p0" + sfx] = rng.standard_normal((batch, lo.H)).astype(np.float32)
    feeds.update(mb.input_values)
    return feeds


def _layer_reference(lo: Opts, X: np.ndarray, mask: np.ndarray | None, h0, c0, p0) -> dict:
    """One layer from the reference, outputs in the layer's own layout. ``X`` is in the model's layout."""
    W, R, B = math_weights(lo)
    if lo.batch_first:
        X = X.transpose(1, 0, 2)
    T, Bn = X.shape[:2]
    if h0 is not None and c0 is None:
        c0 = np.zeros_like(h0)  # init="input_h"
    if h0 is None:
        if lo.init == "learned":
            li = learned_init(lo)
            h0, c0 = np.tile(li["h"], (Bn, 1)), np.tile(li["c"], (Bn, 1))
        else:
            v = 0.25 if lo.init == "fill" else 0.0
            h0 = np.full((Bn, lo.H), v, np.float32)
            c0 = np.full((Bn, lo.H), v, np.float32)
    if has_prev(lo):
        init_out = p0 if p0 is not None else np.full((Bn, lo.H), 0.25 if lo.prev_init == "fill" else 0.0, np.float32)
    else:
        init_out = h0

    def run(fill, init_out):
        return rnn_reference(
            lo.op, X, W, R, B, h0, c0 if lo.op == "LSTM" else None,
            activations=lo.activations(), clip=lo.clip, linear_before_reset=lo.lbr, direction=lo.direction,
            mask=mask, fill=fill, initial_output=init_out,
        )  # fmt: skip

    def layout(Y):
        if (lo.direction == "reverse" and not lo.out_time_order) != lo.flip_out:
            Y = Y[::-1]
        if lo.batch_first:
            Y = Y.transpose(1, 0, 2)
        return np.ascontiguousarray(Y)

    Y, Yh, Yc = run(lo.fill, init_out)
    out = {"Y": layout(Y), "h": Yh, "c": Yc}
    if has_prev(lo):
        # the carried previous output ends as the output of the last processed step (or its initial value)
        out["p"] = (Y[-1] if lo.direction == "forward" else Y[0]) if T else init_out
    if lo.extra_seq:
        Y2 = run("zero", None)[0] if lo.fill == "carry" else run("carry", h0)[0]
        out["Y2"] = layout(Y2)
    return out


def _first_other_reference(lo: Opts, X: np.ndarray, h0, c0) -> dict:
    """A chain whose first step is the cell with other weights (seed + 100), then ``lo``'s cell."""
    tax = 1 if lo.batch_first else 0
    first = _layer_reference(lo.replace(seed=lo.seed + 100), np.take(X, [0], tax), None, h0, c0, None)
    rest = _layer_reference(lo, np.take(X, range(1, X.shape[tax]), tax), None, first["h"],
                            first["c"] if lo.op == "LSTM" else None, None)
    return {"Y": np.concatenate([first["Y"], rest["Y"]], tax), "h": rest["h"], "c": rest["c"]}


def expected(o: Opts, feeds: dict) -> list[np.ndarray]:
    """What the model must output (graph output order), from the numpy reference."""
    if o.mutation:
        raise ValueError("no reference for a near miss")
    mask = None
    if o.masked() and o.lengths == "xmask":
        x = feeds["X"].transpose(1, 0, 2) if o.batch_first else feeds["X"]
        mask = (x != 0).any(-1)
    elif o.masked() and o.lengths not in ("", "gt0"):
        L, T = feeds["lengths"], feeds["X"].shape[1 if o.batch_first else 0]
        steps = np.arange(T)[:, None]
        mask = steps >= T - L[None] if o.lengths == "start" else steps < L[None]
    elif o.masked():
        m = feeds["mask"]
        mask = m.reshape(m.shape[:2]).astype(bool)
        if o.batch_first or o.mask_read_bf:
            mask = mask.T
        if o.padding():
            mask = ~mask
    los = _layer_opts(o)
    results = []
    x = feeds["X"]
    if o.step_inputs:  # the sequence the steps read, in the model's layout
        tax = 1 if o.batch_first else 0
        x = np.stack(step_input_order(o, list(np.moveaxis(x, tax, 0))), tax)
    for k, lo in enumerate(los):
        sfx = "" if k == 0 else "_b"
        if o.step_inputs == "first_other":
            results.append(_first_other_reference(lo, x, feeds.get("h0"), feeds.get("c0")))
            continue
        r = _layer_reference(lo, x, mask, feeds.get("h0" + sfx), feeds.get("c0" + sfx), feeds.get("p0" + sfx))
        results.append(r)
        if o.layers == "stack":
            x = r["Y"]
    outs = []
    if "seq" in o.outputs:
        if o.layers in ("bidir", "side"):
            outs.append(np.concatenate([results[0]["Y"], results[1]["Y"]], -1))
        else:
            outs.append(results[-1]["Y"])
            if "Y2" in results[-1]:
                outs.append(results[-1]["Y2"])
    for r in results if o.layers in ("bidir", "side") else results[-1:]:
        for s in ("h", "c", "p"):
            if o.wants(s):
                outs.append(r[s])
    return outs


def expected_native(o: Opts) -> dict:
    """The native ops a perfect fuser leaves: ``{op: sorted directions}``."""
    if o.layers == "bidir":
        return {o.op: ["bidirectional"]}
    if o.layers in ("stack", "side"):
        return {o.op: sorted([o.direction, o.direction])}
    return {o.op: [o.direction]}


def check_opts(o: Opts) -> None:
    if o.op not in GATES:
        raise ValueError(o.op)
    if o.front == "scan" and o.reverse_form in ("index", "negindex", "flip", "revseq"):
        raise ValueError("Scan reverses with scan_input_directions (reverse_form='native')")
    if o.front == "loop" and o.direction == "reverse" and o.reverse_form == "native":
        raise ValueError("a reverse Loop needs reverse_form='flip' or 'index'")
    if o.perm is not None and sorted(o.perm) != sorted(GATES[o.op]):
        raise ValueError(f"perm {o.perm} is not a permutation of {GATES[o.op]}")
    if o.mutation is not None and o.mutation not in MUTATIONS:
        raise ValueError(o.mutation)
    if o.acts is not None and len(o.acts) != len(DEFAULT_ACTS[o.op]):
        raise ValueError("wrong number of activations")
    if o.loop_bound == "const" and not o.static_T:
        raise ValueError("loop_bound='const' needs static_T")
    if o.front == "chain" and (not o.static_T or o.weights == "carried" or o.reverse_form != "native"):
        raise ValueError("an unrolled chain needs static_T, weights in the graph and reverse_form='native'")
    if o.step_inputs and (o.front != "chain" or o.masked() or o.direction != "forward" or o.layers != "single" or o.xproj
                          or o.step_inputs not in ("double", "diff", "stride2", "perm", "first_other")):
        raise ValueError("step_inputs: a forward unmasked single-layer chain without xproj")
    if o.lengths and (o.front != "chain" or not o.masked() or o.mask_rank != 2
                      or o.lengths not in ("lt", "le", "start", "arange", "arange_float", "xmask", "gt0")):
        raise ValueError("lengths: a masked chain with mask_rank=2 (each step's mask is [B]), lengths in lt | le | start | arange | xmask | gt0")
    if o.lengths in ("xmask", "gt0") and (o.step_inputs or o.mutation == "float_mask" or (o.lengths == "xmask" and (o.padding() or o.xproj))):
        raise ValueError("lengths=xmask | gt0: a per-step mask of the steps themselves (no step_inputs, no float_mask mutation)")
    if o.lengths == "arange_float" and o.mask not in ("cast_sub", "delta"):
        raise ValueError("lengths=arange_float: a float mask is blended (cast_sub | delta), not selected")


def build_full(o: Opts):
    """``(model, feeds_fn, model_builder)``."""
    check_opts(o)
    model, mb = _build(o)

    def feeds_fn(rng, batch: int, T: int, mask_kind: str = "post") -> dict:
        return make_feeds(o, mb, rng, batch, T, mask_kind)

    return model, feeds_fn, mb


def build(o: Opts):
    """``(onnx.ModelProto, feeds_fn)``; ``feeds_fn(rng, batch, T, mask_kind)`` makes the model's inputs."""
    model, feeds_fn, _ = build_full(o)
    return model, feeds_fn


def default_reverse_form(o: Opts) -> Opts:
    """Make a reverse option set valid for its front (Scan: native, Loop: flip)."""
    if o.direction != "reverse" and o.layers != "bidir":
        return o.replace(reverse_form="native") if o.front in ("scan", "chain") else o
    if o.front in ("scan", "chain"):
        return o.replace(reverse_form="native")
    if o.reverse_form == "native":
        return o.replace(reverse_form="flip")
    return o


# ------------------------------------------------------------------------------------------------------
# running a case: optimize, compare fused with original (and original with the reference)

ATOL = 1e-5
RTOL = 1e-5
REF_TOL = 1e-4  # float32 onnxruntime vs the float64 reference


@dataclass
class Outcome:
    opts: Opts
    model: onnx.ModelProto
    fused: onnx.ModelProto
    report: object
    status: str  # fused | declined | partial
    recurrent_left: int
    native: dict  # op -> sorted directions
    fused_err: float = 0.0  # max |fused - original|
    fused_mismatch: str = ""  # first mismatch beyond ATOL/RTOL ("" if none)
    ref_err: float = 0.0  # max |original - reference|
    ref_mismatch: str = ""
    sets: int = 0

    def text(self) -> str:
        return f"{self.opts.label()}\n{self.report.to_text()}"


def assert_prescreen_would_look(model: onnx.ModelProto, report) -> None:
    """Whatever was fused holds an op some pass says it needs (``fuses_only_with``): the command line, which
    copies a model holding none of them without loading it (rnnfuse.prescreen), would have run the passes on
    this one. A pass that learns to fuse a form without saying what it needs fails here, in every hand-built
    and fuzzed case."""
    from rnnfuse import wire
    from rnnfuse.pipeline import Pipeline

    if report.fused:
        needs = Pipeline.default().fusion_needs()
        assert wire.outline(model.SerializeToString(), stop_at=needs) is None, (
            f"fused, but the command line's prescreen would have copied it unexamined (no {sorted(needs)})")


def _session(model: onnx.ModelProto):
    from helpers import session

    return session(model)


def _count(model: onnx.ModelProto) -> dict:
    from helpers import op_counts

    return op_counts(model)


def _natives(model: onnx.ModelProto) -> dict:
    out: dict = {}
    for n in model.graph.node:
        if n.op_type in ("LSTM", "GRU", "RNN"):
            d = "forward"
            for a in n.attribute:
                if a.name == "direction":
                    d = a.s.decode()
            out.setdefault(n.op_type, []).append(d)
    return {k: sorted(v) for k, v in out.items()}


def _rounding_noise(session, feeds: dict, ref: list, rng) -> list:
    """How much the original's outputs move when its float inputs move by a few units in the last place: what
    float32 rounding alone can do to them. A recurrence with unbounded activations (LeakyRelu gates, a Relu
    output) grows exponentially and amplifies rounding as much as the fused op's other order of operations;
    a difference that size is no wrong rewrite."""
    moved = {k: (v * (1 + 2.0**-22 * rng.choice([-1.0, 1.0], v.shape))).astype(v.dtype) if v.dtype == np.float32 else v
             for k, v in feeds.items()}
    return [np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) for a, b in zip(session.run(None, moved), ref)]


def _mismatch(got, want, atol, rtol, what, noise=None) -> tuple[float, str]:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf"), f"{what}: shape {got.shape} != {want.shape}"
    if got.size == 0:
        return 0.0, ""
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    if np.any(np.isnan(g64) != np.isnan(w64)):
        return float("inf"), f"{what}: NaN pattern differs"
    diff = np.where(np.isnan(w64), 0.0, np.abs(g64 - w64))
    err = float(diff.max())
    bad = diff > atol + rtol * np.abs(np.nan_to_num(w64)) + (0.0 if noise is None else 8.0 * np.nan_to_num(noise))
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        return err, f"{what}: max abs error {err:.3g}; first at {idx}: got {g64[idx]:.6g}, want {w64[idx]:.6g}"
    return err, ""


def front_label(o: Opts) -> str:
    """The ``front`` a finding about this recurrence carries."""
    return {"scan": "Scan", "loop": "Loop", "chain": "chain"}[o.front]


def recurrences_left(o: Opts, before: dict, after: dict) -> tuple[int, int]:
    """(recurrences in the original, recurrences left after optimizing). An unrolled chain is left while
    its per-step recurrent matmuls are (only the input projection, when there is one, stays); counted in
    matmuls, so that a chain fused from its second step on (the first kept) is partly fused."""
    if o.front != "chain":
        return before.get("Scan", 0) + before.get("Loop", 0), after.get("Scan", 0) + after.get("Loop", 0)
    n = len(_layer_opts(o))
    mm_before = before.get("MatMul", 0) + before.get("Gemm", 0) + before.get("Einsum", 0)
    mm_after = after.get("MatMul", 0) + after.get("Gemm", 0) + after.get("Einsum", 0)
    kept = n if o.xproj else 0
    if o.step_inputs == "first_other":
        kept += mm_before // o.static_T  # the first step, another cell, stays as it is
    if mm_after <= kept:
        return n, 0
    return mm_before - kept, mm_after - kept


def run_case(
    o: Opts,
    batches=(1, 4),
    Ts=(1, 7),
    kinds=None,
    seed: int = 0,
    check_reference: bool = True,
    always_compare: bool = False,
    **optimize_kwargs,
) -> Outcome:
    """Build, optimize (exceptions propagate), and compare on every (batch, T, mask kind) input set."""
    import rnnfuse

    model, feeds_fn = build(o)
    fused, report = rnnfuse.optimize(model, **optimize_kwargs)
    assert_prescreen_would_look(model, report)
    counts = _count(fused)
    before = _count(model)
    n_rec, left = recurrences_left(o, before, counts)
    status = "fused" if left == 0 else ("declined" if left == n_rec else "partial")
    out = Outcome(o, model, fused, report, status, left, _natives(fused))
    if kinds is None:
        kinds = ("post", "pre", "gappy") if o.masked() else ("none",)
    if o.static_T:
        Ts = (o.static_T,)
    if o.static_B:
        batches = (o.static_B,)
    rng = np.random.default_rng(seed)
    s_orig = _session(model)
    s_fused = None
    if left < n_rec or always_compare:
        try:
            s_fused = _session(fused)
        except Exception as e:  # the optimizer wrote a model onnxruntime refuses
            msg = str(e).strip().splitlines()[0][:400]
            raise AssertionError(f"BROKEN MODEL: onnxruntime cannot load the optimized model: {msg}\n{out.text()}") from None
    names = [v.name for v in model.graph.output]
    noise_rng = np.random.default_rng(seed + 7919)  # (apart: the input sets stay what they were)
    do_ref = check_reference and not o.mutation
    for b in batches:
        for T in Ts:
            for k in kinds:
                feeds = feeds_fn(rng, b, T, k)
                ref = s_orig.run(None, feeds)
                out.sets += 1
                where = f"batch {b}, T={T}, mask {k}"
                if do_ref:
                    for name, got, want in zip(names, ref, expected(o, feeds)):
                        err, msg = _mismatch(got, want, REF_TOL, REF_TOL, f"original vs reference, {name}, {where}")
                        out.ref_err = max(out.ref_err, err)
                        out.ref_mismatch = out.ref_mismatch or msg
                if s_fused is not None:
                    got = s_fused.run(None, feeds)
                    noise = _rounding_noise(s_orig, feeds, ref, noise_rng)
                    for name, g, r, nz in zip(names, got, ref, noise):
                        err, msg = _mismatch(g, r, ATOL, RTOL, f"fused vs original, {name}, {where}", nz)
                        out.fused_err = max(out.fused_err, err)
                        out.fused_mismatch = out.fused_mismatch or msg
    return out
