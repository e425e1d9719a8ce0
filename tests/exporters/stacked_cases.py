"""Export recurrences that run several cells in one time step (issue 14, item 3), with reference outputs.

Keras ``RNN([cell1, cell2])`` / ``RNN(StackedRNNCells([...]))`` put the whole stack into one tf2onnx Loop
body; the second cell reads the first cell's new output, and under a mask the whole stacked state is kept at
masked steps. rnnfuse should write one native op per cell, the second fed by the first's Y.

torch loops that call two cells per step (``h1, c1 = cell1(x[t], (h1, c1)); h2 = cell2(h1, h2)``): TorchScript
writes the stack into one Loop body, trace and dynamo unroll it into one chain per cell, the upper chain
reading the lower one's per-step h.

Usage: ``python stacked_cases.py --backend keras3|tf_keras|torch --out DIR``. The case table is plain data (the
test imports it without TensorFlow); helpers shared with the single-layer cases come from keras_cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from keras_cases import (  # noqa: E402
    FEATURES,
    MASK_PATTERNS,
    ONNX_OP,
    STATIC_BATCH,
    TIME,
    UNMASKED_BATCHES,
    export,
    graph_ops,
    import_backend,
    keras_reference,
    output_order,
)

UNITS = {"LSTM": 4, "GRU": 5, "SimpleRNN": 3}
B1_PATTERNS = {"post_b1": ["1111100"], "pre_b1": ["0001111"], "gappy_b1": ["1011001"], "full_b1": ["1111111"]}


@dataclass(frozen=True)
class Case:
    name: str
    cells: tuple  # cell kinds, bottom first: "LSTM" | "GRU" | "SimpleRNN"
    seq: bool = True  # return_sequences
    masked: bool = False  # Masking(0.0) in front
    state_out: bool = False  # return_state=True: every cell's final states are model outputs
    backwards: bool = False  # go_backwards=True
    wrapper: bool = False  # RNN(StackedRNNCells([...])) instead of RNN([...])
    static: bool = False  # batch and time fixed in the input signature
    layer: bool = False  # keras.layers.<cell kind>(units) itself (one cell), not RNN([cells])
    batch1: bool = False  # batch fixed to 1 in the input signature (time free)

    @property
    def sets(self) -> list[str]:
        if self.batch1:
            return list(B1_PATTERNS) if self.masked else ["b1"]
        names = list(MASK_PATTERNS) if self.masked else list(UNMASKED_BATCHES)
        if self.static:
            names = [s for s in names if s.endswith(f"_b{STATIC_BATCH}") or s == f"b{STATIC_BATCH}"]
        return names


CASES = [
    Case("cells_lstm_gru_seq", ("LSTM", "GRU")),
    Case("cells_lstm_lstm_state", ("LSTM", "LSTM"), seq=False, state_out=True, wrapper=True),
    Case("cells_gru_rnn_masked_seq", ("GRU", "SimpleRNN"), masked=True),
    Case("cells_lstm_gru_masked_last", ("LSTM", "GRU"), seq=False, masked=True),
    Case("cells_three_masked_state", ("LSTM", "GRU", "SimpleRNN"), masked=True, state_out=True),
    Case("cells_lstm_gru_bwd_masked_seq", ("LSTM", "GRU"), masked=True, backwards=True),
    Case("cells_gru_lstm_static_seq", ("GRU", "LSTM"), static=True),
    # issue 14 item 9: a masked layer exported with its batch fixed to 1 (tf2onnx squeezes h @ R to [4H])
    Case("lstm_batch1_masked_seq", ("LSTM",), masked=True, layer=True, batch1=True),
    Case("gru_batch1_masked_last", ("GRU",), seq=False, masked=True, layer=True, batch1=True),
    Case("cells_lstm_gru_batch1_masked_seq", ("LSTM", "GRU"), masked=True, batch1=True),
]


def expectation(c: Case) -> dict:
    ops: dict[str, int] = {}
    for kind in c.cells:
        ops[ONNX_OP[kind]] = ops.get(ONNX_OP[kind], 0) + 1
    return {"ops": ops, "absent": ["Loop", "Scan"]}


def describe(c: Case) -> str:
    cells = ", ".join(f"{k}Cell({UNITS[k]})" for k in c.cells)
    cells = f"StackedRNNCells([{cells}])" if c.wrapper else f"[{cells}]"
    opts = [f"return_sequences={c.seq}"] + (["return_state=True"] if c.state_out else []) + (
        ["go_backwards=True"] if c.backwards else [])
    front = "Masking(0.0) -> " if c.masked else ""
    shape = "; batch fixed to 1" if c.batch1 else ""
    if c.layer:
        return f"{front}{c.cells[0]}({UNITS[c.cells[0]]}, {', '.join(opts)}){shape}"
    return f"{front}RNN({cells}, {', '.join(opts)}){shape}"


def input_sets(c: Case, rng: np.random.Generator) -> dict:
    sets = {}
    for set_name in c.sets:
        if c.masked:
            keep = np.array([[ch == "1" for ch in row] for row in {**MASK_PATTERNS, **B1_PATTERNS}[set_name]])
        else:
            keep = np.ones((UNMASKED_BATCHES[set_name], TIME), dtype=bool)
        x = rng.standard_normal((keep.shape[0], TIME, FEATURES)).astype(np.float32)
        x[x == 0] = 0.5
        x[~keep] = 0.0
        sets[set_name] = {"x": x}
    return sets


def _flat(x) -> list:
    """Keras returns a stack's states nested per cell: the model outputs them flat, bottom cell first."""
    return [t for v in x for t in _flat(v)] if isinstance(x, (list, tuple)) else [x]


