"""How long onnxruntime takes to load a model with pre-packing off, with and without the memory pattern.

    python benchmarks/ort_prepacking.py [--sizes 10000,25000,50000] [--out benchmarks/results]

rnnfuse turns pre-packing off where it would only copy weights (the do-no-harm guard loads a weight-heavy
model from a copy without its weights; a check model on the file route reads memory-mapped weights). With
pre-packing off, onnxruntime lays every initializer out with its memory-pattern planner when the session's
memory pattern is on (the default), and that planner's cost grows with the square of the initializers
(seen with onnxruntime 1.32). So rnnfuse turns the pattern off with pre-packing
(``rnnfuse.check_session.without_prepacking``). This times the three ways on elementwise chains with a weight
per Add and Mul (``benchmarks/graphs.py``: half as many initializers as nodes), one session each, one thread,
graph optimizations off, as the guard loads them; medians of 3. Writes ``results/ort_prepacking.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphs import elementwise_chain  # noqa: E402

WAYS = {
    "pre-packing on (the default)": (False, True),
    "pre-packing off, memory pattern on": (True, True),
    "pre-packing off, memory pattern off (rnnfuse)": (True, False),
}


def load_seconds(ort, path: str, prepacking_off: bool, pattern: bool) -> float:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if prepacking_off:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_mem_pattern = pattern
    t0 = time.perf_counter()
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return time.perf_counter() - t0


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,25000,50000", help="node counts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in a.sizes.split(",")]:
            path = os.path.join(tmp, f"chain_{n}.onnx")
            elementwise_chain(path, n)
            times = {way: statistics.median(load_seconds(ort, path, *how) for _ in range(a.runs)) for way, how in WAYS.items()}
            rows.append((n, times))
            print(n, {k: round(v, 2) for k, v in times.items()}, flush=True)
    lines = [f"# onnxruntime {ort.__version__}: loading with pre-packing off", "",
             "`python benchmarks/ort_prepacking.py`: elementwise chains with a weight per Add and Mul (half as many "
             "initializers as nodes), one thread, graph optimizations off, medians of "
             f"{a.runs} loads, seconds.", "",
             "| nodes | initializers | " + " | ".join(WAYS) + " |", "|---|---|" + "---|" * len(WAYS)]
    for n, times in rows:
        lines.append(f"| {n:,} | {n // 2:,} | " + " | ".join(f"{times[w]:.2f}" for w in WAYS) + " |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ort_prepacking.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
