"""The optimizer's work grows linearly with the graph: counted, never timed (benchmarks/scaling.py times it).

What is counted: the nodes each Dedupe run looks at (none on a graph with nothing to merge, only the edits'
nodes after a fusion), the dead-node searches and sorts a pipeline makes (and that a graph with nothing dead
costs no liveness walk), and that these counts do not grow faster than the graph.
"""

from __future__ import annotations

import cProfile
import pstats

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders as B
from rnnfuse.graph import Graph, Model
from rnnfuse.pipeline import Options, Pipeline
from rnnfuse.passes.dedupe import Dedupe


def elementwise_chain(n: int, width: int = 4) -> onnx.ModelProto:
    """Add w / Mul w / Tanh / Sigmoid, repeated: nothing to fuse, nothing to merge (as benchmarks/scaling.py)."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(n):
        op = ("Add", "Mul", "Tanh", "Sigmoid")[i % 4]
        out = "y" if i == n - 1 else f"v{i}"
        ins = [cur]
        if op in ("Add", "Mul"):
            inits.append(numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"w{i}"))
            ins.append(f"w{i}")
        nodes.append(helper.make_node(op, ins, [out], name=f"{op}_{i}"))
        cur = out
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", width])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


class _Counted:
    """Counts Graph._dead_nodes calls (dead-code searches) and Graph.toposort calls and the nodes sorted."""

    def __init__(self, monkeypatch):
        self.live = self.sorts = self.sorted_nodes = 0
        live, sort = Graph._dead_nodes, Graph.toposort

        def counted_live(g):
            self.live += 1
            return live(g)

        def counted_sort(g, nodes):
            self.sorts += 1
            self.sorted_nodes += len(nodes)
            return sort(g, nodes)

        monkeypatch.setattr(Graph, "_dead_nodes", counted_live)
        monkeypatch.setattr(Graph, "toposort", counted_sort)


def _run(model: onnx.ModelProto):
    passes = Pipeline.default().passes
    m = Model(model)
    report = Pipeline(passes).run(m, Options())
    dedupes = [p for p in passes if isinstance(p, Dedupe)]
    return m, report, dedupes


@pytest.mark.parametrize("n", [200, 800])
def test_nothing_to_merge_costs_dedupe_no_visit(n, monkeypatch):
    counted = _Counted(monkeypatch)
    m, report, dedupes = _run(elementwise_chain(n))
    assert not report.modified
    assert len(dedupes) >= 2
    # a plain chain: no value has two readers, so no node has a possible duplicate; later runs: no edits
    assert [d.visited for d in dedupes] == [0] * len(dedupes)
    assert [d.full_keys for d in dedupes] == [0] * len(dedupes)
    # no liveness walk (no step families: the chain pass does not prune; nothing changed: no finalize) and
    # no sort (the input is in order and no edit disturbed it)
    assert counted.live == 0
    assert counted.sorts == 0
    assert len(m.proto.graph.node) == n


def _dup_graph() -> onnx.ModelProto:
    """x -> Shape twice, Add(x, c1) and Add(x, c2) with c1 == c2 by value, Relu of each Add (equal once the Adds
    are merged), Add(x, c3) with a different c3 (kept), all read by a Concat."""
    c = np.ones(4, np.float32)
    inits = [numpy_helper.from_array(c, "c1"), numpy_helper.from_array(c.copy(), "c2"),
             numpy_helper.from_array(c * 2, "c3")]
    nodes = [
        helper.make_node("Add", ["x", "c1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Add", ["x", "c2"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("Add", ["x", "c3"], ["a3"]),
        helper.make_node("Relu", ["a3"], ["r3"]),
        helper.make_node("Concat", ["r1", "r2", "r3"], ["y"], axis=0),
    ]
    g = helper.make_graph(nodes, "dups", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [12])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_dedupe_merges_by_value_and_cascades():
    m = Model(_dup_graph())
    d = Dedupe()
    r = d.run(m, Options())
    assert r.modified and "merged 2 duplicate nodes" in r.notes[0]  # Add(x, c2) by value, then its Relu
    g = m.graph
    concat = next(n for n in g.live_nodes() if n.op_type == "Concat")
    assert list(concat.input) == ["r1", "r1", "r3"]
    # the first in graph order is the one kept
    assert {n.output[0] for n in g.live_nodes()} == {"a1", "r1", "a3", "r3", "y"}


def _many_readers(cells: int) -> onnx.ModelProto:
    """x read by ``cells`` MatMuls through weights of their own (cells side by side) and by one more MatMul
    through the first weight (a duplicate); ``cells`` Gathers of x's shape at index 0, each index a Constant
    of its own (a trace's per-use constants), and one at index 1."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((9, 8)).astype(np.float32), f"w{i}") for i in range(cells)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(cells)]
    nodes += [helper.make_node("MatMul", ["x", "w0"], ["dup"]), helper.make_node("Shape", ["x"], ["s"])]
    for i in range(cells + 1):
        nodes += [helper.make_node("Constant", [], [f"i{i}"], value=numpy_helper.from_array(np.array(int(i == cells)))),
                  helper.make_node("Gather", ["s", f"i{i}"], [f"d{i}"])]
    outs = [f"y{i}" for i in range(cells)] + ["dup"]
    nodes.append(helper.make_node("Concat", [f"d{i}" for i in range(cells + 1)], ["dims"], axis=0))
    g = helper.make_graph(nodes, "readers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 9])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["B", 8]) for o in outs]
                          + [helper.make_tensor_value_info("dims", TensorProto.INT64, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("cells", [8, 64])
def test_dedupe_keys_weights_by_name_and_each_node_once(cells):
    """A big weight's full-key form is its name, so the coarse key holds it by name: the MatMuls of cells side
    by side share no coarse key (none is looked at or gets a full key) but the duplicate pair; the Gathers, whose Constant
    indices are small and compared by value, get one full key each, however many matches look at the node
    kept, and equal Constants are read once."""
    m = Model(_many_readers(cells))
    d = Dedupe()
    r = d.run(m, Options())
    g = m.graph
    assert r.modified and f"merged {cells} duplicate nodes" in r.notes[0]  # the MatMul and the index-0 Gathers
    assert len([n for n in g.live_nodes() if n.op_type == "MatMul"]) == cells
    gathers = [n for n in g.live_nodes() if n.op_type == "Gather"]
    assert sorted(n.output[0] for n in gathers) == ["d0", f"d{cells}"]
    assert d.full_keys == 2 + (cells + 1)
    # looked at: the two MatMuls of one coarse key and the index-0 Gathers (the other MatMuls, alone under
    # their coarse keys among x's readers, and the index-1 Gather, alone with its index among the Gathers of
    # one coarse key, can have no duplicate), then the Concat the merges rewired and the Identity that keeps
    # the merged MatMul's output name
    assert d.visited == 2 + cells + 2


def _per_step_reads(steps: int, twice: int | None) -> onnx.ModelProto:
    """A trace's per-step reads of x: ``x[t]`` for each step, each a Gather at a Constant index of its own,
    summed; with ``twice``, that step is read a second time (a backward cell's ``x[T-1-t']``), through a
    Constant of the same value."""
    nodes, outs = [], []
    reads = list(range(steps)) + ([twice] if twice is not None else [])
    for k, t in enumerate(reads):
        nodes += [helper.make_node("Constant", [], [f"i{k}"], value=numpy_helper.from_array(np.array(t, np.int64))),
                  helper.make_node("Gather", ["x", f"i{k}"], [f"x{k}"], axis=0)]
        outs.append(f"x{k}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    g = helper.make_graph(nodes, "reads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, "B", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_dedupe_looks_only_at_reads_whose_constants_are_another_reads_too():
    """Thousands of ``x[t]`` under one coarse key (the index a constant) are each alone with its index: none
    is looked at, none gets a full key. A step read twice is still merged (its copy and it are looked at)."""
    m = Model(_per_step_reads(300, None))
    d = Dedupe()
    r = d.run(m, Options())
    assert not r.modified and d.visited == 0 and d.full_keys == 0
    m = Model(_per_step_reads(300, 7))
    d = Dedupe()
    r = d.run(m, Options())
    assert r.modified and "merged 1 duplicate nodes" in r.notes[0]
    assert len([n for n in m.graph.live_nodes() if n.op_type == "Gather"]) == 300
    assert m.graph.producer["y"].input[-1] == "x7"  # (x300, the second read of step 7, merged into x7)
    assert d.visited == 2 + 1  # the pair, then the Sum the merge rewired


def _twins_after_a_merge(read_elsewhere: bool) -> onnx.ModelProto:
    """``a`` and ``b`` equal (Relu of x), ``x[0]`` read from each: ``n2 = b[0]`` comes first, ``n1 = a[0]``
    after it; with ``read_elsewhere`` also ``n3 = a[1]``. Once b is merged into a, n2 and n1 are one value."""
    const = [helper.make_node("Constant", [], [f"c{v}"], value=numpy_helper.from_array(np.array(v, np.int64))) for v in (0, 1)]
    nodes = const + [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["x"], ["b"]),
                     helper.make_node("Gather", ["b", "c0"], ["n2"]), helper.make_node("Gather", ["a", "c0"], ["n1"])]
    outs = ["n1", "n2"] + (["n3"] if read_elsewhere else [])
    if read_elsewhere:
        nodes.append(helper.make_node("Gather", ["a", "c1"], ["n3"]))
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=0))
    g = helper.make_graph(nodes, "twins", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("read_elsewhere", [True, False])
def test_dedupe_merges_the_twins_a_merge_makes(read_elsewhere):
    """Merging b into a rewires n2 to read a: its twin n1, in no list the run walks (not a candidate, not
    edited), is found while n2 is matched and merged in the same run, the first in graph order kept; a second
    run finds nothing left (before, n1 stayed: always without n3, and with n3 once candidates were filtered
    by their constants' values)."""
    m = Model(_twins_after_a_merge(read_elsewhere))
    r = Dedupe().run(m, Options())
    assert r.modified and "merged 2 duplicate nodes" in r.notes[0]
    gathers = [n for n in m.graph.live_nodes() if n.op_type == "Gather"]
    assert [(n.output[0], n.input[0]) for n in gathers if n.input[1] == "c0"] == [("n2", "a")]
    m.graph.finalize()
    again = Dedupe()
    assert not again.run(Model(m.proto), Options()).modified


@pytest.mark.parametrize("padding", [10, 3000])
def test_dedupe_folds_shape_arithmetic_without_visiting_runtime_nodes(padding, monkeypatch):
    """``x[x.shape[0] - 1]`` and ``x[3]`` (x of static shape [4, 3]) are one value: Dedupe folds the index
    computed from the shape and merges the two Gathers. Beside them, ``padding`` Add nodes computing from x's
    values (index-arithmetic op types, never foldable): in a big graph the scan skips them from the run's
    runtime set instead of looking at each (dataflow.runtime_values); the merge is found either way."""
    from rnnfuse.passes import dedupe as dedupe_module

    looked_at: list[str] = []
    real = dedupe_module._reads_only
    monkeypatch.setattr(dedupe_module, "_reads_only", lambda n, *a: looked_at.append(n.op_type) or real(n, *a))
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(3, np.int64), "three")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["t"]),
             helper.make_node("Sub", ["t", "one"], ["last"]),
             helper.make_node("Gather", ["x", "last"], ["a"], axis=0), helper.make_node("Gather", ["x", "three"], ["b"], axis=0)]
    cur = "x"
    for k in range(padding):
        nodes.append(helper.make_node("Add", [cur, "x"], [f"p{k}"]))
        cur = f"p{k}"
    nodes.append(helper.make_node("Concat", ["a", "b"], ["y"], axis=0))
    g = helper.make_graph(nodes, "shape_index", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6]),
                           helper.make_tensor_value_info(cur, TensorProto.FLOAT, [4, 3])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    m = Model(model)
    r = Dedupe().run(m, Options())
    assert r.modified
    concat = next(n for n in m.graph.live_nodes() if n.op_type == "Concat")
    assert list(concat.input) == ["a", "a"]
    assert looked_at.count("Add") == (padding if padding < 1000 else 0), looked_at.count("Add")


