"""``MergeConsecutiveSlices``: a Concat of consecutive slices of one tensor (each through the same layout ops:
Squeeze, Unsqueeze, Transpose) becomes one slice, and nothing else does. Each case runs the pass alone and compares the graph with
the original in onnxruntime, with the time axis both longer and shorter than the slices reach (clamping)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import session
from passes.concat_slices import MergeConsecutiveSlices
from rnnfuse.findings import Options
from rnnfuse.graph import Model


def _i64(name, v):
    return numpy_helper.from_array(np.asarray(v, np.int64), name)


def concat_of_slices(bounds, *, axis=0, cat_axis=None, layout=None, sources=None, steps=None, layouts=None,
                     read_twice=None):
    """y [T, 1, B, H] cut into ``bounds`` along ``axis``, each piece through ``layout`` (None, one layout op
    ("Squeeze", axes), ("Unsqueeze", axes), ("Transpose", perm), or a list of them applied in order; piece k
    through ``layouts[k]`` where given), concatenated along ``cat_axis``; slice ``read_twice`` also read by
    another node (a graph output)."""
    nodes, inits, pieces = [], [], []
    for k, (s, e) in enumerate(bounds):
        src = (sources or {}).get(k, "y")
        ins = [src, f"s{k}", f"e{k}", f"a{k}"] + ([f"st{k}"] if steps else [])
        inits += [_i64(f"s{k}", [s]), _i64(f"e{k}", [e]), _i64(f"a{k}", [axis])]
        if steps:
            inits.append(_i64(f"st{k}", [steps[k]]))
        nodes.append(helper.make_node("Slice", ins, [f"p{k}"]))
        out = f"p{k}"
        ops = (layouts or {}).get(k, layout)
        ops = [] if ops is None else [ops] if isinstance(ops[0], str) else ops
        for j, (op, arg) in enumerate(ops):
            if op == "Transpose":
                nodes.append(helper.make_node("Transpose", [out], [f"l{k}_{j}"], perm=arg))
            else:  # (a copy of the axes per piece, as exporters write it)
                inits.append(_i64(f"q{k}_{j}", arg))
                nodes.append(helper.make_node(op, [out, f"q{k}_{j}"], [f"l{k}_{j}"]))
            out = f"l{k}_{j}"
        pieces.append(out)
    nodes.append(helper.make_node("Concat", pieces, ["out"], axis=axis if cat_axis is None else cat_axis))
    outputs = ["out"]
    if read_twice is not None:
        nodes.append(helper.make_node("Shape", [f"p{read_twice}"], ["other"]))
        outputs.append("other")
    inputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 1, "B", 3]),
              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["T", 1, "B", 3])]
    graph = helper.make_graph(nodes, "cat", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT if o == "out"
                                                     else TensorProto.INT64, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def _merged(model):
    m = Model(model)
    res = MergeConsecutiveSlices().run(m, Options())
    m.graph.finalize()
    return res.modified, m.proto


def _same(a, b):
    rng = np.random.default_rng(0)
    for T in (6, 3):  # longer and shorter than the slices reach
        feeds = {n: rng.standard_normal((T, 1, 2, 3)).astype(np.float32) for n in ("y", "z")}
        np.testing.assert_array_equal(session(b).run(None, feeds)[0], session(a).run(None, feeds)[0])


STEPS = [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("kw", [
    dict(bounds=STEPS),
    dict(bounds=[(1, 3), (3, 4), (4, 6)]),
    dict(bounds=STEPS, layout=("Squeeze", [1]), cat_axis=0),  # torch.cat of squeezed per-step outputs
    dict(bounds=STEPS, axis=2, layout=("Squeeze", [1]), cat_axis=1),
    dict(bounds=STEPS, layout=("Transpose", [2, 0, 1, 3]), cat_axis=1),  # batch-first pieces
    # torch's per-step output of a merged chain: Y[t:t+1] squeezed, then made batch-first
    dict(bounds=STEPS, layout=[("Squeeze", [1]), ("Transpose", [1, 0, 2])], cat_axis=1),
    dict(bounds=STEPS, layout=[("Squeeze", [1]), ("Unsqueeze", [0])], cat_axis=1),
    dict(bounds=STEPS, layout=[("Unsqueeze", [-1]), ("Squeeze", [-1])], cat_axis=0),
    # torch's trace reads the batch size off the first step's x[0:1]: that slice stays for its other reader
    dict(bounds=STEPS, read_twice=0),
], ids=["steps", "stretches", "squeezed", "squeezed_axis2", "transposed", "squeezed_transposed", "unsqueezed",
        "negative_axes", "read_twice"])
def test_consecutive_slices_become_one(kw):
    model = concat_of_slices(**kw)
    modified, out = _merged(model)
    assert modified
    assert [n.op_type for n in out.graph.node].count("Slice") == 1 + (kw.get("read_twice") is not None)
    assert "Concat" not in [n.op_type for n in out.graph.node]
    _same(model, out)


@pytest.mark.parametrize("kw", [
    dict(bounds=[(0, 1), (2, 3)]),  # a gap
    dict(bounds=[(0, 2), (1, 3)]),  # overlapping
    dict(bounds=[(1, 2), (0, 1)]),  # out of order
    dict(bounds=STEPS, sources={2: "z"}),  # one piece of another tensor
    dict(bounds=STEPS[:3], cat_axis=2),  # cut along time, put together along batch
    dict(bounds=STEPS[:3], layout=("Squeeze", [0]), cat_axis=0),  # the squeeze drops the sliced axis itself
    dict(bounds=STEPS, steps=[1, 1, 2, 1]),  # a step of 2
    # layout ops that take time to another axis than the one put together; one piece's ops differ
    dict(bounds=STEPS[:3], layout=[("Squeeze", [1]), ("Transpose", [1, 0, 2])], cat_axis=0),
    dict(bounds=STEPS, layout=[("Squeeze", [1]), ("Unsqueeze", [0])], cat_axis=1,
         layouts={2: [("Squeeze", [1]), ("Unsqueeze", [1])]}),
], ids=["gap", "overlap", "order", "other_source", "other_axis", "squeezed_away", "strided", "time_moved_elsewhere",
        "other_layout"])
def test_near_misses_are_left(kw):
    model = concat_of_slices(**kw)
    modified, out = _merged(model)
    assert not modified
    _same(model, out)


def concat_of_split_parts(sizes, order, *, layout=None, cat_axis=0, runtime_sizes=False, read_twice=None):
    """y [T, 1, B, 3] (T = the sum of ``sizes``) cut by one Split along time, the parts ``order`` names each
    through ``layout`` (as in :func:`concat_of_slices`), concatenated along ``cat_axis``; ``read_twice``: a
    part also read by another node."""
    parts = [f"part{k}" for k in range(len(sizes))]
    nodes = [helper.make_node("Split", ["y", "sizes"], parts, axis=0)]
    inits = [] if runtime_sizes else [_i64("sizes", sizes)]
    pieces = []
    for k in order:
        out = parts[k]
        if layout is not None:
            inits.append(_i64(f"q{k}", layout[1]))
            nodes.append(helper.make_node(layout[0], [out, f"q{k}"], [f"l{k}"]))
            out = f"l{k}"
        pieces.append(out)
    nodes.append(helper.make_node("Concat", pieces, ["out"], axis=cat_axis))
    if read_twice is not None:
        nodes.append(helper.make_node("Relu", [parts[read_twice]], ["other"]))
    T = sum(sizes)
    inputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, 1, "B", 3])]
    if runtime_sizes:
        inputs.append(helper.make_tensor_value_info("sizes", TensorProto.INT64, [len(sizes)]))
    outputs = ["out"] + (["other"] if read_twice is not None else [])
    graph = helper.make_graph(nodes, "cat", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                     for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model), T


def _same_split(a, b, T, sizes):
    rng = np.random.default_rng(0)
    for batch in (1, 2):
        feeds = {"y": rng.standard_normal((T, 1, batch, 3)).astype(np.float32)}
        if any(i.name == "sizes" for i in a.graph.input):
            feeds["sizes"] = np.asarray(sizes, np.int64)
        for x, y in zip(session(a).run(None, feeds), session(b).run(None, feeds)):
            np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("sizes, order, kw", [
    ([1, 1, 1, 1], [0, 1, 2, 3], {}),  # every part: the whole sequence
    ([1, 2, 3], [0, 1, 2], {}),  # stretches of different lengths
    ([1, 1, 1, 1], [1, 2], {}),  # a run of parts in the middle
    ([1, 1, 1, 1], [0, 1, 2, 3], dict(layout=("Squeeze", [1]))),  # squeezed per-step parts (a merged chain's Y)
    ([1, 1, 1], [0, 1, 2], dict(read_twice=1)),  # a part read elsewhere too: it stays for that reader
], ids=["all", "stretches", "middle", "squeezed", "read_twice"])
def test_consecutive_parts_of_a_split_become_one_slice(sizes, order, kw):
    """step_chains cuts a merged op's Y into each op's rows with one Split: the parts put together again
    are a Slice of Y, like consecutive slices."""
    model, T = concat_of_split_parts(sizes, order, **kw)
    modified, out = _merged(model)
    assert modified
    assert "Concat" not in [n.op_type for n in out.graph.node]
    assert [n.op_type for n in out.graph.node].count("Slice") == 1
    _same_split(model, out, T, sizes)


@pytest.mark.parametrize("sizes, order, kw", [
    ([1, 1, 1], [1, 0], {}),  # out of order
    ([1, 1, 1], [0, 2], {}),  # a gap
    ([1, 1, 1], [0, 1, 2], dict(runtime_sizes=True)),  # sizes known only at run time
    ([1, 1, 1], [0, 1, 2], dict(layout=("Squeeze", [1]), cat_axis=1)),  # put together along batch
], ids=["order", "gap", "runtime_sizes", "other_axis"])
def test_parts_of_a_split_near_misses_are_left(sizes, order, kw):
    model, T = concat_of_split_parts(sizes, order, **kw)
    modified, out = _merged(model)
    assert not modified
    _same_split(model, out, T, sizes)
