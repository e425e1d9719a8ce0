"""A recurrence whose outputs are written into a preallocated buffer (``outs[t] = h``): onnxruntime latency of
the export, and of rnnfuse's output, side by side.

    python benchmarks/output_buffer.py [--steps 200] [--batch 16] [--runs 40] [--threads 1] [--baseline OLD_CHECKOUT]

Exports a torch loop over ``nn.GRUCell`` (input 64, hidden 128) that collects h in ``torch.zeros(T, B, H)``
with ``torch.onnx.export(dynamo=False)`` (one ScatterND per step, each copying the buffer), optimizes it with
this checkout (and, with ``--baseline``, with another one, through its command line) and times the models
interleaved on the same input, printing medians (first 5 runs dropped), node counts and the largest difference
from the export's output.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings


def export(path: str, steps: int, batch: int, features: int = 64, hidden: int = 128) -> None:
    import torch

    warnings.filterwarnings("ignore")

    class BufferLoop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.GRUCell(features, hidden)

        def forward(self, x):
            h = torch.zeros(x.shape[1], hidden)
            outs = torch.zeros(x.shape[0], x.shape[1], hidden)
            for t in range(x.shape[0]):
                h = self.cell(x[t], h)
                outs[t] = h
            return outs

    torch.manual_seed(0)
    f = io.BytesIO()
    torch.onnx.export(BufferLoop().eval(), (torch.randn(steps, batch, features),), f, dynamo=False, opset_version=17,
                      input_names=["x"], dynamic_axes={"x": {1: "batch"}})
    with open(path, "wb") as out:
        out.write(f.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--baseline", help="another rnnfuse checkout to compare with (run through its command line)")
    args = ap.parse_args(argv)

    import numpy as np
    import onnx
    import onnxruntime as ort

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        models = {"export": os.path.join(tmp, "export.onnx")}
        export(models["export"], args.steps, args.batch)
        trees = {"rnnfuse": here, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
        for label, tree in trees.items():
            models[label] = os.path.join(tmp, f"{label}.onnx")
            env = dict(os.environ, PYTHONPATH=tree)
            subprocess.run([sys.executable, "-m", "rnnfuse", "optimize", models["export"], models[label], "-q"],
                           env=env, check=True, cwd=tmp)  # (not this directory: python -m would import from it)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
        sessions = {k: ort.InferenceSession(p, so) for k, p in models.items()}
        x = np.random.default_rng(0).standard_normal((args.steps, args.batch, 64)).astype(np.float32)
        want = sessions["export"].run(None, {"x": x})[0]
        times: dict[str, list[float]] = {k: [] for k in sessions}
        worst = {k: 0.0 for k in sessions}
        for r in range(args.runs):
            order = list(sessions)[r % len(sessions):] + list(sessions)[:r % len(sessions)]
            for k in order:
                t0 = time.perf_counter()
                got = sessions[k].run(None, {"x": x})[0]
                times[k].append(time.perf_counter() - t0)
                worst[k] = max(worst[k], float(np.abs(got - want).max()))
        print(f"T={args.steps} B={args.batch} F=64 H=128, onnxruntime {ort.__version__}, {args.threads} thread(s), "
              f"{args.runs} interleaved runs (first 5 dropped)")
        for k, p in models.items():
            print(f"  {k:9s} {len(onnx.load(p).graph.node):6d} nodes  median {statistics.median(times[k][5:]) * 1e3:8.2f} ms"
                  f"  max |diff| {worst[k]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