def test_dedupe_merges_graph_outputs_keeping_their_names():
    """A node computing a graph output may be the node an equal one merges into (a masked layer's last
    carried output equals the final state the graph returns), and may itself be merged into an earlier equal
    node: its name (the model's interface) then stays, as an Identity of the value kept."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    nodes = [
        helper.make_node("Relu", ["x"], ["h_T"]),  # a graph output, first in graph order
        helper.make_node("Relu", ["x"], ["y_last"]),  # its duplicate, read by the stack
        helper.make_node("Neg", ["x"], ["n1"]),
        helper.make_node("Neg", ["x"], ["n2"]),  # two graph outputs equal to each other
        helper.make_node("Concat", ["y_last", "n1"], ["Y"], axis=0),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8 if n == "Y" else 4]) for n in ("Y", "h_T", "n1", "n2")]
    proto = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 17)])
    m = Model(proto)
    r = Dedupe().run(m, Options())
    assert r.modified and "merged 2 duplicate nodes" in r.notes[0]
    g = m.graph
    live = {n.output[0]: n for n in g.live_nodes()}
    assert set(live) == {"h_T", "n1", "n2", "Y"}
    assert list(g.producer["Y"].input) == ["h_T", "n1"]
    assert live["n2"].op_type == "Identity" and list(live["n2"].input) == ["n1"]
    assert live["n1"].op_type == "Neg"
    g.finalize()
    assert [o.name for o in m.proto.graph.output] == ["Y", "h_T", "n1", "n2"]
    onnx.checker.check_model(m.proto)


def test_dedupe_after_edits_visits_only_the_edits():
    m = Model(elementwise_chain(400))
    g = m.graph
    d = Dedupe()
    d.run(m, Options())
    assert d.visited == 0
    # an edit adds a duplicate of an existing node (as a fusion's emitted plumbing may) and a reader of it
    first = g.producer["v0"]
    dup = g.add_node("Add", list(first.input), name="dup")[0]
    g.add_node("Identity", [dup], name="reader")
    r = d.run(m, Options())
    assert r.modified
    assert 1 <= d.visited <= 3  # the two new nodes (and the rewired reader), not the 400 others
    assert g.uses("v0")[-1].op_type == "Identity"
    d.run(m, Options())
    assert d.visited == 0


def _chain_opts(T: int) -> B.Opts:
    return B.default_reverse_form(B.Opts(op="LSTM", front="chain", static_T=T))


def test_fused_chain_work_is_linear_in_its_length(monkeypatch):
    """The same unrolled LSTM chain at T and 2T: the later Dedupes visit only what the fusion added (the
    same for both), the first one at most in proportion, and the pipeline's whole-graph walks are as many."""
    runs = {}
    for T in (8, 16):
        counted = _Counted(monkeypatch)
        model, _ = B.build(_chain_opts(T))
        nodes = len(model.graph.node)
        m, report, dedupes = _run(model)
        assert any(f.status == "fused" for f in report.findings), report.to_text()
        runs[T] = (nodes, [d.visited for d in dedupes], counted.live, counted.sorts, counted.sorted_nodes)
    (n1, v1, live1, sorts1, sn1), (n2, v2, live2, sorts2, sn2) = runs[8], runs[16]
    assert n2 > 1.7 * n1
    assert v2[0] <= 2.5 * v1[0] + 4  # the first run: linear in the graph
    assert v2[1:] == v1[1:]  # later runs: the fusion's own nodes, whatever T is
    assert (live1, sorts1) == (live2, sorts2)  # as many whole-graph walks whatever the length
    assert sn2 <= 2.5 * sn1 + 16


def _steps_summed(T: int) -> onnx.ModelProto:
    """Per step ``tanh(x[t] @ W)``, no state, every step's result read by one ``Sum`` of T: a node that the
    walk from each step's x_t meets (as a Concat of every step's output is met in a torch export)."""
    rng = np.random.default_rng(0)
    nodes, outs = [], []
    for t in range(T):
        nodes.append(helper.make_node("Constant", [], [f"i{t}"], value=numpy_helper.from_array(np.array(t, np.int64))))
        nodes.append(helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0))
        nodes.append(helper.make_node("MatMul", [f"x{t}", "W"], [f"m{t}"]))
        nodes.append(helper.make_node("Tanh", [f"m{t}"], [f"y{t}"]))
        outs.append(f"y{t}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    W = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "W")
    g = helper.make_graph(nodes, "steps", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 16])], [W])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_node_reading_every_step_costs_a_step_walk_once(monkeypatch):
    """The walks from each step's x_t (step-input maps) meet the Sum of every step: 4x the steps may cost
    about 4x the constant lookups, not 16x (each walk used to look at all of the Sum's T inputs)."""
    calls = {}
    for T in (50, 200):
        n = [0]
        const = Graph.const

        def counted(g, name, _const=const, _n=n):
            _n[0] += 1
            return _const(g, name)

        monkeypatch.setattr(Graph, "const", counted)
        m, report, _ = _run(_steps_summed(T))
        assert not report.modified
        calls[T] = n[0]
        monkeypatch.undo()
    assert calls[200] < 6 * calls[50], calls


def _dead_branches() -> onnx.ModelProto:
    """y = Relu(Add(x, w)); beside it dead code: P = Neg(a) read by Q1 and Q2 (both unread, so P dies with
    them), R = Abs(a) -> S = Abs(R) (a dead chain), and T = Sqrt(x) read by a dead node and by the output."""
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    nodes = [
        helper.make_node("Add", ["x", "w"], ["a"], name="A"),
        helper.make_node("Sqrt", ["x"], ["t"], name="T"),
        helper.make_node("Relu", ["a"], ["r"], name="keep"),
        helper.make_node("Add", ["r", "t"], ["y"], name="Y"),
        helper.make_node("Neg", ["a"], ["p"], name="P"),
        helper.make_node("Abs", ["p"], ["q1"], name="Q1"),
        helper.make_node("Mul", ["p", "p"], ["q2"], name="Q2"),
        helper.make_node("Abs", ["a"], ["r1"], name="R"),
        helper.make_node("Abs", ["r1"], ["s"], name="S"),
        helper.make_node("Exp", ["t"], ["u"], name="U"),
    ]
    g = helper.make_graph(nodes, "dead", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_prune_removes_exactly_what_no_output_needs():
    m = Model(_dead_branches())
    g = m.graph
    assert g.prune() == 6
    assert [n.name for n in g.live_nodes()] == ["A", "T", "keep", "Y"]
    assert g.uses("a") == [g.producer["r"]] and g.uses("t") == [g.producer["y"]]
    assert g.prune() == 0


def test_nothing_dead_costs_no_liveness_walk(monkeypatch):
    """A graph with nothing dead is proven so from its indices (no walk over every node's inputs); dead code
    as loaded too, from its unread values; what an edit kills, by the shorter of the walks from the outputs
    and from what the edit touched."""
    walks = []
    orig = Graph._live_set

    def counted(g, limit=None):
        walks.append(len(g.nodes))
        return orig(g, limit)

    monkeypatch.setattr(Graph, "_live_set", counted)
    m = Model(elementwise_chain(400))
    assert m.graph.prune() == 0
    assert walks == []
    # dead code in a graph as loaded is found from its unread nodes back, still without a walk
    assert Model(_dead_branches()).graph.prune() == 6
    assert walks == []
    # after an edit (a fused chain's steps die): from the edited nodes, the values that lost a reader and the
    # graph's unread ones back, the same nodes as the walk from the outputs
    g = Model(_dead_branches()).graph
    g.replace_uses("t", "x")
    everything, want = [n.name for n in g.live_nodes()], _reference_dead(g)
    assert g.prune() == 7 and len(walks) <= 1  # (a walk from the outputs, bounded: this graph is small)
    assert [n.name for n in g.live_nodes()] == [k for k in everything if k not in want]


def _reference_dead(g: Graph) -> list[str]:
    """The dead nodes by the definition: not reached from a graph output through producers (captures too)."""
    live, stack = set(), [g.producer[o] for o in g.output_names if o in g.producer]
    while stack:
        n = stack.pop()
        if id(n) in live:
            continue
        live.add(id(n))
        stack.extend(g.producer[i] for i in [*n.input, *g.implicit_inputs(n)] if i in g.producer)
    return [n.name for n in g.nodes if id(n) not in live]


def _random_graph(rng, n: int, with_loop: bool) -> onnx.ModelProto:
    """A random acyclic graph in order: nodes of 1-3 inputs and 1-2 outputs (some unread), a few outputs;
    optionally a Loop whose body captures an outer value."""
    names, nodes = ["x"], []
    for k in range(n):
        ins = [names[int(j)] for j in rng.integers(0, len(names), int(rng.integers(1, 4)))]
        outs = [f"v{k}_{j}" for j in range(int(rng.integers(1, 3)))]
        if len(outs) == 2:
            nodes.append(helper.make_node("Split", ins[:1], outs, name=f"n{k}", axis=0))
        else:
            nodes.append(helper.make_node("Sum" if len(ins) > 1 else "Identity", ins, outs, name=f"n{k}"))
        names.extend(outs)
    if with_loop:
        cap = names[int(rng.integers(1, len(names)))]
        body = helper.make_graph([helper.make_node("Identity", [cap], ["b_out"])], "body",
                                 [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                  helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                                 [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                  helper.make_tensor_value_info("b_out", TensorProto.FLOAT, None)])
        nodes.append(helper.make_node("Loop", ["", ""], ["loop_out"], name="loop", body=body))
        names.append("loop_out")
    outs = sorted({names[int(j)] for j in rng.integers(1, len(names), 3)})
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(40))
def test_dead_nodes_from_the_indices_are_the_unreachable_ones(seed):
    """However a graph's dead nodes are found (from its indices as loaded, or by a walk after edits), they
    are exactly the nodes no graph output is computed from, in node order (multi-output nodes with one value
    read, values read twice by one node, a Loop capturing an outer value)."""
    rng = np.random.default_rng(seed)
    g = Model(_random_graph(rng, int(rng.integers(5, 60)), with_loop=seed % 3 == 0)).graph
    assert [n.name for n in g._dead_nodes()] == _reference_dead(g)
    g.add_node("Identity", ["x"], name="extra")  # (an edit: the walk)
    assert [n.name for n in g._dead_nodes()] == _reference_dead(g)


def test_finalize_drops_unused_initializers_in_place():
    """Unused initializers go without the kept ones being copied (protobuf copies a message re-added to a
    repeated field: for a weight-heavy model, the whole model once more); order kept, whichever are dropped."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(1, 12))
        used = rng.random(n) < 0.5
        inits = [numpy_helper.from_array(np.full(3, i, np.float32), f"w{i}") for i in range(n)]
        nodes, cur = [], "x"
        for i in np.flatnonzero(used):
            nodes.append(helper.make_node("Add", [cur, f"w{i}"], [f"a{i}"]))
            cur = f"a{i}"
        nodes.append(helper.make_node("Identity", [cur], ["y"]))
        g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], inits)
        m = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)]))
        g = m.graph
        kept = [t for t in m.proto.graph.initializer if t.name in {f"w{i}" for i in np.flatnonzero(used)}]
        g.add_node("Identity", ["x"], name="edit")  # (an edit, so finalize writes back)
        g.finalize()
        assert [t.name for t in m.proto.graph.initializer] == [t.name for t in kept]
        assert all(a is b for a, b in zip(m.proto.graph.initializer, kept))  # the same messages, not copies
        assert set(g.initializers) == {t.name for t in kept}


@pytest.mark.parametrize("kept_share", [0.9, 0.1])
def test_finalize_moves_the_nodes_the_proto_holds_instead_of_copying_them(kept_share, monkeypatch):
    """A small edit in a big graph: the nodes the proto held stay its messages (same objects, sorted in
    place), the added ones become the proto's copies, named so by the index, and no index pass runs; when
    most of the graph goes, the few left are written whole and indexed again. Either way the index is that
    of a fresh view of the proto, and its reader lists name live proto messages only."""
    from rnnfuse.graph_index import GraphIndex

    n = 400
    nodes = [helper.make_node("Relu", ["x" if k == 0 else f"r{k - 1}"], [f"r{k}"], name=f"n{k}") for k in range(n)]
    nodes += [helper.make_node("Mul", ["w", "w"], ["ww"], name="squares"),  # (reads constants only: Dedupe's list)
              helper.make_node("Add", ["ww", "x"], ["wx"], name="kept_reader")]
    g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                           [helper.make_tensor_value_info(f"r{n - 1}", TensorProto.FLOAT, [3]),
                            helper.make_tensor_value_info("wx", TensorProto.FLOAT, [3])],
                           [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    m = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)]))
    g = m.graph
    held = list(m.proto.graph.node)
    # the square becomes a negation (a new node reading the weight only; the Mul goes dead)
    g.replace_uses("ww", g.add_node("Neg", ["w"], name="negation")[0])
    cut = int(n * (1 - kept_share))  # (r{cut} is computed again by new nodes reading r0 and x: the Relus between go dead)
    a = g.add_node("Add", ["r0", "x"], name="added", anchor=held[cut])[0]
    b = g.add_node("Neg", [a], name="added_too", anchor=held[cut])[0]
    g.replace_uses(f"r{cut}", b)
    indexed: list[int] = []
    real = GraphIndex._index_all
    monkeypatch.setattr(GraphIndex, "_index_all", lambda g, nodes, by_op=None: indexed.append(len(nodes)) or real(g, nodes, by_op))
    g.finalize()
    monkeypatch.undo()
    proto_nodes = list(m.proto.graph.node)
    assert [x.op_type for x in proto_nodes][:3] == ["Relu", "Add", "Neg"]  # (placed by the sort, the dead Relus gone)
    assert len(proto_nodes) == n - cut + 2 + 2
    assert g.nodes == proto_nodes and all(x is y for x, y in zip(g.nodes, proto_nodes))
    survivors = [x for x in held if x.name in {y.name for y in proto_nodes}]
    if kept_share > 0.5:
        assert indexed == [] and all(any(x is y for y in proto_nodes) for x in survivors)
    else:
        assert indexed == [len(proto_nodes)]
    ids = {id(x) for x in proto_nodes}
    assert all(id(p) in ids for p in g.producer.values())
    assert all(id(c) in ids for v in g.consumers.values() for c in (v if type(v) is list else [v]))
    fresh = Model(m.proto).graph
    assert {k: v.name for k, v in g.producer.items()} == {k: v.name for k, v in fresh.producer.items()}
    readers = lambda gr: {k: sorted(c.name for c in gr.uses(k)) for k in gr.consumers if gr.uses(k)}  # noqa: E731
    assert readers(g) == readers(fresh)
    # Dedupe's nodes reading constants only: carried (or found again), the same as a fresh index pass lists
    carried = g.const_only_readers()
    assert carried is not None and sorted(x.name for x in carried) == sorted(x.name for x in fresh.const_only_readers())
    assert [x.op_type for x in carried] == ["Neg"] and all(id(x) in ids for x in carried)


def test_write_back_hands_the_index_over_only_when_the_messages_stayed():
    """node_list.write_back moves the field's messages; a field whose sort copied them instead (no protobuf
    does today) is reported as rewritten, so the caller indexes it anew rather than trust stale objects."""
    from rnnfuse.node_list import write_back

    class CopyingSort(list):
        def sort(self, key=None):
            ordered = sorted(self, key=key)
            self[:] = []
            for n in ordered:
                c = onnx.NodeProto()
                c.CopyFrom(n)
                self.append(c)

    nodes = [helper.make_node("Relu", [f"v{k}"], [f"v{k + 1}"]) for k in range(10)]
    added = helper.make_node("Neg", ["v3"], ["w"])
    order = nodes[:4] + [added] + nodes[4:9]  # (the last Relu removed)
    field = list(nodes)
    copies = write_back(field, order)
    assert copies == [(added, added)] and all(a is b for a, b in zip(field, order)) and len(field) == 10
    field = CopyingSort(nodes)
    assert write_back(field, order) is None and [n.output[0] for n in field] == [n.output[0] for n in order]


def test_positions_order_added_nodes_at_their_anchors():
    """Nodes sorted by position: the graph's nodes in list order, an added node just after its anchor (after
    nodes added there before it), one without an anchor at the end; small and large batches alike."""
    m = Model(elementwise_chain(60))
    g = m.graph
    base = list(g.nodes)
    rng = np.random.default_rng(1)
    expected = [(i, 0, n) for i, n in enumerate(base)]
    for k in range(40):
        anchor = base[int(rng.integers(0, len(base)))] if k % 5 else None
        out = g.add_node("Identity", ["x"], name=f"added{k}", anchor=anchor)[0]
        at = base.index(anchor) if anchor is not None else len(base) + k
        expected.append((at, k + 1, g.producer[out]))
    want = [n for _, _, n in sorted(expected, key=lambda e: (e[0], e[1]))]
    everything = list(g.nodes)
    rng.shuffle(everything)
    assert g.in_position_order(everything) == want  # (the vectorised path)
    few = everything[:10]
    assert g.in_position_order(few) == [n for n in want if any(n is f for f in few)]  # (per node)
    assert g.toposort(everything) == want  # (nothing reads an added node: the order is the positions')


def _random_dag(rng, at_least: int) -> tuple[list, list[str]]:
    """Relu and Add nodes over x, in order, each reading values made before it: (nodes, value names)."""
    nodes, names = [], ["x"]
    for k in range(int(rng.integers(at_least, 30))):
        ins = [names[int(j)] for j in rng.integers(0, len(names), int(rng.integers(1, 3)))]
        nodes.append(helper.make_node("Add" if len(ins) == 2 else "Relu", ins, [f"v{k}"], name=f"n{k}"))
        names.append(f"v{k}")
    return nodes, names


def _stable_kahn(g, nodes):
    """The reference order: Kahn's algorithm, the ready node of smallest position first."""
    import heapq

    order = g.in_position_order(nodes)
    index = {id(n): i for i, n in enumerate(order)}
    succ: list[list[int]] = [[] for _ in order]
    indeg = [0] * len(order)
    for i, n in enumerate(order):
        for j in {index[id(p)] for x in g.reads(n) if (p := g.producer.get(x)) is not None and id(p) in index} - {i}:
            succ[j].append(i)
            indeg[i] += 1
    heap = [i for i in range(len(order)) if indeg[i] == 0]
    out = []
    while heap:
        i = heapq.heappop(heap)
        out.append(order[i])
        for k in succ[i]:
            indeg[k] -= 1
            if indeg[k] == 0:
                heapq.heappush(heap, k)
    return out if len(out) == len(order) else None


