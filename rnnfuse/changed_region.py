"""The part of a rewritten model that differs from its input, as a model of its own.

The do-no-harm guard (:mod:`rnnfuse.guard`) asks whether onnxruntime loads the rewritten model. Creating a
session costs onnxruntime more than linear time in the nodes (onnxruntime 1.32, one thread, optimizations
off: an elementwise chain of 25,000 / 50,000 / 100,000 nodes loads in 1.4 / 3.9 / 13 s), and for a big
model with a small fusion (a recurrence among 100,000 other nodes) that one load was most of the run.

What can make the rewritten model fail to load where its input loaded lies in the nodes the run changed and
in the nodes a changed *type* reaches. Every other node is one of the input's nodes, field for field, reading
values defined as they were or of the types they had, and onnxruntime decides whether it takes a node (its
kernel, its type and shape inference) from the node and the types it reads. The region is therefore: the
nodes not found among the input's (equal field for field, or but for reading the same values under the names
the clean-ups gave them: rnnfuse.same_values), plus each unchanged node reading a value whose definition
changed (a changed producer, a changed initializer or declared type) unless ONNX shape inference gives that
value the same known type in both models (a changed constant is followed whatever its type: a reader's
inference may read its value, and so is a value whose contents inference propagates, a Shape's entries); the
outputs of a node taken in are followed in turn. What the region reads from outside becomes its typed graph
inputs (initializers and Constant nodes copied; the nodes computing a value whose contents inference
propagates are taken in, back to values that carry none), and everything it computes that is read outside
it, or not read at all, its outputs, so onnxruntime keeps every node of it.

The region is checked as a model of its own, by onnx.checker and onnxruntime; what neither can see from it is
the wiring of the whole graph around it (a name defined twice, a value read before it is computed, an
output nothing computes), which :func:`wiring_error` checks in one pass.

Where the region cannot stand alone (a value it reads has no type ONNX inference can tell; the graph's
interface, IR version, opsets or functions changed; over 64 MB of weights held in memory, which inference
would copy) or is not much smaller than the model, :func:`region_model` returns None and the guard loads the
whole model as before. Weights stored as external data (a big file's, lent by rnnfuse.model_io) are no
obstacle: the region is loaded from a copy whose big weights read zeros, as the whole model would be.
"""

from __future__ import annotations

from typing import Callable

from onnx import ModelProto, NodeProto, TensorProto

from . import region_types
from .model_parts import Frame, part_model, split_constants
from .load_time_values import FROM_SHAPES, from_load_time
from .protos import reads_of
from .region_types import MAX_CONE_SHARE, Established, InferredTypes, established_types, same_known_type
from .same_values import SameValues, first_output

# below this many nodes onnxruntime loads a whole model in well under a second: the guard loads it whole
SCOPED_NODES = 10_000
# a region holding more than this share of the model's nodes saves too little to be worth building
MAX_REGION_SHARE = 0.5
# ONNX shape inference serialises the model it is given: weights held in memory beyond this are not copied
# for it (the guard loads such a model whole, from a copy without its weights: rnnfuse.check_session)
MAX_INLINE_BYTES = 64 << 20
# initializers up to this size are compared by value (a Reshape's target drives inference); beyond, by
# type and dims (weights, whose values no shape inference reads)
COMPARED_BY_VALUE_BYTES = 1 << 16


