"""How the optimizer's cost grows with the graph: 25k / 50k / 100k / 200k nodes, through the command line.

    python benchmarks/scaling.py [--sizes 25000,50000,100000,200000]
                                 [--graphs lstmcell,declared,elementwise,steps,masked,loops,side,bidir,stacked,views,blocks,attention,stepcalls,backreads,loophead,loopstack,callhead,chunkhead,grucell,rnncell,grustack,grubi,annotated,wide,heavy,heavy_ext,lengths,maskloops,flips,loopouts,sideinputs]
                                 [--runs 3]
                                 [--trees old=DIR,new=DIR] [--out benchmarks/results]
    python benchmarks/scaling.py --generate elementwise --nodes 100000 OUT.onnx    # just write one graph

The graphs, the ends of what a long unrolled model can be (those built op by op: ``benchmarks/graphs.py``):

* ``lstmcell``: a torch loop over ``nn.LSTMCell`` (input 32, hidden 64, batch 4) exported by
  ``torch.onnx.export(dynamo=False)`` (the chain of ``chain_2000.py``): 18 nodes per step, so T = nodes / 18
  (T=6000 is 108k nodes). rnnfuse fuses it into one LSTM (validated numerically, as always). Longer chains
  are a 4-step export stretched to T steps (``stretch_chain``; the export itself takes hours there).
* ``declared``: the same chain with every value's type declared (``value_info``), as torch's dynamo, jax2onnx
  and models saved after onnx's shape inference write them (126,000 declarations at 108k nodes).
* ``elementwise``: a chain of Add / Mul / Tanh / Sigmoid on a [batch, 16] tensor, each Add and Mul with a
  weight vector of its own: a big model with nothing to fuse (and nothing to merge).
* ``wide``: the same LSTMCell loop with input and hidden size 512 (8 MB of weights) and few steps: the
  weight-heavy end, where memory is mostly tensor data.
* ``steps``: per step ``tanh(x[t] @ W)`` with no state, all steps summed: time slices and matmuls that are
  no recurrence, so the chain front end searches the whole graph and fuses nothing.
* ``masked``: a loop over a tanh cell with a ``[T, B]`` bool mask (``h = where(mask[t], cell(x[t], h), h)``),
  unrolled as torch's tracer writes it (11 nodes a step): fused into one masked RNN, validated per step.
* ``loops``: Loops in a row, each with a two-node body (4 nodes a Loop, bodies counted): thousands of
  subgraphs, nothing to fuse.
* ``side``: tanh cells side by side over one input, 16 steps each (6 nodes a cell a step, ~1,000 cells at
  100k nodes): every step of the chain over x reads every cell's state; one RNN per cell, validated per step.
* ``bidir`` / ``stacked``: two tanh cells a step as torch's tracer writes a loop calling ``nn.RNNCell`` twice
  (Gemm cells, no types declared inside the graph): a forward and a backward cell over x (one bidirectional RNN
  once fused), or an upper cell reading the lower one's new h at each step (two RNNs); ~14 nodes a step.
* ``views``: a torch loop over a hand-written LSTM cell viewing its gates per gate (``gates.view(x.size(1), 4,
  H).unbind(1)``), torch's trace export with a dynamic batch (32 nodes a step, each reading the batch from x's
  shape; T = nodes / 32, exported at every size: ~2 minutes at 100k nodes): one LSTM once fused.
* ``blocks``: torch's ``stack([relu(x_t @ W) for x_t in x.unbind(1)], 1)`` block after block over a [B, 16, 4]
  tensor (66 nodes a block): 1,500 step-sliced families at 100k nodes, none holding a chain.
* ``attention``: self-attention block after block, q, k and v the ``unbind(0)`` of one 4-d tensor of a runtime
  shape (11 nodes a block): ~9,000 families whose "steps" combine, none a sequence a native op reads.
* ``stepcalls``: torch's trace of a 2-layer ``nn.LSTM`` called once per step, the state carried by hand (~30
  nodes a step): one LSTM per layer once the per-call ops are merged.
* ``backreads``: torch's trace of a hand-written bidirectional relu RNN, a forward loop then a backward one,
  ``stack(cat([hf[t], hb[t]], 1))`` (14 nodes a step): one bidirectional RNN, every step's cat read from it once.
* ``loophead``: a Loop over x whose body holds a tanh cell and a per-step head of elementwise ops on its new h
  (the head is the graph's size, bodies counted): one RNN once fused, the head applied once to every step.
  The validation and the do-no-harm guard each load a model holding the head in onnxruntime, whose load grows
  faster than the nodes.
* ``loopstack``: Loops stacked on one another, each a tanh cell over the stacked outputs of the Loop below, all
  reading one trip count (9 nodes a Loop, bodies counted): one RNN per Loop, all validated in one check model.
* ``callhead``: torch's trace of ``nn.LSTM`` called once per step with a head per call, ``tanh(Linear(y[0]))``
  stacked on time (16 nodes a step; exported at every size: ~6 minutes at 96k nodes): one LSTM and the head
  applied once.
* ``chunkhead``: torch's trace of a hand-written LSTM cell whose gates are ``(x[t] @ Wi + h @ Wh).chunk(4, 1)``
  (each step's slice bounds computed from its own ``Shape``) with a ``Linear`` head per step, stacked (37 nodes
  a step): one LSTM and the head applied once.
* ``grucell`` / ``rnncell`` / ``grustack`` / ``grubi``: torch's trace of loops over ``nn.GRUCell`` / ``nn.RNNCell``
  on a batch-first ``x[:, t]`` (20 / 8 nodes a step), two GRUCells a step (36), a forward and a backward GRUCell
  loop concatenated (39): one GRU / RNN, two GRUs, one bidirectional GRU.
* ``annotated``: ``head`` (the shipped Keras example and a 100,000-node head after it, ``benchmarks/graphs.py``)
  with ~400 bytes of metadata on every node, as torch's dynamo exporter writes them: a small fusion in a big
  model whose bytes are mostly metadata.
* ``transformer`` / ``celltransformer``: torch's trace of a dynamic-shape transformer (every block assembling
  its Reshapes' targets from a Shape's scalars) after ``nn.LSTM`` (nothing to fuse) or after a loop over
  ``nn.LSTMCell`` holding ~40% of the nodes (one LSTM): ``transformer_graphs.py``.
* ``lengths``, ``maskloops``, ``flips``, ``loopouts``, ``sideinputs``: graphs whose cost once grew faster than
  they do (masks from lengths, masked Loops on one trip count, double time reversals, Loops whose final
  states are graph outputs, cells side by side on inputs of their own): ``growth_graphs.py``.
* ``heavy`` / ``heavy_ext``: the LSTMCell loop at input = hidden = 1536 and 2560 for 20 steps (75 and 210 MB, all
  but 0.1 MB of it weights), one file / tensors in external data; ``--heavy-sizes`` gives the hidden sizes.

Each graph is timed with the real command line (``python -m rnnfuse optimize IN OUT --json J``, wall clock
including start-up, load, passes and save) ``--runs`` times; the table gives medians of the wall time, of the
CPU time, of each pass's time (from the JSON report) and of the process' peak resident set
(``RUSAGE_CHILDREN``), next to the peak of a process that only imports what the CLI imports (the libraries'
share) and the model file's size. ``--trees`` runs several checkouts of rnnfuse side by side (each run of
each size alternates between them, so they see the same load). Writes ``results/NAME.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
NODES_PER_STEP = 18  # torch's LSTMCell trace export
VIEW_NODES_PER_STEP = 32  # torch's trace export of a hand-written LSTM cell with gates.view(B, 4, H)

from chain_2000 import (CALL_HEAD_NODES_PER_STEP, CELL_LOOP_NODES_PER_STEP, CHUNK_HEAD_NODES_PER_STEP,  # noqa: E402
                        export_calls_with_head, export_cell_loops, export_chunk_cell_with_head, export_lstmcell_chain,
                        export_view_chain)
from scoped_graphs import function_calls, ifs_in_a_row, scans_in_a_row, shape_arithmetic  # noqa: E402
from transformer_graphs import transformer_after_cell_loop, transformer_after_lstm  # noqa: E402
from growth_graphs import GROWTH_GENERATORS  # noqa: E402
from graphs import (attention_blocks, backward_loop_read_stacked, cells_side_by_side, elementwise_chain, layer_called_per_step,  # noqa: E402
                    loop_with_head, loops_in_a_row, stacked_loops, masked_rnn_chain, prologue_then_recurrence, recurrence_then_head,
                    steps_summed, two_cells_per_step, unbind_stack_blocks)


MAX_EXPORTED_STEPS = 6000  # torch's trace export of a longer loop takes over an hour here: those are stretched


def lstmcell_chain(path: str, nodes: int) -> int:
    """A torch loop over nn.LSTMCell (input 32, hidden 64) with ``nodes // 18`` steps; returns the node count.
    Up to ``MAX_EXPORTED_STEPS`` steps it is torch's own export; beyond, a 4-step export stretched (see
    :func:`stretch_chain`)."""
    steps = max(2, nodes // NODES_PER_STEP)
    if steps <= MAX_EXPORTED_STEPS:
        return export_lstmcell_chain(path, steps)
    small = path + ".4steps.onnx"
    export_lstmcell_chain(small, 4)
    try:
        return stretch_chain(small, path, steps)
    finally:
        os.remove(small)


def stretch_chain(src: str, path: str, steps: int) -> int:
    """Write ``src`` (torch's trace export of a 4-step LSTMCell loop) with ``steps`` steps: steps 4.. are
    copies of step 3's 18 nodes (same ops, attributes and order: Constant t, Gather x[t], the cell, the
    Unsqueeze of h for the output stack), each reading the step before it, their names numbered as torch
    numbers them ('/cell_3/...' -> '/cell_t/...', other names suffixed '_s<t>'); the stack and the declared
    time dimensions grow to match. What rnnfuse sees is the export's form at any length."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    m = onnx.load(src)
    g = m.graph
    nodes = list(g.node)
    h_of = {t: f"/cell{'' if t == 0 else f'_{t}'}/Mul_2_output_0" for t in range(4)}
    c_of = {t: f"/cell{'' if t == 0 else f'_{t}'}/Add_1_output_0" for t in range(4)}
    # step 3: its Constant index and Gather, its '/cell_3/' nodes, and the Unsqueeze of its h with its axes
    unsq = next(n for n in nodes if n.op_type == "Unsqueeze" and n.input[0] == h_of[3])
    gather = next(n for n in nodes if n.op_type == "Gather" and n.output[0] in
                  {i for c in nodes if c.name.startswith("/cell_3/") for i in c.input})
    index = next(n for n in nodes if n.output[0] == gather.input[1])
    axes = next(n for n in nodes if n.output[0] == unsq.input[1])
    step = [index, gather] + [n for n in nodes if n.name.startswith("/cell_3/")]
    tail = [axes, unsq]
    concat = nodes[-1]
    assert concat.op_type == "Concat" and len(step) == 16, "not the trace export's form"

    def renamed(name: str, t: int) -> str:
        if name.startswith("/cell_3/"):
            return f"/cell_{t}/" + name[len("/cell_3/"):]
        return f"{name}_s{t}"

    first_stack = min(nodes.index(n) for n in nodes if n.op_type == "Unsqueeze")
    first_stack -= nodes[first_stack - 1].op_type == "Constant"  # (its axes)
    cells, stacked = nodes[:first_stack], nodes[first_stack: nodes.index(concat)]
    outs = list(concat.input)
    for t in range(4, steps):
        local = {o for n in step + tail for o in n.output}
        prev_h = h_of[3] if t == 4 else f"/cell_{t - 1}/Mul_2_output_0"
        prev_c = c_of[3] if t == 4 else f"/cell_{t - 1}/Add_1_output_0"
        for n in step + tail:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = renamed(n.name, t)
            c.output[:] = [renamed(o, t) for o in n.output]
            c.input[:] = [prev_h if i == h_of[2] else prev_c if i == c_of[2] else
                          renamed(i, t) if i in local else i for i in n.input]
            if n is index:
                v = numpy_helper.to_array(n.attribute[0].t)
                c.attribute[0].t.CopyFrom(numpy_helper.from_array(np.full_like(v, t), n.attribute[0].t.name))
            (cells if n in step else stacked).append(c)
        outs.append(renamed(unsq.output[0], t))
    # the copies' Unsqueezes go after the cells, as torch writes the stack's inputs after the loop
    del g.node[:]
    g.node.extend(cells + stacked)
    c = onnx.NodeProto()
    c.CopyFrom(concat)
    c.input[:] = outs
    g.node.append(c)
    for vi in list(g.input) + list(g.output):
        vi.type.tensor_type.shape.dim[0].dim_value = steps
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    return len(g.node)


