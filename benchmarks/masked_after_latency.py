"""onnxruntime latency of a masked loop whose outputs are masked after it, as exported and as rnnfuse fuses it.

A Python loop over ``nn.LSTMCell(F, H)`` keeping its states at masked steps (``h = where(m_t, h_new, h)``), each
step's output the raw new h, the stack of them zeroed after the loop (``stack(outs) * mask.unsqueeze(-1)
.float()``), exported by torch's tracer (opset 17, an unrolled chain). rnnfuse makes it one masked LSTM (the
product is its Y zero-filled at masked steps). Both models run side by side on a random mask (about 70% valid
steps, gaps anywhere: the exact path).

    python benchmarks/masked_after_latency.py [--T 100] [--F 64] [--H 128] [--B 8] [--runs 21] [--out DIR]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from side_by_side import run


def export(path: Path, T: int, F: int, H: int, B: int):
    import torch
    from torch import nn

    class MaskedAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(F, H)

        def forward(self, x, mask):
            h = c = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                h_new, c_new = self.cell(x[t], (h, c))
                m = mask[t].unsqueeze(1)
                h, c = torch.where(m, h_new, h), torch.where(m, c_new, c)
                outs.append(h_new)
            return torch.stack(outs) * mask.unsqueeze(-1).float(), h

    torch.manual_seed(0)
    module = MaskedAfter().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(T, B, F), torch.ones(T, B, dtype=torch.bool)), str(path),
                          dynamo=False, opset_version=17, input_names=["x", "mask"], output_names=["y", "h"],
                          dynamic_axes={"x": {1: "batch"}, "mask": {1: "batch"}})
    return module


def inputs(a) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((a.T, a.B, a.F)).astype(np.float32), "mask": rng.random((a.T, a.B)) < 0.7}


def main(argv=None) -> int:
    return run(__doc__, argv, "masked_after", export, inputs)


if __name__ == "__main__":
    sys.exit(main())
