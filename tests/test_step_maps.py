"""Per-step copies of a row-wise map over a native op's steps, stacked on time: applied once to the sequence
(``rnnfuse.passes.step_maps``). Real exports (torch trace and dynamo: a head per step, cat of two cells side by
side, stack(ys[1:])) go through it in ``test_stacked_cells``; here hand-built stacks and near misses."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import op_counts, session

T, B, F, H, K = 5, 3, 4, 6, 2


def stacked_head(axis: int = 0, first: int = 0, miss: str = ""):
    """An RNN op over x, then per step t (from ``first``): relu(Y[t] @ V + c), unsqueezed on ``axis`` and
    concatenated. Near misses: ``per_step_weights`` (step t's own V), ``batch_mean`` (a mean over the batch
    rows, no row-wise map), ``shuffled`` (item j reads step (2 j) mod T: neither forward nor backward).
    ``backward``: item j reads step T-1-j (a backward cell's steps stacked in the forward order), no miss."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W", rng.standard_normal((1, H, F))), ("R", rng.standard_normal((1, H, H)) * 0.3),
        ("V", rng.standard_normal((H, K))), ("c", rng.standard_normal(K)))]
    inits += [numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array([axis], np.int64), "axs"),
              numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    nodes = [helper.make_node("RNN", ["x", "W", "R"], ["Y", "Yh"], hidden_size=H),
             helper.make_node("Squeeze", ["Y", "ax1"], ["Ys"])]
    items = []
    for j, t in enumerate(range(first, T)):
        src = T - 1 - j if miss == "backward" else (2 * j) % T if miss == "shuffled" else t
        V = "V"
        if miss == "per_step_weights":
            V = f"V{t}"
            inits.append(numpy_helper.from_array(rng.standard_normal((H, K)).astype(np.float32), V))
        nodes += [helper.make_node("Constant", [], [f"i{t}"], value=numpy_helper.from_array(np.array(src, np.int64))),
                  helper.make_node("Gather", ["Ys", f"i{t}"], [f"h{t}"], axis=0),
                  helper.make_node("MatMul", [f"h{t}", V], [f"m{t}"]),
                  helper.make_node("Add", [f"m{t}", "c"], [f"a{t}"])]
        last = f"a{t}"
        if miss == "batch_mean":
            nodes.append(helper.make_node("ReduceMean", [f"a{t}", "ax0"], [f"r{t}"], keepdims=1))
            nodes.append(helper.make_node("Sub", [f"a{t}", f"r{t}"], [f"s{t}"]))
            last = f"s{t}"
        nodes += [helper.make_node("Relu", [last], [f"y{t}"]),
                  helper.make_node("Unsqueeze", [f"y{t}", "axs"], [f"u{t}"])]
        items.append(f"u{t}")
    nodes.append(helper.make_node("Concat", items, ["out"], axis=axis))
    shape = [T - first, B, K] if axis == 0 else [B, T - first, K]
    g = helper.make_graph(nodes, "stacked_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, F])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _same_outputs(a, b):
    x = np.random.default_rng(0).standard_normal((T, B, F)).astype(np.float32)
    for p, q in zip(session(a).run(None, {"x": x}), session(b).run(None, {"x": x})):
        np.testing.assert_allclose(p, q, atol=1e-5)


@pytest.mark.parametrize("axis,first", [(0, 0), (1, 0), (0, 2), (1, 1)])
def test_a_stacked_per_step_head_runs_once_on_the_sequence(axis, first):
    _fused_once(stacked_head(axis, first))


@pytest.mark.parametrize("axis, first", [(0, 0), (1, 0), (0, 1)])
def test_steps_read_backward_are_flipped_once(axis, first):
    """Item j reads step T-1-j (torch's ``cat([hf[t], hb[T - 1 - t]])`` of a hand-written bidirectional loop:
    6,660 such copies were left beside one bidirectional op): the map runs once on the steps read backward,
    one slice with step -1 (from the last step, to row 0 included)."""
    _fused_once(stacked_head(axis, first, miss="backward"))


def _fused_once(model):
    fused, report = rnnfuse.optimize(model)
    merged = [f for f in report.findings if f.pass_name == "step-maps" and f.status == "merged"]
    assert len(merged) == 1, report.to_text()
    ops = op_counts(fused)
    assert ops["MatMul"] == 1 and ops["Relu"] == 1 and ops.get("Gather", 0) == 0 and ops.get("Unsqueeze", 0) == 0, ops
    _same_outputs(model, fused)


@pytest.mark.parametrize("miss", ["per_step_weights", "batch_mean", "shuffled"])
def test_maps_that_differ_by_step_or_mix_rows_stay(miss):
    model = stacked_head(miss=miss)
    fused, report = rnnfuse.optimize(model)
    assert not [f for f in report.findings if f.pass_name == "step-maps"], report.to_text()
    assert op_counts(fused) == op_counts(model)
    _same_outputs(model, fused)


def test_a_map_reshaping_to_a_steps_static_shape_stays():
    """A static batch: the head's ``Reshape(h_t @ V + c, Shape(.)[0:1] ++ [K])`` folds to the constant [B, K],
    which applied to every step's rows at once would be wrong: the stack stays per step."""
    model = stacked_head()
    g = model.graph
    nodes = []
    for node in g.node:
        if node.op_type == "Relu":
            t = node.input[0]
            nodes += [helper.make_node("Shape", [t], [f"shape_{t}"]),
                      helper.make_node("Slice", [f"shape_{t}", "ax0", "one", "ax0"], [f"sh_{t}"]),
                      helper.make_node("Concat", [f"sh_{t}", "k_dim"], [f"tgt_{t}"], axis=0),
                      helper.make_node("Reshape", [t, f"tgt_{t}"], [f"rs_{t}"])]
            node.input[0] = f"rs_{t}"
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend([numpy_helper.from_array(np.array([K], np.int64), "k_dim"),
                          numpy_helper.from_array(np.array([1], np.int64), "one")])
    g.input[0].type.tensor_type.shape.dim[1].dim_value = B  # (the batch is static: the shape folds)
    fused, report = rnnfuse.optimize(model, validate=False)
    assert not [f for f in report.findings if f.pass_name == "step-maps" and f.status == "merged"], report.to_text()
    _same_outputs(model, fused)


def test_a_loop_head_reshaping_to_a_steps_static_shape_is_declined():
    """The same inside a Loop body (a head on h applied after the native op): a Reshape target folded from the
    step's static shape would be applied to every step's rows at once; declined with that reason."""
    import builders_loops as BL

    model = BL.build_head(BL.HeadOpts("gemm_relu"))
    body = next(n for n in model.graph.node if n.op_type == "Loop").attribute[0].g
    nodes = []
    for n in body.node:
        if n.op_type == "Relu":
            nodes += [helper.make_node("Shape", ["g"], ["shp"]),
                      helper.make_node("Slice", ["shp", "k0", "kk1", "k0"], ["sh0"]),
                      helper.make_node("Concat", ["sh0", "kdim"], ["tgt"], axis=0),
                      helper.make_node("Reshape", ["g", "tgt"], ["gr"])]
            n.input[0] = "gr"
        nodes.append(n)
    del body.node[:]
    body.node.extend(nodes)
    body.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "kk1"),
                             numpy_helper.from_array(np.array([BL.HEAD_K], np.int64), "kdim")])
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = B  # (a static batch: the shape folds)
    fused, report = rnnfuse.optimize(model, validate=False)
    assert not report.fused and any("folded from a step's shape" in f.reason for f in report.declined), report.to_text()
    x = np.random.default_rng(1).standard_normal((5, B, 3)).astype(np.float32)
    for p, q in zip(session(model).run(None, {"x": x}), session(fused).run(None, {"x": x})):
        np.testing.assert_allclose(p, q, atol=1e-5)


