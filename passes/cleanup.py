"""Small linear-time cleanups that make fused graphs lean.

* ``DropNoOps``, ``InlineConstantIfs``, ``SkipRoundTrips`` (see each); ``Dedupe`` (common-subexpression
  elimination) is in :mod:`passes.dedupe`, ``CancelFlips`` in :mod:`passes.flips`.

Dead nodes and unused initializers are removed when the pipeline finalizes the graph.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from rnnfuse import op_args
from rnnfuse.builder import Builder
from rnnfuse.dims import root_dim, spans_any_extent, static_dim
from rnnfuse.elem_types import fixed_by_op, op_elem_type, typed_like
from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, attr, has_subgraph
from rnnfuse.index_order import in_order, length_term

class DropNoOps:
    """Casts to the type a value already has, Identities, Gathers of a whole axis in order, Slices of whole
    axes, ScatterNDs writing every row in order (their updates), and items of a list built by
    ``SequenceConstruct`` taken at a constant position, read through (torch exports a chain of float->float
    Casts around every step; they hide shared inputs and time flips from the other passes; jax2onnx gathers a
    scanned tensor by indices 0 .. T-1 computed from a reversed iota).

    torch's dynamo exporter without its optimizer (which takes minutes on a long unrolled loop) writes four
    more: a ``CastLike`` whose target's element type the ops fix becomes the ``Cast`` it is (each step casts
    its constants like a value computed from the state, which put them on the recurrent path); an item of a
    list a ``SplitToSequence`` cut, taken at a constant position, becomes the ``Slice`` (or ``Gather``) it is
    (every step's ``chunk`` of an LSTMCell's gates, ``x.chunk(T)``'s steps); its ``x[:, ...]`` Slices of
    whole axes are read through, and so are the ScatterNDs that write a batch-first ``outs[:, t] = h`` back
    into the whole of ``outs``."""

    name = "drop-no-ops"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        done = 0
        # (reader lists of 64+ nodes are filtered once, at the end: torch's per-call Identity of each weight
        # is 2,700 readers of one initializer, rescanned per Identity removed: 1 s)
        long_lists: set[str] = set()
        _cast_likes_as_casts(g)
        typed: dict[str, int | None] = {}
        for n in g.nodes_of("Cast", "Identity"):
            if not g.alive(n) or len(n.input) != 1 or g.is_graph_output(n.output[0]):
                continue
            if n.op_type == "Cast" and _certain_type(g, n.input[0], typed) != attr(n, "to"):
                continue
            g.replace_uses(n.output[0], n.input[0])
            g.remove_node(n, long_lists)
            done += 1
        reads_through = {"Gather": (_gathers_all_in_order, 0), "Slice": (_slices_everything, 0),
                         "ScatterND": (_writes_every_row, 2)}  # (op: when it is a no-op, and which input it is then)
        for n in g.nodes_of(*reads_through):
            if not g.alive(n) or n.domain not in ("", "ai.onnx"):
                continue
            no_op, same_as = reads_through[n.op_type]
            if not no_op(g, n):
                continue
            if g.is_graph_output(n.output[0]):
                g.rewrite_in_place(n, "Identity", [n.input[same_as]])  # (the output keeps its name)
            else:
                g.replace_uses(n.output[0], n.input[same_as])
                g.remove_node(n, long_lists)
            done += 1
        pieces, b = [], Builder(g, None, "rnnfuse")  # (b: the position constants, one per value)
        for n in g.nodes_of("SequenceAt"):
            if not g.alive(n):
                continue
            item = _constructed_item(g, n)
            if item is None:  # (else a list of states rebuilt after a Loop, say: passes.loop_lists)
                piece = _split_piece(g, n, b)
                if piece is not None:
                    pieces.append((n, *piece))
                continue
            if g.is_graph_output(n.output[0]):
                g.rewrite_in_place(n, "Identity", [item])  # (the output keeps its name)
            else:
                g.replace_uses(n.output[0], item)
                g.remove_node(n, long_lists)
            done += 1
        g.drop_removed_readers(long_lists)
        # (in one call: each step's SequenceAt reads the same few position constants, whose reader lists
        # a rewrite at a time filtered once per step)
        g.rewrite_many_in_place(pieces)
        if done:
            res.modified = True
            res.notes.append(f"read through {done} no-op Cast/Identity/Gather/Slice/ScatterND/SequenceAt node(s)")
        if pieces:
            res.modified = True
            res.notes.append(f"took {len(pieces)} SplitToSequence item(s) at a constant position as Slice/Gather")
        return res


def _cast_likes_as_casts(g: Graph) -> None:
    """Rewrite each ``CastLike`` whose target has an element type the ops fix (rnnfuse.elem_types) as a ``Cast``
    to that type, its attributes kept (the two ops share them); in one call, as the split items."""
    rewrites = []
    for n in g.nodes_of("CastLike"):
        if g.alive(n) and n.domain in ("", "ai.onnx") and len(n.input) == 2 and n.input[0]:
            to = op_elem_type(g, n.input[1])
            if to:
                attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                rewrites.append((n, "Cast", [n.input[0]], {**attrs, "to": to}))
    g.rewrite_many_in_place(rewrites)


def _position(g: Graph, n: NodeProto) -> int | None:
    """The constant position ``SequenceAt`` node ``n`` takes its item at, or None."""
    c = g.const(n.input[1]) if len(n.input) == 2 else None
    if c is None or np.size(c) != 1 or np.asarray(c).dtype.kind not in "iu":
        return None
    return int(np.ravel(c)[0])


def _constructed_item(g: Graph, n: NodeProto) -> str | None:
    """The tensor ``SequenceAt`` node ``n`` takes, when its sequence is a ``SequenceConstruct`` and its
    position a constant; else None."""
    p = g.producer.get(n.input[0])
    k = _position(g, n) if p is not None and p.op_type == "SequenceConstruct" else None
    if k is None:
        return None
    k = k + len(p.input) if k < 0 else k
    return p.input[k] if 0 <= k < len(p.input) and p.input[k] else None


def _split_piece(g: Graph, n: NodeProto, b: Builder) -> tuple | None:
    """``(op_type, inputs, attrs)`` computing what ``SequenceAt`` node ``n`` takes, when its list is cut by a
    ``SplitToSequence`` and its position is a constant: a ``Slice`` of the cut tensor (a ``Gather`` for a chunk
    of one squeezed by ``keepdims=0``); else None. ``b`` makes the positions' constants (one per value).

    A scalar ``split`` with ``keepdims=0`` is left alone: the standard ignores keepdims when ``split`` is given,
    onnxruntime 1.32 squeezes the chunks (and fails when they are longer than one), so no rewrite matches both."""
    p = g.producer.get(n.input[0])
    k = _position(g, n) if p is not None and p.op_type == "SplitToSequence" and p.domain in ("", "ai.onnx") else None
    if k is None:
        return None
    data, axis = p.input[0], attr(p, "axis", 0)
    split = g.const(p.input[1]) if len(p.input) > 1 and p.input[1] else None
    if len(p.input) > 1 and p.input[1] and (split is None or np.asarray(split).dtype.kind not in "iu"):
        return None
    extent = static_dim(g, data, axis)
    if split is None:  # (chunks of one)
        if extent is not None and not -extent <= k < extent:
            return None  # (the list has no such item: the original fails there)
        if attr(p, "keepdims", 1) == 0:
            return "Gather", [data, _int64(b, k)], {"axis": axis}
        start, end = k, (k + 1 if k != -1 else INT64_MAX)
    elif np.ndim(split) == 0:
        size = int(split)
        # (a position from the end counts the chunks, which takes the axis' length: a declared one may be stale)
        if attr(p, "keepdims", 1) == 0 or size < 1 or k < 0:
            return None
        if extent is not None and k * size >= extent:
            return None  # (the list has no such item: the original fails there)
        start, end = k * size, (k + 1) * size
    else:
        sizes = [int(v) for v in np.ravel(split)]
        k = k + len(sizes) if k < 0 else k
        if not 0 <= k < len(sizes) or min(sizes) < 0 or (extent is not None and sum(sizes) != extent):
            return None  # (no such item, or sizes the original refuses)
        start = sum(sizes[:k])
        end = start + sizes[k]
    return "Slice", [data, _int64(b, [start]), _int64(b, [end]), _int64(b, [axis])], {}


INT64_MAX = np.iinfo(np.int64).max


def _int64(b: Builder, value) -> str:
    """An int64 constant holding ``value`` (a scalar or a list): the one ``b`` made before for that value."""
    return b.const(np.array(value, np.int64), "position")


def _slices_everything(g: Graph, n: NodeProto) -> bool:
    """Whether Slice ``n`` takes every element of each axis it names, whatever their lengths: from 0 to an end
    past any extent (2**31 - 1 or more), step 1 (torch's ``x[:, ...]`` exported by dynamo without its
    optimizer)."""
    from rnnfuse.op_args import slice_args_of

    starts, ends, axes, steps = slice_args_of(g, n)
    if not starts or ends is None or steps is None or len(starts) != len(ends):
        return False
    return all(spans_any_extent(b, e) for b, e in zip(starts, ends)) and all(k == 1 for k in steps)


def _gathers_all_in_order(g: Graph, n) -> bool:
    """Whether Gather ``n`` takes every element of its data's axis, in order: indices 0 .. n-1 in a vector,
    n the axis' length (read from how both are computed, see rnnfuse.index_order)."""
    return len(n.input) == 2 and _runs_over_axis(g, n.input[1], n.input[0], attr(n, "axis", 0))


def _writes_every_row(g: Graph, n: NodeProto) -> bool:
    """Whether ScatterND ``n`` writes each row of its data once, in order, so that its result is its updates:
    indices ``Unsqueeze(0 .. n-1, -1)``, n the data's first extent (the op then holds the updates to the data's
    shape). dynamo's ``outs[:, t] = h`` writes the whole of ``outs`` so around the column it sets."""
    if len(n.input) != 3 or attr(n, "reduction", "none") not in ("none", b"none"):
        return False
    p = g.producer.get(n.input[1])
    if p is None or p.op_type != "Unsqueeze" or p.domain not in ("", "ai.onnx"):
        return False
    axes = op_args.axes(p, g.model.opset, lambda i: g.const(p.input[i]))
    return axes in ([1], [-1]) and _runs_over_axis(g, p.input[0], n.input[0], 0)


def _runs_over_axis(g: Graph, idx: str, data: str, axis: int) -> bool:
    """Whether vector ``idx`` holds 0 .. n-1, n the length of ``data``'s ``axis``."""
    c = g.const(idx)
    if c is not None and (np.ndim(c) != 1 or np.size(c) < 2):  # (a constant's rank is its own: no inference)
        return False
    size = in_order(g, idx)
    if size is None or (c is None and g.model.rank(idx) != 1):
        return False
    rank = g.model.rank(data)
    if rank is None or not -rank <= axis < rank:
        return False
    axis %= rank
    if size == length_term(g, data, axis):
        return True
    # a number: the extent a graph input declares (onnxruntime holds a run to it) or a weight has, at the root of
    # the data's axis (not an intermediate value's declaration, which an earlier tool may have left stale)
    root, root_axis = root_dim(g, data, axis)
    if size[0] != "c" or not (g.is_graph_input(root) or g.const(root) is not None):
        return False
    shape = g.model.shape(root) if g.is_graph_input(root) else list(np.shape(g.const(root)))
    return shape is not None and 0 <= root_axis < len(shape) and shape[root_axis] == size[1]


# element types of data, not of shape arithmetic or masks: what a Cast is dropped from when the ops give its
# input the type (an int64 ``size // heads`` or a bool ``Equal`` cast to its own type is left: the do-no-harm
# guard counts every reader of a renamed shape value as changed, see rnnfuse.same_values)
_DATA_TYPES = frozenset((TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16))


def _certain_type(g: Graph, name: str, memo: dict[str, int | None]) -> int | None:
    """The element type of ``name`` where it is certain: a graph input's, an initializer's or a Cast's output's;
    or a floating type the ops give it, reached through ops whose output has an input's type (arithmetic,
    views, activations: :mod:`rnnfuse.elem_types`) from one of those or an op that fixes it. Never a
    value_info's: one an earlier tool wrote may be stale, and dropping a real Cast would change results.
    dynamo's ``outs[t] = h`` casts each step's h like the buffer (float to float) with a Cast of a Mul.
    ``memo``: what the walks found (each ends at the first name known, so a chain of steps costs its length
    once)."""
    walked, cur = [], name
    while cur not in memo:
        p = g.producer.get(cur)
        if p is None:
            w = g.initializers.get(cur)
            memo[cur] = (w.data_type or None) if w is not None else \
                g.model.elem_type(cur) if g.is_graph_input(cur) else None
            break
        onnx_op = p.domain in ("", "ai.onnx")
        src = typed_like(p) if onnx_op else None
        if not src:
            t = fixed_by_op(p) if onnx_op else None
            memo[cur] = t if p.op_type == "Cast" or t in _DATA_TYPES else None
            break
        walked.append(cur)
        cur = src
    t = memo[cur]
    t_walked = t if t in _DATA_TYPES else None
    for w in walked:
        memo[w] = t_walked
    return t_walked if walked else t


class InlineConstantIfs:
    """An ``If`` whose condition is a constant is its chosen branch, spliced into the graph.

    Exporters write shape bookkeeping as ``If(rank(x) > 2)`` (Keras 3 on torch, per step); with the
    rank known the branch is fixed, and the plain nodes it holds are what the fusion passes can read."""

    name = "inline-ifs"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        done = 0
        # (the reader lists of what many branches capture, a weight every If reads, are filtered once at the
        # end, not at each removal: 2,273 Ifs inlined took 0.45 / 0.87 / 2.15 s at 25k / 50k / 100k nodes)
        long_readers: set[str] = set()
        for n in g.nodes_of("If"):
            if not g.alive(n) or n.domain not in ("", "ai.onnx"):
                continue
            cond = g.const(n.input[0])
            if cond is None or np.asarray(cond).size != 1:
                continue
            branch = attr(n, "then_branch" if bool(np.asarray(cond).ravel()[0]) else "else_branch")
            if branch is not None and _inline_branch(g, n, branch, long_readers):
                done += 1
        g.drop_removed_readers(long_readers)
        if done:
            g.prune()
            res.modified = True
            res.notes.append(f"inlined {done} If node(s) with a constant condition")
        return res


def _inline_branch(g: Graph, node: NodeProto, branch, long_readers: set[str]) -> bool:
    """Splice ``branch`` in place of the If ``node`` (the long reader lists it is removed from are named in
    ``long_readers``, see Graph.remove_node); False when it cannot be."""
    if any(has_subgraph(b) for b in branch.node) or len(branch.output) != len(node.output) or branch.input:
        return False
    local: dict[str, str] = {}
    for t in branch.initializer:
        local[t.name] = g.add_initializer(numpy_helper.to_array(t), f"{node.name or 'If'}/{t.name}")
    for b in branch.node:
        for o in b.output:
            if o:
                local[o] = g.fresh(f"{node.name or 'If'}/{o}")
    model = g.model
    for old, new in local.items():  # the inlined values keep the types the branch declared or inferred
        model.declare(new, model.known_type(old))
    for b in branch.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in b.attribute}
        g.add_node(b.op_type, [local.get(i, i) for i in b.input], len(b.output), name=b.name or b.op_type,
                   outputs=[local.get(o, o) for o in b.output], domain=b.domain, anchor=node, **attrs)
    for o, bo in zip(node.output, branch.output):
        if o:
            g.replace_uses(o, local.get(bo.name, bo.name))
    g.remove_node(node, long_readers)
    return True