def test_sort_is_kahns_stable_order_and_reads_only_edited_nodes(monkeypatch):
    """Graph.toposort gives exactly the stable Kahn order (smallest position first among ready nodes) for
    random graphs, as read in order or shuffled, after random additions placed anywhere and rewirings; and
    in a graph that was in order it reads the inputs of the edited nodes and their readers only."""
    rng = np.random.default_rng(11)
    compared = reordered = 0
    for trial in range(400):
        nodes, names = _random_dag(rng, 2)
        if trial % 3 == 0:
            nodes = [nodes[int(i)] for i in rng.permutation(len(nodes))]
        g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                               [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2]) for v in names[-2:]])
        g = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)])).graph
        for _ in range(int(rng.integers(1, 5))):
            live = g.live_nodes()
            new = g.add_node("Relu", [names[int(rng.integers(0, len(names)))]], anchor=live[int(rng.integers(0, len(live)))])[0]
            target = names[int(rng.integers(1, len(names)))]
            readers = g.uses(target)
            if readers and rng.random() < 0.6:
                g.replace_reads([readers[int(rng.integers(0, len(readers)))]], target, new)
            names.append(new)
        live = g.live_nodes()
        want = _stable_kahn(g, live)
        if want is None:
            with pytest.raises(RuntimeError):
                g.toposort(live)
            continue
        compared += 1
        reordered += want != g.in_position_order(live)
        assert g.toposort(live) == want, trial
    assert compared > 300 and reordered > 100, (compared, reordered)

    # a long chain in order, one node added out of place: the sort reads a handful of nodes' inputs
    g = Model(elementwise_chain(2000)).graph
    late = g.nodes[1500]
    feeder = g.add_node("Relu", [g.nodes[1000].output[0]], anchor=g.nodes[1700])[0]
    g.replace_reads([late], late.input[0], feeder)  # (late now reads a node placed after it)
    read: list[int] = []
    reads = Graph.reads
    monkeypatch.setattr(Graph, "reads", lambda self, n: read.append(1) or reads(self, n))
    order = g.toposort(g.live_nodes())
    assert len(read) < 250, len(read)
    monkeypatch.undo()
    assert order == _stable_kahn(g, g.live_nodes())
    at = {id(n): i for i, n in enumerate(order)}
    assert at[id(g.producer[feeder])] < at[id(late)]


def test_prune_after_edits_finds_what_a_walk_from_the_outputs_finds(monkeypatch):
    """Dead nodes after edits are found from what the edits touched (Walks.newly_dead): the same nodes as
    the walk back from the outputs finds, on random graphs with dead code of their own, after random removals,
    rewirings and additions (some read by nothing), pruned once or twice; and a prune after a small edit of
    a long chain looks at a handful of nodes, not the chain."""
    walk = Graph._live_set
    # (the walk from the outputs given up at once, whatever its limit: newly_dead decides every time)
    monkeypatch.setattr(Graph, "_live_set", lambda g, limit=None: None if limit is not None else walk(g))
    rng = np.random.default_rng(5)
    checked = found = 0
    for trial in range(300):
        nodes, names = _random_dag(rng, 3)
        outs = sorted({names[-1], names[int(rng.integers(1, len(names)))]})
        g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                               [helper.make_tensor_value_info(v, TensorProto.FLOAT, [2]) for v in outs])
        g = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)])).graph
        for prune_round in range(int(rng.integers(1, 3))):
            for _ in range(int(rng.integers(1, 5))):
                live = g.live_nodes()
                kind = rng.random()
                if kind < 0.3 and len(live) > 1:
                    victim = live[int(rng.integers(0, len(live)))]
                    if not any(g.is_graph_output(o) or g.uses(o) for o in victim.output):
                        g.remove_node(victim)
                elif kind < 0.7:
                    target = names[int(rng.integers(1, len(names)))]
                    readers = [r for r in g.uses(target) if g.alive(r)]
                    if target in g.producer and readers:
                        src = g.producer[target].input[0]  # (an input of its producer: no cycle)
                        g.replace_reads([readers[int(rng.integers(0, len(readers)))]], target, src)
                else:
                    names.append(g.add_node("Relu", [names[int(rng.integers(0, len(names)))]])[0])
            want = {id(n) for n in g.live_nodes()} - g._live_set()
            got = g._dead_nodes()
            assert {id(n) for n in got} == want, trial
            checked += 1
            found += bool(want)
            g.prune()
    assert checked > 300 and found > 100, (checked, found)

    monkeypatch.undo()
    g = Model(elementwise_chain(2000)).graph
    assert g.prune() == 0
    mid = g.nodes[1000]
    g.replace_reads(g.uses(mid.output[0]), mid.output[0], mid.input[0])  # (mid is read by nothing now)
    read: list[int] = []
    reads = Graph.reads
    monkeypatch.setattr(Graph, "reads", lambda self, n: read.append(1) or reads(self, n))
    assert g.prune() >= 1 and not g.alive(mid)
    assert len(read) < 150, len(read)  # (the walk from the outputs tried up to its bound, 4 x 2 + 64 nodes)
    monkeypatch.undo()

    # a fused chain: its steps all dead, a few live nodes left: the walk from the outputs is the cheaper
    g = Model(elementwise_chain(2000)).graph
    assert g.prune() == 0
    last = g.producer[g.output_names[0]]
    g.replace_reads([last], last.input[0], "x")  # (the output now reads x: every other node is dead)
    dead_calls: list[int] = []
    newly = Graph.newly_dead
    monkeypatch.setattr(Graph, "newly_dead", lambda g, touched: dead_calls.append(1) or newly(g, touched))
    assert g.prune() == 1999 and dead_calls == [] and [n.name for n in g.live_nodes()] == [last.name]


def test_the_next_round_takes_over_the_finalized_index(monkeypatch):
    """A round that rewrote the model finalizes its graph (index exact again); the next round's view takes
    that index over instead of indexing the main graph again, and gives the same model as one that did."""
    import os

    from rnnfuse.graph_index import GraphIndex

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "keras_masked_bigru_lstm.onnx")
    src = onnx.load(path)
    plain, _ = Pipeline.default()(src)
    indexed: list[int] = []
    real = GraphIndex._index_all
    monkeypatch.setattr(GraphIndex, "_index_all", lambda g, nodes, by_op=None: indexed.append(len(nodes)) or real(g, nodes, by_op))
    views: list[Model] = []
    init = Model.__init__
    monkeypatch.setattr(Model, "__init__", lambda m, *a, **k: views.append(m) or init(m, *a, **k))
    out, report = Pipeline.default()(src)
    assert report.fused and report.rounds >= 2
    main_sizes = {len(v.graph.nodes) for v in views} | {len(src.graph.node)}
    # the main graph is indexed as loaded and once by each finalize that rewrote its node list; never by a view
    assert len(views) == report.rounds and sum(1 for k in indexed if k in main_sizes) <= report.rounds, indexed
    monkeypatch.undo()
    assert out.SerializeToString() == plain.SerializeToString()
    fresh = Pipeline.default()(out)[0]  # (and the indices it handed on were exact: a second run finds nothing)
    assert fresh.SerializeToString() == out.SerializeToString()


def test_constant_readers_found_while_indexing():
    """The index pass lists the nodes reading constants and nothing else (what Dedupe compares by value), so
    a graph of 100k nodes reading one weight each costs Dedupe no visit of them; the list is exactly the
    nodes whose every input is an initializer or a Constant's output, and it is not used after an edit."""
    rng = np.random.default_rng(3)
    for trial in range(30):
        inits = [numpy_helper.from_array(np.ones(2, np.float32), f"w{i}") for i in range(3)]
        nodes, names, consts = [], ["x"], {"w0", "w1", "w2"}
        for k in range(int(rng.integers(3, 25))):
            if rng.random() < 0.3:
                nodes.append(helper.make_node("Constant", [], [f"c{k}"], value=numpy_helper.from_array(np.ones(2, np.float32))))
                consts.add(f"c{k}")
                names.append(f"c{k}")
                continue
            pool = names + sorted(consts)
            ins = [pool[int(j)] for j in rng.integers(0, len(pool), int(rng.integers(1, 3)))]
            nodes.append(helper.make_node("Add" if len(ins) == 2 else "Relu", ins, [f"v{k}"], name=f"n{k}"))
            names.append(f"v{k}")
        nodes.append(helper.make_node("Identity", [names[-1]], ["y"]))
        g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
        g = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)])).graph
        want = [n.name for n in g.nodes if n.input and all(i in consts for i in n.input)]
        assert [n.name for n in g.const_only_readers()] == want
        g.add_node("Identity", ["w1"], name="added")  # (an edit: Dedupe looks for itself)
        assert g.const_only_readers() is None


