"""Export PyTorch recurrences (and Keras 3 on the torch backend) to ONNX and record the framework's own outputs.

Usage::

    python tests/exporters/torch_cases.py --out DIR [--only SUBSTR ...] [--no-slow] [--verify]
    python tests/exporters/torch_cases.py --list [--only SUBSTR ...]

For every case three files are written into DIR:

``<case>.onnx``
    the model exactly as the exporter wrote it (one self-contained file, no external data):
    ``torch.onnx.export(dynamo=False, opset_version=17)`` of the module ("trace"), of
    ``torch.jit.script(module)`` ("torchscript"), ``torch.onnx.export(dynamo=True)`` with the
    opset it picks ("dynamo"), or Keras' ``model.export(path, format="onnx")`` ("keras3-torch").
``<case>.npz``
    ``in/<set>/<onnx input name>`` (the feeds) and ``out/<set>/<k>`` (the framework's own
    ``module(*inputs)`` / ``model(x)`` for the k-th entry of ``graph.output``).
``<case>.json``
    name, exporter, layers, ``expect`` (what a perfect fuser leaves: ``ops`` = one native op per
    recurrence, ``directions`` = "bidirectional" for a forward+backward pair over one input,
    "reverse" for a backwards loop; ``absent``; ``max_cell_ops``; ``attrs`` where a non-default
    attribute is implied: GRU ``linear_before_reset=1``, RNN ``activations=["Relu"...]``), the input
    ``sets``, ``dynamic_batch`` / ``dynamic_time``, ``masked``, ``slow``, and about the unfused
    export: ``opset``, ``nodes`` (top level), ``nodes_total`` (with subgraphs), ``exported_ops``
    (LSTM/GRU/RNN/Loop/Scan/If counts) and ``notes``.

Sets: ``b1`` and ``b3`` for dynamic-batch exports (example batch is 2), plus ``b2_t11`` when the
time axis is dynamic too; static-shape exports have only ``b<export batch>``; the masked Keras
case has right-padded, left-padded and gappy masks (``post_b1``, ``post_b3``, ``pre_b3``,
``gappy_b3``). A ``summary.jsonl`` line per attempted case (ok / error / seconds) is written too
(not ``*.json``, so globbing the cases does not pick it up).
Exports that fail are reported as one WARNING line each and skipped; the exit status is 0
when most of the selected cases were written. Keras runs in a child process of this script
(``KERAS_BACKEND=torch`` must be set before keras is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

FEATURES = 5
HIDDEN = 4
TIME = 7  # default number of steps
VOCAB = 11  # rows of the embedding tables of token inputs
CONTEXT = 3  # features of a context input concatenated to every step's input
POSITION = 2  # features of a position table's row concatenated to a step's input
EXPORT_BATCH = 2  # batch of the example inputs of dynamic-batch exports (not 1: torch.export specialises 0/1)
OPSET = 17  # trace / TorchScript exports; dynamo and Keras use their own default
ABSENT = ["Loop", "Scan", "SequenceInsert"]
ONNX_OP = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}

# Steps kept (1) / padded (0) in the masked Keras input sets; rows are batch entries.
MASK_PATTERNS = {
    "post_b1": ["1111100"],
    "post_b3": ["1111111", "1111100", "1100000"],
    "pre_b3": ["1111111", "0001111", "0111111"],
    "gappy_b3": ["1011001", "0111110", "1111111"],
}


# --------------------------------------------------------------------------- case table


@dataclass(frozen=True)
class Case:
    """One export. ``model`` selects the module builder, ``opts`` its keyword arguments."""

    name: str
    exporter: str  # "trace" | "dynamo" | "torchscript" | "keras3-torch"
    model: str  # "loop" (Python loop over a cell) | "nn" (nn.RNN/LSTM/GRU) | "script" | "keras"
    opts: dict = field(default_factory=dict)
    time: int = TIME
    batch: int = EXPORT_BATCH  # example / static batch
    features: int = FEATURES
    hidden: int = HIDDEN
    dynamic_batch: bool = True
    dynamic_time: bool = False
    slow: bool = False
    fold: bool = True  # do_constant_folding of the trace / TorchScript exporter
    optimize: bool = True  # the dynamo exporter's onnxscript optimizer (off: minutes saved on long loops)
    notes: str = ""

    @property
    def family(self) -> str:
        """lstm | gru | rnn: the native op a perfect fuser emits."""
        return self.opts["cell"].split("_")[0]

    @property
    def batch_first(self) -> bool:
        return bool(self.opts.get("batch_first"))


CASE_FIELDS = {f.name for f in fields(Case)}


def _case(name, exporter, model, cell, **kw) -> Case:
    """Keywords naming a Case field go there; the rest are builder options."""
    top = {k: kw.pop(k) for k in list(kw) if k in CASE_FIELDS}
    return Case(name, exporter, model, dict(cell=cell, **kw), **top)


def loop(name, cell, exporter="trace", **kw):
    """A Python loop over ``cell`` (nn.LSTMCell/GRUCell/RNNCell or a hand-written cell)."""
    return _case(name, exporter, "loop", cell, **kw)


def nnrnn(name, cell, exporter="dynamo", **kw):
    """``nn.RNN``/``nn.LSTM``/``nn.GRU`` called on the whole sequence; returns (output, final states...)."""
    return _case(name, exporter, "nn", cell, **kw)


def script(name, cell, **kw):
    """``torch.jit.script`` of a ``for t in range(x.size(0))`` loop; exported with dynamic batch and time."""
    return _case(name, "torchscript", "script", cell, dynamic_time=True, **kw)


def charrnn(name, cell, exporter="trace", **kw):
    """PyTorch's char-RNN tutorial: ``comb = cat(x_t, h)``, ``h = i2h(comb)`` (tanh'd or not), a per-step output
    ``log_softmax(i2o(comb))`` read from the same concatenation; returns (stacked outputs, last h)."""
    return _case(name, exporter, "charrnn", cell, **kw)


def univariate(name, cell, exporter="trace", **kw):
    """A univariate series ``[B, T]`` read one column a step (pytorch/examples' time_sequence_prediction:
    ``for input_t in input.split(1, dim=1)``; ``read="slice"``: ``x[:, t:t+1]``) by ``layers`` cells, a
    Linear(H, 1) per step; returns ``torch.cat(outputs, 1)``, [B, T]."""
    return _case(name, exporter, "univariate", cell, **kw)


def projskip(name, cell, exporter="trace", **kw):
    """``xt = Linear(x[t])`` read by the cell and by a skip connection on its output: ``outs.append(h + xt)``."""
    return _case(name, exporter, "projskip", cell, **kw)


def residual(name, cell, exporter="trace", **kw):
    """Two cells a step, the upper reading ``h1_t + x_t`` (``proj=True``: ``h1_t + Linear(x_t)``, GNMT's residual
    stack; ``cat=True``: ``cat(h1_t, x_t)``, a skip connection); ``out_res=True`` returns ``h2_t + h1_t`` stacked,
    else ``h2_t``. Features = hidden for the sums without ``proj``."""
    if not kw.get("proj") and not kw.get("cat"):
        kw.setdefault("features", HIDDEN)
    return _case(name, exporter, "residual", cell, **kw)


def gnmt(name, cell, exporter="trace", **kw):
    """GNMT's residual stack of ``layers`` cells a step: cell i >= 3 reads h_{i-1} plus the input of cell i-1
    (``c3(h2 + h1)``, ``c4(h3 + h2 + h1)``; ``x_res=True``: from cell 2 on, ``c2(h1 + x_t)``, ``c3(h2 + h1 + x_t)``);
    returns the top cell's h plus its input, stacked. Features = hidden. TorchScript: LSTM, three cells
    (``near_miss=True``: ``c3(h2 + c1)``, the state of the cell below that is not its output)."""
    kw.setdefault("features", HIDDEN)
    return _case(name, exporter, "gnmt", cell, **kw)


def keras(name, layer, **kw):
    """A Keras 3 layer on the torch backend, exported with ``model.export(format="onnx")``."""
    return _case(name, "keras3-torch", "keras", layer, **kw)


REV, REV_ITER = dict(reverse=True), dict(reverse=True, order="iteration")
BF, BI, H0 = dict(batch_first=True), dict(bidir=True), dict(init="given", ret="seq_state")
STATIC_NOTE = "static shapes (no dynamic_axes): the zero state and every shape are baked; only the export batch"

CASES = [
    # -- trace: Python loops over torch cells, dynamic batch (dynamic_axes), time-major unless _bf
    loop("lstmcell_trace", "lstm"),
    loop("grucell_trace", "gru"),
    loop("rnncell_tanh_trace", "rnn_tanh"),
    loop("rnncell_relu_trace", "rnn_relu"),
    loop("rnn_tied_trace", "rnn_tied", features=HIDDEN, notes="tanh(W(x_t + h) + b): an RNN whose W and R are one"),
    loop("rnn_tied_dynamo_bf", "rnn_tied", exporter="dynamo", features=HIDDEN, **BF),
    loop("rnn_ind_trace", "rnn_ind", notes="IndRNN: relu(W x_t + b + u * h), a native RNN with R = diag(u)"),
    loop("rnn_ind_dynamo_rev", "rnn_ind", exporter="dynamo", **REV),
    loop("lstmcell_trace_bf", "lstm", **BF),
    # -- a Linear over the sequence (no activation) before the loop: the cell multiplies its rows again
    loop("lstmcell_trace_linear_before", "lstm", prep="linear"),
    loop("grucell_dynamo_linear_before_bf", "gru", exporter="dynamo", prep="linear", **BF),
    # -- outputs written into a preallocated buffer, outs[t] = h: a chain of T scatters, one per step
    loop("grucell_trace_output_buffer", "gru", collect="buffer"),
    loop("lstmcell_dynamo_output_buffer", "lstm", exporter="dynamo", collect="buffer"),
    loop("rnncell_tanh_dynamo_output_buffer_bf", "rnn_tanh", exporter="dynamo", collect="buffer", **BF),
    loop("lstmcell_dynamo_output_buffer_unoptimized", "lstm", exporter="dynamo", collect="buffer", optimize=False,
         notes="each step's h cast like the buffer (a float-to-float Cast of a Mul) before its ScatterElements"),
    loop("rnncell_tanh_dynamo_output_buffer_bf_unoptimized", "rnn_tanh", exporter="dynamo", collect="buffer",
         optimize=False, **BF, notes="outs[:, t] = h: a ScatterElements of the column inside a ScatterND of every row"),
    loop("grucell_trace_static_output_buffer", "gru", collect="buffer", dynamic_batch=False),
    loop("grucell_trace_bf", "gru", **BF),
    loop("lstmcell_trace_rev", "lstm", **REV),
    loop("grucell_trace_rev", "gru", **REV),
    loop("rnncell_tanh_trace_rev", "rnn_tanh", **REV),
    loop("lstmcell_trace_rev_iterorder", "lstm", **REV_ITER),
    loop("grucell_trace_rev_iterorder_bf", "gru", **REV_ITER, **BF),
    loop("lstmcell_trace_bidir", "lstm", **BI),
    loop("grucell_trace_bidir", "gru", **BI),
    loop("rnncell_relu_trace_bidir_bf", "rnn_relu", **BI, **BF),
    # both cells stepped in one loop, the backward one reading x[T - 1 - t] through Shape arithmetic: the
    # two halves' slices of x had two index forms (fused as four half chains, whose merge closed a cycle)
    loop("grucell_trace_bidir_interleaved", "gru", **BI, order="interleaved", time=10),
    loop("lstmcell_trace_bidir_interleaved_bf", "lstm", **BI, **BF, order="interleaved", time=9),
    # -- one cell run forward and backward: each x_t's input projection (and, from a given h0, h0's) is
    # computed once and read by both chains
    loop("grucell_trace_bidir_shared_cell", "gru", **BI, order="interleaved", shared=True),
    loop("lstmcell_dynamo_bidir_shared_cell_h0", "lstm", exporter="dynamo", **BI, **H0, order="interleaved",
         shared=True),
    loop("rnncell_tanh_trace_bidir_shared_cell_bf", "rnn_tanh", **BI, **BF, shared=True),
    # -- the time axis last: a Conv1d's [B, F, T] read as x[:, :, t], outputs torch.stack(outs, 2)
    loop("lstmcell_trace_conv_time_last", "lstm", **BF, time_last=True),
    loop("grucell_dynamo_conv_time_last_rev", "gru", exporter="dynamo", **BF, **REV, time_last=True),
    loop("rnncell_tanh_trace_conv_time_last_bidir", "rnn_tanh", **BF, **BI, time_last=True),
    loop("grucell_trace_zeros_expanded", "gru", init="expand",
         notes="h0 = zeros_like(x[0, :, :1]).expand(-1, H): a broadcast fill read as the given initial state"),
    loop("lstmcell_trace_zeros_expanded_bf", "lstm", init="expand", **BF),
    loop("lstmcell_trace_zeros_expanded_one_state", "lstm", init="expand_one",
         notes="h = c = zeros_like(x[0, :, :1]).expand(-1, H): one zero fill as both states, its shape computed "
               "from a ones fill (torch's expand(-1, H))"),
    loop("lstmcell_trace_h0c0", "lstm", **H0),
    loop("grucell_trace_h0", "gru", **H0),
    loop("rnncell_tanh_trace_h0_bf", "rnn_tanh", **H0, **BF),
    loop("grucell_trace_last_h", "gru", ret="last"),
    loop("lstmcell_trace_last_hc", "lstm", ret="last"),
    loop("lstmcell_trace_nobias", "lstm", bias=False),
    loop("grucell_trace_nobias_h0", "gru", bias=False, **H0),
    loop("lstmcell_trace_h0_linear", "lstm", init="linear", ret="seq_state",
         notes="h0 = tanh(Linear(h0_in)), c0 = Linear(c0_in): initial states computed by the graph"),
    loop("grucell_trace_h0_linear", "gru", init="linear", ret="seq_state"),
    loop("grucell_dynamo_h0_linear", "gru", exporter="dynamo", time=6, init="linear", ret="seq_state"),
    # (without the optimizer, which takes 8 minutes on a 1,000-step LSTMCell loop, each step's gate chunks are
    # SplitToSequence + SequenceAt at constant positions)
    loop("lstmcell_dynamo_unoptimized", "lstm", exporter="dynamo", optimize=False),
    loop("grucell_dynamo_unoptimized_bf_h0", "gru", exporter="dynamo", optimize=False, **BF, **H0),
    loop("lstmcell_trace_h0c0_chunk", "lstm", init="chunk", ret="seq_state",
         notes="h0, c0 = tanh(Linear(code)).chunk(2): both initial states cut from one computed tensor"),
    loop("lstmcell_dynamo_h0c0_chunk_bf", "lstm", exporter="dynamo", init="chunk", ret="seq_state", **BF),
    loop("lstmcell_trace_static", "lstm", dynamic_batch=False, notes=STATIC_NOTE),
    # -- hand-written cell maths
    loop("gru_hand_trace", "gru_hand", time=8),
    loop("lstm_cat_trace", "lstm_cat", time=8),
    loop("lstm_pergate_trace", "lstm_pergate", time=8),
    loop("gru_hand_dynamo_bf", "gru_hand", exporter="dynamo", time=8, **BF),
    loop("gru_hand_trace_learned_init", "gru_hand", time=8, init="learned",
         notes="h0 = nn.Parameter([1, H]).expand(B, -1): the first step's chunk(3) of h0 @ W_hh is sliced at bounds "
               "computed from its shape"),
    loop("grucell_trace_learned_init_bf", "gru", init="learned", **BF),
    loop("lstmcell_trace_stacked_final_state", "lstm", ret="seq_stacked_state",
         notes="returns (ys, torch.stack([h, c])): found as a chain for h and one for c, one op"),
    # -- the char-RNN tutorial: the output head reads the cell's own cat(x_t, h) (kept per step, reading Y)
    charrnn("rnn_char_trace", "rnn_char"),
    charrnn("rnn_char_dynamo", "rnn_char", exporter="dynamo"),
    charrnn("rnn_char_script", "rnn_char", exporter="torchscript", dynamic_time=True,
            notes="a TorchScript Loop whose per-step output reads the h the step read: applied to Y one step later"),
    charrnn("rnn_char_trace_last_output", "rnn_char", ret="last_output",
            notes="returns the last step's output alone: its new h is dead, the op runs to the step before"),
    charrnn("rnn_char_linear_dynamo_last_output", "rnn_char_linear", exporter="dynamo", ret="last_output"),
    charrnn("rnn_char_trace_stacked_last", "rnn_char", ret="stacked_last",
            notes="torch.stack(outputs)[-1]: every head kept, the last step's new h dead"),
    charrnn("rnn_char_linear_trace", "rnn_char_linear",
            notes="the tutorial as first written: hidden = i2h(cat(x_t, h)), no activation (RNN with Affine(1, 0))"),
    # -- a [B, T] series read one column a step: the native op reads Unsqueeze(x, 2)
    univariate("lstmcell_trace_univariate_split", "lstm", layers=2,
               notes="pytorch/examples time_sequence_prediction (float32): two LSTMCells, input.split(1, dim=1)"),
    univariate("lstmcell_dynamo_univariate_split", "lstm", exporter="dynamo", layers=2),
    univariate("grucell_trace_univariate_slice", "gru", read="slice"),
    univariate("grucell_dynamo_univariate_slice", "gru", exporter="dynamo", read="slice"),
    # -- a step input's projection read by the cell and by a skip connection: the map runs once over x
    projskip("lstmcell_trace_proj_skip_bf", "lstm", batch_first=True),
    projskip("grucell_dynamo_proj_skip", "gru", exporter="dynamo"),
    # -- residual stacks: the upper cell reads the lower one's h plus x_t (or a projection of it); each a native op
    residual("lstmcell_trace_residual", "lstm", notes="the upper layer's step input h1_t + x_t (fused second, over "
             "the stacked per-step sums)"),
    residual("grucell_dynamo_residual_proj", "gru", exporter="dynamo", proj=True,
             notes="GNMT-style: the upper cell reads h1_t + Linear(x_t)"),
    residual("lstmcell_trace_residual_proj_bf", "lstm", proj=True, batch_first=True),
    residual("lstmcell_dynamo_residual_out", "lstm", exporter="dynamo", out_res=True,
             notes="returns h2_t + h1_t per step: h1_t is read by the upper step input and again after the cell"),
    residual("rnncell_trace_residual_proj_out", "rnn_tanh", proj=True, out_res=True),
    residual("lstmcell_script_residual_proj", "lstm", exporter="torchscript", proj=True, dynamic_time=True,
             notes="a TorchScript Loop stepping both cells (one-step LSTM ops): the upper op reads cat(Y1, x), "
                   "its input weight [W; W P] (the projection folded in)"),
    residual("lstmcell_script_residual_bf", "lstm", exporter="torchscript", batch_first=True, dynamic_time=True),
    residual("lstmcell_script_residual_cat_bf", "lstm", exporter="torchscript", cat=True, batch_first=True,
             dynamic_time=True, notes="the upper one-step LSTM op reads cat(h1_t, x_t): one op over cat(Y1, x)"),
    residual("grucell_trace_residual_cat", "gru", cat=True),
    residual("lstmcell_script_residual_mapped_bf", "lstm", exporter="torchscript", mapped=True, batch_first=True,
             dynamic_time=True, notes="xt = tanh(Linear(x_t)) in the loop, c1(xt), c2(h1 + xt): the upper op reads "
                                      "cat(Y1, the map over x)"),
    residual("lstmcell_script_residual_mapped_cat", "lstm", exporter="torchscript", mapped=True, cat=True,
             dynamic_time=True),
    residual("lstmcell_script_residual_cat_c", "lstm", exporter="torchscript", cat="c", dynamic_time=True,
             near_miss=True, notes="the upper cell reads cat(c1_t, x_t): the cell below's c, which no native op "
                                   "hands out per step"),
    # -- GNMT: deeper residual stacks, a cell reading the outputs of two or more cells below
    gnmt("lstmcell_trace_gnmt3", "lstm", layers=3, notes="c3(h2 + h1): the chain front end's step inputs"),
    gnmt("grucell_trace_gnmt4_xres", "gru", layers=4, x_res=True),
    gnmt("lstmcell_script_gnmt3", "lstm", exporter="torchscript", layers=3, dynamic_time=True,
         notes="a TorchScript Loop of three one-step LSTM ops, the third reading h2 + h1: its op reads cat(Y2, Y1)"),
    gnmt("lstmcell_script_gnmt3_xres", "lstm", exporter="torchscript", layers=3, x_res=True, dynamic_time=True,
         notes="c2(h1 + x_t), c3(h2 + h1 + x_t): the third op reads cat(Y2, Y1, x)"),
    gnmt("lstmcell_script_gnmt3_c1", "lstm", exporter="torchscript", layers=3, near_miss=True, dynamic_time=True,
         notes="c3(h2 + c1): the cell below's c, which no native op hands out per step"),
    # -- dynamo: the same loops through torch.export (dynamic batch via dynamic_shapes)
    loop("lstmcell_dynamo", "lstm", exporter="dynamo", time=6),
    loop("lstmcell_dynamo_bf", "lstm", exporter="dynamo", time=6, **BF),
    loop("lstmcell_dynamo_rev", "lstm", exporter="dynamo", time=6, **REV),
    loop("lstmcell_dynamo_h0c0", "lstm", exporter="dynamo", time=6, **H0),
    loop("lstmcell_dynamo_bidir", "lstm", exporter="dynamo", time=6, **BI),
    loop("grucell_dynamo", "gru", exporter="dynamo", time=6),
    loop("grucell_dynamo_bf", "gru", exporter="dynamo", time=6, **BF),
    loop("grucell_dynamo_rev", "gru", exporter="dynamo", time=6, **REV),
    loop("grucell_dynamo_h0", "gru", exporter="dynamo", time=6, **H0),
    loop("rnncell_tanh_dynamo", "rnn_tanh", exporter="dynamo", time=6),
    loop("rnncell_tanh_dynamo_rev", "rnn_tanh", exporter="dynamo", time=6, **REV),
    loop("rnncell_relu_dynamo_bf_h0", "rnn_relu", exporter="dynamo", time=6, **BF, **H0),
    # -- dynamo: nn.RNN is decomposed into per-step maths; nn.LSTM/nn.GRU stay native (controls)
    nnrnn("rnn_tanh_dynamo", "rnn_tanh"),
    nnrnn("rnn_tanh_L2_dynamo_bf", "rnn_tanh", layers=2, **BF),
    nnrnn("rnn_relu_L2_dynamo_h0", "rnn_relu", layers=2, init="given"),
    nnrnn("rnn_tanh_bidir_dynamo", "rnn_tanh", **BI),
    nnrnn("rnn_relu_bidir_L2_dynamo_bf", "rnn_relu", layers=2, **BI, **BF),
    # -- a native layer called once per step (or stretch), the state carried by hand: one native op per call
    nnrnn("lstm_steps_trace", "lstm", exporter="trace", stretch=1,
          notes="decoder style: y, state = lstm(x[t:t+1], state) per step; T native LSTMs chained by their states"),
    nnrnn("gru_steps_dynamo_bf", "gru", stretch=1, **BF),
    nnrnn("lstm_stretch3_dynamo_h0", "lstm", stretch=3, init="given", notes="stretches of 3, 3 and 1 steps"),
    nnrnn("rnn_relu_steps_trace_h0", "rnn_relu", exporter="trace", stretch=1, init="given"),
    nnrnn("gru_steps_trace_L2", "gru", exporter="trace", stretch=2, layers=2,
          notes="two layers: the [2, B, H] state is split per layer and concatenated back at every call"),
    nnrnn("lstm_steps_dynamo_L2_h0", "lstm", stretch=1, layers=2, init="given",
          notes="two layers: both cell states share one Concat per call, so the layers merge together"),
    nnrnn("lstm_steps_trace_L2_bf", "lstm", exporter="trace", stretch=2, layers=2, **BF),
    nnrnn("gru_steps_head_trace", "gru", exporter="trace", stretch=1, head=True,
          notes="decoder style with a head per call: tanh(fc(y[0])) stacked on time; the head runs once"),
    nnrnn("lstm_steps_head_dynamo", "lstm", stretch=1, head=True),
    # (dynamo without its optimizer: each call's gate-reordered weights are sliced anew at Shape(state)[2])
    nnrnn("gru_steps_dynamo_bf_unoptimized", "gru", stretch=1, optimize=False, **BF),
    nnrnn("lstm_stretch3_dynamo_h0_unoptimized", "lstm", stretch=3, init="given", optimize=False),
    nnrnn("lstm_steps_dynamo_L2_h0_unoptimized", "lstm", stretch=1, layers=2, init="given", optimize=False,
          notes="layer 1's next weights read Shape of the shared state, which holds layer 2's: no data path"),
    nnrnn("lstm_steps_head_dynamo_unoptimized", "lstm", stretch=1, head=True, optimize=False),
    nnrnn("lstm_native_dynamo", "lstm", notes="control: nn.LSTM exports as a native LSTM already"),
    nnrnn("gru_native_dynamo_bf", "gru", **BF, notes="control: nn.GRU exports as a native GRU already"),
    # -- TorchScript: Loop + SequenceInsert + ConcatFromSequence, dynamic batch and time
    script("lstmcell_script", "lstm"),
    script("lstmcell_script_packed_state", "lstm", packed_state=True,
           notes="the state one tensor s = cat([h, c], 1), cut with s[:, :H], s[:, H:]: carried piece by piece"),
    script("lstm_script_native_step", "lstm", native_step="slice", notes=(
        "nn.LSTM called once a step on x[t:t + 1] (a Slice keeping the time axis), its [1, B, H] state carried")),
    script("gru_script_native_step_narrow", "gru", native_step="narrow", notes="nn.GRU once a step on x.narrow(0, t, 1)"),
    script("rnn_script_native_step", "rnn_tanh", native_step="slice"),
    script("lstm_script_native_step_h0", "lstm", native_step="slice", init="given",
           notes="nn.LSTM once a step on x[t:t + 1] from given [1, B, H] states h0, c0"),
    script("gru_script_native_step_bf", "gru", native_step="narrow", **BF,
           notes="a batch_first nn.GRU once a step on x[:, t:t + 1] (transposed to time-major), cat on axis 1"),
    script("lstm_script_native_step_pairs", "lstm", native_step="pair", near_miss=True,
           notes="nn.LSTM once a step on x[t:t + 2]: overlapping windows of two steps, no sequence"),
    script("lstmcell_script_rev", "lstm", reverse=True, notes=(
        "outputs put in time order with outs.insert(0, h) (SequenceInsert at position 0): with torch 2.13 "
        "the TorchScript exporter silently drops a list.reverse() after the loop (wrong results, no error)")),
    script("gru_hand_script", "gru_hand", notes=(
        "nn.GRUCell itself does not export from a scripted loop with torch 2.13 (its input check "
        "`hx.dim() not in (1, 2)` hits the aten::__contains__ symbolic: 'ONNX symbolic expected node type "
        "prim::ListConstruct, got onnx::Constant'), and calling torch.gru_cell directly gives "
        "'Exporting the operator aten::gru_cell to ONNX opset version 17 is not supported'; so the loop "
        "uses the GRUCell's parameters in PyTorch's GRU formula")),
    # ... the cell reads a map of its step, applied once to the whole sequence by the fused model
    script("lstmcell_script_input_mlp", "lstm", inputs="mlp", notes="relu(Linear(x[t])) before the cell"),
    script("lstmcell_script_input_layernorm", "lstm", inputs="norm", notes="LayerNorm(x[t]) before the cell"),
    script("lstmcell_script_embed_per_step", "lstm", inputs="embed", notes="E(tokens[t]): tokens [T, B] int64"),
    script("lstmcell_script_context_concat", "lstm", inputs="context",
           notes="cat([x[t], z]): z a graph input the body reads from the outer scope"),
    script("lstmcell_script_padding_mask_bf", "lstm", bool_mask="pad", **BF,
           notes="pad [B, T] bool read as pad[:, t:t+1] (a Slice keeping the column): h = where(p, h, cell)"),
    # -- loops that iterate over x (TorchScript writes x.unbind(a) as SplitToSequence, declaring its steps one
    # axis too many: the fused outputs' declarations are restated)
    script("gru_hand_script_unbind", "gru_hand", inputs="unbind", notes="for x_t in x.unbind(0)"),
    script("rnn_hand_script_unbind_bf", "rnn_hand", inputs="unbind_bf", **BF, notes="for x_t in x.unbind(1)"),
    script("gru_hand_script_enumerate", "gru_hand", inputs="enumerate", notes="for t, x_t in enumerate(x)"),
    script("gru_hand_script_narrow_squeeze", "gru_hand", inputs="narrow_squeeze", notes=(
        "x.narrow(0, t, 1).squeeze(0): a one-step Slice, then If(dim 0 == 1, Squeeze, Identity), decided by it")),
    # -- a Conv1d's [B, F, T] output read as f[:, :, t] in the Loop body (the time axis last)
    script("gru_hand_script_conv_time_last", "gru_hand", inputs="conv_time_last", **BF,
           notes="f = conv(x.transpose(1, 2)); for t in range(f.size(2)): h = cell(f[:, :, t], h)"),
    script("rnn_hand_script_conv_time_last_rev", "rnn_hand", inputs="conv_time_last", reverse=True, **BF,
           notes="t = T - 1 - i over f[:, :, t]; outs.insert(0, h)"),
    script("gru_hand_script_zip_mask_bf", "gru_hand", inputs="zip_mask", bool_mask="valid", **BF,
           notes="for x_t, m_t in zip(x.unbind(1), mask.unbind(1)): h = where(m_t, cell, h)"),
    script("lstmcell_script_bool_mask_bf", "lstm", bool_mask="valid", **BF,
           notes="mask [B, T] bool read as mask[:, t].unsqueeze(1): h = where(m, cell, h)"),
    script("lstmcell_script_padding_mask_head_bf", "lstm", bool_mask="pad", mask_head=True, **BF,
           notes="ys.append(where(p, zeros_like(y), y)), y = fc(h_new): a head zeroed at padded steps"),
    script("lstmcell_script_bool_mask_head_bf", "lstm", bool_mask="valid", mask_head=True, **BF,
           notes="ys.append(fc(h)), h = where(m, cell, h): a head on the kept h"),
    # ... a mask input read at the loop's step on its own time axis, which need not be x's
    script("gru_hand_script_mask_gt0_time_major_beside_bf", "gru_hand", mask_input="gt0", mask_transposed=True, **BF,
           notes="x [B, T, F], mask [T, B] float: m = mask[t].unsqueeze(1) > 0; h = where(m, cell, h)"),
    script("rnn_hand_script_mask_long_ne0_bf", "rnn_hand", mask_input="long_ne0", **BF,
           notes="mask [B, T] int64 read as mask[:, t]: m = (mask[:, t] != 0).unsqueeze(1)"),
    script("rnn_hand_script_bool_mask_bf_beside_time_major", "rnn_hand", mask_input="bool", mask_transposed=True,
           notes="x [T, B, F], mask [B, T] bool read as mask[:, t]"),
    script("gru_hand_script_bool_mask_two_cells_bf", "gru_hand", mask_input="bool", layers=2, **BF,
           notes="two cells stacked in one loop, both kept by mask[:, t] ([B, T] bool) over a batch-first x: the "
                 "upper op reads the lower one's time-major Y beside the batch-first mask"),
    script("gru_hand_script_float_mask_blend", "gru_hand", mask_input="blend", near_miss=True,
           notes="h = m * cell + (1 - m) * h with m = mask[t].unsqueeze(1) of a float input: a value between 0 and "
                 "1 mixes the two, which no native op does"),
    script("rnn_hand_script_xmask_bf", "rnn_hand", xmask="where", **BF,
           notes="v = (x[:, t] != 0).any(-1).unsqueeze(1); h = where(v, cell, h): the mask computed in the body from "
                 "the step's row of a batch-first x; the input sets zero x at padded steps"),
    script("gru_hand_script_xmask_column", "gru_hand", xmask="column",
           notes="v = (x[t][:, 0] != 0).unsqueeze(1): the first feature decides (TorchScript slices the rows whole "
                 "before the column's Gather)"),
    # ... the states of cells stacked in one step kept in a list, hs[k] = cell_k(u, hs[k]): a carried sequence
    script("rnn_hand_script_state_list", "rnn_hand", state_list="set", layers=3,
           notes="hs = [zeros] * 3 (SequenceConstruct); hs[k] = cell_k(u, hs[k]) (SequenceErase + SequenceInsert); "
                 "returns (stacked hs[-1], hs[-1])"),
    script("lstmcell_script_state_lists", "lstm", state_list="set", layers=2,
           notes="hs, cs: two lists of states, set item by item; returns (stacked hs[-1], hs[-1], cs[-1])"),
    script("rnn_hand_script_state_list_bidir", "rnn_hand", state_list="bidir", **BI,
           notes="hs = [hf, hb]; hs[0] = fw(x[t], hs[0]); hs[1] = bw(x[T-1-t], hs[1]); outs_b.insert(0, hs[1]); "
                 "cat on features: one Loop reading x both ways, carried item by item, split, one bidirectional op"),
    script("gru_hand_script_state_list_grows", "gru_hand", state_list="append", layers=2, near_miss=True,
           notes="hs.append(cell(u, hs[-1])) each step: the list grows, its last item the state (no fixed items)"),
    script("lstmcell_script_embed_per_step_bf", "lstm", inputs="embed", **BF,
           notes="E(tokens[:, t]): tokens [B, T] int64 read on their time axis 1"),
    script("lstmcell_script_embed_before", "lstm", inputs="embed_before",
           notes="E(tokens) before a loop over tokens.size(0) reading its rows: the trip count is the ids' length"),
    script("lstmcell_script_flip_before", "lstm", inputs="flip_before", reverse=True,
           notes="torch.flip(x, [0]) before a loop over x.size(0) reading its rows: a reverse op"),
    script("lstmcell_script_linear_before", "lstm", inputs="linear_before",
           notes="xq = Linear(x) (no activation) before the loop, LSTMCell(xq[t]): the op reads xq as computed"),
    script("lstm_hand_script_hoisted_proj", "lstm", inputs="hoisted",
           notes="xp = ih(x) before the loop, xp[t] + hh(h) in it: the loop counts x's steps, reads xp's"),
    # ... the outputs written into a preallocated buffer, outs[t] = h: a carried buffer, one ScatterND a step
    script("lstmcell_script_output_buffer", "lstm", collect="buffer"),
    script("lstmcell_script_output_buffer_extra_row", "lstm", collect="buffer", extra_rows=1, near_miss=True,
           notes="zeros(T + 1, B, H): the last row is never written (no native output holds it)"),
    script("lstmcell_script_output_buffer_colon", "lstm", collect="buffer", write="colon",
           notes="outs[t, :, :] = h: one ScatterND over an index grid of Range + Expand + Concat"),
    script("lstmcell_script_output_buffer_bf", "lstm", collect="buffer", write="bf",
           notes="outs = zeros(B, T, H); outs[:, t, :] = h: the grid's time column is t"),
    script("lstmcell_script_output_buffer_bf_extra_row", "lstm", collect="buffer", write="bf", extra_rows=1,
           near_miss=True, notes="zeros(B, T + 1, H) written at [:, t, :]: the last slot is never written"),
    script("lstmcell_script_bf", "lstm", **BF, notes="x[:, t] is Slice(x, 0:INT_MAX) + Gather(axis=1) in the body"),
    script("lstmcell_script_cat_bf", "lstm", cat=True, **BF,
           notes="outs.append(h.unsqueeze(1)); torch.cat(outs, 1): ConcatFromSequence(axis=1) of [B, 1, H]"),
    script("lstmcell_script_cat", "lstm", cat=True, notes="outs.append(h.unsqueeze(0)); torch.cat(outs, 0)"),
    script("lstmcell_script_stack_time_last", "lstm", out_axis=2,
           notes="torch.stack(outs, 2): [B, H, T], ConcatFromSequence(new_axis=1, axis=2)"),
    script("lstmcell_script_cat_time_last_bf", "lstm", cat=True, out_axis=2, **BF,
           notes="outs.append(h.unsqueeze(2)); torch.cat(outs, 2): [B, H, T] from a batch-first x"),
    script("lstmcell_script_rev_range", "lstm", rev_range=1, notes="for t in range(T - 1, -1, -1): outs in processing order"),
    script("lstmcell_script_rev_range_bf", "lstm", rev_range=1, **BF),
    script("lstmcell_script_rev_range_skips_last", "lstm", rev_range=2, near_miss=True,
           notes="range(T - 2, -1, -1): T - 1 iterations, the last step never read"),
    script("lstmcell_script_from1", "lstm", from_range=(1, 0, 0),
           notes="for t in range(1, T): x[t] (Gather(x, 1 + i * 1), T - 1 iterations): an LSTM over x[1:]"),
    script("lstmcell_script_from1_bf", "lstm", from_range=(1, 0, 0), **BF, notes="for t in range(1, T): x[:, t]"),
    script("lstmcell_script_shifted", "lstm", from_range=(1, 1, 1),
           notes="for t in range(1, T + 1): x[t - 1], every step"),
    script("rnn_hand_script_from2", "rnn_hand", from_range=(2, 0, 0),
           notes="for t in range(2, T): x[t], a hand-written RNN: an RNN over x[2:]"),
    script("gru_hand_script_from1", "gru_hand", from_range=(1, 0, 0),
           notes="for t in range(1, T): x[t] over a GRU: a GRU over x[1:], the time length dynamic: given full "
                 "sequence_lens, as over no step onnxruntime's GRU aborts without them (rnnfuse.empty_runs)"),
    script("lstmcell_script_from1_back1", "lstm", from_range=(1, 0, 1), near_miss=True,
           notes="range(1, T) reading x[t - 1]: T - 1 iterations from the first step, the last step never read"),
    script("lstmcell_script_from2_back1", "lstm", from_range=(2, 0, 1), near_miss=True,
           notes="range(2, T) reading x[t - 1]: from step 1, T - 2 iterations, the last step never read"),
    script("lstmcell_script_grown_bf", "lstm", grow=True, **BF,
           notes="out = torch.cat([out, h.unsqueeze(1)], 1) from torch.zeros(B, 0, H): a carried tensor grown a row a step"),
    script("gru_hand_script_lengths", "gru_hand", lengths=True, notes="h = where(t < lengths, cell, h)"),
    script("gru_hand_script_lengths_reverse", "gru_hand", lengths=True, reverse=True,
           notes="for i in range(T): t = T - 1 - i; h = where(t < lengths, cell, h); outs.insert(0, h)"),
    script("rnn_hand_script_lengths_pre", "rnn_hand", lengths=True, pre=True,
           notes="pre-padded by hand: t >= T - lengths, written Neg(lengths) + T in the body"),
    script("gru_hand_script_bf", "gru_hand", **BF),
    script("lstmcell_script_rev_bf", "lstm", reverse=True, **BF),
    script("gru_hand_script_2layers", "gru_hand", layers=2, notes=(
        "the second layer's Loop reads the first's stacked outputs and runs x.size(0) times, read once for both")),
    script("lstmcell_script_2layers_bf", "lstm", layers=2, **BF),
    # -- two recurrences stepped in one Loop, neither reading the other: one Loop each, then merged
    script("lstmcell_script_bidir_one_loop", "lstm", **BI,
           notes="hf = fw(x[t], hf); hb = bw(x[T-1-t], hb) in one loop; outs_b.insert(0, hb); cat on features"),
    script("lstmcell_script_bidir_one_loop_bf", "lstm", **BI, **BF),
    script("lstmcell_script_bidir_one_loop_coupled", "lstm", **BI, coupled=True, near_miss=True,
           notes="the backward cell reads hb + hf: one recurrence reading x both ways (no native op)"),
    script("lstmcell_script_two_cells", "lstm", inputs="two_cells",
           notes="an LSTMCell over x[t] and a hand GRU over z[t] in one loop, neither reading the other"),
    script("rnn_tied_script", "rnn_tied", features=HIDDEN),
    script("rnn_ind_script_bf", "rnn_ind", **BF),
    script("rnn_indsquare_script", "rnn_indsquare", near_miss=True),
    script("rnn_indinput_script", "rnn_indinput", near_miss=True),
    script("rnn_hand_script", "rnn_hand", notes=(
        "nn.RNNCell fails like nn.GRUCell (aten::__contains__ / aten::rnn_tanh_cell unsupported); "
        "tanh(Linear_ih(x_t) + Linear_hh(h)) with the RNNCell's parameters instead")),
    # -- long chain (performance)
    loop("lstmcell_trace_T2000", "lstm", time=2000, batch=4, features=32, hidden=64, dynamic_batch=False,
         slow=True, fold=False, notes=(
             "performance case: ~36,000 nodes; exported with do_constant_folding=False (same graph as with "
             "folding for this model, ~40 s faster); " + STATIC_NOTE)),
    # -- Keras 3 on the torch backend (child process)
    keras("keras_torch_lstm", "LSTM"),
    keras("keras_torch_gru", "GRU"),
    keras("keras_torch_simplernn", "SimpleRNN"),
    keras("keras_torch_masked_lstm", "LSTM", masked=True, seq=False),
    keras("keras_torch_bigru", "GRU", bidir=True),
    keras("keras_torch_masked_gru", "GRU", masked=True),
    keras("keras_torch_masked_simplernn", "SimpleRNN", masked=True, seq=False),
    keras("keras_torch_masked_bilstm", "LSTM", masked=True, bidir=True),
    keras("keras_torch_masked_lstm_bwd", "LSTM", masked=True, backwards=True),
    keras("keras_torch_masked_bigru_last", "GRU", masked=True, bidir=True, seq=False),
    keras("keras_torch_masked_stack", "LSTM", masked=True, then="GRU"),
    keras("keras_torch_rnn_gru_stack", "SimpleRNN", then="GRU", seq=False),
]


# --------------------------------------------------------------------------- per-step inputs and length masks
# (issue 14 items 7 and 8) Python loops over a torch cell whose steps read state-independent inputs other than
# x[t] (2 * x[t], x[t] - x[t-1], every other step, a permuted order, a second sequence after the first), and
# loops masked by hand with a lengths input: h = m * cell(x_t, h) + (1 - m) * h with m = (t < lengths), the
# per-step output m * h (zero past the length). Model "steps"; ``inputs`` names the step-input form.

STEP_INPUTS = {
    "plain": "x[t] for t in range(T)",
    "double": "2 * x[t]",
    "diff": "x[t] - x[t-1] (x[0] at the first step)",
    "stride2": "x[t] for t in range(0, T, 2)",
    "perm": "x[t] for t in a fixed permutation of range(T)",
    "two_seq": "x[t] for t in range(T), then x2[t] for t in range(T2)",
    "first_cell": "x[t], the first step through another cell of the same kind",
    "reads_state": "x[t] * h[:, :1] (near miss: the step input depends on the state)",
    "embed": "E(tokens[t]): an nn.Embedding looked up per step (tokens int64, laid out like x without features)",
    "embed_scaled": "E(tokens[t]) * sqrt(F): the lookup scaled per step",
    "mlp": "relu(Linear(x[t])): an input MLP inside the loop",
    "norm": "LayerNorm(x[t]) inside the loop",
    "context": "cat([x[t], z]): a context input z [B, C] (a latent, a speaker embedding) beside every step's input",
    "mlp_per_step": "relu(Linear_t(x[t])) with another Linear at each step (near miss: no one map)",
    "shared_reshape_bidir": "x[t].reshape(-1, F) once per step, read by a forward and a backward chain "
                            "(outputs concatenated on features)",
    "chunk_index": "p[0] (p[:, 0] batch-first) of each piece of x.chunk(T): a Split's parts, each gathered at 0",
    "time_feature": "cat([x[t], x.new_full((B, 1), t / T)]): the step's place in time as a feature beside x[t]",
    "position": "cat([x[t], pos[t].expand(B, -1)]): a learned position table's row for the step beside x[t]",
    "position_tile": "cat([x[t], pos[t].repeat(B, 1)]): the same row tiled to the batch",
}
STEP_FEATURES = {"context": CONTEXT, "time_feature": 1, "position": POSITION, "position_tile": POSITION}


def steps(name, cell, inputs="plain", exporter="trace", **kw):
    """A Python loop over ``cell`` reading the step inputs ``inputs`` (:data:`STEP_INPUTS`); ``lengths=True``
    adds a lengths input and the hand-written mask."""
    return _case(name, exporter, "steps", cell, inputs=inputs, **kw)


def steps_input_specs(c: Case) -> list[tuple[str, tuple]]:
    x = ("B", "T", c.features) if c.batch_first else ("T", "B", c.features)
    specs = [("tokens", x[:2]) if c.opts.get("inputs", "").startswith("embed") else ("x", x)]
    if c.opts.get("inputs") == "two_seq":
        specs.append(("x2", ("B", 3, c.features) if c.batch_first else (3, "B", c.features)))
    if c.opts.get("inputs") == "context":
        specs.append(("z", ("B", CONTEXT)))
    if c.opts.get("lengths"):
        specs.append(("lengths", ("B",)))
    if c.opts.get("mask_input"):  # laid out like x ([B, T] or [T, B]) unless transposed; int64 for the .bool() form
        specs.append(("mask_long" if c.opts["mask_input"] == "long_bool" else "mask",
                      ("B", "T") if _mask_batch_first(c) else ("T", "B")))
    return specs


def _mask_batch_first(c: Case) -> bool:
    """Whether the mask input is [B, T]: as x is, or the other way round (``mask_transposed``)."""
    return c.batch_first != bool(c.opts.get("mask_transposed"))


def steps_describe(c: Case) -> str:
    o = c.opts
    parts = [CELL_TEXT[o["cell"]], ("batch-first [B,T,F]" if c.batch_first else "time-major [T,B,F]"),
             "step inputs " + STEP_INPUTS[o.get("inputs", "plain")],
             "learned initial state (nn.Parameter h0, c0 expanded to the batch)" if o.get("init") == "learned"
             else "zero initial state"]
    if o.get("lengths") == "pad":
        parts.append("masked by hand with a padding mask: pad = (t >= lengths); h = where(pad, h, cell); "
                     "outputs where(pad, 0, cell)")
    elif o.get("lengths") == "pre_blend":
        parts.append("pre-padded by hand: m = (lengths >= T - t).float(); h = m * cell + (1 - m) * h; outputs m * h")
    elif o.get("lengths") == "pre_where":
        parts.append("pre-padded by hand: v = (lengths >= T - t); h = where(v, cell, h); outputs where(v, cell, 0)")
    elif o.get("lengths") in ("arange", "arange_where"):
        parts.append("masked by hand with one mask arange(T)[:, None] < lengths[None, :] read per step ("
                     + ("as float: m * cell + (1 - m) * h)" if o["lengths"] == "arange" else "torch.where)"))
    elif o.get("lengths"):
        parts.append("masked by hand: m = (t < lengths).float(); h = m * cell + (1 - m) * h; outputs m * h")
    if o.get("xmask"):
        parts.append("a step of a row is padding where its features are all 0, decided inside each step (" + {
            "where": "v = (x_t != 0).any(-1).unsqueeze(-1); h = where(v, cell, h); outputs h",
            "abs_sum": "v = x_t.abs().sum(-1, keepdim=True) > 0; h = where(v, cell, h); outputs h",
            "column": "v = (x_t[:, 0] != 0).unsqueeze(-1), the first feature alone; h = where(v, cell, h); outputs h",
            "float": "m = (x_t != 0).any(-1).unsqueeze(-1).float(); h = m * cell + (1 - m) * h; outputs m * cell",
            "reset": "near miss: m * cell, the state reset to 0 at padded steps",
            "batch": "near miss: v = (x_t != 0).any(-1).all(0): one row's padding stops every row",
            "per_feature": "near miss: v = x_t != 0 with F == H: each hidden unit masked by a feature of its own",
        }[o["xmask"]] + "); the input sets have post-, pre-padded, gappy and empty rows")
    if o.get("token_mask"):
        parts.append("masked where the step's token is the padding id 0 (" + {
            "float": "m = (tokens[:, t] != 0).float().unsqueeze(1); h = m * cell + (1 - m) * h; outputs m * cell",
            "where": "v = (tokens[:, t] != 0).unsqueeze(1); h = where(v, cell, h); outputs where(v, cell, 0)",
            "prev": "near miss: the previous step's token decides",
        }[o["token_mask"]] + "); the input sets have post-, pre-padded, gappy and empty rows")
    if o.get("mask_input"):
        parts.append("a [B, T] (or [T, B]) mask input that is not bool, one step's mask computed from its slice (" + {
            "gt0": "v = mask[:, t:t+1] > 0 (time-major: mask[t].unsqueeze(-1) > 0), float 0/1",
            "ne0_gather": "v = (mask[:, t] != 0).unsqueeze(-1), float 0/1",
            "long_bool": "v = mask[:, t].bool().unsqueeze(-1), int64 0/1",
            "prev": "near miss: v = mask[:, t-1:t] > 0, the previous step's mask",
            "reads_state": "near miss: v = mask[:, t:t+1] > h[:, :1], the mask compared with the state",
            "first_state": "v = mask[:, t:t+1] > 0; step 0's output is its state where(v, cell, h0) (near miss "
                           "with a learned h0)",
        }[o["mask_input"]] + ("; the mask laid out on the other time axis than x" if o.get("mask_transposed") else "")
            + "); h = where(v, cell, h); outputs where(v, cell, 0); the input sets have post-, "
            "pre-padded, gappy and empty rows")
    parts.append("returns (stacked outputs, last h" + (", last c)" if c.family == "lstm" else ")"))
    return "; ".join(parts)


def steps_module(c: Case):
    import torch
    from torch import nn

    o = c.opts
    perm = [3, 0, 6, 1, 5, 2, 4]

    class StepInputsLoop(nn.Module):
        def __init__(self):
            super().__init__()
            kind = o["cell"]
            self.lstm = kind == "lstm"
            def make():
                f = c.features + STEP_FEATURES.get(o.get("inputs"), 0)
                if kind.startswith("rnn"):
                    return nn.RNNCell(f, c.hidden, nonlinearity=kind[4:])
                return {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[kind](f, c.hidden)

            self.cell, self.cell0 = make(), make()  # (cell0: the first step's other cell, or the backward chain's)
            if o.get("inputs", "").startswith("embed"):
                self.embed = nn.Embedding(VOCAB, c.features)
            if o.get("inputs") in ("mlp", "mlp_per_step"):
                self.pre = nn.ModuleList(nn.Linear(c.features, c.features) for _ in range(c.time if o["inputs"] == "mlp_per_step" else 1))
            if o.get("inputs") == "norm":
                self.norm = nn.LayerNorm(c.features)
            if o.get("inputs", "").startswith("position"):
                self.pos = nn.Parameter(torch.randn(c.time, POSITION))
            if o.get("init") == "learned":
                self.h0 = nn.Parameter(0.3 * torch.randn(1, c.hidden))
                self.c0 = nn.Parameter(0.3 * torch.randn(1, c.hidden))

        def step_inputs(self, x, x2):
            at = (lambda s, t: s[:, t]) if c.batch_first else (lambda s, t: s[t])
            steps_ = x.shape[1 if c.batch_first else 0]
            form = o.get("inputs", "plain")
            if form == "double":
                return [2 * at(x, t) for t in range(steps_)]
            if form == "diff":
                return [at(x, t) - at(x, t - 1) if t else at(x, 0) for t in range(steps_)]
            if form == "stride2":
                return [at(x, t) for t in range(0, steps_, 2)]
            if form == "perm":
                return [at(x, t) for t in perm[:steps_]]
            if form == "embed":
                return [self.embed(at(x, t)) for t in range(steps_)]
            if form in ("mlp", "mlp_per_step"):
                return [torch.relu(self.pre[t if form == "mlp_per_step" else 0](at(x, t))) for t in range(steps_)]
            if form == "norm":
                return [self.norm(at(x, t)) for t in range(steps_)]
            if form == "context":  # (x2 is z)
                return [torch.cat([at(x, t), x2], -1) for t in range(steps_)]
            if form == "time_feature":
                return [torch.cat([at(x, t), x.new_full((at(x, t).shape[0], 1), t / steps_)], -1) for t in range(steps_)]
            if form == "position":
                return [torch.cat([at(x, t), self.pos[t].expand(at(x, t).shape[0], -1)], -1) for t in range(steps_)]
            if form == "position_tile":
                return [torch.cat([at(x, t), self.pos[t].repeat(at(x, t).shape[0], 1)], -1) for t in range(steps_)]
            if form == "embed_scaled":
                return [self.embed(at(x, t)) * c.features ** 0.5 for t in range(steps_)]
            if form == "shared_reshape_bidir":
                return [at(x, t).reshape(-1, c.features) for t in range(steps_)]
            if form == "chunk_index":  # (static T: Split(num_outputs=T), each piece's element 0 gathered)
                ax = 1 if c.batch_first else 0
                return [p[:, 0] if c.batch_first else p[0] for p in x.chunk(steps_, ax)]
            if form == "two_seq":
                return [at(x, t) for t in range(steps_)] + [at(x2, t) for t in range(x2.shape[1 if c.batch_first else 0])]
            return [at(x, t) for t in range(steps_)]

        def chain(self, cell, us):
            batch = us[0].shape[0]
            h = torch.zeros(batch, c.hidden, dtype=us[0].dtype)
            cs = torch.zeros(batch, c.hidden, dtype=us[0].dtype)
            outs = []
            for u in us:
                if self.lstm:
                    h, cs = cell(u, (h, cs))
                else:
                    h = cell(u, h)
                outs.append(h)
            return outs

        def bidir_token_mask(self, tokens):
            """A forward and a backward cell stepped in one loop over ``E(tokens)`` (batch-first), each masked
            where its step's token is 0: ``m[:, t:t + 1]`` and ``m[:, tb:tb + 1]``, ``tb = T - 1 - t`` with T the
            traced ``tokens.size(1)`` (torch writes that index as shape arithmetic of the input's declared shape)."""
            x, m = self.embed(tokens), tokens != 0
            batch, T = tokens.size(0), tokens.size(1)
            hf, hb = torch.zeros(batch, c.hidden), torch.zeros(batch, c.hidden)
            fs, bs = [], []
            for t in range(tokens.shape[1]):
                tb = T - 1 - t
                mf, mb = m[:, t:t + 1], m[:, tb:tb + 1]
                hf = torch.where(mf, self.cell(x[:, t], hf), hf)
                hb = torch.where(mb, self.cell0(x[:, tb], hb), hb)
                fs.append(torch.where(mf, hf, torch.zeros_like(hf)))
                bs.insert(0, torch.where(mb, hb, torch.zeros_like(hb)))
            return torch.cat([torch.stack(fs, 1), torch.stack(bs, 1)], 2)

        def forward(self, x, in1=None, in2=None):  # (x[, x2][, lengths]); named: torch.export wants no *args
            if o.get("bidir_token_mask"):
                return self.bidir_token_mask(x)
            if o.get("inputs") == "shared_reshape_bidir":
                us = self.step_inputs(x, None)
                ys = [self.chain(self.cell, us), self.chain(self.cell0, us[::-1])[::-1]]
                return torch.cat([torch.stack(y, dim=1 if c.batch_first else 0) for y in ys], -1)
            rest = [v for v in (in1, in2) if v is not None]
            x2 = rest[0] if o.get("inputs") in ("two_seq", "context") else None  # (context: z)
            lengths = rest[-1] if o.get("lengths") else None
            mask = rest[-1] if o.get("mask_input") else None
            batch = x.shape[0 if c.batch_first else 1]
            dt = x.dtype if x.is_floating_point() else torch.float32  # (x: token ids for an embedding)
            if o.get("init") == "learned":
                h, cs = self.h0.expand(batch, -1), self.c0.expand(batch, -1)
            else:
                h = torch.zeros(batch, c.hidden, dtype=dt)
                cs = torch.zeros(batch, c.hidden, dtype=dt)
            outs = []
            if o.get("lengths") in ("arange", "arange_where"):  # the whole mask once: arange(T)[:, None] < lengths
                T = x.shape[1 if c.batch_first else 0]
                if c.batch_first or o.get("mask_bt"):  # [B, T], read as mask[:, t] (mask_bt: beside a time-major x)
                    masks = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
                else:  # [T, B], read as mask[t]
                    masks = torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)
                if o["lengths"] == "arange":
                    masks = masks.to(dt).unsqueeze(-1)  # float, [.., .., 1]
            for t, u in enumerate(self.step_inputs(x, x2)):
                cell = self.cell0 if (t == 0 and o.get("inputs") == "first_cell") else self.cell
                if o.get("inputs") == "reads_state":
                    u = u * h[:, :1]
                if self.lstm:
                    h_new, c_new = cell(u, (h, cs))
                else:
                    h_new, c_new = cell(u, h), None
                if o.get("token_mask"):  # a step is padding where its token is 0 (the embedding's padding_idx)
                    at_t = max(t - 1, 0) if o["token_mask"] == "prev" else t  # (prev: a near miss)
                    v = ((x[:, at_t] if c.batch_first else x[at_t]) != 0)
                    if o["token_mask"] == "where":
                        v = v.unsqueeze(1)
                        h = torch.where(v, h_new, h)
                        if self.lstm:
                            cs = torch.where(v, c_new, cs)
                        outs.append(torch.where(v, h_new, torch.zeros_like(h_new)))
                    else:  # float, cast before the unit axis is added: m = (tokens[:, t] != 0).float().unsqueeze(1)
                        m = v.to(dt).unsqueeze(1)
                        h = m * h_new + (1 - m) * h
                        if self.lstm:
                            cs = m * c_new + (1 - m) * cs
                        outs.append(m * h_new)
                    continue
                if mask is not None:  # one step's mask computed from its slice of a mask that is not bool
                    form = o["mask_input"]
                    mask_bf = _mask_batch_first(c)
                    at = (lambda a, b: mask[:, a:b]) if mask_bf else (lambda a, b: mask[a].unsqueeze(-1))
                    if form in ("gt0", "first_state"):
                        v = at(t, t + 1) > 0
                    elif form == "ne0_gather":
                        v = ((mask[:, t] if mask_bf else mask[t]) != 0).unsqueeze(-1)
                    elif form == "long_bool":
                        v = (mask[:, t] if mask_bf else mask[t]).bool().unsqueeze(-1)
                    elif form == "prev":  # (near miss: the previous step's mask)
                        v = at(max(t - 1, 0), max(t, 1)) > 0
                    else:  # reads_state (near miss: compared with the state)
                        v = at(t, t + 1) > h[:, :1]
                    h = torch.where(v, h_new, h)
                    if self.lstm:
                        cs = torch.where(v, c_new, cs)
                    if form == "first_state" and t == 0:
                        outs.append(h)  # (the state after step 0: the output where(v, cell, 0) only if h0 is 0)
                        continue
                    outs.append(torch.where(v, h_new, torch.zeros_like(h_new)))
                    continue
                if o.get("xmask"):  # a step is padding where all its features are 0, decided per step
                    if o.get("xmask_of") == "x":  # (decided from the slice itself, the cell reading a map of it)
                        u = x[:, t] if c.batch_first else x[t]
                    if o["xmask"] == "abs_sum":
                        v = u.abs().sum(-1, keepdim=True) > 0
                    elif o["xmask"] == "column":  # (the first feature decides)
                        v = (u[:, 0] != 0).unsqueeze(-1)
                    elif o["xmask"] == "batch":  # (near miss: one row's padding stops every row)
                        v = (u != 0).any(-1, keepdim=True).all(0, keepdim=True)
                    elif o["xmask"] == "per_feature":  # (near miss, F == H: each unit kept where its feature is 0)
                        v = u != 0
                    else:
                        v = (u != 0).any(-1).unsqueeze(-1)
                    if o["xmask"] in ("float", "reset"):
                        m = v.to(dt)
                        keep = (1 - m) * h if o["xmask"] == "float" else 0  # (reset: a near miss)
                        h = m * h_new + keep
                        if self.lstm:
                            cs = m * c_new + ((1 - m) * cs if o["xmask"] == "float" else 0)
                        outs.append(m * h_new)
                    else:
                        h = torch.where(v, h_new, h)
                        if self.lstm:
                            cs = torch.where(v, c_new, cs)
                        outs.append(h)
                    continue
                if lengths is None:
                    h, cs = h_new, c_new
                    outs.append(h)
                    continue
                if o.get("lengths") == "pad":  # a padding mask: true past a row's length
                    pad = (t >= lengths).unsqueeze(1)
                    h = torch.where(pad, h, h_new)
                    if self.lstm:
                        cs = torch.where(pad, cs, c_new)
                    outs.append(torch.where(pad, torch.zeros_like(h_new), h_new))
                    continue
                if o.get("lengths") == "pre_where":  # valid steps last: v = (lengths >= T - t), T = x.shape[0]
                    keep = (lengths >= x.shape[1 if c.batch_first else 0] - t).unsqueeze(1)
                    h = torch.where(keep, h_new, h)
                    if self.lstm:
                        cs = torch.where(keep, c_new, cs)
                    outs.append(torch.where(keep, h_new, torch.zeros_like(h_new)))
                    continue
                step_mask = None if lengths is None or "arange" not in str(o.get("lengths")) else (
                    masks[:, t] if c.batch_first or o.get("mask_bt") else masks[t])
                if o.get("lengths") == "arange_where":  # where(mask[t][:, None], new, old)
                    keep = step_mask.unsqueeze(1)
                    h = torch.where(keep, h_new, h)
                    if self.lstm:
                        cs = torch.where(keep, c_new, cs)
                    outs.append(torch.where(keep, h_new, torch.zeros_like(h_new)))
                    continue
                if o.get("lengths") == "pre_blend":  # valid steps last, as a float blend
                    m = (lengths >= x.shape[1 if c.batch_first else 0] - t).to(x.dtype).unsqueeze(1)
                else:
                    m = step_mask if o.get("lengths") == "arange" else (t < lengths).to(x.dtype).unsqueeze(1)
                h = m * h_new + (1 - m) * h
                if self.lstm:
                    cs = m * c_new + (1 - m) * cs
                outs.append(m * h_new)
            y = torch.stack(outs, dim=1 if c.batch_first else 0)
            if o.get("final_gate"):  # empty rows' last state zeroed after the loop (lengths > 0 is step 0's mask too)
                h = torch.where((lengths > 0).unsqueeze(1), h, torch.zeros_like(h))
            return (y, h, cs) if self.lstm else (y, h)

    return StepInputsLoop()