class NodeScan:
    """One pass over a model's main-graph nodes, what the guard's questions about them need: the position of
    each value's producer and of its readers (inputs and captures, protos.reads_of), and the first fault in
    their wiring (:func:`wiring_error`). Protobuf makes new strings at every read of a
    node's fields: the region's maps and the wiring check read a 100,000-node graph four times over.
    ``computed_at_load``: the values computed from shapes and constants alone, through nodes without
    subgraphs (what rnnfuse.load_time_values decides one by one, here in the scan's one forward pass, its
    nodes being in order once the wiring is sound): where the guard cuts a model into pieces (load_in_pieces)."""

    def __init__(self, model: ModelProto):
        g = model.graph
        self.nodes: list[NodeProto] = list(g.node)
        self.producer: dict[str, int] = {}  # value -> the position of its (last) producer
        self.readers: dict[str, list[int]] = {}  # value -> the positions of the nodes reading it, in order
        self.fault: str | None = None
        self.computed_at_load: set[str] = set()
        # the names defined outside the nodes: graph inputs and initializers (each named once in its field:
        # the checker refuses a second initializer of a name, which a region copying one of them would hide)
        producer, readers, fault = self.producer, self.readers, None
        inputs, weights = [v.name for v in g.input], [t.name for t in g.initializer]
        self.outer = outer = set(inputs) | set(weights)
        for what, names in (("graph input", inputs), ("initializer", weights)):
            if fault is None and len(set(names)) != len(names):
                seen: set[str] = set()
                twice = next(name for name in names if name in seen or seen.add(name))
                fault = f"two {what}s are named {twice!r}"
        named: set[str] = set()  # (onnxruntime refuses two nodes of one name; the checker does not)
        at_load, constants = self.computed_at_load, set(weights) - set(inputs)
        for i, n in enumerate(self.nodes):
            if n.name:
                if fault is None and n.name in named:
                    fault = f"two nodes are named {n.name!r}"
                named.add(n.name)
            reads = reads_of(n)
            for name in reads:
                if not name:
                    continue
                if fault is None and name not in producer and name not in outer:
                    fault = f"{n.op_type} node {n.name!r} reads {name!r} before it is defined"
                lst = readers.get(name)
                if lst is None:
                    readers[name] = [i]
                elif lst[-1] != i:  # (a name a node reads twice: one entry)
                    lst.append(i)
            for o in n.output:
                if o:
                    if fault is None and (o in producer or o in outer):
                        fault = f"{o!r} is defined twice"
                    producer[o] = i
            first = reads[0] if reads else ""
            if (first in at_load or first in constants or n.op_type in FROM_SHAPES) and from_load_time(n, reads, at_load, constants):
                at_load.update(o for o in n.output if o)  # (the first read decides most nodes: data, not shapes)
        if fault is None:
            lost = next((v.name for v in g.output if v.name not in producer and v.name not in outer), None)
            fault = None if lost is None else f"graph output {lost!r} is not defined"
        self.fault = fault


def region_model(after: ModelProto, before: ModelProto, established: Established | None = None,
                 scan: NodeScan | None = None) -> ModelProto | None:
    """The changed region of ``after`` (the rewritten model) against ``before`` (its input), as a model
    onnxruntime loads on its own; None when the whole model must be loaded instead (see the module).

    ``established``: the types the run already inferred for values (name -> (elem_type, dims) or None; it
    infers nothing new), taken for the values both models type alike, where inference stops. ONNX inference
    over the same unchanged nodes from the same inputs gave them: the optimizer typed a 100,000-node
    prologue to analyse the recurrence behind it, and the guard need not infer it again (0.8 s). ``scan``:
    ``after``'s :class:`NodeScan`, when the caller has it."""
    if not _same_frame(after, before) or inline_bytes(after) + inline_bytes(before) > MAX_INLINE_BYTES:
        return None
    scan = NodeScan(after) if scan is None else scan
    nodes, producer_of, readers = scan.nodes, scan.producer, scan.readers
    limit = int(MAX_REGION_SHARE * len(nodes))
    changed = _changed_nodes(nodes, before)
    if len(changed) > limit:
        return None
    region = set(changed)
    # values whose definition changed: produced by a changed node, or an initializer or declared type that
    # is not what it was
    redefined = {o for i in changed for o in nodes[i].output if o}
    # constants whose definition changed are followed whatever their type: a reader's inference may read their
    # value (a Reshape's target), which no type comparison sees
    by_value = _changed_initializers(after, before)
    by_value |= {o for i in changed if nodes[i].op_type == "Constant" for o in nodes[i].output if o}
    redefined |= by_value
    declared_after, declared_before = _declared(after.graph.value_info), _declared(before.graph.value_info)
    redeclared = set()
    for name in declared_after.keys() | declared_before.keys():
        if declared_after.get(name) != declared_before.get(name):
            redeclared.add(name)
            if name in producer_of:  # (the declaration is checked against what its producer computes)
                region.add(producer_of[name])
    redefined |= redeclared
    # (values both models compute from the same nodes, inputs and declarations are typed alike: inference
    # stops at those the run typed, and the input's stops at those the rewritten model's inference typed, so
    # a big unchanged upstream, a prologue of 100,000 nodes, is inferred at most once, not once per model)
    alike = _typed_alike(scan, redefined)
    known = established_types(established)
    types_after = InferredTypes(after, lambda name: known(name) if alike(name) else None, nodes, producer_of)
    # (a rewrite that removed over half the input: the cones of the values it replaced are most of it)
    removed = len(before.graph.node) - (len(nodes) - len(changed))
    types_before = InferredTypes(before, lambda name: (types_after.types.get(name) or known(name)) if alike(name) else None,
                                 whole=removed > MAX_CONE_SHARE * len(before.graph.node))
    wave = [name for name in redefined if any(r not in region for r in readers.get(name, ()))]
    seen = set(wave)
    while wave:  # (in waves: the values of one wave are typed by one inference per model)
        wave = [name for name in wave if any(r not in region for r in readers.get(name, ()))]
        if types_after.ask(wave) is None or types_before.ask(wave) is None:
            return None
        next_wave = []
        for name in wave:
            outside = [r for r in readers.get(name, ()) if r not in region]
            if not outside:
                continue
            t = types_after.types.get(name)
            # (a value whose contents the load knows, a Reshape's target, is followed like a constant: the same
            # type may hold other contents)
            if name not in by_value and not types_after.load_time.carries(name, t) and same_known_type(t, types_before.types.get(name)):
                continue  # the readers see the type they saw: the change stops here
            for r in outside:
                region.add(r)
                for o in nodes[r].output:
                    if o and o not in seen:
                        seen.add(o)
                        next_wave.append(o)
            if len(region) > limit:
                return None
        wave = next_wave
    if not _with_shape_sources(scan, region, types_after, limit):
        return None
    return _standalone(after, [nodes[i] for i in sorted(region)], scan, region, types_after)


