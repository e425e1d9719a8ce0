"""What the rest of the graph reads of a chain: per-step values stacked into sequences, the last step's
values, an extra value carried next to the states; and finding a step's tensor by signature or maths.
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse import op_args
from rnnfuse.dataflow import closure, descendants, dynamic_inputs, lead_of, shape_derived
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.signature import Signer
from rnnfuse.symbolic import Poly
from rnnfuse.zeroed_outputs import product_of

from .chains import Chain
from .step_eval import Foreign, StepEval


def step_output(g: Graph, chain: Chain, k: int, iv, signer: Signer, leaves: dict, allowed, op_type: str, ref: int,
                reads_h: bool = False) -> str | None:
    """The tensor of step k with the reference step's signature ``ref`` (one no later step reads). ``reads_h``:
    the reference tensor is computed from its step's h, so the one sought is computed from step k's."""
    for name in _candidates(g, chain, k, iv, op_type, leaves, allowed, reads_h):
        try:
            if signer.sign(name, leaves, allowed, Foreign(chain.steps[k].t), set(), given=chain.given) == ref:
                return name
        except Decline:
            continue
    return None


def reads_state(g: Graph, name: str, leaves: dict, allowed) -> bool:
    """Whether ``name`` is computed from its step's h (a leaf of role "h") through the step's own nodes."""
    near = _computed_from(g, [leaf for leaf, role in leaves.items() if role == "h"], allowed)
    return near is not None and name in near

def inputs_of(g: Graph, name: str, allowed, leaves: dict, limit: int = 64) -> set[str]:
    """Tensors read by the part of a step that computes ``name`` (not walking into leaves or other steps)."""
    out: set[str] = set()
    stack, seen = [name], set()
    while stack and len(seen) < limit:
        cur = stack.pop()
        if cur in seen or cur in leaves:
            continue
        seen.add(cur)
        if shape_derived(g, cur):
            continue  # computed from shapes and constants: reads no value
        p = g.producer.get(cur)
        if p is None or not allowed(p):
            continue
        for i in p.input:
            if i:
                out.add(i)
                stack.append(i)
    return out

def mask_values(g: Graph, chain: Chain) -> set[str]:
    """Values computed from the steps' masks alone (tiled or negated masks): they may be shared, e.g. by a
    stack of layers, and are no inner value of the chain."""
    masks = {m for st in chain.steps for m in st.masks}
    return closure(g, masks, 64 * len(chain.steps))[0] if masks else set()

def _stacking(g: Graph, nd: NodeProto, o: str, states, chain_nodes: set) -> bool:
    """``o = Unsqueeze(state)`` read outside the chain only by Concats (stacking the states; the same
    Unsqueeze may also be a no-op reshape inside the step): checked as a stack, not an inner value."""
    return nd.op_type == "Unsqueeze" and nd.input[0] in states and not g.is_graph_output(o) and all(
        c.op_type == "Concat" for c in g.uses(o) if id(c) not in chain_nodes)

# ops that prepare a step's input without reading a state, linear maps included (``x_t @ W_ih`` split into
# gates): no activation (every cell applies one, so no cell output is among what they compute)
_PREPARE = {"Add", "Sub", "Mul", "Div", "Neg", "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Transpose",
            "Flatten", "Dropout", "MatMul", "Gemm", "Split", "Slice"}


def prepared_inputs(g: Graph, chain: Chain, limit: int = 16):
    """A predicate: whether a tensor is the preparation of a step's input (``Reshape(x_t)``, ``2 * x_t``,
    ``x_t @ W_ih + b_ih``: computed from the step's slice and constants by the ops of :data:`_PREPARE`). Such
    a value is read by the step's cell but depends on no state, so another chain may read it too: the two
    halves of a bidirectional layer sharing one preparation of x_t, or one cell run forward and backward over
    x, whose projection of each x_t the exporter computed once for both. A value computed from the input alone
    through an activation (a first step's cell output, its state folded to zero) is no preparation."""
    xs = {st.x for st in chain.steps}
    memo: dict[str, bool] = {}

    def prepared(name: str, depth: int = 0) -> bool:
        if name in xs:
            return True
        if name in memo:
            return memo[name]
        p = g.producer.get(name)
        ok = p is not None and p.op_type in _PREPARE and depth < limit and not g.implicit_inputs(p)
        if ok:
            dyn = dynamic_inputs(g, p)
            ok = bool(dyn) and all(prepared(i, depth + 1) for i in dyn)
        memo[name] = ok
        return ok

    return prepared


def read_by_others(g: Graph, chain: Chain, initial: set):
    """A predicate: whether an inner value of the chain may be read outside it too, because it is computed
    from what the chain is given and stays computed for its other readers once the chain is fused: a step
    input's preparation (:func:`prepared_inputs`), or a part of the first step computed from the chain's
    initial states and constants alone (two chains starting from one state, whose ``h0 @ R`` the exporter
    computed once for both: one cell run forward and backward from zeros)."""
    prepared = prepared_inputs(g, chain)
    from_initial = computed_from(g, initial) if initial else (lambda name: False)
    return lambda name: prepared(name) or from_initial(name)


def computed_from(g: Graph, values: set, limit: int = 16):
    """A predicate: whether a tensor is computed from ``values`` and constants alone (within ``limit`` ops)."""
    memo: dict[str, bool] = {}

    def computed(name: str, depth: int = 0) -> bool:
        if name in values:
            return True
        if name not in memo:
            p = g.producer.get(name)
            dyn = dynamic_inputs(g, p) if p is not None and depth < limit and not g.implicit_inputs(p) else None
            memo[name] = bool(dyn) and all(computed(i, depth + 1) for i in dyn)
        return memo[name]

    return computed


class Escapes:
    """The chain's values the rest of the graph reads: ``entries`` lists, in graph order, (node, output, its
    readers outside the chain other than Shape/Size) for every output of a chain node that has such readers
    or is a graph output. One scan of the graph serves both questions asked of it (an extra carried value;
    what the chain outputs); when the chain grows in between (the extra value's nodes join it), only the
    nodes that joined are scanned, and the old entries lose the readers that joined."""

    def __init__(self, g: Graph, chain_nodes: set):
        self.g = g
        self.ids = set(chain_nodes)
        self.entries = _escaping(g, g.nodes_with_ids(chain_nodes), chain_nodes)

    def update(self, chain_nodes: set) -> "Escapes":
        joined = chain_nodes - self.ids
        if not joined:
            return self
        g = self.g
        kept = []
        for nd, o, outside in self.entries:
            outside = [u for u in outside if id(u) not in joined]
            if outside or g.is_graph_output(o):
                kept.append((nd, o, outside))
        new = _escaping(g, g.nodes_with_ids(joined), chain_nodes)
        if new:  # (in the order of the graph's nodes, as one scan would list them)
            rank = {id(n): i for i, n in enumerate(g.in_position_order([e[0] for e in kept + new]))}
            kept = sorted(kept + new, key=lambda e: rank[id(e[0])])
        self.entries = kept
        self.ids = set(chain_nodes)
        return self


def _escaping(g: Graph, nodes, chain_nodes: set) -> list[tuple]:
    out = []
    consumers, is_output = g.consumers, g.is_graph_output
    for nd in nodes:
        for o in nd.output[:]:
            if not o:
                continue
            # (most of a chain's values have one reader, in the chain: asked of it alone, no reader list built)
            v = consumers.get(o)
            if type(v) is list:
                outside = [u for u in v if id(u) not in chain_nodes and u.op_type not in ("Shape", "Size")]
            elif v is None or id(v) in chain_nodes or v.op_type in ("Shape", "Size"):
                outside = []
            else:
                outside = [v]
            if outside or is_output(o):
                out.append((nd, o, outside))
    return out


class LastStepUnused(Decline):
    """The chain's last step computes no state anyone reads, nor a value beyond them: what it computes is only
    read by a head of its own (the char-RNN that returns the last step's output, ``i2o(cat(x_t, h))``, its new
    h dead). The steps before it may still be the recurrence, the last one kept as it is, reading their h."""


class FirstValueIsState(Decline):
    """The first step computes no value beyond its states where later steps do: from a zero initial state
    a masked step's output ``where(m, h', 0)`` and its state ``where(m, h', h0)`` are one expression, which
    the exporter or :class:`~passes.dedupe.Dedupe` made one node (torch's trace with static shapes)."""


def split_first_value(g: Graph, iv, states: list[str], chain_nodes: set):
    """Give the readers outside the chain of the first step's one state read there (the merged value of
    :class:`FirstValueIsState`) a copy of its node to read, as every later step's output has one: the
    value each reader sees is unchanged; the copy spans the steps its original does. Returns the undo, or
    None when no single such state exists."""
    outside = {}
    for s in dict.fromkeys(x for x in states if x):
        readers = [u for u in g.uses(s) if id(u) not in chain_nodes and u.op_type not in ("Shape", "Size")]
        if readers:
            outside[s] = readers
    if len(outside) != 1:
        return None
    (state, readers), = outside.items()
    p = g.producer.get(state)
    if p is None or len(p.output) != 1 or g.implicit_inputs(p):
        return None
    copy, = g.add_node(p.op_type, list(p.input), name=f"{p.name or p.op_type}/first_output", domain=p.domain,
                       anchor=p)
    copy_node = g.producer[copy]
    copy_node.attribute.extend(p.attribute)
    g.replace_reads(readers, state, copy)
    iv.add_copy(copy_node, p)

    def undo() -> None:
        g.replace_reads([u for u in readers if g.alive(u)], copy, state)
        g.remove_node(copy_node)

    return undo


def extra_values(g: Graph, chain: Chain, iv, escapes: Escapes, state_tensors: set, mask_values: set,
                 initial: set) -> list[list[str]] | None:
    """Per step, the values computed from the cell's inner values by nodes outside h and c (Keras' masked
    output carried next to the state; a second output filled otherwise at masked steps), in name order, or
    None when no step has any. Every step has as many, except the last, whose values may be dead (then
    found by their signatures once the step before is known)."""
    chain_nodes = escapes.ids
    steps = chain.steps
    side = 1 if chain.direction == "forward" else 0
    k_of = {st.t: k for k, st in enumerate(steps)}
    hang: dict[int, dict[int, NodeProto]] = {}
    stacked: dict[int, set] = {}
    shared = read_by_others(g, chain, initial)
    from_states = computed_from(g, state_tensors)
    for nd, o, outside in escapes.entries:
        v = iv.nodes.get(id(nd))
        k = k_of.get(v[side]) if v is not None else None
        if k is None:
            continue
        if not outside or o in state_tensors or o in mask_values or shape_derived(g, o) or _stacking(g, nd, o, state_tensors, chain_nodes):
            continue
        if shared(o):
            continue  # (a step input's preparation or the initial states' part another chain reads too)
        if all(u.op_type == "Unsqueeze" and _stacking(g, u, u.output[0], {o}, chain_nodes) for u in outside):
            stacked.setdefault(k, set()).add(o)  # an inner value stacked as it is (e.g. m * h_cell)
            continue
        for u in outside:
            uv = iv.nodes.get(id(u))
            ku = k_of.get(uv[side]) if uv is not None else None
            # the part of a step that reads only the states before it (h R, split into gates) spans the step
            # before: read by that step's value outside the chain (the last step's output gate where its h
            # is dead and only its zero-filled output reads it), it is that step's
            if ku is None or not (ku == k or (ku == k + 1 and from_states(o))):
                raise Decline(f"an inner value of the chain ('{o}') is read outside it")
            hang.setdefault(ku, {})[id(u)] = u
    if not hang and not stacked:
        return None
    per_step: list[list[str]] = []
    for k, st in enumerate(steps):
        region = dict(hang.get(k, {}))
        frontier = list(region.values())
        while frontier:
            nd = frontier.pop()
            for o in nd.output:
                for u in g.uses(o) if o else []:
                    uv = iv.nodes.get(id(u))
                    if id(u) in region or id(u) in chain_nodes or uv is None or uv[side] != st.t:
                        continue
                    if u.op_type == "Identity" or any(g.is_graph_output(x) for x in u.output):
                        continue  # a copy of the value (e.g. returned), not part of computing it
                    if u.op_type == "Unsqueeze" and len(g.uses(u.output[0])) == 1 and g.uses(u.output[0])[0].op_type == "Concat":
                        continue  # stacking the value, not computing it
                    region[id(u)] = u
                    frontier.append(u)
        tops = {o for nd in region.values() for o in nd.output if o and (g.is_graph_output(o) or any(id(u) not in region for u in g.uses(o)))}
        tops |= stacked.get(k, set())
        if k == len(steps) - 1 and len(tops) <= len(per_step[0]):
            per_step.append(sorted(tops))  # (what is missing is found by its signature)
            continue
        if not tops:
            why = f"step {st.t} computes no value beyond its states where later steps do"
            raise FirstValueIsState(why) if k == 0 else Decline(why)
        if per_step and len(tops) != len(per_step[0]):
            raise Decline(f"step {st.t} computes {len(tops)} values beyond its states, step {steps[0].t} {len(per_step[0])}")
        per_step.append(sorted(tops))
    return per_step

def order_of(g: Graph, ids: set) -> list[NodeProto]:
    return g.nodes_with_ids(ids)

def _computed_from(g: Graph, seeds: list[str], allowed, limit: int = 4096) -> set[str] | None:
    """Values computed from ``seeds`` by nodes ``allowed``, not through a node reading more than 8 values (a
    Concat stacking every step's output is no part of a step: past it, a last step's walk reached every step
    of the layer stacked on it); None past ``limit`` of them (not known)."""
    return descendants(g, seeds, lambda c: len(c.input) <= 8 and allowed(c), limit)


def series_leads(g: Graph, names: list[str | None], sigs: list[int | None]) -> list[int]:
    """The leading unit axes of each step's value in a series (``lead_of``, 0 when unknown), asked of the
    graph only where the steps change: a step computed like the one before it (equal signatures) from a value
    of the same lead has that lead too. (Asked per step, a big model inferred a cone per step: 1,000 of them for
    the first layer of a stacked torch trace, 0.5 s.)"""
    leads: list[int | None] = []
    for k, name in enumerate(names):
        if k >= 2 and sigs[k] is not None and sigs[k] == sigs[k - 1] and leads[k - 1] is not None and leads[k - 1] == leads[k - 2]:
            leads.append(leads[k - 1])
        else:
            leads.append(lead_of(g, name) if name is not None else None)
    return [lead or 0 for lead in leads]


def value_lead(g: Graph, name: str, series: dict[str, list], sigs: dict[str, list]) -> int:
    """The leading unit axes of ``name`` (0 when unknown): by :func:`series_leads` when it is a value of one of
    the chain's per-step ``series`` (role -> names), else ``lead_of``. (The last step's h asked on its own, in a
    big graph where no type is declared, walked its cone back to the chain's start, once for every value
    ``lead_of`` followed.)"""
    for role, names in series.items():
        if name in names:
            k = names.index(name)
            return series_leads(g, names[: k + 1], sigs[role][: k + 1])[k]
    return lead_of(g, name) or 0


def _step_tensors(g: Graph, chain: Chain, k: int, iv, op_type: str) -> list[str]:
    """Outputs of ``op_type`` nodes that belong to step k."""
    t = chain.steps[k].t
    out = []
    for name, _ in iv.in_order(1 if chain.direction == "forward" else 0, t, chain.steps[k].lane_nodes):
        p = g.producer.get(name)
        if p is not None and p.op_type == op_type:
            out.append(name)
    return out

def _candidates(g: Graph, chain: Chain, k: int, iv, op_type: str, leaves: dict, allowed, reads_h: bool) -> list[str]:
    """Step k's ``op_type`` tensors that may be the one sought. A bidirectional layer's last forward step
    shares its interval end with every value of the backward half, a stacked layer's last step with the other
    layer's: thousands of candidates, each walked in vain (and every one of them when nothing matches: a dead
    last h or c, quadratic). What reads h comes first, and only that when the one sought reads h (the same
    leaves reached)."""
    names = _step_tensors(g, chain, k, iv, op_type)
    near = _computed_from(g, [name for name, role in leaves.items() if role == "h"], allowed)
    if reads_h and near is not None:
        names = [name for name in names if name in near]
    elif near:
        names.sort(key=lambda name: name not in near)
    return names


def find_symbolic(g: Graph, e: StepEval, chain: Chain, k: int, iv, op_type: str, want: Poly, leaves: dict, allowed,
                  reads_h: bool) -> str | None:
    """The tensor of step k whose maths (``e``: the step evaluated) are ``want`` (found as
    :func:`step_output` finds one by signature)."""
    for name in _candidates(g, chain, k, iv, op_type, leaves, allowed, reads_h):
        try:
            if e.poly(name).key == want.key:
                return name
        except Decline:
            continue
    return None

def chain_outputs(g: Graph, chain: Chain, series: dict, escapes: Escapes, mask_values: set,
                  initial: set) -> tuple[list, dict]:
    """What the rest of the graph reads of the chain: stacks of a per-step series ((role, tensor,
    time axis, reversed)), the last step's values (role -> tensor) and the hidden state of other steps
    read one by one ((k, tensor)). Anything else declines."""
    n = len(chain.steps)
    ts = [s.t for s in chain.steps]
    index = {t: (r, k) for r, names in series.items() for k, t in enumerate(names) if t}
    shared = read_by_others(g, chain, initial)
    chain_nodes = escapes.ids
    for nd, o, _ in escapes.entries:
        if o in index or o in mask_values or shape_derived(g, o) or _stacking(g, nd, o, index, chain_nodes):
            continue
        if not g.is_graph_output(o) and shared(o):
            continue
        raise Decline(f"an inner value of the chain ('{o}') is read outside it")
    cats: dict[int, list] = {}
    extra: list[tuple[str, int, str]] = []
    for t, (r, k) in index.items():
        for u in g.uses(t):
            if u.op_type == "Unsqueeze" and not g.is_graph_output(u.output[0]):
                # stacked (the same Unsqueeze may also be a no-op reshape inside the step)
                outside = [c for c in g.uses(u.output[0]) if id(c) not in chain_nodes]
                if outside and all(c.op_type == "Concat" for c in outside):
                    for cat in {id(c): c for c in outside}.values():
                        cats.setdefault(id(cat), [cat, r, []])[2].append((k, u))
                    continue
            if id(u) in chain_nodes:
                continue
            if u.op_type == "Concat" and attr(u, "axis") == 0 and lead_of(g, t) == 1:
                cats.setdefault(id(u), [u, r, []])[2].append((k, None))  # [1, B, H] states concatenated on time
                continue
            extra.append((r, k, t))
        if g.is_graph_output(t):
            extra.append((r, k, t))
    stacks = []
    for cat, r, items in cats.values():
        got = _stack_output(g, chain, cat, items, series[r])
        if got is None:
            extra.extend((r, k, series[r][k]) for k, _ in items)
        else:
            stacks.append((r,) + got)
    finals: dict[str, str] = {}
    step_reads: list[tuple[int, str]] = []
    for r, k, t in extra:
        if k == n - 1:
            finals[r] = t
        elif r == "h":
            step_reads.append((k, t))  # given its step of Y
        else:
            what = {"c": "cell state"}.get(r, "output")
            raise Decline(f"the {what} of step {ts[k]} is read outside the chain (a native op outputs only the last)")
    if step_reads and "h" in finals:
        # the last step's h read beside the others (a stacked chain's next layer, a head per step): its step of
        # Y too (equal to Y_h), so whatever reads every step reads one sequence
        step_reads.append((n - 1, finals.pop("h")))
    return stacks, finals, step_reads

def _stack_output(g: Graph, chain: Chain, cat: NodeProto, items, names) -> tuple | None:
    """``Concat(Unsqueeze(v_k, a) for every step, axis=a)`` -> (tensor, its time axis, reversed, the product the
    stack is read as, or "": :func:`rnnfuse.zeroed_outputs.product_of`)."""
    n = len(chain.steps)
    axis = attr(cat, "axis")
    direct = all(u is None for _, u in items)  # [1, B, H] states concatenated as they are
    if direct:
        by_name = {names[k]: k for k, _ in items}
    by_node = {id(u): k for k, u in items if u is not None}
    ks = []
    for name in cat.input:
        if direct:
            if name not in by_name:
                return None
            ks.append(by_name[name])
            continue
        p = g.producer.get(name)
        if p is None or id(p) not in by_node:
            return None
        ks.append(by_node[id(p)])
    if sorted(ks) != list(range(n)):
        return None
    for k, u in items:
        if u is None:
            continue
        if op_args.axes(u, g.model.opset, op_args.const_reader(g, u)) != [axis]:
            return None
    if axis < 0:
        axis += 3
    if axis not in (0, 1, 2) or (axis == 2 and lead_of(g, names[ks[0]]) != 0):
        return None  # ([B, H] steps stacked on the last axis: [B, H, T], torch.stack(outs, 2))
    ts = [chain.steps[k].t for k in ks]
    if ts == sorted(ts):
        time_order = True
    elif ts == sorted(ts, reverse=True):
        time_order = False
    else:
        return None
    processing_order = time_order == (chain.direction == "forward")
    return cat.output[0], axis, not processing_order, product_of(g, cat.output[0])
