"""Common-subexpression elimination: nodes with the same op, attributes and inputs compute the same values.

Exporters recompute a layer's mask per layer and a step's index arithmetic per step; rnnfuse shares such
plumbing this way, which is what lets the other passes see one layer, one chain, one input. See
:class:`Dedupe`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from onnx import NodeProto

from rnnfuse.dataflow import runtime_values
from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, has_subgraph
from rnnfuse.protos import CONTROL_FLOW, UNREPEATABLE_OPS, node_field
from rnnfuse.tensor_values import constant_value



class Dedupe:
    """Common-subexpression elimination, linear in the graph and then in the edits.

    Two nodes can only be equal if they read the same values (constants aside, which count by content), so
    a node is compared only with the other readers of its rarest non-constant input, and only nodes that
    have such company are looked at: the first run takes the readers of values read more than once (and the
    nodes reading only constants), in graph order -- a plain chain has none. Nodes are keyed by names first
    (op and input names, every constant as one placeholder) and by the full key (small constants by value,
    attributes) only where two share that. A later run looks only at the nodes edits added or rewired since
    (``Graph.edited``): after passes that changed nothing it visits nothing. A merge rewires the merged
    node's readers; they are looked at again in the same run (a duplicate's readers may now be equal), and
    so are the nodes matching them finds equal to another, wherever they are. A merged node that computed
    a graph output leaves the name to an Identity of the value kept (the model's interface stays): a masked
    layer may return its last carried output beside its final state, two equal values, and the chain is
    only seen as one layer once they are one."""

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
        """Walk ``work`` from ``pos``, then the edits the merges make, then the nodes seeding found equal to
        another that no walk looked at, merging each node into an equal one."""
        n_merged = 0
        edits_from = base  # the first of this run's own edits not walked yet (readers a merge rewired)
        while True:
            if pos >= len(work):
                if work is g.edited:
                    edits_from = len(g.edited)
                if edits_from < len(g.edited):
                    work, pos = g.edited, edits_from
                    later = _LaterEdits(g.edited, pos)
                    continue
                work, pos, later = table.unvisited_duplicates(), 0, None
                if not work:
                    break
                continue
            n = work[pos]
            pos += 1
            if later is not None and later.again(n, pos - 1):
                continue  # (edited again further on: looked at there, once, not once per edit)
            if not table.eligible(n) or table.alone(n):
                continue  # (a node a merge rewired is never alone: see _DedupeTable.alone)
            self.visited += 1
            other = table.match(n)
            if other is None:
                continue
            mark = len(g.edited)
            g.remove_node(n, unfiltered)
            for a, b in zip(n.output, other.output):
                if a and b:
                    g.replace_uses(a, b)  # (a graph output keeps its name: an Identity of b, or b renamed)
            table.forget(n, g.edited[mark:])
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
        self.changed: set[int] = set()  # the nodes merges removed or rewired: their findings no longer stand
        # nodes seeding found equal to one kept before them: a merge's rewired reader seeds its new twins, which
        # need not be candidates (nor edited) and were left unmerged
        self.duplicates: list[NodeProto] = []
        self.full_keys = 0
        self.small: dict[str, object] = {}  # input name -> its full-key form (small constants by content)
        # initializers and Constant outputs: found once (a set lookup per input from then on)
        self.consts = set(g.initializers)
        self.consts.update(o for n in g.nodes_of("Constant") for o in n.output)
        # small values computed from those and static shapes alone, compared by value too: torch's trace of
        # x[x.shape[0] - 1 - t] (a backward cell stepped beside a forward one) reads the slice the forward
        # cell reads as x[t'], through an index of its own
        self.constant_keys: dict[bytes, object] = {}  # a Constant's attribute bytes -> its full-key form
        self.shape_consts = _small_shape_constants(g, self.consts, self.small, self.constant_keys)
        self.consts |= self.shape_consts
        # the constants a coarse key holds as one placeholder: not the weights of more than 64 elements, which
        # the full key compares by name anyway (1,041 cells side by side read each step's x_t through 1,041
        # weights: under one placeholder they were 16,000 nodes of one coarse key, each given a full key)
        self.placeholder = self.consts - {name for name, t in g.initializers.items() if math.prod(t.dims) > 64}
        self.fulls: dict[int, tuple] = {}  # node id -> (node, its inputs, its full key): see ``full``
        self.inputs_keys: dict[int, tuple] = {}  # node id -> (node, its inputs, their key), as the candidates found it

    def candidates(self) -> list[NodeProto]:
        """The nodes that may equal another, in graph order (topological for the input model, which is where
        it matters): nodes whose every non-constant input is read by another node too, one of them with the
        same coarse key and the same inputs, small constants by value (a duplicate reads them all, and has
        the same coarse key), and the nodes reading only constants."""
        g = self.g
        consumers, consts, coarse = g.consumers, self.consts, self.coarse
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
                # ... and the same coarse key: x_t read by 1,041 cells' MatMuls, each through its own weight
                # (held by name), has no duplicate among them
                alike: dict = {}
                for c in cs:
                    if kinds[c.op_type] > 1 and id(c) not in out:
                        alike.setdefault(coarse(c), []).append(c)
                for group in alike.values():
                    if len(group) < 2:
                        continue
                    for c in self._alike_by_value(group):
                        if not self.alone(c):
                            out[id(c)] = c
        for c in self._const_readers():
            out[id(c)] = c
        if not out:
            return []  # (a plain chain: not even the positions are needed)
        return g.in_position_order(out.values())

    def _alike_by_value(self, group: list[NodeProto]) -> list[NodeProto]:
        """The nodes of ``group`` (one coarse key) whose inputs, the small constants by value, are another's
        too. A duplicate has the same inputs as the node it equals (what the full key compares), so the others
        can equal nothing: a trace's per-step ``x[t]`` (a Gather or Slice of x at an index of its own) is
        thousands of nodes under one coarse key, none equal to another, and each was given a full key."""
        if self._CONST not in self.coarse(group[0])[3]:
            return group  # (no constant among the inputs: the coarse key holds every input's name)
        by_inputs: dict[tuple, list[NodeProto]] = {}
        inputs_keys = self.inputs_keys
        for c in group:
            ins = c.input[:]
            key = self._inputs_key(ins)
            by_inputs.setdefault(key, []).append(c)
            inputs_keys[id(c)] = (c, ins, key)  # (a node kept here is given a full key next: this is its first part)
        return [c for same in by_inputs.values() if len(same) > 1 for c in same]

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
        if op in UNREPEATABLE_OPS or op == "Constant" or op in CONTROL_FLOW:
            return False  # Constants are compared by value where they are read
        return bool(n.output) and not (n.domain not in ("", "ai.onnx") and has_subgraph(n))

    def alone(self, n: NodeProto) -> bool:
        """Whether ``n`` reads a value no other node reads (constants aside, which count by content): a node
        equal to it would read that value too, so none is, until an edit gives the value another reader, which
        is then looked at and finds ``n`` among that value's readers. (A fused loop's head replayed once is
        100,000 new nodes, each the one reader of the one before: each was seeded and inserted.) Not a node
        a merge of this run rewired: the values it now reads may have been seeded before it read them, and
        their next reader would not find it unless it is in the table under its new key."""
        if id(n) in self.changed:
            return False
        readers, consts = self.g.consumers, self.consts
        for i in n.input[:]:
            if i and i not in consts:
                r = readers.get(i)
                if type(r) is not list or len(r) < 2:  # (one reader is held as the node itself)
                    return True
        return False

    def coarse(self, n: NodeProto) -> tuple:
        c, placeholder = self._CONST, self.placeholder
        return (n.domain, n.op_type, len(n.output), tuple([c if i in placeholder else i for i in n.input[:]]))

    def _inputs_key(self, ins: list[str]) -> tuple:
        """The full key's part for the inputs: each by name, small constants by value (:func:`_value_key`)."""
        g, small, folded, constant_keys = self.g, self.small, self.shape_consts, self.constant_keys
        return tuple([_value_key(g, i, small, folded, constant_keys) for i in ins])

    def full(self, n: NodeProto) -> tuple:
        """The full key; kept per node while its inputs stay the same (a node is keyed when seeded, when
        matched and each time it is found as a match: merges rewire inputs, nothing else a key reads)."""
        ins = n.input[:]
        kept = self.fulls.get(id(n))
        if kept is not None and kept[0] is n and kept[1] == ins:
            return kept[2]
        self.full_keys += 1
        first = self.inputs_keys.pop(id(n), None)
        inputs_key = first[2] if first is not None and first[0] is n and first[1] == ins else self._inputs_key(ins)
        # (node_field: an attribute-less node's empty list is not read; its object is the index's, held all round)
        key = (inputs_key, tuple(a.SerializeToString() for a in node_field(n, "attribute")))
        self.fulls[id(n)] = (n, ins, key)
        return key

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
                kept = found[id(m)] = self._insert(m, ck if m is n else self.coarse(m))
                if kept is not None and m is not n:
                    self.duplicates.append(m)

    def unvisited_duplicates(self) -> list[NodeProto]:
        """The nodes seeding found equal to another that are still in the graph (a walk merged the others)."""
        out = [m for m in self.duplicates if self.g.alive(m)]
        self.duplicates = []
        return out

    def match(self, n: NodeProto) -> NodeProto | None:
        ck = self.coarse(n)
        self._seed(n, ck)
        # inserting n again finds what inserting it while seeding found, as long as no merge since changed n or
        # the node it found (see ``forget``): the node then kept under its key, still current, or n itself (no
        # match). Without this every seeded node's full key was computed twice.
        r = self.found.pop(id(n), _NOT_SEEDED)
        if r is _NOT_SEEDED or id(n) in self.changed or (r is not None and id(r) in self.changed):
            return self._insert(n, ck)
        return r

    def forget(self, merged: NodeProto, rewired: list[NodeProto]) -> None:
        """A merge removed ``merged`` and gave ``rewired`` (and any node it added) new inputs: what seeding
        found for them, or found equal to them, may no longer be what inserting would find. Every other finding
        stands: a node's keys read its inputs and attributes alone, and the node kept under a key stays there
        while it is unchanged. (Forgetting every finding at each merge re-inserted each node walked after the
        first merge: 7,142 merges of x[t] reads, 14,000 inserts again.)"""
        self.changed.add(id(merged))
        self.changed.update(map(id, rewired))


