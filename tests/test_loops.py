"""Hand-built Loop recurrences in other exporters' forms (tests/builders_loops.py): fused exactly, near misses
declined and left unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from builders_loops import (
    build_piece_carry,
    piece_carry_reference,
    F,
    H,
    HEAD_FORMS,
    HEAD_MISSES,
    LENGTH_FORMS,
    LENGTH_MISSES,
    RUNNING_SUM_FORMS,
    COUNTER_FORMS,
    TWO_SEQUENCE_FORMS,
    TRACED_READ_FORMS,
    WHERE_ELU_FORMS,
    GROWN_FORMS,
    GROWN_MISSES,
    WHERE_ELU_MISSES,
    TRACED_READ_MISSES,
    TWO_SEQUENCE_MISSES,
    COUNTER_MISSES,
    RUNNING_SUM_MISSES,
    XMASK_FORMS,
    XMASK_MISSES,
    NEAR_MISSES,
    SCAN_STACK_FORMS,
    SCAN_STACK_MISSES,
    STACK_FORMS,
    STACK_MISSES,
    TB,
    TRANSPOSED_FORMS,
    TRANSPOSED_MISSES,
    LoopOpts,
    HeadOpts,
    LengthOpts,
    StackOpts,
    TransposedOpts,
    all_variants,
    build,
    build_buffer_loop,
    build_deep_loop,
    build_head,
    build_lengths,
    build_stack,
    build_running_sum,
    build_counted_loop,
    build_two_sequences,
    build_batch_sliced,
    build_traced_read,
    build_read_ahead,
    READ_AHEAD_FORMS,
    READ_AHEAD_MISSES,
    build_held_head,
    weights,
    build_where_elu,
    build_grown_buffer,
    build_scattered_buffer,
    build_stacked_loops,
    build_transposed,
    head_reference,
    lengths_reference,
    reference,
    stack_reference,
)
from helpers import assert_close, op_counts, session

import rnnfuse


def _fused_once(model: onnx.ModelProto, front: str | None = None, **counts: int):
    """``model`` optimized: one recurrence fused (of ``front``, when given), nothing declined, and each op in
    ``counts`` left that many times (0: gone)."""
    fused, report = rnnfuse.optimize(model)
    found = [f for f in report.fused if front is None or f.front == front]
    assert not report.declined and len(found) == 1, report.to_text()
    left = op_counts(fused)
    assert all(left.get(op, 0) == n for op, n in counts.items()), (left, report.to_text())
    return fused, report


def _declined(model: onnx.ModelProto, reason: str = "") -> None:
    """Nothing fused, a recurrence declined (for ``reason``), the model's ops as they were."""
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert reason in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)


def _same_outputs(name: str, model: onnx.ModelProto, fused: onnx.ModelProto, runs) -> None:
    """For each ``(feeds, want)`` of ``runs``, the original and the fused model both give ``want``."""
    s_orig, s_fused = session(model), session(fused)
    for feeds, want in runs:
        got, orig = s_fused.run(None, feeds), s_orig.run(None, feeds)
        for k, w in enumerate(want):
            assert_close(orig[k], w, f"{name}/{k}: original vs numpy")
            assert_close(got[k], w, f"{name}/{k}: fused vs numpy")


@pytest.mark.parametrize("o", all_variants(), ids=lambda o: o.name)
def test_loop_forms_fused(o: LoopOpts):
    model = build(o)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(1)

    def runs():
        for batch, steps in ((1, 5), (3, 7), (2, 1)):
            x = o.x_of(steps, batch, rng)
            yield {"x": x}, reference(o, x)

    _same_outputs(o.name, model, fused, runs())


def _time_major_runs(seed: int, reference_of):
    """Feeds x [T, B, 3] at (batch, steps) (1, 5), (3, 7), (2, 1), each with ``reference_of(x)``."""
    rng = np.random.default_rng(seed)
    for batch, steps in ((1, 5), (3, 7), (2, 1)):
        x = rng.standard_normal((steps, batch, 3)).astype(np.float32)
        yield {"x": x}, reference_of(x)


@pytest.mark.parametrize("o", STACK_FORMS, ids=lambda o: o.name)
def test_stacked_cells_one_op_per_cell(o: StackOpts):
    """Several cells per step: one native op per cell, the one above fed by the Y of the one below."""
    model = build_stack(o)
    fused, _ = _fused_once(model, Loop=0, RNN=o.cells)
    rnns = [n for n in fused.graph.node if n.op_type == "RNN"]
    producers = {out: n for n in fused.graph.node for out in n.output}
    for upper in rnns[1:]:  # each op above the first reads another RNN's Y (through a Squeeze at most)
        src = producers[upper.input[0]]
        while src.op_type != "RNN":
            src = producers[src.input[0]]
        assert src in rnns and src is not upper
    _same_outputs(o.name, model, fused, _time_major_runs(2, lambda x: stack_reference(o, x)))


@pytest.mark.parametrize("o", HEAD_FORMS, ids=lambda o: o.name)
def test_head_in_step_fused(o: HeadOpts):
    """A per-step output computed from h inside the body: one RNN, the head applied to all of Y after it."""
    model = build_head(o)
    fused, _ = _fused_once(model, Loop=0, Scan=0, RNN=1)
    onnx.checker.check_model(fused, full_check=True)
    _same_outputs(o.name, model, fused, _time_major_runs(3, lambda x: head_reference(o, x)))


@pytest.mark.parametrize("o", LENGTH_FORMS, ids=lambda o: o.name)
def test_length_mask_in_step_fused(o: LengthOpts):
    """A step mask computed from the iteration number and per-row lengths: one masked RNN whose mask is that
    comparison, built before it; every row length from 0 to past the end."""
    model = build_lengths(o)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].masked and report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(4)
    dt = np.int64 if o.dtype == "int64" else np.int32

    def runs():
        for lens in ([0], [7], [7, 0, 3, 9, -1], [2, 5]):
            x = rng.standard_normal((7 if len(lens) > 1 else 5, len(lens), 3)).astype(np.float32)
            L = np.array(lens, dt).reshape((-1, 1) if o.unit else (-1,))
            yield {"x": x, "L": L}, lengths_reference(o, x, L)

    _same_outputs(o.name, model, fused, runs())


