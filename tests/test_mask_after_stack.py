"""Per-step outputs masked after the loop: the states keep their values at masked steps (``h = where(m_t,
cell(x_t, h), h)``) while each step's output is the cell's raw new h, and the stack of them is multiplied by
the mask afterwards (``stack(outs) * mask.unsqueeze(-1).float()``). That product is the native op's Y
zero-filled at masked steps, for any mask (pre-padded, gappy); so are ``masked_fill(~m, 0)`` and ``where(m,
stack, 0)`` (or ``zeros_like(stack)``), a batch-first stack times the mask transposed, and a padding mask's ``masked_fill(pad, 0)``.
torch's trace and dynamo exports (an unrolled chain), TorchScript's (a Loop with a list of outputs) and a
``lax.scan`` through jax2onnx (a Loop's scan output), compared with the framework and the original. Near
misses, declined by structure: the stack multiplied by another mask, also read as it is, zeroed at the valid
steps (``masked_fill(m, 0)``) or by the mask flipped in time, or filled with ones (``ones_like``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import assert_as_framework, op_counts

import rnnfuse

T, F, H = 6, 5, 4
MASKS = {"post": ["111111", "111100", "100000"], "pre": ["111111", "001111", "000001"],
         "gappy": ["101101", "000000", "111111"]}


def _export(form: str, exporter: str, path):
    import torch
    from torch import nn

    class MaskedAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.GRUCell(F, H)

        def forward(self, x, mask, other):
            h = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                hn = self.cell(x[t], h)
                if form == "padding":  # (the mask is true at padded steps)
                    h = torch.where(mask[t].unsqueeze(1), h, hn)
                else:
                    h = torch.where(mask[t].unsqueeze(1), hn, h)
                outs.append(hn)
            if form == "batch_first":  # ([B, T, H], zeroed by the mask read [B, T])
                return torch.stack(outs, 1) * mask.t().unsqueeze(-1).float(), h
            stacked = torch.stack(outs)
            if form == "padding":
                return stacked.masked_fill(mask.unsqueeze(-1), 0.0), h
            if form in ("masked_fill", "filled_where_valid"):  # (the near miss zeroes the valid steps)
                return stacked.masked_fill(mask.unsqueeze(-1) if form == "filled_where_valid" else ~mask.unsqueeze(-1), 0.0), h
            if form == "where":
                return torch.where(mask.unsqueeze(-1), stacked, 0.0), h
            if form in ("where_zeros_like", "where_ones_like"):  # (the near miss fills masked steps with ones)
                fill = torch.zeros_like(stacked) if form == "where_zeros_like" else torch.ones_like(stacked)
                return torch.where(mask.unsqueeze(-1), stacked, fill), h
            by = other if form == "other_mask" else mask
            y = stacked * by.unsqueeze(-1).float()
            return (y, h, stacked) if form == "raw_too" else (y, h)

    torch.manual_seed(0)
    module = MaskedAfter().eval()
    m = torch.ones(T, 2, dtype=torch.bool)
    example = (torch.randn(T, 2, F), m, m)
    names = ["x", "mask", "other"]
    outs = ["y", "h"] + (["raw"] if form == "raw_too" else [])
    if exporter == "dynamo":
        batch = torch.export.Dim("batch", min=1)
        torch.onnx.export(module, example, str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=names, output_names=outs, dynamic_shapes=({1: batch},) * 3)
    else:
        torch.onnx.export(module, example, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=outs, dynamic_axes={n: {1: "batch"} for n in names})
    return onnx.load(str(path)), module


def _scripted(form: str, path):
    """A ``torch.jit.script`` loop over ``nn.LSTMCell`` (a Loop whose outputs are a list: ``SequenceInsert``,
    stacked by ``ConcatFromSequence``), the stack zeroed after it by ``* m`` or ``masked_fill(~m, 0)``."""
    import torch
    from torch import nn

    class Scripted(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.hidden, self.form = nn.LSTMCell(F, H), H, form

        def forward(self, x, mask):
            h = torch.zeros(x.size(1), self.hidden)
            c = torch.zeros(x.size(1), self.hidden)
            outs: list[torch.Tensor] = []
            for t in range(x.size(0)):
                hn, cn = self.cell(x[t], (h, c))
                m = mask[t].unsqueeze(1)
                h, c = torch.where(m, hn, h), torch.where(m, cn, c)
                outs.append(hn)
            if self.form == "mul":
                return torch.stack(outs) * mask.unsqueeze(-1).float(), h
            return torch.stack(outs).masked_fill(~mask.unsqueeze(-1), 0.0), h

    torch.manual_seed(0)
    module = torch.jit.script(Scripted().eval())
    example = (torch.randn(T, 2, F), torch.ones(T, 2, dtype=torch.bool))
    torch.onnx.export(module, example, str(path), dynamo=False, opset_version=17, input_names=["x", "mask"],
                      output_names=["y", "h"], dynamic_axes={"x": {0: "T", 1: "batch"}, "mask": {0: "T", 1: "batch"}})
    return onnx.load(str(path)), module


def _feeds(model, rows: list[str]) -> dict:
    """x and the [T, B] mask of ``rows`` (one string of 0/1 a row), for the inputs ``model`` has (an ``other``
    mask, where the export kept it, equal to the mask)."""
    rng = np.random.default_rng(len(rows))
    mask = np.array([[c == "1" for c in r] for r in rows]).T.copy()
    feeds = {"x": rng.standard_normal((T, len(rows), F)).astype(np.float32), "mask": mask, "other": mask}
    return {i.name: feeds[i.name] for i in model.graph.input}


@pytest.mark.parametrize("form,exporter", [("mul", "trace"), ("mul", "dynamo"), ("masked_fill", "trace"),
                                           ("masked_fill", "dynamo"), ("where", "trace"), ("batch_first", "trace"),
                                           ("padding", "trace"), ("mul", "script"), ("masked_fill", "script"),
                                           ("where_zeros_like", "trace"), ("where_zeros_like", "dynamo")])
def test_outputs_masked_after_the_stack_are_the_zero_filled_sequence(form, exporter, tmp_path):
    """``stack(outs) * m``, ``.masked_fill(~m, 0)``, ``where(m, stack(outs), 0)`` (or ``zeros_like(stack)``), a
    batch-first stack times the mask transposed, and a padding mask's ``masked_fill(pad, 0)``: one masked op,
    every output equal to torch's and the original's for post-, pre-padded and gappy masks, batch 1 and 3."""
    pytest.importorskip("torch")
    import torch

    export = (lambda form, _, path: _scripted(form, path)) if exporter == "script" else _export
    model, module = export(form, exporter, tmp_path / "after.onnx")
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["LSTM" if exporter == "script" else "GRU"] == 1, report.to_text()
    assert report.fused[0].masked, report.to_text()
    for kind, rows in MASKS.items():
        for batch_rows in (rows[1:2], rows):
            feeds = _feeds(model, batch_rows)
            with torch.no_grad():
                args = ("x", "mask") if exporter == "script" else ("x", "mask", "other")
                want = [v.numpy() for v in module(*(torch.from_numpy(feeds.get(n, feeds["mask"])) for n in args))]
            assert_as_framework(fused, model, feeds, want, f"{kind}, batch {len(batch_rows)}")


@pytest.mark.parametrize("form", ["other_mask", "raw_too", "filled_where_valid", "where_ones_like"])
def test_outputs_masked_after_by_another_mask_or_also_read_raw_are_declined(form, tmp_path):
    """``stack(outs) * other`` with other not the states' mask, ``stack(outs)`` also an output as it is, and
    ``masked_fill(m, 0)`` (zeroing the valid steps), ``where(m, stack, ones_like(stack))``: the cell's values at
    masked steps are read, or ones no native output holds; declined before validation, the model as it was."""
    pytest.importorskip("torch")
    model, _ = _export(form, "trace", tmp_path / f"{form}.onnx")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert all(d.validation != "failed" for d in report.declined), report.to_text()  # (by structure)
    assert op_counts(fused) == op_counts(model)


def _jax_scan(form: str):
    """A ``lax.scan`` over a tanh cell keeping h at masked steps, its per-step ys the raw new h, zeroed after
    the scan: ``ys * mask[..., None]`` (jax2onnx: ``Cast(Expand(Reshape(mask, [T, B, 1])))``) or
    ``where(mask[..., None], ys, 0)``; near miss ``flipped``: ``ys * mask[::-1][..., None]``. Static shapes."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax2onnx")
    import jax.numpy as jnp
    from jax2onnx import to_onnx

    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((F, H)).astype(np.float32) * 0.5)
    u = jnp.asarray(rng.standard_normal((H, H)).astype(np.float32) * 0.5)

    def fn(x, mask):
        def step(h, inp):
            x_t, m_t = inp
            h_new = jnp.tanh(x_t @ w + h @ u)
            return jnp.where(m_t[:, None], h_new, h), h_new

        h, ys = jax.lax.scan(step, jnp.zeros((x.shape[1], H), jnp.float32), (x, mask))
        if form == "where":
            return jnp.where(mask[..., None], ys, 0.0), h
        return ys * (mask[::-1] if form == "flipped" else mask)[..., None], h

    model = to_onnx(fn, [(T, 3, F), jax.ShapeDtypeStruct((T, 3), jnp.bool_)], opset=21, input_names=["x", "mask"])
    return model, fn


@pytest.mark.parametrize("form", ["mul", "where"])
def test_a_jax_scan_zeroed_after_by_its_mask_is_the_zero_filled_sequence(form):
    """One masked RNN; outputs equal to jax's and the original's on gappy, pre- and post-padded masks."""
    model, fn = _jax_scan(form)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["RNN"] == 1, report.to_text()
    for kind, rows in MASKS.items():
        feeds = _feeds(model, rows)
        assert_as_framework(fused, model, feeds, [np.asarray(v) for v in fn(feeds["x"], feeds["mask"])], kind)


def test_a_jax_scan_zeroed_after_by_its_mask_flipped_is_declined():
    """``ys * mask[::-1][..., None]``: the steps zeroed are not the masked ones; declined by structure."""
    model, _ = _jax_scan("flipped")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and all(d.validation != "failed" for d in report.declined), report.to_text()
    assert op_counts(fused) == op_counts(model)
