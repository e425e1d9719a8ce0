"""``F.celu`` as a cell's activation: ``Celu(alpha)(x) = max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``.
With alpha 1 (torch's default) it is Elu(1), which the native ops name; torch's tracer and dynamo both write
the ONNX ``Celu`` op. Another alpha is ``alpha * Elu(1)(x / alpha)``, a scaled state: declined, named."""

from __future__ import annotations

import onnx
import pytest
from helpers import assert_as_torch_on_x, export_torch_on_x, op_counts

import rnnfuse

T, F, H = 6, 5, 4


def _export(alpha: float, exporter: str, path) -> tuple[onnx.ModelProto, object]:
    import torch
    from torch import nn
    from torch.nn import functional as fn

    class CeluRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.wx, self.wh = nn.Linear(F, H), nn.Linear(H, H)

        def forward(self, x):
            h = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                h = fn.celu(self.wx(x[t]) + self.wh(h), alpha)
                outs.append(h)
            return torch.stack(outs), h

    torch.manual_seed(0)
    module = CeluRNN().eval()
    return export_torch_on_x(module, path, exporter, T, F), module


@pytest.mark.parametrize("exporter", ["trace", "dynamo"])
def test_celu_of_alpha_one_is_an_rnn_under_elu(exporter, tmp_path):
    """One RNN with the activation Elu(1); every output equal to torch and to the original at batch 1 and 3."""
    pytest.importorskip("torch")
    model, module = _export(1.0, exporter, tmp_path / "celu.onnx")
    assert op_counts(model).get("Celu"), "the export no longer writes Celu: this test covers nothing"
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["RNN"] == 1, report.to_text()
    rnn = next(n for n in fused.graph.node if n.op_type == "RNN")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in rnn.attribute}
    assert [s.decode() for s in attrs["activations"]] == ["Elu"] and list(attrs["activation_alpha"]) == [1.0]
    assert_as_torch_on_x(module, model, fused, T, F, "celu", seed=2)


def test_celu_of_another_alpha_is_declined_for_it(tmp_path):
    """``celu(x, 2)`` is ``2 * elu(x / 2)``: no native activation; declined with the alpha named, the model
    as it was."""
    pytest.importorskip("torch")
    model, _ = _export(2.0, "trace", tmp_path / "celu2.onnx")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and any("Celu with alpha 2" in d.reason for d in report.declined), report.to_text()
    assert op_counts(fused) == op_counts(model)
