"""Whether onnxruntime loads a big model, asked of consecutive pieces of its main graph.

onnxruntime's session set-up grows faster than the nodes, whatever they are (1.32, one thread, optimizations
off: a plain chain of Tanh nodes loads in 0.49 / 1.19 / 3.34 s at 25,000 / 50,000 / 100,000 nodes, and the
100,000-op head a fused Loop replays in 5.1 s). The do-no-harm guard loads every fused model it cannot
judge by its changed region alone, so that load set the growth of a run on such a model.

The same argument that lets the guard judge a model by its changed region (rnnfuse.changed_region) lets it
judge one by pieces: onnxruntime decides whether it takes a node from the node, the types it reads and the
constant values it reads. Each piece is a run of consecutive nodes; the values it reads from earlier pieces
are declared as its inputs with the types ONNX inference gives them in the whole model, inferred with data
propagation as onnxruntime's load infers them (a Reshape to ``Shape(w)`` has w's dims); a Constant node it
reads is copied into it (onnxruntime makes Constants initializers, and a kernel may check their values when
it is built: a Resize's scales); the initializers and graph inputs it reads are copied, the declared types
of its values kept (onnxruntime checks a declaration against what it infers), and everything it computes
that is read later, not read at all, or a graph output, is an output. What no piece can see is the whole
graph's wiring (a name defined twice, a value read before it is defined, two nodes of one name): the pieces
are only cut from a model in which :class:`~rnnfuse.changed_region.NodeScan` found none of that. Nor can a
piece know the contents of a shape's values computed in an earlier one (a ``Shape``, a ``Gather`` of it:
rnnfuse.load_time_values), which onnxruntime's load carries along: such a value crossing a cut sends the
model to a whole load.
What is assumed: onnxruntime knows no more of a value crossing a cut than ONNX inference with data
propagation (both run the same ops' inference functions; a dim neither can compute, ``T * B`` say, is
unknown to both).

Only a pass is taken from the pieces. A piece that fails to load, a value of a type inference cannot give,
a model whose weights would be copied into many pieces (weight data beyond ``MAX_INLINE_BYTES``, external
data), or a model too small to gain: the whole model is loaded, as before, and its load alone says what is
wrong.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from onnx import ModelProto, NodeProto

from .changed_region import MAX_INLINE_BYTES, NodeScan, inline_bytes
from .model_parts import Frame, LocalFunctions, part_model, split_constants
from .piecewise_runs import piece_bounds
from .protos import call_sizes, nodes_within
from .tensor_types import may_carry_shape_values

# a model of fewer nodes is loaded whole (its load is cheap enough), a bigger one in pieces of at most
# PIECE_NODES nodes: see rnnfuse.piecewise_runs for why that size (nodes counted as onnxruntime sets them up:
# subgraphs' and the bodies of the model-local functions called)
MIN_CUT_NODES = 20_000
PIECE_NODES = 2_500
MAX_LOAD_THREADS = 4  # (pieces loading at once; see load_threads)
IN_FLIGHT_BYTES = 16 << 20  # (the serialised pieces waiting or loading at once; see all_pass)
# how far a cut moves, at most, to keep a load-time value within one piece: this share of a piece (see
# _off_load_time_values)
CUT_REACH_SHARE = 0.2


class Pieces:
    """A big model cut into pieces onnxruntime loads apart (see the module). ``crossing``: the values
    one piece computes and a later one reads, whose types the whole model's inference must give."""

    def __init__(self, model: ModelProto, scan: NodeScan, spans: list[tuple[int, int]]):
        self.model, self.scan, self.spans = model, scan, spans
        self.reads, self.outputs = _boundaries(scan, spans, {v.name for v in model.graph.output})
        # a Constant read across a cut is copied into the reading piece (model_parts.split_constants)
        self.constants: list[list[NodeProto]] = [[] for _ in spans]
        for k, names in enumerate(self.reads):
            self.constants[k], self.reads[k] = split_constants(scan, names)
        self.crossing = {name for names in self.reads for name in names if name in scan.producer}

    @classmethod
    def cut(cls, model: ModelProto, scan: NodeScan | None = None) -> "Pieces | None":
        """The pieces of ``model`` (``scan``: its NodeScan, when the caller has it); None when it is not
        worth cutting or cannot be judged by pieces."""
        g, calls = model.graph, call_sizes(model)
        if nodes_within(g, MIN_CUT_NODES, calls) < MIN_CUT_NODES or g.sparse_initializer or inline_bytes(model) > MAX_INLINE_BYTES:
            return None
        scan = NodeScan(model) if scan is None else scan
        if scan.fault is not None:
            return None
        spans = piece_bounds(scan.nodes, PIECE_NODES, calls)
        spans = _off_load_time_values(scan, spans)
        return cls(model, scan, spans) if len(spans) > 1 else None

    def load(self, types: dict[str, bytes]) -> bool:
        """Whether every piece loads, its inputs from earlier pieces typed by ``types`` (:meth:`types_of`).

        The pieces load side by side (:func:`all_pass` on :func:`load_threads` threads), built in this thread
        while sessions are set up in the others: onnxruntime 1.32 sets a session up without holding the GIL
        (measured, 2 cores: the 100,000-op head a fused Loop replays, 40 pieces, 1.7 -> 1.0 s; 11,111 stacked
        Loops' RNNs, 2.5 -> 0.9 s). An onnxruntime that holds it loads them one at a time all the same."""
        from .guard import onnxruntime_error

        frame, functions = Frame(self.model.graph), LocalFunctions(self.model.functions)
        built = (_piece_model(self.model, frame, copied + self.scan.nodes[start:stop], read, out, types, functions).SerializeToString()
                 for (start, stop), read, out, copied in zip(self.spans, self.reads, self.outputs, self.constants))
        return all_pass(built, onnxruntime_error, load_threads())

    def types_of(self, inferred: ModelProto) -> dict[str, bytes] | None:
        """The crossing values' serialised types in ``inferred`` (the model as ONNX inference typed it); None
        when one has none."""
        g, names = inferred.graph, self.crossing
        types = {v.name: v.type.SerializeToString() for v in (*g.value_info, *g.output) if v.name in names and v.HasField("type")}
        # (the values computed at load are the scan's, decided in its one pass: a walk back from each crossing
        # value took 0.8 s of a fused 90,000-node model's check)
        at_load = self.scan.computed_at_load
        if len(types) != len(names) or any(name in at_load and may_carry_shape_values(t) for name, t in types.items()):
            return None  # (a shape value crossing a cut: its contents, known to the whole load, would be hidden)
        return types


