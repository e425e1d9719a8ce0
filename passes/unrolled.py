"""Unrolled-chain front end: one cell per time step, written out (torch trace/dynamo, Keras unroll=True).

1. **Families.** Step inputs are slices of one tensor at constant indices: ``Gather(S, t)``,
   ``Squeeze(Slice(S, t, t+1))``, ``Squeeze(Split(S)[t])`` along a time axis.
2. **Intervals.** For every tensor, the lowest and highest step index whose input it depends on (one
   topological pass). A forward chain's step t computes values whose interval ends at t, a backward
   chain's values whose interval starts at t.
3. **Threading.** A step's *combining* nodes mix its input with something older; walking that something back
   through weight matmuls and slices finds the carried state h. A state of step t whose interval ends at
   t-1 links step t-1 -> t (forward); one starting at t+1 links t+1 -> t (backward).
4. **One cell, every step.** A middle step is evaluated symbolically (its h as a State leaf; any other value
   from an earlier step, like the LSTM cell state, becomes a State leaf of its own) and recognised; then
   *every* step must compute exactly the same polynomials (the first step may see a zero initial state that
   the exporter folded into constants: it must equal the cell with that state at zero).
5. **Outputs.** Per-step hidden states stacked with ``Unsqueeze`` + ``Concat`` become the sequence output,
   the last step's h and c the final states, and any other use of a step's h a ``Gather`` of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto

from rnnfuse.dims import static_dim
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.pipeline import Options, PassResult
from rnnfuse.recurrence import FinalOutput, Init, Recurrence, SeqOutput
from rnnfuse.rewrite import apply_recurrences, declined
from rnnfuse.step import StepState, analyse
from rnnfuse.symbolic import Bool, Poly, State, StepEvaluator, Sym, X, loose_key, zero_states

# ops a carried state passes through on its way to a combining node (one non-constant input each)
_STATE_SIDE = {"Gemm", "MatMul", "Split", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Add", "Mul", "Sub", "Cast", "Gather"}
_SLICERS = {"Gather", "Slice", "Split"}


# ----------------------------------------------------------------------------------------------- families


def _axis_index(g: Graph, node: NodeProto) -> tuple[str, int, int] | None:
    """(source, axis, index) if ``node`` takes one slice at a constant index (rank kept or reduced)."""
    src = node.input[0]
    rank = g.model.rank(src)
    if node.op_type == "Gather":
        idx = g.const(node.input[1])
        if idx is None or np.asarray(idx).ndim != 0:
            return None
        ax = attr(node, "axis", 0)
        t = int(idx)
    elif node.op_type == "Slice":
        if g.model.opset < 10:
            return None
        vals = [g.const(i) if i else None for i in node.input[1:5]] + [None] * (5 - len(node.input))
        starts, ends, axes, steps = vals[:4]
        if starts is None or ends is None or starts.size != 1:
            return None
        if steps is not None and int(steps.ravel()[0]) != 1:
            return None
        ax = int(axes.ravel()[0]) if axes is not None else 0
        t, e = int(starts.ravel()[0]), int(ends.ravel()[0])
        if e != t + 1 and not (t == -1 and e >= 2**31 - 1):
            return None
    else:
        return None
    if ax < 0:
        if rank is None:
            return None
        ax += rank
    if t < 0:
        d = static_dim(g, src, ax)
        if d is None:
            return None
        t += d
    return src, ax, t


def _squeezed(g: Graph, name: str, axis: int) -> str | None:
    """The single consumer of ``name`` that drops ``axis`` (Squeeze/Reshape), if any."""
    users = g.uses(name)
    if len(users) != 1:
        return None
    u = users[0]
    if u.op_type == "Squeeze":
        axes = attr(u, "axes") if g.model.opset < 13 else (g.const(u.input[1]) if len(u.input) > 1 else None)
        axes = [int(a) for a in np.asarray(axes).ravel()] if axes is not None else None
        rank = g.model.rank(name)
        if axes is not None and rank:
            axes = [a + rank if a < 0 else a for a in axes]
        if axes == [axis]:
            return u.output[0]
    return None


def find_families(g: Graph) -> dict[tuple[str, int], dict[int, str]]:
    fams: dict[tuple[str, int], dict[int, str]] = {}
    for n in g.live_nodes():
        if n.op_type not in _SLICERS or g.const(n.input[0]) is not None:
            continue
        if n.op_type == "Split":
            ax = attr(n, "axis", 0)
            rank = g.model.rank(n.input[0])
            if ax < 0 and rank:
                ax += rank
            for t, o in enumerate(n.output):
                x = _squeezed(g, o, ax)
                if x is not None:
                    fams.setdefault((n.input[0], ax), {})[t] = x
            continue
        ai = _axis_index(g, n)
        if ai is None:
            continue
        src, ax, t = ai
        x = n.output[0]
        if n.op_type == "Slice":
            x = _squeezed(g, x, ax)
            if x is None:
                continue
        fam = fams.setdefault((src, ax), {})
        if t in fam:
            continue  # the same slice taken twice: keep the first (dedupe makes them one)
        fam[t] = x
    return {k: v for k, v in fams.items() if len(v) >= 2}


# ----------------------------------------------------------------------------------------------- chains


@dataclass
class Step:
    t: int
    x: str
    roots: set = field(default_factory=set)  # carried-state tensors read through weight matmuls / slices
    pulled: set = field(default_factory=set)  # ids of state-side nodes between a root and the step
    mask: str | None = None


@dataclass
class _Found:
    """Per step and direction: older tensors the step reads and the nodes walked to reach them."""

    roots: set = field(default_factory=set)
    pulled: set = field(default_factory=set)


@dataclass
class Chain:
    direction: str
    steps: list  # in processing order


def _intervals(g: Graph, order: list[NodeProto], leaves: dict[str, int]) -> dict[str, tuple[int, int]]:
    iv: dict[str, tuple[int, int]] = {x: (t, t) for x, t in leaves.items()}
    for n in order:
        lo = hi = None
        for i in n.input:
            v = iv.get(i)
            if v is not None:
                lo = v[0] if lo is None else min(lo, v[0])
                hi = v[1] if hi is None else max(hi, v[1])
        if lo is not None:
            for o in n.output:
                if o and o not in leaves:
                    iv[o] = (lo, hi)
    return iv


def _root(g: Graph, name: str, iv, pulled: set, stop: dict, limit: int = 12) -> str | None:
    """Walk a combining node's older input back through state-side ops to the carried tensor."""
    for _ in range(limit):
        if name in stop:
            return name
        p = g.producer.get(name)
        if p is None or p.op_type not in _STATE_SIDE:
            return name
        dyn = [i for i in p.input if i and g.const(i) is None]
        if len(dyn) != 1:
            return name
        if p.op_type in ("MatMul", "Gemm") and p.input[0] != dyn[0]:
            return name
        pulled.add(id(p))
        name = dyn[0]
    return name