def build_model(keras, c: Case, rng: np.random.Generator):
    batch = 1 if c.batch1 else STATIC_BATCH if c.static else None
    time_dim = TIME if c.static else None
    specs = [("x", (batch, time_dim, FEATURES), "float32")]
    x = keras.Input(batch_shape=(batch, time_dim, FEATURES), name="x")
    h = keras.layers.Masking(0.0, name="masking")(x) if c.masked else x
    if c.layer:
        layer = getattr(keras.layers, c.cells[0])(UNITS[c.cells[0]], return_sequences=c.seq, return_state=c.state_out,
                                                  go_backwards=c.backwards, name="layer")
    else:
        cells = [getattr(keras.layers, f"{k}Cell")(UNITS[k], name=f"{k.lower()}_cell{i}") for i, k in enumerate(c.cells)]
        cell = keras.layers.StackedRNNCells(cells) if c.wrapper else cells
        layer = keras.layers.RNN(cell, return_sequences=c.seq, return_state=c.state_out, go_backwards=c.backwards,
                                 name="stacked")
    out = layer(h)
    outputs = _flat(out) if c.state_out else [out]
    model = keras.Model(x, outputs)
    for w in model.weights:
        w.assign((0.5 * rng.standard_normal(tuple(w.shape))).astype(np.float32))
    return model, specs


def generate(c: Case, backend: str, out_dir: Path, keras, tf, tf2onnx, onnx) -> dict:
    for suffix in (".onnx", ".npz", ".json"):
        (out_dir / f"{c.name}{suffix}").unlink(missing_ok=True)
    keras.backend.clear_session()
    seed = zlib.crc32(c.name.encode())
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model, specs = build_model(keras, c, rng)
    sets = input_sets(c, rng)
    refs = {s: keras_reference(model, feeds, ["x"]) for s, feeds in sets.items()}
    onnx_model = export(tf, tf2onnx, onnx, model, specs)
    order = output_order(onnx_model, model, refs[c.sets[0]])
    arrays = {}
    for s, feeds in sets.items():
        arrays[f"in/{s}/x"] = feeds["x"]
        for k, keras_index in enumerate(order):
            arrays[f"out/{s}/{k}"] = refs[s][keras_index]
    ops = graph_ops(onnx_model.graph)
    meta = {
        "name": c.name,
        "backend": backend,
        "layers": describe(c),
        "expect": expectation(c),
        "sets": c.sets,
        "masked": c.masked,
        "notes": "references include the padded steps" if c.masked else "",
        "tf2onnx_ops": {op: ops.count(op) for op in ("LSTM", "GRU", "RNN", "Loop", "Scan") if op in ops},
    }
    onnx.save(onnx_model, str(out_dir / f"{c.name}.onnx"))
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------- torch

TORCH_H = {"lstm": 4, "gru": 5, "rnn": 3}


@dataclass(frozen=True)
class TorchCase:
    name: str
    exporter: str  # "torchscript" | "trace" | "dynamo"
    cells: tuple  # "lstm" | "gru" | "rnn", bottom first (one or two)
    batch_first: bool = False
    # how the per-step outputs are returned (issue 14 item 4: the per-step h read by more than a stack):
    # "stack" torch.stack(ys); "head" a Linear applied to h at every step, stacked; "cat" torch.cat(ys, -1)
    # (features); "skip1" torch.stack(ys[1:]); near miss "hc" torch.stack(cat([h, c], -1)) (a middle step's c,
    # which no native op outputs). TorchScript only (the head inside the Loop body): "head_x" returns
    # (stack(h), stack(tanh(head(h) + proj(x_t)))); "head_prev" the head on h before the cell call; near miss
    # "head_c" the head on the cell state c. Length masks (forward(x, lengths), m = t < lengths per row):
    # "len_zero" every state kept where m is 0, outputs m * h (zeros past the length); "len_carry" outputs the
    # kept h; near miss "len_reset" h = m * new (reset to zero past the length, not kept)
    reads: str = "stack"
    declined: str = ""  # a near miss: what the decline names
    hidden: int = 0  # the bottom cell's hidden size (0: TORCH_H)
    # cells side by side: cell 2 reads x_t too (not h1), the step's output cat([h1, h2], -1); near miss
    # "coupled": cell 1 reads h1 + h2 as its state (its update mixes both states: no native cell)
    side: str = ""

    @property
    def n_findings(self) -> int:
        """One Loop per step stack (TorchScript), one chain per cell (trace, dynamo)."""
        return 1 if self.exporter == "torchscript" else len(self.cells)


