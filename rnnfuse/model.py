"""The model being optimized: its proto, opsets, fresh names, tensor types, weight data and main graph.

Every pass sees the same :class:`Model`; its main graph (and, through it, every subgraph) is an editable
:class:`~rnnfuse.graph_edit.Graph`.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper

from .cone_types import ConeTypes
from .facts import ModelFacts
from .graph_edit import Graph
from .tensor_values import raw_array
from .model_parts import LocalFunctions
from .naming import NameAllocator
from .protos import CONTROL_FLOW, all_names, has_subgraph, nodes_within, subgraphs
from .tensor_types import CHEAP_INFERENCE_NODES, CHEAP_INFERENCE_SCOPE_WORK, declared_types, infer_types


class Model:
    """The model being optimized: opsets, fresh names, type information and the main :class:`Graph`."""

    def __init__(self, proto: ModelProto, external_dir: str | None = None, index_from: Graph | None = None):
        """``index_from``: the finalized main graph of an earlier view of ``proto``, whose index this one takes
        over (see Graph.next_view)."""
        self.proto = proto
        self.external_dir = external_dir  # where tensors stored as external data live (read lazily)
        self._maps: list = []
        self.opsets: dict[str, int] = {}
        for imp in proto.opset_import:
            self.opsets[imp.domain or ""] = imp.version
        self._names: NameAllocator | None = None
        self._types: dict[str, tuple[int, list | None]] | None = None
        self._declared: dict[str, tuple[int, list | None]] | None = None
        self._cones: ConeTypes | None = None  # (big models: types inferred cone by cone)
        self._next: Model | None = None  # (the next round's view, once there is one)
        self._functions: LocalFunctions | None = None  # (see local_functions)
        self.declared_by_edits: set[str] = set()  # (the names of the types :meth:`declare` recorded)
        self.graph = Graph(proto.graph, None, self) if index_from is None else index_from.next_view(self)
        # whether whole-model shape inference is cheap enough to fill in undeclared types (see known_type)
        self._may_infer = self.infers_whole(self.graph)
        # facts passes leave for later passes (e.g. which mask a sequence_lens tensor was computed from)
        self.facts = ModelFacts()

    @staticmethod
    def infers_whole(g) -> bool:
        """Whether a model whose main graph is ``g`` is inferred at once to fill in undeclared types (see
        :meth:`known_type`): its nodes, its bodies' counted too (a Loop whose body holds a 100,000-op head
        is no small model; counted only as far as the bound), under ``CHEAP_INFERENCE_NODES``, and its
        values times its subgraphs under ``CHEAP_INFERENCE_SCOPE_WORK`` (every subgraph is handed the types
        of the values around it: the graph's initializers count too)."""
        n = len(g.nodes)
        control_flow = g.nodes_of(*CONTROL_FLOW)
        for c in control_flow:
            if n >= CHEAP_INFERENCE_NODES:
                break
            n += sum(nodes_within(sg, CHEAP_INFERENCE_NODES) for sg in subgraphs(c))
        scope = len(g.nodes) + len(g.initializers)
        return n < CHEAP_INFERENCE_NODES and scope * len(control_flow) < CHEAP_INFERENCE_SCOPE_WORK

    @property
    def types_by_cone(self) -> bool:
        """Whether this view inferred types cone by cone (what :meth:`next_round` carries over)."""
        return self._cones is not None

    def next_round(self) -> "Model":
        """A fresh view of the same proto for another round of passes (see ``Pipeline.run``): names and types
        are rebuilt from the graph as it now is, its index taken over from this round's finalized graph; the
        facts passes left and open memory maps carry over, and so do the inferred types of values the round
        did not touch."""
        m = Model(self.proto, external_dir=self.external_dir, index_from=self.graph)
        m.facts = self.facts
        m._maps = self._maps
        if self._cones is not None and self.graph.redefined is not None and not m._may_infer:
            # (the types inferred this round of values the round did not touch, nor computed anything they
            # are computed from: a recurrence behind a 100,000-node prologue inferred it again each round)
            m._cones = self._cones.carried_over(m, self.graph.redefined)
        self._cones = None  # (this view is done: what it inferred lives on in the next one, or is stale)
        self._next = m
        if self.facts.upstream_values is not None:
            self.facts.upstream_values.runs.clear()  # (their standing ends with the round)
        return m

    @property
    def local_functions(self) -> LocalFunctions:
        """The model's local functions, and which of them some nodes need: a check model or a piece of one
        copies only those (each of 40 pieces copying all of 5,000 functions was pieces x functions). Listed
        once a view: no pass adds or removes a function."""
        if self._functions is None or len(self._functions.functions) != len(self.proto.functions):
            self._functions = LocalFunctions(self.proto.functions)
        return self._functions

    @property
    def names(self) -> NameAllocator:
        """Fresh names; every name in the model is collected the first time one is needed (a model nothing
        is added to never pays for it)."""
        if self._names is None:
            # the main graph's tensor names are the keys of its indices (no walk over every node's fields)
            g = self.graph
            used: set[str] = set(g.producer)
            # (the readers' keys one by one: a set updated from a dict makes room for all of its keys as if
            # none were there yet, and the producer's mostly are: 8 MB of table where 4 MB hold them, 108k nodes)
            used.update(iter(g.consumers), g.initializers, g.input_names, g.output_names)
            used.update(v.name for v in self.proto.graph.value_info)
            # the node names are packed into one string (see NameAllocator), joined a few thousand at a time
            parts: list[str] = []
            hashes: list[np.ndarray] = []
            chunk: list[str] = []

            def pack() -> None:
                parts.append("\0".join(chunk))
                hashes.append(np.fromiter(map(hash, chunk), np.int64, len(chunk)))
                chunk.clear()

            for n in g.nodes_and_removed():
                if n.name:
                    chunk.append(n.name)
                    if len(chunk) == 4096:
                        pack()
                if has_subgraph(n):
                    used.update(n.input, n.output)
                    for sg in subgraphs(n):
                        all_names(sg, used)
            if chunk:
                pack()
            packed = ("\0" + "\0".join(parts) + "\0", np.sort(np.concatenate(hashes))) if parts else None
            self._names = NameAllocator(used, packed)
        return self._names

    def release_pages(self) -> None:
        """Let the kernel drop the pages of memory-mapped external data we have read (they stay cached on
        disk); keeps the resident set small while huge weights are copied."""
        for mm in self._maps:
            release_mapped_pages(mm)

    def tensor_array(self, t: TensorProto) -> np.ndarray:
        """A tensor's values; external data is memory-mapped from its file, not loaded."""
        if t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"):
            import os

            info = {e.key: e.value for e in t.external_data}
            loc = info["location"]
            if self.external_dir is None and not os.path.isabs(loc):
                raise ValueError(f"tensor '{t.name}' is stored externally but the model's directory is unknown")
            path = loc if os.path.isabs(loc) else os.path.join(self.external_dir, loc)
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            offset = int(info.get("offset", 0))
            shape = tuple(t.dims)
            count = int(np.prod(shape)) if shape else 1
            mm = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
            self._maps.append(mm)
            return mm.reshape(shape)
        return raw_array(t)

    @property
    def opset(self) -> int:
        return self.opsets.get("", self.opsets.get("ai.onnx", 1))

    # -- types: one rule -------------------------------------------------------------------------------
    def known_type(self, name: str, whole_cone: bool = False) -> tuple[int, list | None] | None:
        """``(elem_type, dims)`` of ``name`` (dims: ints, strings for symbolic dimensions, None for unknown
        ones), by the one rule every type query follows: what the file or an edit declares; where that
        leaves the shape unknown, what shape inference gives, if this model is cheap to infer.

        Inference runs once, on the first query that needs it, on a skeleton of the model (no weight data).
        A model of ``CHEAP_INFERENCE_NODES`` nodes or more, or with so many subgraphs that inference would
        grow quadratic (``CHEAP_INFERENCE_SCOPE_WORK``), never runs it (it would cost seconds on graphs that
        often declare what the passes need anyway): there a query infers only the nodes the tensor is
        computed from, within a budget per model (:class:`~rnnfuse.cone_types.ConeTypes`), and only a cone
        that fits one inference; ``whole_cone``: any cone within the budget, inferred in pieces. A query
        whose answer decides what can be folded says so (a recurrence behind a 20,000-node prologue needs
        its input's shape); the many that only filter do not (each family source of a 100k-node trace asked
        through the whole chain: 78,000 nodes of inference, 1.1 s and 57 MB). In such a model :meth:`rank` and
        :meth:`elem_type` take what the ops fix first (exact, no inference; the dims' symbols are inference's
        to name, so this rule stays the one for dims)."""
        t = self.declared_type(name)
        if t is None or t[1] is None:
            if self._may_infer:
                if self._types is None:
                    self._types = infer_types(self.proto)
                t = self._types.get(name, t)
            else:
                if self._cones is None:
                    self._cones = ConeTypes(self)
                t = self._cones.type_of(name, one_piece=not whole_cone) or t
        return t

    @property
    def inferred_at_once(self) -> bool:
        """Whether this view fills in undeclared types by one inference of the whole model (see known_type)."""
        return self._may_infer

    def types_complete(self) -> bool:
        """Whether every type query so far got what one inference of its value's whole cone gives (none was
        given up on or inferred in pieces): an answer a later round, with a fresh budget, would give too."""
        return self._cones is None or not self._cones.incomplete

    def settle_types(self, names) -> None:
        """Infer the types of ``names`` whole (within the budget: see :meth:`known_type`) before an analysis
        that decides on them: a Loop's reads its inputs' ranks and dims in many places, each a filter's query
        that gets nothing from a cone too big for one inference (a Loop behind a 100,000-node prologue)."""
        if self._may_infer:
            return  # (the whole model's inference answers every query)
        for name in names:
            self.known_type(name, whole_cone=True)

    def settled_type(self, name: str) -> tuple[int, list | None] | None:
        """:meth:`known_type` where it costs no new walk: in a model inferred in one piece, the same; in a big
        one, what the file or an edit declares or an earlier query's cone established. For facts worth keeping
        but not worth a cone (the type of a tensor a rewrite replaces: a chain's stacked output is computed
        from every step, 20,000 nodes of inference for a bidirectional trace of 1,000 steps)."""
        if self._may_infer:
            return self.known_type(name)
        t = self.declared_type(name)
        if (t is None or t[1] is None) and self._cones is not None:
            t = self._cones.types.get(name) or t
        return t

    def established_type(self, name: str) -> tuple[int, list | None] | None:
        """What the run knows of ``name``'s type without inferring anything: what the file declares, else what
        an inference already gave it (the whole model's, or a cone's); asked of a view a later round replaced,
        the latest view answers. Not what an edit declared, nor a type inferred from one (the optimizer's own
        belief: the do-no-harm guard takes these answers instead of inferring, and must not check the
        optimizer against itself)."""
        m = self
        while m._next is not None:
            m = m._next
        t = None if name in m.declared_by_edits else m.declared_type(name)
        if t is None or t[1] is None:
            if m._types is not None:
                t = m._types.get(name) or t
            elif m._cones is not None and name not in m._cones.from_edits:
                t = m._cones.types.get(name) or t
        return t

    def declared_type(self, name: str) -> tuple[int, list | None] | None:
        """What the file or an edit declares about ``name`` (no inference)."""
        return self._declared_types().get(name)

    def _declared_types(self) -> dict[str, tuple[int, list | None]]:
        """What the file declares, read the first time it is asked, and what edits declared since."""
        if self._declared is None:
            self._declared = declared_types(self.proto, self.graph)
        return self._declared

    def elem_type(self, name: str) -> int | None:
        """``name``'s element type. In a model too big to infer whole, what the file or an edit declares, or
        what the ops fix (:func:`rnnfuse.elem_types.op_elem_type`), before any cone inference: an element type
        is asked of every tensor sliced into steps, and a cone inferred to learn it (its dims unasked) cost a
        model of 3,000 unbind / stack blocks 2 s."""
        if not self._may_infer:
            t = self.declared_type(name)
            if t is not None and t[0]:
                return t[0]
            from .elem_types import op_elem_type  # (the walk builds on the graph this module builds)

            et = op_elem_type(self.graph, name)
            if et is not None:
                return et
        t = self.known_type(name)
        return t[0] if t else None

    def shape(self, name: str) -> list | None:
        t = self.known_type(name)
        return t[1] if t else None

    def rank(self, name: str) -> int | None:
        """``name``'s rank. In a model too big to infer whole, what the ops fix
        (:func:`rnnfuse.op_shapes.op_rank`) before any cone inference (see :meth:`elem_type`)."""
        if not self._may_infer:
            from .op_shapes import op_rank  # (the walk builds on the graph this module builds)

            r = op_rank(self.graph, name)
            if r is not None:
                return r
        s = self.shape(name)
        return None if s is None else len(s)

    def declare(self, name: str, t) -> None:
        """Record the type (elem_type, dims) of a tensor an edit created, unless one is known."""
        declared = self._declared_types()
        if t is not None and declared.get(name) is None:
            declared[name] = t
            self.declared_by_edits.add(name)

    def restate(self, name: str, t) -> None:
        """Replace what the file declared about ``name`` (a rank it did not have: see rewrite.commit)."""
        self._declared_types()[name] = t
        self.declared_by_edits.add(name)


def release_mapped_pages(arr: np.ndarray) -> None:
    """Let the kernel drop the resident pages of the file mapping under a memory-mapped array (or a view of
    one); they come back from the page cache when read again. Anything else is left alone."""
    import mmap

    a = arr
    while a is not None:
        m = getattr(a, "_mmap", None)
        if m is not None:
            try:
                m.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):  # (closed, or a platform without madvise)
                pass
            return
        a = getattr(a, "base", None)
