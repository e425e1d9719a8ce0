"""Turn the measurements of ``run.py`` into ``results.md``, ``results.csv``, ``results.png`` and ``results.json``."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the goals (from the benchmark issue); a miss is printed plainly, never hidden
FLOOR_RATIO = 1.10  # every fused model within 1.10x of its floor
GEOMEAN_B1 = 2.0  # geomean speedup (original / fused) at batch 1
GEOMEAN_B16 = 1.25  # ... and at batch 16
MEM_RATIO = 2.0  # optimizer peak memory <= 2x the model file
EXACT_POST = 1.05  # exact path <= 5% over the post-padded path (at B=16)
EXACT_POST_BATCH = 16

VARIANTS = ("original", "fused", "post", "floor")
LABELS = {"original": "original", "fused": "fused (exact)", "post": "fused (post-padded)", "floor": "floor"}


@dataclass
class Row:
    """One model at one batch size."""

    model: str
    exporter: str
    describe: str
    masked: bool
    batch: int
    T: int
    timings: dict = field(default_factory=dict)  # original | fused | post | floor -> Timing
    diff_fused: float | None = None
    diff_post: float | None = None
    shapes_ok: bool = True
    error: str = ""
    profile: dict = field(default_factory=dict)  # fused | floor -> op_profile()

    def median(self, k: str) -> float | None:
        t = self.timings.get(k)
        return t.median_ms if t else None

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.median(a), self.median(b)
        return x / y if x and y else None

    @property
    def speedup(self) -> float | None:
        return self.ratio("original", "fused")

    @property
    def fused_floor(self) -> float | None:
        return self.ratio("fused", "floor")

    @property
    def exact_post(self) -> float | None:
        return self.ratio("fused", "post")


@dataclass
class Results:
    meta: dict
    rows: list  # Row
    optimizer: dict  # model -> {mode: record}
    openvino: dict = field(default_factory=dict)


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    ok: bool | None  # None: could not be evaluated


# --------------------------------------------------------------------------- helpers


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ms(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def timing(t) -> str:
    return "–" if t is None else f"{ms(t.median_ms)} ({ms(t.p10_ms)}–{ms(t.p90_ms)})"


def ratio(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}x"


def sci(x: float | None) -> str:
    return "–" if x is None else "inf" if math.isinf(x) else f"{x:.1e}"


def status(ok: bool | None) -> str:
    return "met" if ok else "**MISSED**" if ok is False else "n/a"


def opt_ratio(rec: dict) -> float | None:
    if "peak_extra_mb" not in rec:
        return None
    return rec["peak_extra_mb"] / rec["file_mb"]


def cli_extra(rec: dict) -> float:
    return rec["cli_peak_rss_mb"] - rec["cli_baseline_mb"]


def row_misses(r) -> list[str]:
    """The per-row goals this row misses, in words."""
    out = []
    if r.error:
        out.append(f"error: {r.error}")
    if r.fused_floor is not None and r.fused_floor > FLOOR_RATIO:
        out.append(f"fused/floor > {FLOOR_RATIO:.2f}")
    if r.masked and r.batch == EXACT_POST_BATCH and r.exact_post is not None and r.exact_post > EXACT_POST:
        out.append(f"exact/post > {EXACT_POST:.2f}")
    if r.diff_fused is not None and (not r.shapes_ok or r.diff_fused > 1e-4):
        out.append("fused output differs")
    return out


# --------------------------------------------------------------------------- goals


def evaluate_goals(res: Results) -> list[Goal]:
    rows = res.rows
    goals = []

    ff = [(r, r.fused_floor) for r in rows if r.fused_floor is not None]
    bad = [f"{r.model} B={r.batch} {x:.3f}x" for r, x in ff if x > FLOOR_RATIO]
    worst = max(ff, key=lambda p: p[1], default=None)
    measured = f"worst {worst[0].model} B={worst[0].batch}: {worst[1]:.3f}x" if worst else "no data"
    if bad:
        measured += f"; over: {', '.join(bad)}"
    missing = [f"{r.model} B={r.batch}" for r in rows if r.fused_floor is None]
    if missing:
        measured += f"; not measured: {', '.join(missing)}"
    goals.append(Goal("fused within 1.10x of its floor", f"fused/floor ≤ {FLOOR_RATIO:.2f} for every model and batch",
                      measured, (not bad and not missing) if ff else None))

    for b, target in ((1, GEOMEAN_B1), (16, GEOMEAN_B16)):
        g = geomean(r.speedup for r in rows if r.batch == b)
        n = sum(1 for r in rows if r.batch == b and r.speedup)
        goals.append(Goal(f"geomean speedup at batch {b}", f"≥ {target:.2f}x",
                          f"{g:.2f}x over {n} models" if g else "no data", None if g is None else g >= target))

    recs = [(m, o.get("exact", {})) for m, o in res.optimizer.items()]
    ratios = [(m, opt_ratio(e), e) for m, e in recs if opt_ratio(e) is not None]
    bad = [f"{m} {x:.1f}x ({e['peak_extra_mb']:.0f} MB / {e['file_mb']:.1f} MB)" for m, x, e in ratios if x > MEM_RATIO]
    worst = max(ratios, key=lambda p: p[1], default=None)
    measured = f"worst {worst[0]}: {worst[1]:.1f}x" if worst else "no data"
    if bad:
        measured += f"; over: {', '.join(bad)}"
    clis = [(m, cli_extra(o["cli"]) / o["cli"]["file_mb"]) for m, o in res.optimizer.items()
            if "cli_peak_rss_mb" in o.get("cli", {})]
    if clis:
        m, x = max(clis, key=lambda p: p[1])
        measured += f". Command line, peak RSS above an import-only process: worst {m} {x:.1f}x"
    goals.append(Goal("optimizer peak memory ≤ 2x the model file",
                      f"peak extra RSS of optimize() (warm process, validation on) ≤ {MEM_RATIO:.0f}x file size",
                      measured, None if not ratios else not bad))

    ep = [(r, r.exact_post) for r in rows if r.masked and r.batch == EXACT_POST_BATCH and r.exact_post]
    bad = [f"{r.model} {x:.3f}x" for r, x in ep if x > EXACT_POST]
    worst = max(ep, key=lambda p: p[1], default=None)
    measured = f"worst {worst[0].model}: {worst[1]:.3f}x" if worst else "no data"
    if bad:
        measured += f"; over: {', '.join(bad)}"
    T = res.meta["config"]["T"]
    if T != 100:
        measured += f" (measured at T={T}; the goal is stated at T=100)"
    goals.append(Goal("exact path ≤ 5% over post-padded",
                      f"fused(exact)/fused(post-padded) ≤ {EXACT_POST:.2f} for masked models at B={EXACT_POST_BATCH}",
                      measured, None if not ep else not bad))
    return goals


# --------------------------------------------------------------------------- markdown


def header(res: Results) -> list[str]:
    m, c, v = res.meta, res.meta["config"], res.meta["versions"]
    lines = ["# rnnfuse benchmark results", ""]
    if c["quick"]:
        lines += [f"**Quick run (T={c['T']}, {c['runs']} runs): a smoke test of the suite, not the goals' "
                  "configuration (T=100). Do not quote these numbers.**", ""]
    ex = m.get("exporters", {})
    exporters = ", ".join(f"{k} {val}" for k, val in ex.items())
    lines += [
        "| | |",
        "|---|---|",
        f"| date | {m['date']} |",
        f"| CPU | {m['cpu']} ({m['cores']} logical cores); load average 1/5/15 min at start {m['load_start']}, "
        f"at end {m.get('load_end', '?')} |",
        f"| runtime | onnxruntime {v['onnxruntime']} CPUExecutionProvider, intra-op threads {c['threads']}, "
        "inter-op threads 1, default graph optimizations |",
        f"| runs | {c['runs']} timed runs per variant after {c['warmup']} warm-up runs, the variants interleaved "
        "(rotating order) so all see the same machine state; median (p10–p90) in ms |",
        f"| sizes | T={c['T']}, F={c['F']}, H={c['H']}, batch {' and '.join(map(str, c['batches']))}; masked models "
        "get post-padded inputs (row 0 full, other rows a random length in [T/2, T], padded steps all-zero) |",
        f"| versions | rnnfuse {v['rnnfuse']}, onnx {v['onnx']}, numpy {v['numpy']}, python {v['python']}"
        f"{', ' + exporters if exporters else ''} |",
        f"| reproduce | `pip install -e . && {m['command'].strip()}` (this run took {m['wall_seconds'] / 60:.1f} min; "
        "exports are cached in `benchmarks/.cache`, `--rebuild` redoes them) |",
        "",
    ]
    return lines


def goals_section(res: Results, goals: list[Goal]) -> list[str]:
    lines = ["## Goals", "", "| goal | target | measured | status |", "|---|---|---|---|"]
    for g in goals:
        lines.append(f"| {g.name} | {g.target} | {g.measured} | {status(g.ok)} |")
    missed = [g.name for g in goals if g.ok is False]
    lines += ["", f"**{len(missed)} of {len(goals)} goals missed: {'; '.join(missed)}.**" if missed
              else "All goals met.", ""]
    g1 = geomean(r.speedup for r in res.rows if r.batch == 1)
    g16 = geomean(r.speedup for r in res.rows if r.batch == 16)
    lines += [f"Geometric-mean speedup (original / fused, all models): **batch 1: {ratio(g1)}**, "
              f"**batch 16: {ratio(g16)}**.", ""]
    return lines


def latency_section(res: Results) -> list[str]:
    lines = ["## Latency", "",
             "onnxruntime CPU, ms: median (p10–p90). speedup = original / fused; fused/floor and exact/post are "
             "ratios of medians; max |diff| compares each fused model's outputs with the original's on the same "
             "inputs.", "",
             "| model | B | original | fused (exact) | fused (post-padded) | floor | speedup | fused/floor | "
             "exact/post | max abs diff fused / post | goals missed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res.rows:
        t = r.timings
        misses = row_misses(r)
        lines.append(
            f"| {r.model} | {r.batch} | {timing(t.get('original'))} | {timing(t.get('fused'))} | "
            f"{timing(t.get('post'))} | {timing(t.get('floor'))} | {ratio(r.speedup)} | {ratio(r.fused_floor, 3)} | "
            f"{ratio(r.exact_post, 3)} | {sci(r.diff_fused)} / {sci(r.diff_post)} | "
            f"{'**' + '; '.join(misses) + '**' if misses else '–'} |")
    lines.append("")
    return lines


def gap_section(res: Results) -> list[str]:
    rows = [r for r in res.rows if r.profile]
    if not rows:
        return []
    lines = ["### Where the gap to the floor goes", "",
             "onnxruntime's profiler (separate runs after the timings above, fused and floor interleaved; "
             "profiling adds its own overhead): median ms per run inside the recurrent op kernels, inside all other "
             "kernels (largest op types listed), and outside any kernel (run minus kernels: per-node dispatch, "
             "allocation). A gap in *other kernels* or *outside* is the graph around the native op (mask handling, "
             "transposes, the Keras carried-output fix-up, the Masking layer itself); a gap in the recurrent op is "
             "the kernel.", "",
             "| model | B | fused: run | recurrent op | other kernels (largest) | outside kernels | floor: run | "
             "floor recurrent op |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    rnn = ("LSTM", "GRU", "RNN")
    for r in rows:
        f, fl = r.profile["fused"], r.profile["floor"]
        fk = f["kernels"]
        rec = sum(v for k, v in fk.items() if k in rnn)
        other = {k: v for k, v in fk.items() if k not in rnn}
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(other.items())[:4])
        lines.append(f"| {r.model} | {r.batch} | {ms(f['run_ms'])} | {ms(rec)} | {ms(sum(other.values()))}"
                     f"{' (' + top + ')' if top else ''} | {ms(f['run_ms'] - f['kernels_ms'])} | "
                     f"{ms(fl['run_ms'])} | {ms(sum(v for k, v in fl['kernels'].items() if k in rnn))} |")
    lines.append("")
    return lines


def elman_section(res: Results) -> list[str]:
    rows = [r for r in res.rows if r.model == "keras_simplernn" and r.timings]
    if not rows:
        return []
    lines = ["## onnxruntime's native RNN (Elman) kernel vs the loop (`rnnfuse optimize --prefer-faster`)", "",
             "The masked Keras SimpleRNN, tf2onnx Loop vs the fused native `RNN`. An earlier measurement of the "
             "bare kernel against the Loop at these sizes (onnxruntime 1.31, 1 thread) gave 0.54x at B=16 and 1.4x at B=1.", "",
             "| B | loop (original) ms | fused ms | floor (bare RNN op) ms | fused speedup | bare RNN op vs loop |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {ms(r.median('original'))} | {ms(r.median('fused'))} | {ms(r.median('floor'))} "
                     f"| {ratio(r.speedup)} | {ratio(r.ratio('original', 'floor'))} |")
    lines.append("")
    return lines


def optimizer_section(res: Results) -> list[str]:
    lines = ["## Optimizer cost", "",
             "Each figure from a fresh child process (`benchmarks/optimizer_cost.py`). *peak extra* = resident-set "
             "high-water mark during `rnnfuse.optimize()` minus the resident set just before it, with libraries "
             "imported and the model loaded (Linux `VmHWM`, reset through `/proc/self/clear_refs`). *warm*: a small "
             "model (`examples/keras_masked_bigru_lstm.onnx`) was optimized first in the same process, so "
             "one-time costs (lazy imports, onnxruntime's environment) are not counted; *cold*: first call. "
             "*CLI*: whole-process peak RSS of `python -m rnnfuse optimize IN OUT` (`RUSAGE_CHILDREN`, as "
             "`tests/test_large.py` measures it), and in brackets that minus the peak of a process that only imports "
             "the libraries, over the file size. The memory goal uses *warm, validation on*.", "",
             "| model | file MB | nodes (with subgraphs) | result | optimize s (no validation) | post-padded s | "
             "peak extra MB, warm (x file) | cold MB | no validation MB | CLI peak RSS MB (extra, x file) | "
             "≤ 2x file? |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, o in res.optimizer.items():
        e = o.get("exact", {})
        if "seconds" not in e:
            lines.append(f"| {name} | – | – | **{e.get('error') or o.get('error', 'failed')}** | | | | | | | |")
            continue
        cold, nov, post, cli = o.get("cold", {}), o.get("novalidate", {}), o.get("post", {}), o.get("cli", {})
        result = f"{e['fused']} fused, {e['merged']} merged, {e['declined']} declined -> {'/'.join(e['ops_after'])}"
        x = opt_ratio(e)
        nan = float("nan")
        post_s = f"{post['seconds']:.2f}" if "seconds" in post else "–"
        cli_s = (f"{cli['cli_peak_rss_mb']:.0f} (+{cli_extra(cli):.0f}, {cli_extra(cli) / cli['file_mb']:.1f}x)"
                 if "cli_peak_rss_mb" in cli and not cli.get("error") else cli.get("error", "–"))
        lines.append(
            f"| {name} | {e['file_mb']:.2f} | {e['nodes_before']} → {e['nodes_after']} | {result} | "
            f"{e['seconds']:.2f} ({nov.get('seconds', nan):.2f}) | {post_s} | "
            f"{e['peak_extra_mb']:.1f} ({x:.1f}x) | {cold.get('peak_extra_mb', nan):.1f} | "
            f"{nov.get('peak_extra_mb', nan):.1f} | {cli_s} | {'yes' if x <= MEM_RATIO else '**MISSED**'} |")
    lines.append("")
    notes = [f"{n}: {o['export_notes']}" for n, o in res.optimizer.items() if o.get("export_notes")
             and o["export_notes"] != "cached"]
    if notes:
        lines += ["Export notes: " + "; ".join(notes), ""]
    return lines


def openvino_section(res: Results) -> list[str]:
    if not res.openvino:
        return ["## OpenVINO", "", f"{res.meta.get('openvino', 'not requested')}.", ""]
    def cell(rec):
        if not rec:
            return "–"
        if rec.get("load") != "ok":
            return f"load fails: {rec.get('error', '')}".replace("|", "/")
        if rec.get("match") is None:
            return f"loads; {rec.get('error', '')}".replace("|", "/")
        return f"loads, {'matches' if rec['match'] else '**differs**'} ({sci(rec['max_abs_diff'])})"
    version = next((o.get("version") for o in res.openvino.values() if o.get("version")), None)
    lines = ["## OpenVINO", "",
             f"OpenVINO {version or '?'} CPU (`read_model` + `compile_model`, `INFERENCE_PRECISION_HINT=f32`), "
             "outputs compared with onnxruntime's outputs of the original on the batch-"
             f"{max(res.meta['config']['batches'])} benchmark inputs; *floor* (the bare native op, "
             "`sequence_lens` for masked models) is compared with onnxruntime's floor output.", "",
             "| model | original | fused (exact) | fused (post-padded) | floor |", "|---|---|---|---|---|"]
    for name, o in res.openvino.items():
        if "error" in o and not any(k in o for k in ("original", "fused")):
            lines.append(f"| {name} | {o['error']} | | | |")
            continue
        lines.append(f"| {name} | {cell(o.get('original'))} | {cell(o.get('fused'))} | {cell(o.get('post'))} | "
                     f"{cell(o.get('floor'))} |")
    lines.append("")
    masked = {r.model for r in res.rows if r.masked}
    if any(o.get("floor", {}).get("match") is False for m, o in res.openvino.items() if m in masked):
        lines += ["A *differs* on the floor of a masked model means OpenVINO runs the bare op differently from "
                  "onnxruntime for the same `sequence_lens` (seen with OpenVINO 2026.4: `Y` is not zero past a row's "
                  "length and `Y_h` is the last step's state, not the last valid one). rnnfuse's fused models never "
                  "read `Y` past a row's length or `Y_h` with `sequence_lens`: every such value is computed "
                  "explicitly, so both mask paths match there.", ""]
    return lines


def models_section(res: Results) -> list[str]:
    seen, lines = set(), ["## Models", "",
                          "| model | exporter | layers | floor |", "|---|---|---|---|"]
    from models import BY_NAME

    for r in res.rows:
        if r.model in seen:
            continue
        seen.add(r.model)
        spec = BY_NAME[r.model]
        floor = " → ".join(f"{l.op}({'bidirectional' if l.dirs == 2 else 'forward'})" for l in spec.layers)
        exporter = {"keras": "Keras 3 → tf2onnx (opset 17, dynamic batch+time)",
                    "trace": "torch.onnx.export(dynamo=False, opset 17), dynamic batch, T fixed",
                    "dynamo": "torch.onnx.export(dynamo=True), dynamic batch, T fixed"}[spec.exporter]
        lines.append(f"| {r.model} | {exporter} | {r.describe} | {floor}{' with sequence_lens' if r.masked else ''} |")
    lines += ["", "The floor is the bare native op(s) with random weights of the same shapes (GRU "
              "`linear_before_reset=1`), time-major, layers chained by `Squeeze`: no transposes, no mask handling. "
              "It is fed the same features (time-major) and the post-padded lengths as `sequence_lens`.", ""]
    return lines


def markdown(res: Results) -> str:
    goals = evaluate_goals(res)
    lines = header(res) + goals_section(res, goals) + latency_section(res) + gap_section(res)
    lines += elman_section(res)
    lines += optimizer_section(res) + openvino_section(res) + models_section(res)
    lines += ["![latency](results.png)", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- csv / json / png


CSV_FIELDS = ["model", "exporter", "masked", "batch", "T", "threads"]
for _v in VARIANTS:
    CSV_FIELDS += [f"{_v}_median_ms", f"{_v}_p10_ms", f"{_v}_p90_ms"]
CSV_FIELDS += ["speedup", "fused_over_floor", "exact_over_post", "max_abs_diff_fused", "max_abs_diff_post",
               "optimize_s", "optimize_novalidate_s", "opt_peak_extra_mb_warm", "opt_peak_extra_mb_cold",
               "opt_peak_extra_mb_novalidate", "model_file_mb", "opt_mem_over_file", "cli_peak_rss_mb",
               "cli_baseline_mb", "goals_missed", "error"]


def write_csv(res: Results, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for r in res.rows:
            o = res.optimizer.get(r.model, {})
            e, c, n, cli = o.get("exact", {}), o.get("cold", {}), o.get("novalidate", {}), o.get("cli", {})
            d = dict(model=r.model, exporter=r.exporter, masked=int(r.masked), batch=r.batch, T=r.T,
                     threads=res.meta["config"]["threads"], speedup=r.speedup, fused_over_floor=r.fused_floor,
                     exact_over_post=r.exact_post, max_abs_diff_fused=r.diff_fused, max_abs_diff_post=r.diff_post,
                     optimize_s=e.get("seconds"), optimize_novalidate_s=n.get("seconds"),
                     opt_peak_extra_mb_warm=e.get("peak_extra_mb"), opt_peak_extra_mb_cold=c.get("peak_extra_mb"),
                     opt_peak_extra_mb_novalidate=n.get("peak_extra_mb"), model_file_mb=e.get("file_mb"),
                     opt_mem_over_file=opt_ratio(e), cli_peak_rss_mb=cli.get("cli_peak_rss_mb"),
                     cli_baseline_mb=cli.get("cli_baseline_mb"), goals_missed="; ".join(row_misses(r)), error=r.error)
            for v in VARIANTS:
                t = r.timings.get(v)
                if t:
                    d.update({f"{v}_median_ms": t.median_ms, f"{v}_p10_ms": t.p10_ms, f"{v}_p90_ms": t.p90_ms})
            w.writerow({k: (f"{x:.6g}" if isinstance(x, float) else x) for k, x in d.items()})


def write_json(res: Results, path: Path) -> None:
    data = {"meta": res.meta, "goals": [asdict(g) for g in evaluate_goals(res)],
            "rows": [dict(asdict(r), speedup=r.speedup, fused_over_floor=r.fused_floor, exact_over_post=r.exact_post,
                          goals_missed=row_misses(r)) for r in res.rows],
            "optimizer": res.optimizer, "openvino": res.openvino}
    path.write_text(json.dumps(data, indent=1, default=str))


def plot(res: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    batches = res.meta["config"]["batches"]
    shown = ("original", "fused", "floor")
    colors = {"original": "#b0b0b0", "fused": "#1f77b4", "floor": "#2ca02c"}
    models = list(dict.fromkeys(r.model for r in res.rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    width = 0.27
    for ax, b in zip(axes[0], batches):
        rows = {r.model: r for r in res.rows if r.batch == b}
        xs = range(len(models))
        for k, v in enumerate(shown):
            meds = [rows[m].median(v) if m in rows else None for m in models]
            lo = [(md - rows[m].timings[v].p10_ms) if md else 0 for m, md in zip(models, meds)]
            hi = [(rows[m].timings[v].p90_ms - md) if md else 0 for m, md in zip(models, meds)]
            ax.bar([x + (k - 1) * width for x in xs], [md or 0 for md in meds], width, label=LABELS[v],
                   color=colors[v], yerr=[lo, hi], error_kw=dict(lw=0.7, capsize=1.5, ecolor="#555"))
        labels = []
        for m in models:
            s = rows[m].speedup if m in rows else None
            labels.append(f"{m.replace('_', ' ')}\n{ratio(s)}" if s else m.replace("_", " "))
        ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        lowest = min((rows[m].timings[v].p10_ms for m in rows for v in shown if v in rows[m].timings), default=None)
        if lowest:
            ax.set_ylim(bottom=lowest / 2)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        ax.set_ylabel("median latency, ms (log); bars p10–p90")
        ax.set_title(f"batch {b}  (T={res.meta['config']['T']}, {res.meta['config']['threads']} thread(s)); "
                     "label: speedup", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
    v = res.meta["versions"]
    fig.suptitle(f"rnnfuse: original vs fused vs native-op floor — onnxruntime {v['onnxruntime']} CPU"
                 f"{' (QUICK RUN)' if res.meta['config']['quick'] else ''}", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(shown), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(res: Results, out: Path) -> None:
    (out / "results.md").write_text(markdown(res))
    write_csv(res, out / "results.csv")
    write_json(res, out / "results.json")
    try:
        plot(res, out / "results.png")
    except Exception as e:  # noqa: BLE001 - the tables matter more than the picture
        print(f"warning: no plot ({type(e).__name__}: {e})")


def load_json(path: Path) -> Results:
    """Rebuild :class:`Results` from a ``results.json`` (to re-render the tables and plot without re-measuring)."""
    from rnnfuse.bench import Timing

    data = json.loads(Path(path).read_text())
    rows = []
    for d in data["rows"]:
        kw = {k: v for k, v in d.items() if k in Row.__dataclass_fields__}
        kw["timings"] = {k: Timing(**t) for k, t in d["timings"].items()}
        rows.append(Row(**kw))
    return Results(meta=data["meta"], rows=rows, optimizer=data["optimizer"], openvino=data.get("openvino", {}))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/report.py RESULTS_DIR   (re-renders results.md/.csv/.png from results.json)")
    out = Path(sys.argv[1])
    write_all(load_json(out / "results.json"), out)
    print(f"re-rendered {out / 'results.md'}")
