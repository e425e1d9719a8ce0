"""Dynamic-shape transformers exported by torch's TorchScript exporter (trace), beside a recurrence.

A torch export with dynamic batch and time axes assembles shapes from scalars in every block (``view(B, T, H,
d)``: ``Concat(Unsqueeze(Gather(Shape(x), 0)), ...)`` before each Reshape): thousands of small nodes that
look, op by op, like what the passes look for (a Concat of Unsqueezes, Gathers by a constant index). Cases:

* ``tf_lstm_trace``: an embedding, ``nn.LSTM`` (a native LSTM already), then transformer blocks: nothing to
  fuse; the model must come out as it went in.
* ``lstmcell_tf_trace``: a Python loop over ``nn.LSTMCell`` (unrolled by the tracer, static time), its steps
  stacked, then transformer blocks: the loop becomes one LSTM, the blocks stay.

Each case writes ``NAME.onnx``, ``NAME.npz`` (``in/SET/NAME`` and ``out/SET/K``: torch's own outputs) and
``NAME.json`` (what tests/helpers.check_case reads). Usage: ``python transformer_cases.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

VOCAB, D, HEADS, FF, BLOCKS = 29, 16, 4, 32, 3
FEATURES, STEPS = 8, 6


def modules():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        """Pre-norm causal self-attention and an MLP, the attention written out (view / transpose / matmul)."""

        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            hd = C // HEADS
            q, k, v = (t.view(B, T, HEADS, hd).transpose(1, 2) for t in (q, k, v))
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            mask = torch.ones(T, T).tril().view(1, 1, T, T)
            att = torch.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1)
            y = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, C)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LstmThenBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.lstm = nn.LSTM(D, D, batch_first=True)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(D, VOCAB)

        def forward(self, tokens):
            x, _ = self.lstm(self.emb(tokens))
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    class CellLoopThenBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(FEATURES, D)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(D, 3)

        def forward(self, x):  # x: [B, STEPS, FEATURES]
            h = torch.zeros(x.shape[0], D)
            c = torch.zeros(x.shape[0], D)
            hs = []
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
                hs.append(h)
            y = torch.stack(hs, 1)
            for b in self.blocks:
                y = b(y)
            return self.head(y), h

    return LstmThenBlocks, CellLoopThenBlocks


def export(module, example, names, outputs, dynamic, path: Path) -> None:
    import torch

    with torch.no_grad():
        torch.onnx.export(module, example, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=outputs, dynamic_axes=dynamic, do_constant_folding=True)


def generate(out: Path) -> list[str]:
    import onnx
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    LstmThenBlocks, CellLoopThenBlocks = modules()
    written = []

    def save(name, module, feeds_by_set, expect, notes):
        arrays = {}
        for set_name, feeds in feeds_by_set.items():
            with torch.no_grad():
                outs = module(*(torch.from_numpy(v) for v in feeds.values()))
            outs = outs if isinstance(outs, tuple) else (outs,)
            arrays.update({f"in/{set_name}/{k}": v for k, v in feeds.items()})
            arrays.update({f"out/{set_name}/{k}": o.numpy() for k, o in enumerate(outs)})
        np.savez(out / f"{name}.npz", **arrays)
        model = onnx.load(str(out / f"{name}.onnx"))
        meta = {"name": name, "exporter": "trace", "expect": expect, "sets": list(feeds_by_set),
                "nodes": len(model.graph.node), "notes": notes}
        (out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
        written.append(name)

    m = LstmThenBlocks().eval()
    export(m, (torch.randint(0, VOCAB, (2, 7)),), ["tokens"], ["logits"],
            {"tokens": {0: "B", 1: "T"}, "logits": {0: "B", 1: "T"}}, out / "tf_lstm_trace.onnx")
    sets = {f"b{b}_t{t}": {"tokens": rng.integers(0, VOCAB, (b, t)).astype(np.int64)} for b, t in ((1, 5), (3, 9))}
    save("tf_lstm_trace", m, sets, {"ops": {"LSTM": 1}}, "nn.LSTM then transformer blocks: nothing to fuse")

    m = CellLoopThenBlocks().eval()
    export(m, (torch.randn(2, STEPS, FEATURES),), ["x"], ["y", "h"],
            {"x": {0: "B"}, "y": {0: "B"}, "h": {0: "B"}}, out / "lstmcell_tf_trace.onnx")
    sets = {f"b{b}": {"x": rng.standard_normal((b, STEPS, FEATURES)).astype(np.float32)} for b in (1, 4)}
    save("lstmcell_tf_trace", m, sets, {"ops": {"LSTM": 1}},
         "an unrolled LSTMCell loop, stacked, then transformer blocks")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for <case>.onnx/.npz/.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print("wrote", ", ".join(generate(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
