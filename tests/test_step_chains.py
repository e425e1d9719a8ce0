"""Native ops run once per step (or stretch), each starting from the last state of the one before, become one op.

The real-exporter cases (a torch nn.LSTM/GRU/RNN called per step by trace and dynamo, one and two layers) are in
tests/exporters/torch_cases.py; these hand-built graphs cover what the pass must decline or leave alone: an
autoregressive feedback, a state followed two ways, different weights, a cell state read between the ops, a
``sequence_lens``, and a reverse op. Every fused result is compared with the original in onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rnnfuse
from helpers import op_counts, session, skewed_sessions

F, H, B = 3, 4, 2
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _weights(op, rng, tag, features=F):
    g = GATES[op]
    return [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), f"{tag}{k}")
            for k, s in zip("WRB", [(1, g * H, features), (1, g * H, H), (1, 2 * g * H)])]


def chain_model(op="LSTM", steps=(2, 2, 1), *, feedback=False, fork=False, other_weights=False, read_c=False,
                seq_lens=False, direction="forward", read_every_h=True):
    """x [T, B, F] cut into stretches of ``steps``; one native op per stretch, each starting from the last
    state of the one before (the first from h0 [, c0])."""
    rng = np.random.default_rng(0)
    features = H if feedback else F  # feeding y back needs input size == hidden size
    inits = _weights(op, rng, "w", features)
    other = _weights(op, rng, "v", features)
    if other_weights:
        inits += other
    T = sum(steps)
    nodes, outputs = [], []
    lstm = op == "LSTM"
    h, c = "h0", "c0" if lstm else None
    start = 0
    ys = []
    inits.append(numpy_helper.from_array(np.zeros(1, np.int64), "axis0"))
    for k, n in enumerate(steps):
        inits += [numpy_helper.from_array(np.array([start], np.int64), f"s{k}"),
                  numpy_helper.from_array(np.array([start + n], np.int64), f"e{k}")]
        x_k = f"x{k}"
        if feedback and k > 0:  # the next stretch reads the previous output (input size F == hidden size H)
            x_k = ys[-1]
        else:
            nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "axis0"], [x_k]))
        w = "v" if other_weights and k == len(steps) - 1 else "w"
        ins = [x_k, f"{w}W", f"{w}R", f"{w}B", "lens" if seq_lens and k == 0 else "", h] + ([c] if lstm else [])
        outs = [f"y{k}", f"h{k + 1}"] + ([f"c{k + 1}"] if lstm else [])
        nodes.append(helper.make_node(op, ins, outs, hidden_size=H, direction=direction))
        sq = f"ys{k}"
        nodes.append(helper.make_node("Squeeze", [f"y{k}", "one"], [sq]))
        ys.append(sq)
        h, c = outs[1], (outs[2] if lstm else None)
        if fork and k == 0:  # a second op starting from the same state
            nodes.append(helper.make_node(op, ["x1b", "wW", "wR", "wB", "", h] + ([c] if lstm else []),
                                          ["fy", "fh"] + (["fc"] if lstm else []), hidden_size=H,
                                          direction=direction))
            nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "axis0"], ["x1b"]))
            outputs.append("fh")
        if read_every_h and k < len(steps) - 1:
            outputs.append(h)
        if read_c and lstm and k == 0:
            outputs.append(c)
        start += n
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    nodes.append(helper.make_node("Concat", ys, ["y"], axis=0))
    outputs = ["y", h] + outputs
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F]),
                    helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, "B", H])]
    if lstm:
        graph_inputs.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, [1, "B", H]))
    if seq_lens:  # fed with the first stretch's length (_feeds)
        graph_inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["B"]))
    if feedback:
        graph_inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", H])
    graph = helper.make_graph(nodes, "steps", graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in dict.fromkeys(outputs)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def _feeds(model, batch=B, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else batch for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT32:  # sequence_lens of a one-step first stretch
            feeds[i.name] = np.ones(dims, np.int32)
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _same_outputs(a, b):
    for batch in (1, 3):
        feeds = _feeds(a, batch)
        for x, y in zip(session(a).run(None, feeds), session(b).run(None, feeds)):
            np.testing.assert_allclose(y, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("steps", [(1, 1, 1, 1), (2, 3, 1)])
def test_chain_of_stretches_becomes_one_op(op, steps):
    model = chain_model(op, steps)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)[op] == 1, report.to_text()
    assert "merged" in report.to_text()
    _same_outputs(model, fused)


@pytest.mark.parametrize("steps", [(1, 1, 1, 1, 1), (2, 3, 1)])
def test_each_ops_rows_are_parts_of_one_split(steps):
    """What replaces each op's Y is its part of one Split of the merged Y, not a Slice and two constants of its
    own (a 3,333-op chain left 10,000 nodes for every clean-up to walk and merge-slices to merge again); the
    part is the op's rows, and the last of them its Y_h."""
    from rnnfuse.passes.step_chains import MergeStepChains

    model = chain_model("LSTM", steps)
    fused, report = rnnfuse.optimize(model, passes=[MergeStepChains()])
    lstm = next(n for n in fused.graph.node if n.op_type == "LSTM")
    readers = [n for n in fused.graph.node if lstm.output[0] in n.input]
    assert [n.op_type for n in readers] == ["Split"], report.to_text()
    assert len(readers[0].output) == len(steps)
    _same_outputs(model, fused)


