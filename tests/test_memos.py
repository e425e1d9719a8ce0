"""Shortcuts the passes take to an answer: a Slice's bounds read from its inputs once (and kept, when constant), the file's declared types
from the op index, Dedupe's findings kept across merges. Each must give the answer the long way gives, and
follow an edit of what it read."""

from __future__ import annotations

import random

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rnnfuse import op_args
from rnnfuse.findings import Options
from rnnfuse.graph import Model
from rnnfuse.passes import dedupe as dedupe_module
from rnnfuse.passes.dedupe import Dedupe
from rnnfuse.tensor_types import declared_types


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64)))


def _model(nodes, inputs, outputs, opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def test_a_slices_bounds_read_from_its_inputs_once_are_those_slice_args_reads():
    """op_args.slice_args_of reads the node's inputs once; what it gives is what slice_args gives, defaults
    (axes and steps left out, or given as empty names) included, and it follows a rewired bound."""
    nodes = [_const("ax", [0]), _const("st", [1]), _const("s0", [0]), _const("e1", [1]), _const("e2", [2])]
    shapes = [["x", "s0", "e1"], ["x", "s0", "e2", "ax"], ["x", "s0", "e2", "", "st"], ["x", "s0", "e2", "ax", "st"],
              ["x", "s0", "h"]]
    nodes += [helper.make_node("Slice", ins, [f"y{k}"]) for k, ins in enumerate(shapes)]
    nodes.append(helper.make_node("Concat", [f"y{k}" for k in range(len(shapes))], ["y"], axis=0))
    model = Model(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2]),
                                 helper.make_tensor_value_info("h", TensorProto.INT64, [1])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]))
    g = model.graph
    slices = g.nodes_of("Slice")
    for n in slices:
        assert op_args.slice_args_of(g, n) == op_args.slice_args(n, model.opset, op_args.const_reader(g, n))
    assert [op_args.slice_args_of(g, n) for n in slices[:3]] == [
        ([0], [1], [0], [1]), ([0], [2], [0], [1]), ([0], [2], [0], [1])]
    assert op_args.slice_args_of(g, slices[4])[1] is None  # (a bound computed at run time: not known)
    g.replace_uses("e2", "e1")
    assert op_args.slice_args_of(g, slices[1]) == ([0], [1], [0], [1])
    # bounds all constant are kept by the Slice's inputs; each call's lists are the caller's own
    first = op_args.slice_args_of(g, slices[0])
    first[0].append(99)
    assert op_args.slice_args_of(g, slices[0]) == ([0], [1], [0], [1])
    assert tuple(slices[0].input) in g.slice_args_memo
    assert tuple(slices[4].input) not in g.slice_args_memo  # (a bound not known: never kept)


