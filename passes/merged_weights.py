"""A merged op's weights as initializers, where the exporter computed them for each call.

torch's dynamo exporter without its optimizer computes every ``nn.LSTM`` / ``nn.GRU`` call's gate-reordered
weights anew: Slices of the layer's weights at bounds taken from ``Shape(state)``, concatenated and unsqueezed,
about a dozen nodes a weight. The merged op (rnnfuse.passes.step_chains) read the first call's, so the fused
model ran those ~35 nodes at every inference wherever its runtime's load does not fold them itself
(onnxruntime folds some and not others: a per-call head over 7 steps, batch 1, 1 thread, ran 114.8 us with
them, 97.2 us folded; with its graph optimizations off, 113.5 / 98.4 us).

Folded only where that moves the weights instead of copying them: every big initializer those computations
read (the layer's own weights) is read by nothing but the same computations of the ops being merged, which go
with them, and the folded values are no bigger than what goes.
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.builder import Builder
from rnnfuse.cells import native_kind
from rnnfuse.dataflow import SHAPE_READS
from rnnfuse.graph import Graph
from rnnfuse.protos import tensor_nbytes

# an initializer at most this big is no weight moved: left out of the count of what a fold frees
_SMALL_BYTES = 1024
# a folded weight this small is always kept as an initializer (a computed bias of a small layer)
_FREE_BYTES = 1 << 16


def weight_positions(node: NodeProto) -> list[int]:
    """The input positions of a native op's weights (W, R, B and any extra input after the initial states),
    not its sequence, lengths or initial states."""
    kind = native_kind(node)
    skip = ("X", "sequence_lens") + tuple(f"initial_{s}" for s in kind.states)
    return [k for k, name in enumerate(kind.inputs) if name not in skip]


def merged_inputs(g: Graph, ops: list[NodeProto], b: Builder) -> list[str]:
    """The inputs after ``X`` of the op that replaces ``ops`` (each op of the same recurrence, equal weights):
    the first op's, its computed weights replaced by initializers of their values where that moves them (see
    the module)."""
    head = ops[0]
    names = list(head.input[1:])
    computed = [k for k in weight_positions(head)
                if k < len(head.input) and head.input[k] and head.input[k] in g.producer]
    if not computed:
        return names
    values = {k: g.const(head.input[k]) for k in computed}
    if any(v is None or v.ndim == 0 or v.shape[0] != 1 for v in values.values()):
        return names
    # (each op's weights are constants (step_chains merges no other): their cones stop at constants and shapes)
    cone = g.cone([n.input[k] for n in ops for k in weight_positions(n) if k < len(n.input) and n.input[k]],
                  reads=_data_reads)
    freed = _freed_bytes(g, cone, {id(n) for n in ops})
    if freed is None or sum(v.nbytes for v in values.values()) > max(_FREE_BYTES, freed):
        return names
    kind = native_kind(head)
    for k, v in values.items():  # (a native op's weights lead with its directions: [1, ...] here)
        names[k - 1] = b.stacked([v[0]], kind.inputs[k], dtype=v.dtype)
    return names


def _data_reads(n: NodeProto) -> list[str]:
    """What a weight's computation reads as data: not a Shape's or Size's input (a constant the ops fix,
    computed from no value: dynamo reads the state's, and the state is the previous call's output)."""
    return [] if n.op_type in SHAPE_READS else [i for i in n.input if i]


def _freed_bytes(g: Graph, cone: list[NodeProto], members: set[int]) -> int | None:
    """The bytes of the big initializers ``cone`` (producers first) reads, when removing the merged ops
    (``members``) leaves each of them unread: every node computed from one is read by nothing but ``cone``'s
    nodes and ``members`` (and is no graph output), every reader of one is one of those. None when one stays
    read."""
    gone = {id(n) for n in cone} | members
    carriers: set[int] = set()  # cone nodes computed from a big initializer: each must go
    freed, seen = 0, set()
    for n in cone:
        reads = _data_reads(n)
        big = [i for i in reads if i in g.initializers and _nbytes(g, i) > _SMALL_BYTES]
        if not big and not any(id(g.producer.get(i)) in carriers for i in reads):
            continue
        carriers.add(id(n))
        for o in n.output:
            if o and (g.is_graph_output(o) or any(id(u) not in gone for u in g.uses(o))):
                return None
        for i in big:
            if i not in seen:
                seen.add(i)
                if g.is_graph_output(i) or any(id(u) not in gone for u in g.uses(i)):
                    return None
                freed += _nbytes(g, i)
    return freed


def _nbytes(g: Graph, name: str) -> int:
    return tensor_nbytes(g.initializers[name])
