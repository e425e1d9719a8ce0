"""Types of a big graph's tensors, by shape inference over only the nodes each one is computed from.

Whole-model shape inference costs seconds on a 100k-node graph, so a model that big does not run it
(``tensor_types.CHEAP_INFERENCE_NODES``). Without it, a tensor the file declares no type for had no type at
all, and a recurrence reading one declined: the per-step slice of a mask (``Gather(mask, t)``) in a long
unrolled chain, a sequence computed by an elementwise prologue. Such a query needs only the tensor's cone:
the nodes back from it to values whose types are known (declared by the file, or inferred by an earlier
query). :class:`ConeTypes` infers that cone alone, on a copy holding small constants' data and the known
types of what it reads, and remembers every type the cone gave, so a node is inferred at most once.

The work is bounded per model and linear in it: the nodes walked (and so inferred) over all queries, with a
fixed cost for each inference, stay under ``budget``: twice the graph's nodes (a long chain asks about each
step's values, a cone of one step each: 1,000 steps of a masked GRU cell spend ~43,000 on 24,000 nodes), and
at least what a model whose whole inference runs costs. No one inference is bigger than such a model: a
query that decides a fold (``one_piece=False``) has a bigger cone inferred in pieces of that size, producers
first; a query that only filters (the default of ``Model.known_type``) gets no type from a cone that does not
fit one piece. A graph with nothing to ask pays nothing. Queries come in the passes' own order, so a model
gets the same answers on every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper

from .rule_types import typed_by_rule
from .protos import has_subgraph
from .tensor_types import CHEAP_INFERENCE_NODES, SKELETON_DATA_BYTES, copy_node_skeleton, type_of

if TYPE_CHECKING:
    from .model import Model

Type = tuple[int, "list | None"]

# what one inference costs beside its nodes (building the copy, the inference's own set-up), in nodes: a graph
# asking about thousands of one-node cones (a value per step of a long chain) spends its budget on them too
CONE_OVERHEAD = 25


class ConeTypes:
    """Inferred types of one model's main-graph tensors, each cone inferred on first need."""

    def __init__(self, model: "Model", budget: int | None = None):
        self.model = model
        # nodes that may still be walked or inferred
        self.budget = max(CHEAP_INFERENCE_NODES, 2 * len(model.graph.nodes)) if budget is None else budget
        self.types: dict[str, Type] = {}
        self.cones = 0  # inferences run (names the dims each one invents)
        # a cone is inferred in pieces of at most this many nodes, producers first, each piece reading the types
        # the pieces before it gave: a copy of a 100k-node cone at once held ~150 MB, and a recurrence behind
        # a 20,000-node prologue was declined when its input's cone was given up on instead
        self.max_cone = CHEAP_INFERENCE_NODES
        self.settled: set[str] = set()  # outputs of nodes already inferred (typed or not), or given up on
        self.too_big: set[str] = set()  # names whose cone does not fit one inference (asked in one piece)
        # names typed by an inference that read a type an edit declared, or one typed so (Model.established_type)
        self.from_edits: set[str] = set()
        # whether a question got less than one inference of its whole cone would give (given up on past the
        # budget or a piece's size, or inferred in pieces, which lose the shape values crossing a cut)
        self.incomplete = False

    def carried_over(self, model: "Model", redefined: list[str]) -> "ConeTypes":
        """The types for ``model``, the next round's view of this one's proto: those inferred here, but for
        the values gone, the ``redefined`` ones (the round's new or rewired nodes' outputs, its removed
        nodes') and every value computed from one of those, whose inferred types may differ now (only
        that downstream is walked, over no more nodes than there are types to keep, 1,000 at least: a small
        fusion before a 100,000-node head would walk the head to keep a few types; then none is kept). The count of cones
        carries over too: the dims a cone invented are named after it, and a new cone must not give another
        dim the same name."""
        g = model.graph
        carried = ConeTypes(model)
        carried.cones = self.cones
        after = g.downstream(redefined, max(len(self.types), 1000))
        if after is None:
            return carried
        retyped = set(redefined).union(*(n.output for n in after))
        carried.types = {k: t for k, t in self.types.items() if k in g.producer and k not in retyped}
        carried.from_edits = {k for k in self.from_edits if k in carried.types}
        return carried

    def type_of(self, name: str, one_piece: bool = False) -> Type | None:
        """The type inference gives ``name``; with ``one_piece``, only if its cone fits one inference (a
        bigger cone is left for a query that needs the answer: see Model.known_type)."""
        if name in self.types:
            return self.types[name]
        if name in self.settled or self.budget <= 0 or (one_piece and name in self.too_big):
            return None
        producer = self.model.graph.producer.get(name)
        if producer is None:  # (an input, a weight, a subgraph's value: what the file declares, or nothing)
            return None
        cone = self._cone(producer, self.max_cone if one_piece else None)
        if cone is None:
            (self.too_big if one_piece else self.settled).add(name)
            self.incomplete = True
            return None
        cone = self._typed_by_rule(cone)
        self.incomplete |= len(cone) > self.max_cone
        for start in range(0, len(cone), self.max_cone):  # (producers first: a piece reads what those before typed)
            self._infer(cone[start:start + self.max_cone])
        return self.types.get(name)

    def _typed_by_rule(self, cone: list[NodeProto]) -> list[NodeProto]:
        """Type the cone's plain float nodes (elementwise ones, matrix products) as inference would
        (:mod:`rnnfuse.rule_types`: a 100,000-node prologue scaling and shifting a recurrence's input took 0.8 s
        of inference; 1,041 cells side by side, each first step's cone inferred); returns the
        nodes left for inference, in order. Each input is read as :meth:`_known` gives it, which is what the
        inference's copy reads (a small weight held whole has its declared type). (From opset 7, where Add and
        the like broadcast as the rule does: every model rnnfuse works on.)"""
        if self.model.opset < 7:
            return cone
        typed, rest = typed_by_rule(cone, self._known, self.model.declared_by_edits, self.from_edits)
        self.types.update(typed)
        self.settled.update(typed)
        return rest

    def _known(self, name: str) -> Type | None:
        t = self.model.declared_type(name)
        if t is not None and t[1] is not None:
            return t
        return self.types.get(name, t)

    def _cone(self, root: NodeProto, limit: int | None = None) -> list[NodeProto] | None:
        """The nodes ``root`` is computed from back to the frontier, producers first; None past the budget or
        past ``limit`` nodes. The walk stops at graph inputs and weights, at values settled, and at values of
        known shape -- but not at a Constant or a shape-like value (int64, rank 0 or 1) whose type is known:
        inference needs their values to size what they shape (``ConstantOfShape(Concat(Shape(x)[0], H))``)."""
        g = self.model.graph
        producer = g.producer
        # (the frontier tested here, inline: a prologue of 100,000 nodes has 200,000 reads, and the method
        # calls of a test each were most of the walk)
        settled, initializers, inputs = self.settled, g.initializers, set(g.input_names)
        declared, types, int64 = self.model.declared_type, self.types, TensorProto.INT64
        order: list[NodeProto] = []
        seen: set[int] = set()
        stack: list[tuple[NodeProto, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            self.budget -= 1
            if self.budget < 0 or (limit is not None and len(seen) > limit):
                return None
            stack.append((node, True))
            for i in node.input:
                p = producer.get(i) if i else None
                if p is None or id(p) in seen or i in settled or i in initializers or i in inputs:
                    continue
                t = declared(i)
                if t is None or t[1] is None:
                    t = types.get(i, t)
                if t is None or t[1] is None or p.op_type == "Constant" or (t[0] == int64 and len(t[1]) <= 1):
                    stack.append((p, False))
        return order

    def _infer(self, cone: list[NodeProto]) -> None:
        self.budget -= CONE_OVERHEAD
        proto = self.model.proto
        m = ModelProto()
        m.ir_version = proto.ir_version
        m.opset_import.extend(proto.opset_import)
        made, from_edits = self._cone_graph(cone, m.graph)  # (built in place: a graph copied in is every node copied twice)
        try:
            m = onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
        except Exception:  # (inference is a convenience: the tensors stay untyped)
            pass
        self.cones += 1
        # (a long chain's values mostly share a few types: each distinct one is read once; every name gets
        # its own list of dims)
        read: dict[bytes, Type | None] = {}
        for vi in m.graph.value_info:
            key = vi.type.SerializeToString()
            if key not in read:
                t = type_of(vi)
                read[key] = self._own_dims(t) if t is not None and t[0] != TensorProto.UNDEFINED else None
            t = read[key]
            if t is not None:
                self.types[vi.name] = (t[0], None if t[1] is None else list(t[1]))
                if from_edits:
                    self.from_edits.add(vi.name)
        self.settled |= made

    def _own_dims(self, t: Type) -> Type:
        """``t`` with the dims inference named itself (``unk__0``...) made this cone's own: every inference
        numbers them from 0 again, and two cones' ``unk__0`` are no one dim."""
        def invented(d) -> bool:  # (a dim an earlier cone named, read here as an input's, is already its own)
            return isinstance(d, str) and d.startswith("unk__") and "@" not in d

        if t[1] is None or not any(invented(d) for d in t[1]):
            return t
        return (t[0], [f"{d}@cone{self.cones}" if invented(d) else d for d in t[1]])

    def _cone_graph(self, cone: list[NodeProto], out: GraphProto) -> tuple[set[str], bool]:
        """Fill ``out`` with the cone's nodes (a node with subgraphs as its skeleton), the small weights they
        read and the known types of the other values they read, as inputs; returns what the nodes compute, and
        whether an input's type is one an edit declared or was inferred from one."""
        g = self.model.graph
        out.name = "cone"
        made = {o for n in cone for o in n.output}
        names: list[str] = []
        for n in cone:
            names += n.input  # (gathered in C, filtered once: a filter per input was half this method)
        read = {i: None for i in dict.fromkeys(names) if i and i not in made}
        # a Constant read from outside the cone (settled by an earlier cone, or in an earlier piece of this one)
        # is copied in, not declared: data propagation must see its value. Declared, its readers are inferred
        # as if it held anything, and onnx's propagation is not sound then: a Slice of a shape with unknown
        # starts passes the whole shape on (2,400 Reshapes to computed shapes were typed rank 100, not 3)
        constants = [p for p in map(g.producer.get, read)
                     if p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx")
                     and p.ByteSize() <= SKELETON_DATA_BYTES]
        for p in constants:
            out.node.append(p)
            del read[p.output[0]]
        if not any(has_subgraph(n) for n in cone):
            out.node.extend(cone)
        else:
            for n in cone:
                copy = out.node.add()
                if has_subgraph(n):
                    copy_node_skeleton(n, copy, SKELETON_DATA_BYTES)
                else:
                    copy.CopyFrom(n)
        from_edits = False
        for name in read:
            w = g.initializers.get(name)
            if w is not None and name not in g.input_names and w.data_location != TensorProto.EXTERNAL and w.ByteSize() <= SKELETON_DATA_BYTES:
                out.initializer.append(w)
                continue
            t = self._known(name)
            if t is not None:
                out.input.append(helper.make_tensor_value_info(name, t[0], t[1]))
                from_edits = from_edits or name in self.model.declared_by_edits or name in self.from_edits
        return made, from_edits
