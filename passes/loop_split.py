"""Loop fission: a Loop whose body steps two or more recurrences that never read each other, as one Loop each.

Hand-written bidirectional layers step both directions in one loop (TorchScript ``hf = f(x[t], hf);
hb = b(x[T - 1 - t], hb)``), and so does code that runs two encoders over two inputs side by side. The Loop
front end reads one step input, in one order, per Loop: such a body is declined whole ("read in different
orders"), though each of its recurrences alone is a native op. Split, each part is a Loop it can read, and
the bidirectional merge pairs a forward and a backward part afterwards.

The parts compute exactly what the Loop computed, by construction: each is the Loop's own trip count and
condition with the carried values of one group, and a copy of every body node the group's outputs (and the
condition) are computed from, unchanged. Carried values are grouped by the body's dataflow: two values are one
group when either's next value reads the other, or one per-step output reads both. A carried value whose next
value reads nothing carried but itself and multiplies no weight (a pass-through weight, a counter) is no group
of its own: it is copied into every part that reads it, its final value taken from one of them. A body with
an op whose copies could differ (random ops) or a subgraph of its own, a condition computed from a group, or
fewer than two groups: not split.
"""

from __future__ import annotations

from typing import Callable

from onnx import AttributeProto, GraphProto, NodeProto

from rnnfuse.disjoint_sets import DisjointSets
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.protos import has_subgraph
from rnnfuse.rewrite import recurrences_of
from rnnfuse.symbolic import weight_ops
from .loop_lists import unpack_lists
from .loop_pieces import unpack_pieces

_NOT_COPIED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli", "Dropout"}  # (a copy may draw other numbers: Dropout's training_mode may be fed)


def fuse_parts(g: Graph, loop: NodeProto, recurrence_of) -> tuple[list, list, NodeProto, Callable[[], None] | None]:
    """``(recurrences, [(part, its decline reason)], node, settle)``: when ``loop`` splits (see the module), or
    carries a list of states (its items carried one by one instead: :mod:`passes.loop_lists`; then split if it
    splits) or states cut from one tensor (carried piece by piece: :mod:`passes.loop_pieces`), and at least
    one of the Loops it becomes is a recurrence, their recurrences and the others' declines, the new Loops in
    its place, and ``settle``, to call once the recurrences were applied or declined: it puts a split Loop back
    when no part was fused after all (validation may decline them all); a Loop carried item by item stays so.
    Otherwise no recurrence and the Loop in
    the graph, ``node``: ``loop`` itself, or an equal copy of it where its parts were tried and put back (a
    list of states whose unpacked Loop is no recurrence: declined with that Loop's reason)."""
    unpacked = unpack_lists(g, loop)
    if unpacked is not None:  # (then split: a list may hold the states of a forward and a backward cell)
        new, rebuilds = unpacked
        recs, declines, node, settle = _tried_in_place(g, loop, split_loop(g, new) or [new], rebuilds, recurrence_of)
        if not recs and declines:
            raise Decline(f"{declines[0][1]} (its list of states carried item by item)")
        # (once its recurrences are tried, the unpacked Loop stays, fused or not: it computes what the Loop did,
        # and what was applied meanwhile may read its items (a Loop over its final list) or have pruned what
        # the Loop read (the list built before it))
        return recs, declines, node, (lambda: None)
    pieces = unpack_pieces(g, loop)
    if pieces is not None:  # (put back when none of it fuses: the Loop as it was, its own decline reported)
        new, cuts, joins = pieces
        recs, declines, node, settle = _tried_in_place(g, loop, split_loop(g, new) or [new], joins, recurrence_of,
                                                       before=cuts)
        if not recs and declines:
            raise Decline(f"{declines[0][1]} (its concatenated states carried piece by piece)")
        return recs, declines, node, settle
    parts = split_loop(g, loop)
    if parts is None:
        return [], [], loop, None
    return _tried_in_place(g, loop, parts, [], recurrence_of)


def _tried_in_place(g: Graph, loop: NodeProto, parts: list[NodeProto], after: list[NodeProto], recurrence_of,
                    before: list[NodeProto] = ()):
    """:func:`fuse_parts` for the Loops ``parts`` that compute what ``loop`` does (``after``: nodes that read
    them, put after them; ``before``: nodes they read, put before them)."""
    at = g.position(loop)
    g.remove_node(loop)
    placed = [*before, *parts, *after]
    for p in placed:
        g.append_node(p, at)
    recs, declines = [], []
    for p in parts:
        try:
            recs.extend(recurrences_of(g, p, recurrence_of))
        except Decline as d:
            declines.append((p, d.reason))

    def put_back() -> NodeProto | None:
        if any(not g.alive(p) for p in parts):
            return None  # (a part was fused: the others stay Loops of their own)
        for p in placed:
            g.remove_node(p)
        back = NodeProto()
        back.CopyFrom(loop)  # (the removed node stays removed: a copy goes back)
        g.append_node(back, at)
        return back

    if recs:
        return recs, declines, loop, put_back
    return [], declines, put_back(), None