def find_chains(g: Graph, fam: dict[int, str], iv, mask_fam: dict[int, str] | None) -> list[Chain]:
    """Thread the steps of a family into chains (forward and backward)."""
    xs = {x: t for t, x in fam.items()}
    found: dict[tuple[str, int], _Found] = {}
    for t, x in fam.items():
        # the x-local region: nodes computed from x_t (and constants) only
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
                dyn = [i for i in c.input if i and g.const(i) is None]
                if all(i in local for i in dyn) and not g.implicit_inputs(c):
                    for o in c.output:
                        if o:
                            local.add(o)
                            frontier.append(o)
                else:
                    combining.append(c)
        mask_t = mask_fam.get(t) if mask_fam else None
        for c in combining:
            for i in c.input:
                if not i or i in local or g.const(i) is not None or i in xs or i == mask_t:
                    continue
                pulled: set = set()
                r = _root(g, i, iv, pulled, xs)
                if r in xs:
                    continue
                riv = iv.get(r)
                for direction in ("forward", "reverse"):
                    if riv is not None and not (riv[1] < t if direction == "forward" else riv[0] > t):
                        continue
                    f = found.setdefault((direction, t), _Found())
                    f.roots.add(r)
                    f.pulled |= pulled
    chains: list[Chain] = []
    for direction in ("forward", "reverse"):
        succ: dict[int, int] = {}
        has_pred: set[int] = set()
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
        for t in sorted(fam, reverse=(direction == "reverse")):
            if t in has_pred or t not in succ:
                continue
            seq = [t]
            while seq[-1] in succ:
                seq.append(succ[seq[-1]])
            if len(seq) < 2:
                continue
            steps = []
            for k in seq:
                f = found.get((direction, k), _Found())
                steps.append(Step(k, fam[k], set(f.roots), set(f.pulled), mask_fam.get(k) if mask_fam else None))
            chains.append(Chain(direction, steps))
    return chains


