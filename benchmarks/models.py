"""The benchmark model matrix: a small table, the exporters that build each entry, and its "floor".

Every entry is exported with the real exporter it stands for:

* ``keras``  -- Keras 3 -> ``tf2onnx.convert.from_keras(opset=17)`` with dynamic batch and time, batch-first
  input ``[B, T, F]``, ``Masking(0.0)`` in front when ``masked`` (tf2onnx writes every one of these as a Loop).
* ``trace``  -- a Python loop over ``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell``, ``torch.onnx.export(dynamo=False,
  opset_version=17)`` with a dynamic batch; time-major input ``[T, B, F]``, T fixed (the loop is unrolled).
* ``dynamo`` -- the same loop through ``torch.onnx.export(dynamo=True)``, dynamic batch via ``dynamic_shapes``
  (if torch.export refuses a dynamic batch, one model per batch size is exported instead).

The **floor** of an entry is a model holding only the bare native ops of the same kinds, sizes and directions
(chained by ``Squeeze`` for stacks), time-major, with ``sequence_lens`` when the real model is masked: what a
perfect fuser could not beat. Its weights are random (the kernels' speed does not depend on their values).

This module is plain data plus builders; TensorFlow and torch are imported only inside the export functions.
Run as a script it is the per-framework export child of ``run.py``::

    python benchmarks/models.py --framework keras|torch --cache DIR --T 100 --F 128 --H 256 [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OPSET = 17
IR_VERSION = 8  # onnxruntime 1.31 refuses onnx 1.23's default IR version


@dataclass(frozen=True)
class Layer:
    op: str  # LSTM | GRU | RNN (the ONNX op a perfect fuser emits)
    direction: str = "forward"  # forward | bidirectional

    @property
    def keras_class(self) -> str:
        return {"LSTM": "LSTM", "GRU": "GRU", "RNN": "SimpleRNN"}[self.op]

    @property
    def gates(self) -> int:
        return {"LSTM": 4, "GRU": 3, "RNN": 1}[self.op]

    @property
    def dirs(self) -> int:
        return 2 if self.direction == "bidirectional" else 1


@dataclass(frozen=True)
class ModelSpec:
    name: str
    exporter: str  # keras | trace | dynamo
    layers: tuple[Layer, ...]
    masked: bool = False

    @property
    def framework(self) -> str:
        return "keras" if self.exporter == "keras" else "torch"

    @property
    def batch_first(self) -> bool:
        return self.exporter == "keras"

    @property
    def fixed_time(self) -> bool:
        return self.exporter != "keras"

    def describe(self) -> str:
        parts = []
        for l in self.layers:
            s = l.keras_class if self.exporter == "keras" else f"{l.op}Cell loop"
            parts.append(f"Bidirectional({s})" if l.direction == "bidirectional" else s)
        front = "Masking(0.0) -> " if self.masked else ""
        return front + " -> ".join(parts)

    def file_name(self, T: int, F: int, H: int, batch: int | None = None) -> str:
        t = f"_T{T}" if self.fixed_time else ""
        b = f"_B{batch}" if batch is not None else ""
        return f"{self.name}_F{F}_H{H}{t}{b}.onnx"


L = Layer
MODELS: list[ModelSpec] = [
    ModelSpec("keras_lstm", "keras", (L("LSTM"),), masked=True),
    ModelSpec("keras_gru", "keras", (L("GRU"),), masked=True),
    ModelSpec("keras_simplernn", "keras", (L("RNN"),), masked=True),
    ModelSpec("keras_bigru", "keras", (L("GRU", "bidirectional"),), masked=True),
    ModelSpec("keras_stack", "keras", (L("LSTM"), L("GRU"), L("RNN")), masked=True),
    ModelSpec("torch_lstmcell_trace", "trace", (L("LSTM"),)),
    ModelSpec("torch_grucell_dynamo", "dynamo", (L("GRU"),)),
]
BY_NAME = {m.name: m for m in MODELS}


# --------------------------------------------------------------------------- floor


def build_floor(spec: ModelSpec, F: int, H: int, seed: int = 0):
    """Bare native ops of ``spec``'s kinds/sizes/directions: X ``[T, B, F]`` (+ ``sequence_lens [B]``) -> Y."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "B", F])]
    if spec.masked:
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["B"]))
    nodes, inits = [], []
    x, in_size = "X", F
    for k, layer in enumerate(spec.layers):
        D, G = layer.dirs, layer.gates
        w = {"W": (D, G * H, in_size), "R": (D, G * H, H), "B": (D, 2 * G * H)}
        for n, shape in w.items():
            a = (rng.standard_normal(shape) * (1.0 / np.sqrt(H))).astype(np.float32)
            inits.append(numpy_helper.from_array(a, f"{n}{k}"))
        attrs = dict(hidden_size=H, direction=layer.direction)
        if layer.op == "GRU":
            attrs["linear_before_reset"] = 1  # Keras reset_after=True (default) and every torch GRU
        y = f"Y{k}"
        ins = [x, f"W{k}", f"R{k}", f"B{k}", "sequence_lens" if spec.masked else ""]
        nodes.append(helper.make_node(layer.op, ins, [y], name=f"{layer.op}{k}", **attrs))
        if k + 1 < len(spec.layers):
            if D != 1:
                raise ValueError("floor: only the last layer of a stack may be bidirectional")
            nodes.append(helper.make_node("Squeeze", [y, "axes1"], [f"X{k + 1}"]))
            if not any(i.name == "axes1" for i in inits):
                inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes1"))
            x, in_size = f"X{k + 1}", H
    last = spec.layers[-1]
    out = helper.make_tensor_value_info(y, TensorProto.FLOAT, ["T", last.dirs, "B", H])
    graph = helper.make_graph(nodes, f"floor_{spec.name}", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def floor_feeds(spec: ModelSpec, feeds: dict):
    """The floor's inputs from the real model's: the same features, time-major, and the mask's lengths."""
    import numpy as np

    (x,) = [v for v in feeds.values() if v.ndim == 3]
    if spec.batch_first:
        x = np.ascontiguousarray(x.transpose(1, 0, 2))
    out = {"X": x}
    if spec.masked:
        # Keras Masking(0.0): a step is padding when every feature is 0; inputs are post-padded here
        valid = np.any(x != 0, axis=2)  # [T, B]
        lens = valid.sum(axis=0).astype(np.int32)
        T = x.shape[0]
        post = np.arange(T)[:, None] < lens[None, :]
        if not np.array_equal(valid, post):
            raise ValueError("floor feeds need post-padded masked inputs")
        out["sequence_lens"] = lens
    return out


# --------------------------------------------------------------------------- Keras 3 via tf2onnx


def export_keras(spec: ModelSpec, F: int, H: int, path: Path, seed: int = 0) -> None:
    import keras
    import onnx
    import tensorflow as tf
    import tf2onnx

    keras.utils.set_random_seed(seed)
    inp = keras.Input((None, F), name="x")
    x = keras.layers.Masking(0.0)(inp) if spec.masked else inp
    for layer in spec.layers:
        rnn = getattr(keras.layers, layer.keras_class)(H, return_sequences=True)
        if layer.direction == "bidirectional":
            rnn = keras.layers.Bidirectional(rnn, merge_mode="concat")
        x = rnn(x)
    model = keras.Model(inp, x)
    sig = (tf.TensorSpec((None, None, F), tf.float32, name="x"),)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=sig, opset=OPSET)
    onnx.save(proto, str(path))


