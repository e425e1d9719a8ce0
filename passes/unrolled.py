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
5. **Masks.** Slices of a bool tensor taken at the same steps (Keras' mask, per step) are interval leaves
   too, so a step's masked selects belong to it; the states then go through the same analysis as a loop
   body's (``m * new + (1 - m) * old`` in any spelling; zero-filled or carried outputs).
6. **Carried outputs.** A value a step computes from its cell's values beyond h and c (Keras' previous
   output, carried next to the state for masking) becomes a third state, ``y``.
7. **Outputs.** Per-step values stacked with ``Unsqueeze`` + ``Concat`` become sequence outputs, the last
   step's values the final states. Anything else read outside the chain declines it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto

from rnnfuse.dims import static_dim
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.pipeline import Options, PassResult
from rnnfuse.recurrence import CellCheck, FinalOutput, Init, Recurrence
from rnnfuse.inputs import input_projection, projected_leaf
from rnnfuse.rewrite import apply_recurrences, declined
from rnnfuse.step import StepOut, StepState, analyse
from rnnfuse.symbolic import BoolMask, Fill, Poly, State, StepEvaluator, SymTensor, StepInput, content_key, loose_key, zero_states

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
        if len(v) < 2 or (et is not None and et not in floats + (9,)):
            continue
        if rank is not None and rank != 3 and not (et == 9 and rank == 2):
            continue  # data is [T, B, F] (or batch-first); a mask [T, B, 1] or [T, B]
        out[(src, ax)] = v
    return out


# ----------------------------------------------------------------------------------------------- chains


@dataclass
class Step:
    t: int
    x: str
    roots: set = field(default_factory=set)  # carried-state tensors read through weight matmuls / slices
    pulled: set = field(default_factory=set)  # ids of state-side nodes between a root and the step
    masks: dict = field(default_factory=dict)  # this step's slices of bool families -> mask symbol
    weighted: set = field(default_factory=set)  # the roots read through a weight matmul


@dataclass
class _Found:
    """Per step and direction: older tensors the step reads and the nodes walked to reach them."""

    roots: set = field(default_factory=set)
    pulled: set = field(default_factory=set)
    weighted: set = field(default_factory=set)  # the roots read through a weight matmul (h, not c or a carried output)


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


def _root(g: Graph, name: str, iv, pulled: set, stop: dict, limit: int = 12, ops: list | None = None) -> str | None:
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
        if p.op_type in ("Add", "Sub", "Mul") and any(i and i != dyn[0] and g.const(i) is None for i in p.input):
            return name  # combined with a runtime-shaped fill (0 + m * new at a first step): a state itself
        if not _keeps_rows(g, p):
            return name  # e.g. Slice(h0, layer) of a per-layer initial state: the state starts here
        pulled.add(id(p))
        if ops is not None:
            ops.append(p.op_type)
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
    """How many leading unit axes a [*, B, N] value has: the known rank - 2 (``Model.known_type``), or
    followed through Unsqueeze/Squeeze(axis 0) and elementwise ops."""
    memo = g.model.annotations.setdefault("lead_of", {})
    if name in memo:
        return memo[name]
    t = g.model.known_type(name)
    out = None
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


def _closure(g: Graph, seeds, limit: int = 256) -> tuple[set[str], set[int]]:
    """Tensors computed from ``seeds`` (plus constants and shapes) alone, and the ids of their nodes:
    h @ R and its slices from a state, a tiled or negated mask from a step's mask slice."""
    region = set(seeds)
    ids: set[int] = set()
    frontier = list(seeds)
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
    return region, ids


