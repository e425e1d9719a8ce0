"""A per-step head too big to validate whole is validated at its probe points (rnnfuse.step_heads.probe_points,
rnnfuse.head_probes): the fused model still gives the original's outputs, the check model holds neither copy
of the head, a fault the probes see declines the rewrite, and a head that is not row-wise deep inside is still
declined (the probes stand in for a numeric run, never for the row-wise proof)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from rnnfuse import row_wise, step_heads, validate
from builders_loops import F, H, _loop_counters, _model, _tanh_step, _x_sizes, _zero_state, weights
from helpers import assert_same_on_x, op_counts

HEAD_OPS = step_heads.PROBED_ABOVE + 64  # a head just past the limit


def build_big_head(front: str = "loop", x_at: int | None = None, batch_reduce_at: int | None = None,
                   reversed_output: bool = False, folded: bool = False) -> onnx.ModelProto:
    """A tanh RNN over x [T, B, F] whose per-step output is its new h through ``HEAD_OPS`` elementwise ops
    (Mul, Add, Tanh, Sigmoid in turn), in a Loop or a Scan. ``x_at``: op ``x_at`` of the head adds
    ``x_t @ U`` (the step input read deep in the head); ``batch_reduce_at``: op ``batch_reduce_at`` is a sum over
    the batch (no row-wise op); ``reversed_output`` (Scan): the head's scan output is stacked last step first;
    ``folded``: the head's constant 0.5 is computed in the step (``0.25 * 2``)."""
    W, R, b = weights()
    U = (np.random.default_rng(3).standard_normal((F, H)) * 0.5).astype(np.float32)
    body = [*_tanh_step()]
    if folded:
        body.append(helper.make_node("Mul", ["quarter", "two"], ["half_c"]))
    half = "half_c" if folded else "half"
    cur = "hn"
    for k in range(HEAD_OPS):
        if k == x_at:
            body += [helper.make_node("MatMul", ["xt", "U"], ["xu"]), helper.make_node("Add", [cur, "xu"], [f"e{k}"])]
        elif k == batch_reduce_at:
            body.append(helper.make_node("ReduceSum", [cur, "axis0"], [f"e{k}"], keepdims=1))
        else:
            op = ("Mul", "Add", "Tanh", "Sigmoid")[k % 4]
            body.append(helper.make_node(op, [cur, half] if op in ("Mul", "Add") else [cur], [f"e{k}"]))
        cur = f"e{k}"
    body.append(helper.make_node("Identity", [cur], ["yt"]))
    f = TensorProto.FLOAT
    outs = [helper.make_tensor_value_info("hn", f, ["B", H]), helper.make_tensor_value_info("yt", f, ["B", H])]
    inits = [numpy_helper.from_array(v, n) for n, v in (("W", W), ("R", R), ("b", b), ("U", U))]
    inits += [numpy_helper.from_array(v, n) for n, v in (
        ("half", np.float32(0.5)), ("quarter", np.float32(0.25)), ("two", np.float32(2.0)),
        ("i0", np.array([0], np.int64)), ("i1", np.array([1], np.int64)),
        ("axis0", np.array([0], np.int64)), ("iH", np.array([H], np.int64)), ("zero", np.zeros(1, np.float32)),
        ("true", np.array(True)))]
    if front == "loop":
        body.insert(0, helper.make_node("Gather", ["x", "it"], ["xt"], axis=0))
        body.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
        graph = helper.make_graph(body, "body", _loop_counters() + [helper.make_tensor_value_info("h", f, ["B", H])],
                                  [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])] + outs)
        loop = helper.make_node("Loop", ["T", "true", "h0"], ["hT", "ys"], body=graph)
    else:
        graph = helper.make_graph(body, "body", [helper.make_tensor_value_info("h", f, ["B", H]),
                                                 helper.make_tensor_value_info("xt", f, ["B", F])], outs)
        loop = helper.make_node("Scan", ["h0", "x"], ["hT", "ys"], body=graph, num_scan_inputs=1,
                                scan_output_directions=[1 if reversed_output else 0])
    nodes = _x_sizes() + _zero_state() + [loop]
    return _model(nodes, f"big_head_{front}", [helper.make_tensor_value_info("x", f, ["T", "B", F])],
                  [helper.make_tensor_value_info("ys", f, ["T", "B", H]), helper.make_tensor_value_info("hT", f, ["B", H])],
                  inits)


