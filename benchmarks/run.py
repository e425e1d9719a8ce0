"""rnnfuse benchmark suite: real exporters -> rnnfuse -> onnxruntime latency against a native-op floor.

    python benchmarks/run.py [--quick] [--out DIR] [--threads 1] [--runs N] [--openvino]

1. Exports the model matrix of ``models.py`` (Keras 3 via tf2onnx; torch trace and dynamo cell loops) into a
   cache dir, one child process per framework (cached by name and sizes; ``--rebuild`` re-exports).
2. Per model, in fresh child processes (``optimizer_cost.py``): the wall time and peak memory of
   ``rnnfuse.optimize`` (exact path; post-padded path for masked models; cold; without validation), and the
   whole-process peak RSS of ``rnnfuse optimize IN OUT`` on the command line.
3. Per model and batch, onnxruntime CPU with ``--threads`` intra-op threads, runs interleaved: the original,
   the fused model (exact path), the fused model with ``post_padded=True`` (masked models) and the floor
   (bare native ops of the same sizes, ``sequence_lens`` for masked models), on post-padded random inputs.
   Outputs of fused vs original are compared on the same inputs. Then onnxruntime's profiler splits the fused
   model's and the floor's time by op type (``--no-profile`` skips it).
4. ``--openvino``: whether OpenVINO reads/compiles the original and fused models and agrees with onnxruntime.
5. Writes ``results.md``, ``results.csv``, ``results.png`` and ``results.json`` into ``--out`` (default
   ``benchmarks/results``, the committed results; smoke runs, ``--quick`` or ``--seq-len``, default to
   ``benchmarks/out/quick`` so they never overwrite them).

``--quick`` (T=20, few runs) is a smoke test of the whole pipeline in a few minutes; its numbers are not the
goals' configuration (T=100).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

import report  # noqa: E402
from report import Row  # noqa: E402
from models import MODELS, ModelSpec, build_floor, floor_feeds  # noqa: E402
from rnnfuse.bench import make_inputs, session, summarize, time_side_by_side, versions  # noqa: E402

WARMUP_MODEL = REPO / "examples" / "keras_masked_bigru_lstm.onnx"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Config:
    T: int
    F: int
    H: int
    batches: list[int]
    runs: int
    warmup: int
    threads: int
    quick: bool
    profile: bool = True
    seed: int = 0


# --------------------------------------------------------------------------- 1. export


def export_models(specs: list[ModelSpec], cfg: Config, cache: Path, logs: Path) -> tuple[dict, dict]:
    """``{name: record}`` (``files``: batch or ``*`` -> path, ``error``) and the exporters' versions."""
    records, vers = {}, {}
    for framework in ("keras", "torch"):
        names = [s.name for s in specs if s.framework == framework]
        if not names:
            continue
        out_json = cache / f"export_{framework}.json"
        out_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "models.py"), "--framework", framework, "--cache", str(cache),
               "--names", ",".join(names), "--T", str(cfg.T), "--F", str(cfg.F), "--H", str(cfg.H),
               "--batches", ",".join(map(str, cfg.batches)), "--json", str(out_json)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
        log(f"exporting {framework}: {', '.join(names)}")
        t0 = time.perf_counter()
        with open(logs / f"export_{framework}.log", "w") as lf:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=3600).returncode
        if rc != 0 or not out_json.exists():
            for n in names:
                records[n] = {"name": n, "files": {}, "error": f"{framework} export child failed (rc {rc}); see "
                                                             f"logs/export_{framework}.log"}
            continue
        data = json.loads(out_json.read_text())
        vers.update(data["versions"])
        for rec in data["records"]:
            records[rec["name"]] = rec
        log(f"  {framework} done in {time.perf_counter() - t0:.1f}s")
    return records, vers


# --------------------------------------------------------------------------- 2. optimizer cost


