"""Dataflow queries on a graph that several passes ask: which tensors are computed from shapes alone, how many
leading unit axes a ``[*, B, N]`` value has, and what a set of tensors computes on its own.

Answers are memoised in the model's :class:`~rnnfuse.facts.ModelFacts`, so each tensor is looked at once.
"""

from __future__ import annotations

import numpy as np

from .graph import Graph
from .protos import has_subgraph

# the ops that read their input's shape, never its values: what they compute is no runtime data, whatever they read
SHAPE_READS = ("Shape", "Size")
# elementwise (or row-wise) ops whose output has the leading axes of their inputs
_KEEPS_LEAD = ("Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "MatMul", "Gemm", "Where", "Identity", "Cast")


def runtime_values(g: Graph) -> frozenset | set:
    """The tensors of the main graph computed from a graph input's values (through any ops but Shape and
    Size, explicit inputs only): never constant, never shape-derived. One walk over the graph, kept in the
    model's facts; a tensor added later is simply not in the set (callers then ask :meth:`Graph.const`).

    This is what lets the chain front end ask "does this input carry runtime values?" for every node of a
    100k-node graph with one set lookup instead of a fold attempt and a shape walk per tensor."""
    if g.parent is not None:
        return _NONE
    facts = g.model.facts
    if facts.runtime is not None:
        return facts.runtime
    facts.runtime = out = values_computed_from(g, g.input_names)
    return out


def values_computed_from(g: Graph, inputs: list[str]) -> set[str]:
    """``inputs`` and the tensors of scope ``g`` computed from their values (through any ops but Shape and
    Size, explicit inputs only): :func:`runtime_values`' walk, for any scope and inputs (a body's own)."""
    out: set[str] = set(inputs)  # (an initializer listed as an input can be overridden: not constant)
    frontier = list(out)
    uses = g.uses
    hot: set[int] = set()  # the ids of the nodes computing runtime values
    shapes: set[int] = set()  # the Shape and Size nodes reading them
    produced = 0  # the hot nodes' (non-empty) outputs, counted with repeats
    while frontier:
        v = frontier.pop()
        for c in uses(v):
            k = id(c)
            if k in hot or k in shapes:
                continue
            op = c.op_type
            if op in SHAPE_READS:
                shapes.add(k)
                continue
            if (op in _SUBGRAPH_OPS or c.domain not in ("", "ai.onnx")) and v not in c.input:
                continue  # read inside a subgraph only: fold and shape_derived look at explicit inputs
            hot.add(k)
            for o in c.output[:]:
                if o:
                    produced += 1
                    frontier.append(o)
    # The set is kept for the whole run and holds most of the graph's names: it takes them from the producer
    # map, whose keys are the strings the index holds anyway, not the fresh copies protobuf makes on each read
    # of a node's outputs (108k names of an unrolled export: 7.6 MB). What the map lists is exactly the hot
    # nodes' outputs when each is produced by its node alone (the count says so); else they are read again.
    names = [o for o, p in g.producer.items() if id(p) in hot]
    if len(names) == produced:
        out.update(names)
    else:
        for c in g.nodes_and_removed():
            if id(c) in hot:
                out.update(o for o in c.output if o)
    return out


def runtime_after_edits(runtime: set, nodes, edited) -> None:
    """Add to ``runtime`` (:func:`runtime_values`' kept set) what the ``edited`` nodes (added or rewired this
    round) compute from a graph input's values, by the same rule; ``nodes``: the graph's, in topological order
    (a new node's new producers are seen first). What the set says of the other names stays true (a rewrite
    keeps every value it leaves), so this is the walk over the round's edits that a walk over the whole graph
    would add; without it, the next round took every value a fusion computed from the inputs for one a fold
    might make constant (a fold each of 4,000 fused masked ops' index vectors: 2.9 s at 90,000 nodes)."""
    want = set(map(id, edited))
    for n in nodes:  # (names read as slices, tested in C: a replayed 100,000-node head, 0.27 -> 0.17 s)
        if id(n) in want and not runtime.isdisjoint(n.input[:]) and n.op_type not in SHAPE_READS:
            runtime.update(n.output[:])
    runtime.discard("")  # (an unnamed optional output)


_NONE: frozenset = frozenset()
_SUBGRAPH_OPS = ("Loop", "Scan", "If", "SequenceMap")


def post_order(root: str, memo: dict, open_, close):
    """The value of tensor ``root`` computed bottom-up over what it is computed from, each tensor once.

    ``open_(name)`` either stores ``name``'s value in ``memo`` itself and returns None (a leaf, a constant,
    a value not walked into), or returns the inputs whose values it needs first; ``close(name)`` then
    computes the value from theirs (in ``memo``). Iterative (a 100k-step chain is no recursion limit), and
    the memo carries over between calls: a second query stops where an earlier walk went."""
    if root in memo:
        return memo[root]
    stack = [root]
    opened: set[str] = set()
    while stack:
        cur = stack[-1]
        if cur in memo:
            stack.pop()
            continue
        if cur not in opened:
            ins = open_(cur)
            if ins is None:
                stack.pop()
                continue
            opened.add(cur)
            pending = [i for i in ins if i and i not in memo]
            if pending:
                stack.extend(pending)
                continue
        stack.pop()
        memo[cur] = close(cur)
    return memo[root]


def given_constants(g: Graph) -> frozenset | set:
    """Constants other than zeros broadcast to a runtime shape (``Expand(h0, [B, H])`` of a learned initial
    state, a ConstantOfShape fill) and the values computed from them and no runtime value (``h0 @ R``): an
    unrolled chain's given initial state may be one, though it is computed from shapes and constants only
    (the chain search keeps those its family reads as one: passes/unrolled/chains._initial_state_constants).
    (Zeros are the initial state a first step may fold away.) One walk from the broadcasts, kept in the
    model's facts like :func:`runtime_values`; a graph without such a broadcast costs an op-index lookup."""
    if g.parent is not None:
        return _NONE
    facts = g.model.facts
    if facts.given is not None:
        return facts.given
    runtime = runtime_values(g)
    seeds = []
    sized: dict[str, bool] = {}
    for n in g.nodes_of("Expand", "ConstantOfShape", "Tile"):
        if n.op_type != "ConstantOfShape" and (_reads_a_shape(g, n.input[0], runtime, sized) or g.const(n.input[0]) is None):
            continue  # (a broadcast length, Expand(T, [B]): no learned value, and folding T infers a whole layer's types)
        if n.output[0] not in runtime and g.fill_value(n.output[0]) != 0.0:
            seeds.append(n.output[0])
    out, frontier = set(seeds), seeds
    while frontier:
        for c in g.uses(frontier.pop()):
            if c.op_type == "Expand" and g.fill_value(c.output[0]) == 0.0:
                continue  # (zeros broadcast to a shape computed from a fill: torch's zeros.expand(-1, H))
            if c.op_type in SHAPE_READS:
                continue  # (its shape, not its values: the bounds of torch's chunk of h0 @ R, a Slice's)
            for o in c.output:
                if o and o not in out and o not in runtime:
                    out.add(o)
                    frontier.append(o)
    facts.given = out
    return out


def _reads_a_shape(g: Graph, name: str, runtime, memo: dict) -> bool:
    """Whether a value computed from no runtime value reads some tensor's Shape or Size (no fold asked)."""
    producer = g.producer

    def open_(cur):
        p = producer.get(cur)
        if p is None or cur in runtime:
            memo[cur] = False
            return None
        if p.op_type in SHAPE_READS:
            memo[cur] = True
            return None
        return p.input

    def close(cur) -> bool:
        return any(memo.get(i, False) for i in producer[cur].input if i)

    return post_order(name, memo, open_, close)


def shape_derived(g: Graph, name: str) -> bool:
    """Whether a tensor depends on other tensors' shapes only (never on their values)."""
    memo = g.model.facts.shape_derived
    if name in memo:
        return memo[name]
    runtime = runtime_values(g)
    if name in runtime:
        return False
    producer, const = g.producer, g.const

    # (read from the ops, no fold: folding a Shape infers its tensor's cone, and a computed value folds only
    # when what it reads is constant or a shape, which this walk finds anyway)
    def open_(cur):
        p = producer.get(cur)
        if p is not None and p.op_type in SHAPE_READS:
            memo[cur] = True
            return None
        if cur in runtime:
            memo[cur] = False
            return None
        if p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx"):
            # (a Constant depends on no tensor at all: known without decoding its value, which a trace writes
            # per step, e.g. each step's Split sizes)
            memo[cur] = True
            return None
        if p is None or p.op_type == "Constant" or has_subgraph(p):
            memo[cur] = const(cur) is not None
            return None
        return p.input

    def close(cur) -> bool:
        ins = [i for i in producer[cur].input if i]
        return bool(ins) and all(memo.get(i, False) for i in ins)

    return post_order(name, memo, open_, close)


def lead_of(g: Graph, name: str, depth: int = 0) -> int | None:
    """How many leading unit axes a [*, B, N] value has: the known rank - 2 (``op_shapes.known_dims``), or
    followed through Unsqueeze/Squeeze(axis 0) and elementwise ops."""
    memo = g.model.facts.lead
    if name in memo:
        return memo[name]
    p = g.producer.get(name)
    if p is not None and p.op_type == "Gemm":
        # (2-D by definition: asking inference instead walked a late step's cone back to the chain's start,
        # 16,000 nodes for a bidirectional torch trace, queried from its last step)
        memo[name] = 0
        return 0
    from .op_shapes import known_dims  # (op_shapes builds on dataflow's walks)

    dims = known_dims(g, name)  # (what its ops fix before a cone inferred: one a step of a 6,660-step chain)
    out = None
    if dims is not None:
        out = max(len(dims) - 2, 0)
    elif depth < 24:
        p = g.producer.get(name)
        if p is not None:
            if p.op_type in ("Unsqueeze", "Squeeze"):
                inner = lead_of(g, p.input[0], depth + 1)
                if inner is not None:
                    out = inner + (1 if p.op_type == "Unsqueeze" else -1)
            elif p.op_type in _KEEPS_LEAD:
                runtime = runtime_values(g)
                leads = [lead_of(g, i, depth + 1) for i in p.input if i and (i in runtime or g.const(i) is None)]
                leads = [x for x in leads if x is not None]
                out = max(leads) if leads else None
    memo[name] = out
    return out


def settled_rank(g: Graph, name: str) -> int | None:
    """The rank of ``name`` where it costs no inference: what a settled type says, else what its ops fix
    (:func:`rnnfuse.op_shapes.op_rank`). Exact where it answers (None otherwise), so a filter may reject by it
    what inference would: a 600-layer transformer's q, k, v are slices of a rank-4 tensor, 600 cones inferred
    to learn that."""
    from .op_shapes import op_rank  # (op_shapes builds on dataflow's walks)

    return op_rank(g, name)


def settled_dim(g: Graph, name: str, axis: int) -> int | None:
    """Extent ``axis`` of ``name`` where it costs no inference, as a number (None: not known so, or symbolic):
    what its ops fix (:func:`rnnfuse.op_shapes.op_dims`), and a MatMul's width from its weight where the other
    operand's rank is not known (the dims cannot say that alone). torch's ``chunk`` of a step's
    ``x @ W.T + b`` slices at bounds computed from ``Shape(...)[1]``: a cone inference a step (5 s for 1,900
    steps) to learn a number the weight says."""
    from .op_shapes import op_dims, shape_value

    dims = op_dims(g, name)
    p = g.producer.get(name)
    if dims is not None:
        d = dims[axis] if -len(dims) <= axis < len(dims) else None
        if d is None and p is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx"):
            # (a Reshape's positive shape entry is its extent there, whatever the others are: dynamo reshapes
            # each call's output to a shape computed from its own and declares the result with no dims, which
            # ends the walk of what the ops fix)
            value = shape_value(g, p.input[1])
            d = value[axis] if isinstance(value, tuple) and len(value) == len(dims) else None
            return d if isinstance(d, int) and d > 0 else None
        return d if isinstance(d, int) else None
    if p is None or p.op_type != "MatMul" or axis != -1 or p.domain not in ("", "ai.onnx"):
        return None
    w = op_dims(g, p.input[1])
    return w[-1] if w is not None and len(w) >= 2 and isinstance(w[-1], int) else None


def literal_value(g: Graph, name: str) -> np.ndarray | None:
    """The value of an initializer or a Constant's output (no fold: a fold may infer types, and a walk that
    reads shapes without inference must not start one)."""
    p = g.producer.get(name)
    if name in g.initializers or (p is not None and p.op_type == "Constant"):
        return g.const(name)
    return None


def rank_of(g: Graph, name: str) -> int | None:
    """The rank of ``name``: the known one (``Model.rank``: declared, or inferred -- the Loop front end's
    questions, where an answer missed declines a loop and the graphs are small; in a model too big to infer
    whole it reads the ops first), else what its ops fix where the file and shape inference leave it unknown
    (:func:`rnnfuse.op_shapes.op_rank`: tf2onnx at opset 13 declares nothing after a Reshape to a computed
    shape; a Transpose's ``perm`` says the rank of its output)."""
    from .op_shapes import op_rank  # (op_shapes builds on dataflow's walks)

    r = g.model.rank(name)
    return r if r is not None else op_rank(g, name)


def closure(g: Graph, seeds, limit: int = 256) -> tuple[set[str], set[int]]:
    """Tensors computed from ``seeds`` (plus constants and shapes) alone, and the ids of their nodes:
    h @ R and its slices from a state, a tiled or negated mask from a step's mask slice."""
    region = set(seeds)
    ids: set[int] = set()
    frontier = list(seeds)
    runtime = runtime_values(g)
    while frontier and len(ids) < limit:
        v = frontier.pop()
        for c in g.uses(v):
            if id(c) in ids or len(c.input) > 8 or g.implicit_inputs(c):
                continue  # (a Concat stacking every step's output is no part of a step)
            # every dynamic input (dynamic_inputs) in the region: asked of the inputs outside it only, the first
            # one that carries runtime values ending the test (a step's h @ R reads h and two weights)
            if not any(i not in region and (i in runtime or not shape_derived(g, i)) for i in c.input[:] if i):
                ids.add(id(c))
                for o in c.output[:]:
                    if o:
                        region.add(o)
                        frontier.append(o)
    return region, ids


def descendants(g: Graph, seeds, through=None, limit: int | None = None, known: set[str] | None = None) -> set[str] | None:
    """The tensors computed from ``seeds`` (transitively), by nodes ``through(node)`` accepts (default: all);
    None once more than ``limit`` were found (unknown). ``known``: the descendants of other seeds (a result of
    this function), included and not walked again."""
    out: set[str] = set(known) if known else set()
    stack = list(seeds)
    while stack:
        for c in g.uses(stack.pop()):
            if through is None or through(c):
                for o in c.output:
                    if o and o not in out:
                        out.add(o)
                        stack.append(o)
        if limit is not None and len(out) > limit:
            return None
    return out


def reaches(g: Graph, name: str, targets, limit: int) -> bool | None:
    """Whether ``name`` is computed (transitively) from one of ``targets``: True, False when its whole
    ancestry was read without meeting one, None when ``limit`` tensors were read first (unknown)."""
    seen, stack = set(), [name]
    while stack:
        if len(seen) >= limit:
            return None
        cur = stack.pop()
        if cur in targets:
            return True
        if cur in seen:
            continue
        seen.add(cur)
        p = g.producer.get(cur)
        if p is not None:
            stack.extend(i for i in p.input if i)
    return False


def dynamic_inputs(g: Graph, node) -> list[str]:
    """The inputs of ``node`` that carry runtime values (not constants, not computed from shapes alone)."""
    runtime = runtime_values(g)
    # (not shape_derived: no constant either, asked without folding a Shape, whose fold infers a cone's types)
    return [i for i in node.input[:] if i and (i in runtime or not shape_derived(g, i))]


def reads_shape_only(g: Graph, reader) -> bool:
    """Whether the node ``reader`` takes nothing of its input but the shape: ``Shape``, or a ``Gather`` of one
    row read only by ``Shape`` nodes (torch's exporters size a buffer's row update from ``Shape(buf[t])``)."""
    if reader.op_type == "Shape":
        return True
    return (reader.op_type == "Gather" and not g.is_graph_output(reader.output[0])
            and all(v.op_type == "Shape" for v in g.uses(reader.output[0])))
