"""How the optimizer's cost grows with the graph: 25k / 50k / 100k / 200k nodes, through the command line.

    python benchmarks/scaling.py [--sizes 25000,50000,100000,200000] [--graphs lstmcell,elementwise]
                                 [--runs 3] [--out benchmarks/results] [--cache benchmarks/.cache]
    python benchmarks/scaling.py --generate elementwise --nodes 100000 OUT.onnx    # just write one graph

Two graphs, the two ends of what a long unrolled model can be:

* ``lstmcell``: a torch loop over ``nn.LSTMCell`` (input 32, hidden 64, batch 4) exported by
  ``torch.onnx.export(dynamo=False)``: 18 nodes per step, so T = nodes / 18 (T=6000 is 108k nodes). rnnfuse
  fuses it into one LSTM (validated numerically, as always).
* ``elementwise``: a chain of Add / Mul / Tanh / Sigmoid on a [batch, 16] tensor, each Add and Mul with a
  weight vector of its own: a big model with nothing to fuse (and nothing to merge).

Each graph is timed with the real command line (``python -m rnnfuse optimize IN OUT --json J``, wall clock
including start-up, load, passes and save) ``--runs`` times; the table gives medians of the wall time, of each
pass's time (from the JSON report) and of the process' peak resident set (``RUSAGE_CHILDREN``), next to the
peak of a process that only imports what the CLI imports (the libraries' share) and the model file's size.
Writes ``results/scaling.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
NODES_PER_STEP = 18  # torch's LSTMCell trace export


def lstmcell_chain(path: str, nodes: int) -> int:
    """A torch loop over nn.LSTMCell with ``nodes // 18`` steps; returns the node count."""
    import onnx
    import torch

    warnings.filterwarnings("ignore")
    steps = max(2, nodes // NODES_PER_STEP)

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.LSTMCell(32, 64)

        def forward(self, x):
            h = torch.zeros(x.shape[1], 64)
            c = torch.zeros(x.shape[1], 64)
            outs = []
            for t in range(x.shape[0]):
                h, c = self.cell(x[t], (h, c))
                outs.append(h)
            return torch.stack(outs)

    torch.manual_seed(0)
    torch.onnx.export(Chain().eval(), (torch.randn(steps, 4, 32),), path, dynamo=False, input_names=["x"],
                      output_names=["y"], do_constant_folding=False)
    return len(onnx.load(path).graph.node)


def elementwise_chain(path: str, nodes: int, width: int = 16) -> int:
    """``nodes`` elementwise nodes in one chain (Add w, Mul w, Tanh, Sigmoid, repeated), nothing to fuse."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    g = onnx.GraphProto()
    g.name = "elementwise_chain"
    g.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", width]))
    cur = "x"
    for i in range(nodes):
        op = ("Add", "Mul", "Tanh", "Sigmoid")[i % 4]
        out = "y" if i == nodes - 1 else f"v{i}"
        n = g.node.add()
        n.op_type, n.name = op, f"{op}_{i}"
        n.input.append(cur)
        if op in ("Add", "Mul"):
            w = (rng.standard_normal(width) * 0.1 + (1.0 if op == "Mul" else 0.0)).astype(np.float32)
            g.initializer.append(numpy_helper.from_array(w, f"w{i}"))
            n.input.append(f"w{i}")
        n.output.append(out)
        cur = out
    g.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", width]))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    return nodes


GENERATORS = {"lstmcell": lstmcell_chain, "elementwise": elementwise_chain}

PEAK = ("import json, resource, subprocess, sys, time; t0 = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); t = time.perf_counter() - t0; "
        "ru = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(json.dumps([t, ru.ru_maxrss / 1024, p.returncode, p.stderr[-600:], ru.ru_utime + ru.ru_stime]))")


def _child(cmd: list[str]) -> tuple[float, float, int, str, float]:
    """(wall seconds, peak RSS MB, exit code, stderr tail, CPU seconds) of ``cmd`` run under a fresh wrapper."""
    out = subprocess.run([sys.executable, "-c", PEAK, *cmd], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout))


def measure(src: str, runs: int) -> dict:
    d = tempfile.mkdtemp(prefix="rnnfuse-scaling-")
    dst, rep = os.path.join(d, "out.onnx"), os.path.join(d, "report.json")
    walls, cpus, peaks, per_pass = [], [], [], {}
    report = None
    for _ in range(runs):
        for f in (dst, rep):
            if os.path.exists(f):
                os.remove(f)
        wall, peak, rc, err, cpu = _child([sys.executable, "-m", "rnnfuse", "optimize", src, dst, "-q", "--json", rep])
        if rc:
            raise RuntimeError(f"rnnfuse optimize {src} exited {rc}: {err}")
        walls.append(wall)
        cpus.append(cpu)
        peaks.append(peak)
        with open(rep) as f:
            report = json.load(f)
        seen: dict = {}
        for p in report["passes"]:  # a pass that runs twice is listed twice: dedupe, dedupe#2
            k = seen[p["name"]] = seen.get(p["name"], 0) + 1
            per_pass.setdefault(p["name"] + (f"#{k}" if k > 1 else ""), []).append(p["seconds"])
        per_pass.setdefault("(all passes)", []).append(report["seconds"])
    import onnx

    out_nodes = len(onnx.load(dst, load_external_data=False).graph.node)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    os.rmdir(d)
    fused = sum(1 for p in report["passes"] for f in p["findings"] if f["status"] == "fused")
    return {
        "wall": statistics.median(walls), "walls": walls, "cpu": statistics.median(cpus), "peak_mb": statistics.median(peaks),
        "passes": {k: statistics.median(v) for k, v in per_pass.items()},
        "nodes_after": out_nodes, "fused": fused, "file_mb": os.path.getsize(src) / 2**20,
    }


def baseline_mb() -> float:
    return _child([sys.executable, "-c", "import numpy, onnx, onnxruntime, rnnfuse.cli, rnnfuse.pipeline, "
                   "rnnfuse.validate, rnnfuse.passes"])[1]


def table(results: list[dict], base: float) -> str:
    names: list[str] = []
    for r in results:
        for k in r["m"]["passes"]:
            if k not in names and k != "(all passes)":
                names.append(k)
    head = ("| graph | nodes | file MB | wall s | CPU s | passes s (wall) | outside passes s | peak RSS MB | "
            "RSS - libs MB | x file | nodes after |")
    lines = [head, "|---" * 11 + "|"]
    for r in results:
        m = r["m"]
        passes = m["passes"]["(all passes)"]
        extra = m["peak_mb"] - base
        lines.append(f"| {r['graph']} | {r['nodes']:,} | {m['file_mb']:.1f} | **{m['wall']:.2f}** | {m['cpu']:.2f} | {passes:.2f} | "
                     f"{m['wall'] - passes:.2f} | {m['peak_mb']:.0f} | {extra:.0f} | {extra / m['file_mb']:.1f} | "
                     f"{m['nodes_after']:,} |")
    lines.append("")
    lines.append("Per pass (median seconds):")
    lines.append("")
    lines.append("| graph | nodes | " + " | ".join(names) + " |")
    lines.append("|---|---|" + "---|" * len(names))
    for r in results:
        p = r["m"]["passes"]
        lines.append(f"| {r['graph']} | {r['nodes']:,} | " + " | ".join(f"{p.get(k, 0):.3f}" for k in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25000,50000,100000,200000", help="elementwise node counts")
    ap.add_argument("--lstm-sizes", default="27000,54000,108000,216000",
                    help="lstmcell node counts (T = nodes // 18: 108000 is T=6000)")
    ap.add_argument("--name", default="scaling", help="results file name (results/NAME.md, .json)")
    ap.add_argument("--graphs", default="lstmcell,elementwise")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"))
    ap.add_argument("--generate", choices=sorted(GENERATORS), help="only write one graph to PATH")
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("path", nargs="?")
    a = ap.parse_args(argv)
    if a.generate:
        print(GENERATORS[a.generate](a.path, a.nodes))
        return 0
    os.makedirs(a.cache, exist_ok=True)
    results = []
    for graph in a.graphs.split(","):
        sizes = a.lstm_sizes if graph == "lstmcell" else a.sizes
        for size in (int(s) for s in sizes.split(",") if s):
            src = os.path.join(a.cache, f"scaling_{graph}_{size}.onnx")
            if not os.path.exists(src):
                GENERATORS[graph](src + ".tmp", size)
                os.replace(src + ".tmp", src)
            import onnx

            nodes = len(onnx.load(src, load_external_data=False).graph.node)
            m = measure(src, a.runs)
            print(f"{graph} {nodes}: wall {m['wall']:.2f} s, CPU {m['cpu']:.2f} s, peak {m['peak_mb']:.0f} MB, "
                  f"passes {m['passes']['(all passes)']:.2f} s", flush=True)
            results.append({"graph": graph, "nodes": nodes, "m": m})
    base = baseline_mb()
    load = os.getloadavg()
    text = (
        "# Optimizer cost as the graph grows\n\n"
        "`python -m rnnfuse optimize IN OUT -q --json J` (validation on), medians of "
        f"{a.runs} runs; wall time (and CPU time, user + system, which the load of a shared machine does not "
        "inflate) includes interpreter start-up, imports, load, passes and save. "
        "`lstmcell`: a torch loop over `nn.LSTMCell` (trace export, 18 nodes/step), fused into one LSTM. "
        "`elementwise`: Add/Mul/Tanh/Sigmoid chain, nothing to fuse. "
        f"'RSS - libs' is the peak minus a process that only imports the libraries ({base:.0f} MB).\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs; load average "
        f"{load[0]:.1f} at the end), Python {platform.python_version()}.\n\n" + table(results, base) + "\n"
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump({"baseline_mb": base, "results": results}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
