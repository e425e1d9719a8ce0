"""Build Keras recurrent models, export them with tf2onnx and record Keras' own outputs.

Usage::

    python tests/exporters/keras_cases.py --backend keras3|tf_keras --out DIR [--only SUBSTR ...]
    python tests/exporters/keras_cases.py --list

For every case three files are written into DIR:

``<case>.onnx``
    the model exactly as ``tf2onnx.convert.from_keras(..., opset=17)`` wrote it.
``<case>.npz``
    ``in/<set>/<onnx input name>`` (the feeds) and ``out/<set>/<k>`` (Keras' own
    ``model(x)`` for the k-th entry of ``graph.output``).
``<case>.json``
    what a perfect fuser should leave behind (``expect``), the input set names, whether
    the model is masked, and the recurrent ops tf2onnx itself emitted (``tf2onnx_ops``).

Each backend must run in its own process (``TF_USE_LEGACY_KERAS`` is read when
TensorFlow is imported). The case table below is plain data, so this module can be
imported without importing TensorFlow (e.g. to list the cases from a test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FEATURES = 5  # features per time step
TIME = 7  # time steps in every input set
VOCAB = 20  # Embedding vocabulary (token 0 is the padding id)
EMBED_DIM = 8
STATIC_BATCH = 4  # batch size of the static-shape cases
OPSET = 17

ONNX_OP = {"LSTM": "LSTM", "GRU": "GRU", "SimpleRNN": "RNN", "CharCell": "RNN"}
STATE_NAMES = {"LSTM": ("h0", "c0"), "GRU": ("h0",), "SimpleRNN": ("h0",)}

# Steps kept (1) / padded (0) in the masked input sets; rows are batch entries.
MASK_PATTERNS = {
    "post_b1": ["1111100"],
    "post_b4": ["1111111", "1111100", "1100000", "1000000"],
    "pre_b4": ["1111111", "0001111", "0000001", "0111111"],
    "gappy_b4": ["1011001", "0111110", "1111111", "0010100"],
    "allmasked_b4": ["0000000", "1110000", "0000000", "0101101"],
}
UNMASKED_BATCHES = {"b1": 1, "b4": 4}


# --------------------------------------------------------------------------- case table


@dataclass(frozen=True)
class Rnn:
    """One recurrent layer: ``kind(units, return_sequences=seq, **opts)``, optionally Bidirectional."""

    kind: str  # "LSTM" | "GRU" | "SimpleRNN"
    seq: bool = True  # return_sequences
    units: int = 4
    opts: tuple = ()  # extra layer kwargs as (name, value) pairs
    merge: str | None = None  # Bidirectional merge_mode; None = not wrapped

    @property
    def direction(self) -> str:
        if self.merge is not None:
            return "bidirectional"
        return "reverse" if dict(self.opts).get("go_backwards") else "forward"

    def describe(self) -> str:
        args = [str(self.units)] + [f"{k}={v!r}" for k, v in self.opts]
        if self.seq:
            args.append("return_sequences=True")
        text = f"{self.kind}({', '.join(args)})"
        return f"Bidirectional({text}, merge_mode={self.merge!r})" if self.merge else text


def lstm(seq=True, **opts):
    return Rnn("LSTM", seq, 4, tuple(opts.items()))


def gru(seq=True, **opts):
    return Rnn("GRU", seq, 5, tuple(opts.items()))


def rnn(seq=True, **opts):
    return Rnn("SimpleRNN", seq, 3, tuple(opts.items()))


def char_cell(seq=True) -> Rnn:
    """``keras.layers.RNN`` over a custom cell written as the char-RNN tutorial: ``comb = concat([x_t, h])``,
    new h ``tanh(comb @ W + b)``, output ``log_softmax(comb @ V)`` (the head reads the h the step read)."""
    return Rnn("CharCell", seq, 4)


def bi(layer: Rnn, merge="concat") -> Rnn:
    return Rnn(layer.kind, layer.seq, layer.units, layer.opts, merge)


@dataclass(frozen=True)
class Case:
    name: str
    rnns: tuple  # Rnn layers, applied in order
    front: str = "none"  # "none" | "masking" (Masking(0.0)) | "embedding" (mask_zero=True) | "embedding_nomask"
    # | "permute" (x given features first, [B, F, T], and Permute((2, 1)) before the first layer)
    state_out: bool = False  # last layer has return_state=True; all its outputs are model outputs
    state_in: bool = False  # last layer gets initial_state from extra model inputs h0 (, c0)
    static: bool = False  # batch and time fixed in the input signature

    @property
    def masked(self) -> bool:
        return self.front in ("masking", "embedding")

    @property
    def tokens(self) -> bool:
        return self.front.startswith("embedding")

    @property
    def sets(self) -> list[str]:
        names = list(MASK_PATTERNS) if self.masked else list(UNMASKED_BATCHES)
        if self.static:
            names = [s for s in names if s.endswith(f"_b{STATIC_BATCH}") or s == f"b{STATIC_BATCH}"]
        return names


def case(name, *rnns, masked=False, **kw) -> Case:
    kw.setdefault("front", "masking" if masked else "none")
    return Case(name, tuple(rnns), **kw)


HARD = {"recurrent_activation": "hard_sigmoid"}
BACK = {"go_backwards": True}

CASES = [
    # LSTM
    case("lstm_seq", lstm()),
    case("lstm_last", lstm(False)),
    case("lstm_masked_seq", lstm(), masked=True),
    case("lstm_masked_last", lstm(False), masked=True),
    case("lstm_nobias_seq", lstm(use_bias=False)),
    case("lstm_nobias_masked_last", lstm(False, use_bias=False), masked=True),
    case("lstm_relu_last", lstm(False, activation="relu")),
    case("lstm_relu_masked_seq", lstm(activation="relu"), masked=True),
    case("lstm_hardsig_seq", lstm(**HARD)),
    case("lstm_hardsig_masked_last", lstm(False, **HARD), masked=True),
    case("lstm_state_last", lstm(False), state_out=True),
    case("lstm_state_masked_seq", lstm(), masked=True, state_out=True),
    case("lstm_init_seq", lstm(), state_in=True),
    case("lstm_init_masked_last", lstm(False), masked=True, state_in=True),
    # relu with arguments: max_value (Relu, Min, Max: a relu clipped at 3) and threshold (a select: ThresholdedRelu)
    case("rnn_relu_max3_seq", rnn(activation="relu_max3")),
    # a custom cell whose output head reads concat([x_t, h]) with the h the step read (the char-RNN tutorial's)
    case("char_cell_seq", char_cell()),
    case("rnn_relu_threshold1_masked_seq", rnn(activation="relu_threshold1"), masked=True),
    # x given features first, [B, F, T] (its two symbolic dims apart: validation crashed sizing it)
    case("gru_features_first_seq", gru(), front="permute"),
    # GRU (reset_after=True is the Keras default; "v1" = reset_after=False)
    case("gru_seq", gru()),
    case("gru_last", gru(False)),
    case("gru_masked_seq", gru(), masked=True),
    case("gru_masked_last", gru(False), masked=True),
    case("gru_v1_seq", gru(reset_after=False)),
    case("gru_v1_masked_last", gru(False, reset_after=False), masked=True),
    case("gru_hardsig_last", gru(False, **HARD)),
    case("gru_hardsig_masked_seq", gru(**HARD), masked=True),
    case("gru_state_seq", gru(), state_out=True),
    case("gru_state_masked_last", gru(False), masked=True, state_out=True),
    case("gru_init_last", gru(False), state_in=True),
    case("gru_v1_init_masked_seq", gru(reset_after=False), masked=True, state_in=True),
    # SimpleRNN
    case("rnn_seq", rnn()),
    case("rnn_last", rnn(False)),
    case("rnn_masked_seq", rnn(), masked=True),
    case("rnn_masked_last", rnn(False), masked=True),
    case("rnn_relu_seq", rnn(activation="relu")),
    case("rnn_relu_masked_last", rnn(False, activation="relu"), masked=True),
    case("rnn_state_last", rnn(False), state_out=True),
    case("rnn_state_masked_seq", rnn(), masked=True, state_out=True),
    case("rnn_init_seq", rnn(), state_in=True),
    case("rnn_init_masked_last", rnn(False), masked=True, state_in=True),
    # go_backwards (with return_sequences Keras returns the outputs in reversed time order)
    case("lstm_bwd_seq", lstm(**BACK)),
    case("lstm_bwd_masked_last", lstm(False, **BACK), masked=True),
    case("gru_bwd_last", gru(False, **BACK)),
    case("gru_bwd_masked_seq", gru(**BACK), masked=True),
    case("rnn_bwd_seq", rnn(**BACK)),
    case("rnn_bwd_masked_last", rnn(False, **BACK), masked=True),
    # Bidirectional: every merge mode at least once with and once without a mask
    case("bilstm_seq", bi(lstm())),
    case("bilstm_masked_last", bi(lstm(False)), masked=True),
    case("bilstm_sum_masked_seq", bi(lstm(), "sum"), masked=True),
    case("bilstm_mul_last", bi(lstm(False), "mul")),
    case("bilstm_state_masked_seq", bi(lstm()), masked=True, state_out=True),
    case("bigru_masked_seq", bi(gru()), masked=True),
    case("bigru_sum_seq", bi(gru(), "sum")),
    case("bigru_ave_last", bi(gru(False), "ave")),
    case("bigru_mul_masked_last", bi(gru(False), "mul"), masked=True),
    case("bigru_state_last", bi(gru(False)), state_out=True),
    case("birnn_last", bi(rnn(False))),
    case("birnn_ave_masked_seq", bi(rnn(), "ave"), masked=True),
    # stacks behind one mask
    case("stack_last", lstm(), gru(), rnn(False)),
    case("stack_masked_seq", lstm(), gru(), rnn(), masked=True),
    case("bilstm_lstm_last", bi(lstm()), lstm(False)),
    case("bilstm_lstm_masked_seq", bi(lstm()), lstm(), masked=True),
    case("emb_lstm_seq", lstm(), front="embedding"),
    case("emb_lstm_nomask_last", lstm(False), front="embedding_nomask"),
    case("emb_bigru_last", bi(gru(False)), front="embedding"),
    # static shapes (every other case has dynamic batch and time, batch-first)
    case("lstm_static_masked_seq", lstm(), masked=True, static=True),
    case("gru_static_last", gru(False), static=True),
    # a fixed time dimension gives every Loop a constant trip count: the second layer's count is proven only
    # once the first is a native op, so one run must iterate to the fixed point
    case("stack_static_seq", lstm(), gru(), rnn(), static=True),
    case("stack_static_masked_last", lstm(), gru(), rnn(False), masked=True, static=True),
    # unroll=True (needs a static time dimension): tf2onnx writes one cell per step
    case("lstm_unroll_seq", lstm(unroll=True), static=True),
    case("gru_unroll_last", gru(False, unroll=True), static=True),
    case("gru_v1_unroll_seq", gru(reset_after=False, unroll=True), static=True),
    case("rnn_unroll_bwd_seq", rnn(unroll=True, **BACK), static=True),
    case("bilstm_unroll_last", bi(lstm(False, unroll=True)), static=True),
    case("lstm_unroll_masked_seq", lstm(unroll=True), masked=True, static=True),
    case("gru_unroll_masked_last", gru(False, unroll=True), masked=True, static=True),
    case("gru_v1_unroll_masked_seq", gru(reset_after=False, unroll=True), masked=True, static=True),
    case("rnn_unroll_bwd_masked_seq", rnn(unroll=True, **BACK), masked=True, static=True),
    case("lstm_unroll_init_masked_seq", lstm(unroll=True), masked=True, state_in=True, static=True),
    case("gru_unroll_state_masked_last", gru(False, unroll=True), masked=True, state_out=True, static=True),
    case("bigru_unroll_masked_seq", bi(gru(unroll=True)), masked=True, static=True),
    case("stack_unroll_masked_seq", lstm(unroll=True), gru(unroll=True), masked=True, static=True),
]


# --------------------------------------------------------------------------- expectations


def expectation(c: Case) -> dict:
    ops: dict[str, int] = {}
    directions: dict[str, list[str]] = {}
    for layer in c.rnns:
        op = ONNX_OP[layer.kind]
        ops[op] = ops.get(op, 0) + 1
        directions.setdefault(op, []).append(layer.direction)
    return {"ops": ops, "absent": ["Loop", "Scan"], "directions": directions}


def describe(c: Case) -> str:
    front = {
        "none": [],
        "masking": ["Masking(0.0)"],
        "embedding": [f"Embedding({VOCAB}, {EMBED_DIM}, mask_zero=True)"],
        "embedding_nomask": [f"Embedding({VOCAB}, {EMBED_DIM})"],
        "permute": ["x [B, F, T]", "Permute((2, 1))"],
    }[c.front]
    parts = front + [r.describe() for r in c.rnns]
    if c.state_out:
        parts[-1] += " [return_state=True]"
    if c.state_in:
        parts[-1] += f" [initial_state={list(STATE_NAMES[c.rnns[-1].kind])}]"
    shape = f"static batch={STATIC_BATCH}, time={TIME}" if c.static else "dynamic batch and time"
    return f"{' -> '.join(parts)}; batch-first, {shape}"


def case_notes(c: Case, backend: str) -> str:
    notes = []
    if c.front == "masking":
        notes.append("mask from Masking(0.0): padded steps are all-zero feature vectors")
    elif c.front == "embedding":
        notes.append("int32 token ids; mask from Embedding(mask_zero=True): padded steps are token 0")
    elif c.front == "embedding_nomask":
        notes.append("int32 token ids, no mask (token 0 is an ordinary token)")
    if c.masked:
        notes.append(
            "references include the padded steps: a masked step keeps the state and (return_sequences) repeats "
            "the previous output, or zeros inside Bidirectional"
        )
    if c.masked and c.state_in:
        notes.append("mask passed explicitly (mask=front.compute_mask(x)): Keras 3 drops it with initial_state")
    if any(dict(r.opts).get("recurrent_activation") == "hard_sigmoid" for r in c.rnns):
        notes.append(
            "hard_sigmoid is clip(x/6 + 0.5, 0, 1) in Keras 3"
            if backend == "keras3"
            else "hard_sigmoid is clip(0.2*x + 0.5, 0, 1) in tf_keras"
        )
    if any(r.direction == "reverse" and r.seq for r in c.rnns):
        notes.append("go_backwards with return_sequences: Keras returns the sequence in reversed time order")
    if c.static:
        notes.append(f"static batch: only batch-{STATIC_BATCH} sets")
    return "; ".join(notes)


# --------------------------------------------------------------------------- input sets


def input_sets(c: Case, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Feeds per set, keyed by the Keras/TensorSpec input name."""
    sets = {}
    for set_name in c.sets:
        if c.masked:
            keep = np.array([[ch == "1" for ch in row] for row in MASK_PATTERNS[set_name]])
        else:
            keep = np.ones((UNMASKED_BATCHES[set_name], TIME), dtype=bool)
        batch = keep.shape[0]
        if c.tokens:
            low = 1 if c.masked else 0
            x = rng.integers(low, VOCAB, size=(batch, TIME)).astype(np.int32)
            x[~keep] = 0
        else:
            x = rng.standard_normal((batch, TIME, FEATURES)).astype(np.float32)
            x[x == 0] = 0.5  # a real step is never an exact mask value
            x[~keep] = 0.0
            if c.front == "permute":
                x = np.ascontiguousarray(x.transpose(0, 2, 1))
        feeds = {"x": x}
        if c.state_in:
            layer = c.rnns[-1]
            for name in STATE_NAMES[layer.kind]:
                feeds[name] = rng.standard_normal((batch, layer.units)).astype(np.float32)
        sets[set_name] = feeds
    return sets