TORCH_CASES = [
    TorchCase("script_lstm_lstm", "torchscript", ("lstm", "lstm")),
    TorchCase("script_lstm_gru_bf", "torchscript", ("lstm", "gru"), batch_first=True),
    TorchCase("script_gru_rnn", "torchscript", ("gru", "rnn")),
    TorchCase("trace_lstm_lstm", "trace", ("lstm", "lstm")),
    TorchCase("trace_gru_lstm_bf", "trace", ("gru", "lstm"), batch_first=True),
    TorchCase("dynamo_lstm_gru", "dynamo", ("lstm", "gru")),
    # one cell, its per-step h read by more than a stack on time
    TorchCase("trace_lstm_head", "trace", ("lstm",), reads="head"),
    TorchCase("dynamo_gru_head_bf", "dynamo", ("gru",), batch_first=True, reads="head"),
    TorchCase("trace_gru_cat", "trace", ("gru",), reads="cat"),
    TorchCase("trace_rnn_skip1_bf", "trace", ("rnn",), batch_first=True, reads="skip1"),
    TorchCase("dynamo_lstm_skip1", "dynamo", ("lstm",), reads="skip1"),
    TorchCase("trace_lstm_gru_head", "trace", ("lstm", "gru"), reads="head"),
    TorchCase("near_trace_lstm_hc", "trace", ("lstm",), reads="hc", declined="cell state of step"),
    # issue 14 item 4 for Loops: TorchScript, a head applied to h inside the loop body
    TorchCase("script_lstm_head", "torchscript", ("lstm",), reads="head"),
    TorchCase("script_gru_head_bf", "torchscript", ("gru",), batch_first=True, reads="head"),
    TorchCase("script_rnn_head_x", "torchscript", ("rnn",), reads="head_x"),
    TorchCase("script_lstm_lstm_head", "torchscript", ("lstm", "lstm"), reads="head"),
    TorchCase("script_lstm_head_prev", "torchscript", ("lstm",), reads="head_prev"),  # (Y one step later, h0 first)
    TorchCase("near_script_lstm_head_c", "torchscript", ("lstm",), reads="head_c", declined="at every step"),
    # issue 14 item 8 for Loops: a length mask written by hand in a TorchScript body, m = t < lengths
    TorchCase("script_lstm_len_zero", "torchscript", ("lstm",), reads="len_zero"),
    TorchCase("script_gru_len_carry_bf", "torchscript", ("gru",), batch_first=True, reads="len_carry"),
    TorchCase("script_rnn_len_zero", "torchscript", ("rnn",), reads="len_zero"),
    TorchCase("script_lstm_gru_len_zero", "torchscript", ("lstm", "gru"), reads="len_zero"),
    TorchCase("near_script_gru_len_reset", "torchscript", ("gru",), reads="len_reset", declined="reset to zero at masked steps"),
    # issue 14 item 9: hidden size 1 (a zero state's matmul leaves a scalar bias at the first step)
    TorchCase("trace_gru_hidden1", "trace", ("gru",), hidden=1),
    TorchCase("dynamo_lstm_hidden1", "dynamo", ("lstm",), hidden=1),
    TorchCase("trace_rnn_hidden1_bf", "trace", ("rnn",), batch_first=True, hidden=1),
    # cells side by side over one input (each its own chain of the same steps)
    TorchCase("trace_gru_lstm_side", "trace", ("gru", "lstm"), side="x"),
    TorchCase("dynamo_lstm_rnn_side_bf", "dynamo", ("lstm", "rnn"), batch_first=True, side="x"),
    TorchCase("trace_rnn_gru_side_head", "trace", ("rnn", "gru"), side="x", reads="head"),
    TorchCase("near_trace_rnn_rnn_coupled", "trace", ("rnn", "rnn"), side="coupled", declined="carried values"),
    # TorchScript: one Loop whose step runs both cells, ys.append(cat([h1, h2])) (a head over both cells' Y)
    TorchCase("script_lstm_gru_side", "torchscript", ("lstm", "gru"), side="x"),
    TorchCase("script_gru_rnn_side_head_bf", "torchscript", ("gru", "rnn"), batch_first=True, side="x", reads="head"),
]


