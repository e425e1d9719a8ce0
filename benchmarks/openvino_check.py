"""Can OpenVINO (CPU) read and compile each model, does it agree, does it use its sequence kernel, how fast?

    python benchmarks/openvino_check.py --table [--out benchmarks/results/openvino.md] [--T 100] [--batch 16]
    python benchmarks/openvino_check.py --json OUT.json [--runs N] --case TAG MODEL.onnx FEEDS.npz [--case ...]

``--table`` exports the benchmark model matrix (``models.py``, cached in ``benchmarks/.cache``), optimizes each
model with rnnfuse as by default and with ``--portable``, and writes a markdown table: for the original and
both fused models, whether OpenVINO loads (compiles) it, whether it runs and matches onnxruntime on the
original (pre-padded masks: Keras' ``pad_sequences`` default), how many recurrent ops run on the sequence
kernel (runtime ``layerType`` ``RNNSeq``) or as a generic loop (``TensorIterator``/``Loop``), and the median
latency in OpenVINO. The second form is its child (and ``run.py --openvino``'s):

Each ``FEEDS.npz`` holds ``in/<input name>`` (inputs) and ``ref/<k>`` (onnxruntime's outputs on them: for
the fused variants those of the *original* model). Each model is read with ``Core().read_model(path)`` and
compiled for CPU with ``INFERENCE_PRECISION_HINT=f32`` (OpenVINO's CPU default on bf16-capable CPUs is bf16,
which would make every comparison differ at ~1e-2); when it compiles it is run once and compared to the
reference. Runs in its own
process so that a crash in OpenVINO cannot take the benchmark down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

ATOL = 1e-4


def short_error(e: Exception) -> str:
    """The informative part of an OpenVINO error (its messages are long multi-line check reports)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    for i, l in enumerate(lines):
        if l.startswith("-- ") and "with a message" in l:  # "-- Loop-17 with a message:" + the check + the cause
            op = l[3:].split(" with a message")[0]
            cause = next((x for x in lines[i + 1:] if not x.startswith(("Check '", "While validating"))), "")
            return f"{op} not converted: {cause}"[:200]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:200]


SEQUENCE_KERNEL = "RNNSeq"
GENERIC_LOOPS = ("TensorIterator", "Loop")


def kernels(compiled) -> dict:
    """How the compiled model runs its recurrences: ops on the sequence kernel and generic loops."""
    types: dict = {}
    for op in compiled.get_runtime_model().get_ops():
        t = op.get_rt_info()["layerType"].astype(str)
        types[t] = types.get(t, 0) + 1
    return {"sequence": types.get(SEQUENCE_KERNEL, 0), "loops": sum(types.get(t, 0) for t in GENERIC_LOOPS)}


def median_ms(compiled, feeds: dict, runs: int) -> float:
    import time

    req = compiled.create_infer_request()
    for _ in range(3):
        req.infer(feeds)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        req.infer(feeds)
        ts.append((time.perf_counter() - t0) * 1000)
    return float(np.median(ts))


def check(core, path: str, feeds: dict, refs: list, runs: int = 0) -> dict:
    rec = {"load": "fail", "error": "", "match": None, "max_abs_diff": None}
    try:
        config = {"INFERENCE_PRECISION_HINT": "f32"}
        if runs:
            config["INFERENCE_NUM_THREADS"] = 1  # timed: one thread, as the onnxruntime benchmarks
        compiled = core.compile_model(core.read_model(path), "CPU", config)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        rec["error"] = short_error(e)
        return rec
    rec["load"] = "ok"
    rec.update(kernels(compiled))
    try:
        res = compiled(feeds)
        outs = [np.asarray(res[o]) for o in compiled.outputs]
    except Exception as e:  # noqa: BLE001
        rec["error"] = "run: " + short_error(e)
        return rec
    if len(outs) != len(refs) or any(a.shape != b.shape for a, b in zip(outs, refs)):
        rec["match"] = False
        rec["error"] = f"output shapes {[a.shape for a in outs]} != {[b.shape for b in refs]}"
        return rec
    diff = max((float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0) for a, b in zip(outs, refs))
    rec["max_abs_diff"] = diff
    rec["match"] = bool(diff <= ATOL + 1e-4 * max(float(np.max(np.abs(b))) for b in refs))
    if runs:
        rec["ms"] = median_ms(compiled, feeds, runs)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", action="store_true", help="export, optimize and check the benchmark models")
    ap.add_argument("--out", default=str(HERE / "results" / "openvino.md"), help="--table: the markdown file")
    ap.add_argument("--cache", default=str(HERE / ".cache"), help="--table: exported models")
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--runs", type=int, default=0, help="timed runs per model (0: no timing)")
    ap.add_argument("--case", nargs=3, action="append", metavar=("TAG", "MODEL", "NPZ"))
    a = ap.parse_args(argv)
    if a.table:
        return table(a)
    if not a.json or not a.case:
        ap.error("--json and --case are required without --table")
    out: dict = {}
    try:
        import openvino as ov
    except Exception as e:  # noqa: BLE001
        out["error"] = f"openvino not importable ({type(e).__name__})"
    else:
        out["version"] = ov.get_version()
        core = ov.Core()
        for tag, path, npz in a.case:
            data = np.load(npz)
            feeds = {k[3:]: data[k] for k in data.files if k.startswith("in/")}
            refs = [data[f"ref/{k}"] for k in range(sum(k.startswith("ref/") for k in data.files))]
            out[tag] = check(core, path, feeds, refs, a.runs)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


# --------------------------------------------------------------------------- --table

VARIANTS = (("original", "original"), ("fused", "fused"), ("portable", "fused --portable"))


