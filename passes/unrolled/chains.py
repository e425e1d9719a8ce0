"""Threading the steps of a family into chains.

Dependency intervals: for every tensor, the lowest and highest step index whose input it depends on (one
topological pass). A step's *combining* nodes mix its input with something older; walking that something back
through weight matmuls and slices finds the carried state h. A state of step t whose interval ends at t-1
links step t-1 -> t (forward); one starting at t+1 links t+1 -> t (backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import NodeProto

from rnnfuse.dataflow import closure, dynamic_inputs, given_constants, runtime_values, shape_derived
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.protos import node_field

from .lanes import split_lanes
from .state_roots import state_root



@dataclass
class Step:
    t: int
    x: str
    roots: set = field(default_factory=set)  # carried-state tensors read through weight matmuls / slices
    pulled: set = field(default_factory=set)  # ids of state-side nodes between a root and the step
    masks: dict = field(default_factory=dict)  # this step's slices of bool families -> mask symbol
    weighted: set = field(default_factory=set)  # the roots read through a weight matmul
    pulled_of: dict | None = None  # root -> its part of ``pulled`` (kept when the step reads several roots)
    # cells side by side (:mod:`.lanes`): node id -> the lane whose values it is computed from (-1: several);
    # the step owns no node of another lane
    lane_owner: dict | None = None
    lane: int = -1
    lane_nodes: list | None = None  # the step's nodes this lane reads or computes, in walk order (in_order)

    def hidden_state(self, roots: set | None = None) -> str:
        """The one root (of ``roots``, default all) the step reads: its hidden state h."""
        roots = self.roots if roots is None else roots
        if len(roots) != 1:
            raise Decline(f"step {self.t} reads {len(roots)} carried values through weights (expected one hidden state)")
        return next(iter(roots))

@dataclass
class _Found:
    """Per step and direction: older tensors the step reads and the nodes walked to reach them."""

    roots: set = field(default_factory=set)
    weighted: set = field(default_factory=set)  # the roots read through a weight matmul (h, not c or a carried output)
    pulled_of: dict = field(default_factory=dict)  # root -> the nodes walked to reach it (h @ R, its slices)

@dataclass
class Chain:
    direction: str
    steps: list  # in processing order
    # broadcast constants the chain's first step may read as its given initial state (_initial_state_constants)
    given: frozenset = frozenset()
    lane: str = ""  # one of several cells side by side over the same steps: the state its second step reads

    def key(self, src: str, axis: int) -> tuple:
        """What names this chain from one search to the next (a side-by-side cell by the state it reads)."""
        return (src, axis, self.direction, self.steps[0].t, self.lane)

    def describe(self, over: str) -> str:
        return f"{self.direction} chain over {over}" + (f", the cell reading '{self.lane}'" if self.lane else "")

class Intervals:
    """tensor -> (lo, hi): the range of step indices it depends on (``get``, ``[]``); ``nodes`` the same per
    node id, in the order of the walk.

    A tensor's span is its leaf's, else its producer's: no map keyed by tensor name is kept (on a 100k-node
    unrolled export one would hold 100k names, 11 MB with the copies protobuf makes of them on each read)."""

    def __init__(self, g: Graph, leaves: dict[str, int]):
        self.leaves = {x: (t, t) for x, t in leaves.items()}
        self.nodes: dict[int, tuple[int, int]] = {}
        self.spanned: list[NodeProto] = []  # the nodes of ``nodes``, in its order
        self.producer = g.producer
        self.names: dict[str, tuple[int, int]] | None = None  # set where a name is produced twice (see intervals)
        # per span end (0, 1): step -> (its leaves, its nodes in walk order), built when first asked (in_order)
        self._by_step: list[tuple[dict, dict] | None] = [None, None]

    def get(self, name: str, default=None):
        v = self.leaves.get(name)
        if v is not None:
            return v
        if self.names is not None:
            return self.names.get(name, default)
        p = self.producer.get(name)
        return default if p is None else self.nodes.get(id(p), default)

    def __getitem__(self, name: str) -> tuple[int, int]:
        v = self.get(name)
        if v is None:
            raise KeyError(name)
        return v

    def add_copy(self, node: NodeProto, of: NodeProto) -> None:
        """Span ``node``, a copy of the spanned node ``of`` added since the walk, as ``of``."""
        span = self.nodes[id(of)]
        self.nodes[id(node)] = span
        self.spanned.append(node)
        if self.names is not None:
            self.names.update((o, span) for o in node.output if o)
        for end, built in enumerate(self._by_step):
            if built is not None:
                built[1].setdefault(span[end], []).append(node)

    def in_order(self, end: int, t: int, nodes: list | None = None):
        """(tensor, span) of the tensors whose span ends (``end`` 1) or starts (``end`` 0) at step ``t``: the
        leaves, then each walked node's outputs, in the order of the walk (a node's span is checked before
        its outputs are read). ``nodes``: the step's nodes to list instead of all (one cell's: Step.lane_nodes)."""
        leaves = self.leaves
        leaves_at, nodes_at = self._steps(end)
        for x in leaves_at.get(t, ()):
            yield x, leaves[x]
        if self.names is not None:
            yield from ((x, v) for x, v in self.names.items() if v[end] == t and x not in leaves)
            return
        for n in nodes_at.get(t, ()) if nodes is None else nodes:
            v = self.nodes[id(n)]
            for o in n.output[:]:
                if o and o not in leaves:
                    yield o, v

    def step_nodes(self, end: int, t: int) -> list[NodeProto]:
        """The nodes whose span ends (``end`` 1) or starts (0) at step ``t``, in walk order."""
        return self._steps(end)[1].get(t, [])

    def _steps(self, end: int) -> tuple[dict, dict]:
        """The leaves and nodes by the step their span ends (starts) at: one pass, then each step's query
        reads its own (a graph of many chains over one input asks of every chain's steps)."""
        built = self._by_step[end]
        if built is None:
            leaves_at: dict = {}
            nodes_at: dict = {}
            for x, v in self.leaves.items():
                leaves_at.setdefault(v[end], []).append(x)
            for n, v in zip(self.spanned, self.nodes.values()):
                nodes_at.setdefault(v[end], []).append(n)
            built = self._by_step[end] = (leaves_at, nodes_at)
        return built

def intervals(g: Graph, order: list[NodeProto], leaves: dict[str, int]) -> Intervals:
    iv = Intervals(g, leaves)
    return iv if _walk_spans(g, order, iv) else _intervals_by_name(g, order, leaves)

def _intervals_by_name(g: Graph, order: list[NodeProto], leaves: dict[str, int]) -> Intervals:
    """:func:`intervals` for a graph where a name is produced twice (invalid, but read as it is): the walk
    keeps a map of names, each name's span the last node's that wrote it."""
    iv = Intervals(g, leaves)
    iv.names = {}
    _walk_spans(g, order, iv)
    return iv

def _walk_spans(g: Graph, order: list[NodeProto], iv: Intervals) -> bool:
    """Give each node of ``order`` (and, with ``iv.names``, each of its outputs) the span of its inputs'.
    Without ``iv.names`` an input's span is its producer's (``Intervals.get``, inline: this loop meets every
    input of a 100k-node graph); returns whether that was exact, i.e. every spanned node's outputs are
    produced by that node alone, as the producer map says."""
    nodes, spanned, names = iv.nodes, iv.spanned, iv.names
    leaf, producer, node_span = iv.leaves.get, g.producer.get, nodes.get
    named = names.get if names is not None else None
    owned = True
    for n in order:
        op = n.op_type
        if op in ("Shape", "Size"):
            continue  # a shape does not depend on values
        span = None
        # ([:]: upb's fastest copy of the names; a Constant's empty list is not read, see protos.node_field)
        for i in n.input[:] if op != "Constant" else node_field(n, "input"):
            v = leaf(i)
            if v is None:
                if named is not None:
                    v = named(i)
                else:
                    p = producer(i)
                    v = node_span(id(p)) if p is not None else None
                if v is None:
                    continue
            if v is span:
                continue
            if span is None:
                span = v
            elif v[0] < span[0] or v[1] > span[1]:
                # (most nodes have the span of an input: that tuple is shared, a new one only where spans widen)
                span = v if v[0] <= span[0] and v[1] >= span[1] else (min(v[0], span[0]), max(v[1], span[1]))
        if span is not None:
            nodes[id(n)] = span
            spanned.append(n)
            outs = n.output[:]
            if names is not None:
                for o in outs:
                    if o and o not in iv.leaves:
                        names[o] = span
                continue
            for o in outs:
                if o and producer(o) is not n:
                    owned = False
            if len(outs) > 1 and len(set(outs)) != len(outs):
                owned = False
    return owned and len(spanned) == len(nodes)

def find_chains(g: Graph, fam: dict[int, str], iv, mask_fam: dict[int, dict] | None = None, known=None) -> list[Chain]:
    """Thread the steps of a family into chains (forward and backward). ``known``: the steps' regions the
    pre-check computed (family_filter.KnownRegions), used when they were taken with this search's given
    constants."""
    mask_fam = mask_fam or {}
    given = _initial_state_constants(g, iv, {min(fam), max(fam)})
    if known is not None and known.given == given:
        mask_only = {t: known.regions[t][0] if t in known.regions else closure(g, ms, 64)[0] for t, ms in mask_fam.items()}
        regions = {t: r[1:] for t, r in known.regions.items()}
    else:
        # values computed from one step's mask alone (its Unsqueeze, Not, Cast): never a carried state, even when
        # another chain's step combines them with this step's values (a backward chain's first, x-only step)
        mask_only = {t: closure(g, ms, 64)[0] for t, ms in mask_fam.items()}
        regions = {t: x_region(g, x, mask_only.get(t, set()), given) for t, x in fam.items()}
    # (an input depending on no step never links two (nor does what it is computed from): walked back only for the
    # chains' steps, where it may be an initial state; a fused layer's output read per step walked 6,660 steps')
    skipped: set[int] = set()
    found = _older_reads(g, fam, iv, mask_fam, mask_only, regions, given, skipped=skipped)
    runs = [(direction, seq) for direction in ("forward", "reverse") for seq in _linked_runs(fam, iv, found, direction)]
    redo = {t for _, seq in runs for t in seq} & skipped
    if redo:  # (the links stand: what these walks add are roots of no step)
        found = {key: f for key, f in found.items() if key[1] not in redo}
        found.update(_older_reads(g, fam, iv, mask_fam, mask_only, regions, given, only=redo))
    chains = [_chain(direction, seq, fam, iv, mask_fam, found, given) for direction, seq in runs]
    return [lane for chain in chains for lane in split_lanes(g, chain, iv)]


def _initial_state_constants(g: Graph, iv, ends: set[int]) -> frozenset:
    """The given constants (:func:`rnnfuse.dataflow.given_constants`) that may be this family's initial states:
    sized by no value of its steps (not a step's ``ones_like(z_t)``), and read only at the family's first or
    last time index (``ends``), by a forward or a backward chain's first step (one broadcast may start both
    halves of a bidirectional layer). A broadcast read at other steps (``ones`` for every step's ``1 - z``) is a
    constant of the cell and is read as one, as before. Readers outside the family's steps (another family's,
    e.g. a layer stacked on this one) do not count. The chains carry the set to the step evaluator and the
    signer."""
    given = given_constants(g)
    if not given:
        return frozenset()
    dropped: set[str] = set()
    whole = (min(ends), max(ends))
    producer = g.producer
    # (names an earlier rewrite removed may stay in the set: they are read by nothing)
    for seed in [v for v in given if v in producer and not any(i in given for i in producer[v].input)]:
        part, stack, inside = {seed}, [seed], _sized_by_a_step(g, producer[seed], iv, whole)
        while stack:
            for c in g.uses(stack.pop()):
                outs = [o for o in c.output if o]
                if outs and all(o in given for o in outs):
                    stack.extend(o for o in outs if o not in part)
                    part.update(outs)
                    continue
                span = iv.nodes.get(id(c))  # (a first step's node depends on its own x alone: (t, t))
                inside |= span is not None and not (span[0] == span[1] and span[0] in ends)
        if inside:
            dropped |= part
    return frozenset(given - dropped)


def _sized_by_a_step(g: Graph, broadcast: NodeProto, iv, whole: tuple, limit: int = 32) -> bool:
    """Whether a broadcast's shape is computed from the shape of a value of one of the family's steps (a value
    depending on every step, e.g. the stacked output of a layer below, sizes a given state); only that Shape is
    folded (folding every value walked inferred a type for each transformer block's mask, a broadcast)."""
    stack, seen = [broadcast.input[0 if broadcast.op_type == "ConstantOfShape" else -1]], set()
    while stack and len(seen) < limit:
        cur = stack.pop()
        p = None if cur in seen else g.producer.get(cur)  # (no empty name: none is stacked)
        seen.add(cur)
        if p is None or cur in g.initializers or p.op_type == "Constant":
            continue
        if p.op_type in ("Shape", "Size"):
            span = iv.get(p.input[0])
            if span is not None and span != whole and g.const(cur) is None:
                return True
            continue
        stack.extend(x for x in p.input if x)
    return len(seen) >= limit


def x_region(g: Graph, x: str, mask_local: set, given: set) -> tuple[set, list[NodeProto]]:
    """A step's x-local region (the tensors computed from x_t with constants and the step's mask-only values
    (a tiled, negated or cast mask) only) and its *combining* nodes, which mix the region with anything else
    (a given constant initial state too: see :func:`_initial_state_constants`)."""
    local = {x}
    frontier = [x]
    combining: list[NodeProto] = []
    seen_nodes: set[int] = set()
    while frontier:
        v = frontier.pop()
        for c in g.uses(v):
            if id(c) in seen_nodes:
                continue
            seen_nodes.add(id(c))
            if len(c.input) > 8:
                continue  # a Concat stacking every step's output is no part of a step
            dyn = dynamic_inputs(g, c)
            if all(i in local or i in mask_local for i in dyn) and not g.implicit_inputs(c) and not (given and given.intersection(c.input)):
                for o in c.output:
                    if o and o not in mask_local:  # (a mask computed from x_t is the step's mask, read as one)
                        local.add(o)
                        frontier.append(o)
            else:
                combining.append(c)
    return local, combining


def _older_reads(g: Graph, fam: dict[int, str], iv, mask_fam: dict[int, dict], mask_only: dict[int, set],
                 regions: dict[int, tuple[set, list]], given: set, skipped: set | None = None,
                 only: set | None = None) -> dict[tuple[str, int], _Found]:
    """Per (direction, step): the carried tensors its combining nodes read from older steps, walked back
    through state-side ops (:func:`.state_roots.state_root`)."""
    xs = {x: t for t, x in fam.items()}
    all_masks = {m: t for t, ms in mask_fam.items() for m in ms}
    any_mask_only = set().union(*mask_only.values()) if mask_only else set()
    stop = {**xs, **all_masks}
    runtime = runtime_values(g)
    found: dict[tuple[str, int], _Found] = {}
    # a Concat of values of several other steps stacks them (per-step outputs of a fused layer, read step by
    # step; the stacked inputs of a fused chain whose steps read x[t] - x[t-1]): a real step reads one older
    # step's values (x-local only at a chain's first step), e.g. input feeding's Concat(x_1, y_0)
    local_step = {v: t for t, (local, _) in regions.items() for v in local}
    for t in fam:
        if only is not None and t not in only:
            continue
        local, combining = regions[t]
        mask_local = mask_only.get(t, set())
        mask_t = mask_fam.get(t, {})
        for c in combining:
            if c.op_type == "Concat" and _stacks_steps(c, t, local, local_step, iv):
                continue
            for i in c.input:
                if not may_read_older(g, i, (local, mask_local, xs, mask_t), runtime, given):
                    continue
                if skipped is not None and iv.get(i) is None:  # (after the cheap test: a weight is no reason to redo)
                    skipped.add(t)
                    continue
                pulled: set = set()
                ops: list = [c.op_type]
                r = state_root(g, i, iv, pulled, stop, ops=ops, given=given)
                if r is None or r in stop or r in any_mask_only or (shape_derived(g, r) and r not in given):
                    continue
                weighted = bool({"MatMul", "Gemm", "Einsum", "Concat"} & set(ops))  # read through the recurrent weights
                riv = iv.get(r)
                for direction in ("forward", "reverse"):
                    if riv is not None and not (riv[1] < t if direction == "forward" else riv[0] > t):
                        continue
                    f = found.setdefault((direction, t), _Found())
                    own = f.pulled_of.get(r)
                    if own is None:
                        own = f.pulled_of[r] = set()
                    if r not in f.roots:
                        f.roots.add(r)
                        own |= closure(g, [r])[1]
                    if weighted:
                        f.weighted.add(r)
                    own |= pulled
    return found


def may_read_older(g: Graph, i: str, own: tuple, runtime, given) -> bool:
    """Whether input ``i`` of a step's combining node may be a value of an older step: not empty, none of the
    step's own (``own``: collections of its x-local values, mask-local values, the family's slices, the step's
    masks), and a runtime value or a given constant (not a constant or shape computed from constants). What
    _older_reads walks back, and what family_filter.may_hold_chains asks of every combining node."""
    if not i or any(i in part for part in own):
        return False
    # (shape_derived first: it tells a Constant without decoding it, a torch trace's per-step Split sizes)
    return i in runtime or i in given or (not shape_derived(g, i) and g.const(i) is None)


def _stacks_steps(c: NodeProto, t: int, local: set, local_step: dict, iv) -> bool:
    """Whether Concat ``c``, read by step t, reads the values of more than one other step."""
    others = {local_step[i] for i in c.input if i in local_step} - {t}
    spans = {iv.get(i) for i in c.input if i and i not in local and i not in local_step} - {None}
    return len(others) + len(spans) > 1


def _linked_runs(fam: dict[int, str], iv, found: dict[tuple[str, int], _Found], direction: str) -> list[list[int]]:
    """Link step t to the step before it (in ``direction``) when one of its roots ends there; every run of two
    or more linked steps is a chain's (:func:`_chain`)."""
    succ, has_pred = {}, set()  # (step -> the step linked after it; the steps linked to one before)
    for t in fam:
        pred = t - 1 if direction == "forward" else t + 1
        f = found.get((direction, t))
        if pred not in fam or f is None:
            continue
        for r in f.roots:
            riv = iv.get(r)
            if riv is not None and (riv[1] if direction == "forward" else riv[0]) == pred:
                succ[pred] = t
                has_pred.add(t)
    runs = []
    for t in sorted(fam, reverse=(direction == "reverse")):
        if t in has_pred or t not in succ:
            continue
        seq = [t]
        while seq[-1] in succ:
            seq.append(succ[seq[-1]])
        if len(seq) >= 2:
            runs.append(seq)
    return runs


def _chain(direction: str, seq: list[int], fam: dict[int, str], iv, mask_fam: dict, found: dict, given) -> Chain:
    steps = []
    for pos, k in enumerate(seq):
        f = found.get((direction, k), _Found())
        roots, weighted = set(f.roots), set(f.weighted)
        if pos:
            # past its first step a chain carries only what an earlier step computed: a value no step computes (a
            # given initial state) read at this time index is the start of the bidirectional layer's other chain
            roots = {r for r in roots if iv.get(r) is not None}
            weighted &= roots
        pulled = set().union(*f.pulled_of.values())  # (a dropped root's too, as it was read here)
        pulled_of = {r: f.pulled_of[r] for r in roots} if len(roots) > 1 else None
        steps.append(Step(k, fam[k], roots, pulled, dict(mask_fam.get(k, {})), weighted, pulled_of))
    return Chain(direction, steps, given)