def optimizer_costs(spec: ModelSpec, path: Path, logs: Path) -> dict:
    """Run the optimizer children for one exported file; ``{mode: record}``, fused files saved next to it."""
    stem = path.with_suffix("")
    modes = {
        "exact": ["--warmup", str(WARMUP_MODEL), "--save", f"{stem}.fused.onnx"],
        "cold": [],
        "novalidate": ["--warmup", str(WARMUP_MODEL), "--no-validate"],
        "cli": ["--cli", f"{stem}.cli.onnx"],
    }
    if spec.masked:
        modes["post"] = ["--warmup", str(WARMUP_MODEL), "--post-padded", "--save", f"{stem}.post.onnx"]
    for old in (Path(f"{stem}.fused.onnx"), Path(f"{stem}.post.onnx")):  # never time a stale result
        old.unlink(missing_ok=True)
    out = {}
    for mode, extra in modes.items():
        js = Path(f"{stem}.opt_{mode}.json")
        js.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "optimizer_cost.py"), str(path), "--json", str(js), *extra]
        with open(logs / f"optimize_{path.stem}_{mode}.log", "w") as lf:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600).returncode
        if rc != 0 or not js.exists():
            out[mode] = {"error": f"optimizer child failed (rc {rc}); see logs/optimize_{path.stem}_{mode}.log"}
        else:
            out[mode] = json.loads(js.read_text())
    return out


# --------------------------------------------------------------------------- 3. latency


class FixedFeeds:
    """A session that always runs on its own feeds (the floor's inputs differ from the real model's)."""

    def __init__(self, sess, feeds: dict):
        self.sess, self.feeds = sess, feeds

    def run(self, output_names, _feeds):
        return self.sess.run(output_names, self.feeds)


def _max_diff(ref: list, got: list) -> tuple[float, bool]:
    if len(ref) != len(got) or any(a.shape != b.shape for a, b in zip(ref, got)):
        return float("inf"), False
    return max((float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0)
               for a, b in zip(ref, got)), True


def time_model(spec: ModelSpec, files: dict, cfg: Config, work: Path) -> tuple[list[Row], dict]:
    """Latency rows for every batch, and the batch-``max`` feeds/reference (for the OpenVINO check)."""
    floor = build_floor(spec, cfg.F, cfg.H, cfg.seed).SerializeToString()
    rows, last = [], {}
    for b in cfg.batches:
        row = Row(spec.name, spec.exporter, spec.describe(), spec.masked, b, cfg.T)
        rows.append(row)
        path = Path(files.get(str(b)) or files["*"])
        stem = path.with_suffix("")
        variants = {"original": path, "fused": Path(f"{stem}.fused.onnx")}
        if spec.masked:
            variants["post"] = Path(f"{stem}.post.onnx")
        missing = [k for k, p in variants.items() if not p.exists()]
        if missing:
            row.error = f"no {'/'.join(missing)} model"
            variants = {k: p for k, p in variants.items() if p.exists()}
            if "original" not in variants:
                continue
        try:
            original = onnx.load(str(path))
            rng = np.random.default_rng(cfg.seed + b)
            feeds = make_inputs(original, b, cfg.T, "post" if spec.masked else "none", rng)
            sessions = {k: session(p.read_bytes(), cfg.threads) for k, p in variants.items()}
            ffeeds = floor_feeds(spec, feeds)
            sessions["floor"] = FixedFeeds(session(floor, cfg.threads), ffeeds)
            ref = sessions["original"].run(None, feeds)
            if "fused" in sessions:
                row.diff_fused, ok = _max_diff(ref, sessions["fused"].run(None, feeds))
                row.shapes_ok &= ok
            if "post" in sessions:
                row.diff_post, ok = _max_diff(ref, sessions["post"].run(None, feeds))
                row.shapes_ok &= ok
            times = time_side_by_side(sessions, feeds, cfg.runs, cfg.warmup)
            row.timings = {k: summarize(k, b, v) for k, v in times.items()}
            if cfg.profile and "fused" in variants:
                n = max(5, min(40, cfg.runs))
                row.profile = op_profiles({"fused": (variants["fused"].read_bytes(), feeds), "floor": (floor, ffeeds)},
                                          cfg.threads, n, 3, work)
            last = {"feeds": feeds, "ref": ref, "variants": variants, "floor": floor, "floor_feeds": ffeeds,
                    "floor_ref": sessions["floor"].run(None, None)}
        except Exception as e:  # noqa: BLE001 - one broken model must not stop the suite
            row.error = (row.error + "; " if row.error else "") + f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        t = row.timings
        if t:
            log(f"  {spec.name} B={b}: " + ", ".join(f"{k} {v.median_ms:.2f}ms" for k, v in t.items()))
    return rows, last


