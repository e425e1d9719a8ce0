"""Export hand-written recurrent cells whose maths a native op computes only after weight algebra (issue 15),
plus their near misses, and record torch's own outputs.

Usage::

    python tests/exporters/variant_cases.py --out DIR [--only SUBSTR ...] [--verify]
    python tests/exporters/variant_cases.py --list [--only SUBSTR ...]

Every case is a Python loop over one hand-written ``nn.Module`` cell, exported by the real torch exporter:
``torch.onnx.export(dynamo=False, opset_version=17)`` ("trace": an unrolled chain),
``torch.onnx.export(dynamo=True)`` ("dynamo": an unrolled chain) or ``torch.jit.script`` then the trace
exporter ("script": an ONNX ``Loop``). Directions: ``forward``, ``reverse`` (the loop runs backwards in time,
outputs stored in time order) and ``bidirectional`` (a forward and a backward chain over the same input, each
with its own weights, outputs concatenated on features). Masked cases take a ``mask [T, B]`` bool input and
carry every state through masked steps (``torch.where(mask[t], new, old)``); the per-step output is the
carried h.

Weights are drawn with magnitudes that make every sign matter: weights ~ N(0, 0.8^2), biases and peephole
vectors ~ N(0, 1), so a gate computed as ``1 - z`` instead of ``z``, a dropped bias or a peephole on the wrong
cell state gives outputs far beyond the 1e-5 tolerance.

For every case three files are written into DIR: ``<case>.onnx`` (the export, one self-contained file),
``<case>.npz`` (``in/<set>/<input name>`` feeds and ``out/<set>/<k>`` torch's outputs for the k-th graph output)
and ``<case>.json`` (name, exporter, cell, direction, masked, expect: ``fused`` with the native op and the
attributes implied, or ``declined`` with the words the reason must contain).

Sets: ``b1``/``b3`` unmasked; masked cases ``post_b1``, ``post_b3``, ``pre_b3``, ``gappy_b3`` (with a row that
has no valid step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FEATURES = 5
HIDDEN = 4
TIME = 7
EXPORT_BATCH = 2
OPSET = 17

MASK_PATTERNS = {
    "post_b1": ["1111100"],
    "post_b3": ["1111111", "1111100", "1100000"],
    "pre_b3": ["1111111", "0001111", "0111111"],
    "gappy_b3": ["1011001", "0000000", "1111111"],
}

# --------------------------------------------------------------------------- the cells
# name -> (state count, native op when exact, issue item, description)
CELLS = {
    # (1) peephole LSTM
    "lstm_peephole": (2, "LSTM", 1, "LSTM with peepholes: i, f read p*c_prev, o reads p*c_new (ONNX P)"),
    "lstm_peephole_if": (2, "LSTM", 1, "peepholes on i and f only (P rows of o are zero)"),
    "lstm_peephole_i_only": (2, "LSTM", 1, "a peephole on the input gate only (P rows of o and f are zero)"),
    "lstm_peephole_o_oldc": (2, None, "near", "the output gate's peephole reads the previous cell state, not the new one"),
    "lstm_peephole_matrix": (2, None, "near", "a full matrix from c into the input gate (c_prev @ P), not a diagonal peephole"),
    # (2) one gate written as one minus another: a coupled input-forget gate LSTM (CIFG), ...
    "lstm_cifg": (2, "LSTM", 2, "CIFG LSTM: c = (1-i)*c + i*g (the forget gate is 1 - the input gate)"),
    "lstm_cifg_forget": (2, "LSTM", 2, "CIFG LSTM coupled through the forget gate: c = f*c + (1-f)*g"),
    "lstm_cifg_lerp": (2, "LSTM", 2, "CIFG LSTM written as a lerp: c = c + i*(g - c)"),
    "lstm_cifg_hardsigmoid": (2, "LSTM", 2, "CIFG LSTM with F.hardsigmoid gates (1 - hs(x) = hs(-x) for beta 0.5)"),
    "lstm_cifg_hs04": (2, None, "near", "CIFG LSTM with hard_sigmoid(0.3, 0.4) gates: 1 - hs(x) is no hard_sigmoid of -x"),
    "lstm_cifg_other_gate": (2, "LSTM", 2, "c = (1-i)*c + o*g: a forget gate written 1 - i, o the input gate too (its "
                                           "weights in both rows: an LSTM whose input and output gates are one)"),
    "lstm_forget_one_minus": (2, "LSTM", 2, "f = 1 - sigmoid(a_f): a forget gate of its own written one minus a gate (jax)"),
    "lstm_forget_neg": (2, "LSTM", 2, "f = sigmoid(-a_f): a gate of a negated pre-activation (the op's weights negated)"),
    "lstm_forget_one_minus_hs04": (2, None, "near", "f = 1 - hard_sigmoid(0.3, 0.4)(a_f): no hard_sigmoid of -a_f"),
    # (2) GRU with the update gate the other way round
    "gru_flip": (1, "GRU", 2, "torch GRU formula with h = z*n + (1-z)*h (linear_before_reset=1)"),
    "gru_flip_lbr0": (1, "GRU", 2, "h = z*n + (1-z)*h with the reset gate on the state: U_n(r*h) (linear_before_reset=0)"),
    "gru_flip_lerp": (1, "GRU", 2, "h = h + z*(n - h) (the flipped update written as a lerp)"),
    "gru_flip_hardsigmoid": (1, "GRU", 2, "h = z*n + (1-z)*h with F.hardsigmoid gates (1 - hs(x) = hs(-x) for beta 0.5)"),
    "gru_flip_hs04": (1, None, "near", "h = z*n + (1-z)*h with hard_sigmoid(0.3, 0.4) gates: 1 - hs(x) is no hard_sigmoid of -x"),
    "gru_update_both": (1, None, "near", "h = z*n + z*h: z applied to both terms"),
    "gru_update_other_gate": (1, None, "near", "h = z*n + (1-r)*h: the state is kept by the reset gate, not z"),
    # (3) minimal gated unit
    "mgu": (1, "GRU", 3, "MGU: f = sig(W_f x + U_f h + b_f), n = tanh(W x + U(f*h) + b), h = (1-f)*h + f*n"),
    "mgu_flax": (1, "GRU", 3, "MGU as flax.linen MGUCell: n = tanh(W x + b + f*(U h + b_h)), h = (1-f)*n + f*h"),
    "mgu_reset_input": (1, None, "near", "MGU whose f also multiplies the candidate's input part: tanh(f*(W x + U h))"),
    # (4) input feeding
    "lstm_feed": (2, "LSTM", 4, "nn.LSTMCell(F+H) over cat(x_t, h_prev) (input feeding)"),
    "rnn_feed": (1, "RNN", 4, "nn.RNNCell(F+H, tanh) over cat(x_t, h_prev)"),
    "gru_feed": (1, None, "near", "nn.GRUCell(F+H) over cat(x_t, h_prev): the fed h enters outside the reset product"),
    "lstm_feed_tanh": (2, None, "near", "nn.LSTMCell(F+H) over cat(x_t, tanh(h_prev)): the fed state goes through a nonlinearity"),
    # (5) activations and clip
    "lstm_hardsigmoid": (2, "LSTM", 5, "LSTM with hard_sigmoid(alpha=0.3, beta=0.4) gates, Elu(0.7) candidate, Softsign output"),
    "lstm_scaledtanh": (2, "LSTM", 5, "LSTM whose candidate and output activations are 1.7*tanh(0.6*a) (ScaledTanh)"),
    "lstm_torch_hardsigmoid": (2, "LSTM", 5, "LSTM with F.hardsigmoid gates (x/6 + 1/2), F.leaky_relu(0.1) candidate, tanh output"),
    "gru_softsign": (1, "GRU", 5, "GRU (torch formula) with Softsign gates and a Softsign candidate"),
    "rnn_leaky": (1, "RNN", 5, "Elman RNN with leaky_relu(0.2)"),
    "rnn_elu": (1, "RNN", 5, "Elman RNN with elu(1.3)"),
    "rnn_softplus": (1, None, "near", "Elman RNN with softplus: onnxruntime's native Softplus overflows to inf above ~88"),
    "rnn_softplus_clip": (1, "RNN", 5, "Elman RNN with softplus of the pre-activation clamped to [-5, 5] (clip=5)"),
    "rnn_tanh_control": (1, "RNN", 5, "control: a plain Elman RNN (tanh), to tell front-end gaps from variant gaps"),
    "rnn_softsign": (1, "RNN", 5, "Elman RNN with softsign"),
    "rnn_scaledtanh": (1, "RNN", 5, "Elman RNN with 1.7*tanh(0.6*a) (ScaledTanh)"),
    "rnn_affine": (1, "RNN", 5, "Elman RNN with 0.5*a + 0.1 (Affine)"),
    "rnn_thresholded": (1, "RNN", 5, "Elman RNN with a thresholded relu (a if a > 0.3 else 0)"),
    "rnn_leaky_where": (1, "RNN", 5, "Elman RNN with a leaky relu written torch.where(a < 0, 0.1*a, a)"),
    "rnn_hardtanh_where": (1, "RNN", 5, "Elman RNN with a hard tanh written where(a > 1, 1, where(a < -1, -1, a)) (jax's)"),
    "rnn_leaky_where_off": (1, None, "near", "torch.where(a > 0.5, a, 0.1*a): the branches do not meet at the threshold"),
    "rnn_clip_where_gap": (1, None, "near", "where(a > 1, 1.2, where(a < -1, -1, a)): a jump at the bound, no clip"),
    "lstm_clip": (2, "LSTM", 5, "LSTM whose four gate pre-activations are clamped to [-1.5, 1.5] (clip=1.5)"),
    "gru_clip": (1, "GRU", 5, "GRU (torch formula) whose gate pre-activations are clamped to [-1.2, 1.2] (clip=1.2)"),
    "lstm_clip_cell": (2, None, "near", "LSTM that clamps the cell state to [-1.5, 1.5], not the gate inputs"),
    "lstm_sigmoid_exp": (2, "LSTM", 5, "LSTM whose gates are written 1/(1 + exp(-a)) (the logistic sigmoid spelled out)"),
    "gru_sigmoid_exp": (1, "GRU", 5, "GRU (torch formula) whose gates are written exp(a)/(1 + exp(a)) and 1/(1 + exp(-a))"),
    "lstm_sigmoid_exp_shift": (2, None, "near", "LSTM gates written 1/(2 + exp(-a)): not a sigmoid"),
    "lstm_sigmoid_via_tanh": (2, "LSTM", 5, "LSTM whose gates are 0.5*tanh(0.5*a) + 0.5 and whose tanh are 2*sigmoid(2*a) - 1"),
    "gru_sigmoid_via_tanh": (1, "GRU", 5, "GRU (torch formula) with gates 0.5*tanh(0.5*a) + 0.5, candidate 2*sigmoid(2*a) - 1"),
    "rnn_tanh_via_sigmoid": (1, "RNN", 5, "Elman RNN whose tanh is written 2*sigmoid(2*a) - 1"),
    "rnn_neg_state": (1, "RNN", 6, "Elman RNN tanh(ih(x) - hh(h)): the recurrent term subtracted (R negated)"),
    "lstm_sigmoid_via_tanh_off": (2, None, "near", "LSTM gates written 0.5*tanh(0.5*a) + 0.45: not a sigmoid"),
    "lstm_hs_output": (2, "LSTM", 5, "LSTM whose output activation is clamp(0.3*c + 0.4, 0, 1) (hard_sigmoid of the cell state)"),
    "lstm_hs_clip": (2, "LSTM", 5, "LSTM with clamp(0.3*a + 0.4, 0, 1) gates of pre-activations clamped to [-1.5, 1.5]"),
    "gru_hs_candidate": (1, "GRU", 5, "GRU (torch formula) whose candidate is clamp(0.3*(W x + r*(U h + b)) + 0.4, 0, 1)"),
    "lstm_hs_output_uneven": (2, None, "near", "LSTM whose output activation is clamp(0.3*f*c + 0.5*i*g + 0.4, 0, 1): "
                                               "no hard_sigmoid of the new cell state"),
    # (6) other spellings of the textbook cells
    "lstm_view_gates": (2, "LSTM", 6, "LSTM whose gates are gates.view(-1, 4, H).unbind(1) (not chunk)"),
    "gru_torch_lerp": (1, "GRU", 6, "GRU (torch formula) with h = torch.lerp(n, h, z)"),
    "gru_einsum": (1, "GRU", 6, "GRU (torch formula) whose matmuls are torch.einsum('bf,gf->bg', x, W)"),
}

# what a declined case's reason must name (lower case words, each must occur)
DECLINE_WORDS = {
    "lstm_peephole_o_oldc": ["output gate"],
    "lstm_peephole_matrix": ["state"],
    "lstm_cifg_hs04": ["forget gate", "hardsigmoid"],
    "lstm_forget_one_minus_hs04": ["forget gate", "hardsigmoid"],
    "gru_update_both": ["update"],
    "gru_flip_hs04": ["update", "hardsigmoid"],
    "gru_update_other_gate": ["update"],
    "mgu_reset_input": ["reset"],
    "gru_feed": ["candidate"],
    "lstm_feed_tanh": ["through tanh", "input feed"],
    "lstm_clip_cell": ["cell state"],
    "rnn_softplus": ["softplus"],
    "lstm_sigmoid_exp_shift": ["not 1 + exp(q)"],
    "rnn_leaky_where_off": ["where"],
    "rnn_clip_where_gap": ["where"],
    "lstm_sigmoid_via_tanh_off": ["scaledtanh"],
    "lstm_hs_output_uneven": ["output activation"],
}

# ONNX attributes a fused case must carry (checked on every native op of the case's kind)
EXPECT_ATTRS = {
    "gru_flip": {"linear_before_reset": 1},
    "lstm_cifg_hardsigmoid": {"activations": ["HardSigmoid", "Tanh", "Tanh"]},
    "gru_flip_lbr0": {"linear_before_reset": 0},
    "gru_flip_lerp": {"linear_before_reset": 1},
    "gru_flip_hardsigmoid": {"linear_before_reset": 1, "activations": ["HardSigmoid", "Tanh"]},
    "lstm_scaledtanh": {"activations": ["Sigmoid", "ScaledTanh", "ScaledTanh"]},
    "mgu": {"linear_before_reset": 0},
    "mgu_flax": {"linear_before_reset": 1},
    "lstm_hardsigmoid": {"activations": ["HardSigmoid", "Elu", "Softsign"]},
    "lstm_torch_hardsigmoid": {"activations": ["HardSigmoid", "LeakyRelu", "Tanh"]},
    "gru_softsign": {"activations": ["Softsign", "Softsign"], "linear_before_reset": 1},
    "rnn_leaky": {"activations": ["LeakyRelu"]},
    "rnn_elu": {"activations": ["Elu"]},
    "rnn_softplus_clip": {"activations": ["Softplus"], "clip": 5.0},
    "rnn_softsign": {"activations": ["Softsign"]},
    "rnn_scaledtanh": {"activations": ["ScaledTanh"]},
    "rnn_affine": {"activations": ["Affine"]},
    "rnn_thresholded": {"activations": ["ThresholdedRelu"]},
    "rnn_leaky_where": {"activations": ["LeakyRelu"]},
    "rnn_hardtanh_where": {"activations": ["Affine"], "clip": 1.0},
    "lstm_clip": {"clip": 1.5},
    "gru_clip": {"clip": 1.2},
    "gru_sigmoid_exp": {"linear_before_reset": 1},
    "gru_sigmoid_via_tanh": {"linear_before_reset": 1},
    "lstm_hs_output": {"activations": ["Sigmoid", "Tanh", "HardSigmoid"]},
    "lstm_hs_clip": {"activations": ["HardSigmoid", "Tanh", "Tanh"], "clip": 1.5},
    "gru_hs_candidate": {"activations": ["Sigmoid", "HardSigmoid"], "linear_before_reset": 1},
}


@dataclass(frozen=True)
class Case:
    name: str
    cell: str
    exporter: str = "trace"  # trace | dynamo | script
    direction: str = "forward"  # forward | reverse | bidirectional
    masked: bool = False
    dynamic_batch: bool = True
    notes: str = ""

    @property
    def native(self) -> str | None:
        return CELLS[self.cell][1]

    @property
    def item(self):
        return CELLS[self.cell][2]


def _cases() -> list[Case]:
    out = []
    for cell, (_, native, item, _) in CELLS.items():
        out.append(Case(f"{cell}_fw", cell))
        if native is not None and item != 5:
            out.append(Case(f"{cell}_rev_masked", cell, direction="reverse", masked=True))
            out.append(Case(f"{cell}_bidir", cell, direction="bidirectional"))
        out.append(Case(f"{cell}_bidir_masked", cell, direction="bidirectional", masked=True))
    # the dynamo exporter and the TorchScript Loop front for one cell of each item
    for cell in ("lstm_peephole", "gru_flip", "mgu", "lstm_feed", "rnn_leaky", "lstm_view_gates", "gru_torch_lerp"):
        out.append(Case(f"{cell}_dynamo_masked", cell, exporter="dynamo", masked=True))
    for cell in ("lstm_peephole", "gru_flip", "mgu", "lstm_feed", "lstm_hardsigmoid"):
        out.append(Case(f"{cell}_script", cell, exporter="script",
                        notes="TorchScript loop: an ONNX Loop with SequenceInsert / ConcatFromSequence"))
    return out


CASES = _cases()


def expectation(c: Case) -> dict:
    if c.native is None:
        return {"status": "declined", "reason_words": DECLINE_WORDS[c.cell]}
    n_ops = 1
    return {
        "status": "fused",
        "ops": {c.native: n_ops},
        "directions": {c.native: [c.direction]},
        "attrs": {c.native: EXPECT_ATTRS.get(c.cell, {})},
        "peephole": c.cell.startswith("lstm_peephole"),
        "absent": ["Loop", "Scan", "SequenceInsert"],
    }


# --------------------------------------------------------------------------- torch modules

_classes: dict = {}


def torch_classes():
    if _classes:
        return _classes
    import torch
    import torch.nn.functional as F
    from torch import nn

    def lin(i: int, o: int, bias: bool = True):
        return nn.Linear(i, o, bias=bias)

    class Cell(nn.Module):
        """Activations by name (TorchScript cannot hold Python functions as attributes)."""

        def act(self, kind: str, a):
            if kind == "sigmoid":
                return torch.sigmoid(a)
            if kind == "tanh":
                return torch.tanh(a)
            if kind == "hs34":  # hard_sigmoid(alpha=0.3, beta=0.4)
                return torch.clamp(0.3 * a + 0.4, 0.0, 1.0)
            if kind == "hardsigmoid":
                return F.hardsigmoid(a)
            if kind == "elu07":
                return F.elu(a, 0.7)
            if kind == "elu13":
                return F.elu(a, 1.3)
            if kind == "elu":
                return F.elu(a)
            if kind == "leaky01":
                return F.leaky_relu(a, 0.1)
            if kind == "leaky02":
                return F.leaky_relu(a, 0.2)
            if kind == "softplus":
                return F.softplus(a)
            if kind == "softplus5":
                return F.softplus(torch.clamp(a, -5.0, 5.0))
            if kind == "softsign":
                return F.softsign(a)
            if kind == "scaledtanh":
                return 1.7 * torch.tanh(0.6 * a)
            if kind == "affine":
                return 0.5 * a + 0.1
            if kind == "sigexp":
                return 1.0 / (1.0 + torch.exp(-a))
            if kind == "sigexp_ratio":  # (exp(a) stays finite for these weights)
                return torch.exp(a) / (1.0 + torch.exp(a))
            if kind == "sig_tanh":  # the logistic sigmoid through tanh
                return 0.5 * torch.tanh(0.5 * a) + 0.5
            if kind == "sig_tanh_off":
                return 0.5 * torch.tanh(0.5 * a) + 0.45
            if kind == "tanh_sig":  # tanh through the logistic sigmoid
                return 2.0 * torch.sigmoid(2.0 * a) - 1.0
            if kind == "sigexp_shift":
                return 1.0 / (2.0 + torch.exp(-a))
            if kind == "leaky_where":
                return torch.where(a < 0, 0.1 * a, a)
            if kind == "leaky_where_off":
                return torch.where(a > 0.5, a, 0.1 * a)
            if kind == "hardtanh_where":
                return torch.where(a > 1.0, torch.ones_like(a), torch.where(a < -1.0, -torch.ones_like(a), a))
            if kind == "clip_where_gap":
                return torch.where(a > 1.0, 1.2 * torch.ones_like(a), torch.where(a < -1.0, -torch.ones_like(a), a))
            if kind == "thresholded":
                return torch.where(a > 0.3, a, torch.zeros_like(a))
            raise ValueError(kind)

    class LSTMBase(Cell):
        """ih, hh Linears of 4H in torch order i, f, g, o."""

        def __init__(self, fi: int, h: int):
            super().__init__()
            self.ih, self.hh = lin(fi, 4 * h), lin(h, 4 * h)

    class LSTMPeephole(LSTMBase):
        def __init__(self, fi: int, h: int, gates: str = "ifo", o_old: bool = False):
            super().__init__(fi, h)
            self.o_old = o_old
            # unused peepholes stay zero (and out of the graph: the cell only adds the ones it has)
            self.p_i = nn.Parameter(torch.zeros(h)) if "i" in gates else None
            self.p_f = nn.Parameter(torch.zeros(h)) if "f" in gates else None
            self.p_o = nn.Parameter(torch.zeros(h)) if "o" in gates else None

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            ai, af, ag, ao = (self.ih(x) + self.hh(h)).chunk(4, -1)
            if self.p_i is not None:
                ai = ai + self.p_i * c
            if self.p_f is not None:
                af = af + self.p_f * c
            c2 = torch.sigmoid(af) * c + torch.sigmoid(ai) * torch.tanh(ag)
            if self.p_o is not None:
                ao = ao + self.p_o * (c if self.o_old else c2)
            return torch.sigmoid(ao) * torch.tanh(c2), c2

    class LSTMPeepMatrix(LSTMBase):
        def __init__(self, fi: int, h: int):
            super().__init__(fi, h)
            self.pc = lin(h, h, bias=False)

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            ai, af, ag, ao = (self.ih(x) + self.hh(h)).chunk(4, -1)
            c2 = torch.sigmoid(af) * c + torch.sigmoid(ai + self.pc(c)) * torch.tanh(ag)
            return torch.sigmoid(ao) * torch.tanh(c2), c2

    class LSTMActs(LSTMBase):
        def __init__(self, fi: int, h: int, gate: str, cand: str, out: str, clip: float = 0.0, clip_cell: float = 0.0):
            super().__init__(fi, h)
            self.gate, self.cand, self.out, self.clip, self.clip_cell = gate, cand, out, clip, clip_cell

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            ai, af, ag, ao = (self.ih(x) + self.hh(h)).chunk(4, -1)
            if self.clip > 0:
                k = self.clip
                ai, af, ag, ao = (torch.clamp(ai, -k, k), torch.clamp(af, -k, k), torch.clamp(ag, -k, k),
                                  torch.clamp(ao, -k, k))
            fc, ig = self.act(self.gate, af) * c, self.act(self.gate, ai) * self.act(self.cand, ag)
            c2 = fc + ig
            if self.clip_cell > 0:
                c2 = torch.clamp(c2, -self.clip_cell, self.clip_cell)
            if self.out == "hs_uneven":  # near miss: the two terms of c' scaled differently
                return self.act(self.gate, ao) * torch.clamp(0.3 * fc + 0.5 * ig + 0.4, 0.0, 1.0), c2
            return self.act(self.gate, ao) * self.act(self.out, c2), c2

    class LSTMCoupled(Cell):
        """A coupled input-forget gate LSTM: three gates (i or f, g, o), the missing one one minus the other."""

        def __init__(self, fi: int, h: int, form: str = "input", gate: str = "sigmoid"):
            super().__init__()
            self.ih, self.hh = lin(fi, 3 * h), lin(h, 3 * h)
            self.form, self.gate = form, gate

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            a, ag, ao = (self.ih(x) + self.hh(h)).chunk(3, -1)
            k, g, o = self.act(self.gate, a), torch.tanh(ag), self.act(self.gate, ao)
            if self.form == "forget":  # k is the forget gate
                c2 = k * c + (1 - k) * g
            elif self.form == "lerp":
                c2 = c + k * (g - c)
            elif self.form == "other":  # near miss: the candidate scaled by o, not by the coupled gate
                c2 = (1 - k) * c + o * g
            else:
                c2 = (1 - k) * c + k * g
            return o * torch.tanh(c2), c2

    class LSTMForget(LSTMBase):
        """torch's i, f, g, o chunks, the forget gate written ``1 - act(a_f)`` ("one_minus") or ``act(-a_f)``
        ("neg")."""

        def __init__(self, fi: int, h: int, form: str, gate: str = "sigmoid"):
            super().__init__(fi, h)
            self.form, self.gate = form, gate

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            ai, af, ag, ao = (self.ih(x) + self.hh(h)).chunk(4, -1)
            f = 1 - self.act(self.gate, af) if self.form == "one_minus" else self.act(self.gate, -af)
            c2 = f * c + self.act(self.gate, ai) * torch.tanh(ag)
            return self.act(self.gate, ao) * torch.tanh(c2), c2

    class GRUVariant(Cell):
        """torch's r, z, n chunks; ``update`` says how z combines n and h."""

        def __init__(self, fi: int, h: int, update: str = "flip", lbr: bool = True, gate: str = "sigmoid",
                     cand: str = "tanh", clip: float = 0.0):
            super().__init__()
            self.ih = lin(fi, 3 * h)
            self.hh = lin(h, 3 * h if lbr else 2 * h)
            self.hn = lin(h, h)  # linear_before_reset=0 only: U_n applied to r*h
            self.lbr, self.update, self.gate, self.cand, self.clip = lbr, update, gate, cand, clip
            self.hidden = h  # a Python int: reading h.shape would put a Shape of the state into the graph

        def forward(self, x, h):
            if self.update == "einsum":
                gi = torch.einsum("bf,gf->bg", x, self.ih.weight) + self.ih.bias
                ir, iz, in_ = gi.chunk(3, -1)
                hh = torch.einsum("bk,gk->bg", h, self.hh.weight) + self.hh.bias
            else:
                ir, iz, in_ = self.ih(x).chunk(3, -1)
                hh = self.hh(h)
            H = self.hidden
            ar, az = ir + hh[:, :H], iz + hh[:, H:2 * H]
            if self.clip > 0:
                ar, az = torch.clamp(ar, -self.clip, self.clip), torch.clamp(az, -self.clip, self.clip)
            r = self.act(self.gate, ar)
            z = self.act("sigexp_ratio" if self.gate == "sigexp" else self.gate, az)
            if self.lbr:
                an = in_ + r * hh[:, 2 * H:]
            else:
                an = in_ + self.hn(r * h)
            if self.clip > 0:
                an = torch.clamp(an, -self.clip, self.clip)
            n = self.act(self.cand, an)
            if self.update == "flip":
                return z * n + (1 - z) * h
            if self.update == "lerp":
                return h + z * (n - h)
            if self.update == "torch_lerp":  # (1-z)*n + z*h, exported as Where(|z| < 0.5, ..., ...)
                return torch.lerp(n, h, z)
            if self.update == "both":
                return z * n + z * h
            if self.update == "other":
                return z * n + (1 - r) * h
            return (1 - z) * n + z * h  # torch's own

    class LSTMView(LSTMBase):
        def __init__(self, fi: int, h: int):
            super().__init__(fi, h)
            self.hidden = h

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h, c = state
            ai, af, ag, ao = (self.ih(x) + self.hh(h)).view(-1, 4, self.hidden).unbind(1)
            c2 = torch.sigmoid(af) * c + torch.sigmoid(ai) * torch.tanh(ag)
            return torch.sigmoid(ao) * torch.tanh(c2), c2

    class MGU(Cell):
        def __init__(self, fi: int, h: int, form: str = "wiki"):
            super().__init__()
            self.xf, self.hf = lin(fi, h), lin(h, h)
            self.xn, self.hn = lin(fi, h), lin(h, h, bias=form == "flax")
            self.form = form

        def forward(self, x, h):
            f = torch.sigmoid(self.xf(x) + self.hf(h))
            if self.form == "wiki":
                n = torch.tanh(self.xn(x) + self.hn(f * h))
                return (1 - f) * h + f * n
            if self.form == "flax":
                n = torch.tanh(self.xn(x) + f * self.hn(h))
                return (1 - f) * n + f * h
            n = torch.tanh(f * (self.xn(x) + self.hn(h)))  # reset_input: not a GRU
            return (1 - f) * h + f * n

    class FeedLSTM(nn.Module):
        """nn.LSTMCell over cat(x_t, h_prev) (input feeding)."""

        def __init__(self, fi: int, h: int, through: str = ""):
            super().__init__()
            self.cell, self.through = nn.LSTMCell(fi + h, h), through

        def forward(self, x, state: tuple[torch.Tensor, torch.Tensor]):
            h = state[0]
            fed = torch.tanh(h) if self.through == "tanh" else h
            return self.cell(torch.cat([x, fed], -1), state)

    class FeedH(nn.Module):
        """nn.GRUCell / nn.RNNCell over cat(x_t, h_prev)."""

        def __init__(self, fi: int, h: int, kind: str):
            super().__init__()
            self.cell = nn.GRUCell(fi + h, h) if kind == "gru" else nn.RNNCell(fi + h, h)

        def forward(self, x, h):
            return self.cell(torch.cat([x, h], -1), h)

    class Elman(Cell):
        def __init__(self, fi: int, h: int, act: str, subtract: bool = False):
            super().__init__()
            self.ih, self.hh, self.kind, self.subtract = lin(fi, h), lin(h, h), act, subtract

        def forward(self, x, h):
            return self.act(self.kind, self.ih(x) - self.hh(h) if self.subtract else self.ih(x) + self.hh(h))

    def make_cell(kind: str, fi: int, h: int):
        table = {
            "lstm_peephole": lambda: LSTMPeephole(fi, h),
            "lstm_peephole_if": lambda: LSTMPeephole(fi, h, gates="if"),
            "lstm_peephole_i_only": lambda: LSTMPeephole(fi, h, gates="i"),
            "lstm_peephole_o_oldc": lambda: LSTMPeephole(fi, h, o_old=True),
            "lstm_peephole_matrix": lambda: LSTMPeepMatrix(fi, h),
            "lstm_cifg": lambda: LSTMCoupled(fi, h),
            "lstm_cifg_forget": lambda: LSTMCoupled(fi, h, form="forget"),
            "lstm_cifg_lerp": lambda: LSTMCoupled(fi, h, form="lerp"),
            "lstm_cifg_hardsigmoid": lambda: LSTMCoupled(fi, h, gate="hardsigmoid"),
            "lstm_cifg_hs04": lambda: LSTMCoupled(fi, h, gate="hs34"),
            "lstm_cifg_other_gate": lambda: LSTMCoupled(fi, h, form="other"),
            "lstm_forget_one_minus": lambda: LSTMForget(fi, h, "one_minus"),
            "lstm_forget_neg": lambda: LSTMForget(fi, h, "neg"),
            "lstm_forget_one_minus_hs04": lambda: LSTMForget(fi, h, "one_minus", gate="hs34"),
            "gru_flip": lambda: GRUVariant(fi, h),
            "gru_flip_lbr0": lambda: GRUVariant(fi, h, lbr=False),
            "gru_flip_lerp": lambda: GRUVariant(fi, h, update="lerp"),
            "gru_flip_hardsigmoid": lambda: GRUVariant(fi, h, gate="hardsigmoid"),
            "gru_flip_hs04": lambda: GRUVariant(fi, h, gate="hs34"),
            "gru_update_both": lambda: GRUVariant(fi, h, update="both"),
            "gru_update_other_gate": lambda: GRUVariant(fi, h, update="other"),
            "mgu": lambda: MGU(fi, h),
            "mgu_flax": lambda: MGU(fi, h, form="flax"),
            "mgu_reset_input": lambda: MGU(fi, h, form="reset_input"),
            "lstm_feed": lambda: FeedLSTM(fi, h),
            "rnn_feed": lambda: FeedH(fi, h, "rnn"),
            "gru_feed": lambda: FeedH(fi, h, "gru"),
            "lstm_feed_tanh": lambda: FeedLSTM(fi, h, through="tanh"),
            "lstm_hardsigmoid": lambda: LSTMActs(fi, h, "hs34", "elu07", "softsign"),
            "lstm_scaledtanh": lambda: LSTMActs(fi, h, "sigmoid", "scaledtanh", "scaledtanh"),
            "lstm_torch_hardsigmoid": lambda: LSTMActs(fi, h, "hardsigmoid", "leaky01", "tanh"),
            "gru_softsign": lambda: GRUVariant(fi, h, update="torch", gate="softsign", cand="softsign"),
            "rnn_leaky": lambda: Elman(fi, h, "leaky02"),
            "rnn_elu": lambda: Elman(fi, h, "elu13"),
            "rnn_softplus": lambda: Elman(fi, h, "softplus"),
            "rnn_softplus_clip": lambda: Elman(fi, h, "softplus5"),
            "rnn_tanh_control": lambda: Elman(fi, h, "tanh"),
            "rnn_softsign": lambda: Elman(fi, h, "softsign"),
            "rnn_scaledtanh": lambda: Elman(fi, h, "scaledtanh"),
            "rnn_affine": lambda: Elman(fi, h, "affine"),
            "rnn_thresholded": lambda: Elman(fi, h, "thresholded"),
            "rnn_leaky_where": lambda: Elman(fi, h, "leaky_where"),
            "rnn_hardtanh_where": lambda: Elman(fi, h, "hardtanh_where"),
            "rnn_leaky_where_off": lambda: Elman(fi, h, "leaky_where_off"),
            "rnn_clip_where_gap": lambda: Elman(fi, h, "clip_where_gap"),
            "lstm_clip": lambda: LSTMActs(fi, h, "sigmoid", "tanh", "tanh", clip=1.5),
            "gru_clip": lambda: GRUVariant(fi, h, update="torch", clip=1.2),
            "lstm_clip_cell": lambda: LSTMActs(fi, h, "sigmoid", "tanh", "tanh", clip_cell=1.5),
            "lstm_sigmoid_exp": lambda: LSTMActs(fi, h, "sigexp", "tanh", "tanh"),
            "gru_sigmoid_exp": lambda: GRUVariant(fi, h, update="torch", gate="sigexp"),
            "lstm_sigmoid_exp_shift": lambda: LSTMActs(fi, h, "sigexp_shift", "tanh", "tanh"),
            "lstm_sigmoid_via_tanh": lambda: LSTMActs(fi, h, "sig_tanh", "tanh_sig", "tanh_sig"),
            "gru_sigmoid_via_tanh": lambda: GRUVariant(fi, h, update="torch", gate="sig_tanh", cand="tanh_sig"),
            "rnn_tanh_via_sigmoid": lambda: Elman(fi, h, "tanh_sig"),
            "rnn_neg_state": lambda: Elman(fi, h, "tanh", subtract=True),
            "lstm_sigmoid_via_tanh_off": lambda: LSTMActs(fi, h, "sig_tanh_off", "tanh", "tanh"),
            "lstm_hs_output": lambda: LSTMActs(fi, h, "sigmoid", "tanh", "hs34"),
            "lstm_hs_clip": lambda: LSTMActs(fi, h, "hs34", "tanh", "tanh", clip=1.5),
            "gru_hs_candidate": lambda: GRUVariant(fi, h, update="torch", cand="hs34"),
            "lstm_hs_output_uneven": lambda: LSTMActs(fi, h, "sigmoid", "tanh", "hs_uneven"),
            "lstm_view_gates": lambda: LSTMView(fi, h),
            "gru_torch_lerp": lambda: GRUVariant(fi, h, update="torch_lerp"),
            "gru_einsum": lambda: GRUVariant(fi, h, update="einsum"),
        }
        return table[kind]()

    class VariantLoop(nn.Module):
        """A Python loop over one cell per direction; masked steps carry every state."""

        def __init__(self, cell: str, features: int, hidden: int, direction: str, masked: bool):
            super().__init__()
            self.two = CELLS[cell][0] == 2
            self.hidden, self.masked = hidden, masked
            self.dirs = [False, True] if direction == "bidirectional" else [direction == "reverse"]
            self.cells = nn.ModuleList([make_cell(cell, features, hidden) for _ in self.dirs])

        def chain(self, cell, x, mask, reverse: bool):
            batch = x.shape[1]
            h = torch.zeros(batch, self.hidden, dtype=x.dtype)
            state = (h, torch.zeros(batch, self.hidden, dtype=x.dtype)) if self.two else h
            outs = []
            steps = x.shape[0]
            for t in (reversed(range(steps)) if reverse else range(steps)):
                new = cell(x[t], state)
                if mask is not None:
                    m = mask[t].unsqueeze(-1)
                    new = tuple(torch.where(m, a, b) for a, b in zip(new, state)) if self.two else torch.where(m, new, state)
                state = new
                outs.append(state[0] if self.two else state)
            if reverse:
                outs.reverse()
            return torch.stack(outs, 0)

        def forward(self, x, mask=None):
            ys = [self.chain(cell, x, mask, rev) for cell, rev in zip(self.cells, self.dirs)]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)

    class ScriptLoop2(nn.Module):
        """The scripted form of a two-state (LSTM) cell loop: ``for t in range(x.size(0))`` -> an ONNX Loop."""

        def __init__(self, cell: str, features: int, hidden: int):
            super().__init__()
            self.cell, self.hidden = make_cell(cell, features, hidden), hidden

        def forward(self, x):
            h = torch.zeros(x.size(1), self.hidden, dtype=x.dtype)
            c = torch.zeros(x.size(1), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h, c = self.cell(x[t], (h, c))
                outs.append(h)
            return torch.stack(outs)

    class ScriptLoop1(nn.Module):
        """The scripted form of a one-state cell loop."""

        def __init__(self, cell: str, features: int, hidden: int):
            super().__init__()
            self.cell, self.hidden = make_cell(cell, features, hidden), hidden

        def forward(self, x):
            h = torch.zeros(x.size(1), self.hidden, dtype=x.dtype)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                h = self.cell(x[t], h)
                outs.append(h)
            return torch.stack(outs)

    _classes.update(VariantLoop=VariantLoop, ScriptLoop1=ScriptLoop1, ScriptLoop2=ScriptLoop2)
    return _classes


def randomise(module, rng: np.random.Generator):
    """Weights ~ N(0, 0.8^2), biases and peepholes (1-D) ~ N(0, 1): every term's sign changes the outputs."""
    import torch

    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            scale = 0.8 if p.dim() > 1 else 1.0
            p.copy_(torch.from_numpy((scale * rng.standard_normal(tuple(p.shape))).astype(np.float32)))


def build(c: Case):
    m = torch_classes()
    if c.exporter == "script":
        return m["ScriptLoop2" if CELLS[c.cell][0] == 2 else "ScriptLoop1"](c.cell, FEATURES, HIDDEN)
    return m["VariantLoop"](c.cell, FEATURES, HIDDEN, c.direction, c.masked)


# --------------------------------------------------------------------------- inputs


def input_sets(c: Case, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    sets = {}
    patterns = MASK_PATTERNS if c.masked else {"b1": ["1" * TIME], "b3": ["1" * TIME] * 3}
    for set_name, rows in patterns.items():
        keep = np.array([[ch == "1" for ch in row] for row in rows]).T  # [T, B]
        feeds = {"x": rng.standard_normal((TIME, keep.shape[1], FEATURES)).astype(np.float32)}
        if c.masked:
            feeds["mask"] = keep
        sets[set_name] = feeds
    return sets


# --------------------------------------------------------------------------- export


def export(c: Case, module, path: Path):
    import torch

    names = ["x", "mask"] if c.masked else ["x"]
    example = [torch.randn(TIME, EXPORT_BATCH, FEATURES)]
    if c.masked:
        example.append(torch.ones(TIME, EXPORT_BATCH, dtype=torch.bool))
    args = tuple(example)
    if c.exporter == "dynamo":
        batch = torch.export.Dim("batch")
        dyn = tuple({1: batch} for _ in names) if c.dynamic_batch else None
        torch.onnx.export(module, args, str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=names, output_names=["y"], dynamic_shapes=dyn)
        return
    axes = {n: {1: "batch"} for n in names} if c.dynamic_batch else {}
    if c.exporter == "script":
        axes = {"x": {0: "time", 1: "batch"}}
        module = torch.jit.script(module)
    torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET, input_names=names,
                      output_names=["y"], dynamic_axes=axes or None)


def self_contained(path: Path):
    import onnx

    model = onnx.load(str(path))
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        for t in model.graph.initializer:
            t.data_location = onnx.TensorProto.DEFAULT
        onnx.save(model, str(path), save_as_external_data=False)
    return model


def generate(c: Case, out_dir: Path) -> dict:
    import torch

    seed = zlib.crc32(c.name.encode())
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    module = build(c)
    randomise(module, rng)
    module.eval()
    path = out_dir / f"{c.name}.onnx"
    with torch.no_grad():
        export(c, module, path)
    model = self_contained(path)
    inits = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    want = ["x", "mask"] if c.masked else ["x"]
    if inputs != want:
        raise RuntimeError(f"ONNX inputs {inputs} != {want}")
    arrays = {}
    for set_name, feeds in input_sets(c, rng).items():
        with torch.no_grad():
            y = module(*(torch.from_numpy(feeds[n]) for n in want))
        arrays.update({f"in/{set_name}/{k}": v for k, v in feeds.items()})
        arrays[f"out/{set_name}/0"] = y.numpy()
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    meta = {
        "name": c.name,
        "cell": c.cell,
        "item": c.item,
        "layers": CELLS[c.cell][3],
        "exporter": c.exporter,
        "direction": c.direction,
        "masked": c.masked,
        "expect": expectation(c),
        "sets": list(input_sets(c, np.random.default_rng(0))),
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "nodes": len(model.graph.node),
        "notes": c.notes,
    }
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def verify(out_dir: Path, name: str) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(out_dir / f"{name}.onnx"), so, providers=["CPUExecutionProvider"])
    data = np.load(out_dir / f"{name}.npz")
    worst = 0.0
    for key in data.files:
        kind, set_name, rest = key.split("/", 2)
        if kind != "out":
            continue
        feeds = {k.split("/", 2)[2]: data[k] for k in data.files if k.startswith(f"in/{set_name}/")}
        got = sess.run(None, feeds)[int(rest)]
        worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - data[key]))))
    return worst


def quiet():
    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="+", action="extend", metavar="SUBSTR")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    if args.list:
        for c in cases:
            print(f"{c.name:36s} {c.exporter:7s} {c.direction:13s} {'masked' if c.masked else '':6s} {CELLS[c.cell][3]}")
        return 0
    if args.out is None:
        parser.error("--out is required unless --list is given")
    quiet()
    args.out.mkdir(parents=True, exist_ok=True)
    started, failed = time.perf_counter(), []
    for c in cases:
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                meta = generate(c, args.out)
            line = f"{c.name}: {time.perf_counter() - t0:.1f}s, {meta['nodes']} nodes"
            if args.verify:
                line += f", max |ort - torch| {verify(args.out, c.name):.1e}"
            print(line, flush=True)
        except Exception as exc:  # one broken export must not stop the others; the test of that case fails
            failed.append(c.name)
            print(f"WARNING: skipped {c.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                  file=sys.stderr, flush=True)
    print(f"variants: {len(cases) - len(failed)} of {len(cases)} cases written to {args.out} in "
          f"{time.perf_counter() - started:.1f}s" + (f", failed {failed}" if failed else ""))
    return 0 if len(failed) * 4 < len(cases) else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
