"""A Loop whose trip count is a runtime integer, not x's length: TorchScript's ``for t in range(n)`` with
``n`` an input, ``range(x.size(0) - k)``, ``range(int(lengths.max()))`` beside a length mask. The loop runs
over steps 0 .. M - 1 of x (a read past x's end fails in the original), so the native op runs over
``x[:max(M, 0)]``. Near misses: x read where a read past its end does not fail (a Slice clamps), a counter's
final value used."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders_loops import H, LoopOpts, build, build_counted_loop
from helpers import assert_as_framework, assert_close, op_counts, session
from onnx import TensorProto, helper

import rnnfuse


def _counted(o: LoopOpts | None, form: str) -> onnx.ModelProto:
    """The loop of ``build(o)`` run for ``n`` steps (``form`` "n": a graph input) or ``T - k`` (``"T_minus_k"``);
    with no ``o``, build_counted_loop's (a counter carried beside h, its final used)."""
    model = build(o) if o is not None else build_counted_loop("int64")
    g = model.graph
    loop = next(n for n in g.node if n.op_type == "Loop")
    name = "n" if form == "n" else "k"
    g.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, []))
    if form == "n":
        loop.input[0] = "n"
    else:
        at = list(g.node).index(loop)
        g.node.insert(at, helper.make_node("Sub", ["T", "k1d"], ["Tk"]))
        g.node.insert(at, helper.make_node("Reshape", ["k", "i1"], ["k1d"]))
        loop.input[0] = "Tk"
    for out in g.output:  # ys has the loop's own step count
        if out.name == "ys":
            out.type.tensor_type.shape.dim[0].dim_param = "steps"
    onnx.checker.check_model(model, full_check=True)
    return model


def _runs(o: LoopOpts, form: str, rng):
    """(feeds, steps run) over batch 1 and 3, T = 3 and 7, every count from 1 to T; with the condition
    ``i + 1 < T`` beside the count also counts past T (the condition stops the loop after T steps)."""
    for T, B in ((3, 1), (7, 3)):
        x = o.x_of(T, B, rng)
        for count in range(1, T + (3 if o.cond else 1)):
            yield {"x": x, ("n" if form == "n" else "k"): np.array(count if form == "n" else T - count, np.int64)}, \
                min(count, T)


@pytest.mark.parametrize("read,cond", [("gather0", ""), ("gather1", ""), ("gather0", "int32")])
@pytest.mark.parametrize("form", ["n", "T_minus_k"])
def test_a_loop_run_for_a_runtime_count_runs_the_native_op_over_that_many_steps(read, cond, form):
    """One RNN over the first M steps of x; every output the original's, at every count 1 .. T (ys has M
    steps), time-major and batch-first x, and with the condition ``i + 1 < T`` beside the count (it runs
    min(M, T) steps, as the cut of x does)."""
    o = LoopOpts(read=read, x_carried=False, w_carried=False, cond=cond)
    model = _counted(o, form)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and report.fused[0].validation.startswith("ok"), report.to_text()
    assert op_counts(fused)["Loop"] == 0 and op_counts(fused)["RNN"] == 1
    onnx.checker.check_model(fused, full_check=True)
    s_orig, s_fused = session(model), session(fused)
    for feeds, steps in _runs(o, form, np.random.default_rng(3)):
        for got, want in zip(s_fused.run(None, feeds), s_orig.run(None, feeds)):
            assert got.shape == want.shape, (steps, got.shape, want.shape)
            assert_close(got, want, f"{form} {steps} steps")
        assert s_fused.run(None, feeds)[0].shape[0] == steps


def test_a_runtime_count_of_no_steps_gives_the_initial_state():
    """A count of 0 or less runs no step (the Slice's end is ``max(M, 0)``, never counted from the end): the
    final h is the initial one, as the original's Loop gives it."""
    o = LoopOpts(read="gather0", x_carried=False, w_carried=False)
    model = _counted(o, "n")
    fused, _ = rnnfuse.optimize(model)
    x = o.x_of(4, 2, np.random.default_rng(0))
    for n in (0, -2):
        feeds = {"x": x, "n": np.array(n, np.int64)}
        want = session(model).run(["h_last"], feeds)[0]
        got = session(fused).run(["h_last"], feeds)[0]
        assert want.shape == got.shape == (2, H) and not want.any() and not got.any()


@pytest.mark.parametrize("read", ["slice0", "slice1"])
def test_a_runtime_count_over_reads_that_clamp_is_declined(read):
    """x read with a Slice (past x's end it reads nothing instead of failing): the loop may run steps the
    native op cannot; declined as before, the model as it was."""
    model = _counted(LoopOpts(read=read, x_carried=False, w_carried=False), "n")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and "trip count" in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)