def _check_model_sizes(monkeypatch) -> list[int]:
    """The node count (bodies included) of every check model validation builds from now on."""
    sizes: list[int] = []
    real = validate.build_check_model

    def counting(*args, **kwargs):
        built = real(*args, **kwargs)
        sizes.append(_nodes(built[0].graph))
        return built

    monkeypatch.setattr(validate, "build_check_model", counting)
    return sizes


def _nodes(g: onnx.GraphProto) -> int:
    return sum(1 + sum(_nodes(a.g) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH) for n in g.node)


def _same_outputs(model: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    assert_same_on_x(model, fused, F)


@pytest.mark.parametrize("front,x_at,reversed_output", [("loop", None, False), ("loop", 1000, False),
                                                        ("scan", None, False), ("scan", 1000, True)])
def test_a_big_head_is_validated_at_its_probe_points(monkeypatch, front, x_at, reversed_output):
    """Fused, the head checked at its probe points by a check model far smaller than the head, and the
    outputs the original's (the step input read 1,000 ops deep, a Scan output stacked backwards)."""
    model = build_big_head(front, x_at=x_at, reversed_output=reversed_output)
    sizes = _check_model_sizes(monkeypatch)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and not report.declined, report.to_text()
    assert "probe points" in report.fused[0].validation, report.fused[0].validation
    assert op_counts(fused)["RNN"] == 1 and not op_counts(fused).get(front.capitalize())
    assert sizes and max(sizes) < HEAD_OPS // 4, sizes  # neither the original's head nor its copy
    _same_outputs(model, fused)


def test_a_head_at_the_limit_is_validated_whole(monkeypatch):
    """At ``PROBED_ABOVE`` ops a head is still checked whole: the check model holds it twice."""
    monkeypatch.setattr(step_heads, "PROBED_ABOVE", HEAD_OPS + 10)
    sizes = _check_model_sizes(monkeypatch)
    fused, report = rnnfuse.optimize(build_big_head())
    assert len(report.fused) == 1 and "probe points" not in report.fused[0].validation
    assert max(sizes) > 2 * HEAD_OPS


def test_a_fault_at_a_probe_point_declines_the_rewrite(monkeypatch):
    """A replay that copies the head's first op wrong (an Add for its Mul) is seen at the first probe point: the
    rewrite is declined, the model left as it was."""
    real = row_wise.replay

    def faulty(b, nodes, env, hint):
        if hint == "head" and nodes and nodes[0].op_type == "Mul":
            wrong = onnx.NodeProto()
            wrong.CopyFrom(nodes[0])
            wrong.op_type = "Add"
            nodes = [wrong, *nodes[1:]]
        return real(b, nodes, env, hint)

    monkeypatch.setattr(step_heads, "replay", faulty)
    model = build_big_head()
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert "does not reproduce" in report.declined[0].reason, report.to_text()
    assert op_counts(fused) == op_counts(model)


def test_a_big_head_that_is_not_row_wise_deep_inside_is_declined():
    """A sum over the batch 1,500 ops into the head: the row-wise proof still covers every op, probed or not."""
    fused, report = rnnfuse.optimize(build_big_head(batch_reduce_at=1500))
    assert not report.fused and report.declined, report.to_text()
    assert "ReduceSum" in report.declined[0].reason, report.to_text()


def test_a_head_computed_by_control_flow_inside_the_step_is_declined():
    """An op of the head that holds a subgraph (an If deep in the head) is no row-wise op: the Loop is declined,
    and the reason names it."""
    model = build_big_head()
    body = next(n for n in model.graph.node if n.op_type == "Loop").attribute[0].g
    at = next(i for i, n in enumerate(body.node) if n.op_type == "Tanh" and n.output[0] != "hn")
    old = body.node[at]
    branch = lambda op, name: helper.make_graph([helper.make_node(op, [old.input[0]], [name])], name, [],  # noqa: E731
                                                [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)])
    body.node[at].CopyFrom(helper.make_node("If", ["cond"], [old.output[0]], then_branch=branch("Tanh", "t_out"),
                                            else_branch=branch("Sigmoid", "e_out")))
    fused, report = rnnfuse.optimize(model)
    assert not report.fused and report.declined, report.to_text()
    assert "If inside the step" in report.declined[0].reason, report.to_text()