def test_op_counts_from_the_index():
    """The report's op counts of a graph as loaded come from the op-type index (no node read), subgraphs'
    ops counted as a walk counts them, in the same order; after an edit, or with a node of another domain,
    the proto is walked."""
    from rnnfuse.findings import op_counts

    body = helper.make_graph([helper.make_node("Neg", ["x"], ["b_out"]), helper.make_node("Identity", ["c"], ["c_out"])],
                             "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                      helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                             [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("b_out", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Loop", ["", ""], ["l"], body=body),
             helper.make_node("Add", ["r", "l"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    g0 = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = Model(helper.make_model(g0, opset_imports=[helper.make_opsetid("", 17)]))
    assert m.graph.op_type_counts() is not None
    assert list(op_counts(m.proto.graph, m.graph).items()) == list(op_counts(m.proto.graph).items()) == [
        ("Relu", 2), ("Loop", 1), ("Add", 1), ("Neg", 1), ("Identity", 1)]
    m.graph.add_node("Abs", ["x"], name="edit")
    assert m.graph.op_type_counts() is None
    other = helper.make_node("Custom", ["x"], ["z"], domain="my.ops")
    g1 = helper.make_graph(nodes + [other], "g", list(g0.input), list(g0.output))
    m1 = helper.make_model(g1, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    assert Model(m1).graph.op_type_counts() is None


def _loops_in_a_row(n: int, nested_matmul_at: int | None = None) -> onnx.ModelProto:
    """``n`` Loops in a row, each carrying a value through a Tanh (no cell: nothing multiplies it by a
    weight); Loop ``nested_matmul_at``'s Tanh reads a MatMul inside an If of its body instead."""
    vi = helper.make_tensor_value_info
    nodes, cur = [], "x"
    for i in range(n):
        body_nodes = [helper.make_node("Identity", ["c_in"], ["c_out"])]
        if i == nested_matmul_at:
            branch = helper.make_graph([helper.make_node("MatMul", ["v_in", "W"], ["p"])], "mm", [],
                                       [vi("p", TensorProto.FLOAT, None)])
            body_nodes += [helper.make_node("If", ["c_in"], ["v_p"], then_branch=branch, else_branch=branch),
                           helper.make_node("Tanh", ["v_p"], ["v_out"])]
        else:
            body_nodes.append(helper.make_node("Tanh", ["v_in"], ["v_out"]))
        body = helper.make_graph(body_nodes, f"body{i}",
                                 [vi("it", TensorProto.INT64, []), vi("c_in", TensorProto.BOOL, []),
                                  vi("v_in", TensorProto.FLOAT, None)],
                                 [vi("c_out", TensorProto.BOOL, []), vi("v_out", TensorProto.FLOAT, None)])
        nodes.append(helper.make_node("Loop", ["trip", "cond", cur], [f"l{i}"], f"loop{i}", body=body))
        cur = f"l{i}"
    inits = [numpy_helper.from_array(np.array(2, np.int64), "trip"), numpy_helper.from_array(np.array(True), "cond"),
             numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")]
    g = helper.make_graph(nodes, "loops", [vi("x", TensorProto.FLOAT, ["B", 4])], [vi(cur, TensorProto.FLOAT, ["B", 4])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_loop_without_a_weight_product_is_declined_unindexed(monkeypatch):
    """A Loop whose body (at any depth) multiplies nothing by a weight holds no cell: it is declined from a
    scan of its op types, its body never indexed nor typed (25,000 such Loops: 3 s of the pass); one whose
    body holds a MatMul, even inside an If, is still analysed."""
    indexed = []
    subgraph = Graph.subgraph

    def counted(g, node, _sub=subgraph):
        indexed.append(node.name)
        return _sub(g, node)

    monkeypatch.setattr(Graph, "subgraph", counted)
    model = _loops_in_a_row(30, nested_matmul_at=17)
    before = model.SerializeToString()
    m, report, _ = _run(model)
    assert not report.modified and m.proto.SerializeToString() == before
    assert indexed[:1] == ["loop17"] and set(indexed) == {"loop17"}, indexed
    loops = {f.where: f for f in report.findings if f.pass_name == "loop"}
    assert len(loops) == 30 and all(f.status == "declined" for f in loops.values())
    assert all("multiplies nothing by a weight matrix" in loops[f"loop{i}"].reason for i in range(30) if i != 17)
    assert "weight matrix" not in loops["loop17"].reason


def test_a_loop_state_declared_by_its_body_needs_no_type_inference(monkeypatch):
    """The Loop pass asks a carried value's element type of the body's declaration first: the outer init of a
    Loop in a chain of Loops is another Loop's output, whose type only inference gives (a cone per Loop in a
    big model: 1 s for 25,000)."""
    asked = []
    known_type = Model.known_type

    def counted(m, name, _known=known_type):
        asked.append(name)
        return _known(m, name)

    monkeypatch.setattr(Model, "known_type", counted)
    m, report, _ = _run(_loops_in_a_row(5, nested_matmul_at=3))
    assert not report.modified
    assert "l2" not in asked, asked  # (loop3's carried init)


def _wide_duplicates(n: int) -> onnx.ModelProto:
    """``n`` Gathers of x by 8 distinct constant indices (so n - 8 duplicates), all read by one Concat."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Gather", ["x", f"i{k}"], [f"g{k}"], axis=0) for k in range(n)]
    inits = [numpy_helper.from_array(np.array([k % 8], np.int64), f"i{k}") for k in range(n)]
    inits.append(numpy_helper.from_array(np.eye(4, dtype=np.float32), "W"))
    nodes += [helper.make_node("Concat", [f"g{k}" for k in range(n)], ["c"], axis=0),
              helper.make_node("MatMul", ["c", "W"], ["y"])]
    g = helper.make_graph(nodes, "wide", [vi("x", TensorProto.FLOAT, [8, 4])], [vi("y", TensorProto.FLOAT, [n, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_merging_the_inputs_of_a_wide_node_costs_each_merge_once(monkeypatch):
    """A Concat reading thousands of duplicates is rewired once per merge: each rewiring renames its positions
    of one name (the node is not re-indexed, its whole input list read again), Dedupe looks at it once after
    the merges, not once per merge, and the reader list of the x every duplicate reads is filtered once
    (10,000 inputs: 199 s before, 1.1 s; 50,000: 4.4 s)."""
    reindexed = []
    unindex = Graph._unindex

    def counted(g, n, defer=None, _unindex=unindex):
        if n.op_type == "Concat":
            reindexed.append(n.name)
        return _unindex(g, n, defer)

    monkeypatch.setattr(Graph, "_unindex", counted)
    visited = {}
    for n in (200, 800):
        reindexed.clear()
        m = Model(_wide_duplicates(n))
        dedupe = Dedupe()
        res = dedupe.run(m, Options())
        assert res.modified and len(m.graph.nodes_of("Gather")) == 8
        cat = m.graph.nodes_of("Concat")[0]
        assert len(set(cat.input)) == 8 and len(cat.input) == n
        assert all(m.graph.producer[i].op_type == "Gather" for i in cat.input)
        # x's reader list, filtered of the merged Gathers once at the end (not at each of n - 8 removals)
        assert len(m.graph.uses("x")) == 8 and all(m.graph.alive(u) for u in m.graph.uses("x"))
        assert not reindexed, len(reindexed)
        visited[n] = dedupe.visited
    assert visited[800] < 5 * visited[200], visited


def test_renaming_a_read_leaves_the_readers_other_inputs_alone(monkeypatch):
    """Renaming what a node reads re-indexes none of its other inputs: every step of an unrolled chain reads
    the same weights, and re-indexing a step's matmul filtered the weight's reader list (as long as the chain)
    at each rename: the per-step reads of a stacked chain's lower cell, 7,000 renames, took 10 s."""
    n = 64
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("MatMul", [f"a{k}", "W"], [f"m{k}"], name=f"mm{k}") for k in range(n)]
    nodes += [helper.make_node("Identity", [f"x{k}"], [f"a{k}"]) for k in range(n)]
    nodes += [helper.make_node("Identity", [f"x{k}"], [f"b{k}"]) for k in range(n)]
    nodes.append(helper.make_node("Sum", [f"m{k}" for k in range(n)], ["y"]))
    g = helper.make_graph(nodes, "renames", [vi(f"x{k}", TensorProto.FLOAT, [2, 4]) for k in range(n)],
                          [vi("y", TensorProto.FLOAT, [2, 4])],
                          [numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    reindexed = []
    unindex = Graph._unindex
    monkeypatch.setattr(Graph, "_unindex", lambda g, node, defer=None: (reindexed.append(node.name), unindex(g, node, defer)))
    readers_of_w = m.graph.uses("W")
    for k in range(n):
        m.graph.replace_uses(f"a{k}", f"b{k}")
    assert not reindexed
    assert m.graph.uses("W") is readers_of_w and [u.name for u in readers_of_w] == [f"mm{k}" for k in range(n)]
    for k in range(n):
        (reader,) = m.graph.uses(f"b{k}")
        assert reader.name == f"mm{k}" and list(reader.input) == [f"b{k}", "W"] and not m.graph.uses(f"a{k}")


def _steps_reading_copies(n: int) -> onnx.ModelProto:
    """n steps, each reading its own copy of one value (``Shape(x)``: a traced ``view`` reads the batch at every
    step), and a Concat of every step: once merged, the copy kept is read by every step."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Shape", ["x"], [f"s{k}"], name=f"shape{k}") for k in range(n)]
    nodes += [helper.make_node("Add", [f"s{k}", f"i{k}"], [f"a{k}"], name=f"add{k}") for k in range(n)]
    nodes.append(helper.make_node("Concat", [f"a{k}" for k in range(n)], ["y"], axis=0))
    inputs = [vi("x", TensorProto.FLOAT, [2, 4])] + [vi(f"i{k}", TensorProto.INT64, [2]) for k in range(n)]
    g = helper.make_graph(nodes, "copies", inputs, [vi("y", TensorProto.INT64, [2 * n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_merging_copies_every_step_reads_is_linear():
    """Each merge moved a step onto the kept copy's reader list after searching that list for it (it grows to
    every step: quadratic, 8.4 million comparisons for a 1,024-step gate-view LSTM); whether a node already
    reads a name is a question about the node's own inputs. Work counted in Python calls, never timed."""
    calls = {}
    for n in (200, 800):
        m = Model(_steps_reading_copies(n))
        prof = cProfile.Profile()
        prof.enable()
        res = Dedupe().run(m, Options())
        prof.disable()
        g = m.graph
        assert res.modified and len(g.nodes_of("Shape")) == 1
        kept = g.nodes_of("Shape")[0].output[0]
        assert sorted(u.name for u in g.uses(kept)) == sorted(f"add{k}" for k in range(n))
        assert all(not g.uses(f"s{k}") for k in range(n) if f"s{k}" != kept)
        calls[n] = pstats.Stats(prof).total_calls
    assert calls[800] < 5 * calls[200], calls


def test_renaming_what_a_wide_node_does_not_read_changes_nothing():
    """A node reading many values keeps its positions of each name: asked to rename a name it does not read, it
    was put on the new name's reader list all the same (and an empty position list kept for it)."""
    g = Model(_steps_reading_copies(70)).graph
    cat = g.nodes_of("Concat")[0]
    before = list(cat.input)
    g.replace_reads([cat], "s3", "s5")  # (cat reads neither)
    assert list(cat.input) == before
    assert [u.name for u in g.uses("s5")] == ["add5"] and [u.name for u in g.uses("s3")] == ["add3"]
    g.replace_reads([cat], "a3", "a5")
    g.replace_reads([cat], "s3", "a5")
    assert cat.input[3] == cat.input[5] == "a5" and not g.uses("a3") and [u is cat for u in g.uses("a5")] == [True]


def test_a_step_map_asks_no_type_of_values_that_are_never_bool(monkeypatch):
    """Whether a step's walked value is a mask asks its type only where the op may make a bool: x_t read by
    cells side by side through MatMuls and Adds (numeric by ONNX's type constraints) costs no type query (a
    cone inference each in a big model); a Cast may make a bool and is asked."""
    from rnnfuse import input_maps
    from rnnfuse.model import Model as M

    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]) for i in range(4)]
    nodes += [helper.make_node("Add", [f"m{i}", f"w{i}"], [f"a{i}"]) for i in range(4)]
    nodes.append(helper.make_node("Cast", ["x"], ["b"], to=TensorProto.BOOL))
    inits = [numpy_helper.from_array(np.ones((3, 3), np.float32), f"w{i}") for i in range(4)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3])],
                              [helper.make_tensor_value_info(f"a{i}", TensorProto.FLOAT, None) for i in range(4)]
                              + [helper.make_tensor_value_info("b", TensorProto.BOOL, None)], inits)
    m = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    asked = []
    real = M.elem_type
    monkeypatch.setattr(M, "elem_type", lambda self, name: asked.append(name) or real(self, name))
    assert input_maps._mask_values(m.graph, list(m.graph.nodes)) == {"b"}
    assert asked == ["b"]


