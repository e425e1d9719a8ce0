"""One graph scope's producer and consumer maps, built once in one linear pass, and the queries on them.

Subgraph bodies (Loop, Scan, If) are graphs of their own with a ``parent``; names they capture from outer
scopes count as uses of the capturing node, so dead-code removal and use-replacement stay correct.
:mod:`rnnfuse.graph_edit` adds the edits that keep these maps up to date.
"""

from __future__ import annotations

import collections
import gc
import itertools
from array import array
from typing import TYPE_CHECKING

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, TensorProto

from . import fold
from .deep_walks import fold_deep, folding
from .protos import CONTROL_FLOW, attr, free_names, has_subgraph, node_field, subgraphs
from .removed_nodes import Removed
from .tensor_types import type_of
from .tensor_values import UNREADABLE, constant_value

if TYPE_CHECKING:
    from .model import Model

_EMPTY: frozenset = frozenset()

POS_TIE = 1 << 32  # a position's tie-break (the order nodes were added at one anchor) sits below it


class GraphIndex:
    """One graph scope with its producer/consumer maps and the queries on them (reads only; the edits are
    :class:`~rnnfuse.graph_edit.Graph`, the class every pass works with)."""

    def __init__(self, proto: GraphProto, parent: "GraphIndex | None", model: "Model", owner: NodeProto | None = None):
        self.proto = proto
        self.parent = parent
        self.model = model
        self.owner = owner  # the node whose attribute this graph is (None for the main graph)
        self.nodes: list[NodeProto] = list(proto.node)
        self._pos_from(self.nodes)
        self._seq = itertools.count(1)
        self._removed = Removed()
        self._graveyard: list[NodeProto] = []
        self.initializers: dict[str, TensorProto] = {t.name: t for t in proto.initializer}
        self.input_names = [i.name for i in proto.input]
        self.output_names = [o.name for o in proto.output]
        self._outputs = frozenset(self.output_names)  # (a graph of 1,000 outputs is asked per value)
        self._output_repeats = {k: c for k, c in collections.Counter(self.output_names).items() if c > 1}
        self._inputs = set(self.input_names)
        self.producer: dict[str, NodeProto] = {}
        # value -> its reader, or a list of its readers where it has several (or none: one rewired away). Most
        # values of a chain have one reader: a list each would hold ~90 bytes more a value (108k: 10 MB)
        self.consumers: dict[str, NodeProto | list[NodeProto]] = {}
        self._implicit: dict[int, set[str]] = {}
        self._arrays: dict[str, np.ndarray | None] = {}
        self._scope_runtime: set | None = None  # (a body's: see _runtime)
        # a Slice's inputs -> its bounds, where all are constants (op_args.slice_args_of: asked of each per-step
        # Slice of a trace by several front ends and passes; a name's constant value never changes in a run)
        self.slice_args_memo: dict[tuple, tuple] = {}
        self._subgraph_views: dict[int, GraphIndex] = {}
        # nodes added or rewired (inputs or outputs renamed) since the graph was built or finalized, in edit
        # order: what an incremental pass (Dedupe after a fusion) has to look at again; finalize starts a new list
        self.edited: list[NodeProto] = []
        self._pruned: tuple | None = None  # _state() when the last prune (or finalize) left only live nodes
        self._lost: set[str] | None = set()  # values that lost a reader since then, or since built (Graph.prune)
        # the op-type index (nodes_of) is filled by the same pass, which reads every node's op type anyway
        self._by_op: dict[str, tuple[array, list]] | None = {}  # op type -> (ranks, nodes) (nodes_of)
        self._by_op_next = len(self.nodes)
        self._edits = 0  # index edits so far (what the index pass found stays true while this is unchanged)
        self._input_sorted = self._index_all(self.nodes, self._by_op)

    def nodes_and_removed(self):  # (those removed since the last finalize too: their names stay taken until then)
        return itertools.chain(self.nodes, self._graveyard)

    # -- positions ---------------------------------------------------------------------------------------
    def _pos_from(self, nodes: list[NodeProto]) -> None:
        """Positions are those of ``nodes`` as they are now (later appends are placed by ``add_node``); the
        index is built the first time someone asks, so a graph nothing is added to or sorted never pays for it."""
        self._pos_index: tuple[np.ndarray, np.ndarray] | None = None
        self._pos_base, self._pos_len = nodes, len(nodes)
        self._pos_added: dict[int, int] = {}  # id of a node added since -> its sort key

    def _sorted_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(the base nodes' ids sorted, their positions in that order): a position is found by binary
        search. Two arrays of 8 bytes a node, where a dict of id -> position held ~110 bytes a node (12 MB
        at 108k nodes) in int objects and hash slots."""
        if self._pos_index is None:
            n = self._pos_len  # (the list may have grown since, by add_node)
            ids = np.fromiter(map(id, itertools.islice(self._pos_base, n)), dtype=np.int64, count=n)
            order = np.argsort(ids, kind="stable")
            self._pos_index = (ids[order], order)
        return self._pos_index

    def position(self, node: NodeProto) -> int | None:
        """The node's sort key in graph order (position * POS_TIE + tie-break), None for a node this graph
        never held: the order :meth:`toposort` keeps among ready nodes."""
        k = id(node)
        p = self._pos_added.get(k)
        if p is not None:
            return p
        ids, order = self._sorted_ids()
        i = int(ids.searchsorted(k))  # (the method: the module function wraps it, 1.7 against 0.7 µs)
        return int(order[i]) * POS_TIE if i < len(ids) and int(ids[i]) == k else None

    def place(self, node: NodeProto, key: int) -> None:  # (an added node's sort key)
        self._pos_added[id(node)] = key

    def in_position_order(self, nodes) -> list[NodeProto]:
        """``nodes`` sorted by their positions (keys are unique: any sort gives this order); a node this
        graph never held raises KeyError."""
        nodes = list(nodes)
        if len(nodes) < 16:
            return sorted(nodes, key=self._key)
        ids, order = self._sorted_ids()
        want = np.fromiter(map(id, nodes), dtype=np.int64, count=len(nodes))
        at = np.minimum(np.searchsorted(ids, want), max(len(ids) - 1, 0))
        keys = order[at] * POS_TIE if len(ids) else np.zeros(len(nodes), dtype=np.int64)
        missing = (ids[at] != want) if len(ids) else np.ones(len(nodes), dtype=bool)
        for i in np.flatnonzero(missing).tolist():
            keys[i] = self._pos_added[id(nodes[i])]
        return [nodes[i] for i in np.argsort(keys, kind="stable").tolist()]

    def _key(self, node: NodeProto) -> int:
        p = self.position(node)
        if p is None:
            raise KeyError(id(node))
        return p

    def nodes_of(self, *op_types: str) -> list[NodeProto]:
        """The live nodes of these op types, in node-list order (nodes added later after them, in the order
        they were added). Filled while the graph is indexed (after ``finalize``: on first use) and kept up
        to date by ``add_node``: the passes that look for Loops, Ifs, Casts or native ops in a 100k-node graph
        that has none read no node."""
        by_op = self._by_op
        if by_op is None:
            by_op = self._by_op = {}
            for i, n in enumerate(self.nodes):
                e = by_op.get(n.op_type)
                if e is None:
                    by_op[n.op_type] = (array("q", (i,)), [n])
                else:
                    e[0].append(i)
                    e[1].append(n)
            self._by_op_next = len(self.nodes)
        found = [by_op[op] for op in op_types if op in by_op]
        if not found:
            return []
        if len(found) == 1:
            nodes = found[0][1]
        else:  # (ranks are unique: the order is the one the ranks give, sorted in C: 0.04 s -> 0.01 s at 100k)
            ranks = np.concatenate([np.frombuffer(e[0], dtype=np.int64) for e in found])
            every = list(itertools.chain.from_iterable(e[1] for e in found))
            nodes = [every[i] for i in np.argsort(ranks, kind="stable").tolist()]
        return self._removed.keep(nodes)

    def _by_op_add(self, n: NodeProto) -> None:
        if self._by_op is not None:
            e = self._by_op.get(n.op_type)
            if e is None:
                e = self._by_op[n.op_type] = (array("q"), [])
            e[0].append(self._by_op_next)
            e[1].append(n)
            self._by_op_next += 1

    # -- indexing ----------------------------------------------------------------------------------------
    def implicit_inputs(self, node: NodeProto) -> set[str]:
        if not has_subgraph(node):
            return _EMPTY
        key = id(node)
        if key not in self._implicit:
            free: set[str] = set()
            for sg in subgraphs(node):
                free |= free_names(sg)
            self._implicit[key] = free
        return self._implicit[key]

    def _index(self, n: NodeProto) -> None:
        self.owners_complete = False  # (an edit: who produces what is no longer known from the counts)
        self._edits += 1
        producer = self.producer
        for o in n.output:
            if o:
                producer[o] = n
        self._index_inputs(n, has_subgraph(n))

    def _index_all(self, nodes: list[NodeProto], by_op: dict | None = None) -> bool:
        """``_index`` for many nodes: one loop, each node's fields read once (``by_op``: also the op-type
        index of ``nodes_of``, ``nodes`` being the whole node list). Returns whether the nodes are in
        topological order (no node reads a value a later node produces).

        Reading a node's fields is most of the cost (protobuf makes a new string per name per read), so each is
        read once; a name read before is stored as the string the producer map holds (one string per name), and
        the cyclic garbage collector (it would scan the whole heap several times while a 100k-node index of
        objects without cycles is built) waits until the loop is done."""
        producer, consumers, get = self.producer, self.consumers, self.consumers.get
        had, assigned, lonely = len(producer), 0, 0
        early: list[str] = []  # names read before any node produced them (inputs, initializers, or disorder)
        canon: dict[str, str] = {}
        same = canon.get
        control = CONTROL_FLOW
        consts = set(self.initializers)  # (and, as the loop goes, Constants' outputs)
        const_only: list[NodeProto] = []  # nodes reading constants and nothing else (see const_only_readers)
        other_domain = False  # whether a node of another domain than ONNX's was seen (see op_type_counts)
        collecting = gc.isenabled()
        gc.disable()
        try:
            for rank, n in enumerate(nodes):
                before = len(producer)
                outs = n.output[:]  # (a slice: protobuf builds the list in one call, faster than iterating)
                for o in outs:
                    if o:
                        producer[o] = n
                        canon[o] = o
                        assigned += 1
                if len(producer) == before:
                    lonely += 1
                op = n.op_type
                if by_op is not None:
                    e = by_op.get(op) or by_op.setdefault(op, (array("q"), []))
                    e[0].append(rank)
                    e[1].append(n)
                if op == "Constant":
                    consts.update(outs)
                if op not in control and n.domain not in ("", "ai.onnx"):
                    other_domain = True
                    holds = has_subgraph(n)
                else:
                    holds = op in control
                if holds:
                    self._index_inputs(n)  # (its subgraphs' captures too: those read before they are produced count)
                    early.extend(i for i in itertools.chain(n.input, self.implicit_inputs(n)) if i and i not in producer)
                    ins = [i for i in n.input[:] if i]
                    if ins and consts.issuperset(ins):
                        const_only.append(n)
                    continue
                only = 0  # 1: every name read so far is a constant; -1: one is not
                # (a Constant reads nothing: its empty input list is not read, see protos.node_field)
                for i in n.input[:] if op != "Constant" else node_field(n, "input"):
                    if i:
                        if only >= 0:
                            only = 1 if i in consts else -1
                        lst = get(i)
                        if lst is None:
                            consumers[same(i, i)] = n
                        elif lst is n or (type(lst) is list and lst[-1] is n):
                            continue  # (a name a node reads twice counts once: only n adds itself here)
                        elif type(lst) is list:
                            lst.append(n)
                        else:
                            consumers[i] = [lst, n]  # (the key stays the string the dict holds)
                        if i not in producer:
                            early.append(i)
                if only == 1:
                    const_only.append(n)
        finally:
            if collecting:
                gc.enable()
        # every node produces a name no other node produces (what _dead_nodes' proof from the indices needs)
        self.owners_complete = lonely == 0 and assigned == len(producer) - had
        in_order = not any(i in producer for i in early)
        # (in order, every Constant was seen before its readers: the list is exact until the next edit)
        self._const_only = (self._edits, const_only if in_order else None)
        self._as_read = (self._edits, nodes, not other_domain)
        return in_order

    def _index_inputs(self, n: NodeProto, captures: bool = True) -> None:
        """n as a consumer of each value it reads once: its inputs and, with ``captures``, what its subgraphs
        read from outside them."""
        ins = itertools.chain(n.input, sorted(self.implicit_inputs(n))) if captures else n.input
        add = self._add_reader
        for i in dict.fromkeys(ins):
            if i:
                add(i, n)

    def _add_reader(self, name: str, n: NodeProto) -> None:
        """``n`` at the end of ``name``'s readers (see ``consumers``: one reader, or a list; a list emptied by
        removals counts as none)."""
        consumers = self.consumers
        lst = consumers.get(name)
        if lst is None or (type(lst) is list and not lst):
            consumers[name] = n
        elif type(lst) is list:
            lst.append(n)
        else:
            consumers[name] = [lst, n]

    def _unindex(self, n: NodeProto, defer: set | None = None) -> None:
        """``defer``: the long reader lists (64+) of a removed ``n`` are not filtered but named there."""
        self.owners_complete = False
        self._edits += 1
        for o in n.output:
            if o and self.producer.get(o) is n:
                del self.producer[o]
        consumers = self.consumers
        for i in set(n.input) | self.implicit_inputs(n):
            lst = consumers.get(i)
            if type(lst) is list:
                if defer is not None and len(lst) >= 64:
                    defer.add(i)
                elif lst:
                    lst[:] = [c for c in lst if c is not n]
            elif lst is n:
                consumers[i] = []  # (the name stays known as read, by nothing now, as a list emptied so)

    def subgraph(self, node: NodeProto, name: str = "body") -> "GraphIndex":
        """The graph view (of this class) of a node's graph attribute (created once per node)."""
        key = id(node)
        if key not in self._subgraph_views:
            g = next(a.g for a in node.attribute if a.name == name and a.type == AttributeProto.GRAPH)
            self._subgraph_views[key] = type(self)(g, self, self.model, owner=node)
        return self._subgraph_views[key]

    def local_shape(self, name: str) -> list | None:
        """The shape this graph itself declares for ``name`` (its inputs, outputs, value_info).

        Sibling subgraphs may reuse names, so a body's own declarations beat the model-wide map."""
        t = self.local_type(name)
        return t[1] if t else None

    def local_type(self, name: str) -> tuple[int, list | None] | None:
        """(element type, shape) as this graph itself declares them for ``name`` (see :meth:`local_shape`)."""
        if not hasattr(self, "_local_types"):
            self._local_types = {}
            for vi in itertools.chain(self.proto.input, self.proto.output, self.proto.value_info):
                t = type_of(vi)
                if t is not None:
                    self._local_types[vi.name] = t
        return self._local_types.get(name)

    def op_type_counts(self) -> tuple[dict[str, int], list[NodeProto]] | None:
        """(op type -> how many nodes, in order of first appearance; the control-flow nodes, whose graphs
        hold more, in node order) from the op-type index, while the node list is its proto's as the index
        pass read it (no edit since) and holds no node of another domain; else None (count from the proto)."""
        if not self._as_loaded():
            return None
        return {op: len(e[1]) for op, e in self._by_op.items()}, self.nodes_of(*CONTROL_FLOW)

    def nodes_as_loaded(self, *op_types: str) -> list[NodeProto] | None:
        """The nodes of these op types in node order, from the op-type index, under the condition of
        :meth:`op_type_counts`; else None (read the proto's nodes)."""
        return self.nodes_of(*op_types) if self._as_loaded() else None

    def _as_loaded(self) -> bool:
        """Whether the node list is its proto's as the index pass read it (no edit since), every node of
        ONNX's domain."""
        edits, nodes, onnx_only = self._as_read
        return onnx_only and edits == self._edits and nodes is self.nodes and self._by_op is not None and \
            len(nodes) == len(self.proto.node)

    def const_only_readers(self) -> list[NodeProto] | None:
        """The nodes that read at least one constant (an initializer or a Constant's output) and nothing
        else, as the index pass found them, while no edit has happened since and the pass could tell (every
        Constant before its readers); else None: the caller looks for itself."""
        edits, found = self._const_only
        return list(found) if found is not None and edits == self._edits else None

    def release_arrays(self) -> None:
        """Forget the cached constant values in every scope of this graph's model view (:meth:`const` reads
        them again from their tensors when asked), and let the kernel drop the resident pages of memory-mapped
        weights (read again from the page cache when needed). Called once the passes are done reading values
        (before a validation run, at the end of a round): held on, every weight of a weight-heavy model would
        sit in memory twice (the proto's bytes and the array), and an unrolled chain's per-step Constants
        (18,000 small arrays at 6,000 steps: 4 MB) would stay through its validation and commit."""
        g = self
        while g.parent is not None:
            g = g.parent
        g._release_arrays()
        self.model.release_pages()

    def _release_arrays(self) -> None:
        self._arrays = {}
        self._scope_runtime = None  # (the round's edits may have given a body new values)
        for sub in self._subgraph_views.values():
            sub._release_arrays()

    # -- queries -----------------------------------------------------------------------------------------
    def alive(self, node: NodeProto) -> bool:
        return id(node) not in self._removed

    def live_nodes(self) -> list[NodeProto]:
        return self._removed.keep(self.nodes)

    def is_graph_output(self, name: str) -> bool:
        return name in self._outputs

    def is_graph_input(self, name: str) -> bool:
        return name in self._inputs and name not in self.initializers

    def defines(self, name: str) -> bool:
        return name in self.producer or name in self.initializers or name in self._inputs

    def scope_of(self, name: str) -> "GraphIndex | None":
        g: GraphIndex | None = self
        while g is not None:
            if g.defines(name):
                return g
            g = g.parent
        return None

    def uses(self, name: str) -> list[NodeProto]:
        """The nodes reading ``name`` (a value's own list where it has several readers: not to be changed)."""
        v = self.consumers.get(name)
        return [] if v is None else v if type(v) is list else [v]

    def n_uses(self, name: str) -> int:
        return n_readers(self.consumers.get(name)) + (self._output_repeats.get(name, 1) if name in self._outputs else 0)

    def const(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is constant (initializer, Constant, or foldable from constants)."""
        if not name:
            return None
        arrays = self._arrays
        if name in arrays:  # (computed for this scope before: this scope defines it)
            return arrays[name]
        if name in self.producer and name in self._runtime():  # (else a fold walked back through every value)
            return None  # computed from an input's values: no constant
        g = self.scope_of(name)
        if g is None:
            return None
        return fold_deep(GraphIndex._const_local, g, name)

    def _runtime(self) -> "set | frozenset":
        """The values of this scope computed from its inputs' values (:func:`rnnfuse.dataflow.runtime_values`
        for the main graph; for a body, from its own inputs: the iteration number, the carried states, the
        scanned slices, which differ per iteration). One walk a scope, kept for the round: a Loop body's
        100,000-op head was folded back node by node (60 us each) to learn it is not constant."""
        if self.parent is None:
            runtime = self.model.facts.runtime
            if runtime is not None:
                return runtime  # (asked per constant query: no import on this path)
            from .dataflow import runtime_values  # (dataflow's walks build on the graph index)

            return runtime_values(self)
        if self._scope_runtime is None:
            from .dataflow import values_computed_from

            self._scope_runtime = values_computed_from(self, self.input_names)
        return self._scope_runtime

    def _const_local(self, name: str) -> np.ndarray | None:
        """The value of ``name``, defined in this scope, folded here (through :func:`fold_deep`)."""
        if name in self._arrays:
            return self._arrays[name]
        p = self.producer.get(name) if name not in self.initializers else None
        val = constant_value(p, self.model) if p is not None and p.op_type == "Constant" else None
        if type(val) is np.ndarray:  # (the common Constant: read, it reads nothing: no depth count or cycle guard)
            self._arrays[name] = val
            return val
        with folding(self, self._arrays, name):
            if name in self.initializers:
                if name not in self._inputs:  # an initializer that is also an input can be overridden
                    val = self.model.tensor_array(self.initializers[name])
            elif p is not None:
                if val is UNREADABLE:
                    val = None
                elif val is None:
                    val = fold.fold_output(self, p, name)
            self._arrays[name] = val
        return val

    def fill_value(self, name: str) -> float | None:
        """If ``name`` is a tensor filled with one value (of any, possibly dynamic, shape), that value."""
        g = self.scope_of(name)
        n = g.producer.get(name) if g is not None else None
        # (read off the node before any fold: folding ConstantOfShape(Shape(y)) infers y's whole cone's types)
        if n is not None and n.op_type == "ConstantOfShape":
            v = attr(n, "value")
            return 0.0 if v is None else float(np.asarray(v).ravel()[0])
        if n is not None and n.op_type == "Expand":
            return g.fill_value(n.input[0])
        c = self.const(name)
        if c is not None:
            flat = np.asarray(c).ravel()
            if flat.size and np.all(flat == flat[0]):
                return float(flat[0])
            return None
        if n is None:
            return None
        if n.op_type in ("Identity", "Cast", "Slice", "Split", "Squeeze", "Unsqueeze", "Reshape", "Transpose",
                         "Flatten") and n.input:  # (a piece or a view of a fill is that fill)
            return g.fill_value(n.input[0])
        if n.op_type in ("Mul",):
            a, b = g.fill_value(n.input[0]), g.fill_value(n.input[1])
            if a == 0.0 or b == 0.0:
                return 0.0
        return None


def n_readers(entry) -> int:
    """How many readers a consumers entry holds (a node, a list of them, or None)."""
    return 0 if entry is None else len(entry) if type(entry) is list else 1
