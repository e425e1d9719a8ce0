"""A linear recurrence that reads its state elementwise, ``h = u * h + x_t @ W + b`` (a running sum of projected
steps, a leaky linear integrator): an ONNX RNN with R = diag(u) under the identity activation, Affine(1, 0).
Exported by torch's tracer (an unrolled chain) and dynamo; near misses (an activation on the input part only,
a running max) declined."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import assert_as_torch_on_x, export_torch_on_x, op_counts

import rnnfuse

T, F, H = 6, 5, 4


def _module(form: str):
    import torch
    from torch import nn

    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(F, H)

        def forward(self, x):
            h = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                if form == "sum":
                    h = h + self.w(x[t])
                elif form == "leaky":
                    h = 0.5 * h + self.w(x[t])
                elif form == "ema_tanh":  # near miss: tanh on the input part only
                    h = 0.9 * h + 0.1 * torch.tanh(self.w(x[t]))
                else:  # near miss: a running max
                    h = torch.maximum(h, self.w(x[t]))
                outs.append(h)
            return torch.stack(outs), h

    torch.manual_seed(0)
    return Linear().eval()


def _export(form: str, exporter: str, path) -> tuple[onnx.ModelProto, object]:
    module = _module(form)
    return export_torch_on_x(module, path, exporter, T, F), module


@pytest.mark.parametrize("form,exporter", [("sum", "trace"), ("leaky", "trace"), ("sum", "dynamo")])
def test_a_linear_recurrence_is_an_rnn_with_the_identity_activation(form, exporter, tmp_path):
    """One RNN, activation Affine(1, 0), its R the diagonal the graph multiplies h by (I for a running sum);
    every output equal to torch and to the original at batch 1 and 3."""
    pytest.importorskip("torch")
    model, module = _export(form, exporter, tmp_path / f"{form}.onnx")
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["RNN"] == 1, report.to_text()
    rnn = next(n for n in fused.graph.node if n.op_type == "RNN")
    acts = next(a for a in rnn.attribute if a.name == "activations")
    assert [s.decode() for s in acts.strings] == ["Affine"], report.to_text()
    R = next(onnx.numpy_helper.to_array(i) for i in fused.graph.initializer if i.name == rnn.input[2])
    assert np.array_equal(R[0], np.eye(H, dtype=np.float32) * (1.0 if form == "sum" else 0.5))
    assert_as_torch_on_x(module, model, fused, T, F, form, seed=1)


@pytest.mark.parametrize("form", ["ema_tanh", "max"])
def test_a_recurrence_linear_in_h_but_not_in_x_is_declined(form, tmp_path):
    """``0.9 * h + 0.1 * tanh(x_t @ W)`` (the activation on the input part alone) and ``max(h, x_t @ W)``: no
    native cell; declined, the model as it was."""
    pytest.importorskip("torch")
    model, _ = _export(form, "trace", tmp_path / f"{form}.onnx")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert op_counts(fused) == op_counts(model)