class SkipRoundTrips:
    """Stacked masked layers: do not put a layer's outputs back in time order only to gather them again.

    The exact mask path runs each native op on each row's valid steps moved to the front. A layer's output
    put back in time order and then compacted again, with the same mask, by the next layer is the first
    layer's compacted output at every step the next layer reads (rows past their length are ignored by
    ``sequence_lens``), so the next layer reads that directly -- also through a feature concat (the two
    halves of a Bidirectional layer)."""

    name = "skip-round-trips"
    fuses_only_with = frozenset()  # it shortens what this run's rewrites built: nothing of its own

    def run(self, model: Model, ctx: Options) -> PassResult:
        from rnnfuse.rewrite import Rewrite, apply_rewrites
        from rnnfuse.findings import Finding

        g = model.graph
        res = PassResult(self.name)
        comps = model.facts.compactions
        uncomps = model.facts.uncompactions
        if not comps or not uncomps:
            return res
        rewrites = []
        for xc, (_, m2, mask) in comps.items():
            gather = g.producer.get(xc)
            if gather is None or not g.alive(gather) or not g.uses(xc):
                continue
            flat = g.producer.get(gather.input[0])
            if flat is None or flat.op_type != "Flatten":
                continue
            parts = _compacted_parts(g, flat.input[0], m2, uncomps)
            if parts is None:
                continue
            new = parts[0] if len(parts) == 1 else g.add_node("Concat", parts, 1, name="rnnfuse/Concat", anchor=gather, axis=2)[0]
            rewrites.append(Rewrite(Finding(self.name, "stack", xc, "merged"), {xc: new}, (), {mask: ("any", 0)},
                                    "the shortcut differs"))
        if not rewrites:
            return res
        # the one applier validates, judges and commits; a shortcut is no finding of its own: notes report it
        applied = PassResult(self.name)
        apply_rewrites(g, ctx, rewrites, applied)
        for f in applied.findings:
            if f.status == "declined":
                res.notes.append(f"kept the round trip into '{f.where}': {f.reason}")
        done = sum(f.status != "declined" for f in applied.findings)
        if done:
            res.modified = True
            res.notes.append(f"{done} stacked layer input(s) read without a scatter/gather round trip")
        return res


def _compacted_parts(g: Graph, t: str, m2: str, uncomps: dict, depth: int = 0) -> list[str] | None:
    """The compacted outputs whose time-ordered versions make up ``t`` (through identity transposes and a
    concat along features), if every part was put back with the same mask ``m2``."""
    if depth > 8:
        return None
    if t in uncomps:
        y3, m = uncomps[t]
        return [y3] if m == m2 else None
    p = g.producer.get(t)
    if p is None:
        return None
    if p.op_type == "Identity":
        return _compacted_parts(g, p.input[0], m2, uncomps, depth + 1)
    if p.op_type == "Concat" and attr(p, "axis") in (2, -1):
        parts = []
        for i in p.input:
            sub = _compacted_parts(g, i, m2, uncomps, depth + 1)
            if sub is None:
                return None
            parts.extend(sub)
        return parts
    return None
