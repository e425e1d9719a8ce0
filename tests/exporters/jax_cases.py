"""Export JAX / Flax recurrences with jax2onnx and record JAX's own outputs.

Usage::

    python tests/exporters/jax_cases.py --out DIR [--only SUBSTR ...]
    python tests/exporters/jax_cases.py --list

jax2onnx writes every ``lax.scan`` (and so every flax ``nn.RNN``) as an ONNX ``Loop`` whose body receives
each closed-over weight *and the scanned sequence itself* as loop-carried values it passes on unchanged,
reads the step as ``Gather(<carried xs>, iter)`` and puts ``Cast`` "dtype fix" nodes on the new state.
The cases vary what users vary: the flax.linen cells (``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``,
``SimpleCell``) under ``nn.RNN`` (wrapped with ``flax.nnx.bridge.ToNNX`` and called with an explicit
carry, as jax2onnx's own tests do), ``nn.Bidirectional``, ``return_carry``, ``seq_lengths``, flax.nnx
cells under ``lax.scan``, hand-written steps (with a per-step bool mask), ``lax.fori_loop`` reading the
step with ``dynamic_index_in_dim``, opset 17 and jax2onnx's default 23, static and dynamic time; steps
whose per-step output is a head on h (``dense(h)``); hand-written length masks (``t < lengths``); the
per-step c read at ``lengths - 1`` per row; Equinox cells under ``jax.vmap``; and near misses that a fuser
must decline (a carried weight that changes, a step that also reads the next step, a head on c, a head
feeding back into the state, rows reading another row's c). A head may read the carry before the update (the
char-RNN's ``concatenate([x_t, h])``).

For every case DIR gets ``<case>.onnx`` (as exported), ``<case>.npz`` (``in/<set>/<input name>`` feeds and
``out/<set>/<k>`` = JAX's own value of the k-th graph output) and ``<case>.json`` (name, ``expect``:
``ops`` = one native op per recurrence, ``absent``; or ``declined`` = a reason substring for near misses;
``sets``, ``opset``, ``exported_ops``, ``notes``). Sets: ``b1``/``b3`` (and ``b2_t11`` for a dynamic time
axis); masked cases ``post_b1``, ``post_b3``, ``pre_b3``, ``gappy_b3`` (rows with padding at the end, at
the start, and anywhere). Exports that fail are one WARNING line each and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FEATURES = 3
HIDDEN = 4
TIME = 6
VOCAB = 11  # token ids of the embedding cases
DEFAULT_OPSET = 23  # jax2onnx's default

MASK_PATTERNS = {
    "post_b1": ["111100"],
    "post_b3": ["111111", "111100", "110000"],
    "pre_b3": ["111111", "001111", "011111"],
    "gappy_b3": ["101101", "011110", "111111"],
}
LENGTH_SETS = {"post_b3": [6, 3, 1]}  # static batch: jax2onnx 0.17 cannot export seq_lengths with a symbolic one
# hand-written length masks (dynamic batch): a row with no valid step, one past the end; and batch 1
EDGE_LENGTHS = {"edge_b3": [0, 8, 2], "mid_b1": [4]}
ONNX_OP = {"lstm": "LSTM", "lstm_concat_carry": "LSTM", "olstm": "LSTM", "gru": "GRU", "simple": "RNN", "simple_relu": "RNN", "mgu": "GRU",
           "gru_flipped": "GRU"}


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "rnn" | "bidir" | "nnx_scan" | "hand" | "fori" | "pyfor" | "eqx"
    cell: str  # lstm | olstm | gru | simple | simple_relu (model "hand": lstm | gru | rnn | ...)
    opset: int = DEFAULT_OPSET
    dynamic_time: bool = False
    opts: dict = field(default_factory=dict)
    declined: str = ""  # a near miss: the reason the fuser must give
    notes: str = ""

    @property
    def masked(self) -> bool:
        return bool(self.opts.get("mask"))

    @property
    def lengths(self) -> bool:
        return bool(self.opts.get("seq_lengths"))

    @property
    def sets(self) -> list[str]:
        if self.opts.get("static_batch"):  # exported with the batch size fixed: fed that batch only
            return [f"b{self.opts['static_batch']}"]
        if self.masked:
            return list(MASK_PATTERNS)
        if self.lengths:
            return list(LENGTH_SETS) + (list(EDGE_LENGTHS) if self.opts.get("edges") else [])
        return ["b1", "b3"] + (["b2_t11"] if self.dynamic_time else [])


def rnn(name, cell, **kw):
    top = {k: kw.pop(k) for k in ("opset", "dynamic_time", "declined", "notes") if k in kw}
    return Case(name, "rnn", cell, opts=kw, **top)


def case(name, model, cell, **kw):
    top = {k: kw.pop(k) for k in ("opset", "dynamic_time", "declined", "notes") if k in kw}
    return Case(name, model, cell, opts=kw, **top)


CASES = [
    # -- flax.linen nn.RNN over each cell, through flax.nnx.bridge.ToNNX, opset 23 (default) and 17
    rnn("linen_lstm", "lstm"),
    rnn("linen_olstm", "olstm"),
    rnn("linen_gru", "gru"),
    rnn("linen_simple", "simple"),
    rnn("linen_simple_relu", "simple_relu"),
    rnn("linen_lstm_o17", "lstm", opset=17),
    rnn("linen_gru_o17", "gru", opset=17),
    rnn("linen_simple_o17", "simple", opset=17),
    rnn("linen_lstm_dyn_t", "lstm", dynamic_time=True),
    rnn("linen_gru_dyn_t_o17", "gru", dynamic_time=True, opset=17),
    rnn("linen_lstm_carry", "lstm", return_carry=True),
    rnn("linen_gru_carry", "gru", return_carry=True),
    rnn("linen_lstm_h0", "lstm", given_carry=True),
    rnn("linen_lstm_h0_dense", "lstm", carry_from="dense", notes="(c0, h0) = (z @ W, tanh(z @ W)): computed by the graph"),
    rnn("linen_gru_h0_dense_o17", "gru", carry_from="dense", opset=17),
    rnn("linen_gru_lengths", "gru", seq_lengths=True, return_carry=True),
    rnn("linen_lstm_lengths", "lstm", seq_lengths=True, return_carry=True),
    rnn("linen_gru_reverse", "gru", reverse=True),
    # -- nn.Bidirectional: two Loops, the reversal outside (Range/Sub/Gather), Concat: one bidirectional op
    case("linen_bidir_gru", "bidir", "gru"),
    case("linen_bidir_lstm_o17", "bidir", "lstm", opset=17),
    case("linen_bidir_gru_seq_lengths", "bidir", "gru", seq_lengths=True,
         notes="nn.Bidirectional with seq_lengths: each row flipped within its length; two forward ops"),
    # -- flax.nnx cells under lax.scan
    case("nnx_lstm_scan", "nnx_scan", "lstm"),
    case("nnx_gru_scan", "nnx_scan", "gru"),
    case("nnx_simple_scan_dyn_t", "nnx_scan", "simple", dynamic_time=True),
    # -- hand-written steps under lax.scan (closed-over weights)
    case("hand_lstm_fused_gates", "hand", "lstm"),
    case("hand_gru_cat", "hand", "gru"),
    case("hand_rnn_relu_o17", "hand", "rnn_relu", opset=17),
    case("hand_lstm_masked", "hand", "lstm", mask=True),
    case("hand_gru_masked_o17", "hand", "gru", mask=True, opset=17),
    case("hand_gru_masked_input", "hand", "gru", mask=True, mask_input=True,
         notes="x_t * m_t feeds the cell beside the masked state update"),
    case("hand_gru_xmask", "hand", "gru", mask=True, xmask=True,
         notes="no mask input: the step's mask is jnp.any(x_t != 0, -1), computed in the body"),
    case("hand_lstm_xmask_o17", "hand", "lstm", mask=True, xmask=True, opset=17,
         notes="no mask input: the step's mask is jnp.any(x_t != 0, -1), computed in the body"),
    case("hand_gru_float_mask", "hand", "gru", mask=True, fmask="float",
         notes="the mask input is float 0/1: the step's mask is m_t > 0, computed in the body"),
    case("hand_lstm_int_mask_o17", "hand", "lstm", mask=True, fmask="int", opset=17,
         notes="the mask input is int32 0/1: the step's mask is m_t != 0, computed in the body"),
    # -- matmuls written with jnp.einsum ("bf,fk->bk"; weights [out, in] read "bf,hf->bh", weight first)
    case("hand_gru_einsum", "hand", "gru_einsum"),
    case("hand_rnn_einsum_transposed_o17", "hand", "rnn_einsum_t", opset=17),
    # -- lax.fori_loop reading the step with dynamic_index_in_dim (batch-first, axis 1)
    case("fori_rnn_last_h", "fori", "rnn"),
    case("fori_gru_last_h", "fori", "gru"),
    case("fori_rnn_from1", "fori", "rnn", start=1, notes="fori_loop(1, T) reading x[:, t]: an RNN over x[:, 1:]"),
    case("fori_rnn_from2", "fori", "rnn", start=2, notes="fori_loop(2, T) reading x[:, t]: an RNN over x[:, 2:]"),
    case("fori_gru_from1", "fori", "gru", start=1, notes="fori_loop(1, T) over a GRU: a GRU over x[:, 1:]"),
    case("near_fori_rnn_from1_back1", "fori", "rnn", start=1, back=1, declined="not once per time step",
         notes="fori_loop(1, T) reading x[:, t - 1]: the last step never read"),
    # -- a Python for loop (an unrolled chain): x read from a time-major copy, the [B, T] mask sliced as it is
    case("pyfor_rnn", "pyfor", "rnn"),
    case("pyfor_gru_split_index", "pyfor", "gru", split_index=True,
         notes="[p[:, 0] for p in jnp.split(x, T, 1)]: each piece's element 0, Gather(Transpose(piece, [1, 0, 2]), 0)"),
    case("pyfor_rnn_iterate", "pyfor", "rnn", iterate=True,
         notes="for x_t in x.swapaxes(0, 1): Slice(x, [t, 0, 0], [t + 1, Shape(h)[0], F]), h the step before's"),
    case("pyfor_gru_iterate_masked", "pyfor", "gru", iterate=True, mask=True),
    case("pyfor_gru_masked", "pyfor", "gru", mask=True,
         notes="h = where(mask[:, t:t+1], cell(h, x[:, t]), h): x Gathered from Transpose(x), the mask Sliced batch-first"),
    # -- a running sum carried beside the cell (acc + h), its mean returned: the op's Y summed over time
    case("hand_lstm_running_sum", "hand", "lstm", running_sum=True),
    case("hand_gru_running_sum_o17", "hand", "gru", running_sum=True, opset=17),
    # -- two sequences scanned side by side, (x, x2), the cell reading concatenate([x_t, x2_t]): one op over both
    case("hand_gru_two_seqs", "hand", "gru", second=2),
    # both directions stepped in one scan (jax2onnx refuses reverse=True): the Loop split, the halves merged
    case("hand_rnn_bidir_one_scan", "hand", "rnn_relu", bidir_scan=True),
    case("hand_rnn_bidir_one_scan_dyn_t_o17", "hand", "rnn_relu", bidir_scan=True, dynamic_time=True, opset=17),
    case("hand_lstm_two_seqs_dyn_t_o17", "hand", "lstm", second=1, dynamic_time=True, opset=17),
    # -- two cells a masked step, the upper reading the lower's kept h (where(m, new, h1)): two masked ops
    case("hand_rnn_stacked_masked_kept", "hand", "rnn_relu", mask=True, stacked_kept=True),
    # -- an activation bound by reference before export: jax's own elu, written with Where, Exp and Sub
    case("hand_rnn_elu_ref", "hand", "rnn_elu_ref"),
    # -- x[:, t] with a traced t (jax2onnx: a transpose of x in the body, the index's negative fix-up, Reshape)
    case("hand_gru_traced_read_arange", "hand", "gru", traced_read="arange"),
    case("hand_lstm_traced_read_counter_o17", "hand", "lstm", traced_read="counter", opset=17),
    # -- the batch size fixed in the export: the gates' slices gx[:, :H] name it (ends [B, H]), whole rows
    case("pyfor_gru_static_batch", "pyfor", "gru", static_batch=3,
         notes="the unrolled steps read Slice(x, [0, t, 0], [3, t + 1, 3]): every axis named"),
    case("fori_gru_static_batch1_o17", "fori", "gru", static_batch=1, opset=17),
    # -- a fori_loop filling a preallocated buffer: one ScatterND over a grid of indices built from t and shapes
    case("fori_rnn_buffer_at_tm", "fori", "rnn", buffer="at_tm", notes="ys = ys.at[t].set(h) on a [T, B, H] buffer"),
    case("fori_gru_buffer_at_bf", "fori", "gru", buffer="at_bf", notes="ys = ys.at[:, t].set(h) on a [B, T, H] buffer"),
    case("fori_gru_buffer_dus_o17", "fori", "gru", buffer="dus", opset=17,
         notes="ys = lax.dynamic_update_slice(ys, h[:, None], (0, t, 0)) on a [B, T, H] buffer"),
    case("fori_rnn_buffer_static_batch", "fori", "rnn", buffer="at_bf", static_batch=3),
    case("near_fori_buffer_next_slot", "fori", "rnn", buffer="next", declined="iteration's slot",
         notes="ys.at[:, (t + 1) % T].set(h): every slot written, each one step late"),
    # -- a fori_loop walking time backwards: x[:, T - 1 - t] (jax2onnx wraps the index: Where(v < 0, v + T, v)),
    # the states written at slot t (processing order) or T - 1 - t (time order, a backward layer's)
    case("fori_rnn_read_reverse", "fori", "rnn", reverse_read=1, notes="x[:, T - 1 - t], the last state"),
    case("fori_gru_reverse_buffer_rev", "fori", "gru", reverse_read=1, buffer="at_bf_rev",
         notes="x[:, T - 1 - t] read, ys.at[:, T - 1 - t].set(h): a backward GRU's Y"),
    case("fori_rnn_reverse_buffer_fwd", "fori", "rnn", reverse_read=1, buffer="at_tm",
         notes="x[:, T - 1 - t] read, ys.at[t].set(h): the states in processing order"),
    case("fori_gru_buffer_rev", "fori", "gru", buffer="at_tm_rev",
         notes="x[:, t] read, ys.at[T - 1 - t].set(h): a forward GRU's states stacked last first"),
    case("fori_gru_slice_read", "fori", "gru", slice_read="batch_first",
         notes="lax.dynamic_slice_in_dim(x, t, 1, axis=1) then its element 0: a kept one-step Slice, a Gather"),
    case("fori_gru_slice_read_tm", "fori", "gru", slice_read="time_major",
         notes="the same over x transposed to [T, B, F] before the loop"),
    case("near_fori_read_rev_off_by_one", "fori", "rnn", reverse_read=2, declined="no per-step input",
         notes="x[:, T - 2 - t]: T - 2 down to 0, then T - 1 (the wrap of -1): no order of time"),
    case("near_fori_buffer_rev_off_by_one", "fori", "rnn", buffer="rev_next", declined="iteration's slot",
         notes="ys.at[:, (T - 2 - t) % T].set(h): every slot written, none at T - 1 - t"),
    case("hand_lstm_concat_carry", "hand", "lstm_concat_carry", dynamic_time=True,
         notes="a lax.scan carrying concatenate([h, c]), cut with hc[:, :H], hc[:, H:]: carried piece by piece"),
    case("hand_lstm_dense_before", "hand", "lstm", dense_before=True,
         notes="x @ Wd + bd over the sequence, then a scan whose step multiplies x_t by its own Wx"),
    # -- the input projection hoisted out of the scan (x @ W + b, an Einsum to jax2onnx), the step adding h @ U
    case("hand_lstm_hoisted_proj", "hand", "lstm", hoisted="matmul"),
    case("hand_lstm_hoisted_proj_einsum_dyn_t_o17", "hand", "lstm", hoisted="einsum", dynamic_time=True, opset=17),
    # -- a step counter carried beside the cell, (h, t + 1), its final value used: start plus the steps
    case("hand_lstm_counter", "hand", "lstm", counter=True, notes="returns ys and h_last * t_final (a mean by hand)"),
    case("hand_rnn_counter_dyn_t_o17", "hand", "rnn_relu", counter=True, dynamic_time=True, opset=17),
    # -- near misses
    case("near_hand_weight_decays", "hand", "rnn_decay", declined="not a constant"),
    case("near_hand_reads_next_step", "hand", "rnn_next", declined="per-step input"),
    # -- cell variants (issue 15): a GRU with the update gate the other way round, flax's minimal gated unit
    case("hand_gru_flipped_update", "hand", "gru_flipped", notes=(
        "h = (1-z)*h + z*n: the native GRU with z's weights and biases negated (1 - sigmoid(a) = sigmoid(-a))")),
    rnn("linen_mgu", "mgu", notes="flax.linen MGUCell: one gate f as reset (f * (h @ U_n + b)) and update ((1-f)*n + f*h)"),
    # -- issue 14 item 4 for Loops: the step's per-step output is a head on the new h (and x_t), not h
    case("hand_lstm_head", "hand", "lstm_head", notes="step returns dense(h) = h @ Wd + bd per step"),
    case("hand_gru_head_relu_o17", "hand", "gru_head", opset=17, notes="step returns relu(h @ Wd + bd)"),
    case("hand_rnn_head_x", "hand", "rnn_head_x", notes="step returns (h, tanh(h @ V + x_t @ U)): a head on h and x_t"),
    case("hand_rnn_big_head", "hand", "rnn_big_head", notes=(
        "the step returns a head of 2,080 elementwise ops on h and x_t: validated at its probe points, not whole")),
    case("nnx_gru_scan_head", "nnx_scan", "gru", head=True, notes="nnx.GRUCell under lax.scan, nnx.Linear on h"),
    case("hand_rnn_lstm_side", "hand", "rnn_lstm_side",
         notes="two cells side by side under one lax.scan, the step returns concatenate([h1, h2]): two ops"),
    case("nnx_lstm_scan_head_dyn_t", "nnx_scan", "lstm", head=True, dynamic_time=True),
    # -- a head on masked steps: where(m, dense(h_new), 0) as the step's y, or dense() of the kept h
    case("hand_lstm_head_masked", "hand", "lstm_head", mask=True,
         notes="the masked step returns where(m, dense(h), 0): the head applied to Y, zeros at masked steps"),
    case("hand_gru_head_relu_masked_o17", "hand", "gru_head", mask=True, opset=17,
         notes="where(m, relu(dense(h)), 0) under a GRU's mask"),
    case("hand_lstm_head_times_mask", "hand", "lstm_head", mask=True, y_mul=True,
         notes="the masked step returns m * dense(h), m the mask cast to float: zeros at masked steps"),
    case("hand_gru_head_relu_times_mask_o17", "hand", "gru_head", mask=True, y_mul=True, opset=17,
         notes="m * relu(dense(h)) under a GRU's mask"),
    case("near_hand_lstm_head_times_unmasked", "hand", "lstm_head", mask=True, y_mul=True, y_flip=True,
         declined="at masked steps only", notes="dense(h) * (1 - m): the head's value at the masked steps only"),
    case("hand_lstm_head_kept", "hand", "lstm_head", mask=True, head_kept=True,
         notes="the masked step returns dense(h_kept) (h_kept = where(m, h_new, h)): the head on the carried Y"),
    case("hand_gru_head_kept_o17", "hand", "gru_head", mask=True, head_kept=True, opset=17,
         notes="relu(dense(h_kept)): a pre-padded row's head reads h0 before its first step"),
    case("hand_rnn_lengths_head", "hand", "rnn_len", seq_lengths=True, edges=True, len_head=True,
         notes="h = where(t < lengths, cell, h); y = where(t < lengths, tanh(h_new @ V), 0): a made length mask"),
    case("near_hand_lstm_head_filled_one", "hand", "lstm_head", mask=True, y_fill=1.0, declined="holds 1 at masked steps",
         notes="where(m, dense(h), 1): ones at masked steps, no fill a native op's Y has"),
    case("near_hand_lstm_head_at_masked_steps", "hand", "lstm_head", mask=True, y_flip=True, declined="at masked steps only",
         notes="where(m, 0, dense(h)): the head's value at the masked steps only"),
    case("hand_rnn_head_prev_h", "hand", "rnn_head_prev",
         notes="the step returns dense(h) of the carry *before* the update: the head on Y one step later, h0 first"),
    case("hand_residual_lstm", "hand", "residual_lstm", notes=(
        "GNMT's residual stack in one scan: h1 = tanh cell of x_t; the LSTM above reads h1 + (x_t @ P + bp)")),
    case("hand_residual_rnn_out_dyn_t", "hand", "residual_rnn_out", dynamic_time=True,
         notes="the same with a tanh cell above, the step returning h2 + h1"),
    case("hand_residual_mapped", "hand", "residual_mapped", notes=(
        "m_t = tanh(x_t @ M + bm) in the step, h1 = tanh cell of m_t, a tanh cell above reads h1 + m_t: the upper op "
        "reads the lower one's Y beside the map over x")),
    case("near_hand_residual_product", "hand", "residual_product", declined="left operand is not a step input or state",
         notes="the upper cell reads h1 * (x_t @ P + bp): no native op multiplies its input by another's output"),
    case("near_hand_residual_preactivation", "hand", "residual_c", declined="left operand is not a step input or state",
         notes="the upper cell reads the lower one's pre-activation plus proj(x_t), not its output"),
    case("hand_gnmt3", "hand", "gnmt3", notes=(
        "GNMT's deeper stack in one scan: two tanh cells, an LSTM above reading h2 + h1 (the outputs of both cells "
        "below: its op reads cat(Y2, Y1)); the step returns h3 + h2 + h1")),
    # -- stacks masked the flax way, every carried value kept by one where (jax.tree_util.tree_map): the upper
    # cell reads the lower one's *new* h, and jax2onnx broadcasts the mask to the shape of the step's output,
    # a value of the top cell (known to the analysis only once the cells below are)
    case("hand_stack2_masked", "hand", "stack2", mask=True,
         notes="two tanh cells, the upper reading the lower's unmasked new h1; the step returns h2"),
    case("hand_residual_lstm_masked", "hand", "residual_lstm", mask=True,
         notes="the residual stack masked: the upper op reads cat(Y1, x) under the same mask"),
    case("hand_gnmt3_top_masked", "hand", "gnmt3", mask=True, top=True,
         notes="GNMT's c3(h2 + h1) masked, the step returning h3"),
    case("near_hand_gnmt3_product", "hand", "gnmt3_product", declined="left operand is not a step input or state",
         notes="the LSTM reads h2 * h1: no native op multiplies the outputs of two cells"),
    case("hand_rnn_char_head", "hand", "rnn_char", notes=(
        "the char-RNN step: comb = concatenate([x_t, h]); returns (tanh(comb @ W + b), log_softmax(comb @ V))")),
    case("near_hand_head_feedback", "hand", "rnn_head_feedback", declined="left operand is not a step input or state",
         notes="the head's output feeds back into the state: h = tanh(x W + h R + b) + 0.5 * tanh(dense(h_prev))"),
    case("near_hand_lstm_head_c", "hand", "lstm_head_c", declined="new s",
         notes="the step returns dense(c): the per-step cell state, which no native output holds"),
    # -- issue 14 item 8 for Loops: a length mask written by hand, m = t < lengths, states kept past the length
    case("fori_gru_lengths", "fori", "gru", seq_lengths=True, edges=True, notes="fori_loop: h = where(t < lengths, cell(x_t, h), h)"),
    case("hand_rnn_scan_lengths_prepadded_dyn_t", "hand", "rnn_len", seq_lengths=True, edges=True, prepadded=True,
         dynamic_time=True, notes="t >= T - lengths with T = x.shape[1] read in the step and t counted in the carry"),
    case("hand_rnn_scan_lengths", "hand", "rnn_len", seq_lengths=True, edges=True,
         notes="lax.scan over (x_t, t): h = m*cell + (1-m)*h with m = t < lengths, outputs m * h"),
    # -- issue 14 item 9: Equinox cells (per example: W @ x + U @ h) batched with jax.vmap around lax.scan; the
    #    matmuls are written Transpose(Gemm(W, Transpose(h))): the batch axis moves out of the way and back
    case("eqx_lstm_vmap", "eqx", "lstm", notes="jax.vmap over lax.scan of eqx.nn.LSTMCell; returns ys and the final (h, c)"),
    case("eqx_gru_vmap_o17", "eqx", "gru", opset=17),
    case("eqx_gru_vmap_dyn_t", "eqx", "gru", dynamic_time=True),
    case("eqx_gru_vmap_head", "eqx", "gru", head=True, notes="the step returns relu(eqx.nn.Linear(h)): a head on h"),
    # -- x_t mapped row by row inside the step before the cell: the native op reads the map of the whole sequence
    case("hand_gru_input_mlp", "hand", "gru", prep="mlp", notes="the step's cell reads relu(x_t @ Wi + bi)"),
    case("hand_lstm_input_affine_o17", "hand", "lstm", prep="affine", opset=17, notes="tanh(x_t * s + t) per feature"),
    case("hand_rnn_context_concat", "hand", "rnn_relu", prep="context",
         notes="concat([x_t, z]) @ P, z [B, 2] a graph input the loop carries unchanged"),
    case("hand_gru_input_mlp_masked", "hand", "gru", prep="mlp", mask=True),
    case("hand_lstm_input_layernorm", "hand", "lstm", prep="layernorm",
         notes="LayerNorm written out in the step (jax2onnx broadcasts each row's statistics with Reshape/Expand)"),
    case("hand_gru_embed", "hand", "gru", prep="embed", notes="scan over token ids: the step looks up E[t_t]"),
    case("hand_lstm_embed_token_mask_o17", "hand", "lstm", prep="embed", mask=True, opset=17,
         notes="the step's mask is t_t != 0 (id 0 pads), computed in the body from the same ids"),
    case("hand_lstm_input_mlp_xmask", "hand", "lstm", prep="mlp", mask=True, xmask=True,
         notes="the mask jnp.any(x_t != 0) and the input map both read x_t"),
    case("near_hand_gru_batch_centred", "hand", "gru", prep="batch_centred", declined="unsupported op ReduceSum",
         notes="x_t minus the batch's mean: the map mixes the rows"),
    case("near_hand_rnn_state_gated_input", "hand", "rnn_relu", prep="state_gated", declined="unsupported op ReduceSum",
         notes="x_t * sigmoid(sum(h)): the input depends on the state"),
    # -- the per-step c read at one step per row (flax's carry at seq_lengths - 1): a twin op's Y_c
    case("hand_lstm_c_at_steps", "hand", "lstm", seq_lengths=True, pick="rows",
         notes="returns (hs, cs[lengths - 1, arange(B)]) of a hand-written LSTM step under lax.scan"),
    case("near_hand_lstm_c_rows_flipped", "hand", "lstm", seq_lengths=True, pick="flipped", declined="not the cell output",
         notes="cs[lengths - 1, B - 1 - arange(B)]: each row reads another row's c"),
]


# --------------------------------------------------------------------------- model builders


class Env:
    """The imported frameworks (imported once, in main)."""

    def __init__(self):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_platforms", "cpu")
        import jax.numpy as jnp
        import onnx
        from flax import linen as nn
        from flax import nnx
        from flax.nnx import bridge
        from jax2onnx import to_onnx

        try:  # flax builds its carries from inputs.shape, which jax2onnx patches for its own tracing
            from jax2onnx.plugins.flax.test_utils import _use_original_jnp_shape as original_shape
        except Exception:  # pragma: no cover - other jax2onnx releases
            original_shape = contextlib.nullcontext
        self.jax, self.jnp, self.onnx, self.nn, self.nnx, self.bridge = jax, jnp, onnx, nn, nnx, bridge
        self.to_onnx, self.original_shape = to_onnx, original_shape


def linen_cell(env: Env, kind: str, seed: int):
    nn = env.nn
    init = dict(bias_init=nn.initializers.normal(0.5))
    if kind == "lstm":
        return nn.LSTMCell(features=HIDDEN, **init)
    if kind == "olstm":
        return nn.OptimizedLSTMCell(features=HIDDEN, **init)
    if kind == "gru":
        return nn.GRUCell(features=HIDDEN, **init)
    if kind == "simple":
        return nn.SimpleCell(features=HIDDEN, **init)
    if kind == "simple_relu":
        return nn.SimpleCell(features=HIDDEN, activation_fn=nn.relu, **init)
    if kind == "mgu":  # (its biases have their own initialisers)
        return nn.MGUCell(features=HIDDEN, forget_bias_init=nn.initializers.normal(0.5),
                          activation_bias_init=nn.initializers.normal(0.5))
    raise ValueError(kind)


def zero_carry(env: Env, kind: str, batch):
    z = env.jnp.zeros((batch, HIDDEN), env.jnp.float32)
    return (z, z) if kind in ("lstm", "olstm") else z


def build_rnn(env: Env, c: Case, seed: int):
    """flax.linen nn.RNN / nn.Bidirectional wrapped with ToNNX; returns (fn, input specs)."""
    nn, jnp, jax = env.nn, env.jnp, env.jax
    key = jax.random.PRNGKey(seed)
    o = c.opts
    if c.model == "bidir":
        module = nn.Bidirectional(nn.RNN(linen_cell(env, c.cell, seed)), nn.RNN(linen_cell(env, c.cell, seed)))
    else:
        module = nn.RNN(linen_cell(env, c.cell, seed), return_carry=o.get("return_carry", False),
                        reverse=o.get("reverse", False), keep_order=o.get("reverse", False))
    model = env.bridge.ToNNX(module, rngs=env.nnx.Rngs(seed))

    def carry(batch):
        one = zero_carry(env, c.cell, batch)
        return (one, one) if c.model == "bidir" else one

    example = jnp.zeros((2, TIME, FEATURES), jnp.float32)
    model.lazy_init(example, initial_carry=carry(2), rngs=key)
    specs = [("x", ("B", "T" if c.dynamic_time else TIME, FEATURES), "float32")]
    if o.get("given_carry"):
        specs += [("c0", ("B", HIDDEN), "float32"), ("h0", ("B", HIDDEN), "float32")]

        def fn(x, c0, h0):
            with env.original_shape():
                return model(x, initial_carry=(c0, h0), rngs=key)

        return fn, specs
    if o.get("carry_from") == "dense":
        specs += [("z", ("B", HIDDEN), "float32")]
        Wz = np.asarray(np.random.default_rng(seed).standard_normal((HIDDEN, HIDDEN)) * 0.5, np.float32)

        def fn(x, z):
            c0 = z @ Wz
            h0 = jnp.tanh(c0)
            with env.original_shape():
                return model(x, initial_carry=(c0, h0) if c.cell in ("lstm", "olstm") else h0, rngs=key)

        return fn, specs
    if o.get("seq_lengths"):
        specs = [("x", (3, TIME, FEATURES), "float32"), ("lengths", (3,), "int32")]

        def fn(x, lengths):
            with env.original_shape():
                return model(x, initial_carry=carry(x.shape[0]), seq_lengths=lengths, rngs=key)

        return fn, specs

    def fn(x):
        with env.original_shape():
            return model(x, initial_carry=carry(x.shape[0]), rngs=key)

    return fn, specs


def build_nnx_scan(env: Env, c: Case, seed: int):
    nnx, jnp, jax = env.nnx, env.jnp, env.jax
    rngs = nnx.Rngs(seed)
    cls = {"lstm": nnx.LSTMCell, "gru": nnx.GRUCell, "simple": nnx.SimpleCell}[c.cell]
    cell = cls(FEATURES, HIDDEN, rngs=rngs, bias_init=nnx.initializers.normal(0.5))
    graphdef, state = nnx.split(cell)
    head = nnx.Linear(HIDDEN, 3, rngs=rngs, bias_init=nnx.initializers.normal(0.5)) if c.opts.get("head") else None

    def fn(x):
        with env.original_shape():
            carry0 = zero_carry(env, c.cell, x.shape[0])

        def step(carry, xt):
            carry, h = nnx.merge(graphdef, state)(carry, xt)
            return carry, (head(h) if head is not None else h)

        _, ys = jax.lax.scan(step, carry0, jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(ys, 0, 1)

    return fn, [("x", ("B", "T" if c.dynamic_time else TIME, FEATURES), "float32")]


def _weights(rng, *shapes):
    return [np.asarray(rng.standard_normal(s) * 0.5, np.float32) for s in shapes]


def build_hand(env: Env, c: Case, seed: int):
    """A step written by hand with jax.numpy on closed-over weights, scanned with lax.scan."""
    jnp, jax = env.jnp, env.jax
    rng = np.random.default_rng(seed)
    sig, tanh = jax.nn.sigmoid, jnp.tanh
    H, F = HIDDEN, FEATURES + c.opts.get("second", 0)  # (a second sequence read beside x: the cell reads both)
    kind = c.cell
    if kind == "lstm":
        Wx, Wh, b = _weights(rng, (F, 4 * H), (H, 4 * H), (4 * H,))

        def cell(carry, xt):
            c_, h = carry
            i, f, g, o = jnp.split(xt @ Wx + h @ Wh + b, 4, axis=-1)
            c_ = sig(f) * c_ + sig(i) * tanh(g)
            h = sig(o) * tanh(c_)
            return (c_, h), h
    elif kind == "lstm_concat_carry":  # the carry one tensor [h | c], cut apart and joined again every step
        Wx, Wh, b = _weights(rng, (F, 4 * H), (H, 4 * H), (4 * H,))

        def cell(hc, xt):
            h, c_ = hc[:, :H], hc[:, H:]
            i, f, g, o = jnp.split(xt @ Wx + h @ Wh + b, 4, axis=-1)
            c_ = sig(f) * c_ + sig(i) * tanh(g)
            h = sig(o) * tanh(c_)
            return jnp.concatenate([h, c_], -1), h
    elif kind in ("gru", "gru_flipped"):  # linear_before_reset=0: r gates h before the matmul
        W, Wc, bz, bc = _weights(rng, (F + H, 2 * H), (F + H, H), (2 * H,), (H,))

        def cell(h, xt):
            z, r = jnp.split(sig(jnp.concatenate([xt, h], -1) @ W + bz), 2, axis=-1)
            n = tanh(jnp.concatenate([xt, r * h], -1) @ Wc + bc)
            h = (1 - z) * h + z * n if kind == "gru_flipped" else (1 - z) * n + z * h
            return h, h
    elif kind == "rnn_elu_ref":  # an activation bound before export (flax's activation_fn=nn.elu): jax's own
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))  # where(x > 0, x, expm1(where(x > 0, 0, x))), no Elu op
        act = jax.nn.elu

        def cell(h, xt):
            h = act(xt @ Wx + h @ Wh + b)
            return h, h
    elif kind == "rnn_relu":
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))

        def cell(h, xt):
            h = jax.nn.relu(xt @ Wx + h @ Wh + b)
            return h, h
    elif kind in ("lstm_head", "lstm_head_c"):
        Wx, Wh, b, Wd, bd = _weights(rng, (F, 4 * H), (H, 4 * H), (4 * H,), (H, 2), (2,))

        def cell(carry, xt):
            c_, h = carry
            i, f, g, o = jnp.split(xt @ Wx + h @ Wh + b, 4, axis=-1)
            c_ = sig(f) * c_ + sig(i) * tanh(g)
            h = sig(o) * tanh(c_)
            return (c_, h), (c_ if kind == "lstm_head_c" else h) @ Wd + bd

        def head_of(carry):  # (the head on a carry: a masked step's kept h, see head_kept)
            return carry[1] @ Wd + bd
    elif kind == "gru_head":  # torch's GRU formula (linear_before_reset), a relu head
        Wx, Wh, bx, bh, Wd, bd = _weights(rng, (F, 3 * H), (H, 3 * H), (3 * H,), (3 * H,), (H, 5), (5,))

        def cell(h, xt):
            gx, gh = xt @ Wx + bx, h @ Wh + bh
            r = sig(gx[:, :H] + gh[:, :H])
            z = sig(gx[:, H:2 * H] + gh[:, H:2 * H])
            n = tanh(gx[:, 2 * H:] + r * gh[:, 2 * H:])
            h = (1 - z) * n + z * h
            return h, jax.nn.relu(h @ Wd + bd)

        def head_of(carry):
            return jax.nn.relu(carry @ Wd + bd)
    elif kind == "rnn_lstm_side":  # an Elman cell and an LSTM side by side on x_t, the step returns both h
        Wx, Wh, b, Lx, Lh, lb = _weights(rng, (F, H), (H, H), (H,), (F, 4 * H), (H, 4 * H), (4 * H,))

        def cell(carry, xt):
            h1, c2, h2 = carry
            h1 = tanh(xt @ Wx + h1 @ Wh + b)
            i, f, g, o = jnp.split(xt @ Lx + h2 @ Lh + lb, 4, axis=-1)
            c2 = sig(f) * c2 + sig(i) * tanh(g)
            h2 = sig(o) * tanh(c2)
            return (h1, c2, h2), jnp.concatenate([h1, h2], -1)
    elif kind == "rnn_big_head":  # a head past rnnfuse.step_heads.PROBED_ABOVE, reading x_t deep inside it
        Wx, Wh, b, U = _weights(rng, (F, H), (H, H), (H,), (F, H))

        def cell(h, xt):
            new = tanh(xt @ Wx + h @ Wh + b)
            y = new
            for k in range(520):  # 4 ops each
                y = sig(tanh(y * 0.5 + (xt @ U if k == 260 else 0.25)))
            return new, y
    elif kind in ("residual_lstm", "residual_rnn_out", "residual_product", "residual_c"):
        # GNMT's residual stack: the upper cell reads h1 + proj(x_t) (near misses: h1 * proj(x_t), c1 + proj(x_t))
        Wx, Wh, b, P, bp = _weights(rng, (F, H), (H, H), (H,), (F, H), (H,))
        Ux, Uh, ub = _weights(rng, (H, 4 * H if kind == "residual_lstm" else H), (H, 4 * H if kind == "residual_lstm" else H),
                              (4 * H if kind == "residual_lstm" else H,))

        def cell(carry, xt):
            h1, c2, h2 = carry
            pre = xt @ Wx + h1 @ Wh + b
            h1 = tanh(pre)
            u = h1 * (xt @ P + bp) if kind == "residual_product" else (pre if kind == "residual_c" else h1) + (xt @ P + bp)
            if kind == "residual_lstm":
                i, f, g, o = jnp.split(u @ Ux + h2 @ Uh + ub, 4, axis=-1)
                c2 = sig(f) * c2 + sig(i) * tanh(g)
                h2 = sig(o) * tanh(c2)
                return (h1, c2, h2), h2
            h2 = tanh(u @ Ux + h2 @ Uh + ub)
            return (h1, c2, h2), h2 + h1
    elif kind == "stack2":  # two tanh cells, the upper reading the lower's new h
        Wx, Wh, b, Vx, Vh, vb = _weights(rng, (F, H), (H, H), (H,), (H, H), (H, H), (H,))

        def cell(carry, xt):
            h1, h2 = carry
            h1 = tanh(xt @ Wx + h1 @ Wh + b)
            h2 = tanh(h1 @ Vx + h2 @ Vh + vb)
            return (h1, h2), h2
    elif kind in ("gnmt3", "gnmt3_product"):  # GNMT: c3(h2 + h1) (near miss: c3(h2 * h1))
        Wx, Wh, b, Vx, Vh, vb, Lx, Lh, lb = _weights(rng, (F, H), (H, H), (H,), (H, H), (H, H), (H,), (H, 4 * H),
                                                     (H, 4 * H), (4 * H,))

        def cell(carry, xt):
            h1, h2, c3, h3 = carry
            h1 = tanh(xt @ Wx + h1 @ Wh + b)
            h2 = tanh(h1 @ Vx + h2 @ Vh + vb)
            u = h2 * h1 if kind == "gnmt3_product" else h2 + h1
            i, f, g, o = jnp.split(u @ Lx + h3 @ Lh + lb, 4, axis=-1)
            c3 = sig(f) * c3 + sig(i) * tanh(g)
            h3 = sig(o) * tanh(c3)
            return (h1, h2, c3, h3), h3 if c.opts.get("top") else h3 + h2 + h1
    elif kind == "residual_mapped":
        M, bm, Wx, Wh, b, Ux, Uh, ub = _weights(rng, (F, H), (H,), (H, H), (H, H), (H,), (H, H), (H, H), (H,))

        def cell(carry, xt):
            h1, c2, h2 = carry
            m = tanh(xt @ M + bm)
            h1 = tanh(m @ Wx + h1 @ Wh + b)
            h2 = tanh((h1 + m) @ Ux + h2 @ Uh + ub)
            return (h1, c2, h2), h2
    elif kind == "rnn_char":
        W, b, V = _weights(rng, (F + H, H), (H,), (F + H, 2))

        def cell(h, xt):
            comb = jnp.concatenate([xt, h], -1)
            return tanh(comb @ W + b), jax.nn.log_softmax(comb @ V, -1)
    elif kind in ("rnn_head_x", "rnn_head_prev", "rnn_head_feedback"):
        Wx, Wh, b, V, U, P = _weights(rng, (F, H), (H, H), (H,), (H, 2), (F, 2), (2, H))

        def cell(h, xt):
            new = tanh(xt @ Wx + h @ Wh + b)
            if kind == "rnn_head_x":
                return new, (new, tanh(new @ V + xt @ U))
            if kind == "rnn_head_prev":
                return new, h @ V
            return new + 0.5 * tanh(tanh(h @ V) @ P), new @ V
    elif kind == "gru_einsum":  # Keras' reset_after GRU (gates z, r, h) with jnp.einsum for the matmuls
        Gx, Gh, gbx, gbh = _weights(rng, (F, 3 * H), (H, 3 * H), (3 * H,), (3 * H,))

        def cell(h, xt):
            gx = jnp.einsum("bf,fk->bk", xt, Gx) + gbx
            gh = jnp.einsum("bj,jk->bk", h, Gh) + gbh
            z = sig(gx[:, :H] + gh[:, :H])
            r = sig(gx[:, H:2 * H] + gh[:, H:2 * H])
            n = tanh(gx[:, 2 * H:] + r * gh[:, 2 * H:])
            h = z * h + (1 - z) * n
            return h, h
    elif kind == "rnn_einsum_t":  # weights stored [out, in] (torch's layout), einsum operands either way round
        WxT, WhT, b = _weights(rng, (H, F), (H, H), (H,))

        def cell(h, xt):
            h = tanh(jnp.einsum("bf,hf->bh", xt, WxT) + jnp.einsum("hk,bk->bh", WhT, h) + b)
            return h, h
    elif kind == "rnn_len":
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))

        def cell(h, xt):
            h = tanh(xt @ Wx + h @ Wh + b)
            return h, h
    elif kind == "rnn_decay":  # near miss: the "weight" is carried and changes every step
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))

        def cell(carry, xt):
            h, w = carry
            h = tanh(xt @ Wx + h @ w + b)
            return (h, w * 0.9), h
    elif kind == "rnn_next":  # near miss: the step also reads the next step of x
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))
    else:
        raise ValueError(kind)
    lstm = kind in ("lstm", "lstm_head", "lstm_head_c")
    specs = [("x", ("B", "T" if c.dynamic_time else TIME, FEATURES), "float32")]
    prep = c.opts.get("prep")  # what the step does to x_t before its cell (a row-wise map, or a near miss)
    if prep:
        Wi, bi, scale, shift, P = _weights(rng, (F, F), (F,), (F,), (F,), (F + 2, F))
        if prep == "context":  # a context row per example (a latent) concatenated to every step's input
            specs.append(("z", ("B", 2), "float32"))
        base = cell

        def cell(carry, xt, z=None):
            if prep == "mlp":
                xt = jax.nn.relu(xt @ Wi + bi)
            elif prep == "affine":
                xt = tanh(xt * scale + shift)
            elif prep == "context":
                xt = jnp.concatenate([xt, z], -1) @ P
            elif prep == "layernorm":  # written out: mean and variance over the features
                mu = xt.mean(-1, keepdims=True)
                xt = (xt - mu) / jnp.sqrt(((xt - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + shift
            elif prep == "batch_centred":  # near miss: every row minus the batch's mean mixes the rows
                xt = xt - xt.mean(0, keepdims=True)
            elif prep == "state_gated":  # near miss: the input scaled by the state is no map of x_t
                xt = xt * sig(jnp.sum(carry[1] if lstm else carry, -1, keepdims=True))
            return base(carry, xt)

    if kind == "rnn_next":
        def fn(x):
            xs = jnp.swapaxes(x, 0, 1)
            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)

            def step(h, t):
                nxt = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t + 1, TIME - 1), 0, keepdims=False)
                h = tanh((xs[t] + nxt) @ Wx + h @ Wh + b)
                return h, h

            _, ys = jax.lax.scan(step, h0, jnp.arange(TIME))
            return jnp.swapaxes(ys, 0, 1)

        return fn, specs

    def init(batch):
        with env.original_shape():
            z = jnp.zeros((batch, H), jnp.float32)
        if lstm:
            return (z, z)
        if kind in ("rnn_lstm_side", "residual_lstm", "residual_rnn_out", "residual_product", "residual_c",
                    "residual_mapped"):
            return (z, z, z)
        if kind in ("gnmt3", "gnmt3_product"):
            return (z, z, z, z)
        if kind == "stack2":
            return (z, z)
        if kind == "rnn_decay":
            return (z, jnp.asarray(Wh))
        if kind == "lstm_concat_carry":
            return jnp.concatenate([z, z], -1)
        return z

    if prep == "embed":  # the step looks its token up: E[tokens[:, t]] (id 0 pads when masked)
        table = _weights(rng, (VOCAB, F))[0]
        specs = [("tokens", ("B", TIME), "int32")]

        def fn(tokens):
            def step(carry, tt):
                new, y = cell(carry, jnp.asarray(table)[tt])
                if c.masked:
                    keep = (tt != 0)[:, None]
                    new = jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), new, carry)
                    y = jnp.where(keep, y, 0.0)
                return new, y

            _, ys = jax.lax.scan(step, init(tokens.shape[0]), jnp.swapaxes(tokens, 0, 1))
            return jnp.swapaxes(ys, 0, 1)

        return fn, specs

    if c.opts.get("stacked_kept"):  # two tanh cells a masked step, the upper reading the lower's kept h
        Wx2, Wh2, b2 = _weights(rng, (H, H), (H, H), (H,))
        specs.append(("mask", ("B", TIME), "bool"))

        def fn(x, mask):
            def step(carry, inp):
                xt, mt = inp
                keep = mt[:, None]
                h1 = jnp.where(keep, cell(carry[0], xt)[0], carry[0])
                h2 = jnp.where(keep, tanh(h1 @ Wx2 + carry[1] @ Wh2 + b2), carry[1])
                return (h1, h2), jnp.where(keep, h2, 0.0)

            with env.original_shape():
                z = jnp.zeros((x.shape[0], H), jnp.float32)
            _, ys = jax.lax.scan(step, (z, z), (jnp.swapaxes(x, 0, 1), jnp.swapaxes(mask, 0, 1)))
            return jnp.swapaxes(ys, 0, 1)

        return fn, specs

    if c.masked:
        xmask = c.opts.get("xmask")  # no mask input: the step decides from x_t (padding: every feature 0)
        fmask = c.opts.get("fmask")  # a mask input that is no bool: float32 or int32 0/1, compared in the step
        if not xmask:
            specs.append(("mask", ("B", TIME), {"float": "float32", "int": "int32"}.get(fmask, "bool")))

        def fn(x, mask=None):
            def step(carry, inp):
                xt, mt = (inp, jnp.any(inp != 0, axis=-1)) if xmask else inp
                if fmask:
                    mt = mt > 0 if fmask == "float" else mt != 0
                if c.opts.get("mask_input"):  # the input zeroed at masked steps too
                    xt = xt * mt[:, None].astype(xt.dtype)
                new, y = cell(carry, xt)
                keep = mt[:, None]
                new = jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), new, carry)
                if c.opts.get("head_kept"):  # the head on the kept h: at a masked step, on the h carried through
                    return new, head_of(new)
                if c.opts.get("y_mul"):  # y times the mask as numbers (near miss, y_flip: times 1 - mask)
                    m = keep.astype(y.dtype)
                    return new, y * (1.0 - m) if c.opts.get("y_flip") else m * y
                fill = c.opts.get("y_fill", 0.0)  # (near misses: y filled with another value, or kept at masked steps)
                return new, jnp.where(keep, fill, y) if c.opts.get("y_flip") else jnp.where(keep, y, fill)

            xs = jnp.swapaxes(x, 0, 1)
            _, ys = jax.lax.scan(step, init(x.shape[0]), xs if xmask else (xs, jnp.swapaxes(mask, 0, 1)))
            return jnp.swapaxes(ys, 0, 1)

        return fn, specs

    if kind == "rnn_len" and c.opts.get("prepadded"):  # valid steps last: t >= T - lengths, T read from x's shape
        specs = [("x", ("B", "T" if c.dynamic_time else TIME, F), "float32"), ("lengths", ("B",), "int32")]

        def fn(x, lengths):
            def step(carry, xt):
                h, t = carry
                valid = (t >= x.shape[1] - lengths)[:, None]
                new, _ = cell(h, xt)
                h = jnp.where(valid, new, h)
                return (h, t + 1), jnp.where(valid, h, 0.0)

            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)
            (last, _), ys = jax.lax.scan(step, (h0, jnp.int32(0)), jnp.swapaxes(x, 0, 1))
            return jnp.swapaxes(ys, 0, 1), last

        return fn, specs

    if kind == "rnn_len":  # a length mask by hand: scan over (x_t, t), m = t < lengths
        specs = [("x", ("B", TIME, F), "float32"), ("lengths", ("B",), "int32")]

        V = _weights(rng, (H, 3))[0]  # (drawn once: fn is traced for export and run for the reference)

        def fn(x, lengths):
            def step(h, inp):
                xt, t = inp
                new, _ = cell(h, xt)
                if c.opts.get("len_head"):  # a head on the new h, zeros past a row's length
                    valid = (t < lengths)[:, None]
                    return jnp.where(valid, new, h), jnp.where(valid, tanh(new @ V), 0.0)
                m = (t < lengths).astype(jnp.float32)[:, None]
                return m * new + (1 - m) * h, m * new

            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)
            last, ys = jax.lax.scan(step, h0, (jnp.swapaxes(x, 0, 1), jnp.arange(TIME, dtype=jnp.int32)))
            return jnp.swapaxes(ys, 0, 1), last

        return fn, specs

    if c.opts.get("pick"):  # the per-step (c, h) of every step, c picked at lengths - 1 per row
        specs = [("x", (3, TIME, F), "float32"), ("lengths", (3,), "int32")]
        rows = np.arange(3) if c.opts["pick"] == "rows" else np.arange(3)[::-1].copy()

        def fn(x, lengths):
            def step(carry, xt):
                carry, h = cell(carry, xt)
                return carry, carry

            _, (cs, hs) = jax.lax.scan(step, init(x.shape[0]), jnp.swapaxes(x, 0, 1))
            return jnp.swapaxes(hs, 0, 1), cs[lengths - 1, rows]

        return fn, specs

    if c.opts.get("running_sum"):  # (carry, acc): acc + y summed beside the cell, its mean returned
        def fn(x):
            def step(carry, xt):
                inner, y = cell(carry[0], xt)
                return (inner, carry[1] + y), y

            with env.original_shape():
                acc0 = jnp.zeros((x.shape[0], H), jnp.float32)
            (_, acc), ys = jax.lax.scan(step, (init(x.shape[0]), acc0), jnp.swapaxes(x, 0, 1))
            return jnp.swapaxes(ys, 0, 1), acc / TIME

        return fn, specs

    if c.opts.get("bidir_scan"):  # both directions in one scan over (x, x[::-1]), the backward ys flipped back
        Bx, Bh, bb = _weights(rng, (F, H), (H, H), (H,))

        def fn(x):
            def step(carry, inp):
                xt, xr = inp
                hf, _ = cell(carry[0], xt)
                hb = jax.nn.relu(xr @ Bx + carry[1] @ Bh + bb)
                return (hf, hb), (hf, hb)

            xs = jnp.swapaxes(x, 0, 1)
            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)
            _, (yf, yb) = jax.lax.scan(step, (h0, h0), (xs, xs[::-1]))
            return jnp.swapaxes(jnp.concatenate([yf, yb[::-1]], -1), 0, 1)

        return fn, specs

    if c.opts.get("second"):  # lax.scan over (x, x2): the cell reads concatenate([x_t, x2_t])
        specs.append(("x2", ("B", "T" if c.dynamic_time else TIME, c.opts["second"]), "float32"))

        def fn(x, x2):
            def step(carry, inp):
                return cell(carry, jnp.concatenate(inp, -1))

            last, ys = jax.lax.scan(step, init(x.shape[0]), (jnp.swapaxes(x, 0, 1), jnp.swapaxes(x2, 0, 1)))
            return jnp.swapaxes(ys, 0, 1), last[1] if lstm else last

        return fn, specs

    if c.opts.get("traced_read"):  # x[:, t] with a traced t: Gather(Transpose(x), Reshape(Where(t < 0, t + T, t)))
        def fn(x):
            x = jnp.asarray(x)  # (JAX's own run passes numpy, which a traced index cannot read)
            if c.opts["traced_read"] == "arange":  # lax.scan over arange(T)
                def step(carry, t):
                    return cell(carry, x[:, t])

                _, ys = jax.lax.scan(step, init(x.shape[0]), jnp.arange(TIME))
            else:  # lax.scan(length=T) with no xs, the step counted in the carry
                def step(carry, _):
                    inner, y = cell(carry[0], x[:, carry[1]])
                    return (inner, carry[1] + 1), y

                _, ys = jax.lax.scan(step, (init(x.shape[0]), jnp.int32(0)), None, length=TIME)
            return jnp.swapaxes(ys, 0, 1)

        return fn, specs

    if c.opts.get("hoisted") and kind == "lstm":  # the input projection computed before the scan, read per step
        def fn(x):
            xp = jnp.einsum("btf,fg->btg", x, Wx) + b if c.opts["hoisted"] == "einsum" else x @ Wx + b

            def step(carry, gt):
                c_, h = carry
                i, f, g, o = jnp.split(gt + h @ Wh, 4, axis=-1)
                c_ = sig(f) * c_ + sig(i) * tanh(g)
                h = sig(o) * tanh(c_)
                return (c_, h), h

            last, ys = jax.lax.scan(step, init(x.shape[0]), jnp.swapaxes(xp, 0, 1))
            return jnp.swapaxes(ys, 0, 1), last[1]

        return fn, specs

    if c.opts.get("counter"):  # (carry, t): t + 1 each step beside the cell, the final t used
        def fn(x):
            def step(carry, xt):
                inner, y = cell(carry[0], xt)
                return (inner, carry[1] + 1), y

            (last, t), ys = jax.lax.scan(step, (init(x.shape[0]), jnp.int32(0)), jnp.swapaxes(x, 0, 1))
            h = last[1] if lstm else last
            return jnp.swapaxes(ys, 0, 1), h * t.astype(jnp.float32)

        return fn, specs

    dense = _weights(rng, (F, F), (F,)) if c.opts.get("dense_before") else None

    def fn(x, z=None):
        if dense is not None:  # a Dense over the sequence (no activation) before the scan: the cell's x_t @ Wx again
            x = x @ dense[0] + dense[1]
        step = cell if z is None else (lambda carry, xt: cell(carry, xt, z))
        last, ys = jax.lax.scan(step, init(x.shape[0]), jnp.swapaxes(x, 0, 1))
        h = last[1] if lstm else last[0] if kind == "rnn_decay" else last
        ys = jax.tree_util.tree_map(lambda y: jnp.swapaxes(y, 0, 1), ys)
        return (*ys, h) if isinstance(ys, tuple) else (ys, h)

    return fn, specs


def _small_cell(env: Env, kind: str, rng):
    """``cell(h, x_t)`` on closed-over weights: a tanh RNN ("rnn") or torch's GRU formula (linear_before_reset)."""
    jnp, jax = env.jnp, env.jax
    H, F = HIDDEN, FEATURES
    sig, tanh = jax.nn.sigmoid, jnp.tanh
    if kind == "rnn":
        Wx, Wh, b = _weights(rng, (F, H), (H, H), (H,))
        return lambda h, xt: tanh(xt @ Wx + h @ Wh + b)
    Wx, Wh, bx, bh = _weights(rng, (F, 3 * H), (H, 3 * H), (3 * H,), (3 * H,))

    def cell(h, xt):
        gx, gh = xt @ Wx + bx, h @ Wh + bh
        r = sig(gx[:, :H] + gh[:, :H])
        z = sig(gx[:, H:2 * H] + gh[:, H:2 * H])
        n = tanh(gx[:, 2 * H:] + r * gh[:, 2 * H:])
        return (1 - z) * n + z * h

    return cell


