"""What the unrolled-chain front end keeps in memory: properties, never byte counts.

On a 100k-node unrolled export, memory goes to structures with an entry per tensor or per step. These tests
pin down the properties that keep them small: the runtime values hold the index's own strings (not the fresh
copy protobuf makes on each read of a name), the chain intervals keep no map of names at all, a step's
predicates and evaluations are freed by reference counting (no cycle keeps them, and what they reach, until
a full garbage collection), and fresh names do not need a set of every node name.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from onnx import TensorProto, helper

import builders as B
from rnnfuse.dataflow import runtime_values
from rnnfuse.graph import Model
from rnnfuse.naming import NameAllocator
from rnnfuse.passes.unrolled import FuseChains
from rnnfuse.passes.unrolled.chains import intervals
from rnnfuse.passes.unrolled.families import find_families, length_masks, mask_leaves
from rnnfuse.pipeline import Options


def _chain(T: int = 8, **kw) -> Model:
    model, _ = B.build(B.default_reverse_form(B.Opts(op="LSTM", front="chain", static_T=T, **kw)))
    return Model(model)


def _producer_strings(g) -> dict[str, int]:
    return {k: id(k) for k in g.producer}


def test_runtime_values_hold_the_index_strings():
    g = _chain().graph
    runtime = runtime_values(g)
    keys = _producer_strings(g)
    produced = [v for v in runtime if v in keys]
    assert len(produced) > 8
    assert all(id(v) == keys[v] for v in produced)  # the same string objects, not equal copies


@pytest.mark.parametrize("mask", ["none", "where"])
def test_intervals_keep_no_map_of_names_and_answer_as_the_walk_by_name(mask):
    from rnnfuse.passes.unrolled.chains import _intervals_by_name

    g = _chain(mask=mask).graph
    fams = find_families(g)
    order = g.ordered_live_nodes()
    (src, axis), fam = next((k, f) for k, f in fams.items() if g.model.elem_type(k[0]) != 9)
    leaves, _, _ = mask_leaves(g, fams, fam, length_masks(g))
    iv = intervals(g, order, leaves)
    assert iv.names is None  # (spans by producer: no entry per tensor name)
    # the same answers as a walk keeping a map of names (what an invalid graph, a name produced twice, gets)
    by_name = _intervals_by_name(g, order, leaves)
    assert by_name.names and iv.nodes == by_name.nodes
    for n in order:
        for x in [*n.input, *n.output]:
            assert iv.get(x) == by_name.get(x), x
    for t in sorted(fam):
        for end in (0, 1):
            assert list(iv.in_order(end, t)) == list(by_name.in_order(end, t))
            assert list(iv.in_order(end, t))


def test_intervals_of_a_name_produced_twice_are_the_last_writers():
    g = _chain().graph
    fams = find_families(g)
    order = g.ordered_live_nodes()
    (src, axis), fam = next((k, f) for k, f in fams.items() if g.model.elem_type(k[0]) != 9)
    leaves = {x: t for t, x in fam.items()}
    # a node with a span writes its output twice (invalid, but the walk must not assume otherwise)
    n = next(n for n in order if n.op_type == "Tanh" and intervals(g, order, leaves).nodes.get(id(n)))
    n.output.append(n.output[0])
    iv = intervals(g, order, leaves)
    assert iv.names is not None and iv.get(n.output[0]) == iv.nodes[id(n)]


def test_step_predicates_and_evaluations_are_freed_without_the_cycle_collector():
    model = _chain(T=12)
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        res = FuseChains().run(model, Options(validate=False))
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if collecting:
            gc.enable()
    assert any(f.status == "fused" for f in res.findings)
    left = [type(o).__name__ + ":" + getattr(o, "__qualname__", "") for o in garbage]
    # (each step's predicate reaches the intervals of the whole graph; a cycle would keep them past validation)
    assert not [s for s in left if "allowed" in s or "StepEval" in s or "_StepNodes" in s], left[:20]


def _packed(names: list[str]):
    return "\0" + "\0".join(names) + "\0", np.sort(np.array([hash(s) for s in names], np.int64))


def test_fresh_names_avoid_packed_names_exactly():
    a = NameAllocator({"x"}, _packed(["n", "n_1", "rnnfuse/Add", "a\0b"]))
    assert [a.fresh(h) for h in ("x", "n", "n", "rnnfuse/Add", "rnnfuse/Mul", "m")] == \
        ["x_1", "n_2", "n_3", "rnnfuse/Add_1", "rnnfuse/Mul", "m"]
    assert a.fresh("a\0b") == "a\0b_1" and a.fresh("a") == "a"  # (a name holding "\0" is one name)
    # a model optimized before meets its names again and again: after a few hits they become a set
    b = NameAllocator(set(), _packed(["h"] + [f"h_{i}" for i in range(1, 30)]))
    assert [b.fresh("h") for _ in range(2)] == ["h_30", "h_31"]
    assert b._packed is None and "h_29" in b.used


def test_a_filter_answers_most_candidates_and_no_packed_name_passes_it(monkeypatch):
    """Every packed name (their hashes negative and positive) is still taken; a fresh name costs a binary
    search of the hashes only when the filter cannot tell (about 1 in 16 candidates), not each time."""
    names = [f"node_{i}" for i in range(5000)]
    assert any(hash(s) < 0 for s in names) and any(hash(s) > 0 for s in names)
    a = NameAllocator(set(), _packed(names))
    searches = []
    real = np.searchsorted
    monkeypatch.setattr(np, "searchsorted", lambda *args: searches.append(1) or real(*args))
    for s in names:  # (asked through the filter: every packed name's bit is set)
        bit = hash(s) & a._filter_mask
        assert a._filter[bit >> 3] >> (bit & 7) & 1, s
    assert [a.fresh(s) for s in names[:5]] == [f"{s}_1" for s in names[:5]]  # (fewer hits than make a set)
    searches.clear()
    fresh = [a.fresh("rnnfuse/head/Mul") for _ in range(2000)]
    assert fresh[:2] == ["rnnfuse/head/Mul", "rnnfuse/head/Mul_1"] and len(set(fresh)) == 2000
    assert len(searches) < 2000 // 8, len(searches)


def test_model_names_avoid_node_names_without_holding_them():
    n1 = helper.make_node("Relu", ["x"], ["y"], name="rnnfuse/Relu")
    n2 = helper.make_node("Neg", ["y"], ["z"], name="z_node")
    g = helper.make_graph([n1, n2], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    model = Model(helper.make_model(g))
    names = model.names
    assert "rnnfuse/Relu" not in names.used and "z_node" not in names.used  # (packed, not a set of strings)
    assert names.fresh("rnnfuse/Relu") == "rnnfuse/Relu_1"
    assert names.fresh("z_node") == "z_node_1"
    assert names.fresh("y") == "y_1" and names.fresh("w") == "w"


@pytest.mark.parametrize("mask", ["none", "where"])
def test_step_memos_keep_what_is_signed_later_and_sign_alike(mask, monkeypatch):
    from rnnfuse.passes.unrolled.chains import find_chains
    from rnnfuse.passes.unrolled.roles import _ChainRoles
    from rnnfuse.signature import Signer

    def roles(trim: bool):
        if not trim:
            monkeypatch.setattr(_ChainRoles, "keep_memo", lambda self, k, names: None)
        g = _chain(T=10, mask=mask).graph
        g.prune()
        fams = find_families(g)
        order = g.ordered_live_nodes()
        (src, axis), fam = next((k, f) for k, f in fams.items() if g.model.elem_type(k[0]) != 9)
        leaves, mask_fam, mask_srcs = mask_leaves(g, fams, fam, length_masks(g))
        iv = intervals(g, order, leaves)
        chain = find_chains(g, fam, iv, mask_fam)[0]
        r = _ChainRoles(g, src, axis, chain, iv, Signer(g), mask_srcs)
        r.check_layout(), r.step_input(), r.thread_hidden_state()
        sizes = [len(r.memos[k][1]) for k in range(r.n - 2)]
        r.find_cell_state(), r.reference_step(), r.complete_cell_state()
        monkeypatch.undo()
        return r, sizes

    trimmed, kept = roles(True), roles(False)
    (a, sizes), (b, full) = trimmed, kept
    def walked(r):
        return [n.output[0] for n in r.g.nodes if id(n) in r.chain_nodes]

    assert a.sigs == b.sigs and a.series == b.series and walked(a) == walked(b) and walked(a)
    assert a.sigs["c"][1] is not None  # (the LSTM's c was signed: from the trimmed memo where trimmed)
    if mask == "none":
        assert max(sizes) <= 2 < min(full)  # (h and c of the step; the whole walk otherwise)
    else:
        assert sizes == full  # (a masked step's c is a select of what its h walk met: kept whole)


def _readers_by_walk(g) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for n in g.live_nodes():
        for i in dict.fromkeys(n.input):
            if i:
                out.setdefault(i, []).append(id(n))
    return out


def test_a_value_read_once_holds_its_reader_without_a_list():
    g = _chain().graph
    walked = _readers_by_walk(g)
    once = [v for v, r in walked.items() if len(r) == 1]
    assert len(once) > 20 and any(len(r) > 1 for r in walked.values())
    # (a list per value would hold ~90 bytes more for each of a 100k-node chain's values)
    assert not any(isinstance(g.consumers[v], list) for v in once)
    for v, r in walked.items():
        assert [id(n) for n in g.uses(v)] == r and g.n_uses(v) == len(r) + g.output_names.count(v)
    # edits keep the same answers as a fresh index: a rewired reader, a removed one, many removed at once
    tanh = next(n for n in g.nodes if n.op_type == "Tanh")
    other = next(n for n in g.nodes if n.op_type == "Sigmoid")
    g.replace_uses(tanh.output[0], other.output[0])
    g.remove_node(next(n for n in g.nodes if n.op_type == "Mul" and g.alive(n)))
    g.remove_nodes([n for n in g.nodes if n.op_type == "Add"][:70])
    walked = _readers_by_walk(g)
    for v in set(walked) | set(g.consumers):
        assert [id(n) for n in g.uses(v)] == walked.get(v, []), v
    assert g.uses(tanh.output[0]) == []


def test_constant_values_read_by_the_search_are_not_held_through_validation(monkeypatch):
    import rnnfuse.rewrite as rw

    model = _chain(T=10)
    g = model.graph
    step_consts = {n.output[0] for n in g.nodes if n.op_type == "Constant"}
    assert len(step_consts) >= 10
    held = []
    real = rw.validate

    def validate(graph, *a, **k):
        held.append({x for x, v in graph._arrays.items() if v is not None})
        return real(graph, *a, **k)

    monkeypatch.setattr(rw, "validate", validate)
    res = FuseChains().run(model, Options())
    assert any(f.status == "fused" for f in res.findings) and held
    # (the search read every step's Constants; validation and commit need none of them cached)
    assert not held[0] & step_consts
    g = _chain(T=10).graph
    c = sorted(step_consts)[0]
    before = g.const(c)
    g.release_arrays()
    assert not g._arrays and np.array_equal(g.const(c), before)  # (read again from its tensor when asked)


def test_removing_most_of_a_graph_holds_the_ids_of_what_stays_not_of_what_went():
    g = _chain(T=40).graph
    before = list(g.nodes)
    keep = [n for n in before if n.op_type == "Gather"][:3]
    going = [n for n in before if not any(n is k for k in keep)]
    going_ids = {id(n) for n in going}
    g.remove_nodes(going + going[:5])  # (repeats count once)
    removed = g._removed
    # (a set of the removed ids would hold an entry per step node of a fused 100k-node chain)
    assert not removed.ids and len(removed.live) == len(keep)
    assert all(not g.alive(n) for n in going) and all(g.alive(n) for n in keep)
    assert [id(n) for n in g.live_nodes()] == [id(n) for n in keep]
    assert [id(n) for n in g.nodes_of("Gather")] == [id(n) for n in keep]
    assert len(g._graveyard) == len(going_ids)
    # what is added after is live; what is removed after is not; the index is the survivors'
    (out,) = g.add_node("Identity", [keep[0].output[0]])
    added = g.producer[out]
    assert g.alive(added) and g.uses(keep[0].output[0]) == [added]
    g.remove_node(keep[1])
    assert not g.alive(keep[1]) and [id(n) for n in g.live_nodes()] == [id(keep[0]), id(keep[2]), id(added)]
    assert all(g.producer.get(o) is None for n in going for o in n.output)
    g.finalize()
    assert not g._removed and all(g.alive(n) for n in g.nodes)


class _Reads:
    """A node that records which of its repeated fields were read while empty (protobuf then gives the
    message's object a map of stand-ins for its unset fields, held as long as the object lives: the graph
    index holds every node's object)."""

    def __init__(self, node):
        self._node = node
        self.empty_reads: list[str] = []

    def __getattr__(self, name):
        value = getattr(self._node, name)
        if name in ("input", "output", "attribute") and len(value) == 0:
            self.empty_reads.append(name)
        return value


def test_the_index_spans_signatures_and_dedupe_keys_read_no_empty_field_of_a_node():
    from rnnfuse.passes.dedupe import _DedupeTable
    from rnnfuse.signature import _node_info

    g = _chain(T=8).graph
    nodes = [_Reads(n) for n in g.nodes]
    assert any(n.op_type == "Constant" for n in nodes) and any(not n._node.attribute for n in nodes)
    # (what a signature reads of each step node, the index pass, the intervals' walk)
    infos = [_node_info(n, {}, g.model.opset) for n in nodes]
    assert [i[:5] for i in infos] == [(n.input[:], n.output[:], n.op_type, n.domain,
                                      tuple(a.SerializeToString() for a in sorted(n.attribute, key=lambda a: a.name)))
                                      for n in g.nodes]
    g.producer.clear()
    g.consumers.clear()
    g._index_all(nodes)
    intervals(g, nodes, {})
    table = _DedupeTable(g)
    keys = [table.full(n) for n in nodes if n.op_type != "Constant"]
    assert len(keys) > 20 and any(k[1] for k in keys) and any(not k[1] for k in keys)
    assert not [(n.op_type, n.empty_reads) for n in nodes if n.empty_reads]


@pytest.mark.parametrize("kept", [0, 30])
def test_a_removed_loop_leaves_no_view_of_its_body_behind(kept):
    # a Loop whose body was looked at (its view indexes the body) is removed and replaced by a new node; with
    # no node kept the node list is rewritten whole at finalize (write_back gives no copies), with 30 the
    # kept messages are moved: either way its view goes, body and index (a fused Loop with a 100,000-op head
    # held both through the do-no-harm guard: 593 -> 540 MB peak)
    import weakref

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["s_in", "s_in"], ["s_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Relu", ["x" if k == 0 else f"r{k - 1}"], [f"r{k}"]) for k in range(kept)]
    last = f"r{kept - 1}" if kept else "x"
    nodes.append(helper.make_node("Loop", ["n", "c", last], ["y"], body=body))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(v, t, s) for v, t, s in
                                       (("x", TensorProto.FLOAT, [2]), ("n", TensorProto.INT64, []), ("c", TensorProto.BOOL, []))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    graph = m.graph
    loop = graph.nodes_of("Loop")[0]
    view = weakref.ref(graph.subgraph(loop))
    assert view() is not None and len(view().nodes) == 2
    graph.remove_node(loop)
    graph.add_node("Neg", [last], outputs=["y"])
    graph.finalize()
    loop = None
    gc.collect()
    assert not graph._subgraph_views and view() is None
    assert [n.op_type for n in graph.nodes] == ["Relu"] * kept + ["Neg"]
