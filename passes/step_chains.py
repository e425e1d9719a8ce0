"""Merge native ops that each run one stretch of time, one carrying its state into the next, into one op.

Decoder-style and streaming code calls a recurrent layer once per step and carries the state by hand::

    for t in range(T):
        y, state = lstm(x[t:t + 1], state)

and torch exports one native LSTM per call: T ops, the last state of each the initial state of the next. A
recurrence does not care where its sequence was cut, so running op_1 .. op_n one after the other is running
one op over their inputs concatenated along time. Merged when every op of the chain has the same kind,
attributes and constant weights (equal values, under one name or several), runs forward without
``sequence_lens`` (over any number of steps, read at run time when the shapes do not say), and no op's input
is computed from an earlier op of the chain (an autoregressive decoder feeds its own output back: that is not
a sequence known in advance, and stays as it is).

Every reader of an op's ``Y`` then reads its rows of the merged ``Y``; of its ``Y_h``, the merged ``Y``'s row
of its last step; only the last op's ``Y_c`` is available (the native op has no per-step cell state), so a
chain whose earlier cell state is read elsewhere is declined. The merged op reads the first op's weights, as
initializers where the exporter computed them per call (passes/merged_weights.py).
"""

from __future__ import annotations

import hashlib

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args, rewrite
from rnnfuse.cells import native_kind
from rnnfuse.cells.kinds import KINDS, output_dims
from rnnfuse.dataflow import SHAPE_READS, settled_dim, settled_rank
from rnnfuse.disjoint_sets import DisjointSets
from rnnfuse.builder import Builder
from rnnfuse.errors import Decline
from rnnfuse.findings import Finding, Options, PassResult
from rnnfuse.graph import Graph, Model, attr
from rnnfuse.op_shapes import concatenated_dims
from rnnfuse.rewrite import Rewrite, apply_rewrites

from .merged_weights import merged_inputs, weight_positions

# what carries a state from one op to the next without changing it
_PASS_THROUGH = ("Identity",)
# the ops of each chain a big model's check merges (prefix_check): the first op from the state the chain starts
# in, and three hand-overs of the state from one op to the next
PREFIX_OPS = 4


def _inp(n: NodeProto, i: int) -> str:
    return n.input[i] if len(n.input) > i else ""


def _is_whole_slice(flow: "_StateFlow", n: NodeProto) -> bool:
    """A Slice that keeps every element (dynamo's ``h[0:1]`` of a one-layer state)."""
    g = flow.g
    starts, ends, axes, steps = op_args.slice_args_of(g, n)
    if None in (starts, ends) or any(starts) or (steps is not None and any(s != 1 for s in steps)):
        return False  # (before the rank: the other layers' parts of a multi-layer state start further on)
    rank = flow.rank(n.input[0])
    if rank is None:
        return False
    axes = axes if axes is not None else list(range(len(starts)))
    for start, end, axis in zip(starts, ends, axes):
        dim = flow.extent(n.input[0], axis) if -rank <= axis < rank else None
        if start != 0 or dim is None or end < dim:
            return False
    return True


def _part_of_concat(flow: "_StateFlow", n: NodeProto) -> tuple[str, NodeProto] | None:
    """:meth:`_StateFlow.part_sliced`, worked out."""
    g = flow.g
    cat = g.producer.get(n.input[0])
    if cat is None or cat.op_type != "Concat":
        return None
    starts, ends, axes, steps = op_args.slice_args_of(g, n)
    rank = flow.rank(n.input[0])
    if None in (starts, ends, rank) or len(starts) != 1 or (steps is not None and steps != [1]):
        return None
    axis = (axes or [0])[0] % rank
    if attr(cat, "axis", 0) % rank != axis:
        return None
    offset = 0
    for part in cat.input:
        dim = flow.extent(part, axis)
        if dim is None:
            return None
        if starts[0] == offset and ends[0] == offset + dim:
            return part, cat
        offset += dim
    return None