# --------------------------------------------------------------------------- torch (trace / dynamo)


def _torch_module(spec: ModelSpec, F: int, H: int):
    import torch
    from torch import nn

    if len(spec.layers) != 1 or spec.layers[0].direction != "forward":
        raise ValueError("torch entries are one forward cell loop")
    op = spec.layers[0].op

    class CellLoop(nn.Module):
        """``for t in range(T): h = cell(x[t], h)``; time-major, returns the stacked outputs ``[T, B, H]``."""

        def __init__(self):
            super().__init__()
            self.cell = {"LSTM": nn.LSTMCell, "GRU": nn.GRUCell, "RNN": nn.RNNCell}[op](F, H)

        def forward(self, x):
            h = torch.zeros(x.shape[1], H, dtype=x.dtype)
            state = (h, torch.zeros_like(h)) if op == "LSTM" else h
            outs = []
            for t in range(x.shape[0]):
                state = self.cell(x[t], state)
                outs.append(state[0] if op == "LSTM" else state)
            return torch.stack(outs)

    return CellLoop().eval()


def export_torch(spec: ModelSpec, T: int, F: int, H: int, path: Path, seed: int = 0, batch: int | None = None) -> None:
    """Export with a dynamic batch (``batch=None``), or with the batch fixed to ``batch``."""
    import torch

    torch.manual_seed(seed)
    module = _torch_module(spec, F, H)
    example = (torch.randn(T, batch or 2, F),)  # not 1: torch.export specialises sizes 0 and 1
    with torch.no_grad():
        if spec.exporter == "dynamo":
            dyn = None if batch else ({1: torch.export.Dim("batch")},)
            torch.onnx.export(module, example, str(path), dynamo=True, external_data=False, verbose=False,
                              input_names=["x"], output_names=["y"], dynamic_shapes=dyn)
        else:
            axes = None if batch else {"x": {1: "batch"}, "y": {1: "batch"}}
            torch.onnx.export(module, example, str(path), dynamo=False, opset_version=OPSET, input_names=["x"],
                              output_names=["y"], dynamic_axes=axes)
    _inline_external_data(path)