def test_a_map_reading_a_long_computation_is_declined_without_recursing_through_it():
    """Each step's item adds a value computed by 3,000 nodes from another input (in a real export: the other
    half of a declined chain). The walk of a step's map is bounded by the values it walks: it was bounded by
    the nodes it kept, which are kept only once their inputs are walked (RecursionError, 'internal error')."""
    model = stacked_head()
    g = model.graph
    g.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [B, K]))
    nodes, cur = [], "z"
    for i in range(3000):
        nodes.append(helper.make_node("Tanh" if i % 2 else "Relu", [cur], [f"deep{i}"]))
        cur = f"deep{i}"
    for n in g.node:
        if n.op_type == "Relu" and n.input[0].startswith("a"):  # (a step's relu(a_t) becomes relu(a_t + deep))
            nodes.append(helper.make_node("Add", [n.input[0], cur], [f"{n.input[0]}_deep"]))
            n.input[0] = f"{n.input[0]}_deep"
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    fused, report = rnnfuse.optimize(model)
    assert not [f for f in report.findings if f.pass_name == "step-maps" and f.status == "merged"], report.to_text()
    feeds = {"x": np.random.default_rng(0).standard_normal((T, B, F)).astype(np.float32),
             "z": np.random.default_rng(1).standard_normal((B, K)).astype(np.float32)}
    for p, q in zip(session(model).run(None, feeds), session(fused).run(None, feeds)):
        np.testing.assert_allclose(q, p, atol=1e-5)


