"""Edits of a graph scope that keep its maps exact, and the one sort that writes the result back.

Edits never re-sort the node list; :meth:`Graph.finalize` does one stable topological sort, removes dead
nodes and unused initializers, and writes the result back into the proto.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import TYPE_CHECKING

import numpy as np
from onnx import NodeProto, helper

from .graph_additions import Additions
from .graph_index import GraphIndex, n_readers
from .graph_rewire import Rewiring
from .graph_walks import Walks
from .graph_weights import Weights
from .kept_declines import edits_of
from .node_list import drop_initializers, write_back
from .protos import has_subgraph, node_field
from .removed_nodes import Removed, without

if TYPE_CHECKING:
    from .model import Model


class Graph(Additions, Rewiring, Walks, Weights, GraphIndex):
    """One graph scope with producer/consumer maps (:class:`GraphIndex`), walks over its dataflow
    (:class:`~rnnfuse.graph_walks.Walks`) and edit operations (new nodes: :class:`~rnnfuse.graph_additions.Additions`;
    renaming what nodes read: :class:`~rnnfuse.graph_rewire.Rewiring`; new weights:
    :class:`~rnnfuse.graph_weights.Weights`)."""

    # what the last finalize's round defined anew: the outputs of nodes it added, rewired or removed
    redefined: list[str] | None = None
    # the values that lost a reader since the graph was built or last pruned or finalized (None: not known);
    # with the edited nodes, where the next prune looks for dead nodes (set in GraphIndex.__init__)
    _lost: set[str] | None

    # -- edits -------------------------------------------------------------------------------------------
    def remove_node(self, node: NodeProto, defer: set | None = None) -> None:
        """``defer`` (a set): the reader lists of 64+ readers that ``node`` is in keep it until
        :meth:`drop_removed_readers` is given the set (their uses list it meanwhile, removed: not ``alive``). Dedupe
        merging 50,000 duplicates that all read one ``x`` filtered x's reader list at each removal."""
        if id(node) in self._removed:
            return
        self._removed.add(id(node))
        self._graveyard.append(node)  # keep the object alive: its id must not be reused by a new node
        self._unindex(node, defer)

    def drop_removed_readers(self, names) -> None:
        """Filter the removed nodes out of these values' reader lists (see :meth:`remove_node`)."""
        for i in names:
            lst = self.consumers.get(i)
            if type(lst) is list:
                lst[:] = self._removed.keep(lst)

    def remove_nodes(self, nodes: list[NodeProto]) -> None:
        """Remove many nodes at once: each consumer list is filtered once (a weight read by 2,000 unrolled
        steps would otherwise be rescanned per step)."""
        removed, producer, graveyard = self._removed, self.producer, self._graveyard
        self._edits += 1
        if len(nodes) < 64:
            for n in nodes:
                self.remove_node(n)
            return
        # which live nodes go, as flags over them: no set of every removed id is built (this runs at the peak
        # of a fused chain's rewrite, 108k nodes: the ids and the table of such a set held 7.5 MB)
        live = removed.keep(self.nodes)
        flags = _among(live, nodes)
        n_gone = flags.count(True)
        if n_gone < 64:
            for n in nodes:
                self.remove_node(n)
            return
        if len(live) - n_gone < n_gone:  # most of the graph goes (a fused chain): index what stays instead
            survivors = list(itertools.compress(live, map(operator.not_, flags)))
            graveyard.extend(itertools.compress(live, flags))
            removed.keep_only(survivors)
            self._lost = None  # (what lost a reader is not tracked through a re-index: the next prune walks)
            self.producer.clear()
            self.consumers.clear()
            self._index_all(survivors)
            return
        gone = set(map(id, itertools.compress(live, flags)))
        touched: set[str] = set()
        for n in nodes:
            k = id(n)
            if k not in gone or k in removed:
                continue
            removed.add(k)
            graveyard.append(n)
            for o in n.output:
                if o and producer.get(o) is n:
                    del producer[o]
            touched.update(n.input)
            if has_subgraph(n):
                touched |= self.implicit_inputs(n)
        self._drop_readers(touched, gone)

    def _drop_readers(self, names, gone: set[int]) -> None:
        """Take the nodes of ``gone`` (ids) off these values' reader lists, each list filtered once (removing
        them one by one is quadratic when every step of a chain reads one value)."""
        consumers = self.consumers
        if self._lost is not None:
            self._lost.update(names)
        for i in names:
            lst = consumers.get(i)
            if type(lst) is list:
                if lst:
                    lst[:] = [c for c in lst if id(c) not in gone]
            elif lst is not None and id(lst) in gone:
                consumers[i] = []  # (the name stays known as read, by nothing now)

    def rewrite_in_place(self, node: NodeProto, op_type: str, inputs: list[str], **attrs) -> None:
        """Make ``node`` compute ``op_type(inputs)`` into the same outputs, as the same object (in a body, the message
        its owner holds: what validation and onnxruntime run; the owner's captures are read again)."""
        self.rewrite_many_in_place([(node, op_type, inputs, attrs)])

    def rewrite_many_in_place(self, rewrites) -> None:
        """:meth:`rewrite_in_place` of each ``(node, op_type, inputs, attrs)``, the reader list of each value they
        read before filtered once (every step's mask reads the lengths: a filter per step was quadratic)."""
        rewrites, before = list(rewrites), set()
        for node, *_ in rewrites:
            before.update(x for x in (*node.input, *self.implicit_inputs(node)) if x)
        wide, g, ids = self.__dict__.get("_wide_inputs", {}), self, {id(n) for n, *_ in rewrites}
        self._drop_readers(before, ids)
        while g is not None:  # (the round's nodes that compute otherwise than the input's did: validate._original_runs)
            g.__dict__.setdefault("in_place", set()).update(ids)
            ids, g = {id(g.owner)} if g.owner is not None else set(), g.parent
        moved = [(node, node.op_type) for node, op_type, *_ in rewrites if node.op_type != op_type]
        for node, op_type, inputs, attrs in rewrites:
            wide.pop(id(node), None)  # (positions of its inputs read before: read again when asked)
            node.op_type, node.domain, node.input[:] = op_type, "", inputs
            del node.attribute[:]
            node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
            self._index(node)  # (its outputs are its own still; its reads are indexed anew)
            self.edited.append(node)
        self._by_op_moved(moved)
        if self.owner is not None and self.parent is not None:
            self.parent.reindex(self.owner)

    def add_input(self, hint: str, elem_type: int, dims: list) -> str:
        """A new input of this graph (a Scan body's, for a new scan input of its owner): its name."""
        name = self.fresh(hint)
        self.proto.input.append(helper.make_tensor_value_info(name, elem_type, dims))
        self.input_names.append(name)
        self._inputs.add(name)
        return name

    def reindex(self, node: NodeProto) -> None:
        """Read what ``node``'s subgraphs read from outside them again, after an edit of a node inside one of
        them (its own inputs are as they were). Only the names it no longer reads lose it as a reader and only
        those it reads anew gain it; the others keep it where it is: dropping and adding it again filtered
        every reader list it is on, and the 2,000 masked Loops of a stack all read one trip count, each
        rewritten in place once (0.44 s at 2,000 Loops, 10x for 4x as many; 0.21 s now, linear)."""
        before = set(node.input) | self.implicit_inputs(node)
        self._implicit.pop(id(node), None)
        now = itertools.chain(node.input, sorted(self.implicit_inputs(node)))
        self.owners_complete = False  # (as any edit of the index: see GraphIndex._index)
        self._edits += 1
        self.__dict__.get("_wide_inputs", {}).pop(id(node), None)  # (positions of its reads: read again when asked)
        after = dict.fromkeys(x for x in now if x)
        self._drop_readers([x for x in before if x and x not in after], {id(node)})
        for i in after:
            if i not in before:
                self._add_reader(i, node)
        self.edited.append(node)

    def edit_mark(self) -> tuple:
        """A mark of the edit log as it is now, for :meth:`edited_since`."""
        return (self.edited, len(self.edited), len(self._graveyard))

    def edited_this_round(self) -> list[NodeProto]:
        """The nodes added, rewired or removed since the last :meth:`finalize`."""
        return [*self.edited, *self._graveyard]

    def edited_since(self, mark: tuple) -> list[NodeProto] | None:
        """The nodes added, rewired or removed since ``mark`` was taken; None when the log was reset since
        (:meth:`finalize`: the round is over)."""
        log, n_edited, n_removed = mark
        if log is not self.edited:
            return None
        return self.edited[n_edited:] + self._graveyard[n_removed:]

    def _state(self) -> tuple[int, int]:
        """Changes so far (nodes added or rewired, nodes removed): equal states mean the same graph."""
        return (len(self.edited), len(self._graveyard))

    def prune(self) -> int:
        """Drop nodes nothing reads (the remains of fused recurrences); returns how many."""
        if self._pruned == self._state():
            return 0  # nothing changed since the last prune: nothing new is dead
        dead = self._dead_nodes()
        self.remove_nodes(dead)
        if dead:
            self.nodes = self._removed.keep(self.nodes)
        self._pruned = self._state()
        self._lost = set()  # (every node left is live)
        return len(dead)

    # -- finalize ----------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Remove dead nodes and unused initializers, topologically sort, and write back to the proto.

        Linear, and no whole-graph work it can prove unneeded: no liveness walk right after a prune, no sort of
        an order no edit disturbed, no proto rewrite or index rebuild of an unchanged node list."""
        touched = self.edited_this_round()  # (whose outputs are ``redefined``, when asked: see the end)
        removed = self._removed
        nodes = removed.keep(self.nodes) if removed else self.nodes
        dead = [] if self._pruned == self._state() else self._dead_nodes()  # (else every node left is live)
        if dead:
            gone = set(map(id, dead))
            nodes = [n for n in nodes if id(n) not in gone]
        facts = self.model.facts if self.model is not None else None
        if facts is not None and facts.kept_declines is not None:
            facts.kept_declines.close_round(self.model)
            if facts.kept_declines.reasons:  # (what a kept decline must not have been reached by)
                facts.round_edits = edits_of([*touched, *dead])
        sort = bool(self.edited) or not self._input_sorted
        if sort:
            nodes = self.toposort(nodes)
        runtime = self.model.facts.runtime if self.model is not None and self.parent is None else None
        if runtime is not None and self.edited:  # (the run's kept set learns the values the round computed anew)
            from .dataflow import runtime_after_edits  # (dataflow's walks build on the graph)

            runtime_after_edits(runtime, nodes, self.edited)
        copies: list | None = []
        # the same length and nothing removed or re-sorted: the proto's own list, as it is
        if len(nodes) != len(self.proto.node) or (
            (removed or sort) and any(a is not b for a, b in zip(nodes, self.proto.node))
        ):
            copies = write_back(self.proto.node, nodes)
            nodes = list(self.proto.node)  # (the messages the proto holds: the nodes it held, and copies)
        if dead and copies is not None:
            self.remove_nodes(dead)  # (off the index as a prune takes them; a rewrite indexes the rest anew)
        self.nodes = nodes
        self._pos_from(nodes)
        self._by_op = None  # (a new order)
        self._removed = Removed()
        self._graveyard.clear()
        self.__dict__.pop("_nursery", None)  # (what stays of it was copied into the proto; a node still referred
        # to elsewhere keeps its message, and with it the old nursery's arena, alive)
        edited, self.edited = self.edited, []
        self.__dict__.pop("in_place", None)
        self._input_sorted = True
        if copies is None:  # (every message is new: the index is built again)
            self.producer.clear()
            self.consumers.clear()
            self._implicit.clear()
            self._subgraph_views.clear()  # (by the ids of the messages gone: a fused Loop's held its body's index)
            self._index_all(nodes)
        else:
            live = set(map(id, nodes))
            swap = self._take_copies(copies, live)
            self._carry_const_only(edited, swap, live)
        self._pruned = self._state()
        self._lost = set()  # (every node left is live)
        # the initializers and value_info entries still read or defined (from the indices, not the nodes)
        consumers, outputs = self.consumers, set(self.output_names)
        unused = [k for k in self.initializers if not n_readers(consumers.get(k)) and k not in outputs and k not in self._inputs]
        if unused or len(self.initializers) != len(self.proto.initializer):
            drop_initializers(self.proto.initializer, set(unused))
        self.initializers = {t.name: t for t in self.proto.initializer} if unused else self.initializers
        # (after the drop, which the next round's choice counts: what it carries over of the types this one
        # inferred cone by cone; a graph it infers whole carries none, and reading the outputs of the 100,000
        # nodes a fused chain removed took 0.2 s)
        self.redefined = [o for n in touched for o in n.output if o] if (
            self.model is not None and self.model.types_by_cone and not self.model.infers_whole(self)) else None
        self.release_arrays()  # (the round is over: its cached values go, and the pages of mapped weights)
        if len(self.proto.value_info):
            defined = self.producer.keys() | self.initializers.keys() | self._inputs
            vis = [v for v in self.proto.value_info if v.name in defined]
            if len(vis) != len(self.proto.value_info):
                del self.proto.value_info[:]
                self.proto.value_info.extend(vis)

    def _take_copies(self, copies: list[tuple[NodeProto, NodeProto]], live: set[int]) -> dict[int, NodeProto]:
        """The index, exact for the nodes the proto held before finalize, made to name the proto's copies of the
        nodes added this round (each value's reader list rewritten once); what is keyed by the id of a node
        not ``live`` (the ids of the listed nodes) is dropped (its object goes now: the id may come back).
        Returns a node's id -> its copy."""
        self._edits += 1  # (what the last index pass found is not known to hold)
        producer, consumers, swap = self.producer, self.consumers, {id(n): c for n, c in copies}
        names: set[str] = set()
        for node, copy in copies:
            for o in node.output:
                if o and producer.get(o) is node:
                    producer[o] = copy
            names.update(self.reads(node))
        for name in names:
            lst = consumers.get(name)
            if type(lst) is list:
                lst[:] = [swap.get(id(c), c) for c in lst]
            elif lst is not None:
                consumers[name] = swap.get(id(lst), lst)
        self._implicit = {k: v for k, v in self._implicit.items() if k in live}
        self._subgraph_views = {k: v for k, v in self._subgraph_views.items() if k in live}
        return swap

    def _carry_const_only(self, edited: list[NodeProto], copy_of: dict[int, NodeProto], live: set[int]) -> None:
        """Dedupe's nodes that read constants only (GraphIndex.const_only_readers), carried through a finalize
        that kept the index instead of left for the next round's first Dedupe to find over every constant's
        readers (50,000 weights of a big head): those the last index pass listed, the nodes edited since
        (``copy_of``: an added node's id -> the proto's copy) and the readers of an edited Constant, each
        tested again; ``live``: the ids of the nodes listed."""
        found = self._const_only[1]
        if found is None:  # (the index pass could not tell: the next run looks for itself)
            return
        consts = set(self.initializers)
        consts.update(o for n in self.nodes_of("Constant") for o in n.output)
        ask: dict[int, NodeProto] = {}
        for n in itertools.chain(found, (copy_of.get(id(n), n) for n in edited)):
            ask[id(n)] = n
            for o in n.output if n.op_type == "Constant" else ():
                ask.update((id(r), r) for r in self.uses(o))
        out = []
        for n in ask.values():
            ins = [i for i in node_field(n, "input") if i]
            if id(n) in live and ins and consts.issuperset(ins):
                out.append(n)
        self._const_only = (self._edits, out)

    def next_view(self, model: "Model") -> "Graph":
        """This main graph, just finalized, as the graph of ``model`` (the next round's view of the same
        proto): finalize left its index exact (the proto's node messages, their order, producers and
        readers), so the next round takes it over instead of indexing 100,000 nodes again; what belongs to a
        round starts afresh (cached constants, subgraph views, the edit log, declared types read again)."""
        assert self.parent is None and not self.edited and not self._graveyard and not self._removed, "not finalized"
        g = object.__new__(type(self))
        g.__dict__.update(self.__dict__)
        g.model = model
        g._arrays, g._subgraph_views, g._removed, g._graveyard, g.edited = {}, {}, Removed(), [], []
        for per_round in ("_local_types", "_wide_inputs", "redefined", "in_place"):
            g.__dict__.pop(per_round, None)
        return g

    def _dead_nodes(self) -> list[NodeProto]:
        """The nodes no graph output is computed from, in node-list order.

        A graph no edit has touched yet (as loaded: dead code there is rare) is first checked from the
        indices alone: if every node has an output that is read or is a graph output, nothing is dead (ONNX
        graphs have no cycles), which one pass over the value names proves without reading any node. After
        edits, only what they touched is looked at (:meth:`newly_dead`): the nodes edited and the producers of
        values that lost a reader since the last prune or finalize left every node live (or since the graph
        was built, with its unread values' producers: its own dead code). Otherwise liveness is walked back
        from the outputs: that walk reads the live nodes only."""
        removed = self._removed
        if self._lost is not None and (self.edited or removed):
            since = self._pruned[0] if self._pruned is not None else 0
            sinks = [] if self._pruned is not None else [self.producer[o] for o in self._unread()]
            touched = self.edited[since:] + sinks + [self.producer[v] for v in self._lost if v in self.producer]
            # (the walk from the outputs over the live nodes when they are not many more than the touched
            # ones, which the other walk costs a few times over: a fused chain leaves 100,000 dead steps and a
            # few live nodes; a small fusion in a big graph, the other way round)
            live = self._live_set(4 * len(touched) + 64)
            return self.newly_dead(touched) if live is None else without(removed.keep(self.nodes), live)
        if not self.edited and not removed and self.owners_complete:
            # the names produced but neither read nor output; then only the nodes producing such names are read
            producer = self.producer
            unread = self._unread()
            unread.difference_update(self.output_names)
            sinks = {id(producer[o]): producer[o] for o in unread}
            sinks = [p for p in sinks.values() if all(o in unread for o in p.output if o and producer.get(o) is p)]
            if not sinks:
                return []  # every node has a value that is read or output: nothing is dead (no cycles)
            if self._input_sorted:  # (no cycle: what is dead is found from the unread nodes back)
                return self._dead_from_sinks(sinks, unread)
        live = self._live_set()
        return without(removed.keep(self.nodes), live)

    def nodes_with_ids(self, ids) -> list[NodeProto]:
        """The live nodes whose ids are ``ids``, in node-list order, found through the position index rather
        than by a scan of the list: a chain's nodes among 100,000, asked once per chain of a graph of many."""
        if 8 * len(ids) > len(self.nodes):  # (most of the graph: one scan is cheaper, and still linear overall)
            return [n for n in self._removed.keep(self.nodes) if id(n) in ids]
        want = np.fromiter(ids, dtype=np.int64)
        sorted_ids, order = self._sorted_ids()
        found: list[NodeProto] = []
        missing = want
        if len(sorted_ids) and len(want):
            at = np.minimum(np.searchsorted(sorted_ids, want), len(sorted_ids) - 1)
            hit = sorted_ids[at] == want
            base = self._pos_base
            found = [base[i] for i in np.sort(order[at[hit]]).tolist()]  # (the list as indexed, in its order)
            missing = want[~hit]
        if len(missing):  # nodes added since the index was built, after those in the list: one scan
            rest = set(missing.tolist())
            found += [n for n in self.nodes if id(n) in rest]
        return self._removed.keep(found)

    def ordered_live_nodes(self) -> list[NodeProto]:
        """The live nodes in a topological order: the node list as it is when it was in order (as read, or
        as finalize left it) and no edit has added or rewired a node since (removals keep an order), with
        no sort and no check; else :meth:`toposort`."""
        live = self.live_nodes()
        if self._input_sorted and not self.edited:
            return live
        return self.toposort(live)

    def toposort(self, nodes: list[NodeProto]) -> list[NodeProto]:
        """The stable topological order of ``nodes``: among the nodes whose producers are all placed, the one
        with the smallest position goes first (Kahn's order, a heap of ready nodes).

        Computed by one scan in position order: a node whose producers are all placed is placed; one still
        waiting for a producer is parked until its last one is placed, and parked nodes freed so go before
        the scan moves on, smallest position first (they are then exactly the ready nodes of smaller
        position). Which nodes must be looked at: in a list that was in order (as read, or as finalize left
        it) only an edit can have broken it, and only where it added or rewired a node -- every other node
        keeps its place and its inputs, and a name a new node computes is read by readers found from it --
        so while nothing is parked, only those nodes' reads are read, not a 100,000-node graph around a small
        fusion; a list that was not in order has every node's reads read."""
        order = self.in_position_order(nodes)
        index = {id(n): i for i, n in enumerate(order)}
        check: set[int] | None = None  # (None: every node)
        if self._input_sorted:
            edited = [n for n in self.edited if id(n) in index]
            check = {id(n) for n in edited}
            for n in edited:
                check.update(id(r) for o in n.output if o for r in self.uses(o) if id(r) in index)
        producer, reads = self.producer, self.reads
        out: list[NodeProto] = []
        waits: dict[int, int] = {}  # parked node -> how many of its producers are not placed yet
        waiters: dict[int, list[NodeProto]] = {}  # producer -> the parked nodes waiting for it
        freed: list[tuple[int, NodeProto]] = []  # (heap by position) parked nodes whose producers are all placed

        def place(n: NodeProto) -> None:
            out.append(n)
            for w in waiters.pop(id(n), ()):
                waits[id(w)] -= 1
                if not waits[id(w)]:
                    del waits[id(w)]
                    heapq.heappush(freed, (index[id(w)], w))

        for i, n in enumerate(order):
            while freed:
                place(heapq.heappop(freed)[1])
            if waits or check is None or id(n) in check:
                pending = None
                for x in reads(n):
                    p = producer.get(x)
                    if p is not None and (id(p) in waits or index.get(id(p), -1) > i):
                        if pending is None:
                            pending = {}
                        pending[id(p)] = p
                if pending is not None:
                    waits[id(n)] = len(pending)
                    for p in pending.values():
                        waiters.setdefault(id(p), []).append(n)
                    continue
            if waiters:
                place(n)
            else:
                out.append(n)  # (nothing parked waits for anything: n is placed, and frees nothing)
        while freed:
            place(heapq.heappop(freed)[1])
        if waits:
            raise RuntimeError("graph has a cycle after rewriting")
        return out


def _among(nodes: list[NodeProto], others: list[NodeProto]) -> list[bool]:
    """For each of ``nodes``, whether it is one of ``others`` (by id: a binary search in the sorted ids of
    ``others``, a few arrays of 8 bytes a node where a set held ~70)."""
    ids = np.fromiter(map(id, nodes), dtype=np.int64, count=len(nodes))
    sought = np.fromiter(map(id, others), dtype=np.int64, count=len(others))
    sought.sort()
    at = np.searchsorted(sought, ids)
    np.minimum(at, len(sought) - 1, out=at)
    return (sought[at] == ids).tolist()
