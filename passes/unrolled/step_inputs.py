"""Per-step inputs that are any state-independent tensor (issue 14 item 7).

An unrolled step may read ``2 * x[t]``, ``x[t] - x[t-1]``, every other step, the steps in a permuted order: the
values the cells read are then not the slices of one tensor in step order, so the slice families cannot thread
them. Here the steps are found from the cells instead:

1. **Preparation.** Values computed from the slices of the data families and of the non-bool row families
   (token ids: an embedding looked up per step is ``Gather(E, tokens[:, t])``), constants and tensors that
   depend on no slice, by elementwise, cast, reshaping and gathering ops, never by an activation, and by a
   weight matmul only where another weight matmul reads its result through preparation (GNMT's residual
   ``h1_t + proj(x_t)``, read by the upper cell's own input matmul): no cell state is among them (every cell
   multiplies its state and activates), so none depends on the recurrence. Where that finds no chain, a
   Concat also joins values computed from no slice to a prepared one: the step's features beside x_t (its
   time ``t / T``, a position table's row broadcast to the batch), which differ from step to step, so no
   single map of x (:mod:`.whole_inputs`) computes them.
2. **Step inputs.** Prepared values that something else reads: what the cells read, one per step. A node
   mixing one with the state of a step whose input is computed from it (``h2_t + h1_t``, ``h1_t + x_t`` being
   the step's input) is a head of that step, not a step reading the state of the one before.
3. **Order.** One topological pass gives every tensor an owner, the step input its computation started
   from. A node that mixes a step input's projection (the input itself, or it through a weight matmul,
   slices and bias adds) with values of other owners is where that step reads its state: the state's
   deepest owner is the step before. Other mixing nodes belong to their deepest owner (an LSTM step's
   ``f * c`` reads the cell state of the step before).
4. The steps linked that way, in order, are a family of their own: the sequence the native op reads is
   their inputs stacked (``Concat`` of ``Unsqueeze``), built only for a chain being fused.

Only chains the slice families leave unthreaded are looked for (see :func:`virtual_families`), and only
unmasked ones (a mask's slices are indexed by time, which the steps' order no longer is).
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.dataflow import dynamic_inputs
from rnnfuse.graph import Graph


# state-independent preparation of a step's input: arithmetic, casts, reshapes, broadcasts and slices (no matmul,
# no activation)
_PREP = {"Add", "Sub", "Mul", "Div", "Neg", "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Concat",
         "Slice", "Gather", "Dropout", "Transpose", "Flatten", "Expand", "Tile"}
# what lies between a step input and the node that combines it with the state (a weight matmul, its bias)
_PROJECTION = {"Gemm", "MatMul", "Split", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Add", "Sub",
               "Mul", "Cast", "Gather", "Transpose"}


class VirtualFamily(dict):
    """position -> step input, in processing order; ``sources`` the data families' sources it reads."""

    def __init__(self, inputs: list[str], sources: list[str]):
        super().__init__(enumerate(inputs))
        self.sources = sources

    def describe(self) -> str:
        return f"the step inputs computed from {', '.join(repr(s) for s in self.sources)}"


def virtual_families(g: Graph, order: list[NodeProto], fams: dict) -> list[VirtualFamily]:
    """Chains of steps threaded through their cells, whose inputs are not the slices of one tensor read in
    step order (those are the slice families' chains)."""
    slice_src: dict[str, tuple[str, int, int]] = {}
    for (src, axis), fam in fams.items():
        if g.model.elem_type(src) == 9:
            continue  # (bool: masks)
        # (a row family, one value a row, is a step input once prepared into one: an embedding looked up per
        # step, ``E(tokens[:, t])``)
        for t, x in fam.items():
            slice_src[x] = (src, axis, t)
    if not slice_src:
        return []
    # (only the nodes computed from a slice: every node the walks below can take, not the other 99% of a
    # 100k-node graph whose chain is a few steps)
    reached = set(map(id, g.downstream(list(slice_src))))
    order = [n for n in order if id(n) in reached]
    # a Concat joining a slice to values computed from no slice is a step input only where nothing is found
    # without that: a cell reading cat([x_0, h0]) at its first step (h0 a zero fill: the state folded) would
    # start its chain with a step input of another width. Searched again only when such a Concat was refused
    # (else the search finds the same again: a graph of time slices and no chain paid its search twice)
    refused: list[NodeProto] = []
    found = _threaded(g, order, slice_src, False, refused)
    return found if found or not refused else _threaded(g, order, slice_src, True)