@pytest.mark.parametrize("o", XMASK_FORMS, ids=lambda o: o.name)
def test_mask_from_step_input_fused(o: LengthOpts):
    """A step mask the body computes from x_t alone (a row is padding where its features are all 0): one masked
    RNN; the mask computed for every step before it, the body reading its step of that mask (validation's
    patterns reach both); rows post-, pre-padded, gappy, empty."""
    model = build_lengths(o)
    fused, report = _fused_once(model, Loop=0, Scan=0, RNN=1)
    assert report.fused[0].masked and report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(5)
    L = np.zeros((1, 1) if o.unit else (1,), np.int64)  # (not read)

    def runs():
        for keep in (np.ones((5, 1), bool), np.array([[1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1],
                                                      [1, 1, 1, 1, 0, 0, 0], [0] * 7], bool).T):
            x = rng.standard_normal(keep.shape + (3,)).astype(np.float32)
            x[~keep] = 0.0
            yield {"x": x, "L": L}, lengths_reference(o, x, L)

    _same_outputs(o.name, model, fused, runs())


@pytest.mark.parametrize("o", TRANSPOSED_FORMS, ids=lambda o: o.name)
def test_transposed_matmuls_fused(o: TransposedOpts):
    """Matmuls written as Transpose(W.T @ Transpose(v)) (jax.vmap of a per-example cell): one RNN."""
    model = build_transposed(o)
    fused, _ = _fused_once(model, Loop=0, RNN=1, Transpose=0)
    rng = np.random.default_rng(6)

    def runs():
        for steps in (1, 6):
            x = rng.standard_normal((steps, TB, 3)).astype(np.float32)
            yield {"x": x}, reference(LoopOpts(cast=False), x)

    _same_outputs(o.name, model, fused, runs())


@pytest.mark.parametrize("o", SCAN_STACK_FORMS, ids=lambda o: o.name)
def test_scan_stacked_cells_one_op_per_cell(o: StackOpts):
    """Several cells in one Scan body: one native op per cell, the upper one fed by the lower one's Y; masked
    rows post-, pre-padded, gappy and empty; time backwards with scan_input_directions."""
    model = build_stack(o)
    # (a reverse stack's upper op may be rewritten again by the reverse-input pass: findings of its own)
    fused, _ = _fused_once(model, "Scan", Scan=0, RNN=o.cells)
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(8)
    masks = [np.array([[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1, 0], [0] * 7], bool).T,
             np.ones((5, 1), bool)]

    def runs():
        for m in masks:
            x = rng.standard_normal((m.shape[0], m.shape[1], 3)).astype(np.float32)
            yield ({"x": x, "mask": m} if o.masked else {"x": x}), stack_reference(o, x, m if o.masked else None)

    _same_outputs(o.name, model, fused, runs())


HEAD_REASONS = {"rows_mean": "not a row-wise op", "transpose": "not a row-wise op", "counter": "iteration number"}
# every near miss of every form: (builder, options, a phrase the reason must hold)
NEAR_MISS_CASES = ([(build, o, "cast to INT16" if o.cond == "int16" else "") for o in NEAR_MISSES]
                   + [(build_stack, o, "") for o in STACK_MISSES + SCAN_STACK_MISSES]
                   # (a masked step's output over two cells' h: a head over several cells is unmasked only)
                   + [(build_stack, StackOpts(2, front="scan", masked=True, mixed=True), "several cells' h under a mask")]
                   + [(build_head, o, HEAD_REASONS[o.miss]) for o in HEAD_MISSES]
                   + [(build_lengths, o, "") for o in LENGTH_MISSES + XMASK_MISSES]
                   + [(build_transposed, o, "mix batch rows") for o in TRANSPOSED_MISSES])


@pytest.mark.parametrize("make, o, reason", [pytest.param(*c, id=f"{c[0].__name__}-{c[1].name}") for c in NEAR_MISS_CASES])
def test_near_misses_declined(make, o, reason: str):
    _declined(make(o), reason)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_rewrite_onnxruntime_cannot_run_is_declined(op):
    """A masked Loop that reads only the first T rows of a mask longer than its input (T + 2 rows: a broken
    TimeDistributed export has one; the file says nothing of the longer mask's length): the original runs, a
    native op over the whole mask cannot. Validation must decline it, not skip it: a model that ran must not
    come out unable to."""
    import builders as HB
    from rnnfuse.protos import rename_free

    model = HB.build(HB.Opts(op=op, front="loop", mask="where", **({"lbr": 1} if op == "GRU" else {})))
    model = model[0] if isinstance(model, tuple) else model
    g = model.graph
    loop = next(n for n in g.node if n.op_type == "Loop")
    two = onnx.helper.make_tensor("two_rows", onnx.TensorProto.INT64, [1], [2])
    zero = onnx.helper.make_tensor("row_zero", onnx.TensorProto.INT64, [1], [0])
    g.initializer.extend([two, zero])
    head = onnx.helper.make_node("Slice", ["mask", "row_zero", "two_rows", "row_zero"], ["mask_head"])
    longer = onnx.helper.make_node("Concat", ["mask", "mask_head"], ["mask_longer"], axis=0)
    rename_free(loop.attribute[0].g, "mask", "mask_longer")
    at = list(g.node).index(loop)
    g.node.insert(at, longer)
    g.node.insert(at, head)
    onnx.checker.check_model(model, full_check=True)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert "cannot run the rewrite" in report.declined[0].reason, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_a_rewrite_that_cannot_take_the_given_state_batch_is_declined():
    """h0 = z @ Wz with x of one row and z of two (both fixed by the file): the original broadcasts x against
    h0's rows, and no native op takes a batch of one in x beside two in its initial state. Validation runs the
    rewrite on such inputs: it must decline it, not skip it (a model that ran must not come out unable to)."""
    from onnx import TensorProto, helper as h, numpy_helper as nh

    F_, H_, D_ = 3, 4, 2
    rng = np.random.default_rng(14)
    consts = [nh.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("W", (F_, H_)), ("R", (H_, H_)), ("Wz", (D_, H_)))]
    outer = [h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "z0"], ["T"], axis=0),
             h.make_node("MatMul", ["z", "Wz"], ["h0"])]
    inputs = [h.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 1, F_]),
              h.make_tensor_value_info("z", TensorProto.FLOAT, [2, D_])]
    model = _tanh_loop("h0_from_z", [h.make_node("Gather", ["x", "i"], ["xt"], axis=0)], outer, inputs,
                       consts + [nh.from_array(np.array(0, np.int64), "z0")])
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert "cannot run the rewrite" in report.declined[0].reason, report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