_NOT_SEEDED = object()


def _value_key(g: Graph, name: str, small: dict[str, object], folded, constant_keys: dict[bytes, object]) -> object:
    """How Dedupe compares an input: a small constant (an initializer of 64 elements or fewer, a Constant's
    value, or one of the ``folded`` shape constants) by its content, anything else by its name; cached in
    ``small``. A large weight is never read for this. ``constant_keys``: Constants' forms by their attribute
    bytes (a trace writes a Constant per use of the same index: each distinct one is read once)."""
    if name not in small:
        p = g.producer.get(name)
        if p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx"):
            raw = b"".join(a.SerializeToString() for a in p.attribute)
            if raw not in constant_keys:
                # (its tensor read directly: a trace's 25,000 per-step indices each went through the fold
                # machinery and stayed in the graph's constant cache; any other form is folded as before)
                value = constant_value(p, g.model)
                constant_keys[raw] = _content_key(value if isinstance(value, np.ndarray) else g.const(name))
            small[name] = constant_keys[raw] or name
        else:
            t = g.initializers.get(name)
            direct = (t is not None and math.prod(t.dims) <= 64) or name in folded
            small[name] = _content_key(g.const(name) if name and direct else None) or name
    return small[name]


def _content_key(c) -> tuple | None:
    """A constant's full-key form: its content, when it has 64 elements or fewer (else None)."""
    return ("=", c.dtype.str, c.shape, c.tobytes()) if c is not None and c.size <= 64 else None