def table(a) -> int:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    import onnx
    import onnxruntime as ort

    import rnnfuse
    from models import MODELS
    from rnnfuse.bench import make_inputs

    F, H = 128, 256
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    files = {}
    for fw in ("keras", "torch"):
        js = cache / f"ov_export_{fw}.json"
        cmd = [sys.executable, str(HERE / "models.py"), "--framework", fw, "--cache", str(cache), "--T", str(a.T),
               "--F", str(F), "--H", str(H), "--batches", str(a.batch), "--json", str(js)]
        subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore"))
        for rec in json.loads(js.read_text())["records"]:
            if not rec["error"]:
                files[rec["name"]] = rec["files"].get(str(a.batch)) or rec["files"]["*"]
    rows = []
    for spec in MODELS:
        if spec.name not in files:
            rows.append((spec, {}, f"not exported"))
            continue
        path = Path(files[spec.name])
        original = onnx.load(str(path))
        stem = path.with_suffix("")
        paths = {"original": path}
        notes = []
        for tag, kw in (("fused", {}), ("portable", {"portable": True})):
            fused, report = rnnfuse.optimize(original, **kw)
            p = Path(f"{stem}.ov_{tag}.onnx")
            onnx.save(fused, str(p))
            paths[tag] = p
            warn = sorted({w.split(" (")[0].split(":")[0] for f in report.findings for w in f.warnings})
            if warn:
                notes.append(f"{tag}: " + "; ".join(warn))
        rng = np.random.default_rng(0)
        feeds = make_inputs(original, a.batch, a.T, "pre" if spec.masked else "none", rng)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        ref = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        npz = Path(f"{stem}.ov_feeds.npz")
        np.savez(npz, **{f"in/{k}": v for k, v in feeds.items()}, **{f"ref/{k}": v for k, v in enumerate(ref)})
        js = Path(f"{stem}.ov_check.json")
        js.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--json", str(js), "--runs", str(a.runs or 30)]
        for tag, p in paths.items():
            cmd += ["--case", tag, str(p), str(npz)]
        rc = subprocess.run(cmd, cwd=REPO).returncode
        res = json.loads(js.read_text()) if js.exists() else {"error": f"openvino child failed (rc {rc})"}
        for tag, p in paths.items():
            if isinstance(res.get(tag), dict):
                res[tag]["ort_ms"] = _ort_ms(ort, str(p), feeds, a.runs or 30)
        rows.append((spec, res, "; ".join(notes)))
        print(f"{spec.name}: " + ", ".join(f"{t}={_cell(res.get(t))}" for t, _ in VARIANTS), file=sys.stderr)
    version = next((r.get("version") for _, r, _ in rows if r.get("version")), "?")
    lines = [f"# OpenVINO {version} (CPU) on the benchmark models", "",
             f"`python benchmarks/openvino_check.py --table` -- T={a.T}, F={F}, H={H}, batch {a.batch}; "
             "masked models get pre-padded masks (Keras' `pad_sequences` default). *loads*: `read_model` + "
             "`compile_model` (`INFERENCE_PRECISION_HINT=f32`); *runs*: its outputs match onnxruntime's on the "
             "original (1e-4); *sequence kernel*: recurrent ops running as `RNNSeq` / as a generic loop "
             "(`TensorIterator`); *ms*: median of the OpenVINO run and, for comparison, of onnxruntime's, one thread "
             f"each (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs while measuring: compare rows "
             "with each other).", "",
             "| model | variant | loads | runs | sequence kernel / loops | OpenVINO ms | onnxruntime ms |",
             "|---|---|---|---|---|---:|---:|"]
    for spec, res, notes in rows:
        for tag, label in VARIANTS:
            r = res.get(tag) or {}
            if not r:
                lines.append(f"| {spec.name} | {label} | {res.get('error', '?')} | | | | |")
                continue
            loads = "yes" if r.get("load") == "ok" else f"no: {r.get('error', '')}".replace("|", "/")
            runs = "" if r.get("load") != "ok" else ("yes" if r.get("match") else f"**differs** ({r.get('max_abs_diff') or r.get('error')})")
            kern = "" if r.get("load") != "ok" else f"{r.get('sequence', 0)} / {r.get('loops', 0)}"
            ms = f"{r['ms']:.2f}" if r.get("ms") is not None else ""
            oms = f"{r['ort_ms']:.2f}" if r.get("ort_ms") is not None else ""
            lines.append(f"| {spec.name} | {label} | {loads} | {runs} | {kern} | {ms} | {oms} |")
    notes = [f"* {spec.name}: {n}" for spec, _, n in rows if n]
    if notes:
        lines += ["", "What rnnfuse's report says about OpenVINO:", ""] + notes
        lines += ["", "A fused model the report calls wrong on OpenVINO (a masked reverse op: OpenVINO's sequence "
                  "kernel ignores `sequence_lens` with dynamic shapes) can still match on these inputs: Keras' "
                  "zero-initialised biases keep a zero state over the zero (padded) steps. The test fixtures "
                  "(random biases) show the difference; `--portable` is right on both."]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _ort_ms(ort, path: str, feeds: dict, runs: int) -> float:
    import time

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(3):
        sess.run(None, feeds)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        ts.append((time.perf_counter() - t0) * 1000)
    return float(np.median(ts))


def _cell(r) -> str:
    if not r:
        return "-"
    if r.get("load") != "ok":
        return "no load"
    return f"{'ok' if r.get('match') else 'DIFFERS'} seq={r.get('sequence')} loops={r.get('loops')} {r.get('ms', 0):.2f}ms"


if __name__ == "__main__":
    sys.exit(main())
