"""onnxruntime latency of a TorchScript loop run for a runtime trip count, as exported and as rnnfuse fuses it.

``torch.jit.script`` of ``for t in range(int(n))`` over ``nn.LSTMCell(F, H)`` (n an input: the number of steps
to run, at most x's length), exported with ``torch.onnx.export(dynamo=False, opset_version=17)``: a Loop
around a one-step LSTM. rnnfuse makes it one LSTM over ``x[:n]``. Both models run side by side in one process,
interleaved, onnxruntime with one intra-op and one inter-op thread; the medians and their ratio are printed,
with the largest difference of either model from torch.

    python benchmarks/trip_count_latency.py [--T 100] [--F 64] [--H 128] [--B 8] [--runs 21] [--out DIR]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from side_by_side import run


def export(path: Path, T: int, F: int, H: int, B: int):
    import torch
    from torch import nn

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.hid = nn.LSTMCell(F, H), H

        def forward(self, x, n):
            h = torch.zeros(x.size(1), self.hid)
            c = torch.zeros(x.size(1), self.hid)
            outs: list[torch.Tensor] = []
            for t in range(int(n)):
                h, c = self.cell(x[t], (h, c))
                outs.append(h)
            return torch.stack(outs), h, c

    torch.manual_seed(0)
    module = Counted().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(module), (torch.randn(T, B, F), torch.tensor(T)), str(path),
                          dynamo=False, opset_version=17, input_names=["x", "n"], output_names=["y", "h", "c"],
                          dynamic_axes={"x": {0: "time", 1: "batch"}})
    return module


def inputs(a) -> dict:
    import numpy as np

    return {"x": np.random.default_rng(0).standard_normal((a.T, a.B, a.F)).astype(np.float32),
            "n": np.array(a.T, np.int64)}


def main(argv=None) -> int:
    return run(__doc__, argv, "counted", export, inputs)


if __name__ == "__main__":
    sys.exit(main())