# what index arithmetic on shapes is written with (torch's trace of x.shape[0] - 1 - t, a view's sizes)
_SHAPE_ARITH = ("Shape", "Size", "Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Cast", "Add", "Sub", "Mul",
                "Div", "Neg", "Reshape")


def _small_shape_constants(g: Graph, consts: set[str], small: dict[str, object], constant_keys: dict) -> set[str]:
    """The values of 64 elements or fewer computed from ``consts`` and the shapes of tensors the file types
    (graph inputs, declared values) alone that fold to a constant (the dims they read are static). Walks the
    nodes of index-arithmetic op types once, in graph order; a value computed from anything else (a runtime
    value) is not folded. Values computed the same way (every step of a torch trace reads ``x.shape[1]``
    through a Shape and a Gather of its own) are folded once: the fold is asked per distinct computation,
    keyed like Dedupe's full keys (``small``, ``constant_keys``: the table's caches of constants' full-key
    forms, filled here for the inputs met)."""
    derived: dict[str, tuple] = {}  # value -> how it is computed (op, attributes, inputs' keys)
    folds: dict[tuple, bool] = {}
    out = set()

    def key_of(i: str):
        return derived[i] if i in derived else _value_key(g, i, small, (), constant_keys)

    for n in _maybe_from_constants(g, g.nodes_of(*_SHAPE_ARITH)):
        if n.op_type in ("Shape", "Size"):
            t = g.model.declared_type(n.input[0])
            if t is None or t[1] is None:
                continue  # (the shape of a value the file types: no inference is started for a clean-up)
        elif not _reads_only(n, consts, derived):
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


def _maybe_from_constants(g: Graph, nodes: list[NodeProto]) -> list[NodeProto]:
    """``nodes`` but those whose every output the run's runtime set holds (computed from a graph input's
    values: never from constants and shapes alone), in their order. The set is one walk of the run
    (dataflow.runtime_values), and the test a set difference: a 100,000-node elementwise prologue (Add
    and Mul, index-arithmetic ops) is not looked at node by node (0.3 s a Dedupe run)."""
    if len(nodes) < 1000:
        return nodes  # (each is looked at: cheaper than the walk when the run has not made it yet)
    runtime = runtime_values(g)
    producer = g.producer
    if 2 * len(runtime) < len(producer):
        return nodes  # (most values are not known to come from inputs, those after a Loop say: a filter keeps most)
    keep = {id(producer[o]) for o in producer.keys() - runtime}
    return [n for n in nodes if id(n) in keep]


def _reads_only(n: NodeProto, consts: set, derived: dict) -> bool:
    """Whether every input of ``n`` is in ``consts`` or ``derived`` (a loop that stops at the first that is
    not, over the field: a slice of it made every name of 100,000 nodes, four times a run)."""
    for i in n.input:
        if i and i not in consts and i not in derived:
            return False
    return True
