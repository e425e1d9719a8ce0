"""A check model's shared upstream, run apart and once.

A validation (:mod:`rnnfuse.validate`) computes old and new tensors from the model's inputs through every node
they are computed from. Part of that cone is the same computation for both sides: the nodes an old and a new
tensor are both computed from and that read no mask the validation overrides ("the shared upstream": a
prologue, an encoder, a convolutional backbone). Its values do not depend on the rewrite, so:

* when it is big, it runs in a session of its own once per generated input set, and the check model starts
  where it ends, its last values fed as inputs (the check model runs each input set up to five times: once
  to learn the masks' shapes, once per padding pattern);
* its values are kept for the optimizer run, each under a digest of what computes it (the cone's ops,
  attributes and subgraphs; weights by name, type and, when small, value; graph inputs by name) and of the
  inputs it was computed from: a later validation whose cone holds the same computation starts from them
  instead of running it again. (A recurrence behind a 100,000-node prologue was validated three times, by the
  Loop front end, the bidirectional merge and the stacked-input clean-up, each loading and running the
  prologue in onnxruntime.) Within the round that ran it, while the graph's edit log shows none of its nodes
  edited, a later validation takes its values without walking or digesting it at all (:class:`_UpstreamRun`).

Both sides of the check still read the same values at the cut, computed by onnxruntime from the same inputs,
so the comparison is the one the whole check model made. rnnfuse never rewrites a weight in place (new
weights get new names): a big weight is known by its name, type, shape and size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from onnx import NodeProto, TensorProto

from .piecewise_runs import run_in_pieces
from .graph import Graph
from .protos import has_subgraph, takes_attributes, tensor_nbytes

# a shared upstream of fewer nodes (and lighter weights) stays in the check model: a session of its own costs
# more than running it with the rest
MIN_NODES = 1000
MIN_WEIGHT_BYTES = 8 << 20
# values kept for later validations, at most this much in all (each input set is small: batch <= 4, T <= 9,
# but static shapes keep their size: images, say); a cut whose values are bigger than CUT_BYTES is not made
KEPT_BYTES = 64 << 20
CUT_BYTES = 64 << 20
# the shared upstream runs in sessions of this many nodes at most (see _run_upstream)
PIECE_NODES = 2_500
_SMALL_WEIGHT_BYTES = 1 << 16  # weights this small are known by their value too


@dataclass
class Cut:
    """Where a check model starts: ``nodes`` (the cone's nodes it still holds, in topological order) and the
    tensors it is fed instead of computing them, with their value for each input set."""

    nodes: list[NodeProto]
    given: dict[str, list[np.ndarray]] = field(default_factory=dict)


class KeptValues:
    """Values of shared upstreams computed during one optimizer run: digest of a tensor's computation and of
    the inputs it was computed from -> its value."""

    def __init__(self, budget: int = KEPT_BYTES):
        self.values: dict[tuple[bytes, bytes], np.ndarray] = {}
        self.digests: set[bytes] = set()  # (of the computations kept for some inputs: one lookup a tensor)
        self.budget = budget
        self.runs: list[_UpstreamRun] = []  # (the upstreams run in this round, while their nodes stand unedited)

    def put(self, key: tuple[bytes, bytes], value: np.ndarray) -> None:
        if key not in self.values and value.nbytes <= self.budget:
            self.values[key] = value
            self.digests.add(key[0])
            self.budget -= value.nbytes


def kept_values(g: Graph) -> KeptValues:
    """The model's kept values (made on first use; in its facts, so they carry over to the next round)."""
    facts = g.model.facts
    if facts.upstream_values is None:
        facts.upstream_values = KeptValues()
    return facts.upstream_values


def cut(ort, g: Graph, pairs: list[tuple[str, str]], masks: list[str], inputs, open_session) -> Cut:
    """Where the check model of ``pairs`` starts, for the input sets ``inputs`` (a sequence of feeds, each made
    as it is read: validate.InputSets): after the values kept from earlier validations, and after this
    validation's shared upstream when it is big (run here, its values kept). Anything that cannot be cut (a
    value that is not a tensor, a session that fails) leaves the check model whole from there: it is what
    decides."""
    kept = kept_values(g)
    wanted = {n for p in pairs for n in p}
    fed: list[bytes] = []  # (the input sets' digests, when needed: each set is made again to be read)
    given: dict[str, list[np.ndarray]] = {}
    known: dict[str, bytes] = {}
    kept.runs = [run for run in kept.runs if g.edited_since(run.mark) is not None]  # (an earlier round's: gone)
    if kept.values:
        fed = [_inputs_digest(x) for x in inputs]
        # (an upstream run earlier this round, none of its nodes edited since: its values stand, and the cone
        # is not walked past them, nor digested: a 100,000-node prologue walked twice a validation)
        for run in kept.runs:
            for name, d in run.standing(g, masks).items():
                values = [kept.values.get((d, f)) for f in fed]
                if name not in wanted and all(v is not None for v in values):
                    given[name], known[name] = values, d
    reads = _reads_once(g)
    cone = g.cone(wanted, given, reads)
    digests, from_masks = _digests(g, cone, set(masks), known, reads)
    if kept.values:
        for name, d in digests.items():
            # (a value computed from a mask this validation overrides is computed again, from the override)
            if d in kept.digests and name not in from_masks and name not in given:
                values = [kept.values.get((d, f)) for f in fed]
                if all(v is not None for v in values):
                    given[name] = values
    # (what is still needed once the kept values are fed)
    nodes = g.cone(wanted, given, reads) if len(given) > len(known) else cone
    shared = _shared_upstream(nodes, pairs, from_masks, reads)
    if not _worth_running_apart(g, shared) or any(o in wanted for n in shared for o in n.output):
        return Cut(nodes, given)
    ids = {id(n) for n in shared}
    boundary = _boundary(g, nodes, ids, reads)
    try:
        values = _run_upstream(ort, g, shared, boundary, given, inputs, open_session, reads)
    except Exception:  # (the check model holds it again, and says what fails)
        return Cut(nodes, given)
    if values is None or sum(v.nbytes for per_set in values.values() for v in per_set) > CUT_BYTES:
        return Cut(nodes, given)
    fed = fed or [_inputs_digest(x) for x in inputs]
    for name, per_set in values.items():
        for f, v in zip(fed, per_set):
            kept.put((digests[name], f), v)
    if not any(i in given for n in shared for i in reads(n)) and not any(has_subgraph(n) for n in shared):
        kept.runs.append(_UpstreamRun(g, shared, {name: digests[name] for name in values}, reads))
    rest = [n for n in nodes if id(n) not in ids]
    read = {i for n in rest for i in reads(n)}
    return Cut(rest, {**{k: v for k, v in given.items() if k in read}, **values})


_DIGEST = 16
_NO_INPUT = bytes(_DIGEST + 2)
_FIRST_OUTPUT = (0).to_bytes(2, "little")


class _UpstreamRun:
    """A shared upstream run this round (its values kept under ``boundary``: name -> digest), reading only
    graph inputs and weights, holding no subgraph. A later validation of the round takes its boundary
    values without walking or digesting the upstream again (a 100,000-node prologue was walked twice a
    validation) as long as the graph's edit log shows none of its nodes rewired and no new node computing a
    value they computed (nodes of it removed since were dead, or that would show). A new round (a finalized
    graph, another view) ends its standing: digests alone find its values again."""

    def __init__(self, g: Graph, nodes: list[NodeProto], boundary: dict[str, bytes], reads=None):
        self.ids = ids = {id(n) for n in nodes}
        self.nodes = nodes  # (held: their ids stay theirs)
        self.outputs = {o for o, p in g.producer.items() if id(p) in ids}  # (the index's names: no node read)
        inputs = set(g.input_names)
        self.inputs = {i for n in nodes for i in (reads or g.reads)(n) if i in inputs}  # (graph inputs it reads)
        self.boundary = boundary
        self.mark = g.edit_mark()

    def standing(self, g: Graph, masks: list[str]) -> dict[str, bytes]:
        """Its boundary values (name -> digest) that are still what it computed, computed from none of
        ``masks`` (a validation overriding a mask computes what reads it again, from the override)."""
        since = g.edited_since(self.mark)
        if since is None:  # (finalized since, or another graph's)
            return {}
        ids, outputs = self.ids, self.outputs
        for n in since:
            if (id(n) in ids and g.alive(n)) or (id(n) not in ids and any(o in outputs for o in n.output)):
                return {}  # (one of its nodes rewired, or a new node computing one of its values)
        # what the masks it computes or reads reach within it, walked forward from them (a mask's own value is
        # what the check overrides it from: it stands)
        reached: set[str] = set()
        stack = [m for m in masks if m in outputs or m in self.inputs]
        while stack:
            for r in g.uses(stack.pop()):
                if id(r) in ids:
                    for o in r.output:
                        if o and o not in reached:
                            reached.add(o)
                            stack.append(o)
        producer = g.producer
        return {b: d for b, d in self.boundary.items() if b not in reached and id(producer.get(b)) in ids}


def _reads_once(g: Graph) -> Callable[[NodeProto], list[str]]:
    """``g.reads``, each node's answer kept for the validation: protobuf builds a new string per name at each
    read of a node's inputs, and a validation walks its cone (a 100,000-node prologue) five times."""
    memo: dict[int, list[str]] = {}

    def reads(n: NodeProto) -> list[str]:
        r = memo.get(id(n))
        if r is None:
            r = memo[id(n)] = g.reads(n)
        return r

    return reads


def _digests(g: Graph, cone: list[NodeProto], masks: set[str], known: dict[str, bytes] | None = None,
             reads: Callable[[NodeProto], list[str]] | None = None) -> tuple[dict[str, bytes], set[str]]:
    """Every tensor the cone (in topological order) computes -> a digest of its computation (the graph
    inputs and weights it reads included; the ``known`` values' digests given): equal digests, same values
    from the same inputs. And which of them are computed from one of ``masks``. One pass: this walks every
    node of a cone that may hold a 100,000-node prologue."""
    out: dict[str, bytes] = dict(known or {})
    from_masks: set[str] = set()
    blake2b = hashlib.blake2b
    initializers, input_names = g.initializers, set(g.input_names)  # (a set: a leaf each, 10,000 inputs)

    def leaf(name: str) -> bytes:
        w = initializers.get(name)
        if w is None or name in input_names:
            d = blake2b(b"in\0" + name.encode(), digest_size=_DIGEST).digest()
        else:
            h = blake2b(f"w\0{name}\0{w.data_type}\0{tuple(w.dims)}\0".encode(), digest_size=_DIGEST)
            if tensor_nbytes(w) <= _SMALL_WEIGHT_BYTES and w.data_location != TensorProto.EXTERNAL:
                h.update(w.SerializeToString())
            else:
                h.update(str(tensor_nbytes(w)).encode())
            d = h.digest()
        out[name] = d = d + b"\xff\xff"
        return d

    reads = reads or g.reads
    opset = g.model.opset
    # (op, domain) -> whether its nodes may have attributes; (op, domain, inputs) -> the digest's header for a
    # node without: a 100,000-node prologue asks for a few of each
    takes: dict[tuple, bool] = {}
    headers: dict[tuple, bytes] = {}
    for n in cone:
        read = reads(n)  # (the prefix's input count marks where the captured values begin)
        domain, op = n.domain, n.op_type
        kind = (op, domain)
        with_attributes = takes.get(kind)
        if with_attributes is None:
            with_attributes = takes[kind] = takes_attributes(op, domain, opset)
        # (the attributes of an op that takes none are not read: a 100,000-node prologue of Adds and Muls left a
        # map on each node's object at the first read of its empty field, 36 MB, see protos.node_field)
        if with_attributes:
            attrs = b"".join(a.SerializeToString() for a in n.attribute)
            parts = [f"{domain}\0{op}\0{len(n.input)}\0{len(attrs)}\0".encode(), attrs]
        else:
            key = (op, domain, len(n.input))
            header = headers.get(key)
            if header is None:
                header = headers[key] = f"{domain}\0{op}\0{len(n.input)}\0{0}\0".encode()
            parts = [header]
        for i in read:
            parts.append((out.get(i) or leaf(i)) if i else _NO_INPUT)
            if i in masks or i in from_masks:
                from_masks.update(n.output)
        base = blake2b(b"".join(parts), digest_size=_DIGEST).digest()
        outs = n.output[:]
        if len(outs) == 1:
            if outs[0]:
                out[outs[0]] = base + _FIRST_OUTPUT
            continue
        for k, o in enumerate(outs):
            if o:
                out[o] = base + k.to_bytes(2, "little")
    return out, from_masks


def _inputs_digest(feeds: dict[str, np.ndarray]) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for name in sorted(feeds):
        a = np.ascontiguousarray(feeds[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.digest()


def _shared_upstream(nodes: list[NodeProto], pairs, from_masks: set[str], reads) -> list[NodeProto]:
    """The nodes both an old and a new tensor are computed from, computing nothing from an overridden mask,
    in order (one pass back over ``nodes``, topologically sorted)."""
    old = {a for a, _ in pairs}
    new = {b for _, b in pairs}
    shared: set[int] = set()
    for n in reversed(nodes):
        outputs = n.output
        for_old = not old.isdisjoint(outputs)
        for_new = not new.isdisjoint(outputs)
        if for_old:
            old.update(reads(n))
        if for_new:
            new.update(reads(n))
        if for_old and for_new and from_masks.isdisjoint(outputs):
            shared.add(id(n))
    return [n for n in nodes if id(n) in shared]


def _worth_running_apart(g: Graph, shared: list[NodeProto]) -> bool:
    if not shared:
        return False
    if len(shared) >= MIN_NODES:
        return True
    weights = {i for n in shared for i in n.input if i in g.initializers}
    return sum(tensor_nbytes(g.initializers[w]) for w in weights) >= MIN_WEIGHT_BYTES


def _boundary(g: Graph, nodes: list[NodeProto], shared: set[int], reads) -> list[str]:
    """What the shared upstream hands on: its tensors read by the check model's other nodes (a mask it
    computes among them: what reads a mask is never shared, and the mask's override reads it too)."""
    made = {o for o, p in g.producer.items() if id(p) in shared}  # (the index's names: no node read)
    out: dict[str, None] = {}
    for n in nodes:
        if id(n) not in shared:
            out.update((i, None) for i in reads(n) if i in made)
    return list(out)


def _run_upstream(ort, g: Graph, shared: list[NodeProto], boundary: list[str], given: dict, inputs,
                  open_session, reads=None) -> dict[str, list[np.ndarray]] | None:
    """The boundary tensors' values for each input set, from sessions of the shared upstream alone, in
    pieces of ``PIECE_NODES`` nodes (their subgraphs' counted) run one after the other, each fed what earlier
    ones computed (:func:`rnnfuse.piecewise_runs.run_in_pieces`). None when a value handed from piece to piece
    is not a tensor, or they hold more than ``CUT_BYTES``.

    Why pieces: onnxruntime holds several KB per node while a session is open (a 100,000-node prologue's
    session took 280 MB, twice what the rest of the run held), and its session set-up grows faster than the
    nodes; a piece's session is closed once it ran (the next one opening meanwhile: two at most)."""
    return run_in_pieces(ort, g, shared, boundary, given, inputs, open_session, PIECE_NODES, CUT_BYTES, reads)
