"""A model whose file holds no op any pass needs is copied from its bytes, without being loaded, with the same
output and report as the full run; everything else (a needed op at any depth, a damaged file, external data,
a pass that does not say what it needs) takes the full path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.cli as cli
import rnnfuse.prescreen as prescreen
from rnnfuse import model_io, wire
from rnnfuse.findings import op_counts
from rnnfuse.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_masked_bigru_lstm.onnx"
NEEDS = Pipeline.default().fusion_needs()


def _vi(name, shape=(2, 3)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def elementwise_model(n: int = 50, opset: int = 17) -> onnx.ModelProto:
    """A chain of n elementwise nodes (the issue's nothing-to-fuse graph, small)."""
    nodes, prev = [], "x"
    for i in range(n):
        op = ("Relu", "Neg", "Abs", "Sigmoid")[i % 4]
        nodes.append(helper.make_node(op, [prev], [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    return helper.make_model(helper.make_graph(nodes, "g", [_vi("x")], [_vi("y")]),
                             opset_imports=[helper.make_opsetid("", opset)])


def nested_model(inner_op: str, custom_domain: bool = False) -> onnx.ModelProto:
    """``If(c)`` whose then-branch holds a ``Loop`` whose body holds ``inner_op`` (or, custom_domain, a node of
    another domain whose graph attribute holds it): an op two subgraphs deep."""
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    inner = helper.make_node(inner_op, ["v", "w"] if inner_op == "MatMul" else ["v"], ["u"])
    body = helper.make_graph(
        [helper.make_node("Identity", ["v_in"], ["v"]), inner, helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), _vi("v_in")],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _vi("u")])
    if custom_domain:
        holder = helper.make_node("Wrap", ["x"], ["z"], domain="my.ops", body=body)
    else:
        holder = helper.make_node("Loop", ["", "", "x"], ["z"], body=body)
    then_g = helper.make_graph([holder], "then", [], [_vi("z")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["z2"])], "else", [], [_vi("z2")])
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("my.ops", 1)] if custom_domain else [])
    return helper.make_model(helper.make_graph(nodes, "g", [_vi("x")], [_vi("y")], [w]), opset_imports=opsets)


# -- the walk over the file's bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: onnx.load(EXAMPLE),
    elementwise_model,
    lambda: nested_model("MatMul"),
    lambda: nested_model("Relu", custom_domain=True),
], ids=["keras-loops", "elementwise", "matmul-two-deep", "custom-domain-subgraph"])
def test_outline_reads_what_the_loaded_model_holds(make):
    m = make()
    o = wire.outline(m.SerializeToString())
    assert list(o.ops.items()) == list(op_counts(m.graph).items())  # every depth, same order
    assert o.ir_version == m.ir_version
    assert [(i.domain, i.version) for i in o.opset_import] == [(i.domain, i.version) for i in m.opset_import]


@pytest.mark.parametrize("inner,custom", [("MatMul", False), ("MatMul", True)])
def test_a_needed_op_at_any_depth_stops_the_walk(inner, custom):
    data = nested_model(inner, custom_domain=custom).SerializeToString()
    assert wire.outline(data, stop_at=NEEDS) is None
    assert wire.outline(data, stop_at=frozenset({"Gemm"})) is not None  # (a near miss: no Gemm anywhere)


def test_the_byte_search_finds_every_needed_op_written_the_usual_way():
    # each needed op, two subgraphs deep or at the top, is found by the search alone
    for op in sorted(NEEDS):
        m = elementwise_model(20)
        m.graph.node.insert(10, helper.make_node(op, ["t9"], ["extra"]))
        assert wire.may_name_an_op(m.SerializeToString(), frozenset({op})), op
    assert wire.may_name_an_op(nested_model("MatMul").SerializeToString(), NEEDS)
    assert not wire.may_name_an_op(elementwise_model(200).SerializeToString(), NEEDS)


def test_a_false_alarm_of_the_byte_search_takes_the_full_path_to_the_same_output(tmp_path, monkeypatch):
    # a doc string holding the bytes of a Loop op-type field: the search says maybe, the full run fuses nothing
    m = elementwise_model(30)
    m.graph.doc_string = "\x22\x04Loop"
    src = tmp_path / "alarm.onnx"
    onnx.save(m, src)
    assert wire.may_name_an_op(src.read_bytes(), NEEDS)
    assert wire.outline(src.read_bytes(), stop_at=NEEDS) is not None  # (the walk: no Loop node)
    code, out, d = _optimize(tmp_path, src)
    assert code == 0 and d["passes"] and out.read_bytes() == src.read_bytes()


def test_an_op_type_with_a_long_length_encoding_is_still_found_by_the_walk():
    # protobuf reads a length written in two bytes (0x84 0x00) as 4: the byte search misses it, the walk does not
    m = elementwise_model(5)
    m.graph.node[2].op_type = "Loop"  # (not a valid Loop: only its bytes matter here)
    data = m.SerializeToString()
    usual = bytes([0x22, 4]) + b"Loop"
    longer = bytes([0x22, 0x84, 0x00]) + b"Loop"
    assert data.count(usual) == 1
    # the node, the graph and the model grow by one byte each: rewrite their lengths by re-encoding the pieces
    node = m.graph.node[2].SerializeToString().replace(usual, longer)
    rest = onnx.ModelProto()
    rest.CopyFrom(m)
    del rest.graph.node[:]
    nodes = [n.SerializeToString() if k != 2 else node for k, n in enumerate(m.graph.node)]
    graph_rest = rest.graph.SerializeToString()
    graph = b"".join(bytes([0x0A]) + _varint(len(b)) + b for b in nodes) + graph_rest
    model_rest = rest.SerializeToString().replace(bytes([0x3A]) + _varint(len(graph_rest)) + graph_rest, b"")
    data = model_rest + bytes([0x3A]) + _varint(len(graph)) + graph
    assert onnx.load_from_string(data).graph.node[2].op_type == "Loop"  # (protobuf reads it)
    assert not wire.may_name_an_op(data, NEEDS)
    assert wire.outline(data, stop_at=NEEDS) is None