def find_chains(g: Graph, fam: dict[int, str], iv, mask_fam: dict[int, dict] | None = None) -> list[Chain]:
    """Thread the steps of a family into chains (forward and backward)."""
    xs = {x: t for t, x in fam.items()}
    all_masks = {m: t for t, ms in (mask_fam or {}).items() for m in ms}
    stop = {**xs, **all_masks}
    found: dict[tuple[str, int], _Found] = {}
    for t, x in fam.items():
        # the step's mask-only values (a tiled, negated or cast mask), then the x-local region: nodes
        # computed from x_t (with constants and mask-only values) only
        mask_local = _closure(g, (mask_fam or {}).get(t, ()), 64)[0]
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
                if all(i in local or i in mask_local for i in dyn) and not g.implicit_inputs(c):
                    for o in c.output:
                        if o:
                            local.add(o)
                            frontier.append(o)
                else:
                    combining.append(c)
        mask_t = mask_fam.get(t, {}) if mask_fam else {}
        for c in combining:
            for i in c.input:
                if not i or i in local or i in mask_local or g.const(i) is not None or i in xs or i in mask_t or shape_derived(g, i):
                    continue
                pulled: set = set()
                ops: list = [c.op_type]
                r = _root(g, i, iv, pulled, stop, ops=ops)
                if r is None or r in stop or shape_derived(g, r):
                    continue
                weighted = bool({"MatMul", "Gemm", "Concat"} & set(ops))  # read through the recurrent weights
                riv = iv.get(r)
                for direction in ("forward", "reverse"):
                    if riv is not None and not (riv[1] < t if direction == "forward" else riv[0] > t):
                        continue
                    f = found.setdefault((direction, t), _Found())
                    if r not in f.roots:
                        f.roots.add(r)
                        f.pulled |= _closure(g, [r])[1]
                    if weighted:
                        f.weighted.add(r)
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
                steps.append(Step(k, fam[k], set(f.roots), set(f.pulled), dict(mask_fam.get(k, {})) if mask_fam else {}, set(f.weighted)))
            chains.append(Chain(direction, steps))
    return chains


def _allowed_fn(g: Graph, chain: Chain, k: int, iv):
    st = chain.steps[k]
    t = st.t
    fwd = chain.direction == "forward"

    pulled, nodes, side = st.pulled, iv.nodes, 1 if fwd else 0
    prev = t - 1 if fwd else t + 1
    carried_side: dict[int, bool] = {}

    def allowed(n: NodeProto) -> bool:
        k = id(n)
        if k in pulled:
            return True
        v = nodes.get(k)
        if v is None:
            # constants-and-shapes-only nodes (a zero state's matmul) are evaluated wherever they are read
            return bool(n.output) and shape_derived(g, n.output[0])
        return v[side] == t or (v[side] == prev and _carried_side(n))

    def _carried_side(n: NodeProto) -> bool:
        """A node placed in the step before, computed from one carried value and constants only and read only
        by this step (an LSTM peephole p*c): it belongs to this step, as h @ R does."""
        k = id(n)
        if k not in carried_side:
            carried_side[k] = False  # (while its consumers are asked)
            # (other inputs must be true constants: 0 + m*new with a runtime-shaped zero is a state itself)
            dyn = [i for i in n.input if i and g.const(i) is None]
            users = [c for o in n.output if o for c in g.uses(o)]
            carried_side[k] = (n.op_type in _CARRIED_SIDE and len(dyn) == 1 and bool(users)
                               and not any(g.is_graph_output(o) for o in n.output if o)
                               and all(allowed(c) for c in users))
        return carried_side[k]

    return allowed