class _StateFlow:
    """How states pass between the ops of one graph (copies, a multi-layer state's Concat and per-layer
    Slices), asked many times a run: each Slice's part is worked out once (a per-step state's Concat is met
    from every layer's op, from the links and from both walks)."""

    def __init__(self, g: Graph):
        self.g = g
        self._parts: dict[int, tuple[str, NodeProto] | None] = {}
        self._dims: dict[str, tuple | None] = {}  # (a per-step state is asked for by each layer's Slice)

    def extent(self, name: str, axis: int) -> int | None:
        """Extent ``axis`` of ``name``: what the state's own ops say (:meth:`_state_extent`), else what the ops
        fix first (no inference), else what its type says."""
        d = self._state_extent(name, axis)
        if d is None:
            d = settled_dim(self.g, name, axis)
        if d is None:
            shape = self.g.model.shape(name)
            d = shape[axis] if shape and -len(shape) <= axis < len(shape) else None
        return d if isinstance(d, int) else None

    def rank(self, name: str) -> int | None:
        r = self._state_rank(name)
        if r is None:
            r = settled_rank(self.g, name)
        return r if r is not None else self.g.model.rank(name)

    # A state is a native op's output, or a Concat of such (a multi-layer state): their attributes say the
    # directions and the hidden size, and a Concat's extent along its axis is its parts'. Read so, a Slice of
    # a per-step state is judged without the dims walk back to the batch of each step's x (20,000 states of a
    # layer called per step: half of this pass' time). One Concat deep, no more: a Concat of Concats (outputs
    # gathered step by step) is no state, and is left to the general walk.
    def _state_dims(self, name: str) -> tuple | None:
        """``name``'s dims as :func:`output_dims` gives them, a Concat's of such as
        :func:`~rnnfuse.op_shapes.concatenated_dims` puts them together (a ``(input, axis)`` entry is no number)."""
        if name not in self._dims:
            self._dims[name] = self._dims_of_state(name)
        return self._dims[name]

    def _dims_of_state(self, name: str) -> tuple | None:
        p = self.g.producer.get(name)
        if p is None:
            return None
        dims = output_dims(p, name)
        if dims is not None or p.op_type != "Concat" or p.domain not in ("", "ai.onnx") or not p.input:
            return dims
        return concatenated_dims(p, [output_dims(q, i) if (q := self.g.producer.get(i)) is not None else None
                                     for i in p.input])

    def _state_rank(self, name: str) -> int | None:
        dims = self._state_dims(name)
        return None if dims is None else len(dims)

    def _state_extent(self, name: str, axis: int) -> int | None:
        dims = self._state_dims(name)
        d = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
        return d if isinstance(d, int) else None  # (else taken from an input: the general walk's)

    def part_sliced(self, n: NodeProto) -> tuple[str, NodeProto] | None:
        """If Slice ``n`` takes exactly one input of a Concat along the concatenated axis (a multi-layer
        state put together and split again per layer): (that input, the Concat)."""
        if id(n) not in self._parts:
            self._parts[id(n)] = _part_of_concat(self, n)
        return self._parts[id(n)]

    def carried_from(self, name: str) -> tuple[str, list[NodeProto]]:
        """The tensor ``name`` is an unchanged copy of, and the copying nodes in between."""
        g = self.g
        path = []
        while name:
            p = g.producer.get(name)
            if p is None or len(p.output) != 1:
                break
            if p.op_type in _PASS_THROUGH or (p.op_type == "Slice" and _is_whole_slice(self, p)):
                path.append(p)
                name = p.input[0]
                continue
            part = self.part_sliced(p) if p.op_type == "Slice" else None
            if part is None:
                break
            path += [p, part[1]]
            name = part[0]
        return name, path

    def readers(self, name: str) -> list[NodeProto]:
        """The nodes that read ``name``'s value: through a Concat, only the Slices that take ``name``'s part (a
        per-step multi-layer state is put together and split again; the other layers' parts do not read it)."""
        out = []
        for use in self.g.uses(name):
            out.append(use)
            if use.op_type != "Concat":
                continue
            for o in use.output:
                for sl in self.g.uses(o):
                    part = self.part_sliced(sl) if sl.op_type == "Slice" else None
                    if part is not None and part[0] != name:
                        continue  # takes another input's rows
                    out.append(sl)
        return out


def _steps(flow: _StateFlow, b: Builder, n: NodeProto) -> int | str:
    """How many steps op ``n`` runs: a number when the shape says, else a 1-element tensor read at run time."""
    # (what its ops fix first, no inference: torch's x[:, t:t+1] transposed, where the cone is too big to type)
    steps = flow.extent(n.input[0], 0)
    if steps is not None and steps > 0:
        return steps
    return b.dim(n.input[0], 0)