def torch_module(c: TorchCase):
    """``for t: u = x[t]; for each cell: u = cell(u, state)``; returns (stacked top h, every cell's final h (, c))."""
    import torch
    from torch import nn

    k1, k2 = (c.cells + ("",))[:2]
    mk = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}
    h1n, h2n = c.hidden or TORCH_H[k1], TORCH_H.get(k2, 1)
    lstm1, lstm2, bf, reads, side = k1 == "lstm", k2 == "lstm", c.batch_first, c.reads, c.side

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell1 = mk[k1](FEATURES, h1n)
            self.cell2 = mk[k2](FEATURES if side else h1n, h2n) if k2 else None
            self.head = nn.Linear((h1n + h2n if side else h2n) if k2 else h1n, 3)

        def forward(self, x):
            b = x.size(0) if bf else x.size(1)
            steps = x.size(1) if bf else x.size(0)
            h1 = torch.zeros(b, h1n)
            c1 = torch.zeros(b, h1n)
            h2 = torch.zeros(b, h2n)
            c2 = torch.zeros(b, h2n)
            ys = []
            for t in range(steps):
                u = x[:, t] if bf else x[t]
                h1_in = h1 + h2 if side == "coupled" else h1
                if lstm1:
                    h1, c1 = self.cell1(u, (h1_in, c1))
                else:
                    h1 = self.cell1(u, h1_in)
                top, below = h1, u if side else h1  # (cell 2 beside cell 1 reads x_t)
                if self.cell2 is not None:
                    if lstm2:
                        h2, c2 = self.cell2(below, (h2, c2))
                    else:
                        h2 = self.cell2(below, h2)
                    top = torch.cat([h1, h2], -1) if side else h2
                if reads == "hc":
                    top = torch.cat([h1, c1], -1)
                ys.append(self.head(top) if reads == "head" else top)
            tdim = 1 if bf else 0
            if reads == "cat":
                out = torch.cat(ys, -1)
            elif reads == "skip1":
                out = torch.stack(ys[1:], tdim)
            else:
                out = torch.stack(ys, tdim)
            finals = (h1, c1) if lstm1 else (h1,)
            if self.cell2 is not None:
                finals += (h2, c2) if lstm2 else (h2,)
            return (out,) + finals

    if c.exporter != "torchscript":
        return Stack()
    # TorchScript compiles every branch: one class per pair of cell kinds, the branches fixed at definition
    return torch.jit.script(_script_stack(k1, k2, h1n, h2n, bf, reads, side))


HAND_CELLS = '''
import torch
from torch import nn


class GRUHand(nn.Module):
    """PyTorch's GRU formula from two Linears (nn.GRUCell does not export under TorchScript)."""

    def __init__(self, i: int, h: int):
        super().__init__()
        self.hidden_size = h
        self.ih, self.hh = nn.Linear(i, 3 * h), nn.Linear(h, 3 * h)

    def forward(self, x, h):
        ir, iz, in_ = self.ih(x).chunk(3, -1)
        hr, hz, hn = self.hh(h).chunk(3, -1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        return (1 - z) * torch.tanh(in_ + r * hn) + z * h


class RNNHand(nn.Module):
    def __init__(self, i: int, h: int):
        super().__init__()
        self.hidden_size = h
        self.ih, self.hh = nn.Linear(i, h), nn.Linear(h, h)

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.hh(h))
'''