def build_pyfor(env: Env, c: Case, seed: int):
    """A Python for loop over the steps reading x[:, t] (jax2onnx writes every step: an unrolled chain, x read
    from one time-major copy); masked: h kept where mask[:, t:t + 1], the [B, T] bool input sliced as it is.
    Returns the stacked states (batch-first) and the last one."""
    jnp = env.jnp
    cell = _small_cell(env, c.cell, np.random.default_rng(seed))

    def fn(x, *mask):
        with env.original_shape():
            h = jnp.zeros((x.shape[0], HIDDEN), jnp.float32)
        ys = []
        steps = [p[:, 0] for p in jnp.split(x, TIME, 1)] if c.opts.get("split_index") else None
        if c.opts.get("iterate"):  # for x_t in x.swapaxes(0, 1): each step's batch end is Shape(h)[0]
            steps = list(jnp.swapaxes(x, 0, 1))
        for t in range(TIME):
            new = cell(h, x[:, t] if steps is None else steps[t])
            h = jnp.where(mask[0][:, t:t + 1], new, h) if mask else new
            ys.append(h)
        return jnp.stack(ys, 1), h

    return fn, [("x", ("B", TIME, FEATURES), "float32")] + ([("mask", ("B", TIME), "bool")] if c.masked else [])


def build_fori(env: Env, c: Case, seed: int):
    """lax.fori_loop over t reading x[:, t] with dynamic_index_in_dim; returns the last state."""
    jnp, jax = env.jnp, env.jax
    H, F = HIDDEN, FEATURES
    cell = _small_cell(env, c.cell, np.random.default_rng(seed))

    if c.lengths:  # the state kept where t >= lengths[b]
        def fn(x, lengths):
            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)

            def body(t, carry):
                h, xs, lens = carry
                new = cell(h, jax.lax.dynamic_index_in_dim(xs, t, axis=1, keepdims=False))
                return jnp.where((t < lens)[:, None], new, h), xs, lens

            return jax.lax.fori_loop(0, TIME, body, (h0, x, lengths))[0]

        return fn, [("x", ("B", TIME, F), "float32"), ("lengths", ("B",), "int32")]

    def read(xs, t):  # x[:, t], or x[:, T - r - t] by plain indexing (which jax2onnx wraps for negative values)
        if c.opts.get("reverse_read"):
            return xs[:, TIME - c.opts["reverse_read"] - t]
        if c.opts.get("slice_read"):  # a one-step slice, then its one element ([T, B, F] xs: time-major)
            axis = 0 if c.opts["slice_read"] == "time_major" else 1
            return jnp.take(jax.lax.dynamic_slice_in_dim(xs, t, 1, axis=axis), 0, axis=axis)
        return jax.lax.dynamic_index_in_dim(xs, t, axis=1, keepdims=False)

    buffer = c.opts.get("buffer")
    if buffer:  # the states written into a preallocated buffer, returned with the last one
        def write(ys, t, h):
            if buffer == "at_tm":
                return ys.at[t].set(h)
            if buffer == "at_tm_rev":
                return ys.at[TIME - 1 - t].set(h)
            if buffer == "dus":
                return jax.lax.dynamic_update_slice(ys, h[:, None], (0, t, 0))
            slot = {"next": (t + 1) % TIME, "at_bf_rev": TIME - 1 - t, "rev_next": (TIME - 2 - t) % TIME}
            return ys.at[:, slot.get(buffer, t)].set(h)

        def fn(x):
            with env.original_shape():
                h0 = jnp.zeros((x.shape[0], H), jnp.float32)
                ys0 = jnp.zeros((TIME, x.shape[0], H) if buffer.startswith("at_tm") else (x.shape[0], TIME, H),
                                jnp.float32)

            def body(t, carry):
                h, ys, xs = carry
                h = cell(h, read(xs, t))
                return h, write(ys, t, h), xs

            h, ys, _ = jax.lax.fori_loop(0, TIME, body, (h0, ys0, x))
            return ys, h

        return fn, [("x", ("B", TIME, F), "float32")]

    def fn(x):
        with env.original_shape():
            h0 = jnp.zeros((x.shape[0], H), jnp.float32)

        def body(t, carry):  # jax2onnx's fori_loop cannot close over a traced x: it is carried
            h, xs = carry
            if c.opts.get("reverse_read") or c.opts.get("slice_read"):
                return cell(h, read(xs, t)), xs
            return cell(h, jax.lax.dynamic_index_in_dim(xs, t - back if back else t, axis=1, keepdims=False)), xs

        xs0 = jnp.swapaxes(x, 0, 1) if c.opts.get("slice_read") == "time_major" else x
        return jax.lax.fori_loop(start, TIME, body, (h0, xs0))[0]

    start, back = c.opts.get("start", 0), c.opts.get("back", 0)  # fori_loop(start, T) reading x[:, t - back]

    return fn, [("x", ("B", TIME, F), "float32")]


