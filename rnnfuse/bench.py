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
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from .errors import InputError
from .feeds import random_values, valid_steps


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
    batch: int | None  # the sizes that ran (a static dim wins over the request)
    seq_len: int | None
    threads: int
    original: Timing
    fused: Timing
    speedup: float
    max_abs_diff: float
    requested_batch: int = 0
    requested_seq_len: int = 0
    batch_static: bool = False
    seq_len_static: bool = False
    shapes: dict = field(default_factory=dict)


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




@dataclass
class Sizes:
    """The sizes a benchmark ran at, which a model's static dims may have decided instead of the request."""

    batch: int | None  # None: no input had a dim rnnfuse could identify as the batch
    seq_len: int | None
    shapes: dict = field(default_factory=dict)  # input name -> the shape fed
    batch_static: bool = False  # the model fixes the batch: --batch was not used
    seq_len_static: bool = False

    def label(self) -> str:
        b = "?" if self.batch is None else str(self.batch)
        t = "?" if self.seq_len is None else str(self.seq_len)
        return f"batch {b}{' (static)' if self.batch_static else ''}, T {t}{' (static)' if self.seq_len_static else ''}"

    def shapes_text(self) -> str:
        return ", ".join(f"{n} [{'x'.join(map(str, s))}]" for n, s in self.shapes.items())


def make_inputs(model: onnx.ModelProto, batch: int, seq_len: int, mask: str, rng: np.random.Generator,
                sizes: list | None = None) -> dict:
    """Random feeds for ``model``; when ``sizes`` is a list, the :class:`Sizes` that ran is appended to it."""
    from .graph import Model
    from .feeds import index_ranges, input_sizes

    m = Model(model)
    g = m.graph
    ranges = index_ranges(g)
    dims: dict = {}
    feeds = {}
    used_batch = used_time = False
    static_batch = static_time = None
    for name in g.input_names:
        if name in g.initializers:
            continue
        shape = m.shape(name)
        et = m.elem_type(name)
        if shape is None:
            raise InputError(f"input '{name}' has no declared shape")
        concrete, roles = input_sizes(name, shape, dims, batch, seq_len)
        used_batch |= "batch" in roles
        used_time |= "time" in roles
        # a rank-3 sequence input with one symbolic leading dim: the other leading dim is static and is the
        # other size (batch-first or time-major alike)
        if len(concrete) >= 3 and roles[:2].count(None) == 1:
            other = concrete[roles[:2].index(None)]
            if "batch" in roles[:2] and static_time is None:
                static_time = other
            elif "time" in roles[:2] and static_batch is None:
                static_batch = other
        v = random_values(concrete, helper.tensor_dtype_to_np_dtype(et), rng, p_true=0.8,
                          index_range=ranges.get(name, 3), lowest_index=1)
        if mask != "none" and v.ndim >= 2 and v.dtype != np.bool_:
            # padded steps (batch-first: [B, T, ...]) are zero, which Keras' Masking(0.0) and
            # Embedding(mask_zero=True) treat as padding
            v[~valid_steps(mask, v.shape[1], v.shape[0], rng, realistic=True).T] = 0
        feeds[name] = v
    if sizes is not None:
        if not used_batch and not used_time:
            # every dim static: read batch and time off the first sequence input (batch-first, as Keras and
            # most exports; a time-major static model is reported with the two swapped, the shapes say which)
            seq = next((v for v in feeds.values() if v.ndim >= 3), None)
            if seq is not None:
                static_batch, static_time = seq.shape[0], seq.shape[1]
        sizes.append(Sizes(batch if used_batch else static_batch, seq_len if used_time else static_time,
                           {n: list(v.shape) for n, v in feeds.items()}, not used_batch, not used_time))
    return feeds