def test_step_masks_ask_no_type_of_the_cells_values(monkeypatch):
    """Which masks a step computes from its input rows asks a type only of what may be a mask: x_t read by a
    cell's matmuls and activations (numeric by ONNX's type constraints, and one value a row is asked of the
    candidates only) costs no query; a 1,800-step Keras layer's 6,581 such queries spent the whole model's
    inference budget, and the step masks the evaluator then needed went untyped."""
    from rnnfuse import row_wise
    from rnnfuse.model import Model as M

    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Tanh", ["a"], ["t"]),
             helper.make_node("ReduceMax", ["x"], ["r"], axes=[1], keepdims=1),
             helper.make_node("Greater", ["r", "zero"], ["valid"]),
             helper.make_node("Where", ["valid", "t", "h"], ["y"])]
    inits = [numpy_helper.from_array(np.ones((3, 3), np.float32), "w"), numpy_helper.from_array(np.ones(3, np.float32), "b"),
             numpy_helper.from_array(np.zeros(1, np.float32), "zero")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3]),
                                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    asked = []
    real_shape, real_elem = M.shape, M.elem_type
    monkeypatch.setattr(M, "shape", lambda self, name: asked.append(name) or real_shape(self, name))
    monkeypatch.setattr(M, "elem_type", lambda self, name: asked.append(name) or real_elem(self, name))
    found = row_wise.row_masks(m.graph, ["x"], m.graph.const)
    assert [(name, [n.op_type for n in cone], rank) for name, cone, rank in found] == [("valid", ["ReduceMax", "Greater"], 2)]
    assert not {"m", "a", "t"} & set(asked), asked


def test_fills_and_broadcast_lengths_are_read_without_folding_shapes(monkeypatch):
    """A ConstantOfShape's fill is read off the node, and a length broadcast from a tensor's shape
    (``Expand(Shape(y)[0], ...)``, tf2onnx's ReverseV2) is no given constant: neither folds ``Shape(y)``, which
    infers the types of y's whole cone (a 1,800-step Keras layer's stacked output: 1 s each)."""
    from rnnfuse import dataflow, fold

    nodes = [helper.make_node("Tanh", ["x"], ["y"]), helper.make_node("Shape", ["y"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Gather", ["s", "i0"], ["len"], axis=0),
             helper.make_node("Expand", ["len", "nb"], ["lens"]),
             helper.make_node("Cast", ["lens"], ["lens_f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["z", "lens_f"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array([2], np.int64), "nb")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    m = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    folded = []
    real = fold.fold_output
    monkeypatch.setattr(fold, "fold_output", lambda g, node, name: folded.append(name) or real(g, node, name))
    assert m.graph.fill_value("z") == 0.5
    assert dataflow.given_constants(m.graph) == {"z", "out"}  # (z and what reads it alone: "lens" is no seed)
    assert "s" not in folded, folded


def test_a_carried_output_is_signed_where_the_states_walks_stopped(monkeypatch):
    """Keras' masked layers carry their previous output beside h: signing it at every step walks only what
    the step's h walk did not reach (its memo is kept when the new leaf, the previous output, is in none of
    its signatures), not the whole step again: ~1.2 node openings a node, 2.2 before."""
    from rnnfuse import optimize, signature

    opened = [0]
    real = signature.Signer._open

    def counting(self, *a, **k):
        opened[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(signature.Signer, "_open", counting)
    o = B.Opts(op="GRU", front="chain", mask="where", carry_src="prev", init="input", static_T=40)
    model, _ = B.build(o)
    _, report = optimize(model)
    assert [f.status for f in report.findings if f.pass_name == "unrolled"] == ["fused"], report.to_text()
    assert opened[0] < 1.5 * len(model.graph.node), (opened[0], len(model.graph.node))


def _run_counting_list_filters(monkeypatch, cleanup, m: Model):
    """Run the pass ``cleanup`` on ``m``: its result, and the names of each deferred filter of long reader lists."""
    from rnnfuse.graph_edit import Graph as EditGraph

    filtered = []
    real = EditGraph.drop_removed_readers
    monkeypatch.setattr(EditGraph, "drop_removed_readers", lambda self, names: filtered.append(set(names)) or
                        real(self, names))
    return cleanup.run(m, Options()), filtered


def test_no_op_copies_of_one_weight_are_read_through_in_one_filter(monkeypatch):
    """torch writes an Identity of each weight per call of a layer (2,700 calls: 2,700 readers of one
    initializer). Reading them through removes each copy without rescanning the weight's reader list per
    copy (quadratic: 1 s there): long lists are filtered once at the end, and come out exact."""
    from rnnfuse.passes.cleanup import DropNoOps

    n = 300
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    nodes = []
    for i in range(n):
        nodes += [helper.make_node("Identity", ["W"], [f"w{i}"]), helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"])]
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(n)], ["y"]))
    g = helper.make_graph(nodes, "copies", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])], [w])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    res, filtered = _run_counting_list_filters(monkeypatch, DropNoOps(), m)
    assert res.modified and filtered == [{"W"}]  # (one filter of W's list, for all 300 copies)
    readers = m.graph.uses("W")
    assert sorted(r.output[0] for r in readers) == sorted(f"y{i}" for i in range(n))
    assert all(m.graph.alive(r) and r.op_type == "MatMul" for r in readers)


def test_constant_ifs_capturing_one_weight_are_inlined_in_one_filter(monkeypatch):
    """Constant-condition Ifs whose branches all capture one weight: the weight's reader list holds every If
    and every inlined reader, and filtering it at each removal was quadratic (2,273 Ifs: 0.45 / 0.87 /
    2.15 s at 25k / 50k / 100k nodes). Long lists are filtered once at the end, and come out exact."""
    from rnnfuse.passes.cleanup import InlineConstantIfs

    n = 100
    inits = [numpy_helper.from_array(np.ones((4, 4), np.float32), "W"), numpy_helper.from_array(np.array(True), "yes")]
    nodes, cur = [], "x"
    for i in range(n):
        branches = [helper.make_graph([helper.make_node(op, [cur, "W"], [f"{op}{i}"])], f"{op}{i}", [],
                                      [helper.make_tensor_value_info(f"{op}{i}", TensorProto.FLOAT, ["B", 4])])
                    for op in ("MatMul", "Add")]
        nodes.append(helper.make_node("If", ["yes"], [f"if{i}"], then_branch=branches[0], else_branch=branches[1]))
        cur = f"if{i}"
    g = helper.make_graph(nodes, "ifs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["B", 4])], inits)
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    res, filtered = _run_counting_list_filters(monkeypatch, InlineConstantIfs(), m)
    assert res.modified and filtered == [{"W", "yes"}]  # (one filter of each list all 100 Ifs are in)
    readers = m.graph.uses("W")
    assert len(readers) == n and all(m.graph.alive(r) and r.op_type == "MatMul" for r in readers)
    assert not m.graph.nodes_of("If") or not any(m.graph.alive(x) for x in m.graph.nodes_of("If"))


def _backward_chain_read_per_step(T: int) -> onnx.ModelProto:
    """A backward tanh RNN unrolled over T steps, each step's h read beside the chain (``relu(h_t)`` stacked in
    time order): torch's hand-written bidirectional loop reads its backward cell's states so."""
    rng = np.random.default_rng(0)
    F, H = 3, 4
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W", rng.standard_normal((F, H))), ("R", rng.standard_normal((H, H)) * 0.3), ("b", rng.standard_normal(H)))]
    inits += [numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    nodes, h = [], "h_init"
    for t in range(T - 1, -1, -1):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"i{t}"))
        nodes += [helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0),
                  helper.make_node("MatMul", [f"x{t}", "W"], [f"xw{t}"]),
                  helper.make_node("MatMul", [h, "R"], [f"hr{t}"]),
                  helper.make_node("Add", [f"xw{t}", f"hr{t}"], [f"s{t}"]),
                  helper.make_node("Add", [f"s{t}", "b"], [f"p{t}"]),
                  helper.make_node("Tanh", [f"p{t}"], [f"h{t}"]),
                  helper.make_node("Relu", [f"h{t}"], [f"r{t}"]),
                  helper.make_node("Unsqueeze", [f"r{t}", "ax0"], [f"u{t}"])]
        h = f"h{t}"
    nodes.append(helper.make_node("Concat", [f"u{t}" for t in range(T)], ["out"], axis=0))
    g = helper.make_graph(nodes, "backward_read_per_step",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F]),
                           helper.make_tensor_value_info("h_init", TensorProto.FLOAT, ["B", H])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [T, "B", H])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_backward_chains_step_reads_share_one_flip(monkeypatch):
    """Each step read of a backward chain is a row of Y read backward: the emitter builds that flip once, not
    once a read (6,660 Slices of a whole [T, B, H] sequence for a hand-written bidirectional torch loop, which
    Dedupe then merged and the next round's search walked). The Slices added do not grow with T."""
    from helpers import session

    added = {}
    for T in (6, 12):
        model = _backward_chain_read_per_step(T)
        slices = [0]
        add = Graph.add_node

        def counted(g, op_type, *args, _add=add, _n=slices, **kw):
            _n[0] += op_type == "Slice"
            return _add(g, op_type, *args, **kw)

        monkeypatch.setattr(Graph, "add_node", counted)
        m, report, _ = _run(model)
        monkeypatch.undo()
        assert any(f.status == "fused" for f in report.findings), report.to_text()
        added[T] = slices[0]
        rng = np.random.default_rng(1)
        feeds = {"x": rng.standard_normal((T, 2, 3)).astype(np.float32),
                 "h_init": rng.standard_normal((2, 4)).astype(np.float32)}
        np.testing.assert_allclose(session(m.proto).run(None, feeds)[0], session(model).run(None, feeds)[0], atol=1e-5)
    assert added[6] == added[12] >= 1, added


def test_committing_stacked_loops_filters_a_shared_reader_list_once(monkeypatch):
    """80 stacked Loops all read one trip count ``T``, each capturing the Loop below's output: committing them
    renamed each capture by re-indexing its Loop (filtering T's reader list) and filtered T's list again after
    each commit, quadratic in the Loops (1,600 Loops: 0.7 s of commits, now 0.1 s). The captures are renamed
    in place, and the long lists are filtered once after every commit."""
    from builders_loops import build_stacked_loops

    import rnnfuse

    long_filters: list[str] = []  # names whose reader list of 64+ was filtered
    unindex, drop = Graph._unindex, Graph.drop_removed_readers

    def counted_unindex(g, node, defer=None):
        if defer is None:
            long_filters.extend(i for i in set(node.input) | g.implicit_inputs(node) if len(g.uses(i)) >= 64)
        return unindex(g, node, defer)

    def counted_drop(g, names):
        long_filters.extend(i for i in names if len(g.uses(i)) >= 64)
        return drop(g, names)

    monkeypatch.setattr(Graph, "_unindex", counted_unindex)
    monkeypatch.setattr(Graph, "drop_removed_readers", counted_drop)
    model = build_stacked_loops(80)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 80 and not report.declined, report.to_text()
    assert long_filters.count("T") <= 2, long_filters.count("T")
    x = np.random.default_rng(0).standard_normal((5, 1, 4)).astype(np.float32)
    from helpers import session

    for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_renaming_a_value_a_loop_captures_leaves_the_loops_other_reads_alone(monkeypatch):
    """A Loop whose body reads ``a`` from outside, renamed to ``b``: the body reads ``b``, the Loop is on b's
    reader list and off a's, its captures say so, and no other reader list is filtered (no re-index)."""
    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Add", ["h", "a"], ["hn"]), helper.make_node("Identity", ["cond"], ["cond_out"])], "body",
        [vi("it", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, []), vi("h", TensorProto.FLOAT, [2])],
        [vi("cond_out", TensorProto.BOOL, []), vi("hn", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]),
             helper.make_node("Loop", ["T", "", "x"], ["y"], body=body, name="loop")]
    g = helper.make_graph(nodes, "captures", [vi("x", TensorProto.FLOAT, [2]), vi("T", TensorProto.INT64, [])],
                          [vi("y", TensorProto.FLOAT, [2])])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    reindexed = []
    unindex = Graph._unindex
    monkeypatch.setattr(Graph, "_unindex", lambda g, node, defer=None: (reindexed.append(node.name), unindex(g, node, defer)))
    loop = m.graph.producer["y"]
    m.graph.replace_reads([loop], "a", "b")
    assert not reindexed
    assert m.graph.implicit_inputs(loop) == {"b"}
    assert [u.name for u in m.graph.uses("b")] == ["loop"] and not m.graph.uses("a")
    assert [u.name for u in m.graph.uses("T")] == ["loop"] and list(loop.input) == ["T", "", "x"]
    assert [n.input[1] for n in loop.attribute[0].g.node if n.op_type == "Add"] == ["b"]


def _loop_with_body(ops: int) -> onnx.ModelProto:
    """A Loop whose body applies ``ops`` Relus to a captured x each iteration (scan output)."""
    body_nodes, cur = [], "x"
    for i in range(ops):
        body_nodes.append(helper.make_node("Relu", [cur], [f"b{i}"]))
        cur = f"b{i}"
    body_nodes += [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", [cur], ["scan"])]
    body = helper.make_graph(body_nodes, "body", [helper.make_tensor_value_info("it", TensorProto.INT64, []),
                                                  helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("scan", TensorProto.FLOAT, ["B", 4])])
    loop = helper.make_node("Loop", ["n", ""], ["ys"], body=body)
    g = helper.make_graph([loop], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4]),
                                        helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("ys", TensorProto.FLOAT, [None, "B", 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_loops_body_counts_toward_inferring_the_whole_model(monkeypatch):
    """Whole-model inference walks every body: a Loop whose body holds a big head is no small model (a
    100,000-op head inferred twice over to type one check output)."""
    import rnnfuse.model

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 100)
    assert Model(_loop_with_body(50))._may_infer
    assert not Model(_loop_with_body(150))._may_infer


def test_finalize_lists_what_it_redefined_only_for_types_carried_over(monkeypatch):
    """The outputs of the nodes a round added, rewired or removed are read only where the next round carries
    over types inferred cone by cone (a fused chain's 100,000 removed nodes were read for nothing)."""
    import rnnfuse.model

    def edited_and_finalized(m: Model) -> Graph:
        g = m.graph
        out = g.add_node("Relu", ["v2"])[0]
        g.replace_uses("v3", out)
        g.finalize()
        return g

    assert edited_and_finalized(Model(elementwise_chain(12))).redefined is None  # (inferred whole: no cones)
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 4)
    m = Model(elementwise_chain(12))
    assert m.known_type("v5") is not None and m.types_by_cone  # (a cone query)
    g = edited_and_finalized(m)
    assert g.redefined is not None and g.producer["v4"].input[0] in g.redefined