def test_the_passes_after_the_merge_see_its_input_as_one_slice():
    """The default pipeline puts the merged op's input back into one slice right after step-chains: the passes
    between (step-maps validating a per-call head over Y) otherwise computed the Concat of T slices of x as
    the check's upstream (1.3 s of a 6,000-step torch export's 6.2 s)."""
    from rnnfuse.passes import default_passes

    passes = default_passes()
    at = [p.name for p in passes].index("step-chains")
    model = chain_model("LSTM", (1, 1, 2, 1))
    fused, report = rnnfuse.optimize(model, passes=passes[:at + 2])
    lstm = next(n for n in fused.graph.node if n.op_type == "LSTM")
    source = next(n for n in fused.graph.node if lstm.input[0] in n.output)
    assert source.op_type == "Slice" and source.input[0] == "x", report.to_text()
    assert "Concat" not in op_counts(fused), report.to_text()
    _same_outputs(model, fused)


@pytest.mark.parametrize("case, why", [
    (dict(feedback=True), "computed from op"),
    (dict(read_c=True), "cell state after step 1 is read outside"),
])
def test_declined_with_a_reason(case, why):
    model = chain_model("LSTM", (1, 1, 1), **case)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)["LSTM"] == 3, report.to_text()
    assert why in report.to_text()
    _same_outputs(model, fused)


@pytest.mark.parametrize("case", [
    dict(fork=True),  # the first op's state is followed by two ops: the chain starts after the fork
    dict(other_weights=True),  # the last op has weights of its own: only the first two merge
    dict(seq_lens=True),  # the first op has sequence_lens: only the rest merge
])
def test_only_the_true_chain_merges(case):
    model = chain_model("GRU", (1, 1, 1), **case)
    fused, report = rnnfuse.optimize(model)
    n = op_counts(model)["GRU"]
    assert op_counts(fused)["GRU"] == n - 1, report.to_text()  # exactly one pair merged, the odd op kept
    _same_outputs(model, fused)


def test_reverse_ops_are_left_alone():
    model = chain_model("GRU", (1, 1), direction="reverse")
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)["GRU"] == 2, report.to_text()
    _same_outputs(model, fused)


@pytest.mark.parametrize("skew_light", [False, True])
def test_a_big_check_model_runs_light_first_and_as_deployed_on_a_failure(skew_light, monkeypatch):
    """A check model of many nodes runs first without onnxruntime's graph optimizations (5,400 one-step
    LSTMs, torch's nn.LSTM called per step: minutes to load optimised, seconds light); a failure seen light is
    checked again as deployed, where it passes (made here: light sessions' merged outputs skewed)."""
    from rnnfuse import validate

    monkeypatch.setattr(validate, "LIGHT_CHECK_NODES", 0)  # (every check model is "big")
    opened = skewed_sessions(monkeypatch, validate, lambda light: light and skew_light,
                             lambda name: name.startswith("rnnfuse/"))
    model = chain_model("LSTM", (1, 1, 1, 1))
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)["LSTM"] == 1, report.to_text()
    assert opened[0] is True and (False in opened) == skew_light, opened
    _same_outputs(model, fused)


