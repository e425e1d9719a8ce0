"""Assertions shared by the tests: run a model before and after fusion and compare with the framework."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import rnnfuse
from rnnfuse.graph import attr

ATOL = 1e-5
RTOL = 1e-5


def exported_case(directory: Path, name: str, if_missing=pytest.fail) -> dict:
    """A fixture the exporter scripts wrote: its metadata (``NAME.json``) with the paths of its model and data.
    ``if_missing`` (pytest.fail, or pytest.skip where another test already fails on it) says what a fixture
    the exporter did not write does to the test."""
    path = directory / f"{name}.json"
    if not path.exists():
        if_missing(f"{name} was not exported (see the generator's warnings)")
    meta = json.loads(path.read_text())
    meta["onnx"] = str(directory / f"{name}.onnx")
    meta["npz"] = str(directory / f"{name}.npz")
    return meta


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_model(model: onnx.ModelProto, feeds: dict) -> list:
    """Every output of ``model`` on ``feeds`` (onnxruntime, CPU)."""
    return session(model).run(None, feeds)


def after_pass(pass_, proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``proto`` rewritten by the one pass ``pass_`` (finalized), and its node list's op types."""
    from rnnfuse.findings import Options
    from rnnfuse.model import Model

    model = Model(proto)
    pass_.run(model, Options())
    model.graph.finalize()
    return model.proto, [n.op_type for n in model.proto.graph.node]


def op_counts(model: onnx.ModelProto) -> Counter:
    from rnnfuse.pipeline import op_counts as graph_op_counts

    return graph_op_counts(model.graph)


def directions(model: onnx.ModelProto) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.op_type in ("LSTM", "GRU", "RNN"):
            out.setdefault(n.op_type, []).append(attr(n, "direction", "forward"))
    return {k: sorted(v) for k, v in out.items()}


def io_signature(model: onnx.ModelProto):
    def sig(vis):
        return [(v.name, v.type.tensor_type.elem_type) for v in vis]

    return sig(model.graph.input), sig(model.graph.output)


def load_sets(npz_path: str) -> dict[str, tuple[dict, dict]]:
    data = np.load(npz_path)
    sets: dict[str, tuple[dict, dict]] = {}
    for key in data.files:
        kind, set_name, rest = key.split("/", 2)
        feeds, outs = sets.setdefault(set_name, ({}, {}))
        (feeds if kind == "in" else outs)[rest] = data[key]
    return sets


def assert_close(actual, expected, what: str, atol=ATOL, rtol=RTOL) -> float:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64)))) if actual.size else 0.0
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol, err_msg=what)
    return err


def assert_as_framework(fused: onnx.ModelProto, original: onnx.ModelProto, feeds: dict, want: list, what: str) -> None:
    """Every output of ``fused`` on ``feeds`` is the framework's (``want``, in output order) and the original
    model's, shapes included."""
    got, orig = session(fused).run(None, feeds), session(original).run(None, feeds)
    assert len(got) == len(want) == len(orig), what
    for g, w, o in zip(got, want, orig):
        assert g.shape == w.shape == o.shape, what
        assert_close(g, w, f"{what}: fused vs the framework")
        assert_close(g, o, f"{what}: fused vs the original")


