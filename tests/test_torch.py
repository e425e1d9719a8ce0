"""PyTorch exports (trace, dynamo, TorchScript) and Keras 3 on the torch backend: fused, equal to the module.

Models are exported during the test run by ``tests/exporters/torch_cases.py``. Each case asserts no
Loop/Scan/sequence ops and no per-step cell ops left, one native op per recurrence (one bidirectional op
for a forward+backward pair), and outputs equal to torch's own (and to onnxruntime on the original) to 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import rnnfuse
from helpers import assert_close, check_case, exported_case, load_sets, op_counts, session

sys.path.insert(0, str(Path(__file__).parent / "exporters"))
from torch_cases import CASES  # noqa: E402  (plain data; does not import torch)

CELL_OPS = {"Sigmoid", "Tanh", "Gemm", "MatMul", "Relu"}


def _case(directory: Path, name: str) -> dict:
    return exported_case(directory, name, if_missing=pytest.skip)


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.slow and not c.opts.get("near_miss")])
def test_torch(torch_dir, name):
    case = _case(torch_dir, name)
    fused, report = check_case(case)
    assert not report.declined, report.to_text()
    counts = op_counts(fused)
    for op in ("Loop", "Scan", "SequenceInsert", "ConcatFromSequence", "If"):
        assert counts.get(op, 0) == 0, report.to_text()
    init_nodes = _initial_state_nodes(fused)
    left = {}
    for n in fused.graph.node:  # per-step cell maths left; the maths computing an initial state is not
        if n.op_type in CELL_OPS and id(n) not in init_nodes:
            left[n.op_type] = left.get(n.op_type, 0) + 1
    assert sum(left.values()) <= case["expect"].get("max_cell_ops", 0), (left, report.to_text())


@pytest.mark.parametrize("name", [c.name for c in CASES if c.opts.get("init") in ("expand", "expand_one", "chunk")])
def test_initial_states_fuse_from_the_first_step(torch_dir, name):
    """``zeros_like(x[0, :, :1]).expand(-1, H)`` (its shape computed from a ones fill) is a zero initial state,
    also as both h and c; ``h0, c0 = tanh(Linear(code)).chunk(2)`` are two initial states, each a part of one
    tensor no step computes (not one state the first step splits): the chain is fused from its first step, not
    from its second with the first kept."""
    fused, report = check_case(_case(torch_dir, name))
    chains = [f for f in report.fused if f.front == "chain"]
    assert chains and all(", steps 0.." in f.where for f in chains), report.to_text()


@pytest.mark.parametrize("name", [c.name for c in CASES if c.opts.get("near_miss")])
def test_torch_near_miss_declined(torch_dir, name):
    """Loops that are no native recurrence (a step input computed from the state): declined with a reason,
    the model handed back unchanged."""
    case = _case(torch_dir, name)
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    assert not report.fused and report.declined, report.to_text()
    assert all(f.reason.strip() for f in report.declined), report.to_text()
    assert fused.SerializeToString() == original.SerializeToString(), report.to_text()
    check_case(case)  # (and it still computes what torch does)


def test_declined_chain_leaves_its_split_undone(torch_dir):
    """The near miss above is declined after its first step's output was split from its state (a copy of
    the merged node for the stack to read): the graph is left as the chain found it, so what another fusion
    in the same model writes holds no trace of the attempt."""
    from rnnfuse.passes.unrolled import FuseChains

    case = _case(torch_dir, "lstmcell_trace_static_first_output_state_learned")
    model = rnnfuse.Model(onnx.load(case["onnx"]))
    ctx = rnnfuse.Options()
    for p in rnnfuse.Pipeline.default().passes[:3]:  # the clean-ups the pipeline runs before the front ends
        p.run(model, ctx)
    g = model.graph
    g.prune()

    def nodes():
        return [(n.op_type, list(n.input), list(n.output)) for n in g.live_nodes()]

    before = nodes()
    found = FuseChains().run(model, ctx).findings
    assert [f.status for f in found] == ["declined"], found
    assert nodes() == before


def _initial_state_nodes(model) -> set:
    """ids of the nodes that only compute the native ops' initial states (h0 = tanh(Linear(z)), ...)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out, stack = set(), []
    for n in model.graph.node:
        if n.op_type in ("LSTM", "GRU", "RNN"):
            stack += [i for i in list(n.input)[5:7] if i]
    while stack:
        p = producer.get(stack.pop())
        if p is not None and id(p) not in out and p.op_type != "Shape":  # a shape read carries no values
            out.add(id(p))
            stack += list(p.input)
    return out


def test_long_chain(torch_dir):
    """The 2,000-step LSTMCell chain (36,003 nodes) becomes one LSTM equal to torch's output."""
    case = _case(torch_dir, "lstmcell_trace_T2000")
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    counts = op_counts(fused)
    assert counts.get("LSTM") == 1 and sum(counts.values()) <= 4, (counts, report.to_text())
    assert report.fused and report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    s = session(fused)
    for set_name, (feeds, outs) in load_sets(case["npz"]).items():
        got = s.run(None, feeds)
        for k, ref in outs.items():
            assert_close(got[int(k)], ref, f"T2000/{set_name}/{k}")