def steps_expectation(c: Case, exp: dict) -> dict:
    """A second sequence after the first is two chains (two ops); a first step through another cell stays
    as it is (its cell ops are left); a near miss keeps everything."""
    o = c.opts
    op = ONNX_OP[c.family]
    if o.get("near_miss"):
        return {"declined": True, "ops": {}, "absent": ABSENT}
    if o.get("inputs") == "two_seq":
        exp = dict(exp, ops={op: 2}, directions={op: ["forward", "forward"]})
    if o.get("inputs") == "shared_reshape_bidir" or o.get("bidir_token_mask"):
        exp = dict(exp, directions={op: ["bidirectional"]})
    if o.get("inputs") == "first_cell":
        exp = dict(exp, max_cell_ops={"lstm": 9, "gru": 12}.get(c.family, 3))
    if o.get("inputs") == "mlp":
        exp = dict(exp, max_cell_ops=2)  # (the input MLP, applied once to the whole sequence: a Gemm and a Relu)
    return exp


CASES += [
    # state-independent step inputs (issue 14 item 7): fused over the stacked inputs
    steps("lstmcell_trace_double_x", "lstm", inputs="double"),
    steps("grucell_dynamo_diff_x", "gru", inputs="diff", exporter="dynamo"),
    steps("rnncell_tanh_trace_stride2_bf", "rnn_tanh", inputs="stride2", batch_first=True),
    steps("lstmcell_dynamo_permuted_steps", "lstm", inputs="perm", exporter="dynamo"),
    steps("grucell_dynamo_chunk_index_bf", "gru", inputs="chunk_index", exporter="dynamo", batch_first=True),
    steps("rnncell_tanh_dynamo_chunk_index", "rnn_tanh", inputs="chunk_index", exporter="dynamo"),
    # (without dynamo's optimizer: x.chunk(T)'s items are SplitToSequence + SequenceAt, each step's read)
    steps("rnncell_tanh_dynamo_chunk_index_unoptimized", "rnn_tanh", inputs="chunk_index", exporter="dynamo",
          optimize=False),
    # (and each batch-first item is read through a Slice of its whole batch axis, x[:, ...])
    steps("grucell_dynamo_chunk_index_bf_unoptimized", "gru", inputs="chunk_index", exporter="dynamo",
          batch_first=True, optimize=False),
    steps("grucell_trace_two_sequences", "gru", inputs="two_seq"),
    # ... an embedding looked up per step (tokens sliced per step, one id a row)
    steps("grucell_trace_embed_per_step_bf", "gru", inputs="embed", batch_first=True),
    steps("grucell_trace_bidir_token_mask_bf", "gru", inputs="embed", bidir_token_mask=True, batch_first=True,
          notes="a forward and a backward GRUCell in one loop over E(tokens), each masked where its step's token is 0; "
                "the backward step's index T - 1 - t is shape arithmetic of the input's shape in the trace (folded, "
                "its slices are the forward's: one family)"),
    steps("lstmcell_dynamo_embed_per_step", "lstm", inputs="embed", exporter="dynamo"),
    steps("rnncell_tanh_trace_static_embed_scaled", "rnn_tanh", inputs="embed_scaled", dynamic_batch=False),
    # ... a map of x[t] inside the loop (an input MLP, a LayerNorm): the map applied to the whole sequence once
    steps("grucell_trace_input_mlp_bf", "gru", inputs="mlp", batch_first=True),
    steps("lstmcell_dynamo_input_layernorm", "lstm", inputs="norm", exporter="dynamo"),
    steps("rnncell_tanh_trace_static_input_mlp", "rnn_tanh", inputs="mlp", dynamic_batch=False),
    steps("grucell_trace_input_layernorm_lengths", "gru", inputs="norm", lengths=True),
    steps("lstmcell_trace_input_mlp_per_step", "lstm", inputs="mlp_per_step", near_miss=True),
    steps("grucell_trace_context_concat", "gru", inputs="context"),
    steps("lstmcell_dynamo_context_concat_bf", "lstm", inputs="context", exporter="dynamo", batch_first=True),
    # ... features of the step joined to x[t] (its time, a position table's row): the joined inputs stacked
    steps("lstmcell_trace_time_feature", "lstm", inputs="time_feature"),
    steps("grucell_dynamo_time_feature_bf", "gru", inputs="time_feature", exporter="dynamo", batch_first=True),
    steps("lstmcell_dynamo_position_row", "lstm", inputs="position", exporter="dynamo"),
    steps("rnncell_tanh_trace_position_row_bf", "rnn_tanh", inputs="position", batch_first=True),
    steps("grucell_trace_position_tiled_bf", "gru", inputs="position_tile", batch_first=True),
    # ... masked where the token is the padding id 0
    steps("grucell_trace_embed_token_mask_bf", "gru", inputs="embed", token_mask="float", batch_first=True),
    steps("lstmcell_dynamo_embed_token_mask_where", "lstm", inputs="embed", token_mask="where", exporter="dynamo"),
    steps("lstmcell_trace_static_embed_token_mask", "lstm", inputs="embed", token_mask="float", dynamic_batch=False),
    steps("grucell_trace_embed_token_mask_prev_bf", "gru", inputs="embed", token_mask="prev", batch_first=True,
          near_miss=True),
    steps("lstmcell_trace_first_step_other_cell", "lstm", inputs="first_cell"),
    steps("grucell_dynamo_first_step_other_cell", "gru", inputs="first_cell", exporter="dynamo"),
    steps("lstmcell_trace_bidir_shared_reshape", "lstm", inputs="shared_reshape_bidir"),
    steps("grucell_dynamo_bidir_shared_reshape_bf", "gru", inputs="shared_reshape_bidir", exporter="dynamo",
          batch_first=True),
    steps("grucell_dynamo_bidir_shared_reshape_bf_unoptimized", "gru", inputs="shared_reshape_bidir",
          exporter="dynamo", batch_first=True, optimize=False,
          notes="x[:, t].view(B, -1): the view's shape a Concat of Reshape(size(0), [-1]) and the width"),
    steps("lstmcell_trace_input_reads_state", "lstm", inputs="reads_state", near_miss=True),
    steps("grucell_dynamo_input_reads_state", "gru", inputs="reads_state", near_miss=True, exporter="dynamo"),
    # hand-written length masks (issue 14 item 8)
    steps("lstmcell_trace_lengths", "lstm", lengths=True),
    steps("grucell_trace_lengths", "gru", lengths=True),
    steps("rnncell_tanh_trace_lengths_bf", "rnn_tanh", lengths=True, batch_first=True),
    steps("lstmcell_dynamo_lengths", "lstm", exporter="dynamo", time=6, lengths=True),
    steps("grucell_dynamo_lengths_bf", "gru", exporter="dynamo", time=6, lengths=True, batch_first=True),
    # ... and with a padding mask, true past a row's length: torch.where(pad, h, cell(x_t, h))
    steps("lstmcell_trace_padding_mask", "lstm", lengths="pad"),
    steps("grucell_dynamo_padding_mask_bf", "gru", exporter="dynamo", time=6, lengths="pad", batch_first=True),
    steps("rnncell_tanh_trace_padding_mask", "rnn_tanh", lengths="pad"),
    # ... and with the whole mask built once, arange(T)[:, None] < lengths[None, :], then read per step
    steps("grucell_trace_arange_mask", "gru", lengths="arange"),
    steps("lstmcell_trace_arange_mask_where_bf", "lstm", lengths="arange_where", batch_first=True),
    steps("rnncell_tanh_trace_prepadded_where", "rnn_tanh", lengths="pre_where",
          notes="v = lengths >= T - t per step: the comparisons' constants fall with t (traced Greater(L, T-1-t))"),
    steps("lstmcell_dynamo_prepadded_where_bf", "lstm", lengths="pre_where", batch_first=True, exporter="dynamo"),
    steps("grucell_trace_prepadded_blend", "gru", lengths="pre_blend"),
    steps("grucell_trace_lengths_final_gate", "gru", lengths=True, final_gate=True,
          notes="after the loop h = where(lengths > 0, h, 0): the same Greater(lengths, 0) as step 0's mask"),
    steps("lstmcell_trace_arange_mask_where_bt_time_major", "lstm", lengths="arange_where", mask_bt=True,
          notes="the [B, T] mask arange(T)[None] < lengths[:, None] read as mask[:, t] beside a time-major x"),
    steps("grucell_dynamo_arange_mask_where_bt_time_major", "gru", lengths="arange_where", mask_bt=True,
          exporter="dynamo"),
    steps("lstmcell_dynamo_arange_mask", "lstm", exporter="dynamo", time=6, lengths="arange"),
    # a mask decided inside each step from the step input alone (padding: all features 0)
    steps("grucell_trace_xmask", "gru", xmask="where"),
    steps("lstmcell_dynamo_xmask_abs_sum_bf", "lstm", exporter="dynamo", time=6, xmask="abs_sum", batch_first=True),
    steps("rnncell_tanh_trace_xmask_float", "rnn_tanh", xmask="float"),
    steps("lstmcell_trace_xmask_float_bf", "lstm", xmask="float", batch_first=True),
    steps("grucell_dynamo_xmask_where", "gru", exporter="dynamo", time=6, xmask="where"),
    steps("grucell_trace_xmask_column_bf", "gru", xmask="column", batch_first=True),
    # ... the mask decided from x_t while the cell reads a map of x_t (both read the slice)
    steps("grucell_trace_input_mlp_xmask", "gru", inputs="mlp", xmask="where", xmask_of="x"),
    steps("lstmcell_dynamo_input_layernorm_xmask_float_bf", "lstm", exporter="dynamo", inputs="norm", xmask="float",
          xmask_of="x", batch_first=True),
    steps("grucell_trace_xmask_reset", "gru", xmask="reset", near_miss=True),
    steps("lstmcell_dynamo_xmask_batch", "lstm", exporter="dynamo", time=6, xmask="batch", near_miss=True),
    steps("grucell_trace_xmask_per_feature", "gru", xmask="per_feature", near_miss=True, hidden=FEATURES),
    # ... or from its slice of a mask input that is not bool (float or integer 0/1, compared or cast per step)
    steps("lstmcell_trace_float_mask_gt0_bf", "lstm", mask_input="gt0", batch_first=True),
    steps("grucell_trace_float_mask_gt0", "gru", mask_input="gt0"),
    steps("rnncell_tanh_dynamo_float_mask_ne0_bf", "rnn_tanh", exporter="dynamo", time=6, mask_input="ne0_gather",
          batch_first=True),
    steps("grucell_trace_long_mask_bool_bf", "gru", mask_input="long_bool", batch_first=True),
    steps("lstmcell_dynamo_long_mask_bool", "lstm", exporter="dynamo", time=6, mask_input="long_bool"),
    # (without dynamo's optimizer: each step casts its constants CastLike a value computed from the state)
    steps("lstmcell_dynamo_long_mask_bool_unoptimized", "lstm", exporter="dynamo", time=6, mask_input="long_bool",
          optimize=False),
    # ... exported with static shapes: from the zero state, step 0's output where(v, cell, 0) and its state
    # where(v, cell, h0) are one expression, and the exporter makes them one node
    steps("grucell_trace_static_float_mask_gt0", "gru", mask_input="gt0", dynamic_batch=False),
    steps("lstmcell_trace_static_float_mask_gt0_bf", "lstm", mask_input="gt0", batch_first=True, dynamic_batch=False),
    steps("rnncell_tanh_dynamo_static_float_mask_gt0", "rnn_tanh", exporter="dynamo", time=6, mask_input="gt0",
          dynamic_batch=False),
    steps("grucell_trace_static_first_output_state", "gru", mask_input="first_state", dynamic_batch=False),
    steps("lstmcell_trace_static_first_output_state_learned", "lstm", mask_input="first_state", init="learned",
          dynamic_batch=False, near_miss=True),
    # ... laid out [B, T] beside time-major x (or [T, B] beside batch-first x)
    steps("grucell_trace_float_mask_bt_time_major", "gru", mask_input="gt0", mask_transposed=True),
    steps("lstmcell_dynamo_long_mask_tb_bf", "lstm", exporter="dynamo", time=6, mask_input="long_bool",
          mask_transposed=True, batch_first=True),
    steps("rnncell_tanh_trace_static_float_mask_ne0_bt", "rnn_tanh", mask_input="ne0_gather", mask_transposed=True,
          dynamic_batch=False),
    steps("grucell_trace_float_mask_prev_step_bf", "gru", mask_input="prev", batch_first=True, near_miss=True),
    steps("lstmcell_trace_float_mask_reads_state", "lstm", mask_input="reads_state", near_miss=True),
    # a learned initial state expanded to the batch: the op's initial_h (and initial_c)
    steps("lstmcell_trace_learned_init", "lstm", init="learned"),
    steps("grucell_dynamo_learned_init_lengths", "gru", exporter="dynamo", time=6, init="learned", lengths=True),
    steps("rnncell_tanh_trace_learned_init_bf", "rnn_tanh", init="learned", batch_first=True),
]