# ops with constants that may sit between a carried value and the step reading it (the recogniser then
# decides what they mean: p*c is a peephole, c @ P is not)
_CARRIED_SIDE = {"Mul", "Add", "Sub", "Div", "Neg", "Unsqueeze", "Squeeze", "Identity", "Reshape", "MatMul", "Gemm"}


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

    def __init__(self, g: Graph, chain: Chain, k: int, iv, h_in: str | None, x_atom: StepInput, x_value=None):
        st = chain.steps[k]
        self.foreign = _Foreign(st.t)
        leaves = {st.x: x_value if x_value is not None else SymTensor(Poly.atom(x_atom))}
        if h_in is not None:
            fv = g.fill_value(h_in)
            leaves[h_in] = SymTensor(Poly.atom(H_STATE), lead_of(g, h_in) or 0) if fv is None else Fill(np.array(fv, dtype=np.float32))
        for m, sym in st.masks.items():
            leaves[m] = BoolMask(sym, False, g.model.rank(m) == 2)

        def foreign(name: str):
            fv = g.fill_value(name)
            if fv is not None:  # a zero (or constant) state of runtime shape, e.g. ConstantOfShape(Shape(x))
                return Fill(np.array(fv, dtype=np.float32))
            self.foreign(name)
            return SymTensor(Poly.atom(C_STATE), lead_of(g, name) or 0)

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
        self.nodes: dict[int, tuple] = {}  # id -> (inputs, outputs, op_type, domain): each node read once
        self.const_ids: dict[str, int | None] = {}  # tensor -> id of its constant value (None: not constant)

    def _intern(self, key) -> int:
        v = self.table.get(key)
        if v is None:
            v = self.table[key] = len(self.table)
        return v

    def sign(self, name: str, leaves: dict[str, str], allowed, foreign: _Foreign, visited: set, fills: dict | None = None) -> int:
        g = self.g
        memo: dict[str, int] = {}
        expanded: dict[str, NodeProto] = {}  # tensors whose inputs are being signed: their producer
        infos = self.nodes
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in memo:
                stack.pop()
                continue
            p = expanded.get(cur)
            if p is None:
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
                info = None
                if p is not None:
                    info = infos.get(id(p))
                    if info is None:
                        info = infos[id(p)] = (tuple(p.input), tuple(p.output), p.op_type, p.domain)
                if info is not None and info[2] in ("ConstantOfShape", "Expand"):
                    fv = g.fill_value(cur)
                    if fv is not None:
                        if fills is not None:
                            fills[cur] = fv
                        memo[cur] = self._intern(("fill", fv))
                        stack.pop()
                        continue
                if info is not None and info[2] in ("Shape", "Size") and info[0][0] not in leaves:
                    q = g.producer.get(info[0][0])
                    if q is None or not allowed(q):  # the shape of an outside tensor: the same for every step
                        memo[cur] = self._intern(("ext-shape", info[0][0], p.SerializeToString()))
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
                pending = [i for i in info[0] if i and i not in memo]
                if pending:
                    expanded[cur] = p
                    stack.extend(pending)
                    continue
            else:
                info = infos[id(p)]
            stack.pop()
            visited.add(id(p))
            ak = self.attr_keys.get(id(p))
            if ak is None:
                ak = self.attr_keys[id(p)] = tuple(a.SerializeToString() for a in sorted(p.attribute, key=lambda a: a.name))
            key = (info[2], info[3], ak, info[1].index(cur), tuple(memo[i] if i else -1 for i in info[0]))
            memo[cur] = self._intern(key)
        return memo[name]


def _single_root(st: Step, roots: set | None = None) -> str:
    roots = st.roots if roots is None else roots
    if len(roots) != 1:
        raise Decline(f"step {st.t} reads {len(roots)} carried values through weights (expected one hidden state)")
    return next(iter(roots))


Y_STATE = State("y", None)