def declared_chain(path: str, nodes: int) -> int:
    """:func:`lstmcell_chain` with every value's type declared (``value_info``), as torch's dynamo, jax2onnx or a
    model saved after onnx's shape inference write them: 126,000 declarations at 108k nodes, five types."""
    import onnx

    count = lstmcell_chain(path, nodes)
    onnx.save(onnx.shape_inference.infer_shapes(onnx.load(path)), path)
    return count


# what torch's dynamo exporter writes on every node (bytes each): ~400 bytes a node
_DYNAMO_METADATA = (("namespace", 72), ("pkg.torch.onnx.class_hierarchy", 66), ("pkg.torch.onnx.fx_node", 113),
                    ("pkg.torch.onnx.name_scopes", 22), ("pkg.torch.onnx.stack_trace", 155))


def annotated_head(path: str, nodes: int) -> int:
    """:func:`recurrence_then_head` with ~400 bytes of metadata on every node, as torch's dynamo exporter
    writes them (its namespace, module path, FX node and stack trace): a big model with a small fusion whose
    nodes are mostly metadata (58 MB at 100k nodes)."""
    import onnx

    count = recurrence_then_head(path, nodes)
    m = onnx.load(path)
    for i, n in enumerate(m.graph.node):
        for key, size in _DYNAMO_METADATA:
            p = n.metadata_props.add()
            p.key, p.value = key, (f"{key}:{i}:" * (size // len(key) + 1))[:size]
    onnx.save(m, path)
    return count


def wide_chain(path: str, nodes: int) -> int:
    """The LSTMCell loop with input and hidden size 512 (8 MB of weights), ``nodes // 18`` steps. (At 1024 the
    first step's Gemm of the zero state with a 4M-element weight is not folded, and the chain is declined.)"""
    return export_lstmcell_chain(path, max(2, nodes // NODES_PER_STEP), input_size=512, hidden=512)


HEAVY_STEPS = 20


def heavy_chain(path: str, hidden: int) -> int:
    """The LSTMCell loop at input = hidden = ``hidden`` for 20 steps, one file: weights are nearly all of it
    (1536: 75 MB, 2560: 210 MB). The size argument is the hidden size, not a node count (363 nodes)."""
    return export_lstmcell_chain(path, HEAVY_STEPS, input_size=hidden, hidden=hidden)


def heavy_external_chain(path: str, hidden: int) -> int:
    """:func:`heavy_chain` stored with its tensors in ``PATH.data`` (external data)."""
    import onnx

    nodes = heavy_chain(path + ".whole", hidden)
    m = onnx.load(path + ".whole")
    os.remove(path + ".whole")
    onnx.save(m, path, save_as_external_data=True, location=os.path.basename(path) + ".data", size_threshold=1024)
    return nodes


def model_bytes(path: str) -> int:
    """A model's size on disk: the file and the external data files it names."""
    import onnx

    from rnnfuse.protos import all_tensors

    total = os.path.getsize(path)
    names = {e.value for t in all_tensors(onnx.load(path, load_external_data=False)) for e in t.external_data
             if e.key == "location"}
    return total + sum(os.path.getsize(os.path.join(os.path.dirname(path), n)) for n in names)


GENERATORS = {"lstmcell": lstmcell_chain, "declared": declared_chain, "elementwise": elementwise_chain, "wide": wide_chain,
              "heavy": heavy_chain, "heavy_ext": heavy_external_chain, "steps": steps_summed,
              "masked": masked_rnn_chain, "loops": loops_in_a_row,
              "side": cells_side_by_side,
              "bidir": lambda path, nodes: two_cells_per_step(path, nodes, "bidir"),
              "stacked": lambda path, nodes: two_cells_per_step(path, nodes, "stacked"),
              "views": lambda path, nodes: export_view_chain(path, max(2, nodes // VIEW_NODES_PER_STEP)),
              "head": recurrence_then_head, "annotated": annotated_head, "prologue": prologue_then_recurrence,
              "blocks": unbind_stack_blocks, "attention": attention_blocks, "stepcalls": layer_called_per_step,
              "backreads": backward_loop_read_stacked, "loophead": loop_with_head, "loopstack": stacked_loops,
              "callhead": lambda path, nodes: export_calls_with_head(path, max(2, nodes // CALL_HEAD_NODES_PER_STEP)),
              "chunkhead": lambda path, nodes: export_chunk_cell_with_head(path, max(2, nodes // CHUNK_HEAD_NODES_PER_STEP)),
              "ifs": ifs_in_a_row, "constifs": lambda path, nodes: ifs_in_a_row(path, nodes, constant=True),
              "scans": scans_in_a_row, "calls": function_calls, "shapes": shape_arithmetic,
              "transformer": transformer_after_lstm, "celltransformer": transformer_after_cell_loop,
              **GROWTH_GENERATORS,
              **{kind: (lambda path, nodes, kind=kind, n=n: export_cell_loops(path, max(2, nodes // n), kind))
                 for kind, n in CELL_LOOP_NODES_PER_STEP.items()}}

PEAK = ("import json, resource, subprocess, sys, time; t0 = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); t = time.perf_counter() - t0; "
        "ru = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(json.dumps([t, ru.ru_maxrss / 1024, p.returncode, p.stderr[-600:], ru.ru_utime + ru.ru_stime]))")


def _child(cmd: list[str], tree: str | None = None) -> tuple[float, float, int, str, float]:
    """(wall seconds, peak RSS MB, exit code, stderr tail, CPU seconds) of ``cmd`` run under a fresh wrapper,
    with the rnnfuse checkout ``tree`` first on the path."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # (run from a neutral directory: ``python -m`` puts the working directory ahead of PYTHONPATH)
    out = subprocess.run([sys.executable, "-c", PEAK, *cmd], capture_output=True, text=True, check=True, env=env,
                         cwd=tempfile.gettempdir())
    return tuple(json.loads(out.stdout))


def _run_once(src: str, tree: str | None, acc: dict) -> None:
    """One ``rnnfuse optimize`` of ``src`` with the checkout ``tree``; its figures appended to ``acc``."""
    d = tempfile.mkdtemp(prefix="rnnfuse-scaling-")
    dst, rep = os.path.join(d, "out.onnx"), os.path.join(d, "report.json")
    try:
        wall, peak, rc, err, cpu = _child([sys.executable, "-m", "rnnfuse", "optimize", src, dst, "-q", "--json", rep], tree)
        if rc:
            raise RuntimeError(f"rnnfuse optimize {src} exited {rc}: {err}")
        acc.setdefault("walls", []).append(wall)
        acc.setdefault("cpus", []).append(cpu)
        acc.setdefault("peaks", []).append(peak)
        with open(rep) as f:
            report = json.load(f)
        per_pass = acc.setdefault("per_pass", {})
        # the command's phases around the passes, in brackets (the report's "phases": the load, the do-no-harm
        # guard, the write; older checkouts report none), the load before the passes and the rest after them
        phases = report.get("phases", {})
        if "load" in phases:
            per_pass.setdefault("[load]", []).append(phases["load"])
        seen: dict = {}
        for p in report["passes"]:  # a pass that runs twice is listed twice: dedupe, dedupe#2
            k = seen[p["name"]] = seen.get(p["name"], 0) + 1
            per_pass.setdefault(p["name"] + (f"#{k}" if k > 1 else ""), []).append(p["seconds"])
        for name, secs in phases.items():
            if name != "load":
                per_pass.setdefault(f"[{name}]", []).append(secs)
        per_pass.setdefault("(all passes)", []).append(report["seconds"])
        acc["nodes_after"] = report["nodes_after"]  # (bodies counted)
        acc["fused"] = sum(1 for p in report["passes"] for f in p["findings"] if f["status"] == "fused")
    finally:
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        os.rmdir(d)


def _count_nodes(path: str) -> int:
    """The nodes of the model at ``path``, those of its subgraphs (Loop, Scan and If bodies) and what its calls
    of local functions expand to counted."""
    import onnx

    from rnnfuse.protos import call_sizes, nodes_within

    m = onnx.load(path, load_external_data=False)
    return nodes_within(m.graph, calls=call_sizes(m))


def measure(src: str, runs: int, trees: dict[str, str | None]) -> dict[str, dict]:
    """Per tree: medians of ``runs`` runs; the trees take turns, run by run, so they share the load."""
    accs: dict[str, dict] = {name: {} for name in trees}
    for _ in range(runs):
        for name, tree in trees.items():
            _run_once(src, tree, accs[name])
    out = {}
    for name, a in accs.items():
        out[name] = {
            "wall": statistics.median(a["walls"]), "walls": a["walls"], "cpu": statistics.median(a["cpus"]),
            "peak_mb": statistics.median(a["peaks"]),
            "passes": {k: statistics.median(v) for k, v in a["per_pass"].items()},
            "nodes_after": a["nodes_after"], "fused": a["fused"], "file_mb": model_bytes(src) / 2**20,
        }
    return out


def compile_tree(tree: str) -> None:
    """Write the checkout's bytecode before timing it, as ``pip install`` does: where the environment sets
    PYTHONDONTWRITEBYTECODE (this one does) every run would otherwise compile rnnfuse's modules again, about
    0.2-0.3 s of CPU per run that no installed copy pays."""
    dirs = [os.path.join(tree, d) for d in ("rnnfuse", "passes") if os.path.isdir(os.path.join(tree, d))]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True, capture_output=True)


def baseline_mb(tree: str | None = None) -> float:
    return _child([sys.executable, "-c", "import numpy, onnx, onnxruntime, rnnfuse.cli, rnnfuse.pipeline, "
                   "rnnfuse.validate, rnnfuse.passes"], tree)[1]


FLOOR = "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])"
# the same round trip through onnx-ir, the in-memory IR onnxscript's rewriter and optimizer work on (measured
# only where it is installed: it is no dependency of rnnfuse)
FLOOR_IR = "import onnx_ir, sys; onnx_ir.save(onnx_ir.load(sys.argv[1]), sys.argv[2])"


def _round_trip(code: str, src: str, runs: int, what: str) -> tuple[float, float]:
    """Median wall seconds and peak RSS MB of ``code`` loading ``src`` and saving it, in fresh processes."""
    d = tempfile.mkdtemp(prefix="rnnfuse-floor-")
    try:
        walls, peaks = [], []
        for _ in range(runs):
            wall, peak, rc, err, _cpu = _child([sys.executable, "-c", code, src, os.path.join(d, "out.onnx")])
            if rc:
                raise RuntimeError(f"{what} of {src} exited {rc}: {err}")
            walls.append(wall)
            peaks.append(peak)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return statistics.median(walls), statistics.median(peaks)


# what validating any rewrite of the model costs at least: onnxruntime opening a session of it (one thread), as
# the light check sessions are opened (no graph optimizations), and as deployed (its default optimizations).
# Every rewritten node runs in some check session, so a model whose own session takes seconds to open cannot be
# optimized with validation on in less (`--no-validate` skips it)
ORT_LOAD = """import sys, time, onnxruntime as ort
so = ort.SessionOptions(); so.intra_op_num_threads = so.inter_op_num_threads = 1
if sys.argv[3] == "light":
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
t = time.perf_counter(); ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
print(time.perf_counter() - t)"""


def _ort_load(src: str, runs: int, how: str) -> float:
    """Median seconds onnxruntime takes to open a session of ``src`` (``how``: "light" or "default"), timed
    inside fresh processes (imports excluded)."""
    times = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", ORT_LOAD, src, "-", how], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"onnxruntime's load of {src} exited {r.returncode}: {r.stderr.strip()[-300:]}")
        times.append(float(r.stdout.split()[-1]))
    return statistics.median(times)


def floor(src: str, runs: int) -> dict:
    """The floor the issue names: ``onnx.load`` + ``onnx.save`` of the model in a fresh process (medians of
    ``runs``): wall seconds, peak RSS, and the peak of a process that only imports onnx; and, where onnx-ir is
    installed, the same for its ``load`` + ``save`` (``ir_wall``, ``ir_peak_mb``, ``ir_base_mb``). Besides,
    validation's floor: onnxruntime opening a session of the model, light and as deployed (``ort_light``,
    ``ort_default``, see ``ORT_LOAD``)."""
    wall, peak = _round_trip(FLOOR, src, runs, "onnx.load + onnx.save")
    out = {"wall": wall, "peak_mb": peak, "base_mb": _child([sys.executable, "-c", "import onnx"])[1]}
    out["ort_light"], out["ort_default"] = _ort_load(src, runs, "light"), _ort_load(src, runs, "default")
    if importlib.util.find_spec("onnx_ir") is not None:
        out["ir_wall"], out["ir_peak_mb"] = _round_trip(FLOOR_IR, src, runs, "onnx_ir.load + onnx_ir.save")
        out["ir_base_mb"] = _child([sys.executable, "-c", "import onnx_ir"])[1]
    return out


def floor_table(results: list[dict], bases: dict[str, float]) -> str:
    """Peak memory of each graph's run beside what loading and saving it alone costs (with onnx, and with
    onnx-ir where it was measured)."""
    trees = list(bases)
    with_ir = any("ir_wall" in (r.get("floor") or {}) for r in results)
    lines = ["| graph | nodes | file MB | load+save s | load+save RSS - onnx MB | x file | "
             + ("onnx-ir load+save s | onnx-ir RSS - onnx_ir MB | x file | " if with_ir else "")
             + "onnxruntime session s (light / default) | "
             + " | ".join(f"rnnfuse{f' ({t})' if len(trees) > 1 else ''} wall s, x light session" for t in trees) + " | "
             + " | ".join(f"rnnfuse{f' ({t})' if len(trees) > 1 else ''} RSS - libs MB, x floor" for t in trees) + " |",
             "|---" * (7 + 3 * with_ir + 2 * len(trees)) + "|"]
    for r in results:
        fl = r.get("floor")
        if not fl:
            continue
        file_mb = next(iter(r["m"].values()))["file_mb"]
        extra = fl["peak_mb"] - fl["base_mb"]
        cells = []
        for t in trees:
            mine = r["m"][t]["peak_mb"] - bases[t]
            cells.append(f"{mine:.0f}, {mine / extra:.1f}x")
        ir = ""
        if with_ir:
            ir_extra = fl["ir_peak_mb"] - fl["ir_base_mb"] if "ir_wall" in fl else None
            ir = (f"{fl['ir_wall']:.2f} | {ir_extra:.0f} | {ir_extra / file_mb:.1f} | " if ir_extra is not None
                  else "- | - | - | ")
        ort_cells = " | ".join(f"{r['m'][t]['wall']:.2f}, {r['m'][t]['wall'] / fl['ort_light']:.1f}x" for t in trees)
        lines.append(f"| {r['graph']} | {r['nodes']:,} | {file_mb:.1f} | {fl['wall']:.2f} | {extra:.0f} | "
                     f"{extra / file_mb:.1f} | " + ir + f"{fl['ort_light']:.2f} / {fl['ort_default']:.2f} | "
                     + ort_cells + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[dict], bases: dict[str, float]) -> str:
    """The summary table (one row per graph, size and tree) and the per-pass split."""
    trees = list(bases)
    tree_col = len(trees) > 1
    names: list[str] = []
    for r in results:
        for m in r["m"].values():
            for k in m["passes"]:
                if k not in names and k != "(all passes)":
                    names.append(k)
    # (the load first, the other phases last, whichever graph or tree's report named them first)
    names = [k for k in names if k == "[load]"] + [k for k in names if not k.startswith("[")] + \
        [k for k in names if k.startswith("[") and k != "[load]"]
    head = ("| graph | nodes |" + (" code |" if tree_col else "") + " file MB | wall s | CPU s | passes s (wall) | "
            "outside passes s | peak RSS MB | RSS - libs MB | x file | nodes after |")
    lines = [head, "|---" * (11 + tree_col) + "|"]
    for r in results:
        for tree in trees:
            m = r["m"][tree]
            passes = m["passes"]["(all passes)"]
            extra = m["peak_mb"] - bases[tree]
            lines.append(f"| {r['graph']} | {r['nodes']:,} |" + (f" {tree} |" if tree_col else "") +
                         f" {m['file_mb']:.1f} | **{m['wall']:.2f}** | {m['cpu']:.2f} | {passes:.2f} | "
                         f"{m['wall'] - passes:.2f} | {m['peak_mb']:.0f} | {extra:.0f} | {extra / m['file_mb']:.1f} | "
                         f"{m['nodes_after']:,} |")
    lines.append("")
    lines.append("Per pass, and in brackets the command's phases around the passes where its report gives them "
                 "(median seconds, wall; '-': not reported):")
    lines.append("")
    lines.append("| graph | nodes |" + (" code |" if tree_col else "") + " " + " | ".join(names) + " |")
    lines.append("|---|---|" + ("---|" if tree_col else "") + "---|" * len(names))
    for r in results:
        for tree in trees:
            p = r["m"][tree]["passes"]
            lines.append(f"| {r['graph']} | {r['nodes']:,} |" + (f" {tree} |" if tree_col else "") + " " +
                         " | ".join(f"{p[k]:.3f}" if k in p else ("-" if k.startswith("[") else "0.000")
                                    for k in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25000,50000,100000,200000", help="elementwise node counts")
    ap.add_argument("--lstm-sizes", default="27000,54000,108000,216000",
                    help="lstmcell node counts (T = nodes // 18: 108000 is T=6000)")
    ap.add_argument("--wide-sizes", default="1800", help="wide node counts (T = nodes // 18)")
    ap.add_argument("--heavy-sizes", default="1536,2560", help="heavy / heavy_ext hidden sizes (20 steps)")
    ap.add_argument("--name", default="scaling", help="results file name (results/NAME.md, .json)")
    ap.add_argument("--graphs", default="lstmcell,elementwise")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--floor", action="store_true", help="also time onnx.load + onnx.save of each graph (the floor)")
    ap.add_argument("--trees", default="", help="NAME=DIR,...: rnnfuse checkouts to run side by side "
                    "(default: the one this script imports)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"))
    ap.add_argument("--generate", choices=sorted(GENERATORS), help="only write one graph to PATH")
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("path", nargs="?")
    a = ap.parse_args(argv)
    if a.generate:
        print(GENERATORS[a.generate](a.path, a.nodes))
        return 0
    trees: dict[str, str | None] = {"rnnfuse": None}
    if a.trees:
        trees = dict(t.split("=", 1) for t in a.trees.split(","))
        trees = {k: os.path.abspath(v) for k, v in trees.items()}
    os.makedirs(a.cache, exist_ok=True)
    for tree in trees.values():  # compiled once, as an installed package is (see compile_tree)
        compile_tree(tree or os.path.dirname(HERE))
    load_start = os.getloadavg()
    results = []
    for graph in a.graphs.split(","):
        sizes = {"lstmcell": a.lstm_sizes, "declared": a.lstm_sizes, "wide": a.wide_sizes, "heavy": a.heavy_sizes,
                 "heavy_ext": a.heavy_sizes}.get(graph, a.sizes)
        for size in (int(s) for s in sizes.split(",") if s):
            src = os.path.join(a.cache, f"scaling_{graph}_{size}.onnx")
            if not os.path.exists(src):
                if graph == "heavy_ext":  # (its data file is named after the model file)
                    GENERATORS[graph](src, size)
                else:
                    GENERATORS[graph](src + ".tmp", size)
                    os.replace(src + ".tmp", src)
            nodes = _count_nodes(src)
            ms = measure(src, a.runs, trees)
            for tree, m in ms.items():
                print(f"{graph} {nodes} [{tree}]: wall {m['wall']:.2f} s, CPU {m['cpu']:.2f} s, peak {m['peak_mb']:.0f} MB, "
                      f"passes {m['passes']['(all passes)']:.2f} s", flush=True)
            results.append({"graph": graph, "nodes": nodes, "m": ms})
            if a.floor:
                results[-1]["floor"] = fl = floor(src, a.runs)
                print(f"{graph} {nodes} [onnxruntime session]: light {fl['ort_light']:.2f} s, default "
                      f"{fl['ort_default']:.2f} s", flush=True)
                print(f"{graph} {nodes} [onnx.load + onnx.save]: wall {fl['wall']:.2f} s, peak {fl['peak_mb']:.0f} MB "
                      f"(import onnx: {fl['base_mb']:.0f} MB)" + (f"; [onnx_ir]: wall {fl['ir_wall']:.2f} s, peak "
                      f"{fl['ir_peak_mb']:.0f} MB" if "ir_wall" in fl else ""), flush=True)
    bases = {tree: baseline_mb(path) for tree, path in trees.items()}
    load = os.getloadavg()
    described = ", ".join(f"`{k}` = {v}" for k, v in trees.items() if v)
    text = (
        "# Optimizer cost as the graph grows\n\n"
        "`python -m rnnfuse optimize IN OUT -q --json J` (validation on), medians of "
        f"{a.runs} runs; wall time (and CPU time, user + system, which the load of a shared machine inflates "
        "less) includes interpreter start-up, imports, load, passes and save. "
        "`lstmcell`: a torch loop over `nn.LSTMCell` (trace export, 18 nodes/step), fused into one LSTM. "
        "`elementwise`: Add/Mul/Tanh/Sigmoid chain, nothing to fuse. `steps`: per-step tanh(x[t] @ W) summed, "
        "nothing to fuse. `masked`: a masked tanh-cell loop (11 nodes/step), fused into one masked RNN. "
        "`loops`: Loops in a row with 2-node bodies (4 nodes/Loop, bodies counted), nothing to fuse. "
        "`side`: tanh cells side by side over one input, 16 steps each, one RNN per cell. "
        "`bidir` / `stacked`: two Gemm tanh cells a step in torch's trace form (14 nodes/step), a forward and a "
        "backward one (one bidirectional RNN once fused) or one reading the other's new h (two RNNs). "
        "`views`: a torch loop over a hand-written LSTM cell, `gates.view(x.size(1), 4, H).unbind(1)` (trace "
        "export with a dynamic batch, 32 nodes/step: each step reads the batch from x's shape), one LSTM. "
        "`head` / `prologue`: the shipped Keras example (two masked Loops and a bidirectional pair to fuse) with "
        "the given number of nodes reading its output (MatMul/Tanh/Add/Sigmoid) or computing its input "
        "(x * 1 + 0): a big model with a small fusion. "
        "`stepcalls`: torch's trace of a 2-layer `nn.LSTM` called once per step (~30 nodes/step), merged into one "
        "LSTM per layer. "
        "`backreads`: torch's trace of a hand-written bidirectional relu RNN (a forward loop, then a backward one, "
        "outputs `stack(cat([hf[t], hb[t]], 1))`, 14 nodes/step), one bidirectional RNN and the stack read from it. "
        "`loophead`: a Loop whose body holds a tanh cell and a per-step head of elementwise ops (the graph's size, "
        "bodies counted), one RNN and the head applied once. "
        "`loopstack`: Loops stacked on one another, a tanh cell each over the outputs of the one below, all reading "
        "one trip count (9 nodes a Loop, bodies counted), one RNN per Loop. "
        "`callhead`: torch's trace of `nn.LSTM` called once per step with a head per call, `tanh(Linear(y[0]))` "
        "stacked (16 nodes/step), one LSTM and the head applied once. "
        "`chunkhead`: torch's trace of a hand-written LSTM cell with `gates.chunk(4, 1)` (slice bounds from each "
        "step's shape) and a `Linear` head per step, stacked (37 nodes/step), one LSTM and the head applied once. "
        "`grucell` / `rnncell` / `grustack` / `grubi`: torch's trace of loops over `nn.GRUCell` / `nn.RNNCell` on a "
        "batch-first `x[:, t]` (20 / 8 nodes/step), two GRUCells a step, the second over the first's h (36), or a "
        "forward and a backward GRUCell loop concatenated (39): one GRU / RNN, two GRUs, one bidirectional GRU. "
        "`ifs` / `constifs`: Ifs in a row, each between two 20-node branches that capture the If before's "
        "output, on a computed / a constant condition (inlined); `scans`: Scans in a row carrying an "
        "elementwise state (22 nodes a Scan, bodies counted), nothing to fuse; `calls`: calls of 10-node "
        "model-local functions (11 nodes a call, counting what it expands to); `shapes`: constant-foldable "
        "shape arithmetic (9 nodes a link) giving the shape a recurrence's input is reshaped to; each of these "
        "five with a 16-step unrolled tanh RNN to fuse. "
        "`wide`: the LSTMCell loop at input and "
        "hidden size 512 (weights dominate the file). "
        "'RSS - libs' is the peak minus a process that only imports the libraries "
        f"({', '.join(f'{v:.0f} MB' for v in bases.values())}). The optimizer runs on one thread; the do-no-harm "
        "guard loads a big model's pieces on up to as many threads as cores (4 at most).\n\n"
        + (f"Side by side ({described}): each run of each size alternates between the checkouts.\n\n" if described else "")
        + f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs; load average "
        f"{load_start[0]:.1f} at the start, {load[0]:.1f} at the end), Python {platform.python_version()}; "
        "onnxruntime validation sessions run 1 intra-op and 1 inter-op thread; each checkout's bytecode is "
        "compiled before the runs (as an installed package's is). "
        "`lstmcell` above 6,000 steps is torch's 4-step export stretched (`stretch_chain`: step 3's 18 "
        "nodes copied per step; numerically the export's output, same node count and ops).\n\n"
        + table(results, bases) + "\n"
        + ("\nMemory beside the floor the issue names, `onnx.load` + `onnx.save` of the same file in a fresh "
           "process (its peak minus a process that only imports onnx; and, where onnx-ir is installed, "
           "`onnx_ir.load` + `onnx_ir.save`, the IR onnxscript's rewriter works on, minus a process that only "
           "imports onnx_ir):\n\n" + floor_table(results, bases) + "\n"
           if any("floor" in r for r in results) else "")
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump({"baseline_mb": bases, "trees": trees, "results": results}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
