"""Masked Keras layers that reach ONNX as unrolled chains: latency before and after fusion.

    python benchmarks/keras_unrolled.py [--runs 50] [--out benchmarks/results]

Exports Masking(0.0) -> LSTM(256, return_sequences=True) over T=100 steps of 128 features twice -- Keras 3 on
the torch backend (`model.export(format="onnx")`, which unrolls every step) and Keras `unroll=True` through
tf2onnx -- then runs `rnnfuse optimize` and `rnnfuse bench` (onnxruntime, 1 thread, batch 1 and 16, original and
fused interleaved) and writes `keras_unrolled.md`. Each export runs in its own process (the Keras backend is
chosen when Keras is imported).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

T, F, H = 100, 128, 256

EXPORT_TORCH = f"""
import os, numpy as np
os.environ["KERAS_BACKEND"] = "torch"
import keras
keras.utils.set_random_seed(0)
x = keras.Input(shape=({T}, {F}), name="x")
m = keras.Model(x, keras.layers.LSTM({H}, return_sequences=True)(keras.layers.Masking(0.0)(x)))
m(np.random.rand(2, {T}, {F}).astype("float32"))
m.export(os.environ["OUT"], format="onnx", verbose=False)
"""

EXPORT_TF2ONNX = f"""
import os
import keras, tensorflow as tf, tf2onnx, onnx
keras.utils.set_random_seed(0)
x = keras.Input(shape=({T}, {F}), name="x")
m = keras.Model(x, keras.layers.LSTM({H}, return_sequences=True, unroll=True)(keras.layers.Masking(0.0)(x)))
proto, _ = tf2onnx.convert.from_keras(m, input_signature=(tf.TensorSpec((None, {T}, {F}), tf.float32, name="x"),), opset=17)
onnx.save(proto, os.environ["OUT"])
"""

MODELS = [
    ("keras_torch_masked_lstm", "Keras 3 on the torch backend, `model.export(format=\"onnx\")`", EXPORT_TORCH),
    ("keras_unroll_masked_lstm", "Keras 3 `unroll=True`, tf2onnx 1.17", EXPORT_TF2ONNX),
]


def run(cmd: list[str], env: dict | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{p.stderr[-2000:]}")
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    parts = [
        "# Masked Keras LSTM exported as an unrolled chain\n",
        f"Masking(0.0) -> LSTM({H}, return_sequences=True), T={T}, F={F}. `rnnfuse optimize` (validation on), then "
        "`rnnfuse bench --threads 1` (original and fused interleaved; median ms).\n",
    ]
    with tempfile.TemporaryDirectory() as d:
        for name, title, code in MODELS:
            src, dst = os.path.join(d, f"{name}.onnx"), os.path.join(d, f"{name}.fused.onnx")
            env = dict(os.environ, OUT=src, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
            run([sys.executable, "-c", code], env)
            report = run([sys.executable, "-m", "rnnfuse", "optimize", src, dst, "--force"]).replace(d + os.sep, "")
            table = run([sys.executable, "-m", "rnnfuse", "bench", src, dst, "--batch", "1,16", "--threads", "1",
                         "--runs", str(args.runs)])
            parts.append(f"\n## {title}\n\n```\n{report.strip()}\n```\n\n{table.strip()}\n")
    text = "".join(parts)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "keras_unrolled.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