def chain_recurrence(g: Graph, src: str, axis: int, chain: Chain, iv, signer: _Signer, mask_srcs: dict | None = None) -> Recurrence:
    """The recurrence an unrolled chain computes.

    Roles: ``h`` is read through the recurrent weights; ``c`` is the one other value a step reads from the
    step before (the LSTM cell state); ``y`` is an extra per-step value carried alongside (Keras' previous
    output for masking), found as what the step computes from its cell values beyond h and c. A step may
    read one slice of a bool family (the mask): states are then masked selects, read by ``analyse``."""
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
        x_atom = StepInput("x", static_dim(g, src, 2))
    h_in: list[str | None] = [None] * n
    for k in range(1, n):
        h_in[k] = _single_root(steps[k])
    if steps[0].weighted:  # (the first step may also combine its input with a given c0 or carried output)
        h_in[0] = _single_root(steps[0], steps[0].weighted)
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
        lv.update(st.masks)
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
    last = n - 1
    # the last step's h (nothing after it reads it): the tensor with the reference step's structure; in a
    # three-step LSTM chain it is also what tells which value the reference step passes on as c
    h_new[last] = _step_output(g, chain, last, iv, signer, leaves[last], allowed[last], g.producer[h_new[last - 1]].op_type, sig_h[km])
    if h_new[last] is not None:
        sig_h[last] = signer.sign(h_new[last], leaves[last], allowed[last], foreign[last], chain_nodes)
        if lstm and km == last - 1:
            c_new[km] = foreign[last].name
    mid = _StepEval(g, chain, km, iv, h_in[km], x_atom, x_value)
    ref = {"h": mid.poly(h_new[km])}
    ref_sig = {"h": sig_h[km]}
    if lstm:
        if c_new[km] is None:
            raise Decline("the cell state's next value cannot be found")
        ref["c"] = mid.poly(c_new[km])
        ref_sig["c"] = signer.sign(c_new[km], leaves[km], allowed[km], foreign[km], chain_nodes)
    # the last step's outputs: same structure as the reference step's (they may be dead: Keras on torch
    # returns only the carried output, and the exporter drops the last state updates)
    if h_new[last] is None:
        e = _StepEval(g, chain, last, iv, h_in[last], x_atom, x_value)
        h_new[last] = _find_symbolic(g, e, chain, last, iv, g.producer[h_new[last - 1]].op_type, ref["h"])
        if h_new[last] is not None:
            sig_h[last] = signer.sign(h_new[last], leaves[last], allowed[last], foreign[last], chain_nodes)
    series: dict[str, list] = {"h": h_new}
    sigs: dict[str, list] = {"h": sig_h}
    sig_c: list[int | None] = [None] * n
    if lstm:
        c_new[last - 1] = foreign[last].name or _step_output(g, chain, last - 1, iv, signer, leaves[last - 1], allowed[last - 1], g.producer[c_new[km]].op_type, ref_sig["c"])
        if c_new[last - 1] is None:
            raise Decline(f"step {ts[last]} does not read the cell state")
        c_new[last] = _step_output(g, chain, last, iv, signer, leaves[last], allowed[last], g.producer[c_new[last - 1]].op_type, ref_sig["c"])
        for k in range(n):
            if c_new[k] is not None:
                sig_c[k] = signer.sign(c_new[k], leaves[k], allowed[k], foreign[k], chain_nodes)
        series["c"], sigs["c"] = c_new, sig_c
    # the extra carried value (Keras' previous output): computed from the cells' values, outside h and c
    mask_values = _mask_values(g, chain)
    ys = _extra_values(g, chain, iv, chain_nodes, {t for t in h_new + c_new if t}, mask_values)
    y_carried = False
    y0 = None
    if ys is not None:
        y_carried = any(ys[k - 1] in _inputs_of(g, ys[k], allowed[k], leaves[k]) for k in range(1, n) if ys[k] and ys[k - 1])
        if y_carried and km == 0:
            raise Decline("a two-step chain carrying an extra value")
        sig_y: list[int | None] = [None] * n
        if y_carried and ys[0] is not None:
            # a given initial value of the carried output: the one outside tensor the first step reads
            given = [t for t in _inputs_of(g, ys[0], allowed[0], leaves[0])
                     if iv.get(t) is None and t not in leaves[0] and t != foreign[0].name and g.const(t) is None
                     and not shape_derived(g, t) and g.fill_value(t) is None
                     and (g.producer.get(t) is None or not allowed[0](g.producer[t]))]
            if len(given) == 1:
                y0 = given[0]
                leaves[0] = {**leaves[0], y0: "y"}
        for k in range(n):
            if y_carried and k > 0:
                leaves[k] = {**leaves[k], ys[k - 1]: "y"}
            if ys[k] is None:  # the last step's value, not reached from its (dead) states
                op = g.producer[ys[k - 1]].op_type
                ys[k] = _step_output(g, chain, k, iv, signer, leaves[k], allowed[k], op, sig_y[km]) if k == last else None
                if ys[k] is None:
                    raise Decline(f"step {ts[k]}'s carried output cannot be found")
            sig_y[k] = signer.sign(ys[k], leaves[k], allowed[k], foreign[k], chain_nodes)
        if y_carried:
            mid.ev.memo[ys[km - 1]] = SymTensor(Poly.atom(Y_STATE), lead_of(g, ys[km - 1]) or 0)
        ref["y"] = mid.poly(ys[km])
        ref_sig["y"] = sig_y[km]
        series["y"], sigs["y"] = ys, sig_y
    if h_new[last] is None and ys is None and c_new[last] is None:
        raise Decline("the last step's hidden output cannot be found")
    if lstm and foreign[last].name is not None and foreign[last].name != c_new[last - 1]:
        raise Decline(f"step {ts[last]} reads another cell state than step {ts[last - 1]} computes")
    lstm_c0 = foreign[0].name if lstm else None
    # which states start from zero folded into the first step
    zero = set()
    if h_in[0] is None or h0_fill is not None:
        zero.add("h")
    if lstm and lstm_c0 is None:
        zero.add("c")
    if y_carried and y0 is None:
        zero.add("y")
    stacks, finals = _chain_outputs(g, chain, series, chain_nodes, mask_values)
    inits = {
        "h": Init(h_in[0], None, lead_of(g, h_in[0]) or 0) if h_in[0] is not None and h0_fill is None else Init(),
        "c": Init(lstm_c0, None, lead_of(g, lstm_c0) or 0) if lstm_c0 is not None else Init(),
        "y": Init(y0, None, lead_of(g, y0) or 0) if y0 is not None else Init(),
    }
    states = {"h": H_STATE, "c": C_STATE, "y": Y_STATE}
    step_states = [StepState(r, ref[r], inits[r], finals.get(r)) for r in series if r != "y" or y_carried]
    outs = [StepOut(ref[r], cat, bf, rev) for r, cat, bf, rev in stacks]
    for r, t in finals.items():
        if r == "y" and not y_carried:
            raise Decline("an extra per-step value of the last step is read outside the chain")
    an = analyse(x_atom, step_states, outs, {r: states[r] for r in series})
    spec = an.rec.spec
    # every step computes the reference step: by structure, or else by its maths
    for r, names in series.items():
        for k in range(n):
            name = names[k]
            if name is None:
                continue
            if sigs[r][k] == ref_sig[r] and not (k == 0 and zero):
                continue
            e = _StepEval(g, chain, k, iv, h_in[k], x_atom, x_value)
            prev = (ys[k - 1] if k > 0 else y0) if y_carried else None
            if prev is not None:
                e.ev.memo[prev] = SymTensor(Poly.atom(Y_STATE), lead_of(g, prev) or 0)
            p = e.poly(name)
            chain_nodes |= e.ev.visited_nodes
            if k == 0 and zero:
                if loose_key(p) != loose_key(zero_states(ref[r], zero)):
                    raise Decline(f"the first step is not the cell with a zero initial state ({r})")
            elif p.key != ref[r].key:
                raise Decline(f"step {ts[k]} computes a different cell than step {ts[km]} ({r})")
    x = src if proj is None else proj[0]
    T = static_dim(g, src, axis)
    anchor = g.producer.get(h_new[-1] or c_new[-1] or (ys or [None])[-1])
    mask = None
    if an.masked:
        msrc, maxis = (mask_srcs or {}).get(an.mask_sym, (None, None))
        if msrc is None or maxis != axis or static_dim(g, msrc, maxis) != T:
            raise Decline("the mask is not laid out like the per-step inputs")
        mask = msrc
    if not (min(ts) == 0 and T is not None and max(ts) == T - 1):
        bounds = [np.array([min(ts)], np.int64), np.array([max(ts) + 1], np.int64), np.array([axis], np.int64)]
        consts = [g.add_initializer(b, f"rnnfuse/slice{i}") for i, b in enumerate(bounds)]
        x = g.add_node("Slice", [x] + consts, 1, name="rnnfuse/Slice", anchor=anchor)[0]
        if mask is not None:
            mask = g.add_node("Slice", [mask] + consts, 1, name="rnnfuse/Slice", anchor=anchor)[0]
    rec = Recurrence(
        front="chain",
        where=f"{chain.direction} chain over '{src}' (axis {axis}), steps {ts[0]}..{ts[-1]}: {n} cells",
        cell=spec,
        x=x,
        h0=an.h0,
        c0=an.c0,
        mask=mask,
        seq_outputs=an.seq_outputs,
        finals=[FinalOutput(f.tensor, f.which, f.init, lead_of(g, f.tensor) or 0) for f in an.finals],
        anchor=anchor,
        x_batch_first=axis == 1,
        x_reversed=chain.direction == "reverse",
    )
    if an.masked or y_carried:
        return rec  # validated on the whole model, with its masks overridden
    # what cell-level validation compares (the whole chain may be too big to run in onnxruntime)
    for k in sorted({km, 0}):
        visited: set = set()
        fills: dict = {}
        f = _Foreign(ts[k])
        outs_k = {h_new[k]: "h"}
        signer.sign(h_new[k], leaves[k], allowed[k], f, visited, fills)
        if lstm and c_new[k] is not None:
            signer.sign(c_new[k], leaves[k], allowed[k], f, visited, fills)
            outs_k[c_new[k]] = "c"
        ins = {v: r for v, r in leaves[k].items() if r in ("x", "h")}
        if f.name is not None:
            ins[f.name] = "c"
        chk = CellCheck(order_of(g, visited), ins, outs_k, zero if k == 0 else set(), static_dim(g, src, 1 - axis), fills)
        if proj is not None:
            chk.x_projection = (proj[1], proj[2])
        rec.cell_checks.append(chk)
    return rec