def _agrees(torch, module, model, fused, feeds: dict, what: str) -> None:
    """The fused model's outputs on ``feeds`` are torch's (``module`` called on them in order) and the
    original's, shapes included."""
    with torch.no_grad():
        want = [v.numpy() for v in module(*(torch.from_numpy(v) for v in feeds.values()))]
    assert_as_framework(fused, model, feeds, want, what)


def test_torchscript_range_of_an_input_fuses_and_matches_torch(tmp_path):
    """The real exporter: ``torch.jit.script`` of ``for t in range(int(n))`` and ``range(x.size(0) - int(k))``
    over an nn.LSTMCell (stacked outputs, last h and c). One LSTM each, equal to torch and to the original at
    every count 1 .. T, batch 1 and 3."""
    torch = pytest.importorskip("torch")
    from torch import nn

    class Counted(nn.Module):
        def __init__(self, minus: bool):
            super().__init__()
            self.cell, self.minus = nn.LSTMCell(5, 4), minus

        def forward(self, x, n):
            h = torch.zeros(x.size(1), 4)
            c = torch.zeros(x.size(1), 4)
            outs: list[torch.Tensor] = []
            steps = x.size(0) - int(n) if self.minus else int(n)
            for t in range(steps):
                h, c = self.cell(x[t], (h, c))
                outs.append(h)
            return torch.stack(outs), h, c

    rng = np.random.default_rng(5)
    for minus in (False, True):
        torch.manual_seed(0)
        module = Counted(minus).eval()
        path = tmp_path / f"counted_{minus}.onnx"
        example = (torch.randn(6, 2, 5), torch.tensor(3))
        torch.onnx.export(torch.jit.script(module), example, str(path), dynamo=False, opset_version=17,
                          input_names=["x", "n"], output_names=["y", "h", "c"],
                          dynamic_axes={"x": {0: "time", 1: "batch"}})
        model = onnx.load(str(path))
        fused, report = rnnfuse.optimize(model)
        assert len(report.fused) == 1 and op_counts(fused)["LSTM"] == 1 and op_counts(fused)["Loop"] == 0, \
            report.to_text()
        for T, B in ((4, 1), (7, 3)):
            x = rng.standard_normal((T, B, 5)).astype(np.float32)
            for steps in range(1, T + 1):
                n = T - steps if minus else steps
                _agrees(torch, module, model, fused, {"x": x, "n": np.array(n, np.int64)}, f"minus={minus} n={n}")


def test_a_used_final_counter_of_a_loop_run_for_a_runtime_count_is_declined():
    """A counter carried beside h whose final value the graph uses: its final is read as its start plus x's
    length, which a runtime trip count is not; declined with that reason, the model as it was."""
    model = _counted(None, "n")
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and "runtime trip count" in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)


def test_torchscript_range_of_the_longest_length_with_a_length_mask_matches_torch(tmp_path):
    """``for t in range(int(lengths.max()))`` with the state kept where ``t >= lengths`` and the output zeroed
    there: the op runs over x's first max(lengths) steps with the length mask built over those steps. Equal to
    torch and to the original for T = 1 .. 9, batch 1 .. 4, rows of any length from 0 to T."""
    torch = pytest.importorskip("torch")
    from torch import nn

    class Longest(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.hid = nn.LSTMCell(5, 4), 4

        def forward(self, x, lengths):
            h = torch.zeros(x.size(1), self.hid)
            c = torch.zeros(x.size(1), self.hid)
            outs: list[torch.Tensor] = []
            for t in range(int(lengths.max())):
                h2, c2 = self.cell(x[t], (h, c))
                m = (t < lengths).unsqueeze(1)
                h, c = torch.where(m, h2, h), torch.where(m, c2, c)
                outs.append(h * m.float())
            return torch.stack(outs), h

    torch.manual_seed(0)
    module = Longest().eval()
    path = tmp_path / "longest.onnx"
    torch.onnx.export(torch.jit.script(module), (torch.randn(6, 2, 5), torch.tensor([6, 3])), str(path),
                      dynamo=False, opset_version=17, input_names=["x", "lengths"], output_names=["y", "h"],
                      dynamic_axes={"x": {0: "time", 1: "batch"}, "lengths": {0: "batch"}})
    model = onnx.load(str(path))
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and op_counts(fused)["Loop"] == 0, report.to_text()
    rng = np.random.default_rng(0)
    for T, B in ((1, 1), (4, 1), (6, 3), (9, 4)):
        for _ in range(4):
            lengths = rng.integers(0, T + 1, size=B)
            lengths[rng.integers(B)] = rng.integers(1, T + 1)  # (at least one step: torch.stack of none fails)
            x = rng.standard_normal((T, B, 5)).astype(np.float32)
            _agrees(torch, module, model, fused, {"x": x, "lengths": lengths.astype(np.int64)}, f"lengths {lengths}")
