"""Child process of ``run.py``: the wall time and peak memory of one ``rnnfuse.optimize`` call.

    python benchmarks/optimizer_cost.py IN.onnx --json OUT.json [--save FUSED.onnx] [--post-padded] [--no-validate]
                                        [--warmup SMALL.onnx]

Memory is measured in this fresh process so that nothing else shares its heap. Libraries are imported and the
model is loaded first; then the resident-set high-water mark is reset (Linux: ``/proc/self/clear_refs``), and
after the call ``peak_extra_mb`` = high-water mark - resident set before the call: the memory the optimizer
needed *on top of* the loaded input model. ``peak_rss_mb`` is the whole process' high-water mark (libraries
included). Where the reset is not available, the process-wide ``ru_maxrss`` is used instead (an upper bound).

``--cli OUT.onnx`` instead runs the command line ``python -m rnnfuse optimize IN OUT -q`` as a grandchild and
reports its whole-process peak (``RUSAGE_CHILDREN``'s ``ru_maxrss``, the way ``tests/test_large.py`` measures
the memory bound), and the same for a process that only imports rnnfuse and onnxruntime (``cli_baseline_mb``):
for small models the libraries dominate that figure.

``--warmup SMALL.onnx`` optimizes a small model first ("warm"): lazy imports, onnxruntime's environment and
thread pools and other one-time costs are then paid before the baseline, so the peak is what *this* model
costs in a process that is already up. Without it ("cold") those one-time costs (~15-30 MB) are included.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time


RECURRENT_OPS = ("LSTM", "GRU", "RNN", "Loop", "Scan")


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _graph_nodes(graph) -> int:
    n = 0
    for node in graph.node:
        n += 1
        for a in node.attribute:
            if a.g is not None and a.HasField("g"):
                n += _graph_nodes(a.g)
            for g in a.graphs:
                n += _graph_nodes(g)
    return n


def _child_peak_mb(cmd: list[str]) -> tuple[float, int, str]:
    """Peak RSS of ``cmd`` run as a child of a fresh wrapper process (so RUSAGE_CHILDREN sees only it)."""
    import subprocess

    wrapper = ("import json, resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, "
               "text=True); print(json.dumps([resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "p.returncode, p.stderr[-400:]]))")
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    kb, rc, err = json.loads(out.stdout)
    return kb / 1024, rc, err


def measure_cli(src: str, dst: str, out_json: str) -> int:
    t0 = time.perf_counter()
    peak, rc, err = _child_peak_mb([sys.executable, "-m", "rnnfuse", "optimize", src, dst, "-q", "--force"])
    seconds = time.perf_counter() - t0
    base, _, _ = _child_peak_mb([sys.executable, "-c", "import numpy, onnx, onnxruntime, rnnfuse, rnnfuse.validate"])
    rec = {"input": src, "file_mb": os.path.getsize(src) / 2**20, "cli_seconds": seconds, "cli_peak_rss_mb": peak,
           "cli_baseline_mb": base, "cli_rc": rc}
    if rc != 0:
        rec["error"] = f"rnnfuse optimize exited {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    with open(out_json, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("input")
    ap.add_argument("--json", required=True)
    ap.add_argument("--save")
    ap.add_argument("--post-padded", action="store_true")
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument("--warmup", help="optimize this (small) model first, outside the measurement")
    ap.add_argument("--cli", metavar="OUT", help="measure `python -m rnnfuse optimize INPUT OUT` instead")
    a = ap.parse_args(argv)
    if a.cli:
        return measure_cli(a.input, a.cli, a.json)

    import numpy  # noqa: F401  - imported before the baseline, like everything the optimizer uses
    import onnx
    import onnxruntime  # noqa: F401

    import rnnfuse
    import rnnfuse.validate  # noqa: F401

    if a.warmup:
        rnnfuse.optimize(onnx.load(a.warmup), post_padded=a.post_padded, validate=not a.no_validate)
    model = onnx.load(a.input)
    gc.collect()
    rss0 = _status_kb("VmRSS")
    exact = _reset_peak() and rss0 is not None
    t0 = time.perf_counter()
    fused, report = rnnfuse.optimize(model, post_padded=a.post_padded, validate=not a.no_validate)
    seconds = time.perf_counter() - t0
    hwm = _status_kb("VmHWM") if exact else None
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if exact:
        extra_kb = hwm - rss0
    else:  # no reset: the process-wide peak (includes imports and the input model)
        extra_kb = maxrss_kb
    if a.save:
        onnx.save(fused, a.save)
    findings = report.findings
    out = {
        "input": a.input,
        "file_mb": os.path.getsize(a.input) / 2**20,
        "seconds": seconds,
        "peak_extra_mb": extra_kb / 1024,
        "peak_rss_mb": maxrss_kb / 1024,
        "peak_method": "VmHWM reset" if exact else "ru_maxrss",
        "post_padded": a.post_padded,
        "validate": not a.no_validate,
        "warm": bool(a.warmup),
        "nodes_before": _graph_nodes(model.graph),
        "nodes_after": _graph_nodes(fused.graph),
        "fused": sum(f.status == "fused" for f in findings),
        "merged": sum(f.status == "merged" for f in findings),
        "declined": sum(f.status == "declined" for f in findings),
        "ops_after": sorted({n.op_type for n in fused.graph.node if n.op_type in RECURRENT_OPS}),
        "report": report.to_text(),
    }
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
