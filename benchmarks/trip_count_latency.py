"""onnxruntime latency of a TorchScript loop run for a runtime trip count, as exported and as rnnfuse fuses it.

``torch.jit.script`` of ``for t in range(int(n))`` over ``nn.LSTMCell(F, H)`` (n an input: the number of steps
to run, at most x's length), exported with ``torch.onnx.export(dynamo=False, opset_version=17)``: a Loop
around a one-step LSTM. rnnfuse makes it one LSTM over ``x[:n]``. Both models run side by side in one process,
interleaved, onnxruntime with one intra-op and one inter-op thread; the medians and their ratio are printed,
with the largest difference of either model from torch.

    python benchmarks/trip_count_latency.py [--T 100] [--F 64] [--H 128] [--B 8] [--runs 21] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("T", 100), ("F", 64), ("H", 128), ("B", 8), ("runs", 21)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", type=Path, default=None, help="where the two models are written (default: a temp dir)")
    a = ap.parse_args(argv)
    import numpy as np
    import onnxruntime as ort
    import torch

    out = a.out or Path(tempfile.mkdtemp(prefix="rnnfuse_trip_"))
    out.mkdir(parents=True, exist_ok=True)
    exported, fused = out / "counted.onnx", out / "counted_fused.onnx"
    module = export(exported, a.T, a.F, a.H, a.B)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "rnnfuse", "optimize", str(exported), str(fused)],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr.strip(), file=sys.stderr)
        return 1
    print(r.stdout.strip().splitlines()[1], f"(CLI wall {time.perf_counter() - t0:.2f} s)")
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sessions = {"as exported": ort.InferenceSession(str(exported), so),
                "fused": ort.InferenceSession(str(fused), so)}
    x = np.random.default_rng(0).standard_normal((a.T, a.B, a.F)).astype(np.float32)
    feeds = {"x": x, "n": np.array(a.T, np.int64)}
    with torch.no_grad():
        want = [v.numpy() for v in module(torch.from_numpy(x), torch.tensor(a.T))]
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for k, s in sessions.items():
        got = s.run(None, feeds)
        print(f"{k}: max |difference| from torch {max(float(np.abs(g - w).max()) for g, w in zip(got, want)):.1e}")
        for _ in range(3):
            s.run(None, feeds)
    for _ in range(a.runs):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"T={a.T} B={a.B} F={a.F} H={a.H}, onnxruntime {ort.__version__}, 1 thread, medians of {a.runs} interleaved runs:")
    for k, v in med.items():
        print(f"  {k}: {v * 1e3:.3f} ms")
    print(f"  ratio {med['as exported'] / med['fused']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