class _StepEval:
    """Evaluate one step: its x, mask and carried h are leaves; one other older value may be the cell state."""

    def __init__(self, g: Graph, chain: Chain, k: int, iv, h_in: str | None, x_atom: X):
        st = chain.steps[k]
        t = st.t
        fwd = chain.direction == "forward"
        self.c_in: str | None = None

        def allowed(n: NodeProto) -> bool:
            if id(n) in st.pulled:
                return True
            o = next((o for o in n.output if o), None)
            v = iv.get(o)
            if v is None:
                return False
            return (v[1] == t) if fwd else (v[0] == t)

        def foreign(name: str):
            if self.c_in is None:
                self.c_in = name
                return Sym(Poly.atom(C_STATE))
            if name == self.c_in:
                return Sym(Poly.atom(C_STATE))
            raise Decline(f"step {t} reads more than two carried values ('{self.c_in}', '{name}')")

        leaves = {st.x: Sym(Poly.atom(x_atom))}
        if h_in is not None:
            leaves[h_in] = Sym(Poly.atom(H_STATE))
        if st.mask is not None:
            leaves[st.mask] = Bool("m", False, g.model.rank(st.mask) == 2)
        self.ev = StepEvaluator(g, leaves, may_evaluate=allowed, foreign=foreign, content_keys=True)

    def poly(self, name: str) -> Poly:
        return self.ev.poly(name)


H_STATE = State("h", None)
C_STATE = State("c", None)


def _single_root(st: Step) -> str:
    if len(st.roots) != 1:
        raise Decline(f"step {st.t} reads {len(st.roots)} carried values through weights (expected one hidden state)")
    return next(iter(st.roots))


