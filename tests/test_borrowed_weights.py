"""A big single-file model lends its weights: they stay in the file while rnnfuse works (memory-mapped when
read, see rnnfuse.model_io and rnnfuse.wire) and are copied back inline when the output is written.

What the user gets must not change: the same output bytes as a run that loads the model whole, one file out
for one file in, a byte-for-byte copy when nothing is fused, the same errors for a damaged file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders as B
from helpers import op_counts

from rnnfuse import cli, model_io, wire


def _run(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RNNFUSE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "rnnfuse", *map(str, args)], capture_output=True, text=True, env=env)


def _ort(path_or_model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    data = str(path_or_model) if isinstance(path_or_model, (str, Path)) else path_or_model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


# a masked LSTM as a Scan, input 512, hidden 1024: 24 MB of per-gate weights (2 and 4 MiB each), over
# BORROW_MIN_FILE, so the command line borrows them without any setting
HEAVY = B.Opts(op="LSTM", front="scan", F=512, H=1024, mask="where")


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    d = tmp_path_factory.mktemp("heavy")
    m, feeds_fn = B.build(HEAVY)
    path = d / "heavy.onnx"
    onnx.save(m, str(path))
    assert path.stat().st_size >= model_io.BORROW_MIN_FILE
    feeds = feeds_fn(np.random.default_rng(1), 3, 5, "gappy")
    return path, feeds, _ort(path).run(None, feeds)


class _Spy:
    """Records what each in-process load borrowed."""

    def __init__(self, monkeypatch):
        self.borrowed: list[str | None] = []
        real = model_io.load

        def load(path, borrow=False):
            m, ext = real(path, borrow=borrow)
            self.borrowed.append(model_io.borrowed_from(m))
            return m, ext

        monkeypatch.setattr(model_io, "load", load)


def _optimize_in_process(*args) -> int:
    return cli.main(["optimize", *map(str, args), "-q"])


def _only_files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def test_round_trip_is_byte_identical(heavy, tmp_path):
    path, _, _ = heavy
    m, had_external = model_io.load(str(path), borrow=True)
    assert not had_external and model_io.borrowed_from(m) == str(path)
    lent = [t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert len(lent) == 8 and all(not t.HasField("raw_data") for t in lent)  # the 8 weight matrices; biases stay
    info = {e.key: e.value for e in lent[0].external_data}
    assert info["location"] == "heavy.onnx" and int(info["length"]) >= model_io.BORROW_MIN_TENSOR
    assert m.ByteSize() < 1 << 20
    out = tmp_path / "copy.onnx"
    assert model_io.save(m, str(out)) == [str(out)]
    assert out.read_bytes() == path.read_bytes()
    # the tensors are still borrowed after the save (it restores what it changed to write them)
    assert [t.name for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL] == [t.name for t in lent]


def test_weight_heavy_model_fuses_into_one_file(heavy, tmp_path):
    """Through the real command line: fused, validated, one file, accepted by the checker, same outputs."""
    path, feeds, ref = heavy
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    p = _run("optimize", path, out, "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    assert "1 fused" in p.stdout and "validation ok" in p.stdout, p.stdout
    assert _only_files(out.parent) == ["fused.onnx"]
    onnx.checker.check_model(str(out), full_check=True)
    fused = onnx.load(str(out))
    assert op_counts(fused)["LSTM"] == 1 and "Scan" not in op_counts(fused)
    assert not any(t.data_location == TensorProto.EXTERNAL for t in fused.graph.initializer)
    for a, b in zip(ref, _ort(out).run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    # a second run finds nothing to fuse and copies its input
    again = tmp_path / "again.onnx"
    p = _run("optimize", out, again)
    assert p.returncode == 0, p.stderr
    assert "byte-for-byte copy" in p.stdout, p.stdout
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.parametrize(
    "opts,lends",
    [(HEAVY, True), (B.Opts(op="GRU", front="chain", F=256, H=768, static_T=3, mask="where"), True),
     (B.Opts(op="RNN", front="loop", F=64, H=512, mask="where", weights="outer"), True),
     (B.Opts(op="GRU", front="scan", F=128, H=256, layers="bidir"), True),
     (B.Opts(op="RNN", front="loop", F=64, H=512, weights="body_init"), False)],
    ids=["scan-lstm", "chain-gru", "loop-rnn", "scan-bidir-gru", "loop-rnn-body-weights"],
)
def test_borrowing_changes_no_output_and_no_report(opts, lends, tmp_path, monkeypatch):
    """The same run with the weights borrowed (every tensor of 64 bytes or more) and loaded whole: the same
    output bytes and the same report. Weights that are a Loop body's initializers are not borrowed (only the
    main graph's are): that model is loaded whole."""
    m, _ = B.build(opts)
    src = tmp_path / "in.onnx"
    onnx.save(m, str(src))
    spy = _Spy(monkeypatch)
    outs = {}
    for name, min_file in (("whole", 1 << 62), ("borrowed", 0)):
        monkeypatch.setattr(model_io, "BORROW_MIN_FILE", min_file)
        monkeypatch.setattr(model_io, "BORROW_MIN_TENSOR", 64)
        d = tmp_path / name
        d.mkdir()
        assert _optimize_in_process(src, d / "out.onnx", "--json", d / "r.json") == 0
        assert _only_files(d) == ["out.onnx", "r.json"]
        outs[name] = d
    assert spy.borrowed[0] is None and spy.borrowed[1] == (str(src) if lends else None)
    assert (outs["whole"] / "out.onnx").read_bytes() == (outs["borrowed"] / "out.onnx").read_bytes()
    assert op_counts(onnx.load(str(outs["whole"] / "out.onnx")))[opts.op] == 1

    def report(d):
        r = json.loads((d / "r.json").read_text())
        r.pop("seconds", None)
        r["phases"] = sorted(r["phases"])  # (the phases run, not their seconds)
        for ps in r["passes"]:
            ps.pop("seconds", None)
        r.pop("output", None)
        return json.dumps(r, sort_keys=True).replace(str(d), "OUT")

    assert report(outs["whole"]) == report(outs["borrowed"])


