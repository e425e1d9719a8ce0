"""``rnnfuse bench``: onnxruntime latency of a model before and after fusion, measured side by side.

Inputs are random but respect the model: static dims as declared, symbolic dims from ``--batch`` /
``--seq-len`` (the first symbolic dim of an input is its batch, the second its time, unless their names say
otherwise), integer inputs that index a table stay in range, and rank-3 inputs get padded steps (zeros,
which is what Keras' Masking(0.0) and Embedding(mask_zero=True) treat as padding) in the chosen pattern.
Runs of the two models alternate so both see the same machine state; medians and the 10th-90th percentile
spread are reported, with the thread count and library versions.
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from .errors import InputError, OutputError


@dataclass
class Timing:
    model: str
    batch: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


@dataclass
class BenchResult:
    batch: int
    seq_len: int
    threads: int
    original: Timing
    fused: Timing
    speedup: float
    max_abs_diff: float


@dataclass
class BenchReport:
    input: str
    results: list[BenchResult] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)


def versions() -> dict:
    import onnxruntime as ort

    from . import __version__

    return {
        "rnnfuse": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }


_BATCH_NAMES = re.compile(r"(batch|^b$|^n$|^bs$)", re.I)
_TIME_NAMES = re.compile(r"(time|seq|^t$|len|steps)", re.I)


def make_inputs(model: onnx.ModelProto, batch: int, seq_len: int, mask: str, rng: np.random.Generator) -> dict:
    from .graph import Model
    from .validate import _index_ranges

    m = Model(model)
    g = m.graph
    ranges = _index_ranges(g)
    dims: dict = {}
    feeds = {}
    for name in g.input_names:
        if name in g.initializers:
            continue
        shape = m.shape(name)
        et = m.elem_type(name)
        if shape is None:
            raise InputError(f"input '{name}' has no declared shape")
        sym_pos = 0
        concrete = []
        for d in shape:
            if isinstance(d, int) and d > 0:
                concrete.append(d)
                continue
            key = d if isinstance(d, str) else f"{name}:{len(concrete)}"
            if key not in dims:
                if isinstance(d, str) and _BATCH_NAMES.search(d):
                    dims[key] = batch
                elif isinstance(d, str) and _TIME_NAMES.search(d):
                    dims[key] = seq_len
                else:
                    dims[key] = [batch, seq_len][sym_pos] if sym_pos < 2 else 8
            sym_pos += 1
            concrete.append(dims[key])
        np_t = helper.tensor_dtype_to_np_dtype(et)
        if np.issubdtype(np_t, np.floating):
            v = rng.standard_normal(concrete).astype(np_t)
        elif np_t == np.bool_:
            v = rng.random(concrete) < 0.8
        else:
            v = rng.integers(1, max(ranges.get(name, 3), 2), size=concrete).astype(np_t)
        if mask != "none" and v.ndim >= 2 and v.dtype != np.bool_:
            _pad(v, mask, rng)
        feeds[name] = v
    return feeds


def _pad(v: np.ndarray, kind: str, rng) -> None:
    """Zero out padded steps along axis 1 (batch-first) row by row."""
    B, T = v.shape[0], v.shape[1]
    for b in range(B):
        L = int(rng.integers(max(1, T // 2), T + 1)) if b else T
        if kind == "post":
            v[b, L:] = 0
        elif kind == "pre":
            v[b, : T - L] = 0
        elif kind == "gappy":
            v[b, rng.random(T) < 0.3] = 0


def session(model_bytes: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def time_side_by_side(sessions: dict, feeds: dict, runs: int, warmup: int) -> dict[str, list[float]]:
    """Alternate runs of every session (order rotating) and return per-run milliseconds."""
    names = list(sessions)
    for _ in range(warmup):
        for n in names:
            sessions[n].run(None, feeds)
    times = {n: [] for n in names}
    for r in range(runs):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            sessions[n].run(None, feeds)
            times[n].append((time.perf_counter() - t0) * 1000.0)
    return times


def summarize(name: str, batch: int, ms: list[float]) -> Timing:
    q = np.percentile(ms, [10, 90])
    return Timing(name, batch, statistics.median(ms), float(q[0]), float(q[1]), len(ms))


def bench_pair(original: onnx.ModelProto, fused: onnx.ModelProto, batches: list[int], seq_len: int, threads: int,
               runs: int, warmup: int, mask: str, seed: int = 0) -> list[BenchResult]:
    rng = np.random.default_rng(seed)
    s_o = session(original.SerializeToString(), threads)
    s_f = session(fused.SerializeToString(), threads)
    out = []
    for b in batches:
        feeds = make_inputs(original, b, seq_len, mask, rng)
        ref = s_o.run(None, feeds)
        got = s_f.run(None, feeds)
        diff = max((float(np.max(np.abs(a.astype(np.float64) - c.astype(np.float64)))) if a.size else 0.0)
                   for a, c in zip(ref, got))
        t = time_side_by_side({"original": s_o, "fused": s_f}, feeds, runs, warmup)
        to, tf = summarize("original", b, t["original"]), summarize("fused", b, t["fused"])
        out.append(BenchResult(b, seq_len, threads, to, tf, to.median_ms / tf.median_ms, diff))
    return out


def format_table(results: list[BenchResult]) -> str:
    lines = [
        "| batch | T | threads | original ms (p10-p90) | fused ms (p10-p90) | speedup | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.batch} | {r.seq_len} | {r.threads} | {r.original.median_ms:.3f} ({r.original.p10_ms:.3f}-{r.original.p90_ms:.3f}) "
            f"| {r.fused.median_ms:.3f} ({r.fused.p10_ms:.3f}-{r.fused.p90_ms:.3f}) | {r.speedup:.2f}x | {r.max_abs_diff:.1e} |"
        )
    return "\n".join(lines)


def plot(results: list[BenchResult], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutputError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = np.arange(len(results))
    ax.bar(xs - 0.2, [r.original.median_ms for r in results], 0.4, label="original")
    ax.bar(xs + 0.2, [r.fused.median_ms for r in results], 0.4, label="fused")
    ax.set_xticks(xs, [f"batch {r.batch}" for r in results])
    ax.set_ylabel("median latency (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench_cli(args) -> int:
    from . import model_io
    from .pipeline import Options, Pipeline
    from .graph import Model

    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        from .errors import UsageError

        raise UsageError(f"--batch takes comma-separated integers, not '{args.batch}'") from None
    if args.plot:
        model_io.check_writable(args.plot)
    original, _ = model_io.load(args.input)
    if args.output:
        fused, _ = model_io.load(args.output)
    else:
        c = onnx.ModelProto()
        c.CopyFrom(original)
        model = Model(c)
        rep = Pipeline.default().run(model, Options(post_padded=args.post_padded))
        fused = model.proto
        if not args.quiet:
            print(rep.to_text())
    report = BenchReport(args.input, versions=versions())
    report.results = bench_pair(original, fused, batches, args.seq_len, args.threads, args.runs, args.warmup, args.mask)
    if not args.quiet:
        v = report.versions
        print(f"onnxruntime {v['onnxruntime']} CPU, {args.threads} thread(s), {args.runs} interleaved runs, "
              f"{args.mask}-padded inputs, median (p10-p90)")
    print(format_table(report.results))
    if args.plot:
        plot(report.results, args.plot, args.input)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


def prefer_faster(source: onnx.ModelProto, model, report, opts, args, progress=lambda m: None):
    """For each fused recurrence, time the model with and without it and keep the faster form."""
    from .graph import Model
    from .pipeline import Options, Pipeline

    try:
        batches = [int(b) for b in str(args.prefer_faster).split(",") if b.strip()]
    except ValueError:
        from .errors import UsageError

        raise UsageError(f"--prefer-faster takes comma-separated batch sizes, not '{args.prefer_faster}'") from None
    decisions = []
    keep: set = set()
    fused = [f for f in report.findings if f.status == "fused"]
    rng = np.random.default_rng(0)
    best = model.proto
    for f in fused:
        trial_opts = Options(validate=False, post_padded=opts.post_padded, seed=opts.seed, keep=keep | {f.where})
        c = onnx.ModelProto()
        c.CopyFrom(source)
        m2 = Model(c, external_dir=model.external_dir)
        Pipeline.default().run(m2, trial_opts)
        s_native = session(best.SerializeToString(), args.threads)
        s_orig = session(m2.proto.SerializeToString(), args.threads)
        native_ms = orig_ms = 0.0
        for b in batches:
            feeds = make_inputs(source, b, args.seq_len, "post", rng)
            t = time_side_by_side({"native": s_native, "original": s_orig}, feeds, runs=20, warmup=3)
            native_ms += statistics.median(t["native"])
            orig_ms += statistics.median(t["original"])
        progress(f"{f.where}: native {native_ms:.2f} ms, original {orig_ms:.2f} ms")
        if orig_ms < native_ms:
            keep.add(f.where)
            best = m2.proto
            decisions.append(f"kept {f.front} '{f.where}' as it was: {orig_ms:.2f} ms vs {native_ms:.2f} ms native "
                             f"at batch {args.prefer_faster}, T={args.seq_len}, {args.threads} thread(s)")
        else:
            decisions.append(f"native {f.cell} for '{f.where}': {native_ms:.2f} ms vs {orig_ms:.2f} ms as it was "
                             f"at batch {args.prefer_faster}, T={args.seq_len}, {args.threads} thread(s)")
    if keep:
        c = onnx.ModelProto()
        c.CopyFrom(source)
        model = Model(c, external_dir=model.external_dir)
        report = Pipeline.default().run(model, Options(validate=opts.validate, post_padded=opts.post_padded, seed=opts.seed, keep=keep))
    return model, report, decisions
