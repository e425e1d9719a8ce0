"""Loops carrying a list of states (passes/loop_lists.py): TorchScript's ``hs[k] = cell_k(u, hs[k])`` over a
list built before the loop. Carried item by item, the cells stacked in the step fuse; a list whose items move,
grow, or are read at a position that is no constant is left as it was. (The exporter's own forms are in
tests/exporters/torch_cases.py, ``*_state_list*``.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_same_on_x, op_counts

import rnnfuse

F, H = 3, 4


def build(form: str = "set", read_at: int = -1, erase_at: int = 1, insert_at: int | None = 1, act: str = "Tanh",
          then: str = "") -> onnx.ModelProto:
    """x [T, B, F]; a list [h_a, h_b] of zeros built by SequenceConstruct and carried; each step reads
    ``hs[read_at]`` as the state of one tanh cell and sets the new state with ``SequenceErase(hs, erase_at)``
    + ``SequenceInsert(., new, insert_at)`` (None: at the back); the step's new state is stacked; the final
    list is read at -1 after the loop. ``form``: "set", or near misses "position_read" (the item read at
    the iteration number), "length" (SequenceLength of the list is read: the constant 2). ``act``: the cell's
    activation; ``then``: a second Loop of the same body over x, with that activation, starting from the
    first's final list."""
    rng = np.random.default_rng(3)
    W, R, b = (rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((F, H), (H, H), (H,)))
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"), numpy_helper.from_array(np.array([1], np.int64), "i1"),
             numpy_helper.from_array(np.array([H], np.int64), "iH"), numpy_helper.from_array(np.array(-1, np.int64), "last")]
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["T1"], axis=0),
             helper.make_node("Squeeze", ["T1", "i0"], ["T"]), helper.make_node("Gather", ["xs", "i1"], ["B1"], axis=0),
             helper.make_node("Concat", ["B1", "iH"], ["hshape"], axis=0),
             helper.make_node("Expand", ["zero", "hshape"], ["h0a"]), helper.make_node("Expand", ["zero", "hshape"], ["h0b"]),
             helper.make_node("SequenceConstruct", ["h0a", "h0b"], ["hs0"])]
    body_inits = [numpy_helper.from_array(np.array(read_at, np.int64), "read_at"),
                  numpy_helper.from_array(np.array(erase_at, np.int64), "erase_at")]
    read_pos = "it" if form == "position_read" else "read_at"
    bn = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0),
          helper.make_node("SequenceAt", ["hs", read_pos], ["h"]),
          helper.make_node("MatMul", ["xt", "W"], ["xw"]), helper.make_node("MatMul", ["h", "R"], ["hr"]),
          helper.make_node("Add", ["xw", "hr"], ["s"]), helper.make_node("Add", ["s", "b"], ["z"]),
          helper.make_node(act, ["z"], ["hn"]),
          helper.make_node("SequenceErase", ["hs", "erase_at"], ["hs_e"])]
    if insert_at is None:
        bn.append(helper.make_node("SequenceInsert", ["hs_e", "hn"], ["hs_n"]))
    else:
        body_inits.append(numpy_helper.from_array(np.array(insert_at, np.int64), "insert_at"))
        bn.append(helper.make_node("SequenceInsert", ["hs_e", "hn", "insert_at"], ["hs_n"]))
    if form == "set_back_twice":  # (the erased list read by a second insert: one list becomes two)
        bn += [helper.make_node("SequenceInsert", ["hs_e", "hn"], ["hs_n2"]),
               helper.make_node("SequenceAt", ["hs_n2", "read_at"], ["h_2"])]
    if form == "length":  # (its length, 2, added to the step's output: a constant)
        bn += [helper.make_node("SequenceLength", ["hs"], ["n"]), helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
               helper.make_node("Add", ["hn", "nf"], ["y"])]
    else:
        bn.append(helper.make_node("Identity", ["hn" if form != "set_back_twice" else "h_2"], ["y"]))
    bn.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, ["B", H]))
    body = helper.make_graph(
        bn, "body",
        [helper.make_tensor_value_info("it", TensorProto.INT64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_value_info("hs", seq)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_value_info("hs_n", seq),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", H])], body_inits)
    nodes += [helper.make_node("Loop", ["T", "true", "hs0"], ["hsT", "ys"], body=body, name="the_loop"),
              helper.make_node("SequenceAt", ["hsT", "last"], ["h_last"])]
    outputs = [helper.make_tensor_value_info("ys", TensorProto.FLOAT, ["T", "B", H]),
               helper.make_tensor_value_info("h_last", TensorProto.FLOAT, ["B", H])]
    if then:
        body2 = onnx.GraphProto()
        body2.CopyFrom(body)
        next(n for n in body2.node if n.op_type == act).op_type = then
        nodes.append(helper.make_node("Loop", ["T", "true", "hsT"], ["hsT2", "ys2"], body=body2, name="then_loop"))
        outputs.append(helper.make_tensor_value_info("ys2", TensorProto.FLOAT, ["T", "B", H]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _compare(original: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    assert_same_on_x(original, fused, F, sizes=((1, 1), (5, 3), (8, 2)), seed=0)


@pytest.mark.parametrize("kw", [dict(), dict(read_at=1), dict(erase_at=-1, insert_at=None), dict(form="length")],
                         ids=["read_last", "read_1", "erase_last_append", "length"])
def test_a_list_of_states_set_at_one_position_fuses(kw):
    """The state read at -1 (or 1) and set at 1 (erased at -1, inserted at the back): one RNN, the final list
    rebuilt for the read after the loop, which reads the RNN's last state."""
    model = build(**kw)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1, report.to_text()
    counts = op_counts(fused)
    assert counts.get("Loop", 0) == 0 and counts.get("RNN") == 1, counts
    assert not {"SequenceInsert", "SequenceErase", "SequenceConstruct", "SequenceAt"} & set(counts), counts
    _compare(model, fused)


@pytest.mark.parametrize("kw", [dict(read_at=0), dict(insert_at=0), dict(erase_at=-1, insert_at=-1),
                                dict(form="position_read"), dict(form="set_back_twice")],
                         ids=["reads_the_other_item", "items_move", "inserted_before_the_last", "read_at_the_step",
                              "set_back_twice"])
def test_a_list_whose_items_do_not_stay_put_is_left(kw):
    """Near misses: the state read is another item than the one set (the cell reads the zeros of h_a: no
    recurrence), an item inserted elsewhere than erased (the items move each step; -1 inserts before the
    last), an item read at the iteration number, an erased list two inserts read (two lists of one): declined,
    the model as it was."""
    model = build(**kw)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()
    if kw.get("form") == "set_back_twice":  # (refused before unpacking: no body reading a name it dropped)
        assert "item by item" not in report.to_text(), report.to_text()


def test_a_loop_over_the_final_list_of_one_left_unfused_reads_its_items():
    """Two Loops, the second starting from the first's final list: both are carried item by item, and the
    second reads the first's final items. The first is then declined as it is applied (Softsign is no
    portable activation): it stays carried item by item, so the second, fused, still reads its items (it was
    put back as it was, leaving them dangling, and every rewrite was undone)."""
    model = build(act="Softsign", then="Tanh")
    fused, report = rnnfuse.optimize(model, portable=True)
    assert [f.where for f in report.fused] == ["then_loop"] and report.declined, report.to_text()
    assert op_counts(fused).get("Loop") == 1 and op_counts(fused).get("RNN") == 1, op_counts(fused)
    _compare(model, fused)