def _with_shape_sources(scan: NodeScan, region: set[int], types: InferredTypes, limit: int) -> bool:
    """Add to ``region`` the nodes computing the values it reads whose contents the load knows (a Shape, a
    Gather or Concat of its entries: rnnfuse.load_time_values), and theirs in turn, back to values that carry
    none (a typed input would hide those contents from the region's inference, which would
    accept what the whole model's refuses). A torch export's blocks assemble every Reshape's target from the
    scalars of a Shape: a fusion beside them, whose clean-ups renamed what their Concats read, was judged by
    loading the whole model. False when a read has no type inference can tell, or the region grows past
    ``limit``."""
    nodes, producer = scan.nodes, scan.producer
    produced = {o for i in region for o in nodes[i].output if o}
    pending = list(dict.fromkeys(x for i in region for x in reads_of(nodes[i]) if x and x not in produced))
    while pending:
        _, outside = split_constants(scan, pending)  # (a Constant node is copied into the region as it is)
        computed = [name for name in outside if name in producer]  # (not a graph input or an initializer)
        if computed and (types.ask(computed) is None or any(name not in types.types for name in computed)):
            return False
        pending = []
        for name in computed:
            i = producer[name]
            if i in region or not types.load_time.carries(name, types.types[name]):
                continue
            region.add(i)
            produced.update(o for o in nodes[i].output if o)
            pending.extend(x for x in reads_of(nodes[i]) if x and x not in produced)
        if len(region) > limit:
            return False
        pending = list(dict.fromkeys(x for x in pending if x not in produced))
    return True


def _changed_nodes(nodes: list[NodeProto], before: ModelProto) -> list[int]:
    """The positions of ``nodes`` that are not one of ``before``'s main-graph nodes, field for field
    (protobuf's message equality, in C). A node is compared with the input's node of the same outputs (a value
    has one producer): neither model's nodes are serialised or hashed (a torch dynamo export's node carries
    ~400 bytes of metadata: the digests of both models' nodes took 0.52 s at 100,000 nodes, this 0.3 s, and
    the bytes themselves, held at once, 57 MB). Equality and the bytes differ only on floats: a NaN attribute
    is unequal to itself (the node counts as changed: the region grows), and -0.0 equals 0.0 (a zero's sign
    decides nothing about whether a model loads). A node equal to the input's but for reading the same values
    under other names (a merged duplicate's, a merged constant's: rnnfuse.same_values) is not changed: 6,008
    readers of a torch trace's merged shape arithmetic were, and made a region of 10,807 nodes."""
    same = SameValues(before)
    old = same.by_first_output.get  # (the other outputs are compared by the equality, or by reads_alike)
    changed = [(i, o) for i, n in enumerate(nodes) if (o := old(next(iter(n.output), "") or first_output(n))) != n]
    # (a node reading the values its input's node read, under the names clean-ups gave them, is unchanged; one
    # reading what a new node computes, a fused op's output, is not: no comparison, no index of the input)
    fresh = {x for i, o in changed if o is None for x in nodes[i].output if x}
    return [i for i, o in changed
            if o is None or not fresh.isdisjoint(nodes[i].input) or not same.reads_alike(nodes[i], o)]


def wiring_error(model: ModelProto, scan: NodeScan | None = None) -> str | None:
    """What is wrong with how the main graph's nodes connect, as onnx.checker would find it in the whole
    model and not in a region of it: a value defined twice (by two nodes, or by a node and a graph input or
    initializer), a value read (by a node or captured by its subgraphs) before anything defines it, a graph
    output nothing defines (the first such fault in node order). None when the wiring is sound. One pass over
    the nodes (:class:`NodeScan`; ``scan``: the caller's, when it has one)."""
    return (NodeScan(model) if scan is None else scan).fault