# --------------------------------------------------------------------------- expectations and descriptions


def expectation(c: Case) -> dict:
    o = c.opts
    if c.model == "keras":
        kinds = {"LSTM": "LSTM", "GRU": "GRU", "SimpleRNN": "RNN"}
        direction = "bidirectional" if o.get("bidir") else "reverse" if o.get("backwards") else "forward"
        ops: dict = {}
        directions: dict = {}
        for k, cell in enumerate([o["cell"]] + ([o["then"]] if o.get("then") else [])):
            op = kinds[cell]
            ops[op] = ops.get(op, 0) + 1
            directions.setdefault(op, []).append(direction if k == 0 else "forward")
        exp = {"ops": ops, "absent": ABSENT, "directions": directions, "max_cell_ops": 0}
        if "GRU" in ops:
            exp["attrs"] = {"GRU": {"linear_before_reset": 1}}
        return exp
    op = ONNX_OP[c.family if c.model != "keras" else {"LSTM": "lstm", "GRU": "gru", "SimpleRNN": "rnn"}[o["cell"]]]
    direction = "bidirectional" if o.get("bidir") else "reverse" if o.get("reverse") or o.get("rev_range") else "forward"
    n = o.get("layers", 1)
    exp = {"ops": {op: n}, "absent": ABSENT, "directions": {op: [direction] * n}, "max_cell_ops": 0}
    attrs = {}
    if op == "GRU":
        attrs["linear_before_reset"] = 1  # PyTorch's formula and Keras' reset_after=True
    if o.get("cell") == "rnn_relu":
        attrs["activations"] = ["Relu"] * (2 if o.get("bidir") else 1)
    if attrs:
        exp["attrs"] = {op: attrs}
    if c.model == "steps":
        return steps_expectation(c, exp)
    if c.model == "projskip":  # (the projection once over x for the op; the skip still reads each step's own)
        return dict(exp, max_cell_ops=c.time + 1)
    if c.model == "gnmt" and o.get("near_miss"):  # the Loop stays as it is
        return {"declined": True, "ops": {}, "absent": []}
    if c.model == "residual" and o.get("near_miss"):  # the Loop stays as it is
        return {"declined": True, "ops": {}, "absent": []}
    if c.model == "residual":  # (two layers; a projection inside the upper step input once over x)
        return dict(exp, ops={op: 2}, directions={op: ["forward"] * 2},
                    max_cell_ops=2 if o.get("mapped") else 1 if o.get("proj") else 0)  # (mapped: Gemm, Tanh)
    if c.model == "univariate":  # (a layer's op each; the Linear(H, 1) stays per step)
        n = o.get("layers", 1)
        return dict(exp, ops={op: n}, directions={op: ["forward"] * n}, max_cell_ops=c.time)
    if c.model == "charrnn":  # (the head's Gemm stays per step)
        exp["max_cell_ops"] = c.time
        if o["cell"] == "rnn_char_linear":
            exp["attrs"] = {op: {"activations": ["Affine"]}}
    if c.model == "script" and o.get("near_miss"):  # the Loop stays as it is
        return {"declined": True, "ops": {}, "absent": []}
    if o.get("inputs") == "two_cells":  # (the Loop split in two: an LSTM over x, a GRU over z)
        return {"ops": {"LSTM": 1, "GRU": 1}, "absent": ABSENT, "directions": {"LSTM": ["forward"], "GRU": ["forward"]},
                "max_cell_ops": 0, "attrs": {"GRU": {"linear_before_reset": 1}}}
    if o.get("collect") == "buffer":  # the buffer's row writes go with the steps: the buffer is Y
        exp["absent"] = list(ABSENT) + ["ScatterND", "ScatterElements"]
    if c.model == "script" and o.get("inputs"):
        exp["max_cell_ops"] = 2  # (the step input's map, applied once to the whole sequence: a Gemm and a Relu)
    if c.model == "script" and o.get("mask_head"):
        exp["max_cell_ops"] = 1  # (the head's Gemm, applied once to the whole sequence)
    if c.model == "nn" and o.get("head"):
        exp["max_cell_ops"] = 2  # (the per-call head, applied once to the whole sequence: a Gemm and a Tanh)
    if o.get("prep") == "linear":
        exp["max_cell_ops"] = 1  # (the model's own Linear over the sequence before the loop: the op's input)
    return exp


