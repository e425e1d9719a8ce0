"""Child process of ``run.py --openvino``: can OpenVINO (CPU) read and compile each model, and does it agree?

    python benchmarks/openvino_check.py --json OUT.json --case TAG MODEL.onnx FEEDS.npz [--case ...]

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
import sys

import numpy as np

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


def check(core, path: str, feeds: dict, refs: list) -> dict:
    rec = {"load": "fail", "error": "", "match": None, "max_abs_diff": None}
    try:
        compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        rec["error"] = short_error(e)
        return rec
    rec["load"] = "ok"
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
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--case", nargs=3, action="append", required=True, metavar=("TAG", "MODEL", "NPZ"))
    a = ap.parse_args(argv)
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
            out[tag] = check(core, path, feeds, refs)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