# --------------------------------------------------------------------------- Keras model


def build_model(keras, c: Case, rng: np.random.Generator):
    """Return (model, input specs as (name, shape, dtype)); weights are random, biases included."""
    batch = STATIC_BATCH if c.static else None
    time_dim = TIME if c.static else None
    specs = []

    def model_input(name, shape, dtype="float32"):
        specs.append((name, (batch,) + shape, dtype))
        return keras.Input(batch_shape=(batch,) + shape, name=name, dtype=dtype)

    if c.tokens:
        x = model_input("x", (time_dim,), "int32")
        front = keras.layers.Embedding(VOCAB, EMBED_DIM, mask_zero=c.masked, name="embedding")
    elif c.front == "permute":
        x = model_input("x", (FEATURES, time_dim))
        front = keras.layers.Permute((2, 1), name="permute")
    else:
        x = model_input("x", (time_dim, FEATURES))
        front = keras.layers.Masking(0.0, name="masking") if c.masked else None
    h = front(x) if front is not None else x
    inputs = [x]

    for i, spec in enumerate(c.rnns):
        last = i == len(c.rnns) - 1
        name = f"{spec.kind.lower()}{i}"
        if spec.kind == "CharCell":
            h = keras.layers.RNN(_char_cell(keras, spec.units), return_sequences=spec.seq, name=name)(h)
            continue
        layer = getattr(keras.layers, spec.kind)(
            spec.units,
            return_sequences=spec.seq,
            return_state=last and c.state_out,
            name=name,
            **{k: _activation(keras, v) if k == "activation" else v for k, v in spec.opts},
        )
        if spec.merge is not None:
            layer = keras.layers.Bidirectional(layer, merge_mode=spec.merge, name=f"bidirectional{i}")
        if last and c.state_in:
            states = [model_input(s, (spec.units,)) for s in STATE_NAMES[spec.kind]]
            inputs += states
            # Keras 3 only propagates a mask automatically to a layer called with a single
            # tensor argument, so with initial_state the mask is passed explicitly.
            mask = front.compute_mask(x) if c.masked else None
            h = layer(h, initial_state=states, mask=mask)
        else:
            h = layer(h)

    outputs = list(h) if c.state_out else [h]
    model = keras.Model(inputs if len(inputs) > 1 else inputs[0], outputs)
    # Random weights everywhere: Keras' default zero biases would hide bias bugs.
    for w in model.weights:
        w.assign((0.5 * rng.standard_normal(tuple(w.shape))).astype(np.float32))
    return model, specs