def test_a_big_model_checks_the_first_copies_of_a_stack(monkeypatch):
    """Beyond the whole-model limit a stack is validated on its first copies stacked (a Concat of theirs added
    beside, never connected) against the map run once on their steps; the rest is the same map on the next
    steps. A stack read the wrong way (each copy said to read the step after, not the one before) fails it."""
    from rnnfuse import rewrite
    from rnnfuse.passes import step_maps

    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 0)
    model = stacked_head(miss="backward")
    fused, report = rnnfuse.optimize(model)
    assert f"the first {step_maps.PREFIX_COPIES} copies stacked" in report.to_text()
    assert op_counts(fused).get("Gather", 0) == 0 and "step_maps_check" not in str(fused.graph.node)
    _same_outputs(model, fused)
    monkeypatch.setattr(step_maps, "_step_runs", lambda maps: [(m[1], 1) for m in maps[0].steps.values()])
    fused, report = rnnfuse.optimize(model)
    assert "declined" in report.to_text() and op_counts(fused) == op_counts(model), report.to_text()
    _same_outputs(model, fused)


def test_a_shapes_assembly_beside_a_native_op_is_not_asked_its_ranks(monkeypatch):
    """A dynamic-shape export assembles shapes from unsqueezed scalars in every block (``Concat(Unsqueeze(
    Gather(Shape(y), 0)), Unsqueeze(Gather(Shape(y), 1)), [-1])`` feeding a Reshape); beside a native op, each
    such Concat looked like a stack of steps and each scalar's rank was asked, a type inferred for it (1.7 s
    of a 100,000-node transformer with one LSTM). The scalars are no steps, which their producers tell: no rank
    is asked of them, and the real stack beside them is still merged, outputs unchanged."""
    from rnnfuse.passes import step_maps

    model = stacked_head()
    g = model.graph
    g.input[0].type.tensor_type.shape.dim[1].dim_param = "B"  # (a dynamic batch: the scalars fold to nothing)
    del g.output[0].type.tensor_type.shape.dim[:]
    g.initializer.extend([numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("zero_i", 0), ("one_i", 1), ("minus_one", [-1]), ("ax0_", [0]))])
    cur, scalars = "out", []
    for k in range(20):  # (a chain of reshapes, each to a shape assembled from its input's dims)
        p = f"blk{k}_"
        g.node.extend([
            helper.make_node("Shape", [cur], [p + "shape"]),
            helper.make_node("Gather", [p + "shape", "zero_i"], [p + "d0"], axis=0),
            helper.make_node("Gather", [p + "shape", "one_i"], [p + "d1"], axis=0),
            helper.make_node("Unsqueeze", [p + "d0", "ax0_"], [p + "u0"]),
            helper.make_node("Unsqueeze", [p + "d1", "ax0_"], [p + "u1"]),
            helper.make_node("Concat", [p + "u0", p + "u1", "minus_one"], [p + "to"], axis=0),
            helper.make_node("Reshape", [cur, p + "to"], [p + "r"]),
            helper.make_node("Tanh", [p + "r"], [p + "y"])])
        scalars += [p + "d0", p + "d1"]
        cur = p + "y"
    g.output[0].name = cur
    asked = []
    real = step_maps.known_rank
    monkeypatch.setattr(step_maps, "known_rank", lambda graph, name: asked.append(name) or real(graph, name))
    fused, report = rnnfuse.optimize(model)
    assert [f for f in report.findings if f.pass_name == "step-maps" and f.status == "merged"], report.to_text()
    assert asked and not set(asked) & set(scalars), asked
    _same_outputs(model, fused)