def _step_output(g: Graph, chain: Chain, k: int, iv, signer: _Signer, leaves: dict, allowed, op_type: str, ref: int) -> str | None:
    """The tensor of step k with the reference step's signature ``ref`` (one no later step reads)."""
    for name in _step_tensors(g, chain, k, iv, op_type):
        try:
            if signer.sign(name, leaves, allowed, _Foreign(chain.steps[k].t), set()) == ref:
                return name
        except Decline:
            continue
    return None


def _inputs_of(g: Graph, name: str, allowed, leaves: dict, limit: int = 64) -> set[str]:
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


def _mask_values(g: Graph, chain: Chain) -> set[str]:
    """Values computed from the steps' masks alone (tiled or negated masks): they may be shared, e.g. by a
    stack of layers, and are no inner value of the chain."""
    masks = {m for st in chain.steps for m in st.masks}
    return _closure(g, masks, 64 * len(chain.steps))[0] if masks else set()


def _stacking(g: Graph, nd: NodeProto, o: str, states, chain_nodes: set) -> bool:
    """``o = Unsqueeze(state)`` read outside the chain only by Concats (stacking the states; the same
    Unsqueeze may also be a no-op reshape inside the step): checked as a stack, not an inner value."""
    return nd.op_type == "Unsqueeze" and nd.input[0] in states and not g.is_graph_output(o) and all(
        c.op_type == "Concat" for c in g.uses(o) if id(c) not in chain_nodes)