def test_rank_read_from_how_a_tensor_was_computed():
    """tf2onnx at opset 13 declares nothing after a Reshape to a computed shape, and shape inference gives no
    rank there: a Loop reading such a tensor was declined ('no per-step input'). ``rank_of`` reads a
    Transpose's perm, a Reshape's static-length shape and rank-keeping ops."""
    from onnx import TensorProto, helper

    from rnnfuse.dataflow import rank_of
    from rnnfuse.graph import Model

    nodes = [
        helper.make_node("Reshape", ["x", "s"], ["r"]),  # s: an input of unknown length
        helper.make_node("Relu", ["r"], ["relu"]),
        helper.make_node("Transpose", ["relu"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Add", ["t", "bias"], ["a"]),
        helper.make_node("Reshape", ["x", "s3"], ["r3"]),
        helper.make_node("Tanh", ["r3"], ["tanh"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None), helper.make_tensor_value_info("s", TensorProto.INT64, None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "tanh")],
        [helper.make_tensor("bias", TensorProto.FLOAT, [2], [0.5, 1.0]), helper.make_tensor("s3", TensorProto.INT64, [3], [2, 1, -1])])
    g = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])).graph
    assert [rank_of(g, n) for n in ("r", "relu", "t", "a", "r3", "tanh")] == [None, None, 3, 3, 3, 3]


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_dense_before_a_masked_loop_is_its_input(op):
    """Keras 3 on JAX: Dense on the batch-first input, transposed to the loop's time axis, then a masked layer.
    The input projection the Transpose rule finds is batch-first beside a time-major mask; the loop then reads
    the Dense's output as its input, as it did before that rule (a decline for a while)."""
    import builders as HB

    model = HB.build(HB.Opts(op=op, front="loop", mask="where", F=3, **({"lbr": 1} if op == "GRU" else {})))
    model = model[0] if isinstance(model, tuple) else model
    g = model.graph
    x = next(i for i in g.input if i.name == "X")
    x.name = "X_bf"
    dims = x.type.tensor_type.shape.dim
    dims[0].dim_param, dims[1].dim_param, dims[2].dim_value = "B", "T", 2
    rng = np.random.default_rng(0)
    g.initializer.extend([onnx.numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "dense_k"),
                          onnx.numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "dense_b")])
    for k, n in enumerate([onnx.helper.make_node("MatMul", ["X_bf", "dense_k"], ["dense_mm"]),
                           onnx.helper.make_node("Add", ["dense_mm", "dense_b"], ["dense_out"]),
                           onnx.helper.make_node("Transpose", ["dense_out"], ["X"], perm=[1, 0, 2])]):
        g.node.insert(k, n)
    onnx.checker.check_model(model, full_check=True)
    fused, report = _fused_once(model, "Loop", Loop=0)
    feeds = {"X_bf": rng.standard_normal((3, 6, 2)).astype(np.float32),
             "mask": np.array([[1] * 6, [1] * 4 + [0] * 2, [0, 1, 1, 0, 1, 1]], bool).T[:, :, None]}
    want, got = session(model).run(None, feeds), session(fused).run(None, feeds)
    for a, b in zip(got, want):
        assert_close(a, b, "fused vs original")


def test_outputs_written_into_a_carried_buffer_fused():
    """``outs[t] = h`` in the loop (a carried buffer, one ScatterND at the iteration's row a step): the buffer
    after the loop is the native op's Y; any T and batch."""
    model = build_buffer_loop()
    fused, report = _fused_once(model, Loop=0, ScatterND=0, RNN=1)
    rng = np.random.default_rng(7)
    runs = []
    for T_, B_ in ((1, 1), (5, 3), (8, 2)):
        x = rng.standard_normal((T_, B_, 3)).astype(np.float32)
        runs.append(({"x": x}, reference(LoopOpts(), x)))
    _same_outputs("buffer", model, fused, runs)


@pytest.mark.parametrize("miss,reason", [("reads_previous", "buffer read inside the step"),
                                         ("row_shifted", "")])
def test_buffer_near_misses_declined(miss, reason):
    """A buffer the step reads for its values, or written a row off: no per-step output of a native op."""
    _declined(build_buffer_loop(miss), reason)


@pytest.mark.parametrize("form", ["batch_first", "reversed"])
def test_buffer_written_through_an_index_grid_fused(form):
    """``outs[:, i] = h`` written by one ScatterND over an index grid computed from i and the buffer's shape
    (jax2onnx's ``ys.at[:, t].set(h)``, TorchScript's ``outs[:, t, :] = h``): read by running the write, the
    buffer after the loop is the native op's Y batch-first; any T and batch. ``reversed``: ``outs[:, T - 1 - i]
    = h`` (T read from the buffer's shape), the steps stacked last first: Y flipped on time."""
    model = build_scattered_buffer(form)
    fused, report = _fused_once(model, Loop=0, ScatterND=0, RNN=1)
    rng = np.random.default_rng(8)
    runs = []
    for T_, B_ in ((1, 1), (5, 3), (8, 2)):
        x = rng.standard_normal((T_, B_, 3)).astype(np.float32)
        ys, h_last = reference(LoopOpts(), x)
        ys = ys[::-1] if form == "reversed" else ys
        runs.append(({"x": x}, [np.transpose(ys, (1, 0, 2)), h_last]))
    _same_outputs(f"scattered/{form}", model, fused, runs)


@pytest.mark.parametrize("form,reason", [("data_index", "slots the iteration"),
                                         ("adds", "slots the iteration"), ("clamped", "numbers of its own"),
                                         ("reduced", "slots the iteration"), ("wrapped", "slots the iteration"),
                                         ("wider", "width"),
                                         ("scaled", "no state of the step")])
def test_scattered_buffer_near_misses_declined(form, reason):
    """A grid write at a slot computed from a value, one that adds, one
    writing a value no state holds, one clamped at a number (right at every length a run of a few shows, wrong
    past 16: a review's repro), or one filling part of a wider buffer: declined, the model as it was."""
    _declined(build_scattered_buffer(form), reason)


def test_scattered_buffer_left_unread_is_fused():
    """The buffer's final value no output (nothing reads what it holds): the loop fuses (it was an internal
    error: its placement, never run, was asked of the length check)."""
    model = build_scattered_buffer("unused")
    fused, _ = _fused_once(model, Loop=0, RNN=1)
    x = np.random.default_rng(9).standard_normal((20, 3, 3)).astype(np.float32)
    assert_close(session(fused).run(None, {"x": x})[0], reference(LoopOpts(), x)[1], "h_last")