def _typed_alike(scan: NodeScan, redefined: set[str]) -> Callable[[str], bool]:
    """Whether ONNX inference types a value alike in the rewritten model (``scan``'s) and in its input: a
    graph input or initializer, or an output of an unchanged node (see _changed_nodes) whose
    reads are such values (its subgraphs' captures too), and not one of the ``redefined`` (the changed
    nodes' outputs; another declared type, another small constant), which their readers do not see alike
    either. Asked as its complement: what the redefined values reach, walked forward over the scan's readers,
    is the only part not alike: a fusion at the end of a 100,000-node prologue walks what follows it, not
    the prologue. That holds in a graph in order whose every read is defined, which the guard asks of the
    whole graph too (wiring_error): elsewhere the region is not used. The graph's inputs are the same in
    both models (see _same_frame)."""
    nodes, readers, producer, outer = scan.nodes, scan.readers, scan.producer, scan.outer
    reached = set(redefined)
    wave = list(reached)
    taken: set[int] = set()
    while wave:
        for r in readers.get(wave.pop(), ()):
            if r not in taken:
                taken.add(r)
                for o in nodes[r].output:
                    if o and o not in reached:
                        reached.add(o)
                        wave.append(o)
    return lambda name: name not in reached and (name in producer or name in outer)


def _same_frame(after: ModelProto, before: ModelProto) -> bool:
    """Whether the two models share IR version, opsets, local functions and the graph's inputs and outputs:
    a region says nothing about a change there."""
    if after.ir_version != before.ir_version:
        return False
    if sorted((o.domain, o.version) for o in after.opset_import) != sorted((o.domain, o.version) for o in before.opset_import):
        return False
    return (_serialized(after.functions) == _serialized(before.functions)
            and _serialized(after.graph.input) == _serialized(before.graph.input)
            and _serialized(after.graph.output) == _serialized(before.graph.output))


def inline_bytes(model: ModelProto) -> int:
    """The bytes of initializer data held in the proto (external data is not)."""
    return sum(t.ByteSize() for t in model.graph.initializer if t.data_location != TensorProto.EXTERNAL)


def _serialized(messages) -> list[bytes]:
    return [m.SerializeToString() for m in messages]


def _initializer_key(t: TensorProto):
    if t.data_location == TensorProto.EXTERNAL or t.ByteSize() > COMPARED_BY_VALUE_BYTES:
        return (t.data_type, tuple(t.dims), t.data_location)
    return t.SerializeToString()


def _changed_initializers(after: ModelProto, before: ModelProto) -> set[str]:
    """Initializer names of ``after`` that ``before`` has not, or has with another type, shape or (small
    ones) value."""
    old = {t.name: t for t in before.graph.initializer}
    return {t.name for t in after.graph.initializer
            if t.name not in old or _initializer_key(t) != _initializer_key(old[t.name])}


def _declared(value_infos) -> dict[str, bytes]:
    return {v.name: v.type.SerializeToString() for v in value_infos}


def _standalone(after: ModelProto, nodes: list[NodeProto], scan: NodeScan, region: set[int],
                types: "InferredTypes") -> ModelProto | None:
    """``nodes`` (in ``after``'s order) as a model: what they read from outside as typed inputs, copied
    initializers or copied Constant nodes; what they compute that is read outside them, not read, or a
    graph output, as outputs."""
    readers, produced = scan.readers, {o for n in nodes for o in n.output if o}
    read = list(dict.fromkeys(x for n in nodes for x in reads_of(n) if x and x not in produced))
    constants, read = split_constants(scan, read)
    frame = Frame(after.graph)
    # (every read a node computes is typed and carries no contents the load knows: _with_shape_sources saw to it)
    nodes = constants + nodes
    m = part_model(after, "rnnfuse_changed_region", nodes)
    sub = m.graph
    frame.declare_reads(sub, read, types.types)
    declared = {name: frame.declared[name] for name in produced if name in frame.declared}
    outputs: set[str] = set()
    for n in nodes:
        for o in n.output:
            if not o or o in outputs:
                continue
            if o in frame.outputs:
                sub.output.add().CopyFrom(frame.outputs[o])
            elif o not in readers or any(r not in region for r in readers[o]):
                if o in declared:
                    sub.output.add().CopyFrom(declared[o])
                else:
                    sub.output.add().name = o  # (untyped: onnxruntime infers it)
            else:
                continue
            outputs.add(o)
    if not outputs:
        return None
    sub.value_info.extend(v for name, v in declared.items() if name not in outputs)
    _type_outputs(m)
    return m


def _type_outputs(m: ModelProto) -> None:
    """Give the region's undeclared outputs the types ONNX inference gives them in the region (onnx.checker
    wants every graph output typed; onnxruntime would infer them itself). An output inference cannot type
    stays untyped, and the checker's complaint about it sends the guard to the whole model."""
    untyped = [o for o in m.graph.output if not o.HasField("type")]
    if not untyped:
        return
    types = region_types.inferred_types(m)
    for o in untyped:
        if types is not None and o.name in types:
            o.type.ParseFromString(types[o.name])