def chain_recurrence(g: Graph, src: str, axis: int, chain: Chain, iv) -> Recurrence:
    steps = chain.steps
    n = len(steps)
    ts = [s.t for s in steps]
    rank = g.model.rank(src)
    if rank != 3 or axis not in (0, 1):
        raise Decline(f"the per-step inputs are slices of a rank-{rank} tensor along axis {axis}")
    if sorted(ts) != list(range(min(ts), max(ts) + 1)):
        raise Decline("the chain skips time steps")
    F = static_dim(g, steps[0].x, -1)
    x_atom = X("x", F)
    h_in: list[str | None] = [None] * n
    for k in range(1, n):
        h_in[k] = _single_root(steps[k])
    if steps[0].roots:
        h_in[0] = _single_root(steps[0])
    evals = [_StepEval(g, chain, k, iv, h_in[k], x_atom) for k in range(n)]
    h_new: list[str | None] = [h_in[k + 1] for k in range(n - 1)] + [None]
    # evaluate each step's new h: this also reveals the cell state it reads (LSTM c)
    p_h: list[Poly | None] = [None] * n
    for k in range(n - 1):
        p_h[k] = evals[k].poly(h_new[k])
    c_in = [e.c_in for e in evals[: n - 1]] + [None]
    lstm = any(c is not None for c in c_in[1:])
    c_new: list[str | None] = [None] * n
    if lstm:
        for k in range(1, n - 1):
            if c_in[k] is None:
                raise Decline(f"step {ts[k]} does not read the cell state")
            c_new[k - 1] = c_in[k]
    # recognise the cell on a middle step (the first one may have seen a folded zero state)
    km = 1 if n > 2 else 0
    if n == 2 and (h_in[0] is None):
        raise Decline("a two-step chain with a folded initial state")
    mid = evals[km]
    states = {"h": H_STATE}
    step_states = [StepState("h", p_h[km], Init())]
    if lstm:
        if c_new[km] is None:
            raise Decline("the cell state's next value cannot be found")
        states["c"] = C_STATE
        step_states.append(StepState("c", mid.poly(c_new[km]), Init()))
    an = analyse(x_atom, step_states, [], states)
    if an.masked:
        raise Decline("masked unrolled chains are not supported")
    spec = an.rec.spec
    expected = spec.step_polys(Poly.atom(x_atom), Poly.atom(H_STATE), Poly.atom(C_STATE) if lstm else None)
    # the last step's outputs: tensors of the same kind as the previous step's that compute the cell
    last = evals[n - 1]
    h_new[n - 1] = _find_output(g, last, steps[n - 1], iv, chain, g.producer[h_new[n - 2]].op_type, expected["h"])
    if h_new[n - 1] is None:
        raise Decline("the last step's hidden output cannot be found")
    p_h[n - 1] = last.poly(h_new[n - 1])
    if lstm:
        if last.c_in is None:
            raise Decline(f"step {ts[-1]} does not read the cell state")
        c_new[n - 2] = last.c_in
        c_new[n - 1] = _find_output(g, last, steps[n - 1], iv, chain, g.producer[c_new[n - 2]].op_type, expected["c"])
    # every step computes the same cell
    zero = set()
    if h_in[0] is None:
        zero.add("h")
    if lstm and evals[0].c_in is None:
        zero.add("c")
    for k in range(n):
        e = evals[k]
        outs = {"h": p_h[k]}
        if lstm and c_new[k] is not None:
            outs["c"] = e.poly(c_new[k])
        for sym, p in outs.items():
            want = expected[sym]
            if k == 0 and zero:
                if loose_key(p) != loose_key(zero_states(want, {"h" if z == "h" else "c" for z in zero})):
                    raise Decline(f"the first step is not the cell with a zero initial state ({sym})")
            elif p.key != want.key:
                raise Decline(f"step {ts[k]} computes a different cell than step {ts[km]} ({sym})")
    chain_nodes: set[int] = set()
    for e in evals:
        chain_nodes |= e.ev.visited_nodes
    x = src
    T = static_dim(g, src, axis)
    if not (min(ts) == 0 and T is not None and max(ts) == T - 1):
        b = g.add_node(
            "Slice",
            [src, g.add_initializer(np.array([min(ts)], np.int64), "rnnfuse/start"),
             g.add_initializer(np.array([max(ts) + 1], np.int64), "rnnfuse/end"),
             g.add_initializer(np.array([axis], np.int64), "rnnfuse/axis")],
            1, name="rnnfuse/Slice", anchor=g.producer.get(h_new[-1]),
        )
        x = b[0]
    rec = Recurrence(
        front="chain",
        where=f"{chain.direction} chain over '{src}' (axis {axis}), steps {ts[0]}..{ts[-1]}: {n} cells",
        cell=spec,
        x=x,
        h0=Init(h_in[0], None) if h_in[0] is not None else Init(),
        c0=Init(evals[0].c_in, None) if lstm and evals[0].c_in is not None else Init(),
        anchor=g.producer.get(h_new[-1]),
        x_batch_first=axis == 1,
        x_reversed=chain.direction == "reverse",
    )
    _collect_outputs(g, rec, chain, h_new, c_new, chain_nodes, lstm)
    return rec


def _find_output(g: Graph, e: _StepEval, st: Step, iv, chain: Chain, op_type: str, want: Poly) -> str | None:
    """The tensor of step ``st`` produced by an ``op_type`` node whose polynomial is ``want``."""
    t = st.t
    fwd = chain.direction == "forward"
    for name, v in iv.items():
        if ((v[1] != t) if fwd else (v[0] != t)):
            continue
        p = g.producer.get(name)
        if p is None or p.op_type != op_type:
            continue
        try:
            if e.poly(name).key == want.key:
                return name
        except Decline:
            continue
    return None