def test_a_head_too_deep_to_read_symbolically_is_replayed():
    """A per-step head of 600 elementwise ops (300 activations nested) is no maths the recogniser reads: it is
    declined as such (Python ran out of stack on it, an internal error) and replayed on the op's Y."""
    model = build_deep_loop(head_ops=600)
    fused, _ = _fused_once(model, Loop=0, RNN=1)
    x = np.random.default_rng(1).standard_normal((5, 2, 3)).astype(np.float32)
    for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
        assert_close(got, want, "deep head")


def test_a_cell_nesting_too_deep_is_declined_with_a_reason():
    """h' = tanh(tanh(... tanh(x W + h R + b))), 80 deep: no native cell, and too deep to read: declined."""
    _declined(build_deep_loop(cell_tanhs=80), "nest more than")


def _outputs_kept(model: onnx.ModelProto, fused: onnx.ModelProto, steps: int = 6) -> None:
    x = np.random.default_rng(2).standard_normal((steps, 1, 4)).astype(np.float32)
    for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
        assert got.shape == want.shape
        assert_close(got, want, "stacked loops")


def test_stacked_loops_sharing_one_trip_count_all_fuse():
    """Each Loop's input is the Loop before's scan output, one row per iteration: as many rows as its trip
    count when its condition stays true. More layers than the pipeline has rounds all fuse (one layer took a
    round each, and the rounds ran out: 6 of 8 fused)."""
    from rnnfuse.pipeline import MAX_ROUNDS

    layers = MAX_ROUNDS + 2
    model = build_stacked_loops(layers)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused).get("RNN") == layers and "Loop" not in op_counts(fused), report.to_text()
    _outputs_kept(model, fused)


def _static_loops_through_a_relu(declared: str) -> onnx.ModelProto:
    """Two stacked tanh Loops over x [6, 1, H] that both run a constant 6 iterations, a Relu between them, the
    first Loop's outputs and the Relu's declared with the time dim ``declared`` (jax2onnx names a Loop's
    stacked outputs' dim with a sentinel though T is static)."""
    from onnx import TensorProto, helper, numpy_helper

    model = build_stacked_loops(2)
    g = model.graph
    g.input[0].type.tensor_type.shape.dim[0].Clear()
    g.input[0].type.tensor_type.shape.dim[0].dim_value = 6
    g.initializer.append(numpy_helper.from_array(np.array(6, np.int64), "six"))
    loops = [n for n in g.node if n.op_type == "Loop"]
    for loop in loops:
        loop.input[0] = "six"
    for n in loops[1].attribute[0].g.node:
        n.input[:] = ["relu0" if i == "ys0" else i for i in n.input]
    at = list(g.node).index(loops[0]) + 1
    g.node.insert(at, helper.make_node("Relu", ["ys0"], ["relu0"]))
    g.value_info.extend(helper.make_tensor_value_info(v, TensorProto.FLOAT, [declared, 1, 4]) for v in ("ys0", "relu0"))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_constant_trip_count_matches_a_static_time_dim_a_declared_name_hides():
    """The upper Loop runs 6 iterations over relu(the lower one's outputs), whose dim the file names
    symbolically; followed back through the Relu and the lower op to x, that dim is the static 6 (it was
    declined as "runs at most 6 iterations, not once per time step", a probe's jax2onnx export)."""
    model = _static_loops_through_a_relu("JAX2ONNX_DYNAMIC_DIM_SENTINEL")
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused).get("RNN") == 2 and "Loop" not in op_counts(fused), report.to_text()
    _outputs_kept(model, fused)


def test_a_loop_over_one_that_stops_early_is_not_read_as_running_its_trip_count():
    """The first Loop's condition turns false after 3 iterations: its outputs have 3 rows, not x.shape[0];
    declined. The Loop over them runs x.shape[0] iterations, which is not its input's length: it reads its input
    with a Gather, which fails past the end, so it runs over that many of its input's steps wherever the model
    runs at all (T <= 3): fused over ``ys0[:T]`` (a runtime trip count), not over all of ys0."""
    model = build_stacked_loops(2, stop_after=3)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused).get("Loop", 0) == 1 and len(report.fused) == 1, report.to_text()
    assert "loop condition's bound is not the number of time steps" in report.declined[0].reason, report.to_text()
    _outputs_kept(model, fused, steps=3)
    x = np.random.default_rng(0).standard_normal((2, 1, H)).astype(np.float32)  # (T = 2: the second runs 2 steps)
    assert_close(session(fused).run(None, {"x": x})[0], session(model).run(None, {"x": x})[0], "T = 2")


def test_stacked_loops_in_a_big_model_fuse_in_one_round(monkeypatch):
    """In a model too big to infer whole, each Loop's step input is the stacked output of the Loop below: its
    rank is what that Loop's body declares (rnnfuse.op_shapes.loop_output_type), not a cone inference through
    every Loop below it. The cone budget ran out above ~770 of 2,777 stacked Loops: the rest were declined,
    fused round after round as the ones below were, and the top three never."""
    import rnnfuse.cone_types
    import rnnfuse.model

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)  # (a big model's view)
    monkeypatch.setattr(rnnfuse.cone_types, "CHEAP_INFERENCE_NODES", 100)  # (a budget of 100 nodes)
    model = build_stacked_loops(40)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 40 and not report.declined and report.rounds == 2, report.to_text()
    _outputs_kept(model, fused)


def test_a_check_model_big_by_its_loop_bodies_runs_light_first(monkeypatch):
    """Nodes inside Loop bodies count towards a big check model: onnxruntime optimizes every body too (1,600
    stacked Loops and their RNNs: 2.0 s to load optimized, 0.9 s light). 4 Loops: a check model of 15 nodes
    outside their bodies, 47 with them."""
    from helpers import skewed_sessions
    from rnnfuse import validate

    monkeypatch.setattr(validate, "LIGHT_CHECK_NODES", 30)
    opened = skewed_sessions(monkeypatch, validate, lambda light: False, lambda name: False)
    model = build_stacked_loops(4)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 4 and opened[0] is True, (opened, report.to_text())
    _outputs_kept(model, fused)


