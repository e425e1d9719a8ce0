"""A model as exported and as rnnfuse fuses it, optimized through the CLI and timed side by side in onnxruntime
(one intra-op and one inter-op thread, runs interleaved): the medians, their ratio, and each model's largest
difference from the framework's outputs. Shared by the latency scripts of single export forms."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def arguments(doc: str, argv, stem: str) -> tuple[argparse.Namespace, Path, Path]:
    """The scripts' options (--T, --F, --H, --B, --runs, --out) and the paths of the exported and fused models
    (``stem``.onnx and ``stem``_fused.onnx in --out, or in a temporary directory)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in (("T", 100), ("F", 64), ("H", 128), ("B", 8), ("runs", 21)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", type=Path, default=None, help="where the two models are written (default: a temp dir)")
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix=f"rnnfuse_{stem}_"))
    out.mkdir(parents=True, exist_ok=True)
    return a, out / f"{stem}.onnx", out / f"{stem}_fused.onnx"


def fuse(exported: Path, fused: Path) -> bool:
    """``rnnfuse optimize exported fused`` through the CLI; prints its summary line and wall time."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "rnnfuse", "optimize", str(exported), str(fused)],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr.strip(), file=sys.stderr)
        return False
    print(r.stdout.strip().splitlines()[1], f"(CLI wall {time.perf_counter() - t0:.2f} s)")
    return True


def time_side_by_side(exported: Path, fused: Path, feeds: dict, want: list, runs: int, what: str) -> None:
    """Both models run on ``feeds`` (checked against ``want`` first), then ``runs`` interleaved timings each."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sessions = {"as exported": ort.InferenceSession(str(exported), so),
                "fused": ort.InferenceSession(str(fused), so)}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for k, s in sessions.items():
        got = s.run(None, feeds)
        print(f"{k}: max |difference| from the framework {max(float(np.abs(g - w).max()) for g, w in zip(got, want)):.1e}")
        for _ in range(3):
            s.run(None, feeds)
    for _ in range(runs):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{what}, onnxruntime {ort.__version__}, 1 thread, medians of {runs} interleaved runs:")
    for k, v in med.items():
        print(f"  {k}: {v * 1e3:.3f} ms")
    print(f"  ratio {med['as exported'] / med['fused']:.2f}x")


def run(doc: str, argv, stem: str, export, inputs) -> int:
    """A latency script's whole run: its options, ``export(path, T, F, H, B)`` (returns the torch module),
    the CLI's fusion, then both models timed on ``inputs(options)`` (the feeds by input name, in the module's
    argument order), checked against the module's outputs."""
    import numpy as np
    import torch

    a, exported, fused = arguments(doc, argv, stem)
    module = export(exported, a.T, a.F, a.H, a.B)
    if not fuse(exported, fused):
        return 1
    feeds = inputs(a)
    with torch.no_grad():
        want = [v.numpy() for v in module(*(torch.from_numpy(np.asarray(v)) for v in feeds.values()))]
    time_side_by_side(exported, fused, feeds, want, a.runs, f"T={a.T} B={a.B} F={a.F} H={a.H}")
    return 0