def _script_stack(k1: str, k2: str, h1n: int, h2n: int, bf: bool, reads: str = "stack", side: str = ""):
    """A module whose forward is written out for the cell kinds (one or two; TorchScript compiles every branch)
    and the per-step reads (``reads``: see TorchCase)."""
    cls = {"lstm": "nn.LSTMCell", "gru": "GRUHand", "rnn": "RNNHand"}

    def step_src(k, kind, u):
        if not kind:
            return "pass"
        if kind == "lstm":
            return f"h{k}, c{k} = self.cell{k}({u}, (h{k}, c{k}))"
        return f"h{k} = self.cell{k}({u}, h{k})"

    top = ("torch.cat([h1, h2], -1)" if side else "h2") if k2 else "h1"
    tdim = 1 if bf else 0
    read_src = {
        "stack": f"ys.append({top})",
        "head": f"ys.append(self.head({top}))",
        "head_x": f"ys.append({top})\n            zs.append(torch.tanh(self.head({top}) + self.proj(u)))",
        "head_c": "ys.append(self.head(c1))",
        "head_prev": "pass",
    }.get(reads, "pass")
    prev_src = f"ys.append(self.head({top}))" if reads == "head_prev" else "pass"
    lengths = reads.startswith("len")
    if lengths:  # every cell's states kept where t >= lengths; the per-step output zero or the kept h there
        step_lines = [f"{v}{k}_old = {v}{k}" for k, kind in ((1, k1), (2, k2)) if kind
                      for v in (("h", "c") if kind == "lstm" else ("h",))]
        step_lines.append("m = (t < lengths).unsqueeze(1).to(x.dtype)")
        prev_src = "\n            ".join(step_lines)
        keep = "m * {v} + (1.0 - m) * {v}_old" if reads != "len_reset" else "m * {v}"
        read_src = "\n            ".join(
            [f"{v}{k} = " + keep.format(v=f"{v}{k}") for k, kind in ((1, k1), (2, k2)) if kind
             for v in (("h", "c") if kind == "lstm" else ("h",))]
            + [f"ys.append(m * {top})" if reads == "len_zero" else f"ys.append({top})"])
    ret = f"torch.stack(ys, {tdim})" + (f", torch.stack(zs, {tdim})" if reads == "head_x" else "")
    h_top = (h1n + h2n if side else h2n) if k2 else h1n
    finals = ", ".join((["h1", "c1"] if k1 == "lstm" else ["h1"]) + ((["h2", "c2"] if k2 == "lstm" else ["h2"]) if k2 else []))

    code = HAND_CELLS + f'''

class ScriptStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell1 = {cls[k1]}({FEATURES}, {h1n})
        self.cell2 = {cls[k2] + f"({FEATURES if side else h1n}, {h2n})" if k2 else "None"}
        self.head = nn.Linear({h_top}, 3)
        self.proj = nn.Linear({FEATURES}, 3)

    def forward(self, x{", lengths" if lengths else ""}):
        b = x.size({0 if bf else 1})
        h1 = torch.zeros(b, {h1n})
        c1 = torch.zeros(b, {h1n})
        h2 = torch.zeros(b, {h2n})
        c2 = torch.zeros(b, {h2n})
        ys: list[torch.Tensor] = []
        zs: list[torch.Tensor] = []
        for t in range(x.size({1 if bf else 0})):
            u = x{"[:, t]" if bf else "[t]"}
            {prev_src}
            {step_src(1, k1, "u")}
            {step_src(2, k2, "u" if side else "h1")}
            {read_src}
        return {ret}, {finals}
'''
    import importlib.util
    import tempfile

    # TorchScript reads a class's source from its file: write the module to one
    path = Path(tempfile.mkdtemp()) / f"script_stack_{k1}_{k2 or 'none'}_{reads}{'_side' if side else ''}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ScriptStack()