def test_nothing_to_fuse_is_a_byte_copy(tmp_path):
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array(rng.standard_normal((1024, 1024)).astype(np.float32), f"w{i}") for i in range(5)]
    nodes, cur = [], "x"
    for i in range(5):
        nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        cur = f"r{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 1024])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["B", 1024])], w)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    src = tmp_path / "mlp.onnx"
    onnx.save(m, str(src))
    assert src.stat().st_size >= model_io.BORROW_MIN_FILE
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    p = _run("optimize", src, out)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == src.read_bytes() and _only_files(out.parent) == ["o.onnx"]


def test_in_place(heavy, tmp_path):
    """The output replaces the file the weights are borrowed from: they are read before it goes."""
    path, feeds, ref = heavy
    src = tmp_path / "m.onnx"
    shutil.copyfile(path, src)
    p = _run("optimize", src, src, "--in-place")
    assert p.returncode == 0, p.stderr
    assert _only_files(tmp_path) == ["m.onnx"]
    assert op_counts(onnx.load(str(src)))["LSTM"] == 1
    for a, b in zip(ref, _ort(src).run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_external_data_always(heavy, tmp_path):
    path, feeds, ref = heavy
    out = tmp_path / "fused.onnx"
    p = _run("optimize", path, out, "--external-data", "always")
    assert p.returncode == 0, p.stderr
    assert _only_files(tmp_path) == ["fused.onnx", "fused.onnx.data"]
    onnx.checker.check_model(str(out), full_check=True)
    for a, b in zip(ref, _ort(out).run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_prefer_faster(heavy, tmp_path):
    """--prefer-faster times the model with its weights still borrowed (either form may win: both are checked)."""
    path, feeds, ref = heavy
    out = tmp_path / "fused.onnx"
    p = _run("optimize", path, out, "--prefer-faster", "1", "--seq-len", "5", "--json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    # (the timing is a phase of its own in the report, between the passes and the guard)
    assert list(json.loads((tmp_path / "r.json").read_text())["phases"]) == ["load", "timing", "guard", "write"]
    (tmp_path / "r.json").unlink()
    assert _only_files(tmp_path) == ["fused.onnx"]
    onnx.checker.check_model(str(out), full_check=True)
    for a, b in zip(ref, _ort(out).run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_damaged_big_file_gives_the_same_errors(heavy, tmp_path, monkeypatch):
    """Cut anywhere (in a header, inside a borrowed tensor, just before the end) or with a byte changed, a
    file fails or passes exactly as it does when loaded whole."""
    path, _, _ = heavy
    data = path.read_bytes()
    m, _ = model_io.load(str(path), borrow=True)
    first = int(next(e.value for e in m.graph.initializer[0].external_data if e.key == "offset"))
    cuts = [len(data) // 2, first - 3, first + 100, len(data) - 1, 40]
    variants = {f"cut{c}": data[:c] for c in cuts}
    variants["bad-tag"] = data[:first - 4] + b"\xff" + data[first - 3:]
    variants["bad-wire-type"] = data[:first - 5] + b"\x0f" + data[first - 4:]
    results = {}
    for name, content in variants.items():
        src = tmp_path / f"{name}.onnx"
        src.write_bytes(content)
        for mode, min_file in (("whole", 1 << 62), ("borrowed", 0)):
            monkeypatch.setattr(model_io, "BORROW_MIN_FILE", min_file)
            try:
                model_io.load(str(src), borrow=True)
                results[name, mode] = "loaded"
            except model_io.InputError as e:
                results[name, mode] = e.message
        assert results[name, "borrowed"] == results[name, "whole"], name
    assert results[f"cut{len(data) // 2}", "borrowed"].endswith(")") and "not a valid ONNX model" in results[f"cut{len(data) // 2}", "borrowed"]
    # through the command line: one line, exit 3, nothing written
    src = tmp_path / f"cut{len(data) // 2}.onnx"
    out = tmp_path / "o.onnx"
    p = _run("optimize", src, out)
    assert p.returncode == 3, p.stderr
    assert p.stderr.startswith("rnnfuse: error:") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "not a valid ONNX model" in p.stderr and not out.exists()


def _tensor_model(t: onnx.TensorProto) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Identity", [t.name], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", t.data_type, None)], [t])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_what_the_wire_walk_does_not_lend(tmp_path, monkeypatch):
    """Tensors whose bytes are not plainly their values stay in the proto: bytes that do not fill the dims,
    strings; a tensor already stored as external data sends the model down the external-data path."""
    monkeypatch.setattr(model_io, "BORROW_MIN_FILE", 0)
    monkeypatch.setattr(model_io, "BORROW_MIN_TENSOR", 16)
    ok = numpy_helper.from_array(np.arange(64, dtype=np.float32), "ok")
    short = onnx.TensorProto()
    short.CopyFrom(ok)
    short.ClearField("dims")
    short.dims.extend([8])  # 256 bytes for 8 floats
    for t, lent in ((ok, True), (short, False)):
        src = tmp_path / f"{t.name}{lent}.onnx"
        src.write_bytes(_tensor_model(t).SerializeToString())
        m, _ = model_io.load(str(src), borrow=True)
        assert (model_io.borrowed_from(m) is not None) == lent
    ext = onnx.TensorProto()
    ext.CopyFrom(ok)
    ext.ClearField("raw_data")
    ext.data_location = TensorProto.EXTERNAL
    with pytest.raises(wire.WireError):
        wire.borrow_plan(_tensor_model(ext).SerializeToString(), "m.onnx", 0)
    with pytest.raises(wire.WireError):
        wire.borrow_plan(b"\x3a\x05abc", "m.onnx", 0)  # a graph field running past the end


def test_inline_save_of_nested_external_tensors(tmp_path, monkeypatch):
    """Tensors in external data anywhere (an initializer, a Constant's value, a Scan body's initializer) are
    written inline as ``onnx.save`` writes the model read whole, with every enclosing length right."""
    rng = np.random.default_rng(0)

    def big(n: int, name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), name)

    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "xt"], ["a"]), helper.make_node("Add", ["a", "bw"], ["s2"]),
         helper.make_node("Identity", ["s2"], ["o"])], "body",
        [vi("s", TensorProto.FLOAT, [4096]), vi("xt", TensorProto.FLOAT, [4096])],
        [vi("s2", TensorProto.FLOAT, [4096]), vi("o", TensorProto.FLOAT, [4096])], [big(4096, "bw")])
    nodes = [helper.make_node("Constant", [], ["c"], value=big(4096, "cv")),
             helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Add", ["a", "c"], ["s0"]),
             helper.make_node("Scan", ["s0", "xs"], ["sT", "ys"], body=body, num_scan_inputs=1)]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4096]), vi("xs", TensorProto.FLOAT, [2, 4096])],
                          [vi("sT", TensorProto.FLOAT, [4096])], [big(4096, "w"), big(3, "small")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    d = tmp_path / "ext"
    d.mkdir()
    onnx.save(m, str(d / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=1024, convert_attribute=True)
    monkeypatch.setattr(model_io, "_INLINE_ATTRIBUTE_BYTES", 0)  # (keep the Constant's value external)
    monkeypatch.setattr(model_io, "_ALWAYS_INLINE_BYTES", 0)
    loaded, had_external = model_io.load(str(d / "m.onnx"))
    assert had_external
    assert sum(t.data_location == TensorProto.EXTERNAL for t in _all(loaded)) == 3
    out = tmp_path / "one.onnx"
    model_io.save(loaded, str(out), external=False)
    whole = onnx.load(str(d / "m.onnx"))
    for t in _all(whole):
        t.ClearField("data_location")  # (onnx marks a tensor it read in as DEFAULT; ours never were anything else)
    assert out.read_bytes() == whole.SerializeToString()
    assert sum(t.data_location == TensorProto.EXTERNAL for t in _all(loaded)) == 3  # (restored)


def _all(m):
    from rnnfuse.protos import all_tensors

    return list(all_tensors(m))


def test_external_data_never_writes_one_file(tmp_path):
    """An input with external data can be written as one file (its tensors copied in while writing)."""
    m, feeds_fn = B.build(B.Opts(op="GRU", front="scan", F=16, H=64))
    feeds = feeds_fn(np.random.default_rng(0), 2, 4)
    ref = _ort(m).run(None, feeds)  # (onnx.save below moves m's tensors out)
    d = tmp_path / "in"
    d.mkdir()
    onnx.save(m, str(d / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=1024)
    out = tmp_path / "out.onnx"
    p = _run("optimize", d / "m.onnx", out, "--external-data", "never")
    assert p.returncode == 0, p.stderr
    assert _only_files(tmp_path) == ["in", "out.onnx"]
    for a, b in zip(ref, _ort(out).run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_wire_walk_on_damaged_bytes():
    """Cut or with bytes changed at random, a model is either refused by the walk (WireError: loaded whole
    then, with protobuf's own verdict) or lent exactly: whenever protobuf parses the bytes, the lent model
    with each borrowed tensor's bytes put back is the model protobuf parses."""
    import random

    m, _ = B.build(B.Opts(op="LSTM", front="scan", F=8, H=16, mask="where"))
    data = m.SerializeToString()
    rng = random.Random(0)
    outcomes = {"refused": 0, "lent": 0}
    for _ in range(3000):
        d = bytearray(data)
        if rng.random() < 0.3:
            d = d[: rng.randrange(len(d))]
        else:
            for _ in range(rng.randint(1, 3)):
                d[rng.randrange(len(d))] = rng.randrange(256)
        d = bytes(d)
        try:
            pieces, borrowed = wire.borrow_plan(d, "m.onnx", 16)
        except wire.WireError:
            outcomes["refused"] += 1
            continue
        outcomes["lent"] += 1
        try:
            whole = onnx.ModelProto.FromString(d)
        except Exception:
            continue
        lent = onnx.ModelProto.FromString(b"".join(pieces))
        for b in borrowed:
            t = lent.graph.initializer[b.index]
            assert t.data_location == TensorProto.EXTERNAL
            del t.external_data[:]
            t.ClearField("data_location")
            t.raw_data = d[b.offset : b.offset + b.length]
        assert lent == whole
    assert outcomes["refused"] > 100 and outcomes["lent"] > 100, outcomes
