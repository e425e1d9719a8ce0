"""Walks over a graph's dataflow, for :class:`rnnfuse.graph_edit.Graph` (a :class:`~rnnfuse.graph_index.GraphIndex`).

What a node reads (its inputs and its subgraphs' captures), the nodes some values are computed from (their
cone, producers first) and the nodes computed from some values (their downstream): each walk written once,
over the index's producer and reader maps, so that validation, the guard's helpers, the passes and the
round-to-round type carry follow the same edges in the same order. And liveness: the nodes no graph output
is computed from, found from the unread values, from what edits touched, or from the outputs back
(``Graph._dead_nodes`` picks the walk).
"""

from __future__ import annotations

import itertools

from onnx import NodeProto

from .graph_index import n_readers
from .protos import has_subgraph


class Walks:
    """Mixed into :class:`~rnnfuse.graph_edit.Graph`."""

    def reads(self, node: NodeProto) -> list[str]:
        """What ``node`` reads: its inputs, then (a node with subgraphs) the outer values its subgraphs
        capture, sorted (the walks over the graph follow both, in the same order in every process)."""
        if not has_subgraph(node):
            return node.input[:]
        return [*node.input, *sorted(self.implicit_inputs(node))]

    def cone(self, names, stop=(), reads=None) -> list[NodeProto]:
        """The live nodes ``names`` are computed from, not past the values in ``stop``, producers first: the
        order of one depth-first walk back from them (each node after what it reads). Only that cone is
        walked (validation's check models: sorting the whole graph for a cone of a few hundred nodes cost
        ~0.4 s a validation at 100k nodes; walking and then sorting a 100k-node cone ~0.45 s, the walk alone
        ~0.15 s). ``reads``: :meth:`reads`, or a caller's memo of it."""
        producer, reads = self.producer, reads or self.reads
        seen: set[int] = set()
        order: list[NodeProto] = []
        roots = sorted((n for n in names if n in producer and n not in stop), reverse=True)
        stack: list[tuple[NodeProto, bool]] = [(producer[n], False) for n in roots]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                order.append(n)
                continue
            if id(n) in seen:
                continue
            seen.add(id(n))
            stack.append((n, True))
            for i in reversed(reads(n)):
                p = producer.get(i)
                if p is not None and id(p) not in seen and i not in stop:
                    stack.append((p, False))
        return [n for n in order if self.alive(n)]

    def downstream(self, names, limit: int | None = None) -> list[NodeProto] | None:
        """The nodes computed from ``names``: their readers (a subgraph's capture counts as a read), those
        nodes' readers, and so on, each once, in the order met; None past ``limit`` nodes (a caller that only
        saves work with the answer stops there)."""
        out: list[NodeProto] = []
        for r in self._readers_on(names):
            out.append(r)
            if limit is not None and len(out) > limit:
                return None
        return out

    def feeds_op(self, names, op_types) -> bool:
        """Whether a node of one of ``op_types`` is computed from ``names`` (:meth:`downstream`, stopping at the
        first such node)."""
        return any(r.op_type in op_types for r in self._readers_on(names))

    def _readers_on(self, names):
        """:meth:`downstream`'s nodes, one at a time (a caller may stop early)."""
        seen: set[int] = set()
        stack = list(names)
        while stack:
            for r in self.uses(stack.pop()):
                if id(r) not in seen:
                    seen.add(id(r))
                    yield r
                    stack.extend(o for o in r.output if o)

    def newly_dead(self, touched: list[NodeProto]) -> list[NodeProto]:
        """The live nodes no graph output is computed from, in node-list order, when every node was live
        before some edits: such a node is one of the ``touched`` ones (edited since, or the producer of a
        value that lost a reader since), or one whose every reader is such a dead node. Only those are looked
        at, not the 100,000 live nodes around a fusion that a walk from the outputs reads."""
        producer, dead = self.producer, set()

        def dies(p: NodeProto) -> bool:
            if id(p) in dead or not self.alive(p):
                return False
            for o in p.output:
                if o and (self.is_graph_output(o) or any(id(r) not in dead and self.alive(r) for r in self.uses(o))):
                    return False
            return True

        stack = list(touched)
        while stack:
            p = stack.pop()
            if dies(p):
                dead.add(id(p))
                stack.extend(q for i in self.reads(p) if (q := producer.get(i)) is not None and id(q) not in dead)
        return self.nodes_with_ids(dead) if dead else []

    def _unread(self) -> set[str]:
        """The values nodes produce and no node reads (an emptied reader list, left by rewiring before a
        finalize, reads nothing): set operations in C, no node read."""
        producer, consumers = self.producer, self.consumers
        unread = producer.keys() - consumers.keys()
        if not all(consumers.values()):
            unread.update(k for k, v in consumers.items() if not v and k in producer)
        return unread

    def _dead_from_sinks(self, sinks: list[NodeProto], unread: set[str]) -> list[NodeProto]:
        """The dead nodes of an acyclic graph as loaded, in node-list order, from the indices: the ``sinks``
        (every value they produce is in ``unread``: not read, not output) are dead, and so is a node all of
        whose read values are read only by dead nodes. Reads the dead nodes and their producers, not the live
        graph (a few unused constants in a 100k-node export)."""
        producer, consumers, outs = self.producer, self.consumers, set(self.output_names)
        stack = list(sinks)
        dead: set[int] = set()
        left: dict[str, int] = {}  # read name -> its readers not yet known dead
        owned: dict[int, int] = {}  # node -> its read values not yet known to be read only by dead nodes
        while stack:
            n = stack.pop()
            if id(n) in dead:
                continue
            dead.add(id(n))
            for i in dict.fromkeys(self.reads(n)):
                if not i or i in outs or i in unread or i not in producer:
                    continue
                c = left.get(i, n_readers(consumers[i])) - 1
                left[i] = c
                if c == 0:
                    p = producer[i]
                    m = owned.get(id(p))
                    if m is None:
                        m = sum(1 for o in dict.fromkeys(p.output) if o and o not in unread and producer.get(o) is p)
                    owned[id(p)] = m - 1
                    if m == 1:
                        stack.append(p)
        return list(itertools.compress(self.nodes, map(dead.__contains__, map(id, self.nodes))))

    def _live_set(self, limit: int | None = None) -> set[int] | None:
        """The ids of the nodes a graph output is computed from; None past ``limit`` of them."""
        live: set[int] = set()
        removed, producer = self._removed, self.producer
        stack = [producer[o] for o in self.output_names if o in producer]
        while stack:
            n = stack.pop()
            k = id(n)
            if k in live or k in removed:
                continue
            live.add(k)
            if limit is not None and len(live) > limit:
                return None
            for i in self.reads(n):
                p = producer.get(i)
                if p is not None:
                    stack.append(p)
        return live