def generate_torch(c: TorchCase, out_dir: Path) -> dict:
    import onnx
    import torch

    seed = zlib.crc32(c.name.encode())
    torch.manual_seed(seed)
    module = torch_module(c).eval()
    rng = np.random.default_rng(seed)
    shape = lambda b, t: (b, t, FEATURES) if c.batch_first else (t, b, FEATURES)  # noqa: E731
    example = torch.from_numpy(rng.standard_normal(shape(2, TIME)).astype(np.float32))
    lengths = c.reads.startswith("len")
    args = (example, torch.tensor([TIME, 3])) if lengths else (example,)
    in_names = ["x", "lengths"] if lengths else ["x"]
    path = out_dir / f"{c.name}.onnx"
    with torch.no_grad():
        names = [f"out{k}" for k in range(len(module(*args)))]
    with torch.no_grad():
        if c.exporter == "dynamo":
            batch = torch.export.Dim("batch")
            torch.onnx.export(module, (example,), str(path), dynamo=True, external_data=False, verbose=False,
                              input_names=["x"], output_names=names,
                              dynamic_shapes=({0 if c.batch_first else 1: batch},))
        else:
            axes = {0 if c.batch_first else 1: "batch"}
            if c.exporter == "torchscript":
                axes[1 if c.batch_first else 0] = "time"
            dyn = {"x": axes, "lengths": {0: "batch"}} if lengths else {"x": axes}
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, input_names=in_names,
                              output_names=names, dynamic_axes=dyn)
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=False)
    sets = {"b1": (1, TIME), "b3": (3, TIME)}
    if c.exporter == "torchscript":
        sets["b2_t11"] = (2, 11)
    arrays = {}
    for s, (b, t) in sets.items():
        x = rng.standard_normal(shape(b, t)).astype(np.float32)
        feeds = [torch.from_numpy(x)]
        if lengths:  # a full row, an empty one, one past the end, the rest anywhere
            lens = np.array(([t, 0, t + 2] + list(rng.integers(0, t + 1, size=b)))[:b] if b > 1 else [t // 2], np.int64)
            feeds.append(torch.from_numpy(lens))
            arrays[f"in/{s}/lengths"] = lens
        with torch.no_grad():
            outs = module(*feeds)
        arrays[f"in/{s}/x"] = x
        arrays.update({f"out/{s}/{k}": o.numpy() for k, o in enumerate(outs)})
    np.savez(out_dir / f"{c.name}.npz", **arrays)
    ops = graph_ops(model.graph)
    want: dict[str, int] = {}
    for k in c.cells:
        op = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}[k]
        want[op] = want.get(op, 0) + 1
    meta = {
        "name": c.name,
        "exporter": c.exporter,
        "layers": f"{c.exporter}: two cells per step {c.cells}" + (", batch-first" if c.batch_first else ""),
        "expect": {"ops": want, "absent": ["Loop", "Scan", "SequenceInsert"]} if not c.declined else {
            "declined": c.declined},
        "sets": list(sets),
        "masked": False,
        "exported_ops": {op: ops.count(op) for op in ("LSTM", "GRU", "RNN", "Loop") if op in ops},
    }
    (out_dir / f"{c.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------- TensorFlow functions (tf.scan, tf.while_loop)

TF_SCAN_CASES = ["tfscan_lstm_last_c", "tfwhile_lstm_bf_strided", "tfwhile_rnn_strided", "tfwhile_gru_sequence_mask_where",
                 "tfwhile_gru_float_mask_blend", "tfwhile_lstm_lengths_greater_t", "autograph_for_range_gru",
                 "autograph_for_range_lstm_lengths", "dynamic_rnn_gru", "tfwhile_gru_reverse_read", "tfwhile_lstm_bidir_by_hand"]
MASKED_TF_FUNCTIONS = {"tfwhile_gru_sequence_mask_where", "tfwhile_gru_float_mask_blend", "tfwhile_lstm_lengths_greater_t",
                       "autograph_for_range_lstm_lengths"}


def _tf_functions(tf, rng):
    """name -> (description, the tf.function's body over x, whether x is batch-first)."""
    H = UNITS["LSTM"]
    W = tf.Variable((0.5 * rng.standard_normal((FEATURES, 4 * H))).astype(np.float32))
    R = tf.Variable((0.5 * rng.standard_normal((H, 4 * H))).astype(np.float32))
    b = tf.Variable((0.5 * rng.standard_normal(4 * H)).astype(np.float32))

    def lstm_step(x, h, c):
        i, f, g, o = tf.split(tf.matmul(x, W) + tf.matmul(h, R) + b, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        return tf.sigmoid(o) * tf.tanh(c), c

    def scan_last_c(x):  # time-major
        z = tf.zeros((tf.shape(x)[1], H))
        hs, cs = tf.scan(lambda carry, xt: lstm_step(xt, *carry), x, initializer=(z, z))
        return hs, cs[-1]

    def while_lstm_bf(x):  # batch-first: x[:, t] is a strided slice shrinking axis 1
        n = tf.shape(x)[1]
        z = tf.zeros((tf.shape(x)[0], H))
        ta = tf.TensorArray(tf.float32, size=n)

        def body(t, h, c, ta):
            h, c = lstm_step(x[:, t], h, c)
            return t + 1, h, c, ta.write(t, h)

        _, h, _, ta = tf.while_loop(lambda t, *_: t < n, body, [0, z, z, ta])
        return tf.transpose(ta.stack(), [1, 0, 2]), h

    def while_rnn(x):  # time-major: x[t] shrinks axis 0; an Elman cell from the LSTM's first rows
        n = tf.shape(x)[0]
        ta = tf.TensorArray(tf.float32, size=n)

        def body(t, h, ta):
            h = tf.tanh(tf.matmul(x[t], W[:, :H]) + tf.matmul(h, R[:, :H]) + b[:H])
            return t + 1, h, ta.write(t, h)

        _, _, ta = tf.while_loop(lambda t, *_: t < n, body, [0, tf.zeros((tf.shape(x)[1], H)), ta])
        return ta.stack()

    G = UNITS["GRU"]
    Wg = tf.Variable((0.5 * rng.standard_normal((FEATURES, 3 * G))).astype(np.float32))
    Rg = tf.Variable((0.5 * rng.standard_normal((G, 3 * G))).astype(np.float32))
    bg = tf.Variable((0.5 * rng.standard_normal(3 * G)).astype(np.float32))

    def gru_step(x, h):  # Keras' reset-after GRU: z * h + (1 - z) * n
        xz, xr, xn = tf.split(tf.matmul(x, Wg) + bg, 3, axis=1)
        hz, hr, hn = tf.split(tf.matmul(h, Rg), 3, axis=1)
        z, r = tf.sigmoid(xz + hz), tf.sigmoid(xr + hr)
        return z * h + (1 - z) * tf.tanh(xn + r * hn)

    def masked_while(kind):
        """tf.while_loop over batch-first x with per-row lengths: the bool mask built before the loop and read
        per step (``where``), the same mask cast to 0/1 floats and blended by hand, or ``lengths > t`` computed
        in the body (an LSTM); each loop carries the mask or the lengths through as a pass-through value."""

        def run(x, lengths):
            n = tf.shape(x)[1]
            mask = tf.sequence_mask(lengths, n)
            fmask = tf.cast(mask, tf.float32)
            z = tf.zeros((tf.shape(x)[0], H if kind == "lengths" else G))
            ta = tf.TensorArray(tf.float32, size=n)

            def body(t, h, c, ta):
                if kind == "lengths":
                    hn, cn = lstm_step(x[:, t], h, c)
                    m = tf.expand_dims(lengths > t, 1)
                    return t + 1, tf.where(m, hn, h), tf.where(m, cn, c), ta.write(t, tf.where(m, hn, 0.0))
                hn = gru_step(x[:, t], h)
                if kind == "where":
                    m = mask[:, t][:, None]
                    return t + 1, tf.where(m, hn, h), c, ta.write(t, tf.where(m, hn, tf.zeros_like(hn)))
                m = tf.expand_dims(fmask[:, t], 1)
                h = m * hn + (1.0 - m) * h
                return t + 1, h, c, ta.write(t, h)

            _, h, c, ta = tf.while_loop(lambda t, *_: t < n, body, [0, z, z, ta])
            return (tf.transpose(ta.stack(), [1, 0, 2]), h) + ((c,) if kind == "lengths" else ())

        return run

    def autograph(kind):
        """TF2's ``for t in tf.range(n)`` (autograph writes a while loop whose counter adds ``range/delta``, a
        constant tf2onnx carries through the Loop): a GRU's states into a TensorArray, or an LSTM's kept where
        ``t < lengths``. (Returning the last states alone, tf2onnx 1.17 writes a Loop that does not load.)"""

        def run(x, *lengths):
            n = tf.shape(x)[1]
            h = tf.zeros((tf.shape(x)[0], H if lengths else G))
            c = tf.zeros((tf.shape(x)[0], H))
            ta = tf.TensorArray(tf.float32, size=n)
            for t in tf.range(n):
                if lengths:
                    m = tf.expand_dims(t < lengths[0], 1)
                    hn, cn = lstm_step(x[:, t], h, c)
                    h, c = tf.where(m, hn, h), tf.where(m, cn, c)
                else:
                    h = gru_step(x[:, t], h)
                ta = ta.write(t, h)
            return (tf.transpose(ta.stack(), [1, 0, 2]), h) + ((c,) if lengths else ())

        return run

    def backward(x, step, z):
        """A while loop reading x[:, n - 1 - t] (tf2onnx: a strided slice starting at T - 1 - i), its states
        written in processing order."""
        n = tf.shape(x)[1]
        ta = tf.TensorArray(tf.float32, size=n)

        def body(t, h, c, ta):
            h, c = step(x[:, n - 1 - t], h, c)
            return t + 1, h, c, ta.write(t, h)

        _, h, _, ta = tf.while_loop(lambda t, *_: t < n, body, [0, z, z, ta])
        return tf.transpose(ta.stack(), [1, 0, 2]), h

    def gru_reverse_read(x):
        return backward(x, lambda xt, h, c: (gru_step(xt, h), c), tf.zeros((tf.shape(x)[0], G)))

    def lstm_bidir(x):  # the forward half as while_lstm_bf, the backward one flipped back into time order
        y_fw, h_fw = while_lstm_bf(x)
        y_bw, h_bw = backward(x, lstm_step, tf.zeros((tf.shape(x)[0], H)))
        return tf.concat([y_fw, tf.reverse(y_bw, [1])], -1), tf.concat([h_fw, h_bw], -1)

    def dynamic_rnn(x):  # TF1's dynamic_rnn over a tf_keras GRUCell: a while loop bounded by min(T, max(1, T))
        y, h = tf.compat.v1.nn.dynamic_rnn(tf1_cell, x, dtype=tf.float32)
        return y, h

    import tf_keras  # (a Keras 3 cell is no TF1 RNNCell)

    tf1_cell = tf_keras.layers.GRUCell(G)
    tf1_cell.build((None, FEATURES))
    for w in tf1_cell.weights:
        w.assign((0.5 * rng.standard_normal(tuple(w.shape))).astype(np.float32))

    return {
        "tfwhile_gru_reverse_read": ("tf.while_loop reading x[:, n - 1 - t], states in processing order; batch-first",
                                     gru_reverse_read, True),
        "tfwhile_lstm_bidir_by_hand": ("two tf.while_loops, x[:, t] and x[:, n - 1 - t] (flipped back), concatenated: "
                                       "one bidirectional op", lstm_bidir, True),
        "dynamic_rnn_gru": ("tf.compat.v1.nn.dynamic_rnn(tf_keras GRUCell) without sequence_length: T steps, bounded by "
                            "min(T, max(1, T)); batch-first", dynamic_rnn, True),
        "autograph_for_range_gru": ("for t in tf.range(n): h = gru(x[:, t], h); ta.write(t, h) (autograph); batch-first",
                                    autograph("gru"), True),
        "autograph_for_range_lstm_lengths": ("for t in tf.range(n): h, c kept where t < lengths; ta.write(t, h) "
                                             "(autograph)", autograph("lengths"), True),
        "tfwhile_gru_sequence_mask_where": ("tf.while_loop GRU, h = where(sequence_mask(lengths)[:, t], new, h); batch-first",
                                            masked_while("where"), True),
        "tfwhile_gru_float_mask_blend": ("tf.while_loop GRU, m = cast(sequence_mask(lengths))[:, t]: h = m * new + (1 - m) * h",
                                         masked_while("float"), True),
        "tfwhile_lstm_lengths_greater_t": ("tf.while_loop LSTM, m = lengths > t in the body, where(m, new, h) on h and c",
                                           masked_while("lengths"), True),
        "tfscan_lstm_last_c": ("tf.scan over a hand-written LSTM step, returns (hs, cs[-1])", scan_last_c, False),
        "tfwhile_lstm_bf_strided": ("tf.while_loop reading x[:, t] (a strided slice), TensorArray of h; batch-first",
                                    while_lstm_bf, True),
        "tfwhile_rnn_strided": ("tf.while_loop reading x[t] (a strided slice), TensorArray of h", while_rnn, False),
    }


def generate_tf_scan(name: str, out_dir: Path, tf, tf2onnx, onnx) -> dict:
    """A recurrence written as a TensorFlow function: ``tf.scan`` whose per-step c is read only at its last
    step (issue 14 item 9, the native op's Y_c), or ``tf.while_loop`` reading the step with a strided slice,
    which tf2onnx writes with its own index arithmetic (1e9 for "to the end", a shrunk axis as step 1e9)."""
    seed = zlib.crc32(name.encode())
    rng = np.random.default_rng(seed)
    layers, body, batch_first = _tf_functions(tf, rng)[name]
    masked = name in MASKED_TF_FUNCTIONS
    spec = [tf.TensorSpec((None, None, FEATURES), tf.float32, name="x")]
    spec += [tf.TensorSpec((None,), tf.int32, name="lengths")] if masked else []
    run = tf.function(body, input_signature=spec)
    model, _ = tf2onnx.convert.from_function(run, input_signature=spec, opset=17)
    onnx.checker.check_model(model)
    arrays = {}
    sets = {"b1": (1, TIME), "b4": (4, TIME), "b2_t11": (2, 11)}
    for s, (bsz, t) in sets.items():
        x = rng.standard_normal((bsz, t, FEATURES) if batch_first else (t, bsz, FEATURES)).astype(np.float32)
        feeds = {"x": x}
        if masked:  # (every length from none to all of them, batch 1 a short row)
            feeds["lengths"] = np.array([t - 2] if bsz == 1 else [t, 0, 3, t - 1][:bsz], dtype=np.int32)
        arrays.update({f"in/{s}/{k}": v for k, v in feeds.items()})
        out = run(*(tf.constant(v) for v in feeds.values()))
        arrays.update({f"out/{s}/{k}": np.asarray(v) for k, v in enumerate(out if isinstance(out, tuple) else [out])})
    onnx.save(model, str(out_dir / f"{name}.onnx"))
    np.savez(out_dir / f"{name}.npz", **arrays)
    ops = graph_ops(model.graph)
    op = next(o for o in ("GRU", "LSTM", "RNN") if o.lower() in name)
    meta = {"name": name, "backend": "tf.function", "layers": layers,
            "expect": {"ops": {op: 1}, "absent": ["Loop", "Scan"]}, "sets": list(sets), "masked": masked,
            "tf2onnx_ops": {o: ops.count(o) for o in ("LSTM", "RNN", "Loop", "Scan") if o in ops}}
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["keras3", "tf_keras", "torch"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", action="extend", metavar="SUBSTR")
    args = parser.parse_args(argv)
    table = TORCH_CASES if args.backend == "torch" else CASES
    cases = [c for c in table if not args.only or any(s in c.name for s in args.only)]
    if args.backend != "torch":
        keras, tf, tf2onnx, onnx = import_backend(args.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    done, skipped = 0, []
    for c in cases:
        start = time.perf_counter()
        try:
            if args.backend == "torch":
                meta = generate_torch(c, args.out)
            else:
                meta = generate(c, args.backend, args.out, keras, tf, tf2onnx, onnx)
        except Exception as exc:  # one broken case must not stop the others
            skipped.append(c.name)
            print(f"WARNING: skipped {c.name} ({args.backend}): {type(exc).__name__}: {exc}".splitlines()[0],
                  file=sys.stderr, flush=True)
            continue
        done += 1
        print(f"{c.name}: {time.perf_counter() - start:.1f}s exported {meta.get('tf2onnx_ops', meta.get('exported_ops'))}")
    if args.backend == "keras3":
        for name in TF_SCAN_CASES:
            if not args.only or any(sub in name for sub in args.only):
                meta = generate_tf_scan(name, args.out, tf, tf2onnx, onnx)
                done += 1
                print(f"{name}: exported {meta['tf2onnx_ops']}")
    print(f"{args.backend}: {done} cases written to {args.out}, {len(skipped)} skipped {skipped or ''}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