def per_call_head(row: str = "gather", shuffled: bool = False):
    """Decoder-style torch: one RNN op per step over x[t:t+1] carrying the state by hand, and per step
    relu(y[0] @ V + c) stacked on time (``y`` the op's [1, 1, B, H] Y with its direction axis squeezed, its row
    taken by ``Gather(., 0)`` or ``Squeeze(., [0])``). step_chains merges the ops and leaves each op's part of
    one Split of the merged Y; the stacked map then runs once. ``shuffled``: item j reads op (2 j) mod T;
    ``row="scrambled"``: a [B, H] view of the output that is no rows."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("W", rng.standard_normal((1, H, F))), ("R", rng.standard_normal((1, H, H)) * 0.3),
        ("V", rng.standard_normal((H, K))), ("c", rng.standard_normal(K)))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("ax0", [0]), ("ax1", [1]), ("zero", 0), ("h_first", [H, -1]))]
    nodes, items, h = [], [], "h0"
    for t in range(T):
        inits += [numpy_helper.from_array(np.array([t], np.int64), f"s{t}"),
                  numpy_helper.from_array(np.array([t + 1], np.int64), f"e{t}")]
        nodes += [helper.make_node("Slice", ["x", f"s{t}", f"e{t}", "ax0"], [f"x{t}"]),
                  helper.make_node("RNN", [f"x{t}", "W", "R", "", "", h], [f"Y{t}", f"h{t + 1}"], hidden_size=H),
                  helper.make_node("Squeeze", [f"Y{t}", "ax1"], [f"ys{t}"])]
        h = f"h{t + 1}"
    for j in range(T):
        t = (2 * j) % T if shuffled else j
        if row == "scrambled":  # (a [B, H]-shaped view that is no rows: the elements read H-major, transposed)
            nodes += [helper.make_node("Reshape", [f"ys{t}", "h_first"], [f"hb{j}"]),
                      helper.make_node("Transpose", [f"hb{j}"], [f"r{j}"], perm=[1, 0])]
        else:
            nodes.append(helper.make_node("Gather", [f"ys{t}", "zero"], [f"r{j}"], axis=0) if row == "gather" else
                         helper.make_node("Squeeze", [f"ys{t}", "ax0"], [f"r{j}"]))
        nodes += [helper.make_node("MatMul", [f"r{j}", "V"], [f"m{j}"]),
                  helper.make_node("Add", [f"m{j}", "c"], [f"a{j}"]), helper.make_node("Relu", [f"a{j}"], [f"y{j}"]),
                  helper.make_node("Unsqueeze", [f"y{j}", "ax0"], [f"u{j}"])]
        items.append(f"u{j}")
    nodes.append(helper.make_node("Concat", items, ["out"], axis=0))
    g = helper.make_graph(nodes, "per_call_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, F]),
                                                   helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, B, H])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [T, B, K])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _same_outputs_h0(a, b):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((T, B, F)).astype(np.float32), "h0": rng.standard_normal((1, B, H)).astype(np.float32)}
    for p, q in zip(session(a).run(None, feeds), session(b).run(None, feeds)):
        np.testing.assert_allclose(p, q, atol=1e-5)


@pytest.mark.parametrize("row", ["gather", "squeeze"])
def test_a_head_on_each_calls_output_runs_once_after_the_calls_merge(row):
    model = per_call_head(row)
    fused, report = rnnfuse.optimize(model)
    merged = {f.pass_name for f in report.findings if f.status == "merged"}
    assert merged == {"step-chains", "step-maps"}, report.to_text()
    ops = op_counts(fused)
    assert ops["RNN"] == 1 and ops["MatMul"] == 1 and ops["Relu"] == 1 and ops.get("Split", 0) == 0, ops
    _same_outputs_h0(model, fused)


@pytest.mark.parametrize("case", [dict(shuffled=True), dict(row="scrambled")], ids=["shuffled", "scrambled"])
def test_a_head_on_the_calls_outputs_in_another_order_stays(case):
    """Items reading the calls in another order, or views of a call's output that are not its rows (the same
    shape, the elements in another order): the calls merge, the heads stay."""
    model = per_call_head(**case)
    fused, report = rnnfuse.optimize(model)
    assert not [f for f in report.findings if f.pass_name == "step-maps"], report.to_text()
    ops = op_counts(fused)
    assert ops["RNN"] == 1 and ops["MatMul"] == T, ops  # (the calls merge; the heads stay, one per step)
    _same_outputs_h0(model, fused)