@pytest.mark.parametrize("form", RUNNING_SUM_FORMS)
def test_a_running_sum_beside_the_cell_is_its_outputs_summed(form):
    """A carried ``acc = acc + y`` read for nothing but its sum (y the new h, or a head on it; a jax carry, a
    TorchScript running sum) is no state of the cell: one RNN, and the last acc is its start plus the sum of
    every step's y (it was declined as '2 recurrent states'). Outputs kept at T = 1 and 6, batch 1 and 3."""
    model = build_running_sum(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(6)
    for T, B in ((1, 1), (6, 3)):
        x = rng.standard_normal((T, B, 3)).astype(np.float32)
        for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
            assert_close(got, want, form)


@pytest.mark.parametrize("form", RUNNING_SUM_MISSES)
def test_a_sum_the_step_reads_or_scales_or_outputs_per_step_is_declined(form):
    """The new state reads the sum, the sum decays (0.9 * acc + h), or its value after every step is a per-step
    output: no running sum a native op's outputs give; declined, the model unchanged."""
    _declined(build_running_sum(form))


@pytest.mark.parametrize("form", COUNTER_FORMS)
def test_a_counter_carried_beside_the_cell_ends_at_its_start_plus_the_steps(form):
    """A counter ``t = t + 1`` carried beside h whose final value the graph uses (a jax carry ``(h, t)``; was
    declined as "the loop's final iteration count is used"): one RNN, and the final counter is its start plus
    x's number of steps, in its own type and shape. Outputs the same at T = 1 and 6, batch 1 and 3."""
    model = build_counted_loop(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(7)
    for T, B in ((1, 1), (6, 3)):
        x = rng.standard_normal((T, B, 3)).astype(np.float32)
        for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
            assert got.dtype == want.dtype and got.shape == want.shape, form
            assert_close(got, want, form)


def test_a_wrong_final_count_fails_validation(monkeypatch):
    """The final counter is one of the pairs validation compares: a count built without the steps is caught."""
    from rnnfuse import emit

    monkeypatch.setattr(emit, "_final_count", lambda b, co: b.op("Identity", co.start))
    fused, report = rnnfuse.optimize(build_counted_loop("int64"))
    assert not report.fused and "does not reproduce" in report.declined[0].reason, report.to_text()
    assert op_counts(fused)["Loop"] == 1


@pytest.mark.parametrize("form", COUNTER_MISSES)
def test_a_counter_by_two_from_a_runtime_start_or_of_floats_is_declined(form):
    """A counter stepping by 2, one whose start the graph computes at runtime, or a float one (it stops counting
    where its type runs out of integers, which no input validation feeds reaches): declined, the model as it was."""
    _declined(build_counted_loop(form))


@pytest.mark.parametrize("form", TWO_SEQUENCE_FORMS)
def test_two_sequences_read_side_by_side_are_one_input_concatenated_on_features(form):
    """A step reading x_t and z_t side by side (``lax.scan`` over ``(x, z)``; was declined as "two different
    per-step inputs are read"): one RNN over ``concat([x, z], -1)`` whose input weight is ``[W; V]``, however
    the step spells the product (two matmuls, one of ``concat([x_t, z_t])``, ``concat([z_t, h, x_t])``),
    time-major or batch-first. Outputs the same at T = 1 and 6, batch 1 and 3."""
    model = build_two_sequences(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    onnx.checker.check_model(fused, full_check=True)
    rng = np.random.default_rng(8)
    for T, B in ((6, 1), (6, 3)) if form == "static_T" else ((1, 1), (6, 3)):
        shape = (B, T) if form == "batch_first" else (T, B)
        feeds = {"x": rng.standard_normal(shape + (3,)).astype(np.float32),
                 "z": rng.standard_normal(shape + (2,)).astype(np.float32)}
        for got, want in zip(session(fused).run(None, feeds), session(model).run(None, feeds)):
            assert_close(got, want, form)


@pytest.mark.parametrize("form", ["sum", "cat", "batch_first", "reversed"])
def test_two_inputs_a_scan_scans_side_by_side_are_one_input(form):
    """The same step as a Scan body scanning x and z (alike: forward, backward, batch-first): one RNN over their
    concatenation on features, the outputs the same."""
    model = build_two_sequences(form, "scan")
    fused, report = _fused_once(model, Scan=0, RNN=1)
    assert report.fused[0].validation.startswith("ok"), report.to_text()
    rng = np.random.default_rng(9)
    shape = (3, 6) if form == "batch_first" else (6, 3)
    feeds = {"x": rng.standard_normal(shape + (3,)).astype(np.float32),
             "z": rng.standard_normal(shape + (2,)).astype(np.float32)}
    for got, want in zip(session(fused).run(None, feeds), session(model).run(None, feeds)):
        assert_close(got, want, form)


@pytest.mark.parametrize("form", ["directions_apart", "lengths_apart", "squared"])
def test_two_scanned_inputs_scanned_apart_or_of_lengths_declared_apart_are_declined(form):
    """z scanned backwards beside a forward x, declared with a time length of its own (validation could not feed
    the file: a Scan requires one), or read squared: declined."""
    _declined(build_two_sequences(form, "scan"))


@pytest.mark.parametrize("form", TWO_SEQUENCE_MISSES)
def test_a_second_sequence_of_another_length_or_read_elementwise_is_declined(form):
    """The second sequence declared with a time length or a batch of its own (a concatenation would fail where
    the loop ran: a batch of 1 broadcasts in the step), read squared before its matmul (no part of the input's
    affine map), or of a width only named: declined, the model as it was."""
    _declined(build_two_sequences(form))


@pytest.mark.parametrize("end", [3, 5])
def test_a_slice_over_the_whole_fixed_batch_changes_nothing(end):
    """A model that fixes its batch size (3) slicing the cell's pre-activation [0:end] on the batch axis with
    end >= 3 (jax2onnx's ``gx[:, :H]`` at a static batch names every axis; was declined as "a slice along the
    batch axis"): fused, the outputs the same."""
    model = build_batch_sliced(end)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    x = np.random.default_rng(10).standard_normal((6, 3, 3)).astype(np.float32)
    for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
        assert_close(got, want, f"end {end}")


def test_a_slice_dropping_rows_of_the_fixed_batch_is_declined():
    """[0:1] of a batch of 3 drops rows (what follows broadcasts row 0): declined."""
    _declined(build_batch_sliced(1), "a slice along the batch axis")


@pytest.mark.parametrize("form", TRACED_READ_FORMS)
def test_a_traced_index_into_a_transpose_of_x_reads_the_step(form):
    """jax2onnx's ``x[:, t]`` with a traced t (a scan over arange, a fori_loop, a counter in the carry): a
    Transpose of the carried x in the body, gathered at ``Reshape(Expand(Where(i < 0, i + T, i)))``; was
    declined as "no per-step input". One RNN, the outputs the same at batch 1 and 3."""
    model = build_traced_read(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    rng = np.random.default_rng(11)
    for B in (1, 3):
        x = rng.standard_normal((B, 6, 3) if form == "batch_first" else (6, B, 3)).astype(np.float32)
        for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
            assert_close(got, want, form)


@pytest.mark.parametrize("form", TRACED_READ_MISSES)
def test_a_transpose_that_reorders_the_step_or_an_index_of_the_next_step_is_declined(form):
    """A transpose whose step is [F, B] (perm [1, 2, 0]), or an index ``i + 1``: no step read; declined."""
    _declined(build_traced_read(form))


@pytest.mark.parametrize("form", WHERE_ELU_FORMS)
def test_an_elu_written_with_where_and_exp_is_the_native_elu(form):
    """``Where(a > 0, a, alpha * (exp(a) - 1))``, the exp's argument a or ``Where(a > 0, 0, a)`` (jax's own elu,
    bound by reference before export, writes no Elu op): RNN with Elu(alpha); was declined as "Where on a
    comparison of a cell value that is not a thresholded relu"."""
    model = build_where_elu(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert "Elu(1.3)" in report.fused[0].cell, report.to_text()
    x = np.random.default_rng(12).standard_normal((6, 3, 3)).astype(np.float32) * 3
    for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
        assert_close(got, want, form)


@pytest.mark.parametrize("form", WHERE_ELU_MISSES)
def test_an_elu_like_where_of_another_offset_or_threshold_is_declined(form):
    """``1.3 * exp(a) - 1`` (not alpha times exp(a) - 1), or the comparison a > 1: no elu; declined."""
    _declined(build_where_elu(form))


@pytest.mark.parametrize("form", GROWN_FORMS)
def test_a_tensor_grown_by_a_row_a_step_is_the_stacked_outputs(form):
    """``out = Concat([out, h[None]], a)`` from an empty tensor (TorchScript's growing ``torch.cat``; was
    declined as a state no cell reads): the op's Y, time-major or batch-first. Outputs the same at T = 1 and 6."""
    model = build_grown_buffer(form)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    rng = np.random.default_rng(13)
    for T, B in ((1, 1), (6, 3)):
        x = rng.standard_normal((T, B, 3)).astype(np.float32)
        for got, want in zip(session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})):
            assert_close(got, want, form)


@pytest.mark.parametrize("form", GROWN_MISSES)
def test_a_grown_tensor_with_a_first_row_of_its_own_or_prepended_to_is_declined(form):
    """Grown from a row of zeros no step wrote, or each step's row put first: declined."""
    _declined(build_grown_buffer(form))


def test_a_float_counter_from_a_whole_number_counts_the_iterations():
    """A float counter carried from 0.0 and compared with float lengths (``t < Lf``) is the iteration number,
    as an integer one is (a start read as an integer only declined it; a review's probe)."""
    from onnx import TensorProto, helper, numpy_helper

    model = build_lengths(LengthOpts("lt"))
    g = model.graph
    loop = next(n for n in g.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    g.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "tf0"))
    g.node.insert(0, helper.make_node("Cast", ["L"], ["Lf"], to=TensorProto.FLOAT))
    body.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "one_f"))
    body.node.append(helper.make_node("Add", ["tf", "one_f"], ["tfn"]))
    for n in body.node:
        if n.op_type == "Less":
            n.input[:] = ["tf", "Lf"]
    carried = len(loop.input) - 2
    loop.input.append("tf0")
    loop.output[:] = list(loop.output[:carried]) + ["tf_last"] + list(loop.output[carried:])
    body.input.append(helper.make_tensor_value_info("tf", TensorProto.FLOAT, []))
    outs = list(body.output)
    del body.output[:]
    body.output.extend(outs[:1 + carried] + [helper.make_tensor_value_info("tfn", TensorProto.FLOAT, [])] + outs[1 + carried:])
    onnx.checker.check_model(model, full_check=True)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    rng = np.random.default_rng(3)
    for T in (4, 5):
        x = rng.standard_normal((T, 3, 3)).astype(np.float32)
        L = rng.integers(0, T + 1, (3,)).astype(np.int64)
        for got, want in zip(session(fused).run(None, {"x": x, "L": L}), session(model).run(None, {"x": x, "L": L})):
            assert_close(got, want, "float counter")