def per_step_layers(T=6, layers=2, op="LSTM"):
    """torch's ``nn.LSTM(num_layers=2)`` called once per step, as its trace writes it: x [T, B, F] sliced a step
    at a time, the state of both layers one [2, B, H] tensor (a Concat of each layer's Y_h per step, sliced
    per layer by the next), the upper layer reading the lower's Y squeezed, the output the upper layer's
    squeezed Ys concatenated. No types declared but the inputs' (a model too big to infer reads it so)."""
    rng = np.random.default_rng(3)
    lstm = op == "LSTM"
    inits = [numpy_helper.from_array(np.array([v], np.int64), f"i{v}") for v in range(max(T, layers) + 1)]
    for layer in range(layers):
        inits += _weights(op, rng, f"l{layer}_", F if layer == 0 else H)
    nodes, ys = [], []
    states = {"h": "h0"} | ({"c": "c0"} if lstm else {})
    for t in range(T):
        nodes.append(helper.make_node("Slice", ["x", f"i{t}", f"i{t + 1}", "i0"], [f"x{t}"]))
        inp, finals = f"x{t}", {s: [] for s in states}
        for layer in range(layers):
            inits_t = []
            for s, v in states.items():
                nodes.append(helper.make_node("Slice", [v, f"i{layer}", f"i{layer + 1}", "i0"], [f"{s}{t}_{layer}"]))
                inits_t.append(f"{s}{t}_{layer}")
            outs = [f"y{t}_{layer}"] + [f"{s}n{t}_{layer}" for s in states]
            w = f"l{layer}_"
            nodes.append(helper.make_node(op, [inp, f"{w}W", f"{w}R", f"{w}B", ""] + inits_t, outs, hidden_size=H))
            for s, o in zip(states, outs[1:]):
                finals[s].append(o)
            nodes.append(helper.make_node("Squeeze", [outs[0], "i1"], [f"ys{t}_{layer}"]))
            inp = f"ys{t}_{layer}"
        ys.append(inp)
        for s in states:
            nodes.append(helper.make_node("Concat", finals[s], [f"{s}cat{t}"], axis=0))
            states[s] = f"{s}cat{t}"
    nodes.append(helper.make_node("Concat", ys, ["y"], axis=0))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, "B", F])] + [
        helper.make_tensor_value_info(f"{s}0", TensorProto.FLOAT, [layers, "B", H]) for s in ("h", "c")[:1 + lstm]]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ["y"] + list(states.values())]
    graph = helper.make_graph(nodes, "per_step", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_layers_link_by_what_the_ops_fix_without_types(op, monkeypatch):
    """In a model too big to infer, where no type query answers (the budget spent), each step's per-layer
    Slice of the [layers, B, H] state is still known to take one layer's Y_h whole: the spec fixes a native
    op's output dims. Every step links, and one op per layer is left (5% of a 2,700-step chain was linked only
    in a second round, after the first round's types ran out)."""
    import rnnfuse.model
    from rnnfuse.cone_types import ConeTypes

    monkeypatch.setattr(rnnfuse.model, "CHEAP_INFERENCE_NODES", 0)
    monkeypatch.setattr(ConeTypes, "type_of", lambda self, name, one_piece=False: None)
    model = per_step_layers(op=op)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)[op] == 2, report.to_text()
    assert "merged 6" in report.to_text()
    monkeypatch.undo()
    _same_outputs(model, fused)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_the_state_links_are_read_off_the_ops_that_make_the_states(op, monkeypatch):
    """Whether a Slice of the [layers, B, H] state takes one layer's Y_h whole is read off the native ops'
    attributes and the state's Concat, with no dims walk: each per-step state's walked back through its call's
    input to x's batch (20,000 states in the generated 100k-node ``stepcalls``, half of the pass' time)."""
    import rnnfuse.passes.step_chains as step_chains

    asked = []
    for name in ("settled_dim", "settled_rank"):
        real = getattr(step_chains, name)
        monkeypatch.setattr(step_chains, name, lambda g, t, *a, _real=real: asked.append(t) or _real(g, t, *a))
    model = per_step_layers(op=op)
    natives = [n for n in model.graph.node if n.op_type == op]
    states = {o for n in natives for o in n.output[1:]}
    states |= {n.output[0] for n in model.graph.node if n.op_type == "Concat" and set(n.input) <= states}
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)[op] == 2, report.to_text()
    assert asked and not states & set(asked), sorted(states & set(asked))[:4]


def test_a_big_model_checks_the_first_ops_of_a_merge(monkeypatch):
    """Beyond the whole-model limit a merge is validated on its first ``PREFIX_OPS`` ops of each chain, merged
    the same way beside it (never connected): the rest is the same op, from the state the one before ended in,
    as the links prove. The check model holds those ops alone."""
    from rnnfuse.passes import step_chains
    from rnnfuse import rewrite, validate

    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 0)
    checked = []
    real = validate.validate
    monkeypatch.setattr(rewrite, "validate", lambda g, pairs, *a, **k: checked.append([p[0] for p in pairs]) or
                        real(g, pairs, *a, **k))
    model = per_step_layers(T=9)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)["LSTM"] == 2, report.to_text()
    assert f"the first {step_chains.PREFIX_OPS} ops of each chain merged" in report.to_text()
    (pairs,) = checked
    steps = {int(name.split("_")[0].lstrip("yhcn")) for name in pairs}  # (y3_0: step 3, layer 0)
    assert steps == set(range(step_chains.PREFIX_OPS)), pairs
    assert len(fused.graph.node) < 20  # (no check op left behind; the pieces merged)
    _same_outputs(model, fused)


def test_a_wrong_merge_fails_its_prefix_check(monkeypatch):
    """The prefix check decides: a merge whose rows are cut wrongly (each op said to run 2 steps, not 1) is
    declined in a big model, the ops left as they were."""
    from rnnfuse.passes import step_chains
    from rnnfuse import rewrite

    monkeypatch.setattr(rewrite, "WHOLE_MODEL_LIMIT", 0)
    monkeypatch.setattr(step_chains, "_steps", lambda flow, b, n: 2)
    model = per_step_layers(T=9)
    fused, report = rnnfuse.optimize(model)
    assert op_counts(fused)["LSTM"] == 18, report.to_text()
    assert "the merged op differs" in report.to_text()
    _same_outputs(model, fused)
