"""Engine rules that every pass relies on and no single pass test pins down."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse.model
from rnnfuse.cone_types import ConeTypes
from rnnfuse.graph import Model


def _relu_chain():
    """x [2, 3] -> Relu -> y (no declared type) -> Relu -> out."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["out"])],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_one_type_rule_small_model_infers():
    m = Model(_relu_chain())
    assert m.known_type("y") == (TensorProto.FLOAT, [2, 3])
    assert m.shape("y") == [2, 3] and m.rank("y") == 2 and m.elem_type("y") == TensorProto.FLOAT
    assert m.shape("x") == [2, 3]


@pytest.mark.parametrize("first", ["shape", "known_type"])
def test_one_type_rule_large_model_infers_only_cones(first, monkeypatch):
    """A model too large to infer cheaply never runs whole-model inference, whichever query comes first (the
    type queries used to run it for shape/rank/elem_type but not for known_type): a query infers the nodes
    its tensor is computed from (rnnfuse.cone_types), within a budget; past it, declarations only -- and,
    for a rank or an element type, what the ops fix (op_shapes.op_rank, elem_types.op_elem_type: exact, no
    inference; the dims' symbols are inference's to name)."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 2)

    def no_inference(proto):
        raise AssertionError("whole-model inference ran on a large model")

    monkeypatch.setattr(rnnfuse.model, "infer_types", no_inference)
    m = Model(_relu_chain())
    getattr(m, first)("y")
    assert m.known_type("y") == (TensorProto.FLOAT, [2, 3])
    assert m.shape("y") == [2, 3] and m.rank("y") == 2 and m.elem_type("y") == TensorProto.FLOAT

    monkeypatch.setattr(rnnfuse.model, "ConeTypes", lambda model: ConeTypes(model, budget=0))
    m = Model(_relu_chain())
    getattr(m, first)("y")
    assert m.known_type("y") is None
    assert m.shape("y") is None and m.rank("y") == 2 and m.elem_type("y") == TensorProto.FLOAT  # (Relus of x)
    assert m.shape("x") == [2, 3]  # declared: known at any size
    m.declare("y", (TensorProto.FLOAT, [2, 3]))  # what an edit declares counts like the file
    assert m.rank("y") == 2 and m.known_type("y") == (TensorProto.FLOAT, [2, 3])


def _loops(n: int):
    """``n`` Loops in a row, each a Tanh twice of what it carries, a Mul between them (no value_info)."""
    nodes, cur = [], "x"
    for i in range(n):
        body = helper.make_graph(
            [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Tanh", ["v_in"], ["v_out"])], f"b{i}",
            [helper.make_tensor_value_info("it", TensorProto.INT64, []), helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None)])
        nodes += [helper.make_node("Loop", ["trip", "cond", cur], [f"l{i}"], body=body),
                  helper.make_node("Mul", [f"l{i}", "w"], [f"m{i}"])]
        cur = f"m{i}"
    inits = [numpy_helper.from_array(np.array(2, np.int64), "trip"), numpy_helper.from_array(np.array(True), "cond"),
             numpy_helper.from_array(np.ones(3, np.float32), "w")]
    g = helper.make_graph(nodes, "loops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [2, 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_many_subgraphs_skip_whole_inference(monkeypatch):
    """ONNX inference costs nodes x subgraphs (each subgraph gets every outer value's type): a model past
    CHEAP_INFERENCE_SCOPE_WORK answers from declarations and cones, like a model with too many nodes."""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_SCOPE_WORK", 1000)
    calls = []
    monkeypatch.setattr(rnnfuse.model, "infer_types", lambda proto: calls.append(1) or {})
    Model(_loops(3)).known_type("m0")  # (6 nodes x 3 subgraphs: whole inference)
    assert calls == [1]
    m = Model(_loops(40))  # (80 nodes x 40 subgraphs)
    assert m.known_type("m0")[0] == TensorProto.FLOAT and calls == [1]


def test_initializers_count_in_the_work_of_inferring_subgraphs(monkeypatch):
    """The values each subgraph is handed include the graph's initializers: 6 Loops in a graph of 12 nodes and
    1,203 initializers are past the bound (1,215 x 6), though its nodes alone are not (12 x 6). (1,600 Loops
    of a tanh cell each, 3 weights a Loop: 1.8 s of inference.)"""
    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_SCOPE_WORK", 1000)
    calls = []
    monkeypatch.setattr(rnnfuse.model, "infer_types", lambda proto: calls.append(1) or {})
    model = _loops(6)
    model.graph.initializer.extend(numpy_helper.from_array(np.ones(1, np.float32), f"unused{k}") for k in range(1200))
    m = Model(model)
    assert m.known_type("m0")[0] == TensorProto.FLOAT and calls == []


# -- ONNX arguments by opset (rnnfuse.op_args), through the folder that reads them ----------------------
def _fold(op, inputs, opset, n_out=1, **attrs):
    """Fold one node whose inputs are the given constants (None: an input left out)."""
    from rnnfuse import fold

    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    node = helper.make_node(op, names, [f"o{k}" for k in range(n_out)], **attrs)
    return fold.evaluate(node, list(inputs), opset)


def test_axes_attribute_before_13_input_from_13():
    x = np.zeros((1, 3, 1), np.float32)
    assert _fold("Squeeze", [x], 11, axes=[0])[0].shape == (3, 1)
    assert _fold("Squeeze", [x, np.array([2])], 13)[0].shape == (1, 3)
    assert _fold("Squeeze", [x], 13)[0].shape == (3,)  # no axes: every unit axis
    assert _fold("Unsqueeze", [x, np.array([-1])], 13)[0].shape == (1, 3, 1, 1)


def test_slice_attributes_before_10_inputs_with_defaults_from_10():
    x = np.arange(24).reshape(4, 6)
    assert np.array_equal(_fold("Slice", [x], 9, starts=[1], ends=[3], axes=[1])[0], x[:, 1:3])
    assert np.array_equal(_fold("Slice", [x], 9, starts=[1], ends=[3])[0], x[1:3])  # axes default to 0..
    assert np.array_equal(_fold("Slice", [x, np.array([1]), np.array([3])], 13)[0], x[1:3])
    full = [x, np.array([5]), np.array([0]), np.array([1]), np.array([-2])]
    assert np.array_equal(_fold("Slice", full, 13)[0], x[:, 5:0:-2])
    assert np.array_equal(_fold("Slice", [x, np.array([0]), np.array([4]), None, np.array([2])], 13)[0], x[0:4:2])


def test_split_sizes_attribute_before_13_input_from_13_equal_without():
    x = np.arange(7)
    assert [len(p) for p in _fold("Split", [x], 11, 2, split=[5, 2])] == [5, 2]
    assert [len(p) for p in _fold("Split", [x, np.array([1, 6])], 13, 2)] == [1, 6]
    assert [len(p) for p in _fold("Split", [x], 13, 2)] == [4, 3]


def test_clip_bounds_attributes_before_11_inputs_from_11():
    from rnnfuse import op_args

    node6 = helper.make_node("Clip", ["x"], ["y"], min=-1.0)
    assert op_args.clip_bounds(node6, 6, None) == (-1.0, float("inf"))
    node11 = helper.make_node("Clip", ["x", "", "hi"], ["y"])
    assert op_args.clip_bounds(node11, 11, lambda i: {2: 3.0}[i]) == (float("-inf"), 3.0)


# -- random inputs and padding patterns (rnnfuse.feeds), shared by validation and benchmarks ------------
@pytest.mark.parametrize("kind", ["post", "pre", "gappy"])
def test_validation_patterns_include_a_full_and_an_empty_row(kind):
    from rnnfuse.feeds import valid_steps

    P = valid_steps(kind, 7, 5, np.random.default_rng(0))
    assert P.shape == (7, 5) and P.dtype == np.bool_
    if kind != "gappy":
        assert P[:, 0].all()
    assert not P[:, 1].any()
    for b in range(5):  # post: valid then padded; pre: padded then valid
        col = P[:, b]
        if kind == "post":
            assert not (~col[:-1] & col[1:]).any()
        elif kind == "pre":
            assert not (col[:-1] & ~col[1:]).any()


@pytest.mark.parametrize("kind", ["post", "pre"])
def test_benchmark_patterns_keep_every_row_at_least_half(kind):
    from rnnfuse.feeds import valid_steps

    P = valid_steps(kind, 8, 6, np.random.default_rng(1), realistic=True)
    assert P[:, 0].all() and (P.sum(axis=0) >= 4).all()


def test_random_values_by_dtype():
    from rnnfuse.feeds import random_values

    rng = np.random.default_rng(0)
    assert random_values((2, 3), np.float32, rng).dtype == np.float32
    assert random_values((50,), np.bool_, rng, p_true=1.0).all()
    idx = random_values((200,), np.int64, rng, index_range=4, lowest_index=1)
    assert idx.min() >= 1 and idx.max() <= 3
    with pytest.raises(ValueError):
        from rnnfuse.feeds import valid_steps

        valid_steps("sideways", 3, 2, rng)


# -- the shape of the code: short functions, modules under 500 lines, imports one way --------------------
import ast  # noqa: E402
import pathlib  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
# "module.function" -> why it may be longer than MAX_FUNCTION_LINES (keep this empty if at all possible)
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _engine_modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for rnnfuse/ and passes/ (installed as rnnfuse.passes)."""
    mods = {}
    for top in ("rnnfuse", "passes"):
        for p in sorted((_ROOT / top).rglob("*.py")):
            parts = list(p.relative_to(_ROOT).with_suffix("").parts)
            if parts[0] == "passes":
                parts = ["rnnfuse"] + parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def test_no_function_over_80_lines():
    long = []
    for mod, p in _engine_modules().items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = n.end_lineno - n.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{mod}.{n.name}" not in LONG_FUNCTIONS_ALLOWED:
                    long.append(f"{p.relative_to(_ROOT)}:{n.lineno} {n.name} ({lines} lines)")
    assert not long, "split these into named steps (or list them with a reason): " + ", ".join(long)


def test_no_module_over_500_lines():
    big = [f"{p.relative_to(_ROOT)} ({n} lines)" for p in _engine_modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, "split these by idea: " + ", ".join(big)


def test_no_private_reach_ins():
    """``obj._name`` only on ``self`` / ``cls`` or where the module itself defines ``_name`` (a class reading
    another instance of itself): no module reaches into another's private state, nor into a library's."""
    found = []
    for p in _engine_modules().values():
        tree = ast.parse(p.read_text())
        defined = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls") or n.attr in defined:
                continue
            found.append(f"{p.relative_to(_ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert not found, "ask the owner for a public way: " + ", ".join(found)


def _module_imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the engine modules it imports at module level (imports inside functions load lazily and
    are not edges; ``from pkg import name`` is an edge to ``pkg.name`` when that is a module)."""
    edges = {}
    for mod, p in mods.items():
        deps = set()
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".")
                if node.level:
                    base = base[: len(base) - node.level + (p.name == "__init__.py")]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != mod}
        edges[mod] = deps
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    out.append(sorted(part))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = _engine_modules()
    edges = _module_imports(mods)
    assert edges["rnnfuse.passes.loop"] >= {"rnnfuse.step", "rnnfuse.passes.loop_reads"}  # the reader reads
    assert not _cycles(edges)


# -- finding adds no nodes: what a candidate needs built is a field of it, built by the emitter --------------
def _snapshot(g):
    return [id(n) for n in g.nodes], sorted(g.initializers)


def _chain_over_later_steps(op: str, mask: str = "none", mutation: str | None = None):
    """A hand-built unrolled chain over steps 1..T of an input with T+1 steps (step 0 is never read), so the
    native op must run over a slice of the input (and of the mask)."""
    import builders as B

    T = 4
    model, feeds_fn = B.build(B.Opts(op=op, front="chain", static_T=T, mask=mask, mutation=mutation, outputs=("seq", "h")))
    const_of = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    for n in model.graph.node:
        if n.op_type == "Gather" and n.input[0] in ("X", "mask"):
            value = const_of[n.input[1]].attribute[0].t
            value.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(value) + 1, value.name))
    for vi in model.graph.input:
        if vi.name in ("X", "mask"):
            vi.type.tensor_type.shape.dim[0].dim_value = T + 1
    return model, lambda rng, b: feeds_fn(rng, b, T + 1, "gappy" if mask != "none" else "none")


def _find_chain_recurrences(g):
    """The unrolled front end's find stage (families, chains, a recurrence per chain), without applying."""
    from rnnfuse.errors import Decline
    from rnnfuse.passes.unrolled.chains import find_chains, intervals
    from rnnfuse.passes.unrolled.families import find_families, mask_leaves
    from rnnfuse.passes.unrolled.roles import chain_recurrence
    from rnnfuse.signature import Signer

    found, declined = [], []
    g.prune()  # as the pass does: dead code reads no step's values
    fams = find_families(g)
    order = g.ordered_live_nodes()
    for (src, axis), fam in fams.items():
        if g.model.elem_type(src) == TensorProto.BOOL:
            continue
        leaves, mask_fam, mask_srcs = mask_leaves(g, fams, fam)
        iv = intervals(g, order, leaves)
        for chain in find_chains(g, fam, iv, mask_fam):
            try:
                found.append(chain_recurrence(g, src, axis, chain, iv, Signer(g), mask_srcs))
            except Decline as d:
                declined.append(d.reason)
    return found, declined


@pytest.mark.parametrize("mask", ["none", "where"])
def test_chain_over_later_steps_finds_a_slice_to_build_and_adds_nothing(mask):
    model, _ = _chain_over_later_steps("GRU", mask)
    g = Model(model).graph
    g.prune()
    before = _snapshot(g)
    found, declined = _find_chain_recurrences(g)
    assert not declined and len(found) == 1
    assert found[0].x_prep.steps == (1, 5, 0) and found[0].x == "X"
    assert (found[0].mask is not None) == (mask != "none")
    assert _snapshot(g) == before


def test_declined_chain_adds_nothing():
    model, _ = _chain_over_later_steps("LSTM", mutation="extra_tanh")
    g = Model(model).graph
    g.prune()
    before = _snapshot(g)
    found, declined = _find_chain_recurrences(g)
    assert not found and declined
    assert _snapshot(g) == before


@pytest.mark.parametrize("op,mask", [("LSTM", "none"), ("GRU", "where"), ("RNN", "where")])
def test_chain_over_later_steps_fuses_over_a_slice_of_the_input(op, mask):
    """The emitter builds the slice the front end asked for: same outputs, step 0 of the input unread."""
    import onnxruntime as ort

    import rnnfuse

    model, feeds = _chain_over_later_steps(op, mask)
    fused, report = rnnfuse.optimize(model)
    assert [f.status for f in report.findings if f.status in ("fused", "declined")] == ["fused"], report.to_text()
    assert {n.op_type for n in fused.graph.node} >= {op, "Slice"}
    run = lambda m, f: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)  # noqa: E731
    rng = np.random.default_rng(0)
    for b in (1, 3):
        f = feeds(rng, b)
        for want, got in zip(run(model, f), run(fused, f)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        f["X"][0] = np.nan  # step 0 is no part of the recurrence
        for want, got in zip(run(model, f), run(fused, f)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mutation", [None, "extra_tanh"])
def test_loop_over_a_flipped_projection_finds_the_flip_and_adds_nothing(mutation):
    """A reverse Loop over flip(X @ K + b): the recurrence reads X, and the flip is the emitter's to build,
    whether the candidate is then fused or declined."""
    import builders as B

    from rnnfuse.errors import Decline
    from rnnfuse.passes.loop import loop_recurrence

    o = B.Opts(op="GRU", front="loop", xproj=True, direction="reverse", reverse_form="flip", mutation=mutation)
    g = Model(B.build(o)[0]).graph
    loop = next(iter(g.nodes_of("Loop")))
    before = _snapshot(g)
    try:
        rec, _ = loop_recurrence(g, loop)
    except Decline:
        assert mutation is not None
    else:
        assert mutation is None and rec.x == "X" and [n.op_type for n in rec.x_prep.flips] == ["Slice"]
    assert _snapshot(g) == before


# -- one rule for the sizes of symbolic input dimensions (rnnfuse.feeds.input_sizes) ----------------------
def test_input_sizes_by_name_then_by_position_in_each_input():
    from rnnfuse.feeds import OTHER_DIM_SIZE, input_sizes

    dims: dict = {}
    # a time-major input with named dims runs as [T, B, F]; an unnamed [?, H] of another input is its batch
    assert input_sizes("x", ["seq_len", "batch", 5], dims, 2, 7) == ([7, 2, 5], ["time", "batch", None])
    assert input_sizes("h0", [None, 4], dims, 2, 7) == ([2, 4], ["batch", None])
    assert input_sizes("y", ["N", "L", "K"], dims, 2, 7) == ([2, 7, OTHER_DIM_SIZE], ["batch", "time", None])
    assert input_sizes("m", ["N", "L"], dims, 2, 7)[0] == [2, 7]  # one name, one size
    # one static leading dim: the symbolic one keeps the role of its position
    assert input_sizes("a", [3, None, 5], {}, 2, 7)[0] == [3, 7, 5]
    assert input_sizes("b", [None, 50, 5], {}, 2, 7)[0] == [2, 50, 5]
    # features first ([B, F, T], a Permute before the recurrence, or a channels-first input beside it): the
    # second symbolic dim is the time axis (it crashed validation: IndexError)
    assert input_sizes("c", [None, 5, None], {}, 2, 7) == ([2, 5, 7], ["batch", None, "time"])
    assert input_sizes("d", [None, 3, None, None], {}, 2, 7)[0] == [2, 3, 7, OTHER_DIM_SIZE]


def test_validation_and_benchmarks_size_inputs_alike():
    from rnnfuse import bench, validate
    from rnnfuse.feeds import index_ranges

    g = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"]), helper.make_node("Add", ["h0", "h0"], ["z"])],
        "sizes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, None, 5]),
         helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["unk__1", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m = Model(proto)
    rng = np.random.default_rng(0)
    v = validate._inputs_for(m.graph, {}, 2, 7, 1.0, rng, index_ranges(m.graph))
    b = bench.make_inputs(proto, 2, 7, "none", rng)
    assert {k: a.shape for k, a in v.items()} == {k: a.shape for k, a in b.items()} == {"x": (3, 7, 5), "h0": (2, 4)}


# -- the chain front end reads Slice arguments through op_args (attributes before opset 10) ----------------
def _slice_model(opset, slice_inputs, extra_inputs=(), **attrs):
    g = helper.make_graph(
        [helper.make_node("Slice", ["h"] + list(slice_inputs), ["y"], **attrs)],
        "slice",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", 8])]
        + [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in extra_inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
         (("zero", 0), ("four", 4), ("one", 1), ("big", 2**62))],
    )
    return Model(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])).graph


def test_state_side_slices_by_opset():
    from rnnfuse.passes.unrolled.state_roots import _keeps_rows

    def keeps(g):
        return _keeps_rows(g, g.producer["y"])

    assert keeps(_slice_model(9, [], starts=[0], ends=[4], axes=[1]))  # units of h, as attributes
    assert not keeps(_slice_model(9, [], starts=[0], ends=[1], axes=[0]))  # rows
    assert keeps(_slice_model(13, ["zero", "four", "one"]))
    assert not keeps(_slice_model(13, ["zero", "four"]))  # axes left out: the first axis, rows
    assert keeps(_slice_model(13, ["zero", "big", "zero"]))  # every row
    assert not keeps(_slice_model(13, ["zero", "big", "zero", "s"], ["s"]))  # a step known only at runtime