def _threaded(g: Graph, order: list[NodeProto], slice_src: dict, joins: bool,
              refused: list | None = None) -> list[VirtualFamily]:
    """Steps 1-4 of :func:`virtual_families` over ``order`` (the nodes computed from a slice); ``joins``: a
    Concat of prepared values and values computed from no slice prepares (:func:`_prepared`), else such a
    Concat is added to ``refused``."""
    # 1. preparation: values computed from slices (and slice-free tensors) without an activation, and without a
    # matmul but one that projects what another matmul reads (``h1_t + proj(x_t)`` read by the cell's)
    # (every weight product taken first; then only the nodes that took, a few per step, are walked again with
    # the projections alone: what is prepared then is a part of what was)
    wide, sliced, took = _prepared(g, order, slice_src, lambda n: True, joins=joins, refused=refused)
    took_ids = {id(n) for n in took}
    products = [n for n in took if n.op_type not in _PREP]
    if any(id(u) in took_ids for n in products for u in g.uses(n.output[0])):
        projections = _projections(g, took, wide)
        prep = _prepared(g, took, slice_src, lambda n: id(n) in projections, sliced, joins)[0]
    else:  # (no product's value prepared further: each is a cell's own, the rest is prepared without them)
        prep = wide.difference(n.output[0] for n in products)
    # 2. step inputs: prepared values read by something else
    inputs: dict[str, int] = {}
    for n in order:
        if n.op_type in ("Shape", "Size") or (n.output and n.output[0] in prep) or not any(i in prep for i in n.input):
            continue
        for i in dynamic_inputs(g, n):
            if i in prep and i not in inputs:
                inputs[i] = len(inputs)
    if len(inputs) < 2:
        return []
    # 3. owners and links
    owner: dict[str, str] = {u: u for u in inputs}
    within = _parts_of_inputs(g, inputs, prep)
    pred: dict[str, str] = {}
    succ: dict[str, str | None] = {}  # (None: more than one step reads this one's state)
    depth: dict[str, int] = {}
    for n in order:
        if (n.output and n.output[0] in prep) or not any(i in owner for i in n.input):
            continue
        dyn = dynamic_inputs(g, n)
        owners = {owner[i] for i in dyn if i in owner}
        if not owners:
            continue
        if len(owners) == 1:
            own = next(iter(owners))
        else:
            own = _link(g, n, dyn, owner, within, pred, succ, depth)
        if own is None:
            continue
        for o in n.output:
            if o:
                owner[o] = own
    # 4. chains: follow the links from each step no step precedes
    out = []
    for u in inputs:
        if u in pred or succ.get(u) is None:
            continue
        seq = [u]
        while succ.get(seq[-1]) is not None and len(seq) <= len(inputs):
            seq.append(succ[seq[-1]])
        if len(seq) < 2 or _slice_chain(seq, slice_src):
            continue
        sources = sorted({src for s in seq for src in _sources(g, s, slice_src)})
        out.append(VirtualFamily(seq, sources))
    return out


def _prepared(g: Graph, order: list[NodeProto], slice_src: dict, matmul_taken, sliced: set[str] | None = None,
              joins: bool = False, refused: list | None = None) -> tuple[set[str], set[str], list[NodeProto]]:
    """``(prepared values, the values depending on a slice, the nodes computing prepared values)``: the values
    computed from the slices (and slice-free tensors) by preparation ops, and by the weight products
    ``matmul_taken(node)`` accepts. ``sliced``: the second, known already (``order`` may then be a part).
    A Concat prepares when every part is prepared, or with ``joins`` when the others are computed from no
    slice (``cat([x[t], t / T])``, ``cat([x[t], pos[t].expand(B, -1)])``: features of the step beside x_t);
    without ``joins`` such a Concat is added to ``refused``."""
    known = sliced is not None
    sliced = sliced if known else set(slice_src)
    prep: set[str] = set(slice_src)
    took: list[NodeProto] = []
    # (each loop asks a node's dynamic inputs only when one of its inputs is of interest: those are a subset of
    # its inputs, and asking is a walk's memo lookup per input, seconds over every node of a 100k-node graph)
    for n in order:
        if not any(i in sliced for i in n.input):
            continue
        dyn = dynamic_inputs(g, n)
        if not any(i in sliced for i in dyn):
            continue
        if not known:
            sliced.update(o for o in n.output if o)
        if n.op_type in _PREP:
            taken = not g.implicit_inputs(n) and all(i in prep or i not in sliced for i in dyn)
            if taken and n.op_type == "Concat":
                # (a part computed from no slice joins x_t only with ``joins``: without, a Concat with a constant
                # or zero part is a cat([x, h]) cell's first step, h = 0 folded)
                joinable = len(n.input) <= 8 and all(i in prep or i not in sliced for i in n.input)
                taken = joinable and (joins or all(i in prep for i in n.input))
                if joinable and not taken and refused is not None:
                    refused.append(n)
        else:
            taken = len(dyn) == 1 and dyn[0] in prep and _is_weight_product(g, n, dyn) and matmul_taken(n)
        if taken:
            prep.update(o for o in n.output if o)
            took.append(n)
    return prep, sliced, took