def _row_compare_loop(cast_outside: bool, threshold: float) -> onnx.ModelProto:
    """A tanh RNN Loop over time-major x whose step mask is ``M[i] > threshold`` of a [T, B] float M: a bool
    input cast to 0/1 floats before the loop (``mask.float()``), or a float input."""
    from onnx import TensorProto, helper as h, numpy_helper as nh

    F_, H_ = 3, 4
    rng = np.random.default_rng(11)
    W = nh.from_array(rng.standard_normal((F_, H_)).astype(np.float32), "W")
    R = nh.from_array((0.5 * rng.standard_normal((H_, H_))).astype(np.float32), "R")
    f32 = TensorProto.FLOAT
    reads = [h.make_node("Gather", ["x", "i"], ["xt"], axis=0), h.make_node("Gather", ["Mf", "i"], ["mt"], axis=0),
             h.make_node("Greater", ["mt", "thr"], ["mb"]), h.make_node("Unsqueeze", ["mb", "ax1"], ["mu"])]
    outer = [h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "z"], ["T"], axis=0),
             h.make_node("Gather", ["xs", "one"], ["B"], axis=0), h.make_node("Unsqueeze", ["B", "z1"], ["B1"]),
             h.make_node("Concat", ["B1", "Hc"], ["hs"], axis=0), h.make_node("ConstantOfShape", ["hs"], ["h0"]),
             h.make_node("Cast" if cast_outside else "Identity", ["M"], ["Mf"], **({"to": f32} if cast_outside else {}))]
    consts = [W, R, nh.from_array(np.array(0, np.int64), "z"), nh.from_array(np.array(1, np.int64), "one"),
              nh.from_array(np.array([0], np.int64), "z1"), nh.from_array(np.array([H_], np.int64), "Hc")]
    inputs = [h.make_tensor_value_info("x", f32, ["T", "B", F_]),
              h.make_tensor_value_info("M", TensorProto.BOOL if cast_outside else f32, ["T", "B"])]
    body_consts = [nh.from_array(np.array(threshold, np.float32), "thr"), nh.from_array(np.array([1], np.int64), "ax1")]
    return _tanh_loop("row_compare", reads, outer, inputs, consts, body_consts, keep="mu", state_dims=[None, H_])