def _plus(b: Builder, a: int | str, c: int | str) -> int | str:
    """``a + c`` for step counts that are numbers or 1-element int64 tensors."""
    if isinstance(a, int) and isinstance(c, int):
        return a + c
    if a == 0 or c == 0:
        return c if a == 0 else a
    return b.op("Add", b.i64(a) if isinstance(a, int) else a, b.i64(c) if isinstance(c, int) else c)


def _tensor(b: Builder, v: int | str) -> str:
    return b.i64(v) if isinstance(v, int) else v


def _mergeable(g: Graph, n: NodeProto) -> bool:
    return (native_kind(n) is not None and attr(n, "direction", "forward") == "forward" and not attr(n, "layout", 0)
            and not _inp(n, 4)
            and all(g.const(_inp(n, k)) is not None for k in (1, 2)) and (not _inp(n, 3) or g.const(_inp(n, 3)) is not None))


class _SameRecurrence:
    """Whether two ops compute the same recurrence: kind, attributes, and equal weights, under one name or
    two. torch's dynamo without its optimizer computes each call's gate-reordered weights anew, slicing them at
    ``Shape(state)``: one name per call, one value for all. Values are compared only for ops a state links
    and whose weight names differ, each name's folded and hashed once, in place (a weight-heavy model's one
    op costs no copy)."""

    def __init__(self, g: Graph):
        self.g = g
        self._keys: dict[int, tuple] = {}
        self._digests: dict[str, tuple | None] = {}

    def __call__(self, a: NodeProto, b: NodeProto) -> bool:
        ka, kb = self._key(a), self._key(b)
        return ka[0] == kb[0] and all(x == y or (self._value(x) is not None and self._value(x) == self._value(y))
                                      for x, y in zip(ka[1], kb[1]))

    def _key(self, n: NodeProto) -> tuple:
        """((op, domain, attributes), the weights' names)"""
        got = self._keys.get(id(n))
        if got is None:
            weights = tuple(_inp(n, k) for k in weight_positions(n))
            attrs = tuple(sorted((a.name, a.SerializeToString()) for a in n.attribute))
            got = self._keys[id(n)] = ((n.op_type, n.domain, len(weights), attrs), weights)
        return got

    def _value(self, name: str) -> tuple | None:
        if name not in self._digests:
            v = self.g.const(name) if name else None
            self._digests[name] = None if v is None else (
                v.dtype.str, v.shape, hashlib.blake2b(memoryview(np.ascontiguousarray(v)).cast("B"),
                                                      digest_size=16).digest())
        return self._digests[name]


class _Links:
    """Which op's last state each op starts from (``prev``), when exactly one op follows each."""

    def __init__(self, flow: _StateFlow, ops: list[NodeProto]):
        self.prev: dict[int, NodeProto] = {}
        self.next: dict[int, NodeProto] = {}
        self.carriers: dict[int, list[NodeProto]] = {}  # op -> the copies between it and its predecessor
        same = _SameRecurrence(flow.g)
        members = {id(n) for n in ops}
        followers: dict[int, list[NodeProto]] = {}
        for n in ops:
            p, carriers = self._predecessor(flow, n, members, same)
            if p is not None:
                followers.setdefault(id(p), []).append(n)
                self.carriers[id(n)] = carriers
        by_id = {id(n): n for n in ops}
        for pid, fs in followers.items():
            if len(fs) == 1:  # one state followed two ways is a tree, not a chain
                self.next[pid] = fs[0]
                self.prev[id(fs[0])] = by_id[pid]

    @staticmethod
    def _predecessor(flow: _StateFlow, n: NodeProto, members: set, same: _SameRecurrence
                     ) -> tuple[NodeProto | None, list]:
        kind = native_kind(n)
        source, carriers = None, []
        for k, state in enumerate(kind.states):
            init = _inp(n, kind.inputs.index(f"initial_{state}"))
            if not init:
                return None, []
            name, path = flow.carried_from(init)
            p = flow.g.producer.get(name)
            if p is None or id(p) not in members or list(p.output).index(name) != k + 1:
                return None, []
            if source is not None and p is not source:
                return None, []
            if source is None and not same(p, n):
                return None, []
            source = p
            carriers += path
        return source, carriers

    def chains(self, ops: list[NodeProto]) -> list[list[NodeProto]]:
        out = []
        for n in ops:
            if id(n) in self.prev or id(n) not in self.next:
                continue
            chain = [n]
            while id(chain[-1]) in self.next:
                chain.append(self.next[id(chain[-1])])
            out.append(chain)
        return out