def export_torch_on_x(module, path, exporter: str, steps: int, features: int) -> onnx.ModelProto:
    """``module`` (reading one time-major x, returning (y, h)) exported by torch's tracer (``trace``, opset 17)
    or dynamo (``dynamo``), its batch dynamic; the exported model."""
    import torch

    example = (torch.randn(steps, 2, features),)
    if exporter == "dynamo":
        torch.onnx.export(module, example, str(path), dynamo=True, external_data=False, verbose=False,
                          input_names=["x"], output_names=["y", "h"],
                          dynamic_shapes=({1: torch.export.Dim("batch", min=1)},))
    else:
        torch.onnx.export(module, example, str(path), dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y", "h"], dynamic_axes={"x": {1: "batch"}})
    return onnx.load(str(path))


def assert_as_torch_on_x(module, original: onnx.ModelProto, fused: onnx.ModelProto, steps: int, features: int,
                         what: str, batches=(1, 3), seed: int = 0) -> None:
    """:func:`assert_as_framework` on a random time-major x ``[steps, B, features]`` for each B of ``batches``,
    the framework being the torch ``module`` called on x."""
    import torch

    rng = np.random.default_rng(seed)
    for batch in batches:
        x = rng.standard_normal((steps, batch, features)).astype(np.float32)
        with torch.no_grad():
            want = [v.numpy() for v in module(torch.from_numpy(x))]
        assert_as_framework(fused, original, {"x": x}, want, f"{what}, batch {batch}")


def assert_same_on_x(original: onnx.ModelProto, fused: onnx.ModelProto, features: int,
                     sizes=((1, 1), (6, 3), (9, 2)), seed: int = 5) -> None:
    """The two models, both reading one input ``x`` of ``[T, B, features]``, give the same outputs (every one,
    shapes included) on random x of each ``(T, B)`` of ``sizes``."""
    rng = np.random.default_rng(seed)
    want, got = session(original), session(fused)
    for T, B in sizes:
        x = rng.standard_normal((T, B, features)).astype(np.float32)
        for a, e in zip(got.run(None, {"x": x}), want.run(None, {"x": x})):
            assert_close(a, e, f"T={T}, B={B}")


def check_case(case: dict, sets: list[str] | None = None, **optimize_kwargs) -> tuple[onnx.ModelProto, "rnnfuse.Report"]:
    """Optimize a generated case and check structure and outputs against the original and the framework."""
    original = onnx.load(case["onnx"])
    fused, report = rnnfuse.optimize(original, **optimize_kwargs)
    onnx.checker.check_model(fused, full_check=True)
    assert fused.ir_version == original.ir_version
    assert [(o.domain, o.version) for o in fused.opset_import] == [(o.domain, o.version) for o in original.opset_import]
    assert io_signature(fused) == io_signature(original)
    expect = case.get("expect", {})
    counts = op_counts(fused)
    for op in expect.get("absent", []):
        assert counts.get(op, 0) == 0, f"{case['name']}: {op} left: {report.to_text()}"
    for op, n in expect.get("ops", {}).items():
        assert counts.get(op, 0) == n, f"{case['name']}: {counts.get(op, 0)} {op} instead of {n}\n{report.to_text()}"
    if "directions" in expect:
        assert directions(fused) == {k: sorted(v) for k, v in expect["directions"].items()}, report.to_text()
    if "validated" in expect:  # (how the rewrite was validated, e.g. a big head "at its probe points")
        assert all(expect["validated"] in f.validation for f in report.fused), report.to_text()
    for op, want in expect.get("attrs", {}).items():
        for node in (n for n in fused.graph.node if n.op_type == op):
            got = native_attrs(node)
            for name, value in want.items():
                assert _attr_matches(got, name, value), f"{case['name']}: {op} {name}={got.get(name)!r}, expected {value!r}\n{report.to_text()}"
    s_orig, s_fused = session(original), session(fused)
    names = [o.name for o in original.graph.output]
    all_sets = load_sets(case["npz"])
    for set_name, (feeds, outs) in all_sets.items():
        if sets is not None and set_name not in sets:
            continue
        got = s_fused.run(None, feeds)
        ref = s_orig.run(None, feeds)
        for k, name in enumerate(names):
            assert_close(got[k], ref[k], f"{case['name']}/{set_name}/{name}: fused vs original")
            if str(k) in outs:
                assert_close(got[k], outs[str(k)], f"{case['name']}/{set_name}/{name}: fused vs framework")
    return fused, report


# what a native op's attribute is when it is not written (ONNX defaults)
_NATIVE_DEFAULTS = {"linear_before_reset": 0, "direction": "forward", "layout": 0}


def native_attrs(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values (strings decoded)."""
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list):
            v = [x.decode() if isinstance(x, bytes) else x for x in v]
        out[a.name] = v
    return out


def _attr_matches(got: dict, name: str, want) -> bool:
    """``got[name] == want``, an unwritten attribute taking its ONNX default; a per-direction list (activations,
    their alphas and betas) given for one direction must hold for both directions of a bidirectional op."""
    value = got.get(name, _NATIVE_DEFAULTS.get(name))
    if isinstance(want, list) and isinstance(value, list) and got.get("direction") == "bidirectional" and len(value) == 2 * len(want):
        want = want * 2
    return _same_value(value, want)


def _same_value(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()  # ONNX activation names are case-insensitive
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    return a == b


def skewed_sessions(monkeypatch, module, skew, skewed_output) -> list:
    """Patch ``module.open_session``: every session opened is recorded by its ``light``, and the sessions for
    which ``skew(light)`` holds return the outputs named so that ``skewed_output(name)`` 0.01 off (as if
    onnxruntime computed the rewrite differently there). Returns the list of each opened session's ``light``."""
    opened = []
    open_session = module.open_session

    def skewed(*a, light=False, **k):
        sess = open_session(*a, light=light, **k)
        opened.append(light)
        if skew(light):
            run, names = sess.run, [o.name for o in sess.get_outputs()]
            sess.run = lambda outs, feeds: [v + np.float32(0.01) if skewed_output(n) else v
                                            for n, v in zip(names, run(outs, feeds))]
        return sess

    monkeypatch.setattr(module, "open_session", skewed)
    return opened


class AttributeReads:
    """A node that records the reads of its attribute field (upb gives a node's object a map of stand-ins at
    the first read of an empty repeated field, held as long as the object lives: see rnnfuse.protos.node_field)."""

    def __init__(self, node, reads: list):
        self._node, self._reads = node, reads

    def __getattr__(self, name):
        if name == "attribute":
            self._reads.append(self._node.op_type)
        return getattr(self._node, name)


def agrees_on_x(fused, original, zero_rows: float = 0.0) -> None:
    """``fused`` gives ``original``'s output on random ``x`` of [T, 1, 4] at T = 1 and 7, each step's row zero
    with probability ``zero_rows`` (steps a mask of ``x_t != 0`` skips)."""
    rng = np.random.default_rng(0)
    for t in (1, 7):
        x = rng.standard_normal((t, 1, 4)).astype(np.float32)
        x[rng.random(t) < zero_rows] = 0.0
        (want,) = session(original).run(None, {"x": x})
        (got,) = session(fused).run(None, {"x": x})
        np.testing.assert_allclose(got, want, atol=1e-5)


def benchmark_graph(module: str, generator: str, path, nodes: int) -> onnx.ModelProto:
    """The graph ``benchmarks/{module}.py``'s ``generator`` writes at ``path`` with about ``nodes`` nodes."""
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        getattr(importlib.import_module(module), generator)(str(path), nodes)
    finally:
        sys.path.remove(bench)
    return onnx.load(str(path))


def same_bytes_split(model: onnx.ModelProto, monkeypatch, route: str, piece_nodes: int) -> None:
    """``model`` optimizes to the same bytes and findings when its big check models (over 100 nodes, lowered)
    are split into pieces or groups of ``piece_nodes`` as when each is one session, and ``route`` (a function of
    rnnfuse.validate that splits them) was taken."""
    import rnnfuse
    from rnnfuse import validate

    whole, whole_report = rnnfuse.optimize(model)
    monkeypatch.setattr(validate, "PIECEWISE_CHECK_NODES", 100)
    monkeypatch.setattr(validate, "CHECK_PIECE_NODES", piece_nodes)
    taken = []
    real = getattr(validate, route)
    monkeypatch.setattr(validate, route, lambda *a, **k: taken.append(1) or real(*a, **k))
    split, report = rnnfuse.optimize(model)
    assert taken and split.SerializeToString() == whole.SerializeToString()
    assert [f.status for f in report.findings] == [f.status for f in whole_report.findings]


def emit_wrong_at(monkeypatch, where: str) -> None:
    """The rewrite of the recurrence at ``where`` (a Loop's first output names it) is emitted with a clip its
    cell does not have: a wrong rewrite validation must catch."""
    from onnx import helper

    from rnnfuse import rewrite

    emit = rewrite.emit

    def clipped(g, rec, *a, **k):
        em = emit(g, rec, *a, **k)
        if rec.where == where:
            em.native.attribute.append(helper.make_attribute("clip", 0.05))
        return em

    monkeypatch.setattr(rewrite, "emit", clipped)
