"""A state carried as one stacked tensor (``st = torch.stack([h, c])``, read back as ``st[0]``): an item of a
Concat of tensors each unsqueezed on the Gather's axis, taken at a constant index, is that tensor, so the chain
under it is seen (hand-built; the torch exports are tests/exporters/torch_cases.py's ``*_stacked_state``).
Near misses (pieces not unsqueezed there, a Gather on another axis) are no such item: nothing is fused and the
model comes out as it went in."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import assert_same_on_x, op_counts

T, F, H = 5, 3, 4


def _chain(read: str = "item", index: int = 0) -> onnx.ModelProto:
    """A tanh RNN over x [T, B, F] whose state is carried stacked with its double, st = [h, 2h] on axis 0, the
    next step reading ``Gather(st, index)``; returns the stacked states and the last st. ``read``: "item", or
    "reshaped" (the pieces are Reshapes to [1, B, H], not Unsqueezes), "other_axis" (the Gather reads axis 1)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("W", (F, H)), ("R", (H, H)))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("axis0", [0]), ("index", index), ("view", [1, -1, H]), ("one", 1), ("stack2", [2]), ("hid", [H]))]
    inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "one"], ["b"]),
             helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
             helper.make_node("Concat", ["stack2", "b1", "hid"], ["st_shape"], axis=0),
             helper.make_node("ConstantOfShape", ["st_shape"], ["st_init"])]
    st, ys = "st_init", []
    for t in range(T):
        nodes += [helper.make_node("Gather", ["x", f"t{t}"], [f"x{t}"]),
                  helper.make_node("Gather", [st, "index"], [f"h_in{t}"], axis=1 if read == "other_axis" else 0),
                  helper.make_node("MatMul", [f"x{t}", "W"], [f"xw{t}"]), helper.make_node("MatMul", [f"h_in{t}", "R"], [f"hr{t}"]),
                  helper.make_node("Add", [f"xw{t}", f"hr{t}"], [f"pre{t}"]), helper.make_node("Tanh", [f"pre{t}"], [f"h{t}"]),
                  helper.make_node("Mul", [f"h{t}", "two"], [f"d{t}"])]
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"t{t}"))
        if read == "reshaped":
            nodes += [helper.make_node("Reshape", [f"h{t}", "view"], [f"u{t}"]), helper.make_node("Reshape", [f"d{t}", "view"], [f"v{t}"])]
        else:
            nodes += [helper.make_node("Unsqueeze", [f"h{t}", "axis0"], [f"u{t}"]), helper.make_node("Unsqueeze", [f"d{t}", "axis0"], [f"v{t}"])]
        nodes.append(helper.make_node("Concat", [f"u{t}", f"v{t}"], [f"st{t}"], axis=0))
        nodes.append(helper.make_node("Unsqueeze", [f"h{t}", "axis0"], [f"y{t}"]))
        st = f"st{t}"
        ys.append(f"y{t}")
    nodes.append(helper.make_node("Concat", ys, ["ys"], axis=0))
    graph = helper.make_graph(nodes, "stacked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])],
                              [helper.make_tensor_value_info("ys", TensorProto.FLOAT, [T, "B", H]),
                               helper.make_tensor_value_info(st, TensorProto.FLOAT, [2, "B", H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("index", [0, -2])
def test_a_state_read_back_from_its_stack_fuses(index):
    model = _chain(index=index)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused).get("RNN", 0) == 1 and not report.declined, report.to_text()
    assert_same_on_x(model, fused, F, sizes=((T, 1), (T, 3)))


@pytest.mark.parametrize("read", ["reshaped", "other_axis"])
def test_no_item_of_a_stack_is_read_through(read):
    """The pieces reshaped to [1, B, H] (not known here to be one row), or the Gather taking axis 1 of a
    Concat on axis 0: its value is no piece as it was, and nothing is fused."""
    model = _chain(read)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused).get("RNN", 0) == 0, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()