def _char_cell(keras, units: int, out: int = 3):
    """The custom cell of :func:`char_cell`, for the Keras of the backend (Keras 3 or tf_keras)."""
    ops = keras.ops if hasattr(keras, "ops") else None

    class CharCell(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.units, self.state_size, self.output_size = units, units, out

        def build(self, input_shape):
            width = int(input_shape[-1]) + units
            self.W = self.add_weight(shape=(width, units), name="W")
            self.b = self.add_weight(shape=(units,), name="b")
            self.V = self.add_weight(shape=(width, out), name="V")

        def call(self, x, states):
            if ops is not None:
                comb = ops.concatenate([x, states[0]], -1)
                return keras.activations.log_softmax(ops.matmul(comb, self.V)), [ops.tanh(ops.matmul(comb, self.W) + self.b)]
            import tensorflow as tf
            comb = tf.concat([x, states[0]], -1)
            return tf.nn.log_softmax(tf.matmul(comb, self.V)), [tf.tanh(tf.matmul(comb, self.W) + self.b)]

    return CharCell()


# activations with arguments, named for the case tables (keras.activations.relu takes both in Keras 3 and tf_keras)
CUSTOM_ACTIVATIONS = {"relu_max3": dict(max_value=3.0), "relu_threshold1": dict(threshold=1.0)}


def _activation(keras, name):
    """A layer's activation argument: the name, or the relu with arguments it stands for."""
    if name not in CUSTOM_ACTIVATIONS:
        return name
    kwargs = CUSTOM_ACTIVATIONS[name]
    return lambda x: keras.activations.relu(x, **kwargs)


def keras_reference(model, feeds: dict[str, np.ndarray], input_names: list[str]) -> list[np.ndarray]:
    args = [feeds[n] for n in input_names]
    out = model(args if len(args) > 1 else args[0], training=False)
    return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


# --------------------------------------------------------------------------- export


def keras_output_names(model) -> list[str]:
    """The names tf2onnx gives the graph outputs: Keras' output names, duplicates suffixed _1, _2..."""
    names = list(getattr(model, "output_names", None) or [t.name.split("/")[0] for t in model.outputs])
    seen: set[str] = set()
    result = []
    for name in names:
        new, i = name, 0
        while new in seen:
            i += 1
            new = f"{name}_{i}"
        seen.add(new)
        result.append(new)
    return result


def output_order(onnx_model, model, sample: list[np.ndarray]) -> list[int]:
    """For each ONNX graph output, the index of the Keras output it carries."""
    onnx_names = [o.name for o in onnx_model.graph.output]
    keras_names = keras_output_names(model)
    if sorted(onnx_names) == sorted(keras_names) and len(set(onnx_names)) == len(onnx_names):
        order = [keras_names.index(n) for n in onnx_names]
    elif len(onnx_names) == len(sample):
        order = list(range(len(sample)))  # tf2onnx keeps Keras' output order
    else:
        raise RuntimeError(f"cannot map ONNX outputs {onnx_names} to Keras outputs {keras_names}")
    for out, k in zip(onnx_model.graph.output, order):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in out.type.tensor_type.shape.dim]
        shape = sample[k].shape
        if len(dims) != len(shape) or any(d not in (None, s) for d, s in zip(dims, shape)):
            raise RuntimeError(f"ONNX output {out.name} {dims} does not fit Keras output {k} {shape}")
    return order