def _break_the_loop_copy(monkeypatch) -> None:
    """Every loop copy a probe check builds loses its body's first node: onnxruntime cannot load it."""
    from rnnfuse import head_probes

    real = head_probes._body_computing

    def broken(body, outputs, extra):
        built = real(body, outputs, extra)
        del built.node[0]
        return built

    monkeypatch.setattr(head_probes, "_body_computing", broken)


def test_a_probe_check_that_cannot_run_falls_back_to_the_whole_check(monkeypatch):
    """The loop copy is the optimizer's own construction: when onnxruntime cannot run it (here a body missing
    a node), the rewrite is validated whole instead of being judged unvalidatable."""
    _break_the_loop_copy(monkeypatch)
    model = build_big_head()
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1, report.to_text()
    assert report.fused[0].validation.startswith("ok (max abs error"), report.fused[0].validation
    _same_outputs(model, fused)


def test_a_big_head_reading_a_constant_rnnfuse_folded_is_validated_whole(monkeypatch):
    """A constant the step computes (0.25 * 2) is copied into the replayed head as rnnfuse folded it: only a
    run of the whole head has onnxruntime confirm it, so the head is not probed."""
    sizes = _check_model_sizes(monkeypatch)
    model = build_big_head(folded=True)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and "probe points" not in report.fused[0].validation, report.to_text()
    assert max(sizes) > 2 * HEAD_OPS
    _same_outputs(model, fused)


def test_a_head_whose_output_is_not_rows_and_features_has_no_probe_points():
    """The probes are ``[rows, features]``, and their reshape back to the steps stands for the output's only
    when the output is so too: a head ending in ``[rows]`` (no row-wise op the search accepts ends so today)
    would be compared whole."""
    nodes = [helper.make_node("Tanh", [f"v{k}"], [f"v{k + 1}"]) for k in range(HEAD_OPS)]
    rank = {f"v{k + 1}": 2 for k in range(HEAD_OPS)}
    head = step_heads.StepHead(nodes, f"v{HEAD_OPS}", h={"v0"}, rank=rank)
    assert len(step_heads.probe_points(head)) == 1 + step_heads.PROBE_NODES
    head.rank[head.out] = 1
    assert step_heads.probe_points(head) == []


def test_a_probe_check_that_cannot_run_checks_the_whole_batch_again(monkeypatch):
    """The loop copy is in the check model of every rewrite validated with it: when it cannot run, every one
    of them is checked again on its own pairs (a second Loop beside the big head's is not left unvalidated)."""
    _break_the_loop_copy(monkeypatch)
    model = build_big_head()
    g = model.graph
    second = onnx.NodeProto()
    second.CopyFrom(next(n for n in g.node if n.op_type == "Loop"))
    del second.attribute[0].g.node[len(_tanh_step()) + 1:-1]  # (the cell alone: Gather, the step, Identity cond)
    second.attribute[0].g.node.append(helper.make_node("Identity", ["hn"], ["yt"]))
    second.output[:] = ["hT2", "ys2"]
    g.node.append(second)
    g.output.append(helper.make_tensor_value_info("ys2", TensorProto.FLOAT, ["T", "B", H]))
    onnx.checker.check_model(model, full_check=True)
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 2, report.to_text()
    assert all(f.validation.startswith("ok (max abs error") for f in report.fused), report.to_text()
    _same_outputs(model, fused)


@pytest.mark.parametrize("front", ["loop", "scan"])
def test_a_heads_identity_is_read_through_not_copied(front):
    """The head's last op is ``Identity(e) -> y_t`` (as exporters name a scan output): applied to every step it
    is read through, not copied, so no no-op is left for another round of passes to remove (two rounds: the
    one that fuses, and the one that finds nothing more)."""
    model = build_big_head(front)
    body = next(a.g for a in model.graph.node[-1].attribute if a.name == "body")
    assert body.node[-1 if front == "scan" else -2].op_type == "Identity"
    fused, report = rnnfuse.optimize(model)
    assert len(report.fused) == 1 and not report.declined, report.to_text()
    assert "Identity" not in op_counts(fused), op_counts(fused)
    assert report.rounds == 2, report.rounds
    _same_outputs(model, fused)
