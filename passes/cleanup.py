"""Small linear-time cleanups that make fused graphs lean.

* ``Dedupe`` -- common-subexpression elimination: nodes with the same op, attributes and inputs compute the
  same values (exporters recompute a layer's mask per layer; rnnfuse shares mask plumbing this way).
* ``DropNoOps``, ``InlineConstantIfs``, ``SkipRoundTrips`` (see each); ``CancelFlips`` is in
  :mod:`passes.flips`.

Dead nodes and unused initializers are removed when the pipeline finalizes the graph.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from onnx import NodeProto, helper, numpy_helper

from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, attr, has_subgraph
from rnnfuse.protos import CONTROL_FLOW, node_field

_IMPURE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}


class Dedupe:
    """Common-subexpression elimination, linear in the graph and then in the edits.

    Two nodes can only be equal if they read the same values (constants aside, which count by content), so
    a node is compared only with the other readers of its rarest non-constant input, and only nodes that
    have such company are looked at: the first run takes the readers of values read more than once (and the
    nodes reading only constants), in graph order -- a plain chain has none. Nodes are keyed by names first
    (op and input names, every constant as one placeholder) and by the full key (small constants by value,
    attributes) only where two share that. A later run looks only at the nodes edits added or rewired since
    (``Graph.edited``): after passes that changed nothing it visits nothing. A merge rewires the merged
    node's readers; they are looked at again in the same run (a duplicate's readers may now be equal).
    A merged node that computed a graph output leaves the name to an Identity of the value kept (the
    model's interface stays): a masked layer may return its last carried output beside its final state,
    two equal values, and the chain is only seen as one layer once they are one."""

    name = "dedupe"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def __init__(self):
        self.visited = 0  # nodes looked at by the last run (tests check the work is linear in the edits)
        self.full_keys = 0  # of which compared by the full key

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        mark = model.facts.dedupe_mark
        incremental = mark is not None and mark[0] is g.edited
        self.visited = self.full_keys = 0
        if incremental and mark[1] == len(g.edited):
            return res  # no edit since the last run
        table = _DedupeTable(g)
        if incremental:
            work, pos = g.edited, mark[1]
        else:
            work, pos = table.candidates(), 0
        base = len(g.edited)
        later = _LaterEdits(g.edited, pos) if work is g.edited else None
        unfiltered: set[str] = set()  # long reader lists holding merged nodes (filtered once, at the end)
        try:
            n_merged = self._merge(g, table, work, pos, base, later, unfiltered)
        finally:
            g.drop_removed_readers(unfiltered)
        model.facts.dedupe_mark = (g.edited, len(g.edited))
        self.full_keys = table.full_keys
        if n_merged:
            res.modified = True
            res.notes.append(f"merged {n_merged} duplicate nodes")
        return res

    def _merge(self, g: Graph, table: "_DedupeTable", work: list, pos: int, base: int, later, unfiltered: set) -> int:
        """Walk ``work`` from ``pos`` (then the edits the merges make) merging each node into an equal one."""
        n_merged = 0
        while True:
            if pos >= len(work):
                if work is g.edited or base >= len(g.edited):
                    break
                work, pos = g.edited, base  # readers a merge rewired (a full run's own edits)
                later = _LaterEdits(g.edited, pos)
            n = work[pos]
            pos += 1
            if later is not None and later.again(n, pos - 1):
                continue  # (edited again further on: looked at there, once, not once per edit)
            if not table.eligible(n):
                continue
            self.visited += 1
            other = table.match(n)
            if other is None:
                continue
            g.remove_node(n, unfiltered)
            for a, b in zip(n.output, other.output):
                if a and b:
                    g.replace_uses(a, b)  # (a graph output keeps its name: an Identity of b, or b renamed)
            table.forget()
            n_merged += 1
        return n_merged


class _LaterEdits:
    """Whether a node of the edit list is edited again further on, by generations of the list: the part
    there was when asked, then what the walk's own merges appended (a Concat reading 50,000 duplicates is
    rewired once per merge: looking at it at each of those edits, its whole input list each time, was
    quadratic; at its last edit it is seen with every merge done)."""

    def __init__(self, edited: list, start: int):
        self.edited = edited
        self.end = start
        self.last: dict[int, int] = {}

    def again(self, n: NodeProto, at: int) -> bool:
        if at >= self.end:  # a new generation: the last position of each node in it
            self.last = {id(m): i for i, m in enumerate(self.edited[at:], at)}
            self.end = len(self.edited)
        return self.last.get(id(n), at) > at


class _DedupeTable:
    """Nodes by key, for one Dedupe run: coarse key (names) -> one node, or full key -> node once two share it."""

    _CONST = ("const",)  # the coarse key's stand-in for any initializer or Constant input

    def __init__(self, g: Graph):
        self.g = g
        self.by_coarse: dict[tuple, object] = {}
        self.seeded: set[str] = set()  # values whose readers are in the table (incremental runs)
        self.const_readers: list | None = None
        self.found: dict[int, NodeProto | None] = {}  # node -> what inserting it found while seeding
        self.full_keys = 0
        self.small: dict[str, object] = {}  # input name -> its full-key form (small constants by content)
        # initializers and Constant outputs: found once (a set lookup per input from then on)
        self.consts = set(g.initializers)
        self.consts.update(o for n in g.nodes_of("Constant") for o in n.output)
        # small values computed from those and static shapes alone, compared by value too: torch's trace of
        # x[x.shape[0] - 1 - t] (a backward cell stepped beside a forward one) reads the slice the forward
        # cell reads as x[t'], through an index of its own
        self.shape_consts = _small_shape_constants(g, self.consts, self.small)
        self.consts |= self.shape_consts

    def candidates(self) -> list[NodeProto]:
        """The nodes that may equal another, in graph order (topological for the input model, which is where
        it matters): nodes whose every non-constant input is read by another node too, one of them with the
        same op (a duplicate reads them all), and the nodes reading only constants."""
        g = self.g
        consumers, consts, uses = g.consumers, self.consts, g.uses
        out: dict[int, NodeProto] = {}
        # the values read more than once (lists of readers, picked out in C: a 100k-node chain has few or none)
        for v, cs in itertools.compress(consumers.items(), map(list.__instancecheck__, consumers.values())):
            if len(cs) < 2:
                continue
            if v not in consts:
                # a duplicate of a reader of v is another reader of v with the same op: readers whose op no
                # other reader of v has (h read by its step's Gemm and by the output stack) have none
                kinds: dict = {}
                for c in cs:
                    k = c.op_type
                    kinds[k] = kinds.get(k, 0) + 1
                if len(kinds) == len(cs):
                    continue
                for c in cs:
                    if kinds[c.op_type] > 1 and id(c) not in out and all(len(uses(i)) > 1 for i in c.input[:] if i and i not in consts):
                        out[id(c)] = c
        for c in self._const_readers():
            out[id(c)] = c
        if not out:
            return []  # (a plain chain: not even the positions are needed)
        return g.in_position_order(out.values())

    def _const_readers(self) -> list[NodeProto]:
        """Nodes with at least one input, all of them constants (a second way to be equal: by value)."""
        if self.const_readers is None:
            self.const_readers = self.g.const_only_readers()  # (found by the index pass, when still exact)
        if self.const_readers is None:
            found: dict[int, NodeProto] = {}
            consts, uses = self.consts, self.g.uses
            for v in consts:
                for c in uses(v):
                    if id(c) in found:
                        continue
                    for i in c.input:  # (a plain loop: most readers fail on their first input)
                        if i and i not in consts:
                            break
                    else:
                        found[id(c)] = c
            self.const_readers = list(found.values())
        return self.const_readers

    def eligible(self, n: NodeProto) -> bool:
        """Whether ``n`` may be compared: kept in the table, and merged into an equal node found there."""
        if not self.g.alive(n):
            return False
        op = n.op_type
        if op in _IMPURE or op == "Constant" or op in CONTROL_FLOW:
            return False  # Constants are compared by value where they are read
        return bool(n.output) and not (n.domain not in ("", "ai.onnx") and has_subgraph(n))

    def coarse(self, n: NodeProto) -> tuple:
        c, consts = self._CONST, self.consts
        return (n.domain, n.op_type, len(n.output), tuple(c if i in consts else i for i in n.input[:]))

    def _ref(self, name: str):
        return _value_key(self.g, name, self.small, self.shape_consts)

    def full(self, n: NodeProto) -> tuple:
        self.full_keys += 1
        # (node_field: an attribute-less node's empty list is not read; its object is the index's, held all round)
        return (tuple(self._ref(i) for i in n.input[:]), tuple(a.SerializeToString() for a in node_field(n, "attribute")))

    def _current(self, m: NodeProto, ck: tuple, fk: tuple | None) -> bool:
        """Is ``m`` (found in the table) still a live node under these keys? (edits may have rewired it)"""
        if not self.eligible(m) or self.coarse(m) != ck:
            return False
        return fk is None or self.full(m) == fk

    def _insert(self, n: NodeProto, ck: tuple) -> NodeProto | None:
        """Put ``n`` in the table; returns the node already there with the same full key, if any."""
        e = self.by_coarse.get(ck)
        if e is None or e is n:
            self.by_coarse[ck] = n
            return None
        if not isinstance(e, dict):
            if not self._current(e, ck, None):
                self.by_coarse[ck] = n
                return None
            e = self.by_coarse[ck] = {self.full(e): e}
        fk = self.full(n)
        m = e.get(fk)
        if m is None or m is n or not self._current(m, ck, fk):
            e[fk] = n
            return None
        return m

    def _seed(self, n: NodeProto, ck: tuple) -> None:
        """Put the nodes ``n`` could equal in the table first (once per value): the readers of its rarest
        non-constant input (a duplicate reads every input ``n`` reads), or, for a node reading only
        constants, every such node. What inserting each found is kept for its own ``match`` (see there)."""
        g = self.g
        names = [i for i, k in zip(n.input, ck[3]) if k is not self._CONST and i]
        if names:
            v = min(names, key=lambda i: len(g.uses(i)))
            if v in self.seeded:
                return
            self.seeded.add(v)
            group = list(g.uses(v))
        else:
            if "" in self.seeded:
                return
            self.seeded.add("")
            group = self._const_readers()
        found = self.found
        for m in g.in_position_order(group):  # the first in graph order is the one kept
            if self.eligible(m):  # (``n`` too: in its place in that order)
                found[id(m)] = self._insert(m, ck if m is n else self.coarse(m))

    def match(self, n: NodeProto) -> NodeProto | None:
        ck = self.coarse(n)
        self._seed(n, ck)
        # inserting n again finds what inserting it while seeding found, as long as nothing was merged since
        # (``forget`` empties ``found`` then): the node then kept under its key, still current, or n itself
        # (no match). Without this every seeded node's full key was computed twice.
        r = self.found.pop(id(n), _NOT_SEEDED)
        return self._insert(n, ck) if r is _NOT_SEEDED else r

    def forget(self) -> None:
        """A merge edited the graph: what seeding found may no longer be what inserting would find."""
        self.found.clear()


_NOT_SEEDED = object()


def _value_key(g: Graph, name: str, small: dict[str, object], folded) -> object:
    """How Dedupe compares an input: a small constant (an initializer of 64 elements or fewer, a Constant's
    value, or one of the ``folded`` shape constants) by its content, anything else by its name; cached in
    ``small``. A large weight is never read for this."""
    if name not in small:
        p = g.producer.get(name)
        t = g.initializers.get(name)
        direct = ((t is not None and math.prod(t.dims) <= 64) or (p is not None and p.op_type == "Constant")
                  or name in folded)
        c = g.const(name) if name and direct else None
        small[name] = ("=", c.dtype.str, c.shape, c.tobytes()) if c is not None and c.size <= 64 else name
    return small[name]


# what index arithmetic on shapes is written with (torch's trace of x.shape[0] - 1 - t, a view's sizes)
_SHAPE_ARITH = ("Shape", "Size", "Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Cast", "Add", "Sub", "Mul",
                "Div", "Neg", "Reshape")


def _small_shape_constants(g: Graph, consts: set[str], small: dict[str, object]) -> set[str]:
    """The values of 64 elements or fewer computed from ``consts`` and the shapes of tensors the file types
    (graph inputs, declared values) alone that fold to a constant (the dims they read are static). Walks the
    nodes of index-arithmetic op types once, in graph order; a value computed from anything else (a runtime
    value) is not folded. Values computed the same way (every step of a torch trace reads ``x.shape[1]``
    through a Shape and a Gather of its own) are folded once: the fold is asked per distinct computation,
    keyed like Dedupe's full keys (``small``: the table's cache of constants' full-key forms, filled here for
    the inputs met)."""
    derived: dict[str, tuple] = {}  # value -> how it is computed (op, attributes, inputs' keys)
    folds: dict[tuple, bool] = {}
    out = set()

    def key_of(i: str):
        return derived[i] if i in derived else _value_key(g, i, small, ())

    for n in g.nodes_of(*_SHAPE_ARITH):
        if n.op_type in ("Shape", "Size"):
            t = g.model.declared_type(n.input[0])
            if t is None or t[1] is None:
                continue  # (the shape of a value the file types: no inference is started for a clean-up)
        elif not all(not i or i in consts or i in derived for i in n.input[:]):
            continue
        base = (n.op_type, n.domain, tuple(key_of(i) if i else "" for i in n.input[:]),
                tuple(a.SerializeToString() for a in node_field(n, "attribute")))
        for k, o in enumerate(n.output[:]):
            if not o:
                continue
            derived[o] = key = base + (k,)
            if n.op_type in ("Shape", "Size"):
                continue  # (a whole shape is no index; what is computed from it is looked at)
            if key not in folds:
                c = g.const(o)
                folds[key] = c is not None and c.size <= 64
            if folds[key]:
                out.add(o)
    return out


class DropNoOps:
    """Casts to the type a value already has, and Identities, read through (torch exports a chain of
    float->float Casts around every step; they hide shared inputs and time flips from the other passes)."""

    name = "drop-no-ops"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        done = 0
        for n in g.nodes_of("Cast", "Identity"):
            if not g.alive(n) or len(n.input) != 1 or g.is_graph_output(n.output[0]):
                continue
            if n.op_type == "Cast" and _certain_type(g, n.input[0]) != attr(n, "to"):
                continue
            g.replace_uses(n.output[0], n.input[0])
            g.remove_node(n)
            done += 1
        if done:
            res.modified = True
            res.notes.append(f"read through {done} no-op Cast/Identity node(s)")
        return res


def _certain_type(g: Graph, name: str) -> int | None:
    """The element type of ``name`` where it is certain: a graph input, an initializer or a Cast's output
    (a value_info written by an earlier tool may be stale, and dropping a real Cast would change results)."""
    p = g.producer.get(name)
    if p is not None:
        return attr(p, "to") if p.op_type == "Cast" else None
    if name in g.initializers:
        return g.initializers[name].data_type
    if g.is_graph_input(name):
        return g.model.elem_type(name)
    return None


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
        for n in g.nodes_of("If"):
            if not g.alive(n) or n.domain not in ("", "ai.onnx"):
                continue
            cond = g.const(n.input[0])
            if cond is None or np.asarray(cond).size != 1:
                continue
            branch = attr(n, "then_branch" if bool(np.asarray(cond).ravel()[0]) else "else_branch")
            if branch is not None and _inline_branch(g, n, branch):
                done += 1
        if done:
            g.prune()
            res.modified = True
            res.notes.append(f"inlined {done} If node(s) with a constant condition")
        return res


def _inline_branch(g: Graph, node: NodeProto, branch) -> bool:
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
    g.remove_node(node)
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
