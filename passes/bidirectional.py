"""Merge a forward and a reverse native op over the same input into one ``direction="bidirectional"`` op.

Works on native LSTM/GRU/RNN ops whatever produced them (rnnfuse's other passes, or the exporter): both
must read the same ``X`` and the same ``sequence_lens`` (or none), have constant weights and the same
attributes except ``direction``. The merged op's ``Y`` is sliced back into the two halves, so every reader of
the old outputs sees the same values; cleanup then folds slices into what reads them.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper

from rnnfuse import portability
from rnnfuse.cells import native_kind
from rnnfuse.cells.kinds import KINDS
from rnnfuse.builder import SPILL_BYTES, Builder
from rnnfuse.empty_runs import full_lengths
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.findings import Finding, Options, PassResult
from rnnfuse.rewrite import Rewrite, apply_rewrites

NATIVE_OPS = tuple(KINDS)  # LSTM, GRU, RNN

_SKIP = {"direction", "activations", "activation_alpha", "activation_beta"}


def _attrs_key(n: NodeProto) -> tuple:
    items = []
    for a in sorted(n.attribute, key=lambda a: a.name):
        if a.name in _SKIP:
            continue
        items.append((a.name, a.SerializeToString()))
    acts = native_kind(n).drop_default_activations({k: attr(n, k) for k in ("activations", "activation_alpha", "activation_beta")})
    return (n.op_type, n.domain, tuple(items)) + tuple(tuple(acts.get(k) or ()) for k in ("activations", "activation_alpha", "activation_beta"))


def _inp(n: NodeProto, i: int) -> str:
    return n.input[i] if len(n.input) > i else ""


# the ops' downstream is walked up to this many nodes; past it, the ancestry walks go all the way up
DOWNSTREAM_WALK = 20_000


class _OpAncestry:
    """Which of the pass's native ops each node is computed from, through any path: one walk back over the
    graph, memoized per node and shared by every pair the pass checks (a pass with many pairs reads each node
    once; a walk per pair read the whole upstream of a deep model once a pair)."""

    def __init__(self, g: Graph, ops: list[NodeProto]):
        self.g = g
        self.ops = {id(n): n for n in ops}
        self.memo: dict[int, frozenset] = {}
        # (a node computed from no op has no op among its ancestors: the walks below do not go up there; a
        # model whose ops sit behind a 100,000-node prologue walks the few nodes after them)
        after = g.downstream([o for n in ops for o in n.output if o], DOWNSTREAM_WALK - len(ops))
        self.downstream = None if after is None else {id(n) for n in ops} | {id(n) for n in after}

    def _producers(self, n: NodeProto) -> list[NodeProto]:
        g, downstream = self.g, self.downstream
        producers = (g.producer.get(i) for i in g.reads(n) if i)
        if downstream is None:
            return [p for p in producers if p is not None]
        # (a producer computed from no op has no op among its ancestors: the walk does not go up there)
        return [p for p in producers if p is not None and id(p) in downstream]

    def of(self, node: NodeProto) -> frozenset:
        """The ids of the ops among ``node``'s ancestors (itself not counted)."""
        memo, ops = self.memo, self.ops
        stack = [(node, False)]
        while stack:  # (iterative: an unrolled prologue is 100,000 nodes deep)
            n, expanded = stack.pop()
            if id(n) in memo:
                continue
            producers = self._producers(n)
            if not expanded:
                stack.append((n, True))
                stack.extend((p, False) for p in producers if id(p) not in memo)
                continue
            parts = [memo[id(p)] for p in producers]
            own = frozenset(id(p) for p in producers if id(p) in ops)
            if own or len({id(x) for x in parts}) > 1:
                memo[id(n)] = own.union(*parts)
            else:  # (most nodes: one set, shared, not a copy a node)
                memo[id(n)] = parts[0] if parts else frozenset()
        return memo[id(node)]