def test_a_node_a_merge_rewired_is_kept_in_the_table_though_it_reads_a_value_alone():
    """q = Add(v, yb) absorbs its twin p, then a merge rewires it to Add(v, ya): v has no other reader now,
    but v was seeded before, so q must still be keyed anew, or r, rewired to Add(v, ya) a generation later
    (its rarest input v, already seeded), finds nothing. Skipping nodes that read a value alone skips only
    nodes no merge of the run rewired."""
    N = helper.make_node
    nodes = [N("Sigmoid", ["x"], ["s1"]), N("Sigmoid", ["x"], ["s2"]), N("Relu", ["x"], ["w1"]), N("Relu", ["x"], ["w2"]),
             N("Cos", ["s1"], ["ya"]), N("Cos", ["s2"], ["yb"]), N("Neg", ["w1"], ["u1"]), N("Neg", ["w2"], ["u2"]),
             N("Exp", ["u1"], ["v"]), N("Exp", ["u2"], ["v2"]), N("Add", ["v", "yb"], ["q"]), N("Add", ["v", "yb"], ["p"]),
             N("Add", ["v2", "ya"], ["r"]), N("Sum", ["p", "q", "r"], ["out"])]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3])  # noqa: E731
    m = helper.make_model(helper.make_graph(nodes, "rewired", [vi("x")], [vi("out")]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    model = Model(m)
    r = Dedupe().run(model, Options())
    g = model.graph
    assert "merged 7 duplicate nodes" in r.notes[0]
    assert [n.output[0] for n in g.live_nodes() if n.op_type == "Add"] == ["q"]


def _loop_with_head(tmp_path, head: list[str]) -> onnx.ModelProto:
    """benchmarks/graphs.loop_with_head with its per-step head replaced by ``head`` (op types, each on the one
    before, ``Mul``/``Add`` by 0.5), the first reading the new h, the last the scan output's ``yt``."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from graphs import loop_with_head
    finally:
        sys.path.remove(str(root / "benchmarks"))
    path = str(tmp_path / "loophead.onnx")
    loop_with_head(path, 20)
    m = onnx.load(path)
    body = next(n for n in m.graph.node if n.op_type == "Loop").attribute[0].g
    cell = [n for n in body.node if n.output[0] in ("xt", "xw", "hr", "s", "s2", "hn", "cond_out")]
    prev, nodes = "hn", []
    for k, op in enumerate(head):
        out = "yt" if k == len(head) - 1 else f"e{k}"
        nodes.append(helper.make_node(op, [prev, "half"] if op in ("Mul", "Add") else [prev], [out]))
        prev = out
    del body.node[:]
    body.node.extend(cell + nodes)
    return m


@pytest.mark.parametrize("head, a_state", [(["Identity"] * 40, True), (["Identity"] * 100, False),
                                           (["Mul", "Add", "Tanh", "Sigmoid"] * 75, False)])
def test_a_long_per_step_output_is_not_evaluated_as_a_state(tmp_path, monkeypatch, head, a_state):
    """A Loop's per-step output more than ``COPY_OPS`` ops beyond the step's states is a head, without its
    maths evaluated (a 100,000-op head took 1 s to learn it is none of the states); within the bound it is
    evaluated, and 40 Identities of h are h. Either way the Loop fuses, and the model computes what it did."""
    from helpers import session
    from rnnfuse import optimize
    from rnnfuse.passes import loop_heads

    from rnnfuse.symbolic.evaluator import StepEvaluator

    asked, evaluated = [], []
    owner = loop_heads.owner
    monkeypatch.setattr(loop_heads, "owner", lambda layers, name: asked.append(name) or owner(layers, name))
    eval_node = StepEvaluator._eval_node
    monkeypatch.setattr(StepEvaluator, "_eval_node", lambda ev, n, ins: evaluated.append(n.op_type) or eval_node(ev, n, ins))
    m = _loop_with_head(tmp_path, head)
    fused, report = optimize(m)
    assert len(report.fused) == 1, report.to_text()
    assert ("yt" in asked) == a_state, asked
    # (the head's ops evaluated symbolically: all of a state's copy, at most COPY_OPS of a head)
    n_head = sum(op in head for op in evaluated)  # (the cell's own Add and Tanh among them)
    assert (n_head >= len(head)) if a_state else (n_head <= loop_heads.COPY_OPS + 8), (n_head, evaluated[:20])
    if "Tanh" in head:  # (a head: its ops applied once to every step after the RNN; Identities are dropped)
        assert sum(n.op_type in head for n in fused.graph.node) >= len(head)
    x = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32)
    for a, b in zip(session(fused).run(None, {"x": x}), session(m).run(None, {"x": x})):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_masked_copy_of_a_state_far_from_it_is_still_the_state():
    """The Keras example's forward GRU writes its masked h to the per-step TensorArray through 70 Identities:
    further than ``COPY_OPS`` from the states, but in a masked step no output is a head, so each is evaluated
    in full and still proven the state (it was declined while the bound applied to masked steps too)."""
    from pathlib import Path

    from helpers import session
    from rnnfuse import optimize

    m = onnx.load(str(Path(__file__).resolve().parents[1] / "examples" / "keras_masked_bigru_lstm.onnx"))
    _, plain = optimize(m)
    loop = next(n for n in m.graph.node if n.op_type == "Loop" and "forward_gru" in n.name)
    body = loop.attribute[0].g
    write = next(n for n in body.node if n.output[0].endswith("TensorListSetItem:0"))
    src, at = write.input[0], list(body.node).index(write)
    for k in range(70):
        body.node.insert(at + k, helper.make_node("Identity", [src], [f"copy{k}"]))
        src = f"copy{k}"
    write.input[0] = src
    fused, report = optimize(m)
    assert len(report.fused) == len(plain.fused) and not report.declined, report.to_text()
    x = np.random.default_rng(0).standard_normal((3, 7, 4)).astype(np.float32)
    x[1, 4:] = 0.0  # (padded steps: Keras masks a step whose features are all zero)
    name = m.graph.input[0].name
    for a, b in zip(session(fused).run(None, {name: x}), session(m).run(None, {name: x})):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _far_copy_loop(form: str, copies: int) -> onnx.ModelProto:
    """A Loop over x's steps whose per-step output is a state copied through ``copies`` Identities: ``c_last``,
    an LSTM's c stacked and read only at its last step (``cs[-1]``); ``sequence``, a tanh cell's h inserted
    into a sequence and stacked with ConcatFromSequence (TorchScript's form)."""
    rng = np.random.default_rng(0)
    vi, f, feat, hid = helper.make_tensor_value_info, TensorProto.FLOAT, 3, 4
    gates = 4 if form == "c_last" else 1
    body = [helper.make_node("Gather", ["x", "it"], ["xt"], axis=0), helper.make_node("MatMul", ["xt", "W"], ["xw"]),
            helper.make_node("MatMul", ["h", "R"], ["hr"]), helper.make_node("Add", ["xw", "hr"], ["s"]),
            helper.make_node("Identity", ["cond"], ["cond_out"])]
    if form == "c_last":
        body += [helper.make_node("Split", ["s", "sp"], ["gi", "go", "gf", "gc"], axis=1),
                 helper.make_node("Sigmoid", ["gi"], ["i"]), helper.make_node("Sigmoid", ["go"], ["o"]),
                 helper.make_node("Sigmoid", ["gf"], ["f"]), helper.make_node("Tanh", ["gc"], ["cc"]),
                 helper.make_node("Mul", ["f", "c"], ["fc"]), helper.make_node("Mul", ["i", "cc"], ["ic"]),
                 helper.make_node("Add", ["fc", "ic"], ["cn"]), helper.make_node("Tanh", ["cn"], ["tc"]),
                 helper.make_node("Mul", ["o", "tc"], ["hn"])]
        src = "cn"
    else:
        body.append(helper.make_node("Tanh", ["s"], ["hn"]))
        src = "hn"
    for k in range(copies):
        body.append(helper.make_node("Identity", [src], [f"copy{k}"]))
        src = f"copy{k}"
    state = [vi("h", f, ["B", hid])] + ([vi("c", f, ["B", hid])] if form == "c_last" else [])
    new = [vi("hn", f, ["B", hid])] + ([vi("cn", f, ["B", hid])] if form == "c_last" else [])
    if form == "c_last":
        body.append(helper.make_node("Identity", [src], ["ct"]))
        ins, outs, extra = state, new + [vi("ct", f, ["B", hid])], []
    else:
        body += [helper.make_node("Unsqueeze", [src, "ax0"], ["u"]), helper.make_node("SequenceInsert", ["seq", "u"], ["seq_out"])]
        ins = state + [helper.make_tensor_sequence_value_info("seq", f, None)]
        outs, extra = new + [helper.make_tensor_sequence_value_info("seq_out", f, None)], [numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    graph = helper.make_graph(body, "body", [vi("it", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, [])] + ins,
                              [vi("cond_out", TensorProto.BOOL, [])] + outs, extra)
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("W", (feat, gates * hid)), ("R", (hid, gates * hid)))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("sp", [hid] * 4), ("i0", 0), ("i1", 1), ("iH", [hid]), ("one", [1]), ("last", -1))]
    inits += [numpy_helper.from_array(np.zeros((1, 1), np.float32), "zero"), numpy_helper.from_array(np.array(True), "true")]
    top = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["T"], axis=0),
           helper.make_node("Gather", ["xs", "i1"], ["B1"], axis=0), helper.make_node("Reshape", ["B1", "one"], ["B2"]),
           helper.make_node("Concat", ["B2", "iH"], ["hshape"], axis=0), helper.make_node("Expand", ["zero", "hshape"], ["h0"])]
    if form == "c_last":
        top += [helper.make_node("Loop", ["T", "true", "h0", "h0"], ["hT", "cT", "cs"], body=graph),
                helper.make_node("Gather", ["cs", "last"], ["y"], axis=0)]
        out = vi("y", f, ["B", hid])
    else:
        top += [helper.make_node("SequenceEmpty", [], ["s0"], dtype=f),
                helper.make_node("Loop", ["T", "true", "h0", "s0"], ["hT", "seqT"], body=graph),
                helper.make_node("ConcatFromSequence", ["seqT"], ["y"], axis=0)]
        out = vi("y", f, ["T", "B", hid])
    m = helper.make_model(helper.make_graph(top, "far", [vi("x", f, ["T", "B", feat])], [out], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("form", ["c_last", "sequence"])
def test_a_state_copied_far_is_looked_at_again_when_its_step_declines(form):
    """A state copied through 70 Identities is taken for a head by the far-from-states shortcut, and the head
    path declines these forms (c read at its last step; a sequence stacked by ConcatFromSequence): the Loop is
    analysed again with every output evaluated, and fuses as it did before the shortcut."""
    from helpers import session
    from rnnfuse import optimize

    for copies in (0, 70):
        m = _far_copy_loop(form, copies)
        fused, report = optimize(m)
        assert len(report.fused) == 1 and not report.declined, report.to_text()
        assert not any(n.op_type == "Loop" for n in fused.graph.node)
        x = np.random.default_rng(1).standard_normal((5, 2, 3)).astype(np.float32)
        np.testing.assert_allclose(session(fused).run(None, {"x": x})[0], session(m).run(None, {"x": x})[0], atol=1e-5)


@pytest.mark.parametrize("front", ["scan", "loop"])
def test_a_step_that_is_no_cell_is_declined_before_its_outputs_are_evaluated(front, monkeypatch):
    """A Scan's or Loop's carried state is recognised as a native cell (or not) before its per-step outputs
    are evaluated: a step that is no cell (here a square where the RNN has ``tanh``) is declined on its cell,
    its head never evaluated (4,545 such Scans with an 18-op head spent a quarter of their analysis there);
    the same step with ``tanh`` is analysed on to its head and fused."""
    import builders_loops as BL
    import rnnfuse.passes.loop as loop_pass
    import rnnfuse.passes.scan as scan_pass

    module = scan_pass if front == "scan" else loop_pass
    asked = []
    real = module.state_output
    monkeypatch.setattr(module, "state_output", lambda layers, name, keys: asked.append(name) or real(layers, name, keys))
    model = BL.build_head(BL.HeadOpts(head="softmax", front=front))
    m, report, _ = _run(model)
    assert report.modified and asked, report.findings
    model = BL.build_head(BL.HeadOpts(head="softmax", front=front))  # (the run rewrote the first in place)
    body = next(n for n in model.graph.node if n.op_type in ("Scan", "Loop")).attribute[0].g
    act = next(n for n in body.node if n.op_type == "Tanh")
    act.op_type, act.input[:] = "Mul", [act.input[0], act.input[0]]  # (a square: maths, but no cell's)
    asked.clear()
    m, report, _ = _run(model)
    declined = [f for f in report.findings if f.pass_name == front]
    assert not report.modified and len(declined) == 1 and declined[0].status == "declined", report.findings
    assert asked == [], asked


def _steps_beside_unrelated(T: int, unrelated: int) -> onnx.ModelProto:
    """A T-step tanh RNN unrolled over x's slices, and beside it ``unrelated`` Relus on another input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "R")]
    nodes, h = [], "h0"
    for t in range(T):
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"i{t}"))
        nodes += [helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0),
                  helper.make_node("MatMul", [f"x{t}", "W"], [f"a{t}"]), helper.make_node("MatMul", [h, "R"], [f"b{t}"]),
                  helper.make_node("Add", [f"a{t}", f"b{t}"], [f"s{t}"]), helper.make_node("Tanh", [f"s{t}"], [f"hs{t}"])]
        h = f"hs{t}"
    cur = "z"
    for k in range(unrelated):
        nodes.append(helper.make_node("Relu", [cur], [f"z{k}"]))
        cur = f"z{k}"
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "beside", [vi("x", TensorProto.FLOAT, [T, "B", 4]), vi("h0", TensorProto.FLOAT, ["B", 3]),
                                            vi("z", TensorProto.FLOAT, ["B", 3])],
                          [vi(h, TensorProto.FLOAT, ["B", 3]), vi(cur, TensorProto.FLOAT, ["B", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_steps_found_through_their_cells_cost_the_nodes_the_slices_reach(monkeypatch):
    """The search for step inputs threaded through their cells (passes/unrolled/step_inputs.py) looks at the
    nodes computed from the slices, not at the rest of the graph: as many questions beside 50 unrelated nodes
    as beside 5,000 (it asked each of a 100k-node graph's nodes three times, for a 16-step chain)."""
    import rnnfuse.passes.unrolled.step_inputs as step_inputs

    counts = {}
    for unrelated in (50, 5000):
        asked = []
        real = step_inputs.dynamic_inputs
        monkeypatch.setattr(step_inputs, "dynamic_inputs", lambda g, n: asked.append(n.name) or real(g, n))
        g = Model(_steps_beside_unrelated(6, unrelated)).graph
        fams = {("x", 0): {t: f"x{t}" for t in range(6)}}
        found = step_inputs.virtual_families(g, g.ordered_live_nodes(), fams)
        counts[unrelated] = len(asked)
        assert found == []  # (the slices in step order: the slice families' chain, not a virtual one)
        monkeypatch.undo()
    assert 0 < counts[50] == counts[5000], counts


def _scans_beside_a_chain(scans: int, start: str = "scan_init") -> onnx.ModelProto:
    """The 6-step unrolled tanh RNN of ``_steps_beside_unrelated`` (fused: a second round of passes follows),
    and beside it ``scans`` Scans in a row over z [T, B, 3], each carrying ``s' = (s @ w) * s + z_t`` (no native
    cell: declined), the first one's initial state ``start``: a graph input of its own, ``h0`` (which the chain's
    first step reads too) or ``hs5`` (the chain's final h)."""
    model = _steps_beside_unrelated(6, 0)
    g = model.graph
    vi = helper.make_tensor_value_info
    body = helper.make_graph([helper.make_node("MatMul", ["s_in", "w"], ["sw"]), helper.make_node("Mul", ["sw", "s_in"], ["sq"]),
                              helper.make_node("Add", ["sq", "zt"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y"])],
                             "body",
                             [vi("s_in", TensorProto.FLOAT, ["B", 3]), vi("zt", TensorProto.FLOAT, ["B", 3])],
                             [vi("s_out", TensorProto.FLOAT, ["B", 3]), vi("y", TensorProto.FLOAT, ["B", 3])])
    g.initializer.append(numpy_helper.from_array(np.full((3, 3), 0.2, np.float32), "w"))
    del g.input[2:]
    g.input.extend([vi("zs", TensorProto.FLOAT, [5, "B", 3]), vi("scan_init", TensorProto.FLOAT, ["B", 3])])
    state = start
    for k in range(scans):
        g.node.append(helper.make_node("Scan", [state, "zs"], [f"sN{k}", f"ys{k}"], body=body, num_scan_inputs=1,
                                       name=f"scan{k}"))
        state = f"sN{k}"
    del g.output[1:]
    g.output.append(vi(state, TensorProto.FLOAT, ["B", 3]))
    return model


@pytest.mark.parametrize("start, again", [("scan_init", set()), ("h0", {0}), ("hs5", set(range(8)))])
def test_a_scan_declined_last_round_is_not_analysed_again_unless_an_edit_reached_it(start, again, monkeypatch):
    """A fusion starts a second round of passes: the Scans it did not reach keep last round's decline, with
    its reason, and are not analysed again (rnnfuse.kept_declines). Analysed again: a Scan that reads what the
    fused chain read (its readers changed), and one whose initial state the chain computes, with every Scan
    after it in the row."""
    import rnnfuse.passes.scan as scan_pass

    analysed = []
    real = scan_pass.scan_recurrence
    monkeypatch.setattr(scan_pass, "scan_recurrence", lambda g, node: analysed.append(node.name) or real(g, node))
    m, report, _ = _run(_scans_beside_a_chain(8, start))
    assert report.rounds == 2 and any(f.status == "fused" for f in report.findings), report.to_text()
    declined = {f.where: f.reason for f in report.findings if f.pass_name == "scan"}
    assert sorted(declined) == [f"scan{k}" for k in range(8)] and len(set(declined.values())) == 1, declined
    counts = {k: analysed.count(f"scan{k}") for k in range(8)}
    assert counts == {k: 2 if k in again else 1 for k in range(8)}, counts


def test_two_scans_without_named_final_states_are_kept_apart():
    """Two unnamed Scans whose final states are unused (their first outputs are empty) are not one node to the
    kept declines: the second, a tanh RNN, is analysed and fused though the first, no cell, was declined."""
    import rnnfuse

    vi = helper.make_tensor_value_info
    ios = ([vi("s_in", TensorProto.FLOAT, ["B", 3]), vi("zt", TensorProto.FLOAT, ["B", 3])],
           [vi("s_out", TensorProto.FLOAT, ["B", 3]), vi("y", TensorProto.FLOAT, ["B", 3])])
    odd = helper.make_graph([helper.make_node("MatMul", ["s_in", "w"], ["sw"]), helper.make_node("Mul", ["sw", "s_in"], ["sq"]),
                             helper.make_node("Add", ["sq", "zt"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y"])],
                            "odd", *ios)
    rnn = helper.make_graph([helper.make_node("MatMul", ["zt", "W"], ["a"]), helper.make_node("MatMul", ["s_in", "R"], ["b"]),
                             helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Tanh", ["s"], ["s_out"]),
                             helper.make_node("Identity", ["s_out"], ["y"])], "rnn", *ios)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.full((3, 3), 0.2, np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "R")]
    nodes = [helper.make_node("Scan", ["s0", "zs"], ["", "ysA"], body=odd, num_scan_inputs=1),
             helper.make_node("Scan", ["s0", "zs"], ["", "ysB"], body=rnn, num_scan_inputs=1)]
    g = helper.make_graph(nodes, "g", [vi("zs", TensorProto.FLOAT, [5, "B", 3]), vi("s0", TensorProto.FLOAT, ["B", 3])],
                          [vi("ysA", TensorProto.FLOAT, [5, "B", 3]), vi("ysB", TensorProto.FLOAT, [5, "B", 3])], inits)
    fused, report = rnnfuse.optimize(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [f.status for f in report.findings if f.pass_name == "scan"].count("fused") == 1, report.to_text()
    assert "RNN" in [n.op_type for n in fused.graph.node]


def test_a_decline_for_want_of_a_type_is_not_kept():
    """1,000 Loops, each x a Transpose of its own input: the first round infers types cone by cone and its
    budget runs out part way, so the Loops after that are declined for want of x's type (a trip count not
    proven to be the time steps). A round whose type questions were not all answered whole keeps no decline:
    the next round analyses them again and fuses every one."""
    import rnnfuse

    vi = helper.make_tensor_value_info
    rng = np.random.default_rng(0)
    nodes, inits, ins, outs = [], [], [], []
    for k in range(1000):
        body = helper.make_graph([
            helper.make_node("Gather", [f"x{k}", "i"], ["xt"], axis=0),
            helper.make_node("MatMul", ["xt", f"W{k}"], ["a"]), helper.make_node("MatMul", ["h", f"R{k}"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Tanh", ["s"], ["h2"]),
            helper.make_node("Identity", ["cond"], ["c2"]), helper.make_node("Identity", ["h2"], ["y"])],
            f"body{k}", [vi("i", TensorProto.INT64, []), vi("cond", TensorProto.BOOL, []), vi("h", TensorProto.FLOAT, [2, 3])],
            [vi("c2", TensorProto.BOOL, []), vi("h2", TensorProto.FLOAT, [2, 3]), vi("y", TensorProto.FLOAT, [2, 3])])
        inits += [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), f"W{k}"),
                  numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), f"R{k}"),
                  numpy_helper.from_array(np.array(5, np.int64), f"M{k}"), numpy_helper.from_array(np.array(True), f"c{k}"),
                  numpy_helper.from_array(np.zeros((2, 3), np.float32), f"h0_{k}")]
        ins.append(vi(f"in{k}", TensorProto.FLOAT, [2, 5, 4]))
        nodes += [helper.make_node("Transpose", [f"in{k}"], [f"x{k}"], perm=[1, 0, 2]),
                  helper.make_node("Loop", [f"M{k}", f"c{k}", f"h0_{k}"], [f"hN{k}", f"ys{k}"], body=body, name=f"loop{k}")]
        outs.append(vi(f"ys{k}", TensorProto.FLOAT, [5, 2, 3]))
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs, inits), opset_imports=[helper.make_opsetid("", 17)])
    fused, report = rnnfuse.optimize(model, validate=False)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Loop") == 0 and ops.count("RNN") == 1000, report.to_text()[:400]


def test_clean_ups_of_a_first_round_that_fused_nothing_are_not_written_back(monkeypatch):
    """A first round that fused nothing ends the run, and its clean-ups are never kept (guard.settle hands back
    the input): for the callers that settle (the CLI, ``Pipeline.__call__``) Dedupe's merge of two twins is not
    written back into the proto (no liveness walk, sort or write-back; a transformer's 15,520 merged duplicates
    cost 0.8 s to be dropped). A caller of ``run`` keeping the model gets it written; a run that fuses writes
    its rounds back, as before."""
    finalized = []
    real = Graph.finalize
    monkeypatch.setattr(Graph, "finalize", lambda g, *a, **k: finalized.append(1) or real(g, *a, **k))
    nodes = [helper.make_node("Tanh", ["x"], ["a"]), helper.make_node("Tanh", ["x"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    g = helper.make_graph(nodes, "twins", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])])
    twins = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    as_given = twins.SerializeToString()
    model = Model(twins)
    report = Pipeline.default().run(model, Options(), write_unfused=False)
    assert any(r.name == "dedupe" and r.modified for r in report.passes), report.to_text()
    assert not report.fused and finalized == [], report.to_text()
    out, report = Pipeline.default()(onnx.load_from_string(as_given))  # (the API: the input back, no write)
    assert not report.fused and finalized == [] and out.SerializeToString() == as_given
    model = Model(onnx.load_from_string(as_given))  # (a caller keeping the model: the clean-ups written)
    Pipeline.default().run(model, Options())
    assert finalized == [1] and [n.op_type for n in model.proto.graph.node] == ["Tanh", "Add"]
    finalized.clear()
    report = Pipeline.default().run(Model(B.build(_chain_opts(6))[0]), Options(), write_unfused=False)
    assert report.fused and finalized, report.to_text()


def test_double_time_reversals_are_cancelled_in_one_filter(monkeypatch):
    """Every time reversal reads the same Slice bounds (Dedupe makes them one), so their reader lists hold
    every flip; filtering them at each flip removed was quadratic (20,000 double reversals: 47 s). Long lists
    are filtered once at the end, and come out exact."""
    from rnnfuse.passes.flips import CancelFlips

    n, vi = 100, helper.make_tensor_value_info
    inits = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in (("s", -1), ("e", -(2**63)), ("ax", 0), ("st", -1))]
    nodes, outs = [], []
    for i in range(n):
        inits.append(numpy_helper.from_array(np.full(4, i, np.float32), f"w{i}"))
        nodes += [helper.make_node("Mul", ["x", f"w{i}"], [f"a{i}"]),
                  helper.make_node("Slice", [f"a{i}", "s", "e", "ax", "st"], [f"f{i}"]),
                  helper.make_node("Slice", [f"f{i}", "s", "e", "ax", "st"], [f"g{i}"]),
                  helper.make_node("Tanh", [f"g{i}"], [f"o{i}"])]
        outs.append(f"o{i}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    g = helper.make_graph(nodes, "double_flips", [vi("x", TensorProto.FLOAT, ["T", "B", 4])],
                          [vi("y", TensorProto.FLOAT, ["T", "B", 4])], inits)
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    res, filtered = _run_counting_list_filters(monkeypatch, CancelFlips(), m)
    assert res.modified and filtered == [{"s", "e", "ax", "st"}]
    for bound in ("s", "e", "ax", "st"):  # (the first Slice of each pair is left, dead, for the prune)
        readers = m.graph.uses(bound)
        assert len(readers) == n and all(m.graph.alive(r) and r.output[0].startswith("f") for r in readers)
    assert sorted(r.input[0] for r in m.graph.nodes_of("Tanh") if m.graph.alive(r)) == sorted(f"a{i}" for i in range(n))


def test_masks_from_lengths_are_read_again_in_one_filter(monkeypatch):
    """Every step's mask of a chain masked from a lengths input compares the lengths with its step index;
    once fused, each becomes a Gather of the whole mask in place. The lengths' reader list (every step's
    comparison) is filtered once for all of them, not once a step (quadratic: 1 s at 10,000 steps)."""
    from rnnfuse import optimize
    from rnnfuse.graph_edit import Graph as EditGraph
    from rnnfuse.graph_index import GraphIndex

    T = 48
    unindexed: list[str] = []
    real_unindex, real_drop = GraphIndex._unindex, EditGraph._drop_readers
    monkeypatch.setattr(GraphIndex, "_unindex", lambda self, n, defer=None: (
        unindexed.append(n.op_type) if "lengths" in n.input else None) or real_unindex(self, n, defer))
    dropped: list[int] = []
    monkeypatch.setattr(EditGraph, "_drop_readers", lambda self, names, gone: (
        dropped.append(len(gone)) if "lengths" in names else None) or real_drop(self, names, gone))
    model, _ = B.build(B.Opts(op="RNN", front="chain", mask="where", mask_rank=2, lengths="lt", static_T=T))
    _, report = optimize(model)
    assert [f.status for f in report.findings if f.pass_name == "unrolled"] == ["fused"], report.to_text()
    assert T in dropped and len(unindexed) < 4, (dropped, unindexed)


def test_giving_up_a_graph_output_keeps_the_producers_reads_indexed(monkeypatch):
    """A rewrite replacing a graph output renames its old producer's output: the node reads what it read, so
    no reader list of its inputs is filtered (11,000 stacked Loops read one trip count: filtering its list at
    each Loop whose final state is an output was quadratic). n_uses counts a twice-listed output twice."""
    from rnnfuse.graph_index import GraphIndex

    vi, n = helper.make_tensor_value_info, 80
    nodes = [helper.make_node("Mul", ["x", "k"], [f"y{i}"]) for i in range(n)]
    outs = [vi(f"y{i}", TensorProto.FLOAT, [2]) for i in range(n)] + [vi("y0", TensorProto.FLOAT, [2])]
    g = helper.make_graph(nodes, "outs", [vi("x", TensorProto.FLOAT, [2]), vi("k", TensorProto.FLOAT, [2])], outs)
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    gr = m.graph
    assert gr.n_uses("y0") == 2 and gr.n_uses("y1") == 1 and gr.n_uses("x") == n
    unindexed = []
    real = GraphIndex._unindex
    monkeypatch.setattr(GraphIndex, "_unindex", lambda self, node, defer=None: unindexed.append(node) or real(self, node, defer))
    for i in range(1, n):
        new = gr.add_node("Neg", ["x"])[0]
        gr.replace_uses(f"y{i}", new)
    assert unindexed == []
    assert len(gr.uses("x")) == 2 * n - 1 and len(gr.uses("k")) == n
    muls = [node for node in gr.nodes if node.op_type == "Mul"]
    assert [node.output[0].split("/")[0] for node in muls] == [f"y{i}" for i in range(n)]
    for old in muls[1:]:
        assert old.output[0].endswith("/detached") and gr.producer[old.output[0]] is old
    for i in range(1, n):
        assert gr.producer[f"y{i}"].op_type in ("Neg", "Identity") and f"y{i}" in gr.output_names


def test_mask_overrides_rename_every_mask_in_one_walk(monkeypatch):
    """The check model reads each overridden mask's pattern instead, in its nodes and in what their subgraphs
    capture (nested ones too) and output; every mask's reads are renamed in one walk of the nodes (a walk per
    mask was quadratic: 400 masked Loops over one trip count, 11.6 s)."""
    import rnnfuse.protos as protos
    from rnnfuse import validate

    vi = helper.make_tensor_value_info
    inner = helper.make_graph([helper.make_node("Not", ["m1"], ["n1"])], "inner", [], [vi("m2", TensorProto.BOOL, [2])])
    body = helper.make_graph([helper.make_node("If", ["c"], ["o"], then_branch=inner, else_branch=inner),
                              helper.make_node("And", ["m0", "o"], ["a"])], "body", [], [vi("a", TensorProto.BOOL, [2])])
    keep = [helper.make_node("And", ["m0", "m1"], ["x"]), helper.make_node("Or", ["x", "m2"], ["y"]),
            helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body)]
    visited = []
    real = protos.has_subgraph
    monkeypatch.setattr(protos, "has_subgraph", lambda n: visited.append(n.op_type) or real(n))
    patterns, overrides, _ = validate._mask_overrides(keep, ["m0", "m1", "m2"])
    # (each node once for the three masks: 3 in keep, 2 in each of the outer If's two branches, 1 in each of
    # the four inner branches)
    assert len(visited) == 3 + 2 * 2 + 4 * 1, visited
    assert list(keep[0].input) == ["__rnnfuse_mask_0", "__rnnfuse_mask_1"]
    assert list(keep[1].input) == ["x", "__rnnfuse_mask_2"]
    for branch in keep[2].attribute:
        assert list(branch.g.node[1].input) == ["__rnnfuse_mask_0", "o"]
        for nested in branch.g.node[0].attribute:
            assert list(nested.g.node[0].input) == ["__rnnfuse_mask_1"]
            assert nested.g.output[0].name == "__rnnfuse_mask_2"
    assert patterns == {f"m{k}": f"__rnnfuse_pattern_{k}" for k in range(3)} and len(overrides) == 3


def test_a_wide_node_rewritten_in_place_reads_its_new_inputs_again():
    """Renaming a read of a node of 64+ inputs uses the positions of its inputs, kept once read; a node
    rewritten in place reads other names at other positions, so a later rename must not use the old ones."""
    n, vi = 64, helper.make_tensor_value_info
    ins = [vi(f"a{i}", TensorProto.FLOAT, [1]) for i in range(n)] + [vi(v, TensorProto.FLOAT, [1]) for v in ("z", "w")]
    g = helper.make_graph([helper.make_node("Concat", [f"a{i}" for i in range(n)], ["y"], axis=0)], "wide", ins,
                          [vi("y", TensorProto.FLOAT, [n])])
    gr = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).graph
    cat = gr.producer["y"]
    gr.replace_uses("a0", "z")  # (the positions of cat's inputs are read, and kept)
    reversed_ = [f"a{i}" for i in range(n - 1, 0, -1)] + ["z"]
    gr.rewrite_in_place(cat, "Concat", reversed_, axis=0)
    gr.replace_uses("a1", "w")
    assert [i for i, x in enumerate(cat.input) if x == "w"] == [n - 2] and "a1" not in cat.input
    assert set(cat.input) == set(reversed_) - {"a1"} | {"w"}


def test_index_vectors_computed_from_the_inputs_values_fold_nothing(monkeypatch):
    """Whether a Gather takes its data's rows in order (a no-op drop-no-ops reads through) is not asked by
    folding the sizes beside index arithmetic on the inputs' values (``ids * Shape(z)[0]``): such a vector holds
    data, never a run 0..n-1, and each fold of a size may infer a cone's types (4,000 compacting Gathers of fused
    masked ops took 2.9 s at 90,000 nodes). Indices computed from sizes alone (``Range(0, Shape(y)[0])``) are
    still read, and that Gather is read through."""
    from rnnfuse import fold
    from rnnfuse.passes.cleanup import DropNoOps

    i64, f = TensorProto.INT64, TensorProto.FLOAT
    nodes = [helper.make_node("Shape", ["z"], ["zs"]), helper.make_node("Gather", ["zs", "zero"], ["m"], axis=0),
             helper.make_node("Mul", ["ids", "m"], ["idx"]), helper.make_node("Gather", ["y", "idx"], ["picked"], axis=0),
             helper.make_node("Shape", ["y"], ["ys"]), helper.make_node("Gather", ["ys", "zero"], ["n"], axis=0),
             helper.make_node("Range", ["zero", "n", "one"], ["all"]),
             helper.make_node("Gather", ["y", "all"], ["same"], axis=0),
             helper.make_node("Relu", ["picked"], ["out1"]), helper.make_node("Relu", ["same"], ["out2"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", i64, ["K"]),
                                           helper.make_tensor_value_info("y", f, ["N", 3]),
                                           helper.make_tensor_value_info("z", f, ["M", 3])],
                              [helper.make_tensor_value_info("out1", f, None),
                               helper.make_tensor_value_info("out2", f, None)], inits)
    m = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    folded = []
    real = fold.fold_output
    monkeypatch.setattr(fold, "fold_output", lambda g, node, name: folded.append(name) or real(g, node, name))
    res = DropNoOps().run(m, Options())
    assert res.modified and "read through 1 no-op" in res.notes[0], res.notes
    relus = {n.output[0]: n.input[0] for n in m.graph.nodes if n.op_type == "Relu"}
    assert relus == {"out1": "picked", "out2": "y"}, relus
    assert "m" not in folded and "zs" not in folded, folded


def test_the_kept_runtime_set_learns_what_a_round_computed_from_the_inputs(monkeypatch):
    """The set of values computed from the inputs' values is walked once for the run; a round's new nodes
    join it at finalize, by the same rule (a new Mul of x: runtime; a new Shape of x and what is computed from
    it and constants alone: not), without a second walk over the graph; it then equals a fresh walk."""
    from rnnfuse import dataflow

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["N", 3])],
                              [helper.make_tensor_value_info("y", f, None), helper.make_tensor_value_info("z", f, None),
                               helper.make_tensor_value_info("s", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    m = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    g = m.graph
    assert dataflow.runtime_values(g) == {"x", "r", "y"}
    g.add_node("Mul", ["r", "w"], outputs=["z"])
    (shape,) = g.add_node("Shape", ["x"])
    g.add_node("Mul", [shape, shape], outputs=["s"])
    walks = []
    real = dataflow.values_computed_from
    monkeypatch.setattr(dataflow, "values_computed_from", lambda *a: walks.append(1) or real(*a))
    g.finalize()
    assert dataflow.runtime_values(g) == {"x", "r", "y", "z"} == real(g, g.input_names)
    assert not walks


def test_a_body_node_rewritten_in_place_moves_only_its_owners_changed_reads(monkeypatch):
    """A node of a Loop body rewritten in place (a step's mask made to read its slice of a mask built for all
    steps) makes the Loop read its captures again. 200 Loops all read one trip count and capture one weight;
    each has a body node rewritten to read a new outer value instead. Only the reader lists of the names a
    Loop stops or starts reading change (each Loop was dropped from and added back to the trip count's list,
    a filter of all 200 per Loop): no list is filtered but the weight's, and the index equals a fresh one."""
    from rnnfuse.graph_edit import Graph as EditGraph

    n, f, vi = 200, TensorProto.FLOAT, helper.make_tensor_value_info
    inits = [numpy_helper.from_array(np.ones((1,), np.float32), w) for w in ("w", "v")]
    inits.append(numpy_helper.from_array(np.array(3, np.int64), "T"))
    nodes, cur = [], "x"
    for i in range(n):
        body = helper.make_graph([helper.make_node("Add", ["s", "w"], [f"s{i}"])], f"b{i}",
                                 [vi("it", TensorProto.INT64, []), vi("c", TensorProto.BOOL, []), vi("s", f, [1])],
                                 [vi("c", TensorProto.BOOL, []), vi(f"s{i}", f, [1])])
        nodes.append(helper.make_node("Loop", ["T", "", cur], [f"l{i}"], body=body))
        cur = f"l{i}"
    g = helper.make_graph(nodes, "loops", [vi("x", f, [1])], [vi(cur, f, [1])], inits)
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    gr = m.graph
    filtered: list[str] = []  # names whose reader list (of several) was filtered
    drop, unindex = EditGraph._drop_readers, EditGraph._unindex
    monkeypatch.setattr(EditGraph, "_drop_readers", lambda self, names, gone: filtered.extend(
        x for x in names if type(self.consumers.get(x)) is list) or drop(self, names, gone))
    monkeypatch.setattr(EditGraph, "_unindex", lambda self, node, defer=None: filtered.extend(
        x for x in set(node.input) | self.implicit_inputs(node) if type(self.consumers.get(x)) is list)
        or unindex(self, node, defer))
    for loop in gr.nodes_of("Loop"):
        body = gr.subgraph(loop)
        add = body.nodes[0]
        body.rewrite_in_place(add, "Add", ["s", "v"])
    assert set(filtered) <= {"w", "s"} and "T" not in filtered, sorted(set(filtered))
    fresh = Model(m.proto).graph
    for name in ("T", "w", "v", "x"):
        assert [id(r) for r in gr.uses(name)] == [id(r) for r in fresh.uses(name)], name
    assert len(gr.uses("v")) == n and not gr.uses("w") and len(gr.uses("T")) == n