def _typed_model(foreign: bool = False) -> onnx.ModelProto:
    body = helper.make_graph(
        [_const("k", 2), helper.make_node("Add", ["c_in", "k"], ["c_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("c_in", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), helper.make_tensor_value_info("c_out", TensorProto.INT64, [])],
        value_info=[helper.make_tensor_value_info("k", TensorProto.INT64, [])])
    nodes = [_const("n", 3), _const("c0", 0), helper.make_node("Constant", [], ["t"], value_float=1.5),
             helper.make_node("Loop", ["n", "", "c0"], ["c"], body=body),
             helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)]
    if foreign:
        nodes.append(helper.make_node("Custom", ["y"], ["z"], domain="my.domain"))
    return _model(nodes, [], [helper.make_tensor_value_info("z" if foreign else "y", TensorProto.FLOAT, [])])


def test_declared_types_from_the_op_index_are_those_of_a_read_of_every_node():
    for foreign in (False, True):
        proto = _typed_model(foreign)
        model = Model(proto)
        g = model.graph
        assert declared_types(proto, g) == declared_types(proto)
        assert declared_types(proto)["n"] == (TensorProto.INT64, []) and "k" in declared_types(proto)
        # (a node of another domain may hold graphs the index does not list: the nodes are read instead)
        assert (g.nodes_as_loaded("Constant") is None) == foreign
    g = Model(_typed_model()).graph
    assert [n.output[0] for n in g.nodes_as_loaded("Constant", "Loop")] == ["n", "c0", "t", "c"]
    g.add_node("Identity", ["y"])
    assert g.nodes_as_loaded("Constant") is None  # (an edit since: the index no longer lists the file's nodes)


def _random_graph(seed: int) -> onnx.ModelProto:
    """Reads of x through Gathers at a few constant indices, elementwise ops on them, some values graph outputs
    as well as read: many duplicates, and merges that make more."""
    r = random.Random(seed)
    nodes = [_const(f"c{k}", r.randint(0, 1)) for k in range(3)]
    vals = ["x"]
    for i in range(r.randint(4, 30)):
        op = r.choice(["Relu", "Add", "Gather", "Gather", "Neg", "Mul", "Sub"])
        if op in ("Relu", "Neg"):
            nodes.append(helper.make_node(op, [r.choice(vals)], [f"v{i}"]))
        elif op in ("Add", "Mul", "Sub"):
            nodes.append(helper.make_node(op, [r.choice(vals), r.choice(vals)], [f"v{i}"]))
        else:
            nodes.append(helper.make_node("Gather", [r.choice(vals), f"c{r.randint(0, 2)}"], [f"v{i}"], axis=0))
        vals.append(f"v{i}")
    read = {i for n in nodes for i in n.input}
    ends = [v for v in vals[1:] if v not in read] or [vals[-1]]
    also = [v for v in vals[1:] if v not in ends and r.random() < 0.15]
    nodes.append(helper.make_node("Concat", ends, ["y"], axis=0))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2] * 12)],
                  [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ["y"] + also])


def _deduped(proto: onnx.ModelProto) -> tuple[list, list]:
    model = Model(proto)
    report = Dedupe().run(model, Options())
    return [(n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.live_nodes()], report.notes


def test_dedupe_forgets_only_what_a_merge_changed(monkeypatch):
    """A merge keeps what matching found about the nodes it did not touch: the same merges, the same nodes
    kept, as forgetting every finding at each merge gives; and fewer nodes put in the table again."""
    inserts = {"kept": 0, "all": 0}
    real_insert = dedupe_module._DedupeTable._insert

    def counting(which):
        def insert(self, n, ck):
            inserts[which] += 1
            return real_insert(self, n, ck)
        return insert

    real_forget = dedupe_module._DedupeTable.forget

    def forget_all(self, merged, rewired):
        real_forget(self, merged, rewired)
        self.found.clear()

    merged = 0
    for seed in range(4000):  # (a merge whose rewired reader's finding would stand wrongly: ~1 graph in 800)
        proto = _random_graph(seed)
        monkeypatch.setattr(dedupe_module._DedupeTable, "_insert", counting("kept"))
        kept = _deduped(onnx.ModelProto.FromString(proto.SerializeToString()))
        monkeypatch.setattr(dedupe_module._DedupeTable, "_insert", counting("all"))
        monkeypatch.setattr(dedupe_module._DedupeTable, "forget", forget_all)
        forgot = _deduped(proto)
        monkeypatch.setattr(dedupe_module._DedupeTable, "forget", real_forget)
        assert kept == forgot, seed
        merged += bool(kept[1])
    assert merged > 2000  # (the graphs do merge)
    assert inserts["kept"] < inserts["all"]


def test_declared_types_of_one_type_are_held_once_and_read_only():
    """A file declaring each value's type (torch's dynamo, jax2onnx) declares thousands of values of a few
    types: each type is held once, its dims shared and read-only, and the answers are the file's."""
    import copy

    from rnnfuse.tensor_types import SharedDims

    n = 200
    nodes, x = [], "x"
    for k in range(n):
        nodes.append(helper.make_node("Add" if k % 2 else "Mul", [x, f"w{k}"], [f"v{k}"]))
        x = f"v{k}"
    inits = [numpy_helper.from_array(np.full(16, 0.5, np.float32), f"w{k}") for k in range(n)]
    declared = [helper.make_tensor_value_info(f"v{k}", TensorProto.FLOAT, ["B", 16]) for k in range(n - 1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["B", 16])], inits, value_info=declared)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    types = declared_types(proto)
    assert all(types[f"v{k}"] == (TensorProto.FLOAT, ["B", 16]) for k in range(n))
    assert all(types[f"w{k}"] == (TensorProto.FLOAT, [16]) for k in range(n))
    assert len({id(types[f"v{k}"]) for k in range(n)} | {id(types["x"])}) == 1  # (x is declared alike)
    assert len({id(types[f"w{k}"]) for k in range(n)}) == 1
    dims = Model(proto).known_type("v7")[1]
    assert isinstance(dims, SharedDims)
    for change in (lambda d: d.append(1), lambda d: d.__setitem__(0, 2), lambda d: d.insert(0, 1), lambda d: d.sort()):
        try:
            change(dims)
        except TypeError:
            continue
        raise AssertionError("a shared declared type's dims were changed")
    assert types["v0"] == (TensorProto.FLOAT, ["B", 16])  # (unchanged for every value of that type)
    mine = copy.copy(dims)
    mine.append(1)  # (a copy is the caller's own)
    assert type(mine) is list and dims == ["B", 16] and dims[:1] == ["B"] and list(dims) + [3] == ["B", 16, 3]