def _collect_outputs(g: Graph, rec: Recurrence, chain: Chain, h_new, c_new, chain_nodes: set, lstm: bool) -> None:
    steps = chain.steps
    n = len(steps)
    ts = [s.t for s in steps]
    h_index = {h: k for k, h in enumerate(h_new)}
    c_index = {c: k for k, c in enumerate(c_new) if c}
    # nothing computed inside the chain may be read outside it, except the states
    for nid_node in (nd for nd in g.live_nodes() if id(nd) in chain_nodes):
        for o in nid_node.output:
            if not o or o in h_index or o in c_index:
                continue
            if g.is_graph_output(o) or any(id(u) not in chain_nodes for u in g.uses(o)):
                raise Decline(f"an inner value of the chain ('{o}') is read outside it")
    stacks: dict[int, list] = {}
    extra: list[tuple[str, int]] = []
    for k, h in enumerate(h_new):
        for u in g.uses(h):
            if id(u) in chain_nodes:
                continue
            cat_users = g.uses(u.output[0]) if u.op_type == "Unsqueeze" else []
            if len(cat_users) == 1 and cat_users[0].op_type == "Concat" and not g.is_graph_output(u.output[0]):
                cat = cat_users[0]
                stacks.setdefault(id(cat), [cat, []])[1].append((k, u))
                continue
            extra.append((h, k))
        if g.is_graph_output(h):
            extra.append((h, k))
    for cat, items in stacks.values():
        if not _stack_output(g, rec, chain, cat, items):
            extra.extend((h_new[k], k) for k, _ in items)
    done = set()
    for h, k in extra:
        if k == n - 1:
            if h not in done:
                rec.finals.append(FinalOutput(h, "h"))
                done.add(h)
        else:
            raise Decline(f"the hidden state of step {ts[k]} is read outside the chain (not stacked)")
    for k, c in enumerate(c_new):
        if not c:
            continue
        outside = [u for u in g.uses(c) if id(u) not in chain_nodes]
        if not outside and not g.is_graph_output(c):
            continue
        if k != n - 1:
            raise Decline(f"the cell state of step {ts[k]} is read outside the chain")
        rec.finals.append(FinalOutput(c, "c"))


def _stack_output(g: Graph, rec: Recurrence, chain: Chain, cat: NodeProto, items) -> bool:
    """``Concat(Unsqueeze(h_k, a) for every step, axis=a)`` -> a sequence output."""
    n = len(chain.steps)
    axis = attr(cat, "axis")
    by_node = {id(u): k for k, u in items}
    ks = []
    for name in cat.input:
        p = g.producer.get(name)
        if p is None or id(p) not in by_node:
            return False
        ks.append(by_node[id(p)])
    if sorted(ks) != list(range(n)):
        return False
    for k, u in items:
        ax = attr(u, "axes") if g.model.opset < 13 else g.const(u.input[1])
        if ax is None or [int(a) for a in np.asarray(ax).ravel()] != [axis]:
            return False
    if axis < 0:
        axis += 3
    if axis not in (0, 1):
        return False
    ts = [chain.steps[k].t for k in ks]
    if ts == sorted(ts):
        time_order = True
    elif ts == sorted(ts, reverse=True):
        time_order = False
    else:
        return False
    processing_order = time_order == (chain.direction == "forward")
    rec.seq_outputs.append(SeqOutput(cat.output[0], "none", Init(), batch_first=axis == 1, reversed=not processing_order))
    return True


class FuseChains:
    """Rewrite unrolled per-step cell chains into native ops (repeats while new chains appear: stacks)."""

    name = "unrolled"
    max_rounds = 8

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        tried: set = set()
        for _ in range(self.max_rounds):
            fams = find_families(g)
            if not fams:
                break
            order = g._toposort(g.live_nodes())
            bool_fams = {k: v for k, v in fams.items() if g.model.elem_type(next(iter(v.values()))) == 9}
            recs = []
            for (src, axis), fam in fams.items():
                if (src, axis) in bool_fams:
                    continue
                iv = _intervals(g, order, {x: t for t, x in fam.items()})
                mask_fam = None
                for chain in find_chains(g, fam, iv, mask_fam):
                    key = (src, axis, chain.direction, chain.steps[0].t)
                    if key in tried:
                        continue
                    tried.add(key)
                    try:
                        recs.append((chain_recurrence(g, src, axis, chain, iv), {}))
                    except Decline as d:
                        res.findings.append(declined(self.name, "chain", f"{chain.direction} chain over '{src}' (axis {axis})", d.reason))
            if not recs:
                break
            before = res.modified
            apply_recurrences(g, ctx, self.name, recs, res)
            if res.modified == before and not res.modified:
                break
        return res
