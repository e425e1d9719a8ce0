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
from rnnfuse.recurrence import CellCheck, FinalOutput, Init, Recurrence, SeqOutput
from rnnfuse.inputs import input_projection, projected_leaf
from rnnfuse.rewrite import apply_recurrences, declined
from rnnfuse.step import StepState, analyse
from rnnfuse.symbolic import Bool, Fill, Poly, State, StepEvaluator, Sym, X, content_key, loose_key, zero_states

# ops a carried state passes through on its way to a combining node (one non-constant input each)
_STATE_SIDE = {"Gemm", "MatMul", "Split", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity", "Add", "Mul", "Sub", "Cast", "Gather"}
_SLICERS = {"Gather", "Slice", "Split"}


# ----------------------------------------------------------------------------------------------- families


def _axis_index(g: Graph, node: NodeProto) -> tuple[str, int, int] | None:
    """(source, axis, index) if ``node`` takes one slice at a constant index (rank kept or reduced)."""
    src = node.input[0]
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
        rank = g.model.rank(src)
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
        if axes is not None and any(a < 0 for a in axes):
            rank = g.model.rank(name)
            if rank is None:
                return None
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
            if ax < 0:
                rank = g.model.rank(n.input[0])
                if rank is None:
                    continue
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
    floats = (1, 10, 11, 16)  # float, float16, double, bfloat16 (bool families are masks)
    out = {}
    for (src, ax), v in fams.items():
        et, rank = g.model.elem_type(src), g.model.rank(src)
        if len(v) < 2 or (et is not None and et not in floats + (9,)) or (rank is not None and rank != 3):
            continue
        out[(src, ax)] = v
    return out


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


class Intervals(dict):
    """tensor -> (lo, hi): the range of step indices it depends on; ``nodes`` the same per node id."""

    def __init__(self):
        super().__init__()
        self.nodes: dict[int, tuple[int, int]] = {}


def _intervals(g: Graph, order: list[NodeProto], leaves: dict[str, int]) -> Intervals:
    iv = Intervals()
    iv.update({x: (t, t) for x, t in leaves.items()})
    get = iv.get
    for n in order:
        if n.op_type in ("Shape", "Size"):
            continue  # a shape does not depend on values
        lo = hi = None
        for i in n.input:
            v = get(i)
            if v is not None:
                if lo is None:
                    lo, hi = v
                else:
                    if v[0] < lo:
                        lo = v[0]
                    if v[1] > hi:
                        hi = v[1]
        if lo is not None:
            iv.nodes[id(n)] = (lo, hi)
            for o in n.output:
                if o and o not in leaves:
                    iv[o] = (lo, hi)
    return iv


def shape_derived(g: Graph, name: str) -> bool:
    """Whether a tensor depends on other tensors' shapes only (never on their values)."""
    memo = g.model.annotations.setdefault("shape_derived", {})
    if name in memo:
        return memo[name]
    stack = [name]
    while stack:
        cur = stack[-1]
        if cur in memo:
            stack.pop()
            continue
        p = g.producer.get(cur)
        if p is None or g.const(cur) is not None:
            memo[cur] = g.const(cur) is not None
            stack.pop()
            continue
        if p.op_type in ("Shape", "Size"):
            memo[cur] = True
            stack.pop()
            continue
        pending = [i for i in p.input if i and i not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[cur] = all(memo[i] for i in p.input if i) and bool([i for i in p.input if i])
        stack.pop()
    return memo[name]


def _root(g: Graph, name: str, iv, pulled: set, stop: dict, limit: int = 12) -> str | None:
    """Walk a combining node's older input back through state-side ops to the carried tensor."""
    for _ in range(limit):
        if name in stop:
            return name
        p = g.producer.get(name)
        if p is None or p.op_type not in _STATE_SIDE:
            return name
        dyn = [i for i in p.input if i and g.const(i) is None and not shape_derived(g, i)]
        if not dyn:
            return None  # computed from constants and shapes only: a zero initial state, not a carried value
        if len(dyn) != 1:
            return name
        if p.op_type in ("MatMul", "Gemm") and p.input[0] != dyn[0]:
            return name
        if not _keeps_rows(g, p):
            return name  # e.g. Slice(h0, layer) of a per-layer initial state: the state starts here
        pulled.add(id(p))
        name = dyn[0]
    return name


def _keeps_rows(g: Graph, p: NodeProto) -> bool:
    """Slicing ops on the way to a state must cut units (the last axis) or drop/add leading unit axes."""
    last = (lead_of(g, p.input[0]) or 0) + 1
    if p.op_type in ("Split", "Gather"):
        return attr(p, "axis", 0) in (-1, last)
    if p.op_type == "Slice":
        vals = [g.const(i) if i else None for i in list(p.input[1:5]) + [""] * (5 - len(p.input))]
        starts, ends, axes, steps = vals
        if axes is None:
            return False
        if all(int(ax) in (-1, last) for ax in axes.ravel()):
            return True  # units only (bounds may come from shapes, as in torch's chunk)
        if starts is None or ends is None:
            return False
        steps = steps if steps is not None else np.ones_like(starts)
        for s0, e0, ax, st in zip(starts.ravel(), ends.ravel(), axes.ravel(), steps.ravel()):
            full = int(s0) == 0 and int(e0) >= 2**31 - 1 and int(st) == 1
            if not full and int(ax) not in (-1, last):
                return False
        return True
    if p.op_type in ("Squeeze", "Unsqueeze"):
        axes = attr(p, "axes") if g.model.opset < 13 else (g.const(p.input[1]) if len(p.input) > 1 else None)
        return axes is not None and [int(v) for v in np.asarray(axes).ravel()] == [0]
    return True


def lead_of(g: Graph, name: str, depth: int = 0) -> int | None:
    """How many leading unit axes a [*, B, N] value has: declared rank - 2, or followed through
    Unsqueeze/Squeeze(axis 0) and elementwise ops (never runs shape inference)."""
    memo = g.model.annotations.setdefault("lead_of", {})
    if name in memo:
        return memo[name]
    declared = g.model._declared if g.model._declared is not None else None
    if declared is None:
        g.model._type(name)  # builds the declared map
        declared = g.model._declared
    t = declared.get(name)
    out = None
    if (t is None or t[1] is None) and len(g.nodes) < 20000:
        t = g.model.types().get(name)  # shape inference is cheap on graphs of this size
    if t is not None and t[1] is not None:
        out = max(len(t[1]) - 2, 0)
    elif depth < 24:
        p = g.producer.get(name)
        if p is not None:
            if p.op_type in ("Unsqueeze", "Squeeze"):
                inner = lead_of(g, p.input[0], depth + 1)
                if inner is not None:
                    out = inner + (1 if p.op_type == "Unsqueeze" else -1)
            elif p.op_type in ("Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "MatMul", "Gemm", "Where", "Identity", "Cast"):
                leads = [lead_of(g, i, depth + 1) for i in p.input if i and g.const(i) is None]
                leads = [x for x in leads if x is not None]
                out = max(leads) if leads else None
    memo[name] = out
    return out


def _local_closure(g: Graph, root: str, limit: int = 256) -> set[int]:
    """Ids of nodes computed from ``root`` (plus constants and shapes) alone: h @ R, its slices, ..."""
    region = {root}
    ids: set[int] = set()
    frontier = [root]
    while frontier and len(ids) < limit:
        v = frontier.pop()
        for c in g.uses(v):
            if id(c) in ids or len(c.input) > 8 or g.implicit_inputs(c):
                continue  # (a Concat stacking every step's output is no part of a step)
            dyn = [i for i in c.input if i and g.const(i) is None and not shape_derived(g, i)]
            if all(i in region for i in dyn):
                ids.add(id(c))
                for o in c.output:
                    if o:
                        region.add(o)
                        frontier.append(o)
    return ids


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
                if len(c.input) > 8:
                    continue  # a Concat stacking every step's output is no part of a step
                dyn = [i for i in c.input if i and g.const(i) is None and not shape_derived(g, i)]
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
                if not i or i in local or g.const(i) is not None or i in xs or i == mask_t or shape_derived(g, i):
                    continue
                pulled: set = set()
                r = _root(g, i, iv, pulled, xs)
                if r is None or r in xs or shape_derived(g, r):
                    continue
                riv = iv.get(r)
                for direction in ("forward", "reverse"):
                    if riv is not None and not (riv[1] < t if direction == "forward" else riv[0] > t):
                        continue
                    f = found.setdefault((direction, t), _Found())
                    if r not in f.roots:
                        f.roots.add(r)
                        f.pulled |= _local_closure(g, r)
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


def _allowed_fn(g: Graph, chain: Chain, k: int, iv):
    st = chain.steps[k]
    t = st.t
    fwd = chain.direction == "forward"

    pulled, nodes, side = st.pulled, iv.nodes, 1 if fwd else 0

    def allowed(n: NodeProto) -> bool:
        k = id(n)
        if k in pulled:
            return True
        v = nodes.get(k)
        if v is None:
            # constants-and-shapes-only nodes (a zero state's matmul) are evaluated wherever they are read
            return bool(n.output) and shape_derived(g, n.output[0])
        return v[side] == t

    return allowed


class _Foreign:
    """The one older value (besides h) a step may read: the LSTM cell state."""

    def __init__(self, t: int):
        self.t = t
        self.name: str | None = None

    def __call__(self, name: str) -> str:
        if self.name is None:
            self.name = name
        elif name != self.name:
            raise Decline(f"step {self.t} reads more than two carried values ('{self.name}', '{name}')")
        return "c"


H_STATE = State("h", None)
C_STATE = State("c", None)


class _StepEval:
    """Symbolic evaluation of one step: x, mask and h are leaves, the one other older value is state c."""

    def __init__(self, g: Graph, chain: Chain, k: int, iv, h_in: str | None, x_atom: X, x_value=None):
        st = chain.steps[k]
        self.foreign = _Foreign(st.t)
        leaves = {st.x: x_value if x_value is not None else Sym(Poly.atom(x_atom))}
        if h_in is not None:
            fv = g.fill_value(h_in)
            leaves[h_in] = Sym(Poly.atom(H_STATE), lead_of(g, h_in) or 0) if fv is None else Fill(np.array(fv, dtype=np.float32))
        if st.mask is not None:
            leaves[st.mask] = Bool("m", False, g.model.rank(st.mask) == 2)

        def foreign(name: str):
            fv = g.fill_value(name)
            if fv is not None:  # a zero (or constant) state of runtime shape, e.g. ConstantOfShape(Shape(x))
                return Fill(np.array(fv, dtype=np.float32))
            self.foreign(name)
            return Sym(Poly.atom(C_STATE), lead_of(g, name) or 0)

        self.ev = StepEvaluator(g, leaves, may_evaluate=_allowed_fn(g, chain, k, iv), foreign=foreign, content_keys=True)

    def poly(self, name: str) -> Poly:
        return self.ev.poly(name)


class _Signer:
    """Structural signatures of step outputs: equal signatures mean the same computation (names aside).

    Far cheaper than symbolic evaluation, so every step of a long chain is compared to a reference step this
    way; steps that differ structurally (a folded first step) are checked symbolically instead."""

    def __init__(self, g: Graph):
        self.g = g
        self.table: dict = {}
        self.attr_keys: dict[int, tuple] = {}
        self.const_ids: dict[str, int | None] = {}  # tensor -> id of its constant value (None: not constant)

    def _intern(self, key) -> int:
        v = self.table.get(key)
        if v is None:
            v = self.table[key] = len(self.table)
        return v

    def sign(self, name: str, leaves: dict[str, str], allowed, foreign: _Foreign, visited: set, fills: dict | None = None) -> int:
        g = self.g
        memo: dict[str, int] = {}
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in memo:
                stack.pop()
                continue
            if cur in leaves:
                memo[cur] = self._intern(("leaf", leaves[cur]))
                stack.pop()
                continue
            cid = self.const_ids.get(cur, -1)
            if cid == -1:
                c = g.const(cur)
                cid = self.const_ids[cur] = None if c is None else self._intern(("const", content_key(g, cur, c)))
            if cid is not None:
                memo[cur] = cid
                stack.pop()
                continue
            p = g.producer.get(cur)
            if p is not None and p.op_type in ("ConstantOfShape", "Expand"):
                fv = g.fill_value(cur)
                if fv is not None:
                    if fills is not None:
                        fills[cur] = fv
                    memo[cur] = self._intern(("fill", fv))
                    stack.pop()
                    continue
            if p is not None and p.op_type in ("Shape", "Size") and p.input[0] not in leaves:
                q = g.producer.get(p.input[0])
                if q is None or not allowed(q):  # the shape of an outside tensor: the same for every step
                    memo[cur] = self._intern(("ext-shape", p.input[0], p.SerializeToString()))
                    visited.add(id(p))
                    stack.pop()
                    continue
            if p is None or not allowed(p):
                fv = g.fill_value(cur)
                if fv is not None and fills is not None:
                    fills[cur] = fv
                memo[cur] = self._intern(("fill", fv) if fv is not None else ("leaf", foreign(cur)))
                stack.pop()
                continue
            pending = [i for i in p.input if i and i not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            visited.add(id(p))
            ak = self.attr_keys.get(id(p))
            if ak is None:
                ak = self.attr_keys[id(p)] = tuple(a.SerializeToString() for a in sorted(p.attribute, key=lambda a: a.name))
            key = (p.op_type, p.domain, ak, list(p.output).index(cur), tuple(memo[i] if i else -1 for i in p.input))
            memo[cur] = self._intern(key)
        return memo[name]


def _single_root(st: Step) -> str:
    if len(st.roots) != 1:
        raise Decline(f"step {st.t} reads {len(st.roots)} carried values through weights (expected one hidden state)")
    return next(iter(st.roots))


def chain_recurrence(g: Graph, src: str, axis: int, chain: Chain, iv, signer: _Signer) -> Recurrence:
    steps = chain.steps
    n = len(steps)
    ts = [s.t for s in steps]
    rank = g.model.rank(src)
    if rank != 3 or axis not in (0, 1):
        raise Decline(f"the per-step inputs are slices of a rank-{rank} tensor along axis {axis}")
    if sorted(ts) != list(range(min(ts), max(ts) + 1)):
        raise Decline("the chain skips time steps")
    proj = input_projection(g, src, axis)
    x_value = None
    if proj is not None:
        x_atom, x_value = projected_leaf(proj)
    else:
        x_atom = X("x", static_dim(g, src, 2))
    h_in: list[str | None] = [None] * n
    for k in range(1, n):
        h_in[k] = _single_root(steps[k])
    if steps[0].roots:
        h_in[0] = _single_root(steps[0])
    h0_fill = g.fill_value(h_in[0]) if h_in[0] is not None else None
    if h0_fill is not None and h0_fill != 0.0:
        raise Decline(f"the initial hidden state is a constant {h0_fill:g}, not zeros")
    h_new: list[str | None] = [h_in[k + 1] for k in range(n - 1)] + [None]
    allowed = [_allowed_fn(g, chain, k, iv) for k in range(n)]
    foreign = [_Foreign(s.t) for s in steps]
    leaves = []
    for k, st in enumerate(steps):
        lv = {st.x: "x"}
        if h_in[k] is not None and not (k == 0 and h0_fill is not None):
            lv[h_in[k]] = "h"
        if st.mask is not None:
            lv[st.mask] = "m"
        leaves.append(lv)
    chain_nodes: set[int] = set()
    sig_h: list[int | None] = [None] * n
    for k in range(n - 1):
        sig_h[k] = signer.sign(h_new[k], leaves[k], allowed[k], foreign[k], chain_nodes)
    # the extra state (LSTM c): what step k reads besides h is what step k-1 computed
    lstm = any(f.name is not None for f in foreign[1 : n - 1]) or (n == 2 and foreign[0].name is not None)
    c_new: list[str | None] = [None] * n
    if lstm:
        for k in range(1, n - 1):
            if foreign[k].name is None:
                raise Decline(f"step {ts[k]} does not read the cell state")
            c_new[k - 1] = foreign[k].name
    if n == 2 and h_in[0] is None:
        raise Decline("a two-step chain with a folded initial state")
    km = 1 if n > 2 else 0
    mid = _StepEval(g, chain, km, iv, h_in[km], x_atom, x_value)
    states = {"h": H_STATE}
    step_states = [StepState("h", mid.poly(h_new[km]), Init())]
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
    ref_h = sig_h[km]
    ref_c = signer.sign(c_new[km], leaves[km], allowed[km], foreign[km], chain_nodes) if lstm else None
    # the last step's outputs: same structure as the reference step's
    last = n - 1
    for name in _step_tensors(g, chain, last, iv, g.producer[h_new[last - 1]].op_type):
        f = _Foreign(ts[last])
        try:
            if signer.sign(name, leaves[last], allowed[last], f, set()) == ref_h:
                h_new[last] = name
                break
        except Decline:
            continue
    if h_new[last] is None:
        e = _StepEval(g, chain, last, iv, h_in[last], x_atom, x_value)
        h_new[last] = _find_symbolic(g, e, chain, last, iv, g.producer[h_new[last - 1]].op_type, expected["h"])
    if h_new[last] is None:
        raise Decline("the last step's hidden output cannot be found")
    sig_h[last] = signer.sign(h_new[last], leaves[last], allowed[last], foreign[last], chain_nodes)
    if lstm:
        c_new[last - 1] = foreign[last].name
        if c_new[last - 1] is None:
            raise Decline(f"step {ts[last]} does not read the cell state")
        for name in _step_tensors(g, chain, last, iv, g.producer[c_new[last - 1]].op_type):
            try:
                if signer.sign(name, leaves[last], allowed[last], _Foreign(ts[last]), set()) == ref_c:
                    c_new[last] = name
                    break
            except Decline:
                continue
    # every step computes the reference cell: by structure, or else by its maths
    zero = set()
    if h_in[0] is None or h0_fill is not None:
        zero.add("h")
    if lstm and foreign[0].name is None:
        zero.add("c")
    for k in range(n):
        outs = {"h": (h_new[k], sig_h[k], ref_h)}
        if lstm and c_new[k] is not None:
            outs["c"] = (c_new[k], signer.sign(c_new[k], leaves[k], allowed[k], foreign[k], chain_nodes), ref_c)
        for sym, (name, sig, ref) in outs.items():
            if sig == ref and not (k == 0 and zero):
                continue
            e = _StepEval(g, chain, k, iv, h_in[k], x_atom, x_value)
            p = e.poly(name)
            chain_nodes |= e.ev.visited_nodes
            want = expected[sym]
            if k == 0 and zero:
                if loose_key(p) != loose_key(zero_states(want, zero)):
                    raise Decline(f"the first step is not the cell with a zero initial state ({sym})")
            elif p.key != want.key:
                raise Decline(f"step {ts[k]} computes a different cell than step {ts[km]} ({sym})")
    x = src if proj is None else proj[0]
    T = static_dim(g, src, axis)
    anchor = g.producer.get(h_new[-1])
    if not (min(ts) == 0 and T is not None and max(ts) == T - 1):
        bounds = [np.array([min(ts)], np.int64), np.array([max(ts) + 1], np.int64), np.array([axis], np.int64)]
        x = g.add_node(
            "Slice",
            [x] + [g.add_initializer(b, f"rnnfuse/slice{i}") for i, b in enumerate(bounds)],
            1, name="rnnfuse/Slice", anchor=anchor,
        )[0]
    rec = Recurrence(
        front="chain",
        where=f"{chain.direction} chain over '{src}' (axis {axis}), steps {ts[0]}..{ts[-1]}: {n} cells",
        cell=spec,
        x=x,
        h0=Init(h_in[0], None, lead_of(g, h_in[0]) or 0) if h_in[0] is not None and h0_fill is None else Init(),
        c0=Init(foreign[0].name, None, lead_of(g, foreign[0].name) or 0) if lstm and foreign[0].name is not None else Init(),
        anchor=anchor,
        x_batch_first=axis == 1,
        x_reversed=chain.direction == "reverse",
    )
    _collect_outputs(g, rec, chain, h_new, c_new, chain_nodes, lstm)
    # what cell-level validation compares (the whole chain may be too big to run in onnxruntime)
    for k in sorted({km, 0}):
        visited: set = set()
        fills: dict = {}
        f = _Foreign(ts[k])
        outs = {h_new[k]: "h"}
        signer.sign(h_new[k], leaves[k], allowed[k], f, visited, fills)
        if lstm and c_new[k] is not None:
            signer.sign(c_new[k], leaves[k], allowed[k], f, visited, fills)
            outs[c_new[k]] = "c"
        ins = {v: r for v, r in leaves[k].items() if r != "m"}
        if f.name is not None:
            ins[f.name] = "c"
        chk = CellCheck(order_of(g, visited), ins, outs, zero if k == 0 else set(), static_dim(g, src, 1 - axis), fills)
        if proj is not None:
            chk.x_projection = (proj[1], proj[2])
        rec.cell_checks.append(chk)
    return rec


def order_of(g: Graph, ids: set) -> list[NodeProto]:
    return [n for n in g.nodes if id(n) in ids and g.alive(n)]


def _step_tensors(g: Graph, chain: Chain, k: int, iv, op_type: str) -> list[str]:
    """Outputs of ``op_type`` nodes that belong to step k."""
    t = chain.steps[k].t
    fwd = chain.direction == "forward"
    out = []
    for name, v in iv.items():
        if (v[1] == t) if fwd else (v[0] == t):
            p = g.producer.get(name)
            if p is not None and p.op_type == op_type:
                out.append(name)
    return out


def _find_symbolic(g: Graph, e: _StepEval, chain: Chain, k: int, iv, op_type: str, want: Poly) -> str | None:
    for name in _step_tensors(g, chain, k, iv, op_type):
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
            if u.op_type == "Concat" and lead_of(g, h) == 1 and attr(u, "axis") == 0:
                stacks.setdefault(id(u), [u, []])[1].append((k, None))  # [1, B, H] states concatenated on time
                continue
            extra.append((h, k))
        if g.is_graph_output(h):
            extra.append((h, k))
    for cat, items in stacks.values():
        if not _stack_output(g, rec, chain, cat, items, h_new):
            extra.extend((h_new[k], k) for k, _ in items)
    done = set()
    for h, k in extra:
        if k == n - 1:
            if h not in done:
                rec.finals.append(FinalOutput(h, "h", lead=lead_of(g, h) or 0))
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
        rec.finals.append(FinalOutput(c, "c", lead=lead_of(g, c) or 0))


def _stack_output(g: Graph, rec: Recurrence, chain: Chain, cat: NodeProto, items, h_names) -> bool:
    """``Concat(Unsqueeze(h_k, a) for every step, axis=a)`` -> a sequence output."""
    n = len(chain.steps)
    axis = attr(cat, "axis")
    direct = all(u is None for _, u in items)  # [1, B, H] states concatenated as they are
    if direct:
        by_name = {h_names[k]: k for k, _ in items}
    by_node = {id(u): k for k, u in items if u is not None}
    ks = []
    for name in cat.input:
        if direct:
            if name not in by_name:
                return False
            ks.append(by_name[name])
            continue
        p = g.producer.get(name)
        if p is None or id(p) not in by_node:
            return False
        ks.append(by_node[id(p)])
    if sorted(ks) != list(range(n)):
        return False
    for k, u in items:
        if u is None:
            continue
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
        pending: dict = {}  # chain key -> its decline, reported only if the chain still exists at the end
        for _ in range(self.max_rounds):
            fams = find_families(g)
            if not fams:
                break
            order = g._toposort(g.live_nodes())
            signer = _Signer(g)
            recs = []
            seen_now: set = set()
            for (src, axis), fam in fams.items():
                if g.model.elem_type(src) == 9:
                    continue  # bool families are masks, read by the chains over the data
                iv = _intervals(g, order, {x: t for t, x in fam.items()})
                for chain in find_chains(g, fam, iv, None):
                    key = (src, axis, chain.direction, chain.steps[0].t)
                    seen_now.add(key)
                    if key in tried:
                        continue
                    tried.add(key)
                    try:
                        recs.append((chain_recurrence(g, src, axis, chain, iv, signer), {}))
                    except Decline as d:
                        where = f"{chain.direction} chain over '{src}' (axis {axis})"
                        pending[key] = declined(self.name, "chain", where, d.reason)
            pending = {k: v for k, v in pending.items() if k in seen_now}
            if not recs:
                break
            n_before = len(res.findings)
            apply_recurrences(g, ctx, self.name, recs, res)
            if not any(f.status == "fused" for f in res.findings[n_before:]):
                break
        # declines of "chains" that disappeared once real chains were fused (e.g. per-layer initial states
        # sliced from one tensor) were not recurrences: only what remains is reported
        final = set()
        fams = find_families(g)
        order = g._toposort(g.live_nodes()) if fams else []
        for (src, axis), fam in fams.items():
            iv = _intervals(g, order, {x: t for t, x in fam.items()})
            for chain in find_chains(g, fam, iv, None):
                final.add((src, axis, chain.direction, chain.steps[0].t))
        res.findings.extend(v for k, v in pending.items() if k in final)
        return res