def build_eqx(env: Env, c: Case, seed: int):
    """``jax.vmap`` of a ``lax.scan`` over an Equinox cell (which computes one example at a time)."""
    import equinox as eqx

    jnp, jax = env.jnp, env.jax
    key = jax.random.PRNGKey(seed)
    lstm = c.cell == "lstm"
    key, head_key = jax.random.split(key)
    cell = (eqx.nn.LSTMCell if lstm else eqx.nn.GRUCell)(FEATURES, HIDDEN, key=key)
    head = eqx.nn.Linear(HIDDEN, 2, key=head_key) if c.opts.get("head") else None

    def one(x):  # [T, F] -> ([T, H], final state)
        h0 = jnp.zeros((HIDDEN,), jnp.float32)

        def step(carry, xt):
            carry = cell(xt, carry)
            h = carry[0] if lstm else carry
            return carry, jax.nn.relu(head(h)) if head is not None else h

        last, ys = jax.lax.scan(step, (h0, h0) if lstm else h0, x)
        return (ys, *last) if lstm else (ys, last)

    return jax.vmap(one), [("x", ("B", "T" if c.dynamic_time else TIME, FEATURES), "float32")]


BUILDERS = {"rnn": build_rnn, "eqx": build_eqx, "bidir": build_rnn, "nnx_scan": build_nnx_scan, "hand": build_hand, "fori": build_fori,
            "pyfor": build_pyfor}