def _extra_values(g: Graph, chain: Chain, iv, chain_nodes: set, state_tensors: set, mask_values: set) -> list[str] | None:
    """Per step, the one value computed from the cell's inner values by nodes outside h and c (Keras'
    masked output carried next to the state), or None when no step has one."""
    steps = chain.steps
    side = 1 if chain.direction == "forward" else 0
    k_of = {st.t: k for k, st in enumerate(steps)}
    hang: dict[int, dict[int, NodeProto]] = {}
    stacked: dict[int, set] = {}
    for nd in g.live_nodes():
        if id(nd) not in chain_nodes:
            continue
        v = iv.nodes.get(id(nd))
        k = k_of.get(v[side]) if v is not None else None
        if k is None:
            continue
        for o in nd.output:
            # (read only inside the chain, or only by shape reads: the common case, checked first)
            outside = [u for u in g.uses(o) if id(u) not in chain_nodes and u.op_type not in ("Shape", "Size")] if o else []
            if not outside or o in state_tensors or o in mask_values or shape_derived(g, o) or _stacking(g, nd, o, state_tensors, chain_nodes):
                continue
            if all(u.op_type == "Unsqueeze" and _stacking(g, u, u.output[0], {o}, chain_nodes) for u in outside):
                stacked.setdefault(k, set()).add(o)  # an inner value stacked as it is (e.g. m * h_cell)
                continue
            for u in outside:
                uv = iv.nodes.get(id(u))
                if uv is None or uv[side] != steps[k].t:
                    raise Decline(f"an inner value of the chain ('{o}') is read outside it")
                hang.setdefault(k, {})[id(u)] = u
    if not hang and not stacked:
        return None
    ys: list[str | None] = []
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
        if not tops and k == len(steps) - 1:
            ys.append(None)  # found by its signature once the step before is known
            continue
        if len(tops) != 1:
            raise Decline(f"step {st.t} computes {len(tops)} values beyond its states (expected at most one)")
        ys.append(next(iter(tops)))
    return ys


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