def _walk_on(g: Graph, name: str, use: NodeProto) -> list[str]:
    """The values a walk from ``name`` reaches through ``use`` (a Concat is passed through to the Slices of
    ``name``'s part, which :meth:`_StateFlow.readers` lists themselves; a Shape whose picks the ops fix is a
    constant, computed from no value: dynamo's per-call weights slice at ``Shape(state)``)."""
    if use.op_type == "Concat" or (use.op_type in SHAPE_READS and g.const(use.output[0]) is not None):
        return []
    return [o for o in use.output if o]


def _reads_chain(flow: _StateFlow, chain: list[NodeProto]) -> str | None:
    """Why one op's input is computed from an earlier op of the chain (None when none is): one walk
    forward from the chain's outputs that does not enter the chain's own ops."""
    members = {id(n) for n in chain}
    first_read = {}
    for k, n in enumerate(chain):
        first_read.setdefault(n.input[0], k)
    reached: set[str] = set()
    for k, n in enumerate(chain):  # in chain order: a value is first reached from the earliest op it reads
        stack = [o for o in n.output if o]
        while stack:
            name = stack.pop()
            if name in reached:
                continue
            reached.add(name)
            if first_read.get(name, -1) > k:
                return f"the input of op {first_read[name] + 1} is computed from op {k + 1}'s output"
            for use in flow.readers(name):
                if id(use) not in members:
                    stack.extend(_walk_on(flow.g, name, use))
    return None


def _only_carried_on(flow: _StateFlow, name: str, chain_ids: set, carriers: set) -> bool:
    """``name`` is read by nothing but the copies that carry it into the next op of a chain being merged."""
    if flow.g.is_graph_output(name):
        return False
    for use in flow.readers(name):
        if id(use) in chain_ids:
            continue
        if id(use) not in carriers:
            return False
        if use.op_type != "Concat" and not all(_only_carried_on(flow, o, chain_ids, carriers) for o in use.output):
            return False
    return True


def merge_chain(flow: _StateFlow, chain: list[NodeProto], group: list[list[NodeProto]], links: _Links
                ) -> dict[str, str]:
    """Add the merged op; returns the replacement of every output of the chain read outside it. ``group``:
    the chains merged together with this one (the layers of one stack share their state carriers)."""
    g = flow.g
    kind = native_kind(chain[0])
    if g.model.opset < 10:
        raise Decline(f"slicing the merged output needs opset 10; the model has opset {g.model.opset}")
    chain_ids = {id(n) for c in group for n in c}
    carriers = {id(x) for c in group for n in c for x in links.carriers.get(id(n), [])}
    why = _reads_chain(flow, chain)
    if why:
        raise Decline(why)
    for n in chain[:-1]:
        for k in range(2, 1 + len(kind.states)):  # the cell state (Y_c) of an op before the last
            if len(n.output) > k and n.output[k] and not _only_carried_on(flow, n.output[k], chain_ids, carriers):
                raise Decline(f"the cell state after step {chain.index(n) + 1} is read outside the chain")
    return _merged(flow, chain, lambda y_h: not _only_carried_on(flow, y_h, chain_ids, carriers),
                   lambda y: bool(g.n_uses(y) or g.is_graph_output(y)))


def _merged(flow: _StateFlow, chain: list[NodeProto], read_h, read_y, weights_of: list[NodeProto] | None = None
            ) -> dict[str, str]:
    """Add one op over the inputs of ``chain`` concatenated along time; returns what replaces each op's
    outputs: its rows of ``Y`` (where ``read_y(Y)``), the row of its last step for ``Y_h`` (where
    ``read_h(Y_h)``), and the merged op's final states for the last op's. Its weights are the first op's,
    folded where ``weights_of`` (the ops merged, default ``chain``) computed them (passes.merged_weights)."""
    g = flow.g
    head, last = chain[0], chain[-1]
    kind = native_kind(head)
    n_states = len(kind.states)
    b = Builder(g, head, f"rnnfuse/{kind.op}")
    x = b.op("Concat", *[n.input[0] for n in chain], axis=0)
    attrs = {a.name: attr(head, a.name) for a in head.attribute}
    outs = g.add_node(kind.op, [x] + merged_inputs(g, weights_of or chain, b), 1 + n_states, name=f"rnnfuse/{kind.op}",
                      anchor=head, **attrs)
    repl: dict[str, str] = {}
    steps = [_steps(flow, b, n) for n in chain]
    # (each op's rows of Y: one Split where every op's step count is a number, else a Slice each)
    rows = b.split(outs[0], steps) if all(isinstance(s, int) for s in steps) else None
    start: int | str = 0
    for k, n in enumerate(chain):
        end = _plus(b, start, steps[k])
        y, y_h = _inp_out(n, 0), _inp_out(n, 1)
        if y and read_y(y):
            repl[y] = rows[k] if rows else b.op("Slice", outs[0], _tensor(b, start), _tensor(b, end), b.i64(0))
        if n is last:
            for j in range(1, 1 + n_states):
                if _inp_out(n, j):
                    repl[n.output[j]] = outs[j]
        elif y_h and read_h(y_h):
            if rows:  # (the last of its rows; constants shared by every stretch of one length)
                last_row = rows[k] if steps[k] == 1 else b.op("Slice", rows[k], b.i64(steps[k] - 1), b.i64(steps[k]),
                                                               b.i64(0))
            else:
                last_row = b.op("Slice", outs[0], _tensor(b, _plus(b, end, -1)), _tensor(b, end), b.i64(0))
            repl[y_h] = b.squeeze(last_row, [0])
        start = end
    return repl


