"""Models exported for opset 9 and 10 (torch's default before 1.12; old tf2onnx): a Slice takes its bounds as
attributes before opset 10, and the rewrite writes them so (rnnfuse.builder), keeping the model's opset.
Unmasked unrolled loops fuse; a mask still needs opset 11 (Range, CumSum) and is declined with that reason."""

from __future__ import annotations

import onnx
import pytest
from helpers import assert_as_torch_on_x, op_counts

import rnnfuse

T, F, H = 6, 5, 4


def _module(cell: str, reverse: bool, masked: bool):
    import torch
    from torch import nn

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}[cell](F, H)

        def forward(self, x, lengths=None):
            h = torch.zeros(x.shape[1], H)
            c = torch.zeros(x.shape[1], H)
            outs = []
            for t in (reversed(range(x.shape[0])) if reverse else range(x.shape[0])):
                if cell == "lstm":
                    hn, cn = self.cell(x[t], (h, c))
                else:
                    hn, cn = self.cell(x[t], h), c
                if masked:
                    m = (t < lengths).unsqueeze(1)
                    hn, cn = torch.where(m, hn, h), torch.where(m, cn, c)
                h, c = hn, cn
                outs.append(h)
            return torch.stack(outs), h

    torch.manual_seed(0)
    return Loop().eval()


def _export(cell: str, opset: int, path, reverse=False, masked=False):
    import torch

    module = _module(cell, reverse, masked)
    args = (torch.randn(T, 2, F),) + ((torch.tensor([T, 3]),) if masked else ())
    names = ["x"] + (["lengths"] if masked else [])
    torch.onnx.export(module, args, str(path), dynamo=False, opset_version=opset, input_names=names,
                      output_names=["y", "h"], dynamic_axes={n: {[1, 0][k]: "batch"} for k, n in enumerate(names)})
    return onnx.load(str(path)), module


@pytest.mark.parametrize("cell,opset,reverse", [("lstm", 9, False), ("rnn", 9, False), ("gru", 10, True)])
def test_an_unrolled_loop_of_an_old_opset_fuses_in_that_opset(cell, opset, reverse, tmp_path):
    """One native op; the model keeps its opset and passes the checker; its Slices carry their bounds as that
    opset takes them; every output equal to torch and to the original at batch 1 and 3."""
    pytest.importorskip("torch")
    model, module = _export(cell, opset, tmp_path / "m.onnx", reverse)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)[cell.upper()] == 1, report.to_text()
    assert [o.version for o in fused.opset_import if o.domain in ("", "ai.onnx")] == [opset]
    onnx.checker.check_model(fused, full_check=True)
    for n in fused.graph.node:
        if n.op_type == "Slice" and opset < 10:
            assert len(n.input) == 1 and {a.name for a in n.attribute} >= {"starts", "ends"}
    assert_as_torch_on_x(module, model, fused, T, F, f"{cell} opset {opset}", seed=2)


def test_a_reverse_loop_of_opset_9_is_declined_for_its_opset(tmp_path):
    """A reverse loop's Y is flipped back by a Slice of step -1, which opset 9 has no form of: declined with
    that reason, the model as it was."""
    pytest.importorskip("torch")
    model, _ = _export("gru", 9, tmp_path / "m.onnx", reverse=True)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and "needs opset 10" in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)


def test_a_masked_loop_of_opset_10_is_declined_for_its_opset(tmp_path):
    """A length mask needs Range and CumSum (opset 11): declined with that reason, the model as it was."""
    pytest.importorskip("torch")
    model, _ = _export("lstm", 10, tmp_path / "m.onnx", masked=True)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and "opset 11" in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)