CELL_TEXT = {
    "lstm": "nn.LSTMCell", "gru": "nn.GRUCell", "rnn_tanh": "nn.RNNCell(tanh)", "rnn_relu": "nn.RNNCell(relu)",
    "gru_hand": "hand GRU: Linear_ih(3H), Linear_hh(3H), chunk(3), PyTorch formula",
    "lstm_cat": "hand LSTM: one Linear over cat([x_t, h]), gates i,f,g,o",
    "lstm_pergate": "hand LSTM: per gate Linear(x_t) + Linear(h, bias=False)",
    "rnn_hand": "hand RNN: tanh(Linear_ih(x_t) + Linear_hh(h))",
    "rnn_tied": "hand RNN with one weight for input and state: tanh(Linear(x_t + h))",
    "rnn_ind": "IndRNN: relu(Linear(x_t) + u * h), u a vector (an RNN whose R is diagonal)",
    "rnn_indsquare": "near miss: relu(Linear(x_t) + u * h + u * h * h)",
    "rnn_indinput": "near miss: relu(Linear(x_t) + P(x_t) * h), h scaled by the input",
    "rnn_char": "char-RNN tutorial: h = tanh(i2h(cat(x_t, h))), out_t = log_softmax(i2o(cat(x_t, h)))",
    "rnn_char_linear": "char-RNN tutorial as first written: h = i2h(cat(x_t, h)), out_t = log_softmax(i2o(cat(x_t, h)))",
}