def _merge_closes_a_cycle(ancestry: _OpAncestry, fw: NodeProto, bw: NodeProto, partner: dict[int, NodeProto]) -> bool:
    """Whether the op merging ``fw`` and ``bw`` would read its own output: one of the two computed, through
    any path, from the other, the pairs merged before (``partner``: node id -> the node it merges with)
    counted as one node each. Two pairs that each look independent can close a cycle between them: a torch
    loop stepping a forward and a backward cell over x, fused as two chains a direction, paired the first
    forward half with the backward half that starts from the other backward half's state, and the other way
    round."""
    start = {id(fw), id(bw)}
    frontier = set(ancestry.of(fw) | ancestry.of(bw))
    seen: set[int] = set()
    while frontier:
        k = frontier.pop()
        if k in start:
            return True
        if k in seen:
            continue
        seen.add(k)
        merged_with = partner.get(k)  # (one op once merged: it reads what its partner reads)
        if merged_with is not None and id(merged_with) not in seen:
            frontier |= ancestry.of(merged_with)
    return False


def merge_pair(g: Graph, fw: NodeProto, bw: NodeProto) -> tuple[NodeProto, dict[str, str]]:
    """Add the bidirectional op for the pair; returns it and the replacement of each used output of the two
    (a Slice of the merged output)."""
    kind = native_kind(fw)
    op = kind.op
    H = attr(fw, "hidden_size")
    if H is None:
        raise Decline("no hidden_size")
    weights = _constant_weights(g, fw, bw, kind, H)
    b = Builder(g, fw, f"rnnfuse/{op}")
    ins = _merged_inputs(g, b, fw, bw, kind, H, weights)
    attrs = _merged_attrs(fw, kind)
    n_out = max(len(fw.output), len(bw.output))
    outs = g.add_node(op, ins, n_out, name=f"rnnfuse/{op}", anchor=fw, **attrs)
    native = g.producer[outs[0]]
    repl: dict[str, str] = {}
    axes = {0: 1, 1: 0, 2: 0}  # Y is [T, D, B, H]; Y_h, Y_c are [D, B, H]
    for k in range(n_out):
        for d, node in ((0, fw), (1, bw)):
            if k < len(node.output) and node.output[k] and g.n_uses(node.output[k]):
                repl[node.output[k]] = b.op("Slice", outs[k], b.i64(d), b.i64(d + 1), b.i64(axes[k]))
    return native, repl


def _constant_weights(g: Graph, fw: NodeProto, bw: NodeProto, kind, H: int) -> tuple:
    """Both directions' W and R ((fw, bw) each), biases (None when absent) and extra inputs (an LSTM's P:
    input position -> [fw, bw], zeros for a direction without); declined unless all are constant."""
    ws = []
    for k in (1, 2):
        a, b = g.const(_inp(fw, k)), g.const(_inp(bw, k))
        if a is None or b is None:
            raise Decline("weights are not constant")
        ws.append((a, b))
    bf, bb = g.const(_inp(fw, 3)) if _inp(fw, 3) else None, g.const(_inp(bw, 3)) if _inp(bw, 3) else None
    if (_inp(fw, 3) and bf is None) or (_inp(bw, 3) and bb is None):
        raise Decline("biases are not constant")
    extras = {}
    for k, name in enumerate(kind.inputs):
        if name in kind.extra_inputs and (_inp(fw, k) or _inp(bw, k)):
            pair = [g.const(_inp(n, k)) if _inp(n, k) else None for n in (fw, bw)]
            if any(_inp(n, k) and v is None for n, v in zip((fw, bw), pair)):
                raise Decline(f"{kind.extra_inputs[name]} computed at runtime")
            zero = np.zeros((1,) + kind.extra_input_shape(name, H), ws[0][0].dtype)
            extras[k] = [v if v is not None else zero for v in pair]
    return ws, bf, bb, extras