def _inline_external_data(path: Path) -> None:
    import onnx

    model = onnx.load(str(path))
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        for t in model.graph.initializer:
            t.data_location = onnx.TensorProto.DEFAULT
        onnx.save(model, str(path), save_as_external_data=False)
    data = Path(str(path) + ".data")
    if data.exists():
        data.unlink()


# --------------------------------------------------------------------------- export child


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "tf2onnx", "absl",
                 "keras", "tensorflow"):
        logging.getLogger(name).setLevel(logging.ERROR)


def exporter_versions(framework: str) -> dict:
    if framework == "keras":
        import keras
        import tensorflow as tf
        import tf2onnx

        return {"tensorflow": tf.__version__, "keras": keras.__version__, "tf2onnx": tf2onnx.__version__}
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnxscript": onnxscript.__version__}


def _atomic(path: Path, export) -> None:
    """``export(tmp)`` then rename to ``path``: an interrupted export never leaves a cached file behind."""
    tmp = path.with_name(path.stem + ".partial.onnx")
    try:
        export(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".data").unlink(missing_ok=True)


def export_all(framework: str, names: list[str], cache: Path, T: int, F: int, H: int, batches: list[int]) -> list[dict]:
    """Export the named entries that are not in ``cache`` yet; one JSON-able record per entry."""
    _quiet()
    records = []
    for name in names:
        spec = BY_NAME[name]
        if spec.framework != framework:
            continue
        rec = {"name": name, "files": {}, "seconds": 0.0, "error": "", "notes": ""}
        path = cache / spec.file_name(T, F, H)
        t0 = time.perf_counter()
        try:
            if path.exists():
                rec["notes"] = "cached"
            elif framework == "keras":
                _atomic(path, lambda p: export_keras(spec, F, H, p))
            else:
                try:
                    _atomic(path, lambda p: export_torch(spec, T, F, H, p))
                except Exception as e:  # noqa: BLE001 - fall back to one static-batch export per batch size
                    rec["notes"] = f"dynamic batch failed ({type(e).__name__}); one export per batch"
                    for b in batches:
                        pb = cache / spec.file_name(T, F, H, b)
                        if not pb.exists():
                            _atomic(pb, lambda p, b=b: export_torch(spec, T, F, H, p, batch=b))
                        rec["files"][str(b)] = str(pb)
            if not rec["files"]:
                rec["files"] = {"*": str(path)}
        except Exception as e:  # noqa: BLE001 - reported by the parent, the other entries go on
            rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        rec["seconds"] = time.perf_counter() - t0
        records.append(rec)
        print(f"  exported {name}: {rec['error'] or rec['notes'] or 'ok'} ({rec['seconds']:.1f}s)", file=sys.stderr)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="export the benchmark models of one framework into a cache dir")
    ap.add_argument("--framework", choices=["keras", "torch"], required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--names", default=",".join(m.name for m in MODELS))
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--F", type=int, default=128)
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--json", type=Path, required=True, help="where to write the records")
    a = ap.parse_args(argv)
    a.cache.mkdir(parents=True, exist_ok=True)
    recs = export_all(a.framework, a.names.split(","), a.cache, a.T, a.F, a.H, [int(b) for b in a.batches.split(",")])
    a.json.write_text(json.dumps({"versions": exporter_versions(a.framework), "records": recs}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