# --------------------------------------------------------------------------- inputs, export, files


def input_sets(c: Case, specs, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    sets = {}
    for set_name in c.sets:
        if c.masked:
            keep = np.array([[ch == "1" for ch in row] for row in MASK_PATTERNS[set_name]])
            batch, steps = keep.shape
        elif c.lengths:
            lengths = np.array({**LENGTH_SETS, **EDGE_LENGTHS}[set_name], np.int32)
            batch, steps = len(lengths), TIME
        else:
            batch = int(set_name[1:].split("_")[0])
            steps = int(set_name.split("_t")[1]) if "_t" in set_name else TIME
        feeds = {}
        for name, shape, dtype in specs:
            if name == "x":
                x = rng.standard_normal((batch, steps, FEATURES)).astype(np.float32)
                if c.masked:
                    x[~keep] = 0.0
                feeds[name] = x
            elif name == "mask":
                feeds[name] = keep.astype(dtype)
            elif name == "lengths":
                feeds[name] = lengths
            elif name == "x2":  # a second sequence beside x: as many steps
                feeds[name] = rng.standard_normal((batch, steps, shape[2])).astype(np.float32)
            elif name == "tokens":
                ids = rng.integers(1, VOCAB, (batch, steps)).astype(np.int32)
                if c.masked:
                    ids[~keep] = 0
                feeds[name] = ids
            else:
                feeds[name] = rng.standard_normal((batch,) + tuple(shape[1:])).astype(np.float32)
        sets[set_name] = feeds
    return sets


def graph_ops(graph) -> list[str]:
    ops = []
    for node in graph.node:
        ops.append(node.op_type)
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                ops.extend(graph_ops(sub))
    return ops


def expectation(c: Case) -> dict:
    if c.declined:
        return {"declined": c.declined}
    if c.cell == "rnn_lstm_side":  # two cells side by side: an op each
        return {"ops": {"RNN": 1, "LSTM": 1}, "absent": ["Loop", "Scan"]}
    if c.cell == "residual_lstm":  # a stack: the upper op reads the lower one's Y beside x
        return {"ops": {"RNN": 1, "LSTM": 1}, "absent": ["Loop", "Scan"]}
    if c.cell in ("residual_rnn_out", "residual_mapped"):
        return {"ops": {"RNN": 2}, "absent": ["Loop", "Scan"]}
    if c.cell == "gnmt3":
        return {"ops": {"RNN": 2, "LSTM": 1}, "absent": ["Loop", "Scan"]}
    if c.cell == "stack2":
        return {"ops": {"RNN": 2}, "absent": ["Loop", "Scan"]}
    op = ONNX_OP.get(c.cell) or {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN", "rnn_relu": "RNN", "lstm_head": "LSTM",
                                   "gru_head": "GRU", "rnn_head_x": "RNN", "rnn_elu_ref": "RNN", "rnn_len": "RNN", "gru_einsum": "GRU",
                                   "rnn_einsum_t": "RNN", "rnn_big_head": "RNN", "rnn_head_prev": "RNN",
                                   "rnn_char": "RNN"}[c.cell]
    if c.cell == "rnn_big_head":
        return {"ops": {op: 1}, "absent": ["Loop", "Scan"], "validated": "probe points"}
    if c.opts.get("stacked_kept"):  # (and a tanh cell above it)
        return {"ops": {"RNN": 2}, "absent": ["Loop", "Scan"]}
    # (bidir_scan: the Loop split; jax2onnx feeds xs as a Gather of x by 0 .. T-1 computed as a reversed
    # reversed iota, read through, so both halves read x and merge)
    if c.model == "bidir" and c.lengths:
        # (flax flips each row within its length and runs the backward cell on over the padding: a forward op
        # over the rows flipped, where ONNX's reverse direction with sequence_lens zero-fills past the length)
        return {"ops": {op: 2}, "directions": {op: ["forward", "forward"]}, "absent": ["Loop", "Scan"]}
    if c.model == "bidir" or c.opts.get("bidir_scan"):  # the flip outside the loops (Range/Sub/Gather) is seen: one bidirectional op
        return {"ops": {op: 1}, "directions": {op: ["bidirectional"]}, "absent": ["Loop", "Scan"]}
    # an LSTM's c read at one step per row (flax's carry at seq_lengths - 1) is a twin op's Y_c
    twin = op == "LSTM" and (c.opts.get("pick") == "rows" or (c.model == "rnn" and c.lengths))
    return {"ops": {op: 2 if twin else 1}, "absent": ["Loop", "Scan"]}


def generate(env: Env, c: Case, out_dir: Path) -> dict:
    for suffix in (".onnx", ".npz", ".json"):
        (out_dir / f"{c.name}{suffix}").unlink(missing_ok=True)
    seed = zlib.crc32(c.name.encode()) % (2**31)
    rng = np.random.default_rng(seed)
    fn, specs = BUILDERS[c.model](env, c, seed)
    if c.opts.get("static_batch"):  # the batch size fixed in the export: jax2onnx's slices then name it
        specs = [(n, tuple(c.opts["static_batch"] if d == "B" else d for d in shape), dt) for n, shape, dt in specs]
    jax = env.jax
    shapes = []
    for name, shape, dtype in specs:
        if dtype == "float32":
            shapes.append(shape)
        else:  # jax2onnx takes a ShapeDtypeStruct for other dtypes, with symbolic dims
            shapes.append(jax.ShapeDtypeStruct(shape, getattr(env.jnp, dtype)))
    model = env.to_onnx(fn, shapes, opset=c.opset, input_names=[n for n, _, _ in specs])
    env.onnx.checker.check_model(model)
    sets = input_sets(c, specs, rng)
    arrays = {}
    for s, feeds in sets.items():
        outs = jax.tree_util.tree_leaves(fn(*[feeds[n] for n, _, _ in specs]))
        if len(outs) != len(model.graph.output):
            raise RuntimeError(f"{len(outs)} JAX outputs, {len(model.graph.output)} graph outputs")
        for name, value in feeds.items():
            arrays[f"in/{s}/{name}"] = value
        for k, value in enumerate(outs):
            arrays[f"out/{s}/{k}"] = np.asarray(value)
    ops = graph_ops(model.graph)
    meta = {
        "name": c.name,
        "exporter": "jax2onnx",
        "model": c.model,
        "cell": c.cell,
        "opts": c.opts,
        "expect": expectation(c),
        "sets": c.sets,
        "masked": c.masked,
        "opset": c.opset,
        "dynamic_time": c.dynamic_time,
        "exported_ops": {op: ops.count(op) for op in ("LSTM", "GRU", "RNN", "Loop", "Scan") if op in ops},
        "notes": c.notes,
    }
    env.onnx.save(model, str(out_dir / f"{c.name}.onnx"))
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for <case>.onnx/.npz/.json")
    parser.add_argument("--only", nargs="+", action="extend", metavar="SUBSTR")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.out is None:
        parser.error("--out is required unless --list is given")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    env = Env()
    args.out.mkdir(parents=True, exist_ok=True)
    done, skipped = 0, []
    for c in cases:
        start = time.perf_counter()
        try:
            meta = generate(env, c, args.out)
        except Exception as exc:  # one broken case must not stop the others
            if os.environ.get("JAX_CASES_DEBUG"):
                raise
            skipped.append(c.name)
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(f"WARNING: skipped {c.name}: {reason}", file=sys.stderr, flush=True)
            continue
        done += 1
        print(f"{c.name}: {time.perf_counter() - start:.1f}s jax2onnx emitted {meta['exported_ops']}", flush=True)
    print(f"jax: {done} cases written to {args.out}, {len(skipped)} skipped {skipped or ''}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
