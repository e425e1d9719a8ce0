"""Which picks of a step's row tensor ``x_t [B, F]`` act row by row (``rnnfuse.row_wise.check_row_wise``): the
test every per-step map and every mask computed from x_t goes through before it is run once over the whole
sequence. A column picked by constant indices, and a slice that takes the rows whole (TorchScript writes
``x_t[:, 0]`` as ``x_t[0:INT_MAX, :]`` and then a Gather), are row-wise; a pick by a runtime index, one along
the rows, or a slice that cuts rows is not, and must be declined."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from rnnfuse.errors import Decline
from rnnfuse.graph import Model
from rnnfuse.row_wise import ROW_RANK, check_row_wise

INT_MAX = 2**63 - 1


def _graph(node, consts: dict):
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    g = helper.make_graph([node], "picks", [helper.make_tensor_value_info("xt", TensorProto.FLOAT, ["B", 5]),
                                            helper.make_tensor_value_info("k", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)], inits)
    return Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])).graph


def _rank(node, consts: dict) -> int:
    g = _graph(node, consts)
    return check_row_wise(g, node, {"xt": ROW_RANK}, g.const, "a mask", reductions=True)


@pytest.mark.parametrize("index, rank", [(np.array(0, np.int64), 1), (np.array(-1, np.int64), 1),
                                         (np.array([0, 2], np.int64), ROW_RANK)])
def test_columns_picked_by_constants_are_row_wise(index, rank):
    for axis in (1, -1):
        node = helper.make_node("Gather", ["xt", "i"], ["y"], axis=axis)
        assert _rank(node, {"i": index}) == rank


def test_rows_taken_whole_then_columns_cut_is_row_wise():
    node = helper.make_node("Slice", ["xt", "s", "e", "a"], ["y"])
    assert _rank(node, {"s": np.array([0, 1], np.int64), "e": np.array([INT_MAX, 3], np.int64),
                        "a": np.array([0, 1], np.int64)}) == ROW_RANK


@pytest.mark.parametrize("case", ["runtime_column", "gather_rows", "slice_cuts_rows", "slice_rows_step_2"])
def test_picks_that_are_not_row_wise_are_declined(case):
    if case == "runtime_column":  # (which feature decides is known only at run time)
        node, consts = helper.make_node("Gather", ["xt", "k"], ["y"], axis=1), {}
    elif case == "gather_rows":  # (row 0 for every row: mixes batch rows)
        node, consts = helper.make_node("Gather", ["xt", "i"], ["y"], axis=0), {"i": np.array(0, np.int64)}
    else:
        node = helper.make_node("Slice", ["xt", "s", "e", "a", "st"], ["y"])
        end, step = (1, 1) if case == "slice_cuts_rows" else (INT_MAX, 2)
        consts = {"s": np.array([0], np.int64), "e": np.array([end], np.int64), "a": np.array([0], np.int64),
                  "st": np.array([step], np.int64)}
    with pytest.raises(Decline):
        _rank(node, consts)