def _varint(v: int) -> bytes:
    return wire.varint(v)


@pytest.mark.parametrize("damage", ["truncated", "no-graph", "zero-ir", "garbage"])
def test_damaged_bytes_are_not_outlined(damage):
    data = elementwise_model().SerializeToString()
    m = onnx.load_from_string(data)
    if damage == "truncated":
        data = data[: len(data) - 7]
    elif damage == "no-graph":
        m.ClearField("graph")
        data = m.SerializeToString()
    elif damage == "zero-ir":
        m.ir_version = 0
        data = m.SerializeToString()
    else:
        data = bytes(range(256)) * 4
    with pytest.raises(wire.WireError):
        wire.outline(data)


def test_every_default_pass_says_what_it_needs():
    assert NEEDS is not None and {"Loop", "Scan", "MatMul", "Gemm", "LSTM", "GRU", "RNN"} <= NEEDS
    # a pass that does not say could fuse anything: no model is skipped then
    assert Pipeline([*Pipeline.default().passes, lambda model, ctx: False]).fusion_needs() is None


# -- the command line ------------------------------------------------------------------------------------------


def _optimize(tmp_path, src, *extra, full_path=False, monkeypatch=None, name="out"):
    out, js = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
    if full_path:
        monkeypatch.setattr(prescreen, "report_if_nothing_to_fuse", lambda path, needs: None)
    try:
        code = cli.main(["optimize", str(src), str(out), "-f", "-q", "--json", str(js), *extra])
    finally:
        if full_path:
            monkeypatch.undo()
    return code, out, (json.loads(js.read_text()) if js.exists() else None)


def test_nothing_to_fuse_is_copied_without_loading(tmp_path, monkeypatch):
    src = tmp_path / "elementwise.onnx"
    onnx.save(elementwise_model(400), src)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as mp:
        mp.setattr(model_io, "load", no_load)
        code, out, d = _optimize(tmp_path, src)
    assert code == 0 and out.read_bytes() == src.read_bytes()
    assert any("the file was read, not loaded" in n for n in d["notes"])
    assert any("byte-for-byte copy" in n for n in d["notes"])
    # the same report as the full run, but for the passes that did not run
    code2, out2, d2 = _optimize(tmp_path, src, full_path=True, monkeypatch=monkeypatch, name="full")
    assert code2 == 0 and out2.read_bytes() == src.read_bytes()
    for key in ("nodes_before", "nodes_after", "ops_before", "ops_after", "unsupported"):
        assert d[key] == d2[key], key
    assert d["nodes_before"] == 401 and not d["passes"] and d2["passes"]


def test_unsupported_model_is_reported_and_strict_refuses_it_as_before(tmp_path, monkeypatch):
    src = tmp_path / "old.onnx"
    onnx.save(elementwise_model(5, opset=6), src)
    for extra in ((), ("--strict",)):
        code, out, d = _optimize(tmp_path, src, *extra)
        code2, out2, d2 = _optimize(tmp_path, src, *extra, full_path=True, monkeypatch=monkeypatch, name="full")
        assert (code, d["unsupported"]) == (code2, d2["unsupported"]) and d["unsupported"].startswith("it uses opset 6")
        assert out.read_bytes() == out2.read_bytes() == src.read_bytes()
    assert code != 0  # --strict: not examined


@pytest.mark.parametrize("make", [lambda: nested_model("MatMul"), lambda: onnx.load(EXAMPLE)], ids=["nested", "example"])
def test_a_needed_op_takes_the_full_path(tmp_path, make):
    src = tmp_path / "m.onnx"
    onnx.save(make(), src)
    code, out, d = _optimize(tmp_path, src)
    assert code == 0 and d["passes"]
    assert not any("read, not loaded" in n for n in d["notes"])


def test_damaged_file_gives_the_load_error(tmp_path, capsys):
    src = tmp_path / "cut.onnx"
    data = elementwise_model(200).SerializeToString()
    src.write_bytes(data[: len(data) // 2])
    code = cli.main(["optimize", str(src), str(tmp_path / "o.onnx"), "-q"])
    err = capsys.readouterr().err
    assert code == 3 and "not a valid ONNX model" in err, err
    assert not (tmp_path / "o.onnx").exists()


def test_external_data_takes_the_full_path(tmp_path):
    m = elementwise_model(5)
    m.graph.initializer.append(numpy_helper.from_array(np.ones((64, 64), np.float32), "unused"))
    src = tmp_path / "ext.onnx"
    onnx.save(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data", size_threshold=0)
    code, out, d = _optimize(tmp_path, src)
    assert code == 0 and d["passes"]  # loaded: its tensors are checked and written beside the output
    assert (tmp_path / "out.onnx.data").exists() or any("tensors in" in n for n in d["notes"])