def graph_ops(graph) -> list[str]:
    """Op types in a graph and its subgraphs; ops outside the default domain as "domain::op"."""
    ops = []
    for node in graph.node:
        ops.append(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}")
        for attr in node.attribute:
            subgraphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            for sub in subgraphs:
                ops.extend(graph_ops(sub))
    return ops


def export(tf, tf2onnx, onnx, model, specs):
    signature = [tf.TensorSpec(shape, getattr(tf, dtype), name=name) for name, shape, dtype in specs]
    onnx_model, _ = tf2onnx.convert.from_keras(model, input_signature=signature, opset=OPSET)
    onnx.checker.check_model(onnx_model)
    foreign = sorted({op for op in graph_ops(onnx_model.graph) if "::" in op})
    if foreign:  # from_keras converts with continue_on_error=True
        raise RuntimeError(f"tf2onnx left unconverted ops: {foreign}")
    onnx_names = [i.name for i in onnx_model.graph.input]
    if sorted(onnx_names) != sorted(n for n, _, _ in specs):
        raise RuntimeError(f"ONNX inputs {onnx_names} do not match Keras inputs {[n for n, _, _ in specs]}")
    return onnx_model


def generate(c: Case, backend: str, out_dir: Path, keras, tf, tf2onnx, onnx) -> dict:
    for suffix in (".onnx", ".npz", ".json"):  # a skipped case must not leave stale files behind
        (out_dir / f"{c.name}{suffix}").unlink(missing_ok=True)
    keras.backend.clear_session()
    seed = zlib.crc32(c.name.encode())  # same data whatever subset of cases is generated
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)

    model, specs = build_model(keras, c, rng)
    input_names = [n for n, _, _ in specs]
    sets = input_sets(c, rng)
    refs = {s: keras_reference(model, feeds, input_names) for s, feeds in sets.items()}

    onnx_model = export(tf, tf2onnx, onnx, model, specs)
    order = output_order(onnx_model, model, refs[c.sets[0]])

    arrays = {}
    for s, feeds in sets.items():
        for name, value in feeds.items():
            arrays[f"in/{s}/{name}"] = value
        for k, keras_index in enumerate(order):
            arrays[f"out/{s}/{k}"] = refs[s][keras_index]

    ops = graph_ops(onnx_model.graph)
    exported = {op: ops.count(op) for op in ("LSTM", "GRU", "RNN", "Loop", "Scan") if op in ops}
    meta = {
        "name": c.name,
        "backend": backend,
        "layers": describe(c),
        "expect": expectation(c),
        "sets": c.sets,
        "masked": c.masked,
        "notes": case_notes(c, backend),
        "tf2onnx_ops": exported,
    }
    onnx.save(onnx_model, str(out_dir / f"{c.name}.onnx"))
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------- main