def _is_weight_product(g: Graph, n: NodeProto, dyn: list[str] | None = None) -> bool:
    """A ``MatMul`` or ``Gemm`` of one runtime operand, on the left, by a constant weight."""
    if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
        return False
    if n.op_type == "Gemm" and any(a.name == "transA" and a.i for a in n.attribute):
        return False
    return (dyn if dyn is not None else dynamic_inputs(g, n)) == [n.input[0]]


def _projections(g: Graph, order: list[NodeProto], prep: set) -> set[int]:
    """The weight products among ``prep`` (computed with every weight product taken) whose value, through
    prepared values, another weight product reads: projections inside a step input. The others are the cells'
    own input products: the step input is what they read."""
    feeds: set[str] = set()  # prepared values a prepared weight product reads, directly or through preparation
    taken: set[int] = set()
    for n in reversed(order):
        if not n.output or n.output[0] not in prep:
            continue
        product = _is_weight_product(g, n)
        if product and n.output[0] in feeds:
            taken.add(id(n))
        if product or any(o in feeds for o in n.output):
            feeds.update(i for i in n.input if i in prep)
    return taken


def _parts_of_inputs(g: Graph, inputs: dict, prep: set, limit: int = 64) -> dict[str, set]:
    """Step input -> the other step inputs computed from it (``h1_t`` -> a residual step input ``h1_t + x_t``;
    ``x[t-1]`` -> ``x[t] - x[t-1]``)."""
    whole: dict[str, set] = {}
    for v in inputs:
        stack, seen = [v], {v}
        while stack and len(seen) < limit:
            p = g.producer.get(stack.pop())
            if p is None:
                continue
            for i in p.input:
                if i in prep and i not in seen:
                    seen.add(i)
                    stack.append(i)
                    if i in inputs:
                        whole.setdefault(i, set()).add(v)
    return whole


def _link(g: Graph, n: NodeProto, dyn: list[str], owner: dict, within: dict, pred: dict, succ: dict, depth: dict):
    """The owner of a node mixing several owners' values; links a step to the one before when ``n`` is where
    the step combines its input with its state. ``within``: step input -> the step inputs computed from it.
    Where the input is part of the one whose state is read (``h2_t + h1_t``, a head after the cell reading
    ``h1_t`` again, ``h1_t + x_t`` being the step's input) no step reads the one before: the node is that one's."""
    step_side, state_side = set(), set()
    for i in dyn:
        o = owner.get(i)
        if o is None:
            continue
        (step_side if _projection_of(g, i, o) else state_side).add(o)
    if len(step_side) == 1 and state_side and not (step_side & state_side):
        a = next(iter(step_side))
        deepest = _deepest(state_side, depth)
        if deepest is None:
            return None
        if deepest in within.get(a, ()):
            return deepest
        if a not in pred:
            if deepest in succ:
                succ[deepest] = None  # two steps read one state: no chain through it
                return a
            pred[a] = deepest
            succ[deepest] = a
            depth[a] = depth.get(deepest, 0) + 1
            return a
        if pred[a] == deepest:
            return a
    return _deepest(step_side | state_side, depth)


def _deepest(owners: set, depth: dict) -> str | None:
    best = max(depth.get(o, 0) for o in owners)
    top = [o for o in owners if depth.get(o, 0) == best]
    return top[0] if len(top) == 1 else None


def _projection_of(g: Graph, name: str, u: str, limit: int = 12) -> bool:
    """Whether ``name`` is step input ``u`` itself or ``u`` through a weight matmul, slices and bias adds."""
    for _ in range(limit):
        if name == u:
            return True
        p = g.producer.get(name)
        if p is None or p.op_type not in _PROJECTION:
            return False
        dyn = dynamic_inputs(g, p)
        if len(dyn) != 1:
            return False
        name = dyn[0]
    return False


def _slice_chain(seq: list[str], slice_src: dict) -> bool:
    """A chain over the slices of one tensor in step order, forward or backward: the slice families' business."""
    if not all(s in slice_src for s in seq):
        return False
    srcs = {slice_src[s][:2] for s in seq}
    ts = [slice_src[s][2] for s in seq]
    return len(srcs) == 1 and all(abs(b - a) == 1 for a, b in zip(ts, ts[1:])) and (ts == sorted(ts) or ts == sorted(ts, reverse=True))


def _sources(g: Graph, name: str, slice_src: dict, limit: int = 64) -> set[str]:
    """The sliced tensors a step input is computed from."""
    out, stack, seen = set(), [name], set()
    while stack and len(seen) < limit:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur in slice_src:
            out.add(slice_src[cur][0])
            continue
        p = g.producer.get(cur)
        if p is not None:
            stack.extend(i for i in p.input if i)
    return out