def load_threads() -> int:
    """How many pieces load at once: the cores this process may run on, at most ``MAX_LOAD_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_LOAD_THREADS))


def all_pass(items: Iterator[bytes], check: Callable[[bytes], str | None], threads: int,
             max_bytes: int = IN_FLIGHT_BYTES) -> bool:
    """Whether ``check`` finds nothing wrong (returns None) with each of ``items`` (serialised models), checked
    on ``threads`` threads: the answer checking them one by one gives.

    The items are handed to the threads in order, one more than the threads at most (one ready to start), and
    only while their bytes stay within ``max_bytes`` (one is always handed on): each piece's session holds its
    own copy of the weights the piece reads, so pieces that copy big shared weights load one at a time, as they
    did. The next item is drawn while those are checked. At the first complaint, in the items' order, the
    answer is False: none is drawn after it, those not started are dropped, and the checks running finish
    first. What ``check`` raises is raised; what the iterator raises too, once the items drawn before it are
    judged (a complaint among them is the answer)."""
    if threads <= 1:
        return all(check(item) is None for item in items)
    pool = ThreadPoolExecutor(max_workers=threads)
    waiting: collections.deque = collections.deque()  # (future, bytes) in the items' order
    held = 0
    try:
        it = iter(items)
        while True:
            try:
                item = next(it, None)
            except Exception:
                if not all(f.result() is None for f, _ in waiting):
                    return False
                raise
            if item is None:
                return all(f.result() is None for f, _ in waiting)
            while waiting and (len(waiting) > threads or held + len(item) > max_bytes):
                f, size = waiting.popleft()  # (the next one, built, waits for room)
                held -= size
                if f.result() is not None:
                    return False
            waiting.append((pool.submit(check, item), len(item)))
            held += len(item)
            del item
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _off_load_time_values(scan: NodeScan, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` with each cut moved, by at most :data:`CUT_REACH_SHARE` of a piece, to the nearest one no value
    computed at load time crosses (rnnfuse.load_time_values: a shape's entries computed in one piece and read in
    a later one send the whole model to a whole load, see :meth:`Pieces.types_of`). Exported graphs compute
    shapes all along (a fused masked op's lengths and step indices are ``Shape``, ``Slice``, ``Range`` of its
    input): cut at fixed counts, a 45,000-node model of 1,000 such ops had 59 shapes among its 99 crossing
    values and loaded whole, 2.9 s where its pieces load in 0.9 s. A cut with no such position within reach
    stays where it was. Linear: each value's reach is marked once, in a difference array over the positions."""
    n = len(scan.nodes)
    if len(spans) < 2:
        return spans
    opened = [0] * (n + 2)  # +1 where a load-time value's reach starts (after its producer), -1 past its end
    for name in scan.computed_at_load:
        at, readers = scan.producer[name], scan.readers.get(name)
        if readers and readers[-1] > at and scan.nodes[at].op_type != "Constant":  # (a Constant is copied: cut)
            opened[at + 1] += 1
            opened[readers[-1] + 1] -= 1
    crossed, depth = [False] * (n + 1), 0  # crossed[c]: a load-time value crosses a cut before position c
    for c in range(n + 1):
        depth += opened[c]
        crossed[c] = depth > 0
    cuts: list[int] = []
    reach = int(PIECE_NODES * CUT_REACH_SHARE)
    for start, _ in spans[1:]:
        best = start
        for d in range(reach + 1) if crossed[start] else ():
            if 0 < start - d and not crossed[start - d]:
                best = start - d
                break
            if start + d < n and not crossed[start + d]:
                best = start + d
                break
        if 0 < best < n and (not cuts or best > cuts[-1]):
            cuts.append(best)
    bounds = [0, *cuts, n]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def _boundaries(scan: NodeScan, pieces: list[tuple[int, int]], graph_outputs: set[str]
                ) -> tuple[list[list[str]], list[list[str]]]:
    """Per piece, the names it reads from outside itself (earlier pieces, graph inputs, initializers) and
    those it computes that a later piece reads, nothing reads, or the graph outputs: one pass over the scan's
    maps."""
    piece_of = [0] * len(scan.nodes)
    for k, (start, stop) in enumerate(pieces):
        piece_of[start:stop] = [k] * (stop - start)
    reads: list[list[str]] = [[] for _ in pieces]
    outputs: list[list[str]] = [[] for _ in pieces]
    producer, readers = scan.producer, scan.readers
    for name, at in readers.items():
        home = piece_of[producer[name]] if name in producer else -1
        last = home
        for r in at:  # (positions in order: each reading piece once)
            k = piece_of[r]
            if k != home and k != last:
                reads[k].append(name)
                last = k
        if home >= 0 and (last != home or name in graph_outputs):
            outputs[home].append(name)
    for name, at in producer.items():
        if name not in readers:  # (read by nothing: an output, so onnxruntime keeps its node)
            outputs[piece_of[at]].append(name)
    return reads, outputs


def _piece_model(model: ModelProto, frame: Frame, nodes: list[NodeProto], read: list[str], out: list[str],
                 types: dict[str, bytes], functions: LocalFunctions | None = None) -> ModelProto:
    """``nodes`` as a model (see the module): ``read`` its inputs, ``out`` its outputs; the functions they call."""
    m = part_model(model, "rnnfuse_piece", nodes, functions)
    sub = m.graph
    frame.declare_reads(sub, read, types)
    declared = {o: frame.declared[o] for n in nodes for o in n.output if o in frame.declared}
    for name in out:
        vi = sub.output.add()
        if name in frame.outputs:
            vi.CopyFrom(frame.outputs[name])
            declared.pop(name, None)
        elif name in declared:
            vi.CopyFrom(declared.pop(name))
        else:
            vi.name = name
            if name in types:
                vi.type.ParseFromString(types[name])
    sub.value_info.extend(declared.values())
    return m