def import_backend(backend: str):
    """Import TensorFlow, the requested Keras, tf2onnx and onnx (environment set first)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if backend == "tf_keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import logging

    import tensorflow as tf

    if backend == "tf_keras":
        import tf_keras as keras
    else:
        import keras
    import onnx
    import tf2onnx

    tf.get_logger().setLevel(logging.ERROR)
    logging.getLogger("tf2onnx").setLevel(logging.ERROR)
    return keras, tf, tf2onnx, onnx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["keras3", "tf_keras"])
    parser.add_argument("--out", type=Path, help="directory for <case>.onnx/.npz/.json")
    parser.add_argument("--only", nargs="+", action="extend", metavar="SUBSTR",
                        help="only cases whose name contains one of these substrings")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)

    cases = [c for c in CASES if not args.only or any(s in c.name for s in args.only)]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.backend is None or args.out is None:
        parser.error("--backend and --out are required unless --list is given")
    if not cases:
        print(f"no case matches --only {args.only}", file=sys.stderr)
        return 2

    keras, tf, tf2onnx, onnx = import_backend(args.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    done, skipped = 0, []
    for c in cases:
        start = time.perf_counter()
        try:
            meta = generate(c, args.backend, args.out, keras, tf, tf2onnx, onnx)
        except Exception as exc:  # one broken case must not stop the others
            skipped.append(c.name)
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"WARNING: skipped {c.name} ({args.backend}): {reason}", file=sys.stderr, flush=True)
            continue
        done += 1
        print(f"{c.name}: {time.perf_counter() - start:.1f}s tf2onnx emitted {meta['tf2onnx_ops']}")
    print(f"{args.backend}: {done} cases written to {args.out}, {len(skipped)} skipped {skipped or ''}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