def describe(c: Case) -> str:
    o = c.opts
    if c.model == "steps":
        return steps_describe(c)
    layout = "batch-first [B,T,F] read as x[:, t]" if c.batch_first else "time-major [T,B,F] read as x[t]"
    if c.model == "keras":
        back = ", go_backwards=True" if o.get("backwards") else ""
        text = f"{o['cell']}({c.hidden}{back}, return_sequences={o.get('seq', True) or bool(o.get('then'))})"
        if o.get("bidir"):
            text = f"Bidirectional({text})"
        if o.get("then"):
            text += f" -> {o['then']}({c.hidden}, return_sequences={o.get('seq', True)})"
        if o.get("masked"):
            text = f"Masking(0.0) -> {text}"
        return f"{text}; batch-first, static time={c.time}"
    if c.model == "nn":
        cls = {"lstm": "nn.LSTM", "gru": "nn.GRU"}.get(o["cell"], "nn.RNN")
        args = [f"{c.features}, {c.hidden}"]
        if o["cell"].startswith("rnn"):
            args.append(f"nonlinearity={o['cell'][4:]!r}")
        if o.get("layers", 1) > 1:
            args.append(f"num_layers={o['layers']}")
        if c.batch_first:
            args.append("batch_first=True")
        if o.get("bidir"):
            args.append("bidirectional=True")
        init = "given h0" if o.get("init") == "given" else "no initial state"
        out = "tanh(Linear(y[0])) of each call, stacked" if o.get("head") else "output"
        return f"{cls}({', '.join(args)}), {init}; returns ({out}, h_n[, c_n])"
    if c.model == "charrnn":
        ret = {"last_output": "the last step's output", "stacked_last": "torch.stack(outputs)[-1]"}.get(
            o.get("ret"), "(stacked outputs, last h)")
        return f"{CELL_TEXT[o['cell']]}; {layout}; zero initial state; returns {ret}"
    if c.model == "projskip":
        return f"{CELL_TEXT[o['cell']]} over xt = Linear(x_t); {layout}; returns torch.stack([h + xt per step])"
    if c.model == "gnmt":
        ups = ["c2(h1 + x_t)" if o.get("x_res") else "c2(h1)"]
        for i in range(3, o["layers"] + 1):
            ups.append(f"c{i}(" + " + ".join(f"h{j}" for j in range(i - 1, 0, -1)) + (" + x_t)" if o.get("x_res") else ")"))
        if o.get("near_miss"):
            ups[-1] = "c3(h2 + c1)"
        return f"{CELL_TEXT[o['cell']]} x{o['layers']}, GNMT residual stack: c1(x_t), {', '.join(ups)}; returns the top h plus its input"
    if c.model == "residual":
        xt = "xt = tanh(Linear(x_t))" if o.get("mapped") else "x_t"
        if o.get("cat"):
            up = f"cat({'c1_t' if o.get('cat') == 'c' else 'h1_t'}, {xt})"
        else:
            up = "h1_t + Linear(x_t)" if o.get("proj") else f"h1_t + {xt}"
        out = "h2_t + h1_t" if o.get("out_res") else "h2_t"
        return f"2 x {CELL_TEXT[o['cell']]}, the upper over {up}; {layout}; returns torch.stack([{out} per step])"
    if c.model == "univariate":
        read = "x[:, t:t+1]" if o.get("read") == "slice" else "x.split(1, dim=1)"
        return (f"{o.get('layers', 1)} x {CELL_TEXT[o['cell']]} stacked over a [B, T] series read as {read}; "
                "Linear(H, 1) per step; returns torch.cat(outputs, 1)")
    parts = [CELL_TEXT[o["cell"]] + ("" if o.get("bias", True) else " bias=False"), layout]
    if o.get("shared"):
        parts.append("one cell for both directions")
    if o.get("time_last"):
        parts.append("a Conv1d over x.transpose(1, 2), read as x[:, :, t], outputs torch.stack(outs, 2)")
    if o.get("bidir") and o.get("order") == "interleaved":
        parts.append("one loop stepping a forward cell on x[t] and a backward cell on x[T-1-t] (T = x.shape[0]), "
                     "outputs concatenated on features")
    elif o.get("bidir"):
        parts.append("two chains (forward and backward) over the same x, outputs concatenated on features")
    elif o.get("reverse"):
        loop_text = "for i in range(x.size(0)): t = T-1-i" if c.model == "script" else "for t in reversed(range(T))"
        order = "iteration order (reversed in time)" if o.get("order") == "iteration" else "time order"
        parts.append(f"{loop_text}, outputs stacked in {order}")
    elif c.model == "script":
        parts.append("for t in range(x.size(0)), list append, torch.stack")
        if o.get("layers", 1) > 1:
            parts.append(f"{o['layers']} such loops stacked, each over the one before's outputs, steps = x.size(0) read once")
    parts.append({"given": "initial state given as inputs", "learned": "learned initial state expanded to the batch",
                  "chunk": "h0, c0 = tanh(Linear(code)).chunk(2, -1), the code given as input h0"}
                 .get(o.get("init"), "zero initial state (torch.zeros)"))
    parts.append({
        "seq": "returns stacked h",
        "seq_state": "returns (stacked h, last state)",
        "seq_stacked_state": "returns (stacked h, torch.stack(last state))",
        "last": "returns the last state only",
    }[o.get("ret", "seq")])
    return "; ".join(parts)


def case_notes(c: Case) -> str:
    notes = [c.notes] if c.notes else []
    if c.exporter == "trace" and c.dynamic_batch:
        notes.append("dynamic batch via dynamic_axes; T unrolled")
    if c.exporter == "dynamo" and c.model == "loop":
        notes.append("dynamic batch via dynamic_shapes; T unrolled")
    if c.model == "loop" and c.opts.get("order") == "iteration":
        notes.append("output sequence is in reversed time order (a perfect fuser adds a time reversal of Y)")
    if c.exporter == "keras3-torch":
        notes.append("Keras weights randomised (Keras' zero biases would hide bias bugs)")
        if c.opts.get("masked"):
            notes.append("mask from Masking(0.0): padded steps are all-zero feature vectors; "
                         "reference outputs are whatever Keras returns")
    return "; ".join(notes)


# --------------------------------------------------------------------------- input sets


def set_specs(c: Case) -> list[tuple[str, int, int]]:
    """(set name, batch, time) for the numeric input sets."""
    if not c.dynamic_batch:
        return [(f"b{c.batch}", c.batch, c.time)]
    sets = [("b1", 1, c.time), ("b3", 3, c.time)]
    if c.dynamic_time:
        sets.append(("b2_t11", 2, 11))
    return sets


def input_specs(c: Case) -> list[tuple[str, tuple]]:
    """ONNX input names with symbolic shapes: "B" and "T" stand for batch and time."""
    if c.model == "steps":
        return steps_input_specs(c)
    if c.model == "univariate":
        return [("x", ("B", "T"))]
    x = ("B", "T", c.features) if c.batch_first else ("T", "B", c.features)
    specs = [("tokens", x[:2]) if c.opts.get("inputs") in ("embed", "embed_before") else ("x", x)]
    if c.opts.get("inputs") == "context":
        specs.append(("z", ("B", CONTEXT)))
    if c.opts.get("inputs") == "two_cells":  # (a second sequence, as x)
        specs.append(("z", x))
    if c.model == "script" and c.opts.get("lengths"):
        specs.append(("lengths", ("B",)))
    if c.model == "script" and c.opts.get("bool_mask"):  # [B, T] bool: true at valid steps, or padding ("pad")
        specs.append(("pad" if c.opts["bool_mask"] == "pad" else "mask_bool", ("B", "T")))
    if c.model == "script" and c.opts.get("mask_input"):  # [B, T] or [T, B]: bool, float or int64 0/1
        name = {"bool": "mask_bool", "long_ne0": "mask_long"}.get(c.opts["mask_input"], "mask")
        specs.append((name, ("B", "T") if _mask_batch_first(c) else ("T", "B")))
    if c.opts.get("init") in ("given", "linear", "chunk"):
        names = ("h0", "c0") if c.family == "lstm" and c.opts["init"] != "chunk" else ("h0",)
        if c.model == "nn" or c.opts.get("native_step"):  # (a native op's own [D, B, H] state)
            lead = c.opts.get("layers", 1) * (2 if c.opts.get("bidir") else 1)
            specs += [(n, (lead, "B", c.hidden)) for n in names]
        else:
            specs += [(n, ("B", c.hidden)) for n in names]
    return specs