@pytest.mark.parametrize("cast_outside", [True, False], ids=["bool_cast_to_float", "float_input"])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_a_float_row_compared_with_a_threshold_is_the_step_mask(cast_outside, threshold):
    """``M[i] > c`` of a [T, B] float M read per step: of a bool mask cast to 0/1 floats before the loop, the mask
    itself for any c in [0, 1) (the evaluator reads a 0/1 value compared between its values as that mask); of
    a float input, a mask computed from its rows. Either way one masked RNN, the outputs the original's."""
    model = _row_compare_loop(cast_outside, threshold)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].masked, report.to_text()
    rng = np.random.default_rng(12)
    s_orig, s_fused = session(model), session(fused)
    for B in (1, 3):
        x = rng.standard_normal((6, B, 3)).astype(np.float32)
        M = rng.random((6, B)) > 0.4
        if not cast_outside:  # (values a float mask may hold besides 0 and 1)
            M = np.where(M, 1.0, rng.choice([0.0, -0.5, 0.25], size=M.shape)).astype(np.float32)
        for got, want in zip(s_fused.run(None, {"x": x, "M": M}), s_orig.run(None, {"x": x, "M": M})):
            assert_close(got, want, f"row_compare B={B}")


def test_an_initial_state_given_with_batch_one_broadcasts_as_in_the_original():
    """h0 given as an input whose batch the file does not tie to x's ([None, H]): fed one row while x has three,
    the original broadcasts it against every row (its first step's sum does); the native op takes exactly
    [1, B, H], so the fused model expands it to x's batch. Both run, with the same outputs."""
    from onnx import TensorProto, helper as h, numpy_helper as nh

    F_, H_ = 3, 4
    rng = np.random.default_rng(13)
    consts = [nh.from_array(rng.standard_normal((F_, H_)).astype(np.float32), "W"),
              nh.from_array((0.5 * rng.standard_normal((H_, H_))).astype(np.float32), "R"), nh.from_array(np.array(0, np.int64), "z")]
    outer = [h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "z"], ["T"], axis=0)]
    inputs = [h.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", F_]),
              h.make_tensor_value_info("h0", TensorProto.FLOAT, [None, H_])]
    model = _tanh_loop("given_h0", [h.make_node("Gather", ["x", "i"], ["xt"], axis=0)], outer, inputs, consts)
    fused, report = _fused_once(model, Loop=0, RNN=1)
    s_orig, s_fused = session(model), session(fused)
    for rows in (3, 1):  # (h0 with x's batch, then one row broadcast)
        feeds = {"x": rng.standard_normal((5, 3, F_)).astype(np.float32),
                 "h0": rng.standard_normal((rows, H_)).astype(np.float32)}
        for got, want in zip(s_fused.run(None, feeds), s_orig.run(None, feeds)):
            assert got.shape == want.shape
            assert_close(got, want, f"given h0 of {rows} rows")


@pytest.mark.parametrize("back, fused", [(1, True), (2, False), (0, False)])
def test_a_strided_read_from_the_end_is_a_reverse_step(back, fused):
    """tf2onnx's x[:, n - 1 - t] in a while loop over batch-first x: a Slice whose start on the time axis is
    ``T - back - i`` with a step of 1e9 (one element) to an end of 1e9. back = 1 reads x backwards (one reverse
    op, the outputs the original's); T - 2 - i and T - i read other steps: declined, left as it was."""
    from onnx import TensorProto, helper as h, numpy_helper as nh

    F_, H_ = 3, 4
    rng = np.random.default_rng(15)
    consts = [nh.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("W", (F_, H_)), ("R", (H_, H_)))]
    i64 = lambda name, v: nh.from_array(np.array(v, np.int64), name)  # noqa: E731
    reads = [h.make_node("Sub", ["n", "back"], ["nb"]), h.make_node("Sub", ["nb", "i"], ["t"]),
             h.make_node("Unsqueeze", ["t", "ax0"], ["t1"]), h.make_node("Concat", ["zero1", "t1"], ["starts"], axis=0),
             h.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["xs"]), h.make_node("Squeeze", ["xs", "ax1"], ["xt"])]
    body_consts = [i64("back", back), i64("ax0", [0]), i64("ax1", [1]), i64("zero1", [0]), i64("ends", [10**9, 10**9]),
                   i64("axes", [0, 1]), i64("steps", [1, 10**9])]
    outer = [h.make_node("Shape", ["x"], ["xs_"]), h.make_node("Gather", ["xs_", "one"], ["n"], axis=0),
             h.make_node("Identity", ["n"], ["T"]), h.make_node("Gather", ["xs_", "zero"], ["B"], axis=0),
             h.make_node("Unsqueeze", ["B", "ax0o"], ["B1"]), h.make_node("Concat", ["B1", "Hc"], ["hs"], axis=0),
             h.make_node("ConstantOfShape", ["hs"], ["h0"])]
    model = _tanh_loop("strided_back", reads, outer, [h.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", F_])],
                       consts + [i64("one", 1), i64("zero", 0), i64("ax0o", [0]), i64("Hc", [H_])], body_consts,
                       state_dims=["B", H_])
    out, report = rnnfuse.optimize(model)
    if not fused:
        assert not report.fused, report.to_text()
        assert out.SerializeToString() == model.SerializeToString()
        return
    out, report = _fused_once(model, Loop=0, RNN=1)
    assert report.fused[0].direction == "reverse", report.to_text()
    s_orig, s_fused = session(model), session(out)
    for B in (1, 3):
        feeds = {"x": rng.standard_normal((B, 5, F_)).astype(np.float32)}
        for got, want in zip(s_fused.run(None, feeds), s_orig.run(None, feeds)):
            assert_close(got, want, f"strided back B={B}")


def test_a_mask_of_another_length_read_back_from_its_own_end_is_declined():
    """x [seq, B, F] read at Tx - 1 - i beside a mask [mask_len, B] read at Tm - 1 - i, Tm its own length: fed a
    longer mask the loop reads its last rows, so cutting it to its first Tx rows would be wrong (a review found
    the wrong result): declined, left as it was."""
    from onnx import TensorProto, helper as h, numpy_helper as nh

    F_, H_ = 3, 4
    rng = np.random.default_rng(16)
    consts = [nh.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("W", (F_, H_)), ("R", (H_, H_)))]
    i64 = lambda name, v: nh.from_array(np.array(v, np.int64), name)  # noqa: E731

    def back(src, out):  # (the length of src minus one minus i)
        return [h.make_node("Shape", [src], [f"{out}_s"]), h.make_node("Gather", [f"{out}_s", "zero"], [f"{out}_n"], axis=0),
                h.make_node("Sub", [f"{out}_n", "one"], [f"{out}_n1"]), h.make_node("Sub", [f"{out}_n1", "i"], [out])]

    reads = back("x", "tx") + back("m", "tm") + [
        h.make_node("Gather", ["x", "tx"], ["xt"], axis=0), h.make_node("Gather", ["m", "tm"], ["mt"], axis=0),
        h.make_node("Unsqueeze", ["mt", "ax1"], ["mu"])]
    outer = [h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "z"], ["T"], axis=0),
             h.make_node("Gather", ["xs", "o"], ["B"], axis=0), h.make_node("Unsqueeze", ["B", "ax0"], ["B1"]),
             h.make_node("Concat", ["B1", "Hc"], ["hs"], axis=0), h.make_node("ConstantOfShape", ["hs"], ["h0"])]
    inputs = [h.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", F_]),
              h.make_tensor_value_info("m", TensorProto.BOOL, ["mask_len", "batch"])]
    model = _tanh_loop("mask_back", reads, outer, inputs, consts + [i64("z", 0), i64("o", 1), i64("ax0", [0]), i64("Hc", [H_])],
                       [i64("zero", 0), i64("one", 1), i64("ax1", [1])], keep="mu", state_dims=["batch", H_])
    out, report = rnnfuse.optimize(model)
    assert not report.fused and any("time length" in f.reason for f in report.declined), report.to_text()
    assert out.SerializeToString() == model.SerializeToString()


