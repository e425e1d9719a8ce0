"""Dynamic-shape transformers from torch's tracer beside a recurrence (``tests/exporters/transformer_cases.py``,
exported during the test run): every block assembles shapes from unsqueezed scalars, which the passes must
pass over without asking anything of them. Outputs are compared with torch's own, on two batch sizes."""

from __future__ import annotations

import onnx
import pytest

import rnnfuse
from conftest import generate
from helpers import check_case, exported_case


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory):
    return generate(tmp_path_factory, "transformer_cases.py", [], "transformers")


@pytest.fixture
def ranks_asked(monkeypatch):
    """The values whose rank step-maps asks (each may cost a type inference of the value's cone)."""
    from rnnfuse.passes import step_maps

    asked: list[str] = []
    real = step_maps.known_rank
    monkeypatch.setattr(step_maps, "known_rank", lambda g, name: asked.append(name) or real(g, name))
    return asked


def test_a_transformer_beside_a_native_lstm_comes_out_as_it_went_in(transformer_dir, ranks_asked):
    """nn.LSTM then three blocks, dynamic batch and time: nothing to fuse, the model handed back as it was,
    and no shape scalar asked its rank (each block's ``Concat`` of them looked like a stack of steps)."""
    case = exported_case(transformer_dir, "tf_lstm_trace")
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original)
    assert not report.fused and not report.declined, report.to_text()
    assert fused.SerializeToString() == original.SerializeToString()
    assert ranks_asked == []
    check_case(case)  # (the export computes what torch does, at batch 1 and 3, 5 and 9 steps)


def test_an_lstmcell_loop_before_transformer_blocks_is_fused(transformer_dir, ranks_asked):
    """A traced LSTMCell loop, its steps stacked into three blocks: one LSTM, the blocks as they were, outputs
    (the head's and the last h) equal to torch's at batch 1 and 4."""
    fused, report = check_case(exported_case(transformer_dir, "lstmcell_tf_trace"))
    assert [f.cell for f in report.fused] == ["LSTM(hidden=16)"], report.to_text()
    assert ranks_asked == []


def test_a_loops_zero_state_is_not_sized_by_folding_the_blocks_shapes(transformer_dir, monkeypatch):
    """Each block's causal mask is a broadcast (``ones(T, T)`` from the block's Shape): the chain search asks
    whether such a broadcast is sized by one of the loop's steps, walking back from it to a Shape. It folded
    every value it walked (the block's Concat, Unsqueezes and Gathers), each fold inferring the type of the
    block's input: 1.5 s of a 96,000-node export. Only a Shape of a step's value is folded now."""
    from rnnfuse.passes.unrolled import chains

    folded: list[str] = []
    real = chains._sized_by_a_step

    def sized(g, *args, **kwargs):
        const = g.const
        g.const = lambda name: folded.append(g.producer[name].op_type if name in g.producer else name) or const(name)
        try:
            return real(g, *args, **kwargs)
        finally:
            del g.const

    monkeypatch.setattr(chains, "_sized_by_a_step", sized)
    fused, report = check_case(exported_case(transformer_dir, "lstmcell_tf_trace"))
    assert [f.cell for f in report.fused] == ["LSTM(hidden=16)"], report.to_text()
    assert not {"Concat", "Unsqueeze", "Gather"} & set(folded), folded


def test_the_guard_judges_the_fusion_not_the_blocks_the_clean_ups_renamed(transformer_dir):
    """Dedupe merges each block's repeated shape arithmetic and reads LayerNorm weights past their Identity:
    the blocks' nodes then read the same values under other names. The guard's changed region holds the
    fusion and what its output reaches (the first block's shape assembly), none of the later blocks (each
    merge's readers counted as changed: 6,008 of a 96,000-node export, its region 10,807 nodes)."""
    from rnnfuse import changed_region

    original = onnx.load(exported_case(transformer_dir, "lstmcell_tf_trace")["onnx"])
    fused, report = rnnfuse.optimize(original)
    assert report.fused
    kept = {n.name for n in original.graph.node} & {n.name for n in fused.graph.node}
    renamed = [n.name for n in fused.graph.node if n.name in kept and n.name.startswith(("/blocks.1/", "/blocks.2/"))
               and n not in original.graph.node]
    assert renamed  # (the clean-ups renamed reads in the later blocks)
    part = changed_region.region_model(fused, original)
    assert part is not None
    names = [n.name for n in part.graph.node]
    assert not [n for n in names if n.startswith(("/blocks.1/", "/blocks.2/"))], names