def _merged_inputs(g: Graph, b: Builder, fw: NodeProto, bw: NodeProto, kind, H: int, weights: tuple) -> list[str]:
    """The merged op's inputs: each weight concatenated along the direction axis, X and sequence_lens shared,
    initial states concatenated (zeros for a direction without one)."""
    ws, bf, bb, extras = weights
    op = kind.op

    def both(pair, hint):
        a, c = pair
        if a.nbytes + c.nbytes >= SPILL_BYTES and g.model.external_dir is not None:
            return g.add_spilled_initializer([a, c], (2,) + a.shape[1:], a.dtype, f"rnnfuse/{op}/{hint}")
        return b.const(np.concatenate([a, c], 0), hint)

    ins = [fw.input[0], both(ws[0], "W"), both(ws[1], "R")]
    if bf is not None or bb is not None:
        nb = 2 * len(kind.gates) * H
        dt = ws[0][0].dtype
        bf = bf if bf is not None else np.zeros((1, nb), dt)
        bb = bb if bb is not None else np.zeros((1, nb), dt)
        ins.append(b.const(np.concatenate([bf, bb], 0), "B"))
    else:
        ins.append("")
    ins.append(_inp(fw, 4))
    for k in (kind.inputs.index(f"initial_{s}") for s in kind.states):
        a, c = _inp(fw, k), _inp(bw, k)
        if not a and not c:
            ins.append("")
            continue
        ref = a or c
        zeros = lambda: b.op("Mul", ref, b.const(np.array(0, dtype=np.float32), "zero_f"))  # noqa: E731
        ins.append(b.op("Concat", a or zeros(), c or zeros(), axis=0))
    for k in range(len(ins), len(kind.inputs)):
        ins.append(b.const(np.concatenate(extras[k], 0), kind.inputs[k]) if k in extras else "")
    while ins and ins[-1] == "":
        ins.pop()
    return ins


def _merged_attrs(fw: NodeProto, kind) -> dict:
    """The forward op's attributes with direction="bidirectional" and the activations given for both
    directions (none when they are the defaults)."""
    attrs = {}
    for a in fw.attribute:
        if a.name in _SKIP:
            continue
        attrs[a.name] = helper.get_attribute_value(a)
    attrs["direction"] = "bidirectional"
    acts = attr(fw, "activations")
    if acts:
        attrs["activations"] = list(acts) * 2
        al, be = attr(fw, "activation_alpha"), attr(fw, "activation_beta")
        if al:
            attrs["activation_alpha"] = list(al) * 2
        if be:
            attrs["activation_beta"] = list(be) * 2
    return kind.drop_default_activations(attrs)


class MergeBidirectional:
    """Pair forward and reverse native ops over the same input and sequence lengths."""

    name = "bidirectional"
    fuses_only_with = frozenset(NATIVE_OPS)  # native ops: what it merges or turns around

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        groups: dict[tuple, dict[str, list[NodeProto]]] = {}
        for n in g.nodes_of(*NATIVE_OPS):
            if native_kind(n) is None:
                continue
            d = attr(n, "direction", "forward")
            if d == "bidirectional" or attr(n, "layout", 0):
                continue
            key = (n.input[0], _inp(n, 4), _attrs_key(n))
            groups.setdefault(key, {"forward": [], "reverse": []})[d].append(n)
        known = model.facts.seq_lens_mask
        rewrites = []
        partner: dict[int, NodeProto] = {}  # the pairs merged so far, each node -> the other
        ancestry = _OpAncestry(g, [n for dirs in groups.values() for d in dirs.values() for n in d])
        for key, dirs in groups.items():
            for fw, bw in zip(dirs["forward"], dirs["reverse"]):
                where = f"{fw.name or fw.output[0]} + {bw.name or bw.output[0]}"
                try:
                    if _merge_closes_a_cycle(ancestry, fw, bw, partner):
                        raise Decline("one direction is computed from the other (directly, or through a pair merged "
                                      "before): one op would read its own output")
                    native, repl = merge_pair(g, fw, bw)
                except Decline as e:
                    res.findings.append(Finding(self.name, f"{fw.op_type} pair", where, "declined", reason=e.reason))
                    continue
                partner[id(fw)], partner[id(bw)] = bw, fw
                f = Finding(self.name, f"{fw.op_type} pair", where, "merged", cell=f"{fw.op_type}(hidden={attr(fw, 'hidden_size')})",
                            direction="bidirectional", hidden=attr(fw, "hidden_size"))
                masks = {known[_inp(fw, 4)]: ("any", 0)} if _inp(fw, 4) in known else {}
                acts = attr(fw, "activations")
                rewrites.append(Rewrite(f, repl, (fw, bw), masks, "the merged op differs",
                                        gate=lambda f, acts=acts: portability.check(f, acts, ctx, replaces_native=True)))
        apply_rewrites(g, ctx, rewrites, res, prune=False)
        return res


