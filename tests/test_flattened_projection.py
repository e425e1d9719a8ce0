"""An input projection computed on the sequence's rows flattened: ``Reshape(Gemm(Reshape(x, [-1, F]), K, b),
[T, -1, N])``, as onnx-simplifier rewrites ``x @ K + b`` of a 3-D x (and TF's tensordot writes it, its shape
computed). The steps read slices of the restored projection; the native op reads x itself with ``W = K^T``.
The model is torch's trace of a loop over a hand-written LSTM cell whose x was projected before the loop,
its ``MatMul`` + ``Add`` rewritten into that form here (onnx-simplifier is no dependency of the tests). Near
miss: a Gemm that scales its product (alpha 2) is not read as ``x @ K + b``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import assert_as_torch_on_x, export_torch_on_x, op_counts
from onnx import helper, numpy_helper

import rnnfuse

T, F, H = 6, 5, 4


def _export(path):
    import torch
    from torch import nn

    class Projected(nn.Module):
        def __init__(self):
            super().__init__()
            self.wx = nn.Parameter(torch.randn(F, 4 * H) * 0.6)
            self.b = nn.Parameter(torch.randn(4 * H) * 0.3)
            self.wh = nn.Parameter(torch.randn(H, 4 * H) * 0.6)

        def forward(self, x):
            xp = x @ self.wx + self.b  # (the whole sequence at once)
            h = c = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                i, f, g, o = (xp[t] + h @ self.wh).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            return torch.stack(outs), h

    torch.manual_seed(0)
    module = Projected().eval()
    return export_torch_on_x(module, path, "trace", T, F), module


def _flattened(model: onnx.ModelProto, restore: str, alpha: float = 1.0) -> onnx.ModelProto:
    """The model with its projection ``Add(MatMul(x, K), b)`` computed as ``Gemm`` (of ``alpha``) on x's rows
    flattened, restored by a constant shape (``const``: [T, -1, 4H]) or a computed one (``computed``:
    [x.size(0), -1, 4H])."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    mm = next(n for n in g.node if n.op_type == "MatMul" and n.input[0] == "x")
    add = next(n for n in g.node if n.op_type == "Add" and mm.output[0] in n.input)
    bias = next(i for i in add.input if i != mm.output[0])
    consts = [numpy_helper.from_array(np.array([-1, F], np.int64), "flat_shape")]
    nodes = [helper.make_node("Reshape", ["x", "flat_shape"], ["x_rows"]),
             helper.make_node("Gemm", ["x_rows", mm.input[1], bias], ["proj_rows"], alpha=alpha)]
    if restore == "computed":
        consts.append(numpy_helper.from_array(np.array([0], np.int64), "at0"))
        consts.append(numpy_helper.from_array(np.array([-1, 4 * H], np.int64), "rest"))
        nodes += [helper.make_node("Shape", ["x"], ["x_shape"]),
                  helper.make_node("Gather", ["x_shape", "at0"], ["x_len"], axis=0),
                  helper.make_node("Concat", ["x_len", "rest"], ["proj_shape"], axis=0)]
    else:
        consts.append(numpy_helper.from_array(np.array([T, -1, 4 * H], np.int64), "proj_shape"))
    nodes.append(helper.make_node("Reshape", ["proj_rows", "proj_shape"], [add.output[0]]))
    at = list(g.node).index(mm)
    kept = [n for n in g.node if n is not mm and n is not add]
    del g.node[:]
    g.node.extend(kept[:at] + nodes + kept[at:])
    g.initializer.extend(consts)
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("restore", ["const", "computed"])
def test_a_projection_on_flattened_rows_is_the_ops_input_weight(restore, tmp_path):
    """One LSTM reading x (its W the projection's K transposed: no Gemm left); outputs equal torch's and the
    original's at batch 1 and 3."""
    pytest.importorskip("torch")
    exported, module = _export(tmp_path / "projected.onnx")
    model = _flattened(exported, restore)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["LSTM"] == 1, report.to_text()
    lstm = next(n for n in fused.graph.node if n.op_type == "LSTM")
    assert lstm.input[0] == "x" and not op_counts(fused).get("Gemm"), report.to_text()
    assert_as_torch_on_x(module, model, fused, T, F, restore, seed=3)


def test_a_gemm_that_scales_its_product_is_not_read_as_the_projection(tmp_path):
    """``Gemm(rows, K, b, alpha=2)`` is ``2 * (x @ K) + b``: not x @ K + b. Declined as before this form was read
    (a slice of the computed projection), not fused with K's weights and left to validation to catch."""
    pytest.importorskip("torch")
    exported, _ = _export(tmp_path / "projected.onnx")
    model = _flattened(exported, "const", alpha=2.0)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and op_counts(fused) == op_counts(model), report.to_text()
    assert all(d.validation != "failed" for d in report.declined), report.to_text()
