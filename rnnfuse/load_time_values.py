"""Which values of a model onnxruntime's load may know the contents of, not only the type.

onnxruntime's session set-up infers every node's output type, and for some ops it reads an input's contents
to do so: a Reshape's target, an Expand's shape, a Slice's bounds. It knows those contents where they are
constants, or computed at load time from shapes and constants (a ``Shape``'s entries gathered, unsqueezed,
concatenated; cast to a float and back). A part of the model (the do-no-harm guard's changed region, a piece
of a big model, a cone inferred alone) that takes such a value as a typed input hides those contents from its
own inference, and may accept what the whole model's load refuses. So such a value is not cut at: the nodes
computing it go along with it.

A value is taken for one of those when its type may hold shape values (:func:`tensor_types.may_carry_shape_values`:
a small numeric tensor) and it is computed from shapes and constants alone, through any ops (also those whose
contents the load does not follow: the nodes computing it go along, which only makes the part bigger). A value
computed from a graph input's contents (a runtime value), from a node holding subgraphs (no load computes
through control flow) or from a random op is not one: no load knows it.

What is not covered: onnxruntime's load follows fewer ops than ONNX inference with data propagation (not an
``Add`` of a shape, say), so a value ONNX types alike in the input and the rewritten model may be known to one
load and not the other; the guard compares ONNX's types. In such a case the input's inference already fails
where the rewritten model's load does (it runs to an error, the rewritten model does not load).
"""

from __future__ import annotations

from onnx import GraphProto, NodeProto

from .dataflow import post_order
from .protos import fixed_initializers, has_subgraph
from .tensor_types import may_carry_shape_values

FROM_SHAPES = ("Shape", "Size", "Constant")


def from_load_time(n: NodeProto, reads: list[str], at_load: set[str], constants: set[str]) -> bool:
    """Whether ``n``'s outputs are computed at load time (see :class:`LoadTimeValues`) given which of the
    values it reads are (``at_load``: those computed at load, ``constants``: initializers no graph input
    overrides); ``reads``: its inputs and captures (protos.reads_of)."""
    if n.op_type in FROM_SHAPES and n.domain in ("", "ai.onnx"):
        return True
    names = [x for x in reads if x]
    return bool(names) and all(x in at_load or x in constants for x in names) and not has_subgraph(n)


class LoadTimeValues:
    """The values of one graph computed at load time (see the module), each decided once: ``nodes`` and
    ``producer`` (value -> its producer's position) are the graph's."""

    def __init__(self, graph: GraphProto, nodes: list[NodeProto], producer: dict[str, int]):
        self.nodes, self.producer = nodes, producer
        self.constants = fixed_initializers(graph)  # (one a graph input may override is runtime data)
        self.known: dict[str, bool] = {}

    def carries(self, name: str, serialized_type: bytes | None) -> bool:
        """Whether ``name``, of this type (None: unknown), may hold contents the load knows."""
        return (serialized_type is None or may_carry_shape_values(serialized_type)) and self.at_load(name)

    def at_load(self, name: str) -> bool:
        """Whether ``name`` is computed from shapes and constants alone (see the module): one walk back over
        what it is computed from, each value decided once for all questions."""
        return post_order(name, self.known, self._open, self._close)

    def _open(self, v: str) -> list[str] | None:
        """What ``v``'s producer reads, each to be decided first; None when ``v`` is decided without them
        (recorded)."""
        i = self.producer.get(v)
        if i is None:  # (a graph input, runtime data; an initializer, a constant)
            self.known[v] = v in self.constants
            return None
        n = self.nodes[i]
        if n.op_type in FROM_SHAPES and n.domain in ("", "ai.onnx"):
            self.known[v] = True
            return None
        reads = [x for x in n.input if x]
        if has_subgraph(n) or not reads:  # (no load computes through control flow, nor a random op's values)
            self.known[v] = False
            return None
        return reads

    def _close(self, v: str) -> bool:
        return all(self.known[x] for x in self.nodes[self.producer[v]].input if x)