# --------------------------------------------------------------------------- 3b. where the time goes


def op_profiles(models: dict, threads: int, runs: int, warmup: int, work: Path) -> dict:
    """onnxruntime's profiler on each ``name -> (model bytes, feeds)``, runs interleaved like the timings.

    Per model: the median over runs of the whole run's ms (``run_ms``), of all kernels' ms (``kernels_ms``) and of
    each op type's kernel ms (``kernels``) -- medians, so that a run disturbed by another process does not skew
    the split."""
    import onnxruntime as ort

    sessions = {}
    for name, (model_bytes, feeds) in models.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
        so.enable_profiling = True
        so.profile_file_prefix = str(work / f"ort_profile_{name}")
        sessions[name] = (ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"]), feeds)
    for _ in range(warmup + runs):
        for sess, feeds in sessions.values():
            sess.run(None, feeds)
    return {name: _split_profile(Path(sess.end_profiling()), warmup) for name, (sess, _) in sessions.items()}


def _split_profile(path: Path, warmup: int) -> dict:
    events = json.loads(path.read_text())
    path.unlink()
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")[warmup:]
    nodes = sorted((e["ts"], e["dur"], e.get("args", {}).get("op_name", "?")) for e in events
                   if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
    per_run, k = [], 0
    for t0, t1 in spans:
        ops: dict = {}
        while k < len(nodes) and nodes[k][0] < t0:
            k += 1
        while k < len(nodes) and nodes[k][0] <= t1:
            ops[nodes[k][2]] = ops.get(nodes[k][2], 0.0) + nodes[k][1] / 1000.0
            k += 1
        per_run.append(((t1 - t0) / 1000.0, ops))
    if not per_run:
        return {"run_ms": None, "kernels_ms": None, "kernels": {}, "runs": 0}
    op_types = {op for _, ops in per_run for op in ops}
    kernels = {op: float(np.median([ops.get(op, 0.0) for _, ops in per_run])) for op in op_types}
    return {"run_ms": float(np.median([r for r, _ in per_run])),
            "kernels_ms": float(np.median([sum(ops.values()) for _, ops in per_run])),
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])), "runs": len(per_run)}


# --------------------------------------------------------------------------- 4. OpenVINO


def openvino_status() -> str:
    """'' if openvino imports (checked in a child: importing it here would share the process)."""
    r = subprocess.run([sys.executable, "-c", "import openvino, sys; sys.stdout.write(openvino.get_version())"],
                       capture_output=True, text=True, timeout=300)
    return "" if r.returncode == 0 else "not installed (pip install openvino)"


def openvino_check(spec: ModelSpec, last: dict, work: Path, logs: Path) -> dict:
    """OpenVINO on the original, fused and post-padded models (vs onnxruntime's original) and on the floor
    (vs onnxruntime's floor: does OpenVINO honour ``sequence_lens``?)."""
    if not last:
        return {"error": "no benchmark inputs (the model did not run)"}

    def npz(tag: str, feeds: dict, ref: list) -> str:
        path = work / f"{spec.name}.ov_{tag}.npz"
        np.savez(path, **{f"in/{k}": v for k, v in feeds.items()}, **{f"ref/{k}": v for k, v in enumerate(ref)})
        return str(path)

    cases = [["--case", k, str(p), npz("model", last["feeds"], last["ref"])] for k, p in last["variants"].items()]
    floor_path = work / f"{spec.name}.floor.onnx"
    floor_path.write_bytes(last["floor"])
    cases.append(["--case", "floor", str(floor_path), npz("floor", last["floor_feeds"], last["floor_ref"])])
    js = work / f"{spec.name}.ov.json"
    js.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "openvino_check.py"), "--json", str(js), *(a for c in cases for a in c)]
    with open(logs / f"openvino_{spec.name}.log", "w") as lf:
        rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO, timeout=1800).returncode
    if rc != 0 or not js.exists():
        return {"error": f"openvino child failed (rc {rc}, crash?); see logs/openvino_{spec.name}.log"}
    return json.loads(js.read_text())


