"""rnnfuse in the ONNX ecosystem, on real exports: the onnx-ir pass inside a PassManager, and ``optimize()``
round-tripping every kind of model it accepts (ModelProto, onnx_ir.Model, onnx_graphsurgeon.Graph, a path).

The models: a torch ``dynamo=True`` export of a Python loop over ``nn.LSTMCell`` (unrolled per step) and a
masked Keras 3 GRU through tf2onnx (a ``Loop``), both generated during the run by the fixture exporters. Every
fused model is checked against the original in onnxruntime and against the framework's own outputs."""

from __future__ import annotations

import warnings

import onnx
import pytest

import rnnfuse
from conftest import generate, load_cases
from helpers import assert_close, load_sets, op_counts, session

ir = pytest.importorskip("onnx_ir")
common_passes = pytest.importorskip("onnx_ir.passes.common")
gs = pytest.importorskip("onnx_graphsurgeon")

# one case per exporter keeps the exports short; the full matrices live in test_torch.py / test_keras.py
TORCH_CASE, KERAS_CASE = "lstmcell_dynamo_bf", "gru_masked_seq"


@pytest.fixture(scope="module", params=["torch-dynamo", "tf2onnx"])
def case(request, tmp_path_factory) -> dict:
    if request.param == "torch-dynamo":
        d = generate(tmp_path_factory, "torch_cases.py", ["--only", TORCH_CASE], "interop-torch")
        name, native = TORCH_CASE, "LSTM"
    else:
        d = generate(tmp_path_factory, "keras_cases.py", ["--backend", "keras3", "--only", KERAS_CASE], "interop-keras3")
        name, native = KERAS_CASE, "GRU"
    (c,) = [c for c in load_cases(d) if c["name"] == name]
    c["native"] = native
    return c


def check_fused(fused: onnx.ModelProto, case: dict) -> None:
    """Fused: one native op and no recurrence left; outputs equal the original's and the framework's."""
    original = onnx.load(case["onnx"])
    counts = op_counts(fused)
    assert counts.get(case["native"], 0) == 1, counts
    assert counts.get("Loop", 0) == 0 and sum(counts.values()) < sum(op_counts(original).values())
    assert fused.ir_version == original.ir_version
    s_orig, s_fused = session(original), session(fused)
    names = [o.name for o in original.graph.output]
    for set_name, (feeds, outs) in load_sets(case["npz"]).items():
        got, ref = s_fused.run(None, feeds), s_orig.run(None, feeds)
        for k, name in enumerate(names):
            assert_close(got[k], ref[k], f"{case['name']}/{set_name}/{name}: fused vs original")
            if str(k) in outs:
                assert_close(got[k], outs[str(k)], f"{case['name']}/{set_name}/{name}: fused vs framework")


def test_ir_pass_in_a_pass_manager(case):
    from rnnfuse.ir_pass import FuseRecurrencesPass

    model = ir.load(case["onnx"])
    fuse = FuseRecurrencesPass()
    assert isinstance(fuse, ir.passes.InPlacePass)
    pm = ir.passes.PassManager([fuse, common_passes.RemoveUnusedNodesPass()])
    result = pm(model)
    assert result.modified and result.model is model  # in place: the same object, now fused
    assert [f.status for f in fuse.report.findings if f.status == "declined"] == []
    check_fused(ir.to_proto(model), case)


def test_ir_pass_leaves_a_model_with_nothing_to_fuse_alone(case):
    from rnnfuse.ir_pass import FuseRecurrencesPass

    model = ir.load(case["onnx"])
    fused = FuseRecurrencesPass()(model).model
    before = ir.to_proto(fused).SerializeToString()
    again = FuseRecurrencesPass()(fused)  # already native now: nothing to fuse
    assert not again.modified and again.model is fused
    assert ir.to_proto(fused).SerializeToString() == before


@pytest.mark.parametrize("kind", ["ModelProto", "onnx_ir.Model", "onnx_graphsurgeon.Graph", "path", "PathLike"])
def test_optimize_returns_the_kind_it_was_given(case, kind):
    from pathlib import Path

    proto = onnx.load(case["onnx"])
    given = {
        "ModelProto": lambda: proto,
        "onnx_ir.Model": lambda: ir.load(case["onnx"]),
        "onnx_graphsurgeon.Graph": lambda: gs.import_onnx(onnx.load(case["onnx"])),
        "path": lambda: case["onnx"],
        "PathLike": lambda: Path(case["onnx"]),
    }[kind]()
    before = proto.SerializeToString()
    fused, report = rnnfuse.optimize(given)
    assert report.fused and not report.declined, report.to_text()
    expected_type = {"onnx_ir.Model": ir.Model, "onnx_graphsurgeon.Graph": gs.Graph}.get(kind, onnx.ModelProto)
    assert isinstance(fused, expected_type) and fused is not given
    as_proto = {"onnx_ir.Model": ir.to_proto, "onnx_graphsurgeon.Graph": lambda g: gs.export_onnx(g, do_type_check=False)}
    check_fused(as_proto.get(kind, lambda p: p)(fused), case)
    if kind == "ModelProto":
        assert given.SerializeToString() == before  # the caller's model is not changed


def test_optimize_refuses_other_objects():
    with pytest.raises(TypeError, match="ModelProto, an onnx_ir.Model"):
        rnnfuse.optimize(object())


def test_old_result_name_still_works_with_a_warning():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        old = rnnfuse.PassResult
    assert old is rnnfuse.PassReport
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    assert rnnfuse.PassReport.__name__ != ir.passes.PassResult.__name__