def _options(threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def session(model_bytes: bytes, threads: int):
    import onnxruntime as ort

    return ort.InferenceSession(model_bytes, _options(threads), providers=["CPUExecutionProvider"])


def model_session(proto: onnx.ModelProto, tensor_array, threads: int):
    """A timing session of a model being optimized, whose weights may be external data (the input's files,
    spilled or borrowed weights: see rnnfuse.check_session.whole_model_session); pre-packed, as deployed."""
    import onnxruntime as ort

    from .check_session import whole_model_session

    return whole_model_session(ort, proto, tensor_array, _options(threads), prepack=True)


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
    """Time both models at each requested batch; a batch the model's static dims override runs once."""
    rng = np.random.default_rng(seed)
    s_o = session(original.SerializeToString(), threads)
    s_f = session(fused.SerializeToString(), threads)
    out: list[BenchResult] = []
    seen_shapes = []
    for b in batches:
        sizes: list[Sizes] = []
        feeds = make_inputs(original, b, seq_len, mask, rng, sizes)
        sz = sizes[0]
        if sz.shapes in seen_shapes:  # the model fixes the batch: another request would time the same thing
            continue
        seen_shapes.append(sz.shapes)
        ref = s_o.run(None, feeds)
        got = s_f.run(None, feeds)
        diff = max((float(np.max(np.abs(a.astype(np.float64) - c.astype(np.float64)))) if a.size else 0.0)
                   for a, c in zip(ref, got))
        t = time_side_by_side({"original": s_o, "fused": s_f}, feeds, runs, warmup)
        to, tf = summarize("original", sz.batch or b, t["original"]), summarize("fused", sz.batch or b, t["fused"])
        out.append(BenchResult(sz.batch, sz.seq_len, threads, to, tf, to.median_ms / tf.median_ms, diff,
                               requested_batch=b, requested_seq_len=seq_len, batch_static=sz.batch_static,
                               seq_len_static=sz.seq_len_static, shapes=sz.shapes))
    return out


def overrides(results: list[BenchResult], batches: list[int], seq_len: int) -> list[str]:
    """Plain sentences for every requested size that a static dimension of the model replaced."""
    if not results:
        return []
    notes = []
    r = results[0]
    shapes = r.shapes and "; inputs " + ", ".join(f"{n} [{'x'.join(map(str, s))}]" for n, s in r.shapes.items())
    if r.batch_static:
        asked = ",".join(map(str, batches))
        ran = "the model's own" if r.batch is None else str(r.batch)
        notes.append(f"--batch {asked} not used: the model's batch dimension is static, ran at batch {ran}{shapes}")
    if r.seq_len_static:
        ran = "the model's own length" if r.seq_len is None else str(r.seq_len)
        notes.append(f"--seq-len {seq_len} not used: the model's time dimension is static, ran at T {ran}{shapes}")
    return notes


def _size(v: int | None, static: bool) -> str:
    return ("?" if v is None else str(v)) + (" (static)" if static else "")


def format_table(results: list[BenchResult]) -> str:
    lines = [
        "| batch | T | threads | original ms (p10-p90) | fused ms (p10-p90) | speedup | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {_size(r.batch, r.batch_static)} | {_size(r.seq_len, r.seq_len_static)} | {r.threads} "
            f"| {r.original.median_ms:.3f} ({r.original.p10_ms:.3f}-{r.original.p90_ms:.3f}) "
            f"| {r.fused.median_ms:.3f} ({r.fused.p10_ms:.3f}-{r.fused.p90_ms:.3f}) | {r.speedup:.2f}x | {r.max_abs_diff:.1e} |"
        )
    return "\n".join(lines)


def require_matplotlib():
    """Import matplotlib's non-interactive backend, or say how to install it (checked before any timing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .errors import UsageError

        raise UsageError('--plot needs matplotlib: pip install "rnnfuse[plot]"') from None
    return plt


def plot(results: list[BenchResult], path: str, title: str, threads: int = 1, ort_version: str = "") -> None:
    """Grouped bars of median latency on a log axis (a 0.2 ms bar beside 8.8 ms stays visible), p10-p90
    error bars, the speedup above each pair, and the sizes, threads and onnxruntime version in the title."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.8 * len(results) + 2), 4))
    xs = np.arange(len(results))
    for off, key, colour in ((-0.2, "original", "#9e9e9e"), (0.2, "fused", "#1f77b4")):
        t = [getattr(r, key) for r in results]
        med = np.array([x.median_ms for x in t])
        err = np.array([[m - x.p10_ms for m, x in zip(med, t)], [x.p90_ms - m for m, x in zip(med, t)]])
        ax.bar(xs + off, med, 0.4, yerr=np.clip(err, 0, None), capsize=3, label=key, color=colour)
    ax.set_yscale("log")
    top = max(max(r.original.p90_ms, r.fused.p90_ms) for r in results) if results else 1.0
    for x, r in zip(xs, results):
        ax.annotate(f"{r.speedup:.2f}x", (x, max(r.original.p90_ms, r.fused.p90_ms)), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=9, fontweight="bold")
    ax.set_ylim(top=top * 2.5)
    ax.set_xticks(xs, [f"batch {_size(r.batch, r.batch_static)}\nT {_size(r.seq_len, r.seq_len_static)}"
                       for r in results])
    ax.set_ylabel("latency, ms (median, p10-p90; log scale)")
    ort = f"onnxruntime {ort_version} CPU, " if ort_version else ""
    ax.set_title(f"{title}\n{ort}{threads} thread(s)", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench_cli(args) -> int:
    import os
    import sys

    from . import model_io, progress
    from .output_checks import check_writable
    from .pipeline import Options, Pipeline
    from .graph import Model

    batches = args.batch if isinstance(args.batch, list) else [int(b) for b in str(args.batch).split(",")]
    if args.plot:  # before any work: a missing matplotlib or an unwritable path must not cost a benchmark
        require_matplotlib()
        check_writable(args.plot)
    if args.json and args.json != "-":
        check_writable(args.json)
    # with --json -, stdout carries only the JSON
    out = sys.stderr if args.json == "-" else sys.stdout
    original, _ = model_io.load(args.input)
    if args.output:
        fused, _ = model_io.load(args.output)
    else:
        c = onnx.ModelProto()
        c.CopyFrom(original)
        model = Model(c)
        rep = Pipeline.default().run(model, Options(post_padded=args.post_padded, seed=getattr(args, "seed", 0)))
        fused = model.proto
        if not args.quiet:
            progress.finish()
            print(rep.to_text(), file=out)
    progress.step(f"timing {args.runs} interleaved runs per model and batch")
    report = BenchReport(args.input, versions=versions())
    report.results = bench_pair(original, fused, batches, args.seq_len, args.threads, args.runs, args.warmup,
                                args.mask, seed=getattr(args, "seed", 0))
    progress.finish()
    report.decisions = overrides(report.results, batches, args.seq_len)
    v = report.versions
    if not args.quiet:
        print(f"onnxruntime {v['onnxruntime']} CPU, {args.threads} thread(s), {args.runs} interleaved runs, "
              f"{args.mask}-padded inputs, median (p10-p90)", file=out)
        for n in report.decisions:
            print(f"note: {n}", file=out)
    print(format_table(report.results), file=out)
    if args.plot:
        sizes = "; ".join(f"batch {_size(r.batch, r.batch_static)}, T {_size(r.seq_len, r.seq_len_static)}"
                          for r in report.results)
        plot(report.results, args.plot, f"{os.path.basename(args.input)}: {sizes}", args.threads, v["onnxruntime"])
        if not args.quiet:
            print(f"plot written to {os.path.abspath(args.plot)}", file=out)
    if args.json:
        text = json.dumps(asdict(report), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


def prefer_faster(source: onnx.ModelProto, model, report, opts, args, progress=lambda m: None):
    """For each fused recurrence, time the model with and without it and keep the faster form."""
    from .graph import Model
    from .pipeline import Options, Pipeline

    batches = args.prefer_faster
    if not isinstance(batches, list):
        batches = [int(b) for b in str(batches).split(",") if b.strip()]
    if not batches or min(batches) < 1:
        from .errors import UsageError

        raise UsageError(f"--prefer-faster takes positive batch sizes, not {args.prefer_faster}")
    asked = ",".join(map(str, batches))
    decisions = []
    keep: set = set()
    fused = [f for f in report.findings if f.status == "fused"]
    rng = np.random.default_rng(0)
    best = model.proto
    for f in fused:
        trial_opts = Options(validate=False, post_padded=opts.post_padded, seed=opts.seed, keep=keep | {f.where},
                             portable=opts.portable)
        c = onnx.ModelProto()
        c.CopyFrom(source)
        m2 = Model(c, external_dir=model.external_dir)
        Pipeline.default().run(m2, trial_opts)
        s_native = model_session(best, model.tensor_array, args.threads)
        s_orig = model_session(m2.proto, model.tensor_array, args.threads)
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
                             f"at batch {asked}, T={args.seq_len}, {args.threads} thread(s)")
        else:
            decisions.append(f"native {f.cell} for '{f.where}': {native_ms:.2f} ms vs {orig_ms:.2f} ms as it was "
                             f"at batch {asked}, T={args.seq_len}, {args.threads} thread(s)")
    if keep:
        c = onnx.ModelProto()
        c.CopyFrom(source)
        model = Model(c, external_dir=model.external_dir)
        report = Pipeline.default().run(model, Options(validate=opts.validate, post_padded=opts.post_padded, seed=opts.seed, keep=keep,
                                                               portable=opts.portable))
    return model, report, decisions