def split_loop(g: Graph, loop: NodeProto) -> list[NodeProto] | None:
    """The parts of ``loop`` (new Loop nodes, not in the graph), or None when it does not split."""
    body = next((a.g for a in loop.attribute if a.name == "body" and a.type == AttributeProto.GRAPH), None)
    n_carried = len(loop.input) - 2
    if body is None or n_carried < 2 or len(body.input) != 2 + n_carried or len(body.output) < 1 + n_carried:
        return None
    if body.sparse_initializer or any(has_subgraph(n) or n.op_type in _NOT_COPIED for n in body.node):
        return None
    b_in = [v.name for v in body.input]
    b_out = [v.name for v in body.output]
    producer = {o: n for n in body.node for o in n.output if o}
    reads = _carried_reads(body, b_in[2:])
    out_reads = [reads.get(o, 0) for o in b_out]
    shared = {k for k in range(n_carried)
              if out_reads[1 + k] & ~(1 << k) == 0 and not _multiplies(producer, b_out[1 + k])}
    groups = _groups(n_carried, out_reads, shared)
    if groups is None or len(set(groups.values())) < 2:
        return None
    n_scan = len(b_out) - 1 - n_carried
    members: dict[int, list[int]] = {}
    for k in range(n_carried):
        if k not in shared:
            members.setdefault(groups[k], []).append(k)
    firsts = sorted(members, key=lambda r: min(members[r]))
    scans: dict[int, list[int]] = {r: [] for r in firsts}
    for j in range(n_scan):
        bits = _bits(out_reads[1 + n_carried + j]) - shared
        scans[groups[min(bits)] if bits else firsts[0]].append(j)
    taken = [_shared_read(members[r], scans[r], shared, out_reads, n_carried) for r in firsts]
    taken[0] |= shared - set().union(*taken)  # (read by no part: its final value is still computed, once)
    owned: set[int] = set()
    return [_part(g, loop, body, i, sorted(set(members[r]) | taken[i]), scans[r], n_carried, shared, owned)
            for i, r in enumerate(firsts)]


def _carried_reads(body: GraphProto, carried: list[str]) -> dict[str, int]:
    """Each body value -> the carried values it is computed from, as a bit mask by carried position."""
    reads = {name: 1 << k for k, name in enumerate(carried)}
    for n in body.node:
        m = 0
        for i in n.input:
            if i:
                m |= reads.get(i, 0)
        for o in n.output:
            reads[o] = m
    return reads


def _multiplies(producer: dict, name: str) -> bool:
    """Whether the body computes ``name`` with a weight product (a state, not a counter or a pass-through)."""
    ops, seen, todo = weight_ops(), set(), [name]
    while todo:
        n = producer.get(todo.pop())
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type in ops:
            return True
        todo.extend(i for i in n.input if i)
    return False


def _bits(mask: int) -> set[int]:
    return {k for k in range(mask.bit_length()) if mask >> k & 1}


def _groups(n_carried: int, out_reads: list[int], shared: set[int]) -> dict[int, int] | None:
    """Each carried value that is no shared one -> its group's root; None when the condition reads a group."""
    tied = DisjointSets(range(n_carried))
    if _bits(out_reads[0]) - shared:
        return None  # (every part would need that group: the step does not split)
    for k, mask in enumerate(out_reads[1:]):
        bits = _bits(mask) - shared
        if k < n_carried and k not in shared:
            bits.add(k)
        for b in sorted(bits)[1:]:
            tied.join(b, min(bits))
    return {k: tied.root(k) for k in range(n_carried) if k not in shared}


def _shared_read(own: list[int], scans: list[int], shared: set[int], out_reads: list[int], n_carried: int) -> set[int]:
    """The shared values a part's outputs or the condition read."""
    mask = out_reads[0]
    for k in own:
        mask |= out_reads[1 + k]
    for j in scans:
        mask |= out_reads[1 + n_carried + j]
    return _bits(mask) & shared


def _part(g: Graph, loop: NodeProto, body: GraphProto, i: int, carried: list[int], scans: list[int],
          n_carried: int, shared: set[int], owned: set[int]) -> NodeProto:
    """Part ``i``: a Loop carrying ``carried`` and emitting the scan outputs ``scans``, its body the nodes they
    (and the condition) are computed from. A shared value's final is the loop's output in the first part to
    carry it (``owned``), a fresh name nothing reads in the others."""
    outs = [body.output[0]] + [body.output[1 + k] for k in carried] + [body.output[1 + n_carried + j] for j in scans]
    needed = _cone(body, [v.name for v in outs])
    suffix = f"/part{i}" if i else ""
    sub = GraphProto(name=body.name + suffix)
    for n in body.node:
        if id(n) in needed:
            copy = sub.node.add()
            copy.CopyFrom(n)
            if copy.name and suffix:
                copy.name += suffix
    sub.input.extend([body.input[0], body.input[1]] + [body.input[2 + k] for k in carried])
    sub.output.extend(outs)
    names = {o for n in sub.node for o in n.output} | {v.name for v in sub.input}
    read = {x for n in sub.node for x in n.input} | {v.name for v in outs}
    sub.initializer.extend(t for t in body.initializer if t.name in read)
    sub.value_info.extend(v for v in body.value_info if v.name in names)

    def final(pos: int, shared_k: int | None) -> str:
        name = loop.output[pos] if pos < len(loop.output) else ""
        if not name or (shared_k is not None and shared_k in owned):
            return g.fresh(f"{loop.name or 'loop'}{suffix or '/part0'}/unused")
        if shared_k is not None:
            owned.add(shared_k)
        return name

    part = NodeProto(op_type="Loop", name=g.fresh(loop.name + suffix) if loop.name and suffix else loop.name,
                     domain=loop.domain)
    part.input.extend([loop.input[0], loop.input[1]] + [loop.input[2 + k] for k in carried])
    part.output.extend([final(k, k if k in shared else None) for k in carried] + [final(n_carried + j, None) for j in scans])
    part.attribute.add(name="body", type=AttributeProto.GRAPH).g.CopyFrom(sub)
    return part


def _cone(body: GraphProto, names: list[str]) -> set[int]:
    """The ids of the body nodes ``names`` are computed from."""
    producer = {o: n for n in body.node for o in n.output if o}
    seen: set[int] = set()
    todo = list(names)
    while todo:
        n = producer.get(todo.pop())
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        todo.extend(x for x in n.input if x)
    return seen