def test_a_loop_bodys_values_computed_from_its_inputs_are_known_not_constant_without_a_fold(monkeypatch):
    """GraphIndex.const in a Loop body: a value computed from the body's inputs (the iteration number, a
    carried state) is no constant, known from one walk of the body (a 100,000-op head in a body was folded
    back node by node); values of constants alone, in the body or outside it, still fold."""
    from rnnfuse import fold, graph_index

    f = TensorProto.FLOAT
    n = 400
    body_nodes = [helper.make_node("Identity", ["cond"], ["cond_out"]),
                  helper.make_node("Cast", ["it"], ["itf"], to=f), helper.make_node("Add", ["h", "itf"], ["e0"])]
    body_nodes += [helper.make_node(("Tanh", "Sigmoid")[k % 2], [f"e{k}"], [f"e{k + 1}"]) for k in range(n)]
    body_nodes += [helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.float32(1.0).reshape(()))),
                   helper.make_node("Add", ["one", "outer"], ["two"]), helper.make_node("Mul", [f"e{n}", "two"], ["hn"])]
    body = helper.make_graph(body_nodes, "body", [helper.make_tensor_value_info("it", TensorProto.INT64, []),
                                                  helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                                                  helper.make_tensor_value_info("h", f, ["B", 2])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("hn", f, ["B", 2])])
    nodes = [_const("trip", 3), helper.make_node("Loop", ["trip", "", "h0"], ["hT"], body=body),
             helper.make_node("Constant", [], ["outer"], value=numpy_helper.from_array(np.float32(1.0).reshape(())))]
    model = Model(_model(nodes, [helper.make_tensor_value_info("h0", f, ["B", 2])],
                         [helper.make_tensor_value_info("hT", f, ["B", 2])]))
    g = model.graph
    bg = g.subgraph(g.nodes_of("Loop")[0])
    folds: list[str] = []
    fold_output = fold.fold_output
    monkeypatch.setattr(fold, "fold_output", lambda scope, node, name: folds.append(name) or fold_output(scope, node, name))
    assert bg.const(f"e{n}") is None and bg.const("hn") is None and bg.const("itf") is None
    assert folds == []  # (known from the walk: no fold started)
    assert float(bg.const("two")) == 2.0 and "two" in folds  # (constants in and around the body still fold)
    assert bg._runtime() >= {"it", "cond", "h", "cond_out", "itf", "e0", f"e{n}", "hn"} and "two" not in bg._runtime()
    assert graph_index.GraphIndex._runtime(g) is not bg._runtime()  # (each scope its own walk)