def _chain_outputs(g: Graph, chain: Chain, series: dict, chain_nodes: set, mask_values: set) -> tuple[list, dict]:
    """What the rest of the graph reads of the chain: stacks of a per-step series ((role, tensor,
    batch_first, reversed)) and the last step's values (role -> tensor). Anything else declines."""
    n = len(chain.steps)
    ts = [s.t for s in chain.steps]
    index = {t: (r, k) for r, names in series.items() for k, t in enumerate(names) if t}
    for nd in (x for x in g.live_nodes() if id(x) in chain_nodes):
        for o in nd.output:
            read = o and (g.is_graph_output(o) or any(id(u) not in chain_nodes and u.op_type not in ("Shape", "Size") for u in g.uses(o)))
            if not read or o in index or o in mask_values or shape_derived(g, o) or _stacking(g, nd, o, index, chain_nodes):
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
            if u.op_type == "Concat" and lead_of(g, t) == 1 and attr(u, "axis") == 0:
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
    for r, k, t in extra:
        if k != n - 1:
            what = {"h": "hidden state", "c": "cell state"}.get(r, "output")
            raise Decline(f"the {what} of step {ts[k]} is read outside the chain (not stacked)")
        finals[r] = t
    return stacks, finals


def _stack_output(g: Graph, chain: Chain, cat: NodeProto, items, names) -> tuple | None:
    """``Concat(Unsqueeze(v_k, a) for every step, axis=a)`` -> (tensor, batch_first, reversed)."""
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
        ax = attr(u, "axes") if g.model.opset < 13 else g.const(u.input[1])
        if ax is None or [int(a) for a in np.asarray(ax).ravel()] != [axis]:
            return None
    if axis < 0:
        axis += 3
    if axis not in (0, 1):
        return None
    ts = [chain.steps[k].t for k in ks]
    if ts == sorted(ts):
        time_order = True
    elif ts == sorted(ts, reverse=True):
        time_order = False
    else:
        return None
    processing_order = time_order == (chain.direction == "forward")
    return cat.output[0], axis == 1, not processing_order


def _mask_leaves(g: Graph, fams: dict, fam: dict) -> tuple[dict, dict, dict]:
    """Interval leaves for a data family and the bool families sliced at the same steps (candidate masks):
    (tensor -> step, step -> {mask slice -> symbol}, symbol -> (mask source, axis))."""
    leaves = {x: t for t, x in fam.items()}
    mask_fam: dict[int, dict] = {}
    mask_srcs: dict[str, tuple] = {}
    for (msrc, maxis), mf in fams.items():
        if g.model.elem_type(msrc) != 9 or set(mf) != set(fam):
            continue
        sym = f"m{len(mask_srcs)}"
        mask_srcs[sym] = (msrc, maxis)
        for t, m in mf.items():
            leaves[m] = t
            mask_fam.setdefault(t, {})[m] = sym
    return leaves, mask_fam, mask_srcs


class FuseChains:
    """Rewrite unrolled per-step cell chains into native ops (repeats while new chains appear: stacks)."""

    name = "unrolled"
    max_rounds = 8

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        tried: set = set()
        pending: dict = {}  # chain key -> its decline, reported only if the chain still exists at the end
        g.prune()  # dead code (an exporter's unused per-step values) is no reader of a step's values
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
                leaves, mask_fam, mask_srcs = _mask_leaves(g, fams, fam)
                iv = _intervals(g, order, leaves)
                for chain in find_chains(g, fam, iv, mask_fam):
                    key = (src, axis, chain.direction, chain.steps[0].t)
                    seen_now.add(key)
                    if key in tried:
                        continue
                    tried.add(key)
                    try:
                        recs.append((chain_recurrence(g, src, axis, chain, iv, signer, mask_srcs), {}))
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
            if g.model.elem_type(src) == 9:
                continue
            leaves, mask_fam, _ = _mask_leaves(g, fams, fam)
            iv = _intervals(g, order, leaves)
            for chain in find_chains(g, fam, iv, mask_fam):
                final.add((src, axis, chain.direction, chain.steps[0].t))
        res.findings.extend(v for k, v in pending.items() if k in final)
        return res