class ReverseInputs:
    """A native op reading its input time-reversed becomes the opposite direction on the unreversed input.

    ``LSTM(ReverseSequence(x, T...), direction=forward)`` (tf2onnx's go_backwards layers) is
    ``LSTM(x, direction=reverse)`` with ``Y`` reversed; ``Y_h``/``Y_c`` are unchanged. Only without
    ``sequence_lens`` (a per-row length would reverse within the row, not the whole axis), or with the full
    lengths the emitter gives a GRU whose time length may be 0 (:mod:`rnnfuse.empty_runs`)."""

    name = "reverse-input"
    fuses_only_with = frozenset(NATIVE_OPS)  # native ops: what it merges or turns around

    def run(self, model: Model, ctx: Options) -> PassResult:
        from rnnfuse.time_flips import full_lengths_of, time_flip_source

        g = model.graph
        res = PassResult(self.name)
        rewrites = []
        for n in g.nodes_of(*NATIVE_OPS):
            if native_kind(n) is None:
                continue
            d = attr(n, "direction", "forward")
            if d == "bidirectional" or attr(n, "layout", 0):
                continue
            src, axis = time_flip_source(g, n.input[0], 0), 0
            perm: list = []
            if src is None:
                # Transpose(flip(x) along the axis that becomes time) == flip(Transpose(x)) along time
                t = g.producer.get(n.input[0])
                perm = list(attr(t, "perm") or []) if t is not None and t.op_type == "Transpose" else []
                if not perm:
                    continue
                src, axis = time_flip_source(g, t.input[0], perm[0]), perm[0]
                if src is None:
                    continue
            # lengths that run every row whole only (reversing the axis then reverses each row), known by the op's
            # input or by the unreversed tensor (as long: an exporter sizes them by what it reverses)
            lens = _inp(n, 4)
            if lens and not (full_lengths_of(g, lens, n.input[0]) or full_lengths_of(g, lens, src, axis)):
                continue
            if perm:
                src = g.add_node("Transpose", [src], 1, name="rnnfuse/Transpose", anchor=n, perm=perm)[0]
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            attrs["direction"] = "reverse" if d == "forward" else "forward"
            attrs = native_kind(n).drop_default_activations(attrs)
            b = Builder(g, n, f"rnnfuse/{n.op_type}")
            ins = [src] + list(n.input[1:])
            if lens:  # (the full lengths of src: the reversed input need not be computed for its shape)
                ins[4] = full_lengths(b, src)
            outs = g.add_node(n.op_type, ins, len(n.output), name=f"rnnfuse/{n.op_type}", anchor=n, **attrs)
            repl = {}
            for k, o in enumerate(n.output):
                if o and g.n_uses(o):
                    repl[o] = b.flip0(outs[k]) if k == 0 else b.op("Identity", outs[k])
            f = Finding(self.name, n.op_type, n.name or n.output[0], "fused", cell=f"{n.op_type}(hidden={attr(n, 'hidden_size')})",
                        direction=attrs["direction"], reason="input read backwards -> native direction")
            acts = attr(n, "activations")
            rewrites.append(Rewrite(f, repl, (n,), {}, "the reversed op differs",
                                    gate=lambda f, acts=acts: portability.check(f, acts, ctx, replaces_native=True)))
        apply_rewrites(g, ctx, rewrites, res)
        return res