def prefix_check(flow: _StateFlow, group: list[list[NodeProto]]) -> dict[str, str]:
    """What a big model validates in place of a merge: the first ``PREFIX_OPS`` ops of each chain merged the
    same way, every output of theirs against its rows of that op. The rest of a chain is the same op (kind,
    attributes, equal weights) starting from the state the one before ended in, passed on unchanged (the
    links prove it); what a prefix check does not see is proven so, as a chain's unchecked steps are. A 2,700-op
    chain validated whole was a 77,000-node check model (4 s to load, light)."""
    pairs: dict[str, str] = {}
    for chain in group:
        pairs.update(_merged(flow, chain[:PREFIX_OPS], lambda _: True, lambda _: True, chain))
    return pairs


def _inp_out(n: NodeProto, k: int) -> str:
    return n.output[k] if len(n.output) > k else ""


def _groups(chains: list[list[NodeProto]], links: _Links) -> list[list[list[NodeProto]]]:
    """Chains that share a state carrier (a multi-layer state's per-step Concat) merge together or not at
    all: merging one alone would leave the shared Concat reading a state that no longer exists."""
    owner: dict[int, int] = {}
    tied = DisjointSets(range(len(chains)))
    for i, chain in enumerate(chains):
        for n in chain:
            for c in links.carriers.get(id(n), []):
                tied.join(i, owner.setdefault(id(c), i))
    groups: dict[int, list] = {}
    for i, chain in enumerate(chains):
        groups.setdefault(tied.root(i), []).append(chain)
    return list(groups.values())


class MergeStepChains:
    """Chains of native ops over consecutive stretches of one sequence become one op."""

    name = "step-chains"
    fuses_only_with = frozenset(KINDS)  # the native ops it merges

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        ops = [n for n in g.nodes_of(*KINDS) if _mergeable(g, n)]
        flow = _StateFlow(g)
        links = _Links(flow, ops)
        big = len(g.nodes) > rewrite.WHOLE_MODEL_LIMIT  # (validated whole, else checked by a prefix)
        rewrites = []
        for group in _groups(links.chains(ops), links):
            head, end = group[0][0], group[-1][-1]
            where = f"{head.name or head.output[0]} .. {end.name or end.output[0]}"
            front = f"{len(group[0])} {head.op_type} ops" + (f" x {len(group)} layers" if len(group) > 1 else "")
            repl: dict[str, str] = {}
            try:
                for chain in group:
                    repl.update(merge_chain(flow, chain, group, links))
            except Decline as e:
                res.findings.append(Finding(self.name, front, where, "declined", reason=e.reason))
                continue
            f = Finding(self.name, front, where, "merged", cell=f"{head.op_type}(hidden={attr(head, 'hidden_size')})",
                        direction="forward", hidden=attr(head, "hidden_size"))
            rw = Rewrite(f, repl, tuple(n for chain in group for n in chain), {}, "the merged op differs")
            if big and any(len(chain) > PREFIX_OPS for chain in group):
                rw.proxy = prefix_check(flow, group)
                rw.proxy_how = f"the first {PREFIX_OPS} ops of each chain merged"
            rewrites.append(rw)
        # (the prefix checks' ops are never connected: dropped here, before a clean-up can merge a live node
        # into one of them)
        apply_rewrites(g, ctx, rewrites, res, prune=any(r.proxy is not None for r in rewrites))
        return res
