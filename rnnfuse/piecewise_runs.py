"""Running a long run of a graph's nodes in onnxruntime as consecutive pieces, one session after the other.

onnxruntime holds several KB a node while a session is open, and its session set-up grows faster than the nodes.
Measured with onnxruntime 1.32, graph optimizations off, one thread: a Tanh/Sigmoid chain loads in 7.4 / 10.3 /
12.1 us a node at 2,500 / 10,000 / 20,000 nodes (3.3 s for 100,000), Loops stacked on one another in 22 / 27.5 /
29.7 us a node (bodies counted). So a long list of nodes in topological order is cut into runs of at most so
many nodes (their subgraphs' counted: a Loop of 8 body nodes is 9), each run is loaded as a model of its own and
run on every input set, fed what the earlier runs computed, and closed once it ran (the next one opens
meanwhile on a worker thread, :mod:`rnnfuse.sessions_ahead`): only the values crossing a cut are held between
sessions. The callers cut at 2,500 nodes: smaller pieces load hardly
faster a node (7.0 us at 1,000), and each piece costs a model built and a session's fixed set-up.

Used for a check model's shared upstream (:mod:`rnnfuse.upstream`), for a whole check model without masks
(:mod:`rnnfuse.validate`: 11,111 Loops stacked on one another and their RNNs were one 200,000-node session),
and, cut the same way, for the do-no-harm guard's load (:mod:`rnnfuse.load_in_pieces`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import NodeProto

from .check_session import model_of
from .graph import Graph
from .protos import call_key, has_subgraph, nodes_within, subgraphs
from .sessions_ahead import SessionsAhead


def weight(n: NodeProto, calls: dict | None = None) -> int:
    """How many nodes ``n`` is for a session: itself and its subgraphs' nodes at any depth (``calls``, see
    protos.call_sizes: and the nodes a call of a model-local function expands to)."""
    own = 1 + (calls.get(call_key(n), 0) if calls else 0)
    return own + (sum(nodes_within(sg, calls=calls) for sg in subgraphs(n)) if has_subgraph(n) else 0)


def piece_bounds(nodes: list[NodeProto], limit: int, calls: dict | None = None) -> list[tuple[int, int]]:
    """Runs of consecutive positions of ``nodes`` holding at most ``limit`` nodes each, subgraphs included (a
    node whose subgraphs hold more is a piece of its own; ``calls``: see :func:`weight`)."""
    pieces: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(nodes):
        k = weight(n, calls)
        if size and size + k > limit:
            pieces.append((start, i))
            start, size = i, 0
        size += k
    if size:
        pieces.append((start, len(nodes)))
    return pieces


def run_in_pieces(ort, g: Graph, nodes: list[NodeProto], wanted: list[str], given: dict[str, list[np.ndarray]],
                  inputs, open_session, limit: int, max_bytes: int, reads=None,
                  take: Callable[[str, list[np.ndarray]], None] | None = None) -> dict[str, list[np.ndarray]] | None:
    """The values of ``wanted`` (tensors ``nodes`` compute) for each input set of ``inputs`` (a sequence of feeds),
    from sessions of ``nodes`` (of ``g``, in topological order) in pieces of at most ``limit`` nodes run one after
    the other, each fed what the earlier ones computed and ``given`` (name -> its value per input set).

    ``take(name, values)``: each wanted value is handed to it as soon as its piece ran, and held after that only
    while a later piece reads it (the result is then empty); without it every wanted value is held to the end.
    None when a value a piece computes is not a tensor, or the values held at once exceed ``max_bytes``.
    ``open_session(ort, model, big)`` opens a piece's session; what it or a run raises is raised."""
    reads = reads or g.reads
    bounds = piece_bounds(nodes, limit)
    last_reader: dict[str, int] = {}  # value -> the last piece reading it (held to the end: past the last one)
    piece_of: dict[int, int] = {}
    for k, (a, b) in enumerate(bounds):
        for n in nodes[a:b]:
            piece_of[id(n)] = k
            for i in reads(n):
                last_reader[i] = k
    if take is None:
        for w in wanted:
            last_reader[w] = len(bounds)
    # what each piece hands on: its values a later piece reads, found from the index's producers (no node's
    # outputs read again), and the wanted values it computes
    handed: list[dict[str, None]] = [{} for _ in bounds]
    producer = g.producer
    for name, last in last_reader.items():
        k = piece_of.get(id(producer.get(name)))
        if k is not None and last > k:
            handed[k][name] = None
    taken: list[list[str]] = [[] for _ in bounds]
    if take is not None:
        for w in wanted:
            k = piece_of.get(id(producer.get(w)))
            if k is None:
                raise ValueError(f"'{w}' is not computed by the nodes run")
            handed[k][w] = None
            taken[k].append(w)
    values: dict[str, list[np.ndarray]] = dict(given)
    if len(bounds) > 1:
        inputs = _made_once(inputs, max_bytes)

    def model(k: int) -> tuple:
        # (the graph's own nodes: the model copies them as it takes them, and nothing here changes them)
        m, big = model_of(g, nodes[bounds[k][0]:bounds[k][1]], [onnx.ValueInfoProto(name=o) for o in handed[k]],
                          values, "rnnfuse_piece", reads=reads)
        return m, big, None

    with SessionsAhead(threaded=len(bounds) > 1) as ahead:
        opens = lambda m, big: open_session(ort, m, big)  # noqa: E731
        coming = ahead.open(lambda: model(0), opens) if bounds else None
        for k in range(len(bounds)):
            sess = coming.result()[0]
            computed = _ran(sess, list(handed[k]), inputs, values)
            if computed is None:
                return None
            values.update(computed)
            if k + 1 < len(bounds):  # (its model declares the values fed to it by their shapes: built now)
                coming = ahead.open(lambda k=k: model(k + 1), opens)
            del sess
            for w in taken[k]:
                take(w, computed[w])
            values = {name: v for name, v in values.items() if last_reader.get(name, -1) > k}
            if sum(v.nbytes for per_set in values.values() for v in per_set) > max_bytes:
                return None
    return {w: values[w] for w in wanted} if take is None else {}


def _ran(sess, outputs: list[str], inputs, values: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]] | None:
    """``outputs`` of a piece's session run on each input set (fed ``values`` where it reads them); None when
    one is not a tensor."""
    fed = [i.name for i in sess.get_inputs()]
    computed: dict[str, list[np.ndarray]] = {o: [] for o in outputs}
    for s, feeds in enumerate(inputs):
        outs = sess.run(outputs, {name: values[name][s] if name in values else feeds[name] for name in fed})
        for o, v in zip(outputs, outs):
            if not isinstance(v, np.ndarray):
                return None
            computed[o].append(v)
    return computed


def _made_once(inputs, max_bytes: int):
    """The input sets as a list, each made once, when together they hold at most ``max_bytes``; else ``inputs``
    as given (a sequence that makes each set again when asked, one at a time: see validate.InputSets). Each
    piece feeds every set, and making all of a model's graph inputs again per piece was pieces x inputs (a
    model of thousands of graph inputs)."""
    if isinstance(inputs, list) or not (hasattr(inputs, "__len__") and hasattr(inputs, "__getitem__")):
        return inputs
    made, held = [], 0
    for k in range(len(inputs)):
        made.append(inputs[k])
        held += sum(v.nbytes for v in made[-1].values())
        if held > max_bytes:
            return inputs
    return made