def _tanh_loop(name: str, reads: list, outer: list, inputs: list, consts: list, body_consts: list = (),
               keep: str | None = None, h0: str = "h0", state_dims=None) -> onnx.ModelProto:
    """A Loop over ``T`` stepping ``h = tanh(x_t @ W + h @ R)`` from ``h0``, x_t computed by the body nodes
    ``reads`` as "xt" (with ``keep``, a [B, 1] bool the reads compute: h kept where it is false); ``outer``
    the main graph's nodes before the Loop (computing T and h0); outputs the per-step h "Y" and the last "hT"."""
    from onnx import TensorProto, helper as h

    f32 = TensorProto.FLOAT
    step = [h.make_node("MatMul", ["xt", "W"], ["a"]), h.make_node("MatMul", ["hp", "R"], ["b"]),
            h.make_node("Add", ["a", "b"], ["s"]), h.make_node("Tanh", ["s"], ["hn"])]
    step += [h.make_node("Where", [keep, "hn", "hp"], ["ho"])] if keep else [h.make_node("Identity", ["hn"], ["ho"])]
    state = h.make_tensor_value_info  # (the carried h, declared with ``state_dims``)
    body = h.make_graph(
        list(reads) + step + [h.make_node("Identity", ["cond"], ["co"]), h.make_node("Identity", ["ho"], ["y"])], "body",
        [state("i", TensorProto.INT64, []), state("cond", TensorProto.BOOL, []), state("hp", f32, state_dims)],
        [state("co", TensorProto.BOOL, []), state("ho", f32, state_dims), state("y", f32, state_dims)], list(body_consts))
    g = h.make_graph(list(outer) + [h.make_node("Loop", ["T", "", h0], ["hT", "Y"], body=body)], name, inputs,
                     [h.make_tensor_value_info("Y", f32, None), h.make_tensor_value_info("hT", f32, None)], consts)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("form", READ_AHEAD_FORMS)
def test_a_loop_reading_x_ahead_of_the_iteration_number_is_an_op_over_the_rest_of_x(form):
    """x read at ``i + s`` by a Loop that runs ``T - s`` times (TorchScript's ``range(s, T)``, a jax counter from
    s, here written by hand with a dynamic T): one RNN over ``x[s:]``, the outputs those of the loop and of
    numpy's recurrence over x from step s, at several lengths and batches."""
    model = build_read_ahead(form)
    fused, report = _fused_once(model, Loop=0, RNN=1, Slice=1)
    s = 2 if form == "ahead2_counted_twice" else 1
    W, R, b = weights()
    rng = np.random.default_rng(5)
    for T, B in ((s + 1, 1), (5, 3), (9, 2)):
        x = rng.standard_normal((T, B, F)).astype(np.float32)
        h, ys = np.zeros((B, H), np.float32), []
        for t in range(s, T):
            h = np.tanh(x[t] @ W + h @ R + b)
            ys.append(h)
        got, want = session(fused).run(None, {"x": x}), session(model).run(None, {"x": x})
        for g_, w_, r_ in zip(got, want, (np.stack(ys), h)):
            assert_close(g_, w_, form)
            assert_close(g_, r_, form)


@pytest.mark.parametrize("form", sorted(READ_AHEAD_MISSES))
def test_a_loop_reading_ahead_with_a_wrong_count_a_mask_or_two_offsets_is_declined(form):
    """Read ahead but not over the rest of x alone: a trip count of T (the last read past x's end), a mask read
    at the iteration's own step, x read at two offsets: declined with the reason, the model unchanged."""
    model = build_read_ahead(form)
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert any(READ_AHEAD_MISSES[form] in f.reason for f in report.declined), report.to_text()
    assert fused.SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("form", ["pieces", "negative_bounds"])
def test_states_carried_as_one_tensor_fused(form):
    """Two states carried side by side in one tensor, cut apart by Slices and joined by a Concat each step
    (jax's ``carry = concatenate([h1, h2])``): carried piece by piece, each a native op of its own; the final
    carry joined again after them. Outputs equal at several lengths and batches."""
    model = build_piece_carry(form)
    fused, report = rnnfuse.optimize(model)
    assert not report.declined and [f.where for f in report.fused] == ["hh_last"], report.to_text()
    assert op_counts(fused).get("Loop", 0) == 0 and op_counts(fused).get("RNN") == 2, report.to_text()
    rng = np.random.default_rng(21)
    runs = []
    for T_, B_ in ((1, 1), (5, 3), (9, 2)):
        x = rng.standard_normal((T_, B_, F)).astype(np.float32)
        runs.append(({"x": x}, piece_carry_reference(form, x)))
    _same_outputs(f"pieces/{form}", model, fused, runs)


def test_states_carried_as_one_tensor_written_back_swapped_declined():
    """The halves joined the other way round each step (the states trade places): carried piece by piece it is
    no native cell; declined, the model as it was."""
    _declined(build_piece_carry("swapped"))


def test_an_output_carried_apart_from_the_state_is_declined_for_what_it_is():
    """A masked tanh step whose per-step output is a head on the new h, carried through the loop and held at
    masked steps (Keras' ``RNN`` over a custom cell whose output is not its state): the head is computed from
    the cell's new state, not from itself, so it is no cell; declined with that reason (it said "no state
    feeds back into the step"), the model as it was."""
    _declined(build_held_head(), "computed from the new state of a cell, not from itself")
