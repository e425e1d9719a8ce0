"""``AssembleRowWrites``: a buffer written row by row with the steps of a native op's output (``outs[t] = h``
after fusion) becomes that output, and nothing else does.

Hand-built: a native GRU's Y squeezed to ``[T, B, H]``, a zero buffer sized from x, and one scatter per step
in the forms the torch exporters write (ScatterND at ``[[t]]``; ScatterElements with indices filled with t
along the time axis, batch-first too). Near misses keep their scatters and their outputs: a row left
unwritten, rows written from other steps, a row written from another tensor. The torch exports of the same
idiom are ``*_output_buffer`` in ``tests/exporters/torch_cases.py``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import op_counts, session

T, F, H = 5, 3, 4


def _i64(name, v):
    return numpy_helper.from_array(np.asarray(v, np.int64), name)


def buffer_model(kind="nd", rows=None, batch_first=False, other_row=None) -> onnx.ModelProto:
    """x [T, B, F] -> GRU -> Y [T, B, H]; buffer = zeros shaped like Y (``[B, T, H]`` batch-first) written at
    row ``r`` with ``Y[t]`` for each ``(r, t)`` of ``rows`` (default: every t at its own row); ``other_row``: that
    row is written with x's projection instead (another tensor)."""
    rng = np.random.default_rng(0)
    rows = rows if rows is not None else [(t, t) for t in range(T)]
    inits = [numpy_helper.from_array(rng.standard_normal((1, 3 * H, F)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((1, 3 * H, H)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.standard_normal((F, H)).astype(np.float32), "P"),
             _i64("ax1", [1]), _i64("ax0", [0]), _i64("i0", [0]), _i64("i1", [1]), _i64("i2", [2]), _i64("Hd", [H]),
             _i64("Td", [T])]
    nodes = [helper.make_node("GRU", ["x", "W", "R"], ["Y4"], hidden_size=H),
             helper.make_node("Squeeze", ["Y4", "ax1"], ["Y"]),
             helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Slice", ["xs", "i1", "i2"], ["Bd"]),
             helper.make_node("Concat", ["Bd", "Td", "Hd"] if batch_first else ["Td", "Bd", "Hd"], ["bshape"], axis=0),
             helper.make_node("ConstantOfShape", ["bshape"], ["buf0"])]
    axis = 1 if batch_first else 0
    buf = "buf0"
    for k, (r, t) in enumerate(rows):
        inits.append(_i64(f"t{k}", t))
        nodes.append(helper.make_node("Gather", ["Y", f"t{k}"], [f"h{k}"], axis=0))
        value = f"h{k}"
        if other_row == r:
            nodes += [helper.make_node("Gather", ["x", f"t{k}"], [f"xk{k}"], axis=0),
                      helper.make_node("MatMul", [f"xk{k}", "P"], [f"p{k}"])]
            value = f"p{k}"
        nodes.append(helper.make_node("Unsqueeze", [value, "ax1" if batch_first else "ax0"], [f"u{k}"]))
        out = f"buf{k + 1}"
        if kind == "nd":
            inits.append(_i64(f"ix{k}", [[r]]))
            nodes.append(helper.make_node("ScatterND", [buf, f"ix{k}", f"u{k}"], [out]))
        else:  # indices filled with r, shaped like the update
            inits.append(_i64(f"ix{k}", r))
            nodes += [helper.make_node("Shape", [f"u{k}"], [f"us{k}"]),
                      helper.make_node("Expand", [f"ix{k}", f"us{k}"], [f"ie{k}"]),
                      helper.make_node("ScatterElements", [buf, f"ie{k}", f"u{k}"], [out], axis=axis)]
        buf = out
    nodes.append(helper.make_node("Identity", [buf], ["outs"]))
    graph = helper.make_graph(nodes, "row_writes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])],
                              [helper.make_tensor_value_info("outs", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _outputs(model, batch):
    x = np.random.default_rng(batch).standard_normal((T, batch, F)).astype(np.float32)
    return session(model).run(None, {"x": x})


@pytest.mark.parametrize("kind,batch_first", [("nd", False), ("elements", False), ("elements", True)])
def test_buffer_written_with_every_step_is_y(kind, batch_first):
    model = buffer_model(kind, batch_first=batch_first)
    fused, report = rnnfuse.optimize(model)
    merged = [f for f in report.fused if f.front == "row writes"]
    assert len(merged) == 1 and merged[0].validation.startswith("ok"), report.to_text()
    counts = op_counts(fused)
    assert counts.get("ScatterND", 0) + counts.get("ScatterElements", 0) == 0, report.to_text()
    assert counts.get("Transpose", 0) == int(batch_first)
    for batch in (1, 3):
        for got, want in zip(_outputs(fused, batch), _outputs(model, batch)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows,other_row", [
    ([(t, t) for t in range(T - 1)], None),  # the last row keeps the buffer's zeros
    ([(T - 1 - t, t) for t in range(T)], None),  # rows written from the steps in reverse: Y flipped, not Y
    ([(t, t) for t in range(T)], 2),  # one row is another tensor's
], ids=["row_left_unwritten", "rows_from_other_steps", "row_from_another_tensor"])
def test_near_misses_keep_their_writes(rows, other_row):
    model = buffer_model("nd", rows=rows, other_row=other_row)
    fused, report = rnnfuse.optimize(model)
    assert not [f for f in report.fused if f.front == "row writes"], report.to_text()
    assert op_counts(fused)["ScatterND"] == len(rows)
    for got, want in zip(_outputs(fused, 3), _outputs(model, 3)):
        np.testing.assert_array_equal(got, want)