# --------------------------------------------------------------------------- main


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: T=20, few runs (a few minutes)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results directory (default benchmarks/results, the committed results README links to; "
                         "--quick and --seq-len runs default to benchmarks/out/quick, which git ignores, so a smoke "
                         "run never overwrites them)")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    ap.add_argument("--runs", type=int, help="timed runs per model variant and batch (default 200, quick 30)")
    ap.add_argument("--warmup", type=int, help="untimed runs first (default 10, quick 3)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the onnxruntime-profiler breakdown of fused vs floor (where the gap goes)")
    ap.add_argument("--openvino", action="store_true", help="also check that OpenVINO loads/agrees (if installed)")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="exported models (default benchmarks/.cache)")
    ap.add_argument("--rebuild", action="store_true", help="re-export models even when cached")
    ap.add_argument("--models", help="comma-separated substrings: only the matching models")
    ap.add_argument("--seq-len", type=int, help="override T (default 100, quick 20)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = HERE / "out" / "quick" if args.quick or args.seq_len else HERE / "results"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = Config(T=args.seq_len or (20 if args.quick else 100), F=128, H=256, batches=[1, 16],
                 runs=args.runs or (30 if args.quick else 200), warmup=args.warmup if args.warmup is not None
                 else (3 if args.quick else 10), threads=args.threads, quick=args.quick, profile=not args.no_profile)
    specs = [m for m in MODELS if not args.models or any(s in m.name for s in args.models.split(","))]
    out, cache = args.out, args.cache
    logs = out / "logs"
    for d in (out, cache, logs):
        d.mkdir(parents=True, exist_ok=True)
    if args.rebuild:
        for s in specs:
            for p in cache.glob(f"{s.name}_*"):
                p.unlink()
    meta = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "cpu": cpu_name(), "cores": os.cpu_count(), "load_start": load_avg(),
        "config": asdict(cfg), "versions": versions(),
    }
    log(f"T={cfg.T} F={cfg.F} H={cfg.H} batches={cfg.batches} runs={cfg.runs} threads={cfg.threads} "
        f"(load average {meta['load_start']})")

    exported, meta["exporters"] = export_models(specs, cfg, cache, logs)

    ov_status = openvino_status() if args.openvino else "not requested (--openvino)"
    rows, opt, ov = [], {}, {}
    for spec in specs:
        rec = exported.get(spec.name, {"files": {}, "error": "not exported"})
        if rec.get("error"):
            log(f"{spec.name}: export failed: {rec['error']}")
            opt[spec.name] = {"error": "export failed: " + rec["error"]}
            rows += [Row(spec.name, spec.exporter, spec.describe(), spec.masked, b, cfg.T,
                         error="export failed: " + rec["error"]) for b in cfg.batches]
            continue
        files = rec["files"]
        log(f"{spec.name}: optimizing ({len(set(files.values()))} file(s))")
        costs = {}
        for key, p in files.items():
            costs[key] = optimizer_costs(spec, Path(p), logs)
        # the table shows one optimizer record per model: the dynamic-batch file, or the largest batch's
        opt[spec.name] = costs.get("*") or costs[max(costs, key=lambda k: int(k))]
        opt[spec.name]["export_notes"] = rec.get("notes", "")
        e = opt[spec.name].get("exact", {})
        if "seconds" in e:
            log(f"  {e['fused']} fused, {e['declined']} declined, {e['seconds']:.2f}s, "
                f"+{e['peak_extra_mb']:.1f} MB ({e['peak_extra_mb'] / e['file_mb']:.1f}x file)")
        log(f"{spec.name}: timing {cfg.runs} interleaved runs per variant")
        mrows, last = time_model(spec, files, cfg, cache)
        rows += mrows
        if args.openvino:
            ov[spec.name] = {"error": ov_status} if ov_status else openvino_check(spec, last, cache, logs)

    meta["load_end"] = load_avg()
    meta["openvino"] = ov_status
    meta["wall_seconds"] = time.perf_counter() - _T0
    res = report.Results(meta=meta, rows=rows, optimizer=opt, openvino=ov)
    report.write_all(res, out)
    log(f"wrote {out / 'results.md'}, results.csv, results.png, results.json in {meta['wall_seconds']:.0f}s")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