def make_inputs(specs, batch: int, time_: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for name, shape in specs:
        dims = tuple(batch if d == "B" else time_ if d == "T" else d for d in shape)
        if name == "lengths":  # valid steps per row (post-padded): full, partial and empty rows
            feeds[name] = np.array([(time_ - 2 - 3 * i) % (time_ + 1) for i in range(batch)], np.int64)
            continue
        if name == "tokens":  # ids of an embedding's rows, 0 (padding) where zero_padded_steps' patterns pad
            keep = np.stack([_keep_row(time_, batch, b) for b in range(batch)])  # [B, T]
            ids = rng.integers(1, VOCAB, size=(batch, time_)) * keep
            feeds[name] = (ids if shape[0] == "B" else ids.T).astype(np.int64)
            continue
        if name in ("mask_bool", "pad"):  # bool per step and row: valid steps, or their negation
            keep = np.stack([_keep_row(time_, batch, b) for b in range(batch)])  # [B, T]
            keep = keep.T if shape[0] == "T" else keep
            feeds[name] = keep if name == "mask_bool" else ~keep
            continue
        if name in ("mask", "mask_long"):  # 0/1 per step and row: the rows of zero_padded_steps' patterns
            keep = np.stack([_keep_row(time_, batch, b) for b in range(batch)])  # [B, T]
            if shape[0] == "T":
                keep = keep.T
            feeds[name] = keep.astype(np.int64 if name == "mask_long" else np.float32)
            continue
        scale = 1.0 if name == "x" else 0.5
        feeds[name] = (scale * rng.standard_normal(dims)).astype(np.float32)
    return feeds


def _keep_row(T: int, batch: int, b: int) -> np.ndarray:
    """Which steps of row ``b`` are valid: one row post-padded (batch 1); gappy, pre-padded and empty rows
    (more rows: then valid, post-padded, ...)."""
    first = 1 if batch == 1 else 2
    return [np.ones(T, bool), np.arange(T) < T - 3, np.arange(T) % 3 != 1, np.arange(T) >= 2,
            np.zeros(T, bool)][(first + b) % 5]


def zero_padded_steps(x: np.ndarray, batch_first: bool) -> None:
    """Zero the padded steps of ``x`` in place, row by row: one row post-padded (batch 1); gappy, pre-padded
    and empty rows (more rows: then valid, post-padded, ...)."""
    xs = x if batch_first else x.swapaxes(0, 1)  # (a view: [B, T, F])
    for b in range(xs.shape[0]):
        xs[b, ~_keep_row(xs.shape[1], xs.shape[0], b)] = 0.0


# --------------------------------------------------------------------------- torch modules

_nn_classes = {}


def torch_modules():
    """Define the torch module classes once (torch is imported lazily: --list and the Keras child skip it)."""
    if _nn_classes:
        return _nn_classes
    import torch
    from torch import nn

    class GRUHand(nn.Module):
        """PyTorch's GRU formula from two Linears (r, z, n chunks); linear_before_reset semantics."""

        def __init__(self, i, h, bias=True):
            super().__init__()
            self.ih, self.hh = nn.Linear(i, 3 * h, bias=bias), nn.Linear(h, 3 * h, bias=bias)

        def forward(self, x, h):
            ir, iz, in_ = self.ih(x).chunk(3, -1)
            hr, hz, hn = self.hh(h).chunk(3, -1)
            r = torch.sigmoid(ir + hr)
            z = torch.sigmoid(iz + hz)
            n = torch.tanh(in_ + r * hn)
            return (1 - z) * n + z * h

    class RNNHand(nn.Module):
        def __init__(self, i, h, bias=True):
            super().__init__()
            self.ih, self.hh = nn.Linear(i, h, bias=bias), nn.Linear(h, h, bias=bias)

        def forward(self, x, h):
            return torch.tanh(self.ih(x) + self.hh(h))

    class RNNTied(nn.Module):
        """One Linear for the input and the state: ``tanh(W(x_t + h) + b)`` (features = hidden)."""

        def __init__(self, i, h, bias=True):
            super().__init__()
            self.w = nn.Linear(h, h, bias=bias)

        def forward(self, x, h):
            return torch.tanh(self.w(x + h))

    class RNNInd(nn.Module):
        """IndRNN (Li et al. 2018): ``relu(W x_t + b + u * h)``, each unit reading only its own past state. Near
        misses (``form``): "square" adds ``u * h * h``, "input" scales h by ``P x_t`` (multiplicative)."""

        def __init__(self, i, h, bias=True, form="ind"):
            super().__init__()
            self.ih, self.p = nn.Linear(i, h, bias=bias), nn.Linear(i, h)
            self.u = nn.Parameter(torch.rand(h) * 1.5 - 0.5)
            self.square, self.by_input = form == "square", form == "input"

        def forward(self, x, h):
            if self.square:
                return torch.relu(self.ih(x) + self.u * h + self.u * h * h)
            if self.by_input:
                return torch.relu(self.ih(x) + self.p(x) * h)
            return torch.relu(self.ih(x) + self.u * h)

    class LSTMCat(nn.Module):
        """One Linear over cat([x_t, h]); gates i, f, g, o."""

        def __init__(self, i, h, bias=True):
            super().__init__()
            self.lin = nn.Linear(i + h, 4 * h, bias=bias)

        def forward(self, x, state):
            h, c = state
            i, f, g, o = self.lin(torch.cat([x, h], -1)).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c

    class LSTMPerGate(nn.Module):
        """Separate Linears per gate: W_g x_t + b_g + U_g h."""

        def __init__(self, i, h, bias=True):
            super().__init__()
            self.wx = nn.ModuleList([nn.Linear(i, h, bias=bias) for _ in range(4)])
            self.wh = nn.ModuleList([nn.Linear(h, h, bias=False) for _ in range(4)])

        def forward(self, x, state):
            h, c = state
            i, f, g, o = (wx(x) + wh(h) for wx, wh in zip(self.wx, self.wh))
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c

    def make_cell(kind, i, h, bias=True):
        if kind == "lstm":
            return nn.LSTMCell(i, h, bias=bias)
        if kind == "gru":
            return nn.GRUCell(i, h, bias=bias)
        if kind in ("rnn_tanh", "rnn_relu"):
            return nn.RNNCell(i, h, bias=bias, nonlinearity=kind[4:])
        return {"gru_hand": GRUHand, "rnn_hand": RNNHand, "rnn_tied": RNNTied, "rnn_ind": RNNInd, "lstm_cat": LSTMCat,
                "rnn_indsquare": lambda i, h, bias: RNNInd(i, h, bias, "square"),
                "rnn_indinput": lambda i, h, bias: RNNInd(i, h, bias, "input"),
                "lstm_pergate": LSTMPerGate}[kind](
            i, h, bias=bias)

    class CellLoop(nn.Module):
        """A Python loop over one cell (or two for a hand-made bidirectional); unrolled by trace / dynamo."""

        def __init__(self, cell, features, hidden, bias=True, batch_first=False, reverse=False, order="time",
                     init="zeros", ret="seq", bidir=False, collect="stack", prep="", shared=False, time_last=False):
            super().__init__()
            # "linear": a Linear over the whole sequence (no activation) before the loop; the cell's own input
            # matmul then multiplies it again
            self.prep = nn.Linear(features, features) if prep == "linear" else None
            # a Conv1d over the batch-first x's channels first, [B, F, T], read a step at a time as
            # x[:, :, t] and stacked as torch.stack(outs, 2) (an audio front end's layout)
            self.conv = nn.Conv1d(features, features, 3, padding=1) if time_last else None
            self.lstm = cell.startswith("lstm")
            self.hidden, self.batch_first, self.init, self.ret = hidden, batch_first, init, ret
            self.collect = collect  # "buffer": outs = zeros(T, B, H); outs[t] = h (outs[:, t] batch-first)
            self.dirs = [False, True] if bidir else [reverse]
            self.order = order
            self.cells = nn.ModuleList([make_cell(cell, features, hidden, bias) for _ in self.dirs])
            if shared:  # one cell run both ways: the exporter computes each x_t's projection once for both
                self.cells = nn.ModuleList([self.cells[0]] * len(self.dirs))
            if init == "linear":  # the initial state is computed by the graph (a decoder started from a code)
                self.init_proj = nn.Linear(hidden, hidden)
            if init == "chunk":  # both states cut from one tensor the graph computes (a decoder's state from a code)
                self.init_proj = nn.Linear(hidden, 2 * hidden)
            if init == "learned":  # nn.Parameter states expanded to the batch
                self.h0, self.c0 = nn.Parameter(0.3 * torch.randn(1, hidden)), nn.Parameter(0.3 * torch.randn(1, hidden))

        def chain(self, cell, x, state, reverse):
            if self.conv is not None:
                return self.time_last_chain(cell, x, state, reverse)
            steps = x.shape[1 if self.batch_first else 0]
            outs = []
            for t in (reversed(range(steps)) if reverse else range(steps)):
                state = cell(x[:, t] if self.batch_first else x[t], state)
                outs.append(state[0] if self.lstm else state)
            if reverse and self.order == "time":
                outs.reverse()
            if self.collect == "buffer":  # a preallocated output written step by step
                shape = (x.shape[0], steps, self.hidden) if self.batch_first else (steps, x.shape[1], self.hidden)
                buf = torch.zeros(shape, dtype=x.dtype)
                for t, h in enumerate(outs):
                    if self.batch_first:
                        buf[:, t] = h
                    else:
                        buf[t] = h
                return buf, state
            return torch.stack(outs, dim=1 if self.batch_first else 0), state

        def time_last_chain(self, cell, x, state, reverse):
            outs = []
            for t in (reversed(range(x.shape[2])) if reverse else range(x.shape[2])):
                state = cell(x[:, :, t], state)
                outs.append(state[0] if self.lstm else state)
            return torch.stack(outs[::-1] if reverse else outs, 2), state

        def interleaved(self, x, state0):
            """The forward and the backward cell stepped in one loop, the backward one reading x[T - 1 - t]
            with T = x.shape[0] read when run (the trace writes that index as Shape arithmetic, not as the
            constant the forward cell's x[t'] has)."""
            steps = x.shape[1 if self.batch_first else 0]
            states, outs = [state0, state0], [[], []]
            for t in range(steps):
                for k, idx in enumerate((t, steps - 1 - t)):
                    states[k] = self.cells[k](x[:, idx] if self.batch_first else x[idx], states[k])
                    outs[k].append(states[k][0] if self.lstm else states[k])
            outs[1].reverse()
            ys = [torch.stack(o, dim=1 if self.batch_first else 0) for o in outs]
            return ys, [s for st in states for s in (st if self.lstm else [st])]

        def forward(self, x, h0=None, c0=None):
            if self.prep is not None:
                x = self.prep(x)
            if self.conv is not None:  # (batch-first x: [B, T, F] -> [B, F, T])
                x = self.conv(x.transpose(1, 2))
            if self.init == "zeros":
                batch = x.shape[0 if self.batch_first else 1]
                h0 = torch.zeros(batch, self.hidden, dtype=x.dtype)
                c0 = torch.zeros(batch, self.hidden, dtype=x.dtype) if self.lstm else None
            if self.init in ("expand", "expand_one"):  # zeros shaped from x: one column, expanded to the hidden size
                col = x[:, 0, :1] if self.batch_first else x[0, :, :1]
                h0 = torch.zeros_like(col).expand(-1, self.hidden)
                c0 = (h0 if self.init == "expand_one" else torch.zeros_like(col).expand(-1, self.hidden)) if self.lstm else None
            if self.init == "learned":
                batch = x.shape[0 if self.batch_first else 1]
                h0, c0 = self.h0.expand(batch, -1), (self.c0.expand(batch, -1) if self.lstm else None)
            if self.init == "linear":
                h0 = torch.tanh(self.init_proj(h0))
                c0 = self.init_proj(c0) if self.lstm else None
            if self.init == "chunk":  # (the input h0 is the code both states are computed from)
                h0, c0 = torch.tanh(self.init_proj(h0)).chunk(2, -1)
            ys, states = [], []
            if self.order == "interleaved":
                ys, states = self.interleaved(x, (h0, c0) if self.lstm else h0)
            for cell, reverse in zip(self.cells, self.dirs) if self.order != "interleaved" else ():
                y, state = self.chain(cell, x, (h0, c0) if self.lstm else h0, reverse)
                ys.append(y)
                states.extend(state if self.lstm else [state])
            y = ys[0] if len(ys) == 1 else torch.cat(ys, 1 if self.conv is not None else -1)
            if self.ret == "seq":
                return y
            if self.ret == "last":
                return tuple(states) if len(states) > 1 else states[0]
            if self.ret == "seq_stacked_state":
                return y, torch.stack(states)
            return (y, *states)

    class CharRNN(nn.Module):
        """PyTorch's char-RNN tutorial, over a whole sequence: the head reads the cell's concatenation."""

        def __init__(self, features, hidden, linear=False, out=3):
            super().__init__()
            self.hidden, self.linear = hidden, linear
            self.i2h, self.i2o = nn.Linear(features + hidden, hidden), nn.Linear(features + hidden, out)

        def steps(self, x):
            h = torch.zeros(x.shape[1], self.hidden, dtype=x.dtype)
            outs = []
            for t in range(x.shape[0]):
                comb = torch.cat((x[t], h), 1)
                h = self.i2h(comb) if self.linear else torch.tanh(self.i2h(comb))
                outs.append(torch.log_softmax(self.i2o(comb), 1))
            return torch.stack(outs), h

        def forward(self, x):
            return self.steps(x)

    class CharRNNLastOutput(CharRNN):
        """The classifying-names tutorial: ``output, hidden = rnn(x[t], hidden)`` per step, the last output
        returned (the heads before it dead); ``stacked``: every step's output stacked, the last one taken."""

        def __init__(self, features, hidden, linear=False, stacked=False):
            super().__init__(features, hidden, linear)
            self.stacked = stacked

        def forward(self, x):
            if self.stacked:
                return self.steps(x)[0][-1]
            h = torch.zeros(x.shape[1], self.hidden, dtype=x.dtype)
            output = h
            for t in range(x.shape[0]):
                comb = torch.cat((x[t], h), 1)
                h = self.i2h(comb) if self.linear else torch.tanh(self.i2h(comb))
                output = torch.log_softmax(self.i2o(comb), 1)
            return output

    class Univariate(nn.Module):
        """pytorch/examples' time_sequence_prediction in float32 (``layers`` cells of one kind)."""

        def __init__(self, cell, hidden, layers=1, read="split"):
            super().__init__()
            self.cells = nn.ModuleList([make_cell(cell, 1 if k == 0 else hidden, hidden) for k in range(layers)])
            self.lstm, self.hidden, self.read = cell == "lstm", hidden, read
            self.linear = nn.Linear(hidden, 1)

        def forward(self, x):
            zeros = torch.zeros(x.shape[0], self.hidden, dtype=x.dtype)
            states = [(zeros, zeros) if self.lstm else zeros for _ in self.cells]
            steps = x.split(1, dim=1) if self.read == "split" else [x[:, t:t + 1] for t in range(x.shape[1])]
            outputs = []
            for u in steps:
                for k, cell in enumerate(self.cells):
                    states[k] = cell(u, states[k])
                    u = states[k][0] if self.lstm else states[k]
                outputs.append(self.linear(u))
            return torch.cat(outputs, 1)

    class ProjSkip(nn.Module):
        """A per-step input projection read by the cell and by a skip connection on its output."""

        def __init__(self, cell, features, hidden, batch_first=False):
            super().__init__()
            self.inp, self.cell = nn.Linear(features, hidden), make_cell(cell, hidden, hidden)
            self.lstm, self.hidden, self.batch_first = cell == "lstm", hidden, batch_first

        def forward(self, x):
            t_axis = 1 if self.batch_first else 0
            h = torch.zeros(x.shape[1 - t_axis], self.hidden, dtype=x.dtype)
            state = (h, h) if self.lstm else h
            outs = []
            for t in range(x.shape[t_axis]):
                xt = self.inp(x[:, t] if self.batch_first else x[t])
                state = self.cell(xt, state)
                outs.append((state[0] if self.lstm else state) + xt)
            return torch.stack(outs, t_axis)

    class ResidualStack(nn.Module):
        """Two cells a step, the upper reading the lower one's h plus x_t or a projection of it."""

        def __init__(self, cell, features, hidden, proj=False, out_res=False, batch_first=False, cat=False):
            super().__init__()
            self.lower = make_cell(cell, features, hidden)
            self.upper = make_cell(cell, hidden + features if cat else hidden, hidden)
            self.proj = nn.Linear(features, hidden) if proj else None
            self.lstm, self.hidden, self.out_res, self.batch_first = cell == "lstm", hidden, out_res, batch_first
            self.cat = cat

        def forward(self, x):
            t_axis = 1 if self.batch_first else 0
            z = torch.zeros(x.shape[1 - t_axis], self.hidden, dtype=x.dtype)
            s1 = s2 = (z, z) if self.lstm else z
            outs = []
            for t in range(x.shape[t_axis]):
                xt = x[:, t] if self.batch_first else x[t]
                s1 = self.lower(xt, s1)
                h1 = s1[0] if self.lstm else s1
                up = torch.cat([h1, xt], 1) if self.cat else h1 + (self.proj(xt) if self.proj is not None else xt)
                s2 = self.upper(up, s2)
                h2 = s2[0] if self.lstm else s2
                outs.append(h2 + h1 if self.out_res else h2)
            return torch.stack(outs, t_axis)

    class GNMTStack(nn.Module):
        """GNMT's residual stack: cell i reads h_{i-1} plus the input of cell i-1 from the third cell on (the
        second with ``x_res``); returns the top cell's h plus its input per step."""

        def __init__(self, cell, hidden, layers, x_res=False):
            super().__init__()
            self.cells = nn.ModuleList(make_cell(cell, hidden, hidden) for _ in range(layers))
            self.lstm, self.hidden, self.first_res = cell == "lstm", hidden, 1 if x_res else 2

        def forward(self, x):
            z = torch.zeros(x.shape[1], self.hidden, dtype=x.dtype)
            states = [(z, z) if self.lstm else z for _ in self.cells]
            outs = []
            for t in range(x.shape[0]):
                inp = x[t]
                for i, cell in enumerate(self.cells):
                    states[i] = cell(inp, states[i])
                    h = states[i][0] if self.lstm else states[i]
                    inp = h + inp if i + 1 >= self.first_res else h
                outs.append(inp)
            return torch.stack(outs)

    class ScriptGNMT(nn.Module):
        """GNMTStack's three-LSTM form for ``torch.jit.script`` (``c1``: the third cell reads h2 + c1)."""

        def __init__(self, hidden, x_res=False, c1=False):
            super().__init__()
            self.l1, self.l2, self.l3 = (nn.LSTMCell(hidden, hidden) for _ in range(3))
            self.hidden, self.x_res, self.c1_read = hidden, x_res, c1

        def forward(self, x):
            z = torch.zeros(x.size(1), self.hidden, dtype=x.dtype)
            h1, c1, h2, c2, h3, c3 = z, z, z, z, z, z
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                xt = x[t]
                h1, c1 = self.l1(xt, (h1, c1))
                in2 = h1 + xt if self.x_res else h1
                h2, c2 = self.l2(in2, (h2, c2))
                in3 = h2 + c1 if self.c1_read else h2 + in2
                h3, c3 = self.l3(in3, (h3, c3))
                outs.append(h3 + in3)
            return torch.stack(outs)

    class ScriptResidualLSTM(nn.Module):
        """ResidualStack's LSTM form for ``torch.jit.script``: the two cells' states kept apart."""

        def __init__(self, features, hidden, proj=False, batch_first=False, cat=False, mapped=False):
            super().__init__()
            width = hidden if mapped else features  # (mapped: both cells read xt = tanh(Linear(x_t)))
            self.lower, self.upper = nn.LSTMCell(width, hidden), nn.LSTMCell(hidden + width if cat else hidden, hidden)
            self.proj = nn.Linear(features, hidden)
            self.use_proj, self.hidden, self.batch_first, self.mapped = proj, hidden, batch_first, mapped
            self.cat, self.cat_c = bool(cat), cat == "c"  # (typed apart for TorchScript)

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            z = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            h1, c1, h2, c2 = z, z, z, z
            outs: list[torch.Tensor] = []
            for t in range(x.size(tdim)):
                xt = x[:, t] if self.batch_first else x[t]
                if self.mapped:
                    xt = torch.tanh(self.proj(xt))
                h1, c1 = self.lower(xt, (h1, c1))
                if self.cat:
                    up = torch.cat([c1 if self.cat_c else h1, xt], 1)
                else:
                    up = h1 + self.proj(xt) if self.use_proj else h1 + xt
                h2, c2 = self.upper(up, (h2, c2))
                outs.append(h2)
            return torch.stack(outs, tdim)

    class SeqModule(nn.Module):
        """nn.RNN / nn.LSTM / nn.GRU on the whole sequence; returns (output, h_n[, c_n])."""

        def __init__(self, cell, features, hidden, layers=1, batch_first=False, bidir=False, init="zeros",
                     stretch=0, head=False):
            super().__init__()
            self.head = nn.Linear(hidden, 3) if head else None  # (time-major, one step a call)
            self.stretch, self.tdim = stretch, 1 if batch_first else 0
            kw = dict(num_layers=layers, batch_first=batch_first, bidirectional=bidir)
            if cell == "lstm":
                self.rnn = nn.LSTM(features, hidden, **kw)
            elif cell == "gru":
                self.rnn = nn.GRU(features, hidden, **kw)
            else:
                self.rnn = nn.RNN(features, hidden, nonlinearity=cell[4:], **kw)
            self.lstm, self.given = cell == "lstm", init == "given"

        def forward(self, x, h0=None, c0=None):
            state = ((h0, c0) if self.lstm else h0) if self.given else None
            if not self.stretch:
                y, state = self.rnn(x, state)
            else:  # decoder style: the layer called on `stretch` steps at a time, the state carried by hand
                ys, T = [], x.shape[self.tdim]
                for t in range(0, T, self.stretch):
                    y, state = self.rnn(x.narrow(self.tdim, t, min(self.stretch, T - t)), state)
                    ys.append(y if self.head is None else torch.tanh(self.head(y[0])).unsqueeze(0))
                y = torch.cat(ys, self.tdim)
            return (y, *state) if self.lstm else (y, state)

    class ScriptLSTMLoop(nn.Module):
        """Scripted loop over an nn.LSTMCell; T is the dynamic trip count of an ONNX Loop."""

        def __init__(self, features, hidden, reverse=False, batch_first=False, layers=1, cat=False, grow=False,
                     out_axis=-1):
            super().__init__()
            self.cells = nn.ModuleList(nn.LSTMCell(features if k == 0 else hidden, hidden) for k in range(layers))
            self.out_axis = out_axis  # the axis the outputs are stacked on (one layer), else x's time axis
            self.hidden, self.reverse, self.batch_first = hidden, reverse, batch_first
            self.cat = cat  # outs.append(h.unsqueeze(tdim)), then torch.cat(outs, tdim): no stack
            self.grow = grow  # out = torch.cat([out, h.unsqueeze(tdim)], tdim) from an empty tensor

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            odim = self.out_axis if self.out_axis >= 0 else tdim
            steps = x.size(tdim)  # (read once: every layer's Loop runs this many iterations)
            for cell in self.cells:
                h = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
                c = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
                outs: list[torch.Tensor] = []
                grown = torch.zeros(x.size(1 - tdim), 0, self.hidden) if tdim else torch.zeros(0, x.size(1), self.hidden)
                for i in range(steps):
                    t = steps - 1 - i if self.reverse else i
                    h, c = cell(x[:, t] if self.batch_first else x[t], (h, c))
                    if self.grow:
                        grown = torch.cat([grown, h.unsqueeze(tdim)], tdim)
                        continue
                    if self.reverse:  # not outs.reverse() after the loop: the exporter silently drops it
                        outs.insert(0, h)
                    else:
                        outs.append(h.unsqueeze(odim) if self.cat else h)
                x = grown if self.grow else torch.cat(outs, dim=odim) if self.cat else torch.stack(outs, dim=odim)
            return x

    class ScriptPrepLoop(nn.Module):
        """Scripted loop over an nn.LSTMCell reading a map of its step (an input MLP, a LayerNorm, an
        embedding lookup of token ids ``[T, B]``) instead of x[t]."""

        def __init__(self, features, hidden, inputs, batch_first=False):
            super().__init__()
            self.cell, self.hidden, self.batch_first = nn.LSTMCell(features, hidden), hidden, batch_first
            self.prep = {"mlp": lambda: nn.Sequential(nn.Linear(features, features), nn.ReLU()),
                         "norm": lambda: nn.LayerNorm(features),
                         "embed": lambda: nn.Embedding(VOCAB, features)}[inputs]()

        def forward(self, x):
            bf = self.batch_first
            h = torch.zeros(x.size(0 if bf else 1), self.hidden)
            c = torch.zeros(x.size(0 if bf else 1), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(1 if bf else 0)):
                h, c = self.cell(self.prep(x[:, t] if bf else x[t]), (h, c))
                outs.append(h)
            return torch.stack(outs, dim=0)

    class ScriptPackedStateLoop(nn.Module):
        """Scripted loop over an nn.LSTMCell whose state is one tensor ``s = cat([h, c], 1)``, cut apart every
        step (``s[:, :H]``, ``s[:, H:]``: a whole Slice on axis 0, then one on axis 1); returns the stacked h
        and the last s."""

        def __init__(self, features, hidden):
            super().__init__()
            self.cell, self.hidden = nn.LSTMCell(features, hidden), hidden

        def forward(self, x):
            s = torch.zeros(x.size(1), 2 * self.hidden)
            ys: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h, c = self.cell(x[t], (s[:, :self.hidden], s[:, self.hidden:]))
                s = torch.cat([h, c], 1)
                ys.append(h)
            return torch.stack(ys), s

    class ScriptNativeStepLoop(nn.Module):
        """Scripted streaming code: ``nn.LSTM``/``nn.GRU``/``nn.RNN`` called once a step on ``x[t:t + 1]``
        (``read="narrow"``: ``x.narrow(0, t, 1)``), its [1, B, H] state carried by hand, the outputs
        concatenated on time; returns them and the last h (and c)."""

        def __init__(self, features, hidden, read="slice"):
            super().__init__()
            self.rnn, self.hidden, self.narrow = nn.LSTM(features, hidden), hidden, read == "narrow"
            self.width = 2 if read == "pair" else 1  # (x[t:t + 2]: windows of two steps overlapping, a near miss)

        def forward(self, x):
            return self.steps(x, torch.zeros(1, x.size(1), self.hidden), torch.zeros(1, x.size(1), self.hidden))

        def steps(self, x, h, c):
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                y, (h, c) = self.rnn(x.narrow(0, t, 1) if self.narrow else x[t:t + self.width], (h, c))
                outs.append(y)
            return torch.cat(outs, 0), h, c

    class ScriptNativeStepFromLoop(ScriptNativeStepLoop):
        """:class:`ScriptNativeStepLoop` from given [1, B, H] states (inputs h0, c0: the final ones are guarded
        for a run of no step)."""

        def forward(self, x, h0, c0):
            return self.steps(x, h0, c0)

    class ScriptNativeHStepLoop(ScriptNativeStepLoop):
        """:class:`ScriptNativeStepLoop` over ``nn.GRU`` or ``nn.RNN`` (one state: TorchScript types each call);
        ``batch_first``: the op batch-first, called on ``x[:, t:t + 1]``, its outputs concatenated on axis 1."""

        def __init__(self, cell, features, hidden, read="slice", batch_first=False):
            super().__init__(features, hidden, read)
            self.rnn = {"gru": nn.GRU, "rnn_tanh": nn.RNN}[cell](features, hidden, batch_first=batch_first)
            self.t_axis = 1 if batch_first else 0

        def forward(self, x):
            h = torch.zeros(1, x.size(1 - self.t_axis), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(self.t_axis)):
                y, h = self.rnn(x.narrow(self.t_axis, t, 1), h)
                outs.append(y)
            return torch.cat(outs, self.t_axis), h

    class ScriptBufferLoop(nn.Module):
        """Scripted loop over an nn.LSTMCell writing each step's h into a preallocated buffer: outs[t] = h
        (``extra_rows``: a buffer longer than the loop, whose last rows keep their zeros: a near miss)."""

        def __init__(self, features, hidden, extra_rows=0, write="row"):
            super().__init__()
            self.cell, self.hidden, self.extra_rows = nn.LSTMCell(features, hidden), hidden, extra_rows
            self.write = write  # "row": outs[t] = h; "colon": outs[t, :, :] = h; "bf": outs[:, t, :] = h ([B, T, H])

        def forward(self, x):
            h = torch.zeros(x.size(1), self.hidden)
            c = torch.zeros(x.size(1), self.hidden)
            if self.write == "bf":
                outs = torch.zeros(x.size(1), x.size(0) + self.extra_rows, self.hidden)
            else:
                outs = torch.zeros(x.size(0) + self.extra_rows, x.size(1), self.hidden)
            for t in range(x.size(0)):
                h, c = self.cell(x[t], (h, c))
                if self.write == "colon":
                    outs[t, :, :] = h
                elif self.write == "bf":
                    outs[:, t, :] = h
                else:
                    outs[t] = h
            return outs

    class ScriptHoistedLoop(nn.Module):
        """Scripted LSTM loop reading an input projection computed once before it: ``xp = ih(x)``, then per
        step ``xp[t] + hh(h)`` split into the gates (the loop runs x.size(0) times but reads xp)."""

        def __init__(self, features, hidden, cell_after=False):
            super().__init__()
            self.ih, self.hh, self.hidden = nn.Linear(features, 4 * hidden), nn.Linear(hidden, 4 * hidden), hidden
            # cell_after: a Linear(F, F) over x before the loop, an nn.LSTMCell reading its rows (a second matmul)
            self.cell_after = cell_after
            self.pre, self.cell = nn.Linear(features, features), nn.LSTMCell(features, hidden)

        def forward(self, x):
            h = torch.zeros(x.size(1), self.hidden)
            c = torch.zeros(x.size(1), self.hidden)
            outs: list[torch.Tensor] = []
            if self.cell_after:
                xq = self.pre(x)
                for t in range(x.size(0)):
                    h, c = self.cell(xq[t], (h, c))
                    outs.append(h)
                return torch.stack(outs, dim=0)
            xp = self.ih(x)
            for t in range(x.size(0)):
                i, f, g, o = (xp[t] + self.hh(h)).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            return torch.stack(outs, dim=0)

    class ScriptMaskLoop(nn.Module):
        """Scripted LSTM loop over batch-first x [B, T, F] with a [B, T] bool mask read per step:
        ``pad[:, t:t+1]`` (a padding mask, true past a row's length: the states kept, the output 0 there) or
        ``mask[:, t]`` (true at valid steps, unsqueezed: the states kept at the others, the output the kept h).
        ``mask_head``: the output is a Linear head, ``where(p, zeros_like(y), y)`` of the new h (padding mask) or
        of the kept h (valid mask)."""

        def __init__(self, features, hidden, form, mask_head: bool = False):
            super().__init__()
            self.cell, self.hidden, self.pad = nn.LSTMCell(features, hidden), hidden, form == "pad"
            self.fc = nn.Linear(hidden, 3) if mask_head else nn.Identity()

        def forward(self, x, mask):
            h = torch.zeros(x.size(0), self.hidden)
            c = torch.zeros(x.size(0), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(1)):
                h2, c2 = self.cell(x[:, t], (h, c))
                if self.pad:
                    p = mask[:, t:t + 1]
                    h, c = torch.where(p, h, h2), torch.where(p, c, c2)
                    y = self.fc(h2)
                    outs.append(torch.where(p, torch.zeros_like(y), y))
                else:
                    m = mask[:, t].unsqueeze(1)
                    h, c = torch.where(m, h2, h), torch.where(m, c2, c)
                    outs.append(self.fc(h))
            return torch.stack(outs, 1)

    class ScriptMaskInputLoop(nn.Module):
        """Scripted loop over ``layers`` hand cells stacked in one step, each kept where a mask input says the
        step is valid, read at the step on its own time axis (``mask_bf``: ``mask[:, t]``, else ``mask[t]``),
        x's being ``batch_first``'s. ``form``: "bool" (``where(m, cell, h)``), "gt0" (a float 0/1 mask, ``m >
        0``), "long_ne0" (an int64 one, ``m != 0``), "blend" (``m * cell + (1 - m) * h`` of the float mask
        itself: a near miss)."""

        def __init__(self, cell, features, hidden, form, mask_bf, batch_first, layers=1):
            super().__init__()  # (layers: 1 or 2)
            self.cells = nn.ModuleList(make_cell(cell, features if k == 0 else hidden, hidden) for k in range(layers))
            self.hidden, self.form, self.mask_bf, self.batch_first = hidden, form, mask_bf, batch_first

        def keep(self, m_t, new, h):
            if self.form == "blend":
                return m_t * new + (1 - m_t) * h
            valid = m_t if self.form == "bool" else (m_t > 0 if self.form == "gt0" else m_t != 0)
            return torch.where(valid, new, h)

        def forward(self, x, mask):
            steps = x.size(1) if self.batch_first else x.size(0)
            h1 = torch.zeros(x.size(0) if self.batch_first else x.size(1), self.hidden)
            h2 = torch.zeros_like(h1)  # (one state a cell as its own variable: a list of them is carried as a sequence)
            outs: list[torch.Tensor] = []
            for t in range(steps):
                u = x[:, t] if self.batch_first else x[t]
                m_t = (mask[:, t] if self.mask_bf else mask[t]).unsqueeze(1)
                h1 = self.keep(m_t, self.cells[0](u, h1), h1)
                if len(self.cells) > 1:
                    h2 = self.keep(m_t, self.cells[-1](h1, h2), h2)
                    outs.append(h2)
                else:
                    outs.append(h1)
            return torch.stack(outs, 1 if self.batch_first else 0)

    class ScriptXMaskLoop(nn.Module):
        """Scripted loop over a hand cell kept where the step's row of x is not all zeros, decided in the body
        from the step it reads (``v = (x_t != 0).any(-1).unsqueeze(1)``; ``column``: ``x_t[:, 0] != 0``), x read
        on its own time axis."""

        def __init__(self, cell, features, hidden, batch_first, column=False):
            super().__init__()
            self.cell, self.hidden, self.batch_first = make_cell(cell, features, hidden), hidden, batch_first
            self.column = column

        def forward(self, x):
            h = torch.zeros(x.size(0) if self.batch_first else x.size(1), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(1) if self.batch_first else x.size(0)):
                u = x[:, t] if self.batch_first else x[t]
                v = (u[:, 0] != 0).unsqueeze(1) if self.column else (u != 0).any(-1).unsqueeze(1)
                h = torch.where(v, self.cell(u, h), h)
                outs.append(h)
            return torch.stack(outs, 1 if self.batch_first else 0)

    class ScriptStateListLoop(nn.Module):
        """Scripted loop over ``layers`` single-state cells stacked in one step whose states are kept in a Python
        list (``form`` "set": ``hs[k] = cell_k(u, hs[k])``; "bidir": two cells, the second over x backwards,
        ``hs[1] = cell_1(x[T-1-t], hs[1])``; "append": ``hs.append(cell(u, hs[-1]))``, the list growing a state a
        step: a near miss)."""

        def __init__(self, cell, features, hidden, form, layers):
            super().__init__()
            width = [features if k == 0 or form == "bidir" else hidden for k in range(layers)]  # (bidir: both over x)
            self.cells = nn.ModuleList(make_cell(cell, width[k], hidden) for k in range(layers))
            self.hidden, self.form = hidden, form

        def forward(self, x):
            hs = [torch.zeros(x.size(1), self.hidden) for _ in range(len(self.cells))]
            outs: list[torch.Tensor] = []
            back: list[torch.Tensor] = []
            for t in range(x.size(0)):
                u = x[t]
                if self.form == "bidir":
                    hs[0] = self.cells[0](u, hs[0])
                    hs[1] = self.cells[-1](x[x.size(0) - 1 - t], hs[1])
                    back.insert(0, hs[1])
                    u = hs[0]
                elif self.form == "append":
                    hs.append(self.cells[0](u, hs[-1]))
                    u = hs[-1]
                else:
                    for k, cell in enumerate(self.cells):
                        hs[k] = cell(u, hs[k])
                        u = hs[k]
                outs.append(u)
            if self.form == "bidir":
                return torch.cat([torch.stack(outs, 0), torch.stack(back, 0)], -1), hs[-1]
            return torch.stack(outs, 0), hs[-1]

    class ScriptLSTMStateListsLoop(nn.Module):
        """:class:`ScriptStateListLoop` ("set") over nn.LSTMCells: the h and the c of each in a list of its own."""

        def __init__(self, features, hidden, layers):
            super().__init__()
            self.cells = nn.ModuleList(nn.LSTMCell(features if k == 0 else hidden, hidden) for k in range(layers))
            self.hidden = hidden

        def forward(self, x):
            hs = [torch.zeros(x.size(1), self.hidden) for _ in range(len(self.cells))]
            cs = [torch.zeros(x.size(1), self.hidden) for _ in range(len(self.cells))]
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                u = x[t]
                for k, cell in enumerate(self.cells):
                    hs[k], cs[k] = cell(u, (hs[k], cs[k]))
                    u = hs[k]
                outs.append(u)
            return torch.stack(outs, 0), hs[-1], cs[-1]

    class ScriptIterLoop(nn.Module):
        """Scripted loops over a single-state hand cell that iterate over x instead of ``range(x.size(0))``:
        ``for x_t in x.unbind(a)`` (SplitToSequence + SequenceAt, the trip count its SequenceLength), ``for t,
        x_t in enumerate(x)`` (run min(INT64_MAX, x.size(0)) times). (An nn.*Cell checks its input's rank
        with an If on the step's dim, which a SequenceAt element leaves unknown: not fused.)"""

        def __init__(self, cell, features, hidden, kind):
            super().__init__()
            self.cell, self.hidden, self.kind = make_cell(cell, features, hidden), hidden, kind

        def forward(self, x):
            tdim = 1 if self.kind == "unbind_bf" else 0
            h = torch.zeros(x.size(1 - tdim), self.hidden)
            outs: list[torch.Tensor] = []
            if self.kind == "enumerate":
                for t, x_t in enumerate(x):
                    h = self.cell(x_t, h)
                    outs.append(h)
            elif self.kind == "narrow_squeeze":  # (squeeze(0) of a dim TorchScript cannot see: an If on it)
                for t in range(x.size(0)):
                    h = self.cell(x.narrow(0, t, 1).squeeze(0), h)
                    outs.append(h)
            else:
                for x_t in x.unbind(tdim):
                    h = self.cell(x_t, h)
                    outs.append(h)
            return torch.stack(outs, tdim), h

    class ScriptConvLoop(nn.Module):
        """Scripted loop over a single-state hand cell reading ``f[:, :, t]`` of a Conv1d's [B, F, T] output
        (TorchScript: two whole-axis Slices and a Gather on axis 2 in the body); ``reverse``: t = T - 1 - i, the
        outputs put back in time order. Returns the states stacked batch-first and the last one."""

        def __init__(self, cell, features, hidden, reverse=False, **_):
            super().__init__()
            self.conv = nn.Conv1d(features, features, 3, padding=1)
            self.cell, self.hidden, self.reverse = make_cell(cell, features, hidden), hidden, reverse

        def forward(self, x):
            f = self.conv(x.transpose(1, 2))
            steps = f.size(2)
            h = torch.zeros(x.size(0), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for i in range(steps):
                t = steps - 1 - i if self.reverse else i
                h = self.cell(f[:, :, t], h)
                if self.reverse:
                    outs.insert(0, h)
                else:
                    outs.append(h)
            return torch.stack(outs, 1), h

    class ScriptZipMaskLoop(ScriptIterLoop):
        """``for x_t, m_t in zip(x.unbind(1), mask.unbind(1))`` over batch-first x and a [B, T] bool mask: the
        trip count the least of the two lengths, ``h = where(m_t, cell, h)``."""

        def forward(self, x, mask):
            h = torch.zeros(x.size(0), self.hidden)
            outs: list[torch.Tensor] = []
            for x_t, m_t in zip(x.unbind(1), mask.unbind(1)):
                h = torch.where(m_t.unsqueeze(1), self.cell(x_t, h), h)
                outs.append(h)
            return torch.stack(outs, 1), h

    class ScriptBeforeLoop(nn.Module):
        """Scripted LSTMCell loop over x.size(0) reading, at step t, a tensor computed before the loop with x's
        time axis: the embedding rows of [T, B] token ids (``embed_before``), or x flipped in time
        (``flip_before``: torch.flip(x, [0])[t], a backward direction)."""

        def __init__(self, features, hidden, kind):
            super().__init__()
            self.cell, self.hidden, self.embeds = nn.LSTMCell(features, hidden), hidden, kind == "embed_before"
            self.embed = nn.Embedding(VOCAB, features)

        def forward(self, x):
            xs = self.embed(x) if self.embeds else torch.flip(x, [0])
            h = torch.zeros(x.size(1), self.hidden)
            c = torch.zeros(x.size(1), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h, c = self.cell(xs[t], (h, c))
                outs.append(h)
            return torch.stack(outs, dim=0)

    class ScriptContextLoop(nn.Module):
        """Scripted loop over an nn.LSTMCell reading cat([x[t], z]): z [B, C] is captured by the loop body."""

        def __init__(self, features, hidden):
            super().__init__()
            self.cell, self.hidden = nn.LSTMCell(features + CONTEXT, hidden), hidden

        def forward(self, x, z):
            h = torch.zeros(x.size(1), self.hidden)
            c = torch.zeros(x.size(1), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h, c = self.cell(torch.cat([x[t], z], 1), (h, c))
                outs.append(h)
            return torch.stack(outs, dim=0)

    class ScriptHLoop(nn.Module):
        """Scripted loop over a single-state hand-written cell (GRUHand / RNNHand)."""

        def __init__(self, cell, features, hidden, batch_first=False, layers=1):
            super().__init__()
            self.cells = nn.ModuleList(make_cell(cell, features if k == 0 else hidden, hidden) for k in range(layers))
            self.hidden, self.batch_first = hidden, batch_first

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            steps = x.size(tdim)  # (read once: every layer's Loop runs this many iterations)
            for cell in self.cells:
                h = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
                outs: list[torch.Tensor] = []
                for t in range(steps):
                    h = cell(x[:, t] if self.batch_first else x[t], h)
                    outs.append(h)
                x = torch.stack(outs, dim=tdim)
            return x

    class ScriptRevRangeLoop(nn.Module):
        """Scripted ``for t in range(T - skip, -1, -1)`` over an nn.LSTMCell, the outputs stacked in processing
        order (skip 1: every step, backwards; 2: the last step never read, a near miss)."""

        def __init__(self, features, hidden, rev_range=1, batch_first=False, near_miss=False):
            super().__init__()
            self.cell, self.hidden, self.skip, self.batch_first = nn.LSTMCell(features, hidden), hidden, rev_range, batch_first

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            h = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            c = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(x.size(tdim) - self.skip, -1, -1):
                h, c = self.cell(x[:, t] if self.batch_first else x[t], (h, c))
                outs.append(h)
            return torch.stack(outs, dim=tdim)

    class ScriptFromLoop(nn.Module):
        """Scripted ``for t in range(start, T + extra)`` over an nn.LSTMCell reading ``x[t - back]``, the outputs
        stacked: (1, 0, 0) every step from the second (an LSTM over ``x[1:]``), (1, 1, 1) every step with t
        shifted by one; (1, 0, 1) and (2, 0, 1) leave x's last step unread (near misses)."""

        def __init__(self, features, hidden, from_range=(1, 0, 0), batch_first=False):
            super().__init__()
            self.cell, self.hidden, self.batch_first = nn.LSTMCell(features, hidden), hidden, batch_first
            self.start, self.extra, self.back = from_range

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            h = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            c = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(self.start, x.size(tdim) + self.extra):
                h, c = self.cell(x[:, t - self.back] if self.batch_first else x[t - self.back], (h, c))
                outs.append(h)
            return torch.stack(outs, dim=tdim), c

    class ScriptFromHLoop(nn.Module):
        """:class:`ScriptFromLoop` over a single-state hand-written cell (GRUHand / RNNHand)."""

        def __init__(self, cell, features, hidden, from_range=(1, 0, 0), batch_first=False):
            super().__init__()
            self.cell, self.hidden, self.batch_first = make_cell(cell, features, hidden), hidden, batch_first
            self.start, self.extra, self.back = from_range

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            h = torch.zeros(x.size(1 - tdim), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(self.start, x.size(tdim) + self.extra):
                h = self.cell(x[:, t - self.back] if self.batch_first else x[t - self.back], h)
                outs.append(h)
            return torch.stack(outs, dim=tdim)

    class ScriptLengthsLoop(nn.Module):
        """Scripted loop over a hand-written single-state cell masked by hand with lengths: ``pre``: rows valid
        at their last ``lengths`` steps, ``t >= T - lengths`` (pre-padded); else ``t < lengths``. ``reverse``:
        the loop walks time backwards, ``t = T - 1 - i``, its outputs put back in time order (``insert(0, h)``):
        each row's valid steps processed from its last."""

        def __init__(self, cell, features, hidden, pre=False, reverse=False):
            super().__init__()
            self.cell, self.hidden, self.pre, self.reverse = make_cell(cell, features, hidden), hidden, pre, reverse

        def forward(self, x, lengths):
            steps = x.size(0)
            h = torch.zeros(x.size(1), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for i in range(steps):
                t = steps - 1 - i if self.reverse else i
                m = (t >= steps - lengths) if self.pre else (t < lengths)
                h = torch.where(m.unsqueeze(1), self.cell(x[t], h), h)
                if self.reverse:
                    outs.insert(0, h)
                else:
                    outs.append(h)
            return torch.stack(outs), h

    class ScriptBidirLoop(nn.Module):
        """Scripted loop stepping a forward and a backward nn.LSTMCell together: hf from x[t], hb from
        x[T - 1 - t] (a bidirectional layer by hand, in one Loop); ``coupled``: the backward cell also reads hf
        (one recurrence reading x both ways: no native op, a near miss)."""

        def __init__(self, features, hidden, batch_first=False, coupled=False, **_):
            super().__init__()
            self.fw, self.bw = nn.LSTMCell(features, hidden), nn.LSTMCell(features, hidden)
            self.hidden, self.batch_first, self.coupled = hidden, batch_first, coupled

        def forward(self, x):
            tdim = 1 if self.batch_first else 0
            steps, batch = x.size(tdim), x.size(1 - tdim)
            hf, cf = torch.zeros(batch, self.hidden, dtype=x.dtype), torch.zeros(batch, self.hidden, dtype=x.dtype)
            hb, cb = torch.zeros(batch, self.hidden, dtype=x.dtype), torch.zeros(batch, self.hidden, dtype=x.dtype)
            outs_f: list[torch.Tensor] = []
            outs_b: list[torch.Tensor] = []
            for i in range(steps):
                j = steps - 1 - i
                hf, cf = self.fw(x[:, i] if self.batch_first else x[i], (hf, cf))
                hb, cb = self.bw(x[:, j] if self.batch_first else x[j], (hb + hf if self.coupled else hb, cb))
                outs_f.append(hf)
                outs_b.insert(0, hb)  # (not outs_b.reverse() after the loop: the exporter drops it)
            return torch.cat([torch.stack(outs_f, tdim), torch.stack(outs_b, tdim)], -1)

    class ScriptTwoCellsLoop(nn.Module):
        """Scripted loop stepping two cells side by side over two inputs (an nn.LSTMCell over x[t], a hand GRU
        over z[t]), neither reading the other: two encoders in one Loop."""

        def __init__(self, features, hidden, **_):
            super().__init__()
            self.a, self.b = nn.LSTMCell(features, hidden), make_cell("gru_hand", features, hidden)
            self.hidden = hidden

        def forward(self, x, z):
            batch = x.size(1)
            h, c = torch.zeros(batch, self.hidden, dtype=x.dtype), torch.zeros(batch, self.hidden, dtype=x.dtype)
            g = torch.zeros(batch, self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h, c = self.a(x[t], (h, c))
                g = self.b(z[t], g)
                outs.append(h)
            return torch.stack(outs), g

    _nn_classes.update(CellLoop=CellLoop, CharRNN=CharRNN, CharRNNLastOutput=CharRNNLastOutput, Univariate=Univariate,
                       ProjSkip=ProjSkip, ResidualStack=ResidualStack, ScriptResidualLSTM=ScriptResidualLSTM, GNMTStack=GNMTStack, ScriptGNMT=ScriptGNMT,
                       SeqModule=SeqModule, ScriptLSTMLoop=ScriptLSTMLoop,
                       ScriptHLoop=ScriptHLoop, ScriptPrepLoop=ScriptPrepLoop, ScriptContextLoop=ScriptContextLoop,
                       ScriptBufferLoop=ScriptBufferLoop, ScriptNativeStepLoop=ScriptNativeStepLoop, ScriptPackedStateLoop=ScriptPackedStateLoop,
                       ScriptNativeHStepLoop=ScriptNativeHStepLoop,
                       ScriptNativeStepFromLoop=ScriptNativeStepFromLoop, ScriptLengthsLoop=ScriptLengthsLoop,
                       ScriptHoistedLoop=ScriptHoistedLoop, ScriptMaskLoop=ScriptMaskLoop, ScriptIterLoop=ScriptIterLoop,
                       ScriptMaskInputLoop=ScriptMaskInputLoop, ScriptXMaskLoop=ScriptXMaskLoop,
                       ScriptStateListLoop=ScriptStateListLoop, ScriptLSTMStateListsLoop=ScriptLSTMStateListsLoop,
                       ScriptZipMaskLoop=ScriptZipMaskLoop, ScriptConvLoop=ScriptConvLoop,
                       ScriptBeforeLoop=ScriptBeforeLoop,
                       ScriptRevRangeLoop=ScriptRevRangeLoop, ScriptFromLoop=ScriptFromLoop,
                       ScriptFromHLoop=ScriptFromHLoop, ScriptBidirLoop=ScriptBidirLoop,
                       ScriptTwoCellsLoop=ScriptTwoCellsLoop)
    return _nn_classes


def build_module(c: Case):
    m = torch_modules()
    o = dict(c.opts)
    cell = o.pop("cell")
    if c.model == "loop":
        return m["CellLoop"](cell, c.features, c.hidden, **o)
    if c.model == "nn":
        return m["SeqModule"](cell, c.features, c.hidden, **o)
    if c.model == "steps":
        return steps_module(c)
    if c.model == "charrnn":
        if o.get("ret") in ("last_output", "stacked_last"):
            return m["CharRNNLastOutput"](c.features, c.hidden, cell == "rnn_char_linear", o["ret"] == "stacked_last")
        return m["CharRNN"](c.features, c.hidden, linear=cell == "rnn_char_linear")
    if c.model == "univariate":
        return m["Univariate"](cell, c.hidden, **o)
    if c.model == "projskip":
        return m["ProjSkip"](cell, c.features, c.hidden, **o)
    if c.model == "gnmt" and c.exporter == "torchscript":
        return m["ScriptGNMT"](c.hidden, x_res=o.get("x_res", False), c1=o.get("near_miss", False))
    if c.model == "gnmt":
        return m["GNMTStack"](cell, c.hidden, o["layers"], x_res=o.get("x_res", False))
    if c.model == "residual" and c.exporter == "torchscript":
        o.pop("near_miss", None)
        return m["ScriptResidualLSTM"](c.features, c.hidden, **o)
    if c.model == "residual":
        return m["ResidualStack"](cell, c.features, c.hidden, **o)
    if c.model == "script":
        inputs = o.pop("inputs", None)
        if o.get("packed_state"):
            return m["ScriptPackedStateLoop"](c.features, c.hidden)
        if o.get("native_step"):
            if cell == "lstm":
                kind = "ScriptNativeStepFromLoop" if o.get("init") == "given" else "ScriptNativeStepLoop"
                return m[kind](c.features, c.hidden, o["native_step"])
            return m["ScriptNativeHStepLoop"](cell, c.features, c.hidden, o["native_step"], c.batch_first)
        if o.pop("collect", None) == "buffer":
            return m["ScriptBufferLoop"](c.features, c.hidden, o.get("extra_rows", 0), o.get("write", "row"))
        if o.pop("lengths", None):
            return m["ScriptLengthsLoop"](cell, c.features, c.hidden, **o)
        if o.get("rev_range"):
            return m["ScriptRevRangeLoop"](c.features, c.hidden, **o)
        if o.get("from_range") and cell == "lstm":
            return m["ScriptFromLoop"](c.features, c.hidden, o["from_range"], c.batch_first)
        if o.get("from_range"):
            return m["ScriptFromHLoop"](cell, c.features, c.hidden, o["from_range"], c.batch_first)
        if inputs == "context":
            return m["ScriptContextLoop"](c.features, c.hidden)
        if inputs in ("embed_before", "flip_before"):
            return m["ScriptBeforeLoop"](c.features, c.hidden, inputs)
        if inputs in ("hoisted", "linear_before"):
            return m["ScriptHoistedLoop"](c.features, c.hidden, inputs == "linear_before")
        if inputs == "conv_time_last":
            return m["ScriptConvLoop"](cell, c.features, c.hidden, **o)
        if inputs in ("unbind", "unbind_bf", "enumerate", "zip_mask", "narrow_squeeze"):
            return m["ScriptZipMaskLoop" if inputs == "zip_mask" else "ScriptIterLoop"](cell, c.features, c.hidden, inputs)
        if o.get("bool_mask"):
            return m["ScriptMaskLoop"](c.features, c.hidden, o["bool_mask"], o.get("mask_head", False))
        if o.get("state_list") and cell == "lstm":
            return m["ScriptLSTMStateListsLoop"](c.features, c.hidden, o["layers"])
        if o.get("state_list"):
            return m["ScriptStateListLoop"](cell, c.features, c.hidden, o["state_list"],
                                            2 if o["state_list"] == "bidir" else o["layers"])
        if o.get("xmask"):
            return m["ScriptXMaskLoop"](cell, c.features, c.hidden, c.batch_first, o["xmask"] == "column")
        if o.get("mask_input"):
            return m["ScriptMaskInputLoop"](cell, c.features, c.hidden, o["mask_input"], _mask_batch_first(c),
                                            c.batch_first, o.get("layers", 1))
        if o.get("bidir"):
            return m["ScriptBidirLoop"](c.features, c.hidden, **o)
        if inputs == "two_cells":
            return m["ScriptTwoCellsLoop"](c.features, c.hidden)
        if inputs:
            return m["ScriptPrepLoop"](c.features, c.hidden, inputs, c.batch_first)
        o.pop("near_miss", None)  # (a near-miss cell: the loop as any other)
        if cell == "lstm":
            return m["ScriptLSTMLoop"](c.features, c.hidden, **o)
        return m["ScriptHLoop"](cell, c.features, c.hidden, **o)
    raise ValueError(c.model)


# --------------------------------------------------------------------------- torch export


def flat_outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def export_torch(c: Case, module, specs, path: Path):
    import torch

    example = make_inputs(specs, c.batch, c.time, np.random.default_rng(0))
    args = tuple(torch.from_numpy(example[name]) for name, _ in specs)
    names = [name for name, _ in specs]
    n_out = len(flat_outputs(module(*args)))
    out_names = [f"out{k}" for k in range(n_out)]
    if c.exporter == "dynamo":
        dynamic_shapes = None
        if c.dynamic_batch:
            batch = torch.export.Dim("batch")
            dynamic_shapes = tuple({shape.index("B"): batch} for _, shape in specs)
        torch.onnx.export(module, args, str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=names, output_names=out_names, dynamic_shapes=dynamic_shapes,
                          optimize=c.optimize)
        return
    axes = {}
    for name, shape in specs:
        dims = {}
        if c.dynamic_batch:
            dims[shape.index("B")] = "batch"
        if c.dynamic_time and "T" in shape:
            dims[shape.index("T")] = "time"
        if dims:
            axes[name] = dims
    if c.exporter == "torchscript":
        module = torch.jit.script(module)
    torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, input_names=names,
                      output_names=out_names, dynamic_axes=axes or None, do_constant_folding=c.fold)


def self_contained(path: Path):
    """Load the export; inline any external data and re-save as one file."""
    import onnx

    model = onnx.load(str(path))
    inits = list(model.graph.initializer)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in inits):
        for t in inits:
            t.data_location = onnx.TensorProto.DEFAULT
        onnx.save(model, str(path), save_as_external_data=False)
    return model


def generate_torch(c: Case, out_dir: Path) -> dict:
    import torch

    seed = zlib.crc32(c.name.encode())  # same weights and data whatever subset is generated
    torch.manual_seed(seed)
    module = build_module(c).eval()
    specs = input_specs(c)
    path = out_dir / f"{c.name}.onnx"
    with torch.no_grad():
        export_torch(c, module, specs, path)
    model = self_contained(path)

    if graph_inputs(model) != [name for name, _ in specs]:
        raise RuntimeError(f"ONNX inputs {graph_inputs(model)} != module inputs {[n for n, _ in specs]}")
    rng = np.random.default_rng(seed)
    arrays = {}
    for set_name, batch, time_ in set_specs(c):
        feeds = make_inputs(specs, batch, time_, rng)
        if c.opts.get("xmask"):
            zero_padded_steps(feeds["x"], c.batch_first)
        with torch.no_grad():
            outs = flat_outputs(module(*(torch.from_numpy(feeds[n]) for n, _ in specs)))
        if len(outs) != len(model.graph.output):
            raise RuntimeError(f"{len(outs)} torch outputs but {len(model.graph.output)} ONNX outputs")
        arrays.update({f"in/{set_name}/{k}": v for k, v in feeds.items()})
        arrays.update({f"out/{set_name}/{k}": o.numpy() for k, o in enumerate(outs)})
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    return write_meta(c, model, out_dir)


def write_meta(c: Case, model, out_dir: Path, extra_notes: str = "", sets=None) -> dict:
    ops = graph_ops(model.graph)
    meta = {
        "name": c.name,
        "exporter": c.exporter,
        "layers": describe(c),
        "expect": expectation(c),
        "sets": sets or [s for s, _, _ in set_specs(c)],
        "dynamic_batch": c.dynamic_batch,
        "dynamic_time": c.dynamic_time,
        "masked": bool(c.opts.get("masked")),
        "slow": c.slow,
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "nodes": len(model.graph.node),  # top-level graph
        "nodes_total": len(ops),  # with Loop / If bodies
        "exported_ops": {op: ops.count(op) for op in ("LSTM", "GRU", "RNN", "Loop", "Scan", "If") if op in ops},
        "notes": "; ".join(n for n in (case_notes(c), extra_notes) if n),
    }
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def graph_inputs(model) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def graph_ops(graph) -> list[str]:
    """Op types in a graph and its subgraphs."""
    ops = []
    for node in graph.node:
        ops.append(node.op_type)
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                ops.extend(graph_ops(sub))
    return ops


# --------------------------------------------------------------------------- Keras 3 (torch backend), child side


def keras_sets(c: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(c.name.encode()))
    sets = {}
    patterns = MASK_PATTERNS if c.opts.get("masked") else {"b1": ["1" * c.time], "b3": ["1" * c.time] * 3}
    for set_name, rows in patterns.items():
        keep = np.array([[ch == "1" for ch in row] for row in rows])
        x = rng.standard_normal((keep.shape[0], c.time, c.features)).astype(np.float32)
        x[x == 0] = 0.5  # a real step is never an exact mask value
        x[~keep] = 0.0
        sets[set_name] = x
    return sets


def generate_keras(c: Case, out_dir: Path) -> dict:
    import keras

    keras.backend.clear_session()
    seed = zlib.crc32(c.name.encode())
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    o = c.opts
    x_in = keras.Input(shape=(c.time, c.features), name="x")
    h = keras.layers.Masking(0.0)(x_in) if o.get("masked") else x_in
    layer = getattr(keras.layers, o["cell"])(c.hidden, return_sequences=o.get("seq", True) or bool(o.get("then")),
                                             go_backwards=bool(o.get("backwards")))
    h = (keras.layers.Bidirectional(layer) if o.get("bidir") else layer)(h)
    if o.get("then"):
        h = getattr(keras.layers, o["then"])(c.hidden, return_sequences=o.get("seq", True))(h)
    model = keras.Model(x_in, h)
    for w in model.weights:
        w.assign((0.5 * rng.standard_normal(tuple(w.shape))).astype(np.float32))

    sets = keras_sets(c)
    refs = {s: keras.ops.convert_to_numpy(model(x, training=False)) for s, x in sets.items()}
    path = out_dir / f"{c.name}.onnx"
    extra = ""
    try:
        model.export(str(path), format="onnx", verbose=False)
    except Exception as exc:  # dynamic batch refused: fall back to the static signature of the first set
        first = next(iter(sets.values()))
        extra = f"dynamic-batch export failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); static batch"
        model.export(str(path), format="onnx", verbose=False,
                     input_signature=[keras.InputSpec(shape=first.shape, dtype="float32", name="x")])
        sets = {s: x for s, x in sets.items() if x.shape[0] == first.shape[0]}
    onnx_model = self_contained(path)
    inputs = graph_inputs(onnx_model)
    if len(inputs) != 1 or len(onnx_model.graph.output) != 1:
        raise RuntimeError(f"unexpected ONNX signature: inputs {inputs}, {len(onnx_model.graph.output)} outputs")
    dims = [d.dim_param or d.dim_value for d in onnx_model.graph.input[0].type.tensor_type.shape.dim]
    c = replace(c, dynamic_batch=isinstance(dims[0], str))
    arrays = {}
    for s, x in sets.items():
        arrays[f"in/{s}/{inputs[0]}"] = x
        arrays[f"out/{s}/0"] = refs[s]
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    extra = "; ".join(p for p in (extra, f"ONNX input shape {dims}") if p)
    return write_meta(c, onnx_model, out_dir, extra, sets=list(sets))


def keras_child(out_dir: Path, names: list[str]) -> int:
    """Runs in the child process: KERAS_BACKEND=torch is already in the environment."""
    quiet_logs()
    cases = {c.name: c for c in CASES}
    for name in names:
        start = time.perf_counter()
        try:
            with captured():
                meta = generate_keras(cases[name], out_dir)
            print(json.dumps({"name": name, "ok": True, "seconds": time.perf_counter() - start,
                              "nodes": meta["nodes"]}), flush=True)
        except Exception as exc:
            print(json.dumps({"name": name, "ok": False, "seconds": time.perf_counter() - start,
                              "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}), flush=True)
    return 0


def run_keras_children(cases: list[Case], out_dir: Path) -> list[dict]:
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--keras-child", "--out", str(out_dir),
           "--only", *[c.name for c in cases]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                r = json.loads(line)
                results[r["name"]] = r
    errors = [ln for ln in proc.stderr.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    tail = (errors[-1] if errors else f"exit status {proc.returncode}")[:300]
    return [results.get(c.name, {"name": c.name, "ok": False, "seconds": 0.0,
                                 "error": f"Keras child process gave no result: {tail}"}) for c in cases]


# --------------------------------------------------------------------------- verification (optional)


def verify(out_dir: Path, name: str, atol=1e-5, rtol=1e-5) -> tuple[bool, float]:
    """Run the unfused export in onnxruntime on every set and compare with the framework's outputs."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(out_dir / f"{name}.onnx"), so, providers=["CPUExecutionProvider"])
    data = np.load(out_dir / f"{name}.npz")
    sets: dict[str, tuple[dict, dict]] = {}
    for key in data.files:
        kind, set_name, rest = key.split("/", 2)
        sets.setdefault(set_name, ({}, {}))[kind == "out"][rest] = data[key]
    ok, worst = True, 0.0
    for feeds, outs in sets.values():
        got = sess.run(None, feeds)
        for k, ref in outs.items():
            g = got[int(k)]
            if g.shape != ref.shape:
                return False, float("inf")
            worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - ref))) if ref.size else 0.0)
            ok &= bool(np.allclose(g, ref, atol=atol, rtol=rtol))
    return ok, worst


# --------------------------------------------------------------------------- main


def quiet_logs():
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for name in ("torch", "torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "keras", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def captured():
    """Swallow what exporters print on stdout/stderr (Python level)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for <case>.onnx/.npz/.json")
    parser.add_argument("--only", nargs="+", action="extend", metavar="SUBSTR",
                        help="only cases whose name contains one of these substrings")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--no-slow", action="store_true", help='leave out the cases marked "slow"')
    parser.add_argument("--verify", action="store_true",
                        help="also check every export with onnxruntime against the reference outputs")
    parser.add_argument("--keras-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    cases = [c for c in CASES if (not args.only or any(s in c.name for s in args.only))
             and not (args.no_slow and c.slow)]
    if args.keras_child:
        return keras_child(args.out, [c.name for c in CASES if c.exporter == "keras3-torch" and c.name in args.only])
    if args.list:
        for c in cases:
            print(f"{c.name:34s} {c.exporter:12s} {describe(c)}{'  [slow]' if c.slow else ''}")
        return 0
    if args.out is None:
        parser.error("--out is required unless --list is given")
    if not cases:
        print(f"no case matches --only {args.only}", file=sys.stderr)
        return 2

    quiet_logs()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    for c in cases:
        if c.exporter == "keras3-torch":
            continue
        start = time.perf_counter()
        try:
            with captured():
                meta = generate_torch(c, args.out)
            results.append({"name": c.name, "ok": True, "seconds": time.perf_counter() - start,
                            "nodes": meta["nodes"]})
        except Exception as exc:  # one broken case must not stop the others
            results.append({"name": c.name, "ok": False, "seconds": time.perf_counter() - start,
                            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]})
        report(results[-1])
    keras_cases = [c for c in cases if c.exporter == "keras3-torch"]
    if keras_cases:
        for r in run_keras_children(keras_cases, args.out):
            results.append(r)
            report(r)

    bad = []
    if args.verify:
        for r in results:
            if r["ok"]:
                ok, err = verify(args.out, r["name"])
                r["max_abs_err"] = err
                print(f"verify {r['name']:34s} {'ok ' if ok else 'BAD'} max|ort-ref| = {err:.2e}", flush=True)
                if not ok:
                    bad.append(r["name"])
    with open(args.out / "summary.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    done = sum(r["ok"] for r in results)
    skipped = [r["name"] for r in results if not r["ok"]]
    print(f"torch: {done} of {len(results)} cases written to {args.out} in {time.perf_counter() - started:.1f}s"
          + (f", skipped {skipped}" if skipped else "") + (f", ONNX differs from reference: {bad}" if bad else ""))
    return 0 if done * 2 > len(results) and not bad else 1


def report(r: dict):
    if r["ok"]:
        print(f"{r['name']}: {r['seconds']:.1f}s, {r['nodes']} nodes", flush=True)
    else:
        print(f"WARNING: skipped {r['name']}: {r['error']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
