"""A scope-aware, linear-time view of an ONNX graph that rewrites can edit.

rnnfuse works on the ``ModelProto`` directly (no import/export round trip): every pass sees the same
``Model`` object, whose graphs keep producer and consumer maps that are built once and updated on each edit.
Subgraph bodies (Loop, Scan, If) are graphs of their own with a ``parent``; names they capture from outer
scopes count as uses of the capturing node, so dead-code removal and use-replacement stay correct.

Edits never re-sort the node list; :meth:`Graph.finalize` does one stable topological sort, removes dead
nodes and unused initializers, and writes the result back into the proto.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Iterator

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from . import fold
from .facts import ModelFacts
from .protos import attr  # noqa: F401  (re-exported: passes read attributes through the graph module)

INT64_MAX = 2**63 - 1


def has_subgraph(node: NodeProto) -> bool:
    return node.op_type in _CONTROL_FLOW or (node.domain not in ("", "ai.onnx") and any(True for _ in subgraphs(node)))


_CONTROL_FLOW = {"Loop", "Scan", "If", "SequenceMap"}
_EMPTY: frozenset = frozenset()


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    if node.domain in ("", "ai.onnx") and node.op_type not in _CONTROL_FLOW:
        return
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def _graph_free_names(g: GraphProto) -> set[str]:
    """Names a graph reads that it does not define (its captures from enclosing scopes)."""
    defined = {i.name for i in g.input} | {i.name for i in g.initializer} | {""}
    used: set[str] = set()
    for n in g.node:
        used.update(n.input)
        for sg in subgraphs(n):
            used |= _graph_free_names(sg)
        defined.update(n.output)
    used.update(o.name for o in g.output)
    return used - defined


class NameAllocator:
    """Fresh, deterministic tensor/node names that collide with nothing in the model."""

    def __init__(self, used: Iterable[str]):
        self.used = set(used)
        self._counters: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        if hint not in self.used:
            self.used.add(hint)
            return hint
        i = self._counters.get(hint, 0)
        while True:
            i += 1
            cand = f"{hint}_{i}"
            if cand not in self.used:
                self._counters[hint] = i
                self.used.add(cand)
                return cand


def _all_names(g: GraphProto, out: set[str]) -> None:
    out.update(i.name for i in g.input)
    out.update(i.name for i in g.output)
    out.update(i.name for i in g.initializer)
    out.update(v.name for v in g.value_info)
    for n in g.node:
        out.update(n.input)
        out.update(n.output)
        if n.name:
            out.add(n.name)
        if has_subgraph(n):
            for sg in subgraphs(n):
                _all_names(sg, out)


# below this many nodes, shape inference (once per model) is cheaper than doing without the shapes it gives
CHEAP_INFERENCE_NODES = 20000


class Model:
    """The model being optimized: opsets, fresh names, type information and the main :class:`Graph`."""

    def __init__(self, proto: ModelProto, external_dir: str | None = None):
        self.proto = proto
        self.external_dir = external_dir  # where tensors stored as external data live (read lazily)
        self._maps: list = []
        self.opsets: dict[str, int] = {}
        for imp in proto.opset_import:
            self.opsets[imp.domain or ""] = imp.version
        self._names: NameAllocator | None = None
        self._types: dict[str, tuple[int, list | None]] | None = None
        self._declared: dict[str, tuple[int, list | None]] | None = None
        self.graph = Graph(proto.graph, None, self)
        # facts passes leave for later passes (e.g. which mask a sequence_lens tensor was computed from)
        self.facts = ModelFacts()

    def next_round(self) -> "Model":
        """A fresh view of the same proto for another round of passes (see ``Pipeline.run``): indices, names
        and types are rebuilt from the graph as it now is; the facts passes left and open memory maps carry over."""
        m = Model(self.proto, external_dir=self.external_dir)
        m.facts = self.facts
        m._maps = self._maps
        return m

    @property
    def names(self) -> NameAllocator:
        """Fresh names; every name in the model is collected the first time one is needed (a model nothing
        is added to never pays for it)."""
        if self._names is None:
            # the main graph's tensor names are the keys of its indices (no walk over every node's fields)
            g = self.graph
            used: set[str] = set(g.producer)
            used.update(g.consumers, g.initializers, g.input_names, g.output_names)
            used.update(v.name for v in self.proto.graph.value_info)
            for n in itertools.chain(g.nodes, g._graveyard):
                if n.name:
                    used.add(n.name)
                if has_subgraph(n):
                    used.update(n.input, n.output)
                    for sg in subgraphs(n):
                        _all_names(sg, used)
            self._names = NameAllocator(used)
        return self._names

    def release_pages(self) -> None:
        """Let the kernel drop the pages of memory-mapped external data we have read (they stay cached on
        disk); keeps the resident set small while huge weights are copied."""
        import mmap

        for mm in self._maps:
            m = getattr(mm, "_mmap", None)
            if m is not None and hasattr(m, "madvise"):
                try:
                    m.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError):
                    pass

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
        return numpy_helper.to_array(t)

    @property
    def opset(self) -> int:
        return self.opsets.get("", self.opsets.get("ai.onnx", 1))

    # -- types -------------------------------------------------------------------------------------------
    def types(self) -> dict[str, tuple[int, list | None]]:
        """Element type and shape (ints, strings for symbolic dims, None for unknown) of every named value.

        Shape inference runs once on a skeleton of the model (no weight data), so it is cheap for large models.
        """
        if self._types is None:
            self._types = infer_types(self.proto)
        return self._types

    def _type(self, name: str):
        if self._declared is None:
            self._declared = declared_types(self.proto)
        t = self._declared.get(name)
        if t is None or t[1] is None:
            t = self.types().get(name, t)
        return t

    def elem_type(self, name: str) -> int | None:
        t = self._type(name)
        return t[0] if t else None

    def shape(self, name: str) -> list | None:
        t = self._type(name)
        return t[1] if t else None

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)

    def known_type(self, name: str):
        """Declared, or inferred where inference is cheap: already done, or a graph of fewer than
        ``CHEAP_INFERENCE_NODES`` nodes (it runs once, on a skeleton of the model)."""
        t = self.declared_type(name)
        if (t is None or t[1] is None) and (self._types is not None or len(self.graph.nodes) < CHEAP_INFERENCE_NODES):
            t = self.types().get(name, t)
        return t

    def declare(self, name: str, t) -> None:
        """Record the type (elem_type, dims) of a tensor an edit created, unless one is known."""
        if self._declared is None:
            self._declared = declared_types(self.proto)
        if t is not None and self._declared.get(name) is None:
            self._declared[name] = t

    def declared_type(self, name: str):
        """The type the file (or an edit) declares for ``name``, without running shape inference."""
        if self._declared is None:
            self._declared = declared_types(self.proto)
        t = self._declared.get(name)
        if (t is None or t[1] is None) and self._types is not None:
            t = self._types.get(name, t)
        return t


def _skeleton(g: GraphProto, keep_bytes: int = 4096) -> GraphProto:
    out = GraphProto()
    out.name = g.name
    out.input.extend(g.input)
    out.output.extend(g.output)
    out.value_info.extend(g.value_info)
    for t in g.initializer:
        s = TensorProto()
        s.name = t.name
        s.data_type = t.data_type
        s.dims.extend(t.dims)
        if t.data_location != TensorProto.EXTERNAL and t.ByteSize() <= keep_bytes:
            s.CopyFrom(t)
        out.initializer.append(s)
    for n in g.node:
        m = out.node.add()
        m.CopyFrom(n) if not any(True for _ in subgraphs(n)) else _copy_node_skeleton(n, m, keep_bytes)
    return out


def _copy_node_skeleton(n: NodeProto, m: NodeProto, keep_bytes: int) -> None:
    m.op_type, m.domain, m.name = n.op_type, n.domain, n.name
    m.input.extend(n.input)
    m.output.extend(n.output)
    for a in n.attribute:
        b = m.attribute.add()
        if a.type == AttributeProto.GRAPH:
            b.name, b.type = a.name, a.type
            b.g.CopyFrom(_skeleton(a.g, keep_bytes))
        elif a.type == AttributeProto.GRAPHS:
            b.name, b.type = a.name, a.type
            for sg in a.graphs:
                b.graphs.append(_skeleton(sg, keep_bytes))
        else:
            b.CopyFrom(a)


def _type_of(vi: onnx.ValueInfoProto) -> tuple[int, list | None] | None:
    t = vi.type
    if not t.HasField("tensor_type"):
        return None
    tt = t.tensor_type
    if not tt.HasField("shape"):
        return (tt.elem_type, None)
    dims: list = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return (tt.elem_type, dims)


def _collect_types(g: GraphProto, out: dict, top: bool = True) -> None:
    """Types of every name; a subgraph's names never override the main graph's or each other's."""
    for vi in itertools.chain(g.input, g.output, g.value_info):
        t = _type_of(vi)
        if t is not None and (vi.name not in out or (top and out[vi.name][1] is None and t[1] is not None)):
            out[vi.name] = t
    for t in g.initializer:
        out[t.name] = (t.data_type, list(t.dims))
    for n in g.node:
        op = n.op_type
        if op == "Constant":
            for a in n.attribute:  # (the tensor's declared type: its data is never decoded for this)
                if a.name == "value" and a.type == AttributeProto.TENSOR and n.output:
                    out[n.output[0]] = (a.t.data_type, list(a.t.dims))
        elif op in _CONTROL_FLOW or n.domain not in ("", "ai.onnx"):
            for sg in subgraphs(n):
                _collect_types(sg, out, False)


def declared_types(proto: ModelProto) -> dict[str, tuple[int, list | None]]:
    """Types the file itself declares (inputs, outputs, value_info, initializers, Constants): no inference."""
    out: dict = {}
    _collect_types(proto.graph, out)
    return out


def infer_types(proto: ModelProto) -> dict[str, tuple[int, list | None]]:
    sk = ModelProto()
    sk.ir_version = proto.ir_version
    sk.opset_import.extend(proto.opset_import)
    sk.graph.CopyFrom(_skeleton(proto.graph))
    try:
        sk = onnx.shape_inference.infer_shapes(sk, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # inference is a convenience; fall back to what the file declares
        pass
    out: dict[str, tuple[int, list | None]] = {}
    _collect_types(sk.graph, out)
    return out


class Graph:
    """One graph scope with producer/consumer maps and edit operations."""

    def __init__(self, proto: GraphProto, parent: "Graph | None", model: Model, owner: NodeProto | None = None):
        self.proto = proto
        self.parent = parent
        self.model = model
        self.owner = owner  # the node whose attribute this graph is (None for the main graph)
        self.nodes: list[NodeProto] = list(proto.node)
        self._pos: dict[int, tuple] = {id(n): (i, 0) for i, n in enumerate(self.nodes)}
        self._seq = itertools.count(1)
        self._removed: set[int] = set()
        self._graveyard: list[NodeProto] = []
        self.initializers: dict[str, TensorProto] = {t.name: t for t in proto.initializer}
        self.input_names = [i.name for i in proto.input]
        self.output_names = [o.name for o in proto.output]
        self._inputs = set(self.input_names)
        self.producer: dict[str, NodeProto] = {}
        self.consumers: dict[str, list[NodeProto]] = {}
        self._implicit: dict[int, set[str]] = {}
        self._arrays: dict[str, np.ndarray | None] = {}
        self._subgraph_views: dict[int, Graph] = {}
        # nodes added or rewired (inputs or outputs renamed) since the graph was built or finalized, in edit
        # order: what an incremental pass (Dedupe after a fusion) has to look at again; finalize starts a new list
        self.edited: list[NodeProto] = []
        self._pruned: tuple | None = None  # _state() when the last prune (or finalize) left only live nodes
        self._input_sorted = self._index_all(self.nodes)

    # -- indexing ----------------------------------------------------------------------------------------
    def implicit_inputs(self, node: NodeProto) -> set[str]:
        if not has_subgraph(node):
            return _EMPTY
        key = id(node)
        if key not in self._implicit:
            free: set[str] = set()
            for sg in subgraphs(node):
                free |= _graph_free_names(sg)
            self._implicit[key] = free
        return self._implicit[key]

    def _index(self, n: NodeProto) -> None:
        producer, consumers = self.producer, self.consumers
        for o in n.output:
            if o:
                producer[o] = n
        ins = n.input
        if has_subgraph(n):
            ins = list(dict.fromkeys(itertools.chain(n.input, sorted(self.implicit_inputs(n)))))
        elif len(ins) > 1:
            ins = list(dict.fromkeys(ins))
        for i in ins:
            if i:
                lst = consumers.get(i)
                if lst is None:
                    consumers[i] = [n]
                else:
                    lst.append(n)

    def _index_all(self, nodes: list[NodeProto]) -> bool:
        """``_index`` for many nodes: one loop, each node's fields read once. Returns whether the nodes are
        in topological order (no node reads a value a later node produces)."""
        producer, consumers, get = self.producer, self.consumers, self.consumers.get
        early: list[str] = []  # names read before any node produced them (inputs, initializers, or disorder)
        captures = False
        for n in nodes:
            for o in n.output:
                if o:
                    producer[o] = n
            if n.op_type in _CONTROL_FLOW or (n.domain not in ("", "ai.onnx") and has_subgraph(n)):
                self._index_inputs(n)
                captures = True  # (what a subgraph reads is not checked here: the sort will do it)
                continue
            ins = n.input
            if len(ins) > 1:
                ins = dict.fromkeys(ins)
            for i in ins:
                if i:
                    if i not in producer:
                        early.append(i)
                    lst = get(i)
                    if lst is None:
                        consumers[i] = [n]
                    else:
                        lst.append(n)
        return not captures and not any(i in producer for i in early)

    def _index_inputs(self, n: NodeProto) -> None:
        consumers = self.consumers
        for i in dict.fromkeys(itertools.chain(n.input, sorted(self.implicit_inputs(n)))):
            if i:
                lst = consumers.get(i)
                if lst is None:
                    consumers[i] = [n]
                else:
                    lst.append(n)

    def _unindex(self, n: NodeProto) -> None:
        for o in n.output:
            if o and self.producer.get(o) is n:
                del self.producer[o]
        for i in set(n.input) | self.implicit_inputs(n):
            lst = self.consumers.get(i)
            if lst:
                lst[:] = [c for c in lst if c is not n]

    def subgraph(self, node: NodeProto, name: str = "body") -> "Graph":
        """The :class:`Graph` view of a node's graph attribute (created once per node)."""
        key = id(node)
        if key not in self._subgraph_views:
            g = next(a.g for a in node.attribute if a.name == name and a.type == AttributeProto.GRAPH)
            self._subgraph_views[key] = Graph(g, self, self.model, owner=node)
        return self._subgraph_views[key]

    def local_shape(self, name: str) -> list | None:
        """The shape this graph itself declares for ``name`` (its inputs, outputs, value_info).

        Sibling subgraphs may reuse names, so a body's own declarations beat the model-wide map."""
        if not hasattr(self, "_local_types"):
            self._local_types = {}
            for vi in itertools.chain(self.proto.input, self.proto.output, self.proto.value_info):
                t = _type_of(vi)
                if t is not None:
                    self._local_types[vi.name] = t
        t = self._local_types.get(name)
        return t[1] if t else None

    # -- queries -----------------------------------------------------------------------------------------
    def alive(self, node: NodeProto) -> bool:
        return id(node) not in self._removed

    def live_nodes(self) -> list[NodeProto]:
        return [n for n in self.nodes if id(n) not in self._removed]

    def is_graph_output(self, name: str) -> bool:
        return name in self.output_names

    def is_graph_input(self, name: str) -> bool:
        return name in self._inputs and name not in self.initializers

    def defines(self, name: str) -> bool:
        return name in self.producer or name in self.initializers or name in self._inputs

    def scope_of(self, name: str) -> "Graph | None":
        g: Graph | None = self
        while g is not None:
            if g.defines(name):
                return g
            g = g.parent
        return None

    def uses(self, name: str) -> list[NodeProto]:
        return self.consumers.get(name, [])

    def n_uses(self, name: str) -> int:
        return len(self.consumers.get(name, [])) + self.output_names.count(name)

    def const(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is constant (initializer, Constant, or foldable from constants)."""
        if not name:
            return None
        arrays = self._arrays
        if name in arrays:  # (computed for this scope before: this scope defines it)
            return arrays[name]
        g = self.scope_of(name)
        if g is None:
            return None
        return g._const_local(name)

    def _const_local(self, name: str) -> np.ndarray | None:
        if name in self._arrays:
            return self._arrays[name]
        self._arrays[name] = None  # guards cycles
        val: np.ndarray | None = None
        if name in self.initializers:
            if name not in self._inputs:  # an initializer that is also an input can be overridden
                val = self.model.tensor_array(self.initializers[name])
        elif name in self.producer:
            val = fold.fold_output(self, self.producer[name], name)
        self._arrays[name] = val
        return val

    def fill_value(self, name: str) -> float | None:
        """If ``name`` is a tensor filled with one value (of any, possibly dynamic, shape), that value."""
        c = self.const(name)
        if c is not None:
            flat = np.asarray(c).ravel()
            if flat.size and np.all(flat == flat[0]):
                return float(flat[0])
            return None
        g = self.scope_of(name)
        if g is None or name not in g.producer:
            return None
        n = g.producer[name]
        if n.op_type == "ConstantOfShape":
            v = attr(n, "value")
            return 0.0 if v is None else float(np.asarray(v).ravel()[0])
        if n.op_type == "Expand":
            return g.fill_value(n.input[0])
        if n.op_type in ("Identity", "Cast") and n.input:
            return g.fill_value(n.input[0])
        if n.op_type in ("Mul",):
            a, b = g.fill_value(n.input[0]), g.fill_value(n.input[1])
            if a == 0.0 or b == 0.0:
                return 0.0
        return None

    # -- edits -------------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        return self.model.names.fresh(hint)

    def add_node(
        self,
        op_type: str,
        inputs: list[str],
        n_outputs: int = 1,
        *,
        name: str | None = None,
        outputs: list[str] | None = None,
        domain: str = "",
        anchor: NodeProto | None = None,
        **attrs,
    ) -> list[str]:
        """Append a node; returns its output names. ``anchor`` places it near that node in the final order."""
        base = name or f"rnnfuse/{op_type}"
        if outputs is None:
            outputs = [self.fresh(f"{base}:{i}" if n_outputs > 1 else base) for i in range(n_outputs)]
        node = helper.make_node(op_type, inputs, outputs, name=self.fresh(base), domain=domain or None, **attrs)
        self.nodes.append(node)
        anchor_pos = self._pos.get(id(anchor), (len(self.nodes), 0)) if anchor is not None else (len(self.nodes), 0)
        self._pos[id(node)] = (anchor_pos[0], next(self._seq))
        self._index(node)
        self.edited.append(node)
        return outputs

    def add_initializer(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        t = numpy_helper.from_array(np.asarray(array).copy(order="C"), name)
        self.proto.initializer.append(t)
        self.initializers[name] = t
        self._arrays[name] = array
        return name

    def add_spilled_initializer(self, parts: list, shape: tuple, dtype, hint: str) -> str:
        """An initializer of ``shape`` whose data is the concatenation of ``parts`` (in C order), written
        block by block to a spill file and kept external."""
        import atexit
        import os
        import shutil
        import tempfile

        spill = self.model.facts.spill_dir
        if spill is None:
            spill = tempfile.mkdtemp(prefix="rnnfuse-spill-")
            atexit.register(shutil.rmtree, spill, True)
            self.model.facts.spill_dir = spill
        name = self.fresh(hint)
        path = os.path.join(spill, f"{len(os.listdir(spill))}.bin")
        # written one block of rows at a time, so no copy of the whole tensor is ever held in memory
        with open(path, "wb") as f:
            for p in parts:
                q = p if p.ndim <= 2 else p.reshape(-1, p.shape[-1])
                block = max(1, (32 << 20) // max(1, int(np.prod(q.shape[1:])) * np.dtype(dtype).itemsize))
                for r in range(0, int(q.shape[0]), block):
                    f.write(np.ascontiguousarray(q[r : r + block], dtype=dtype).tobytes())
                    self.model.release_pages()
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        t.dims.extend(shape)
        set_external(t, path, 0, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.proto.initializer.append(t)
        self.initializers[name] = t
        return name

    def remove_node(self, node: NodeProto) -> None:
        if id(node) in self._removed:
            return
        self._removed.add(id(node))
        self._graveyard.append(node)  # keep the object alive: its id must not be reused by a new node
        self._unindex(node)

    def remove_nodes(self, nodes: list[NodeProto]) -> None:
        """Remove many nodes at once: each consumer list is filtered once (a weight read by 2,000 unrolled
        steps would otherwise be rescanned per step)."""
        gone = {id(n) for n in nodes if id(n) not in self._removed}
        if len(gone) < 64:
            for n in nodes:
                self.remove_node(n)
            return
        removed, producer, graveyard = self._removed, self.producer, self._graveyard
        survivors = [n for n in self.nodes if id(n) not in removed and id(n) not in gone]
        if len(survivors) < len(gone):  # most of the graph goes (a fused chain): index what stays instead
            for n in nodes:
                if id(n) in gone and id(n) not in removed:
                    removed.add(id(n))
                    graveyard.append(n)
            self.producer.clear()
            self.consumers.clear()
            self._index_all(survivors)
            return
        touched: set[str] = set()
        for n in nodes:
            k = id(n)
            if k not in gone or k in removed:
                continue
            removed.add(k)
            graveyard.append(n)
            for o in n.output:
                if o and producer.get(o) is n:
                    del producer[o]
            touched.update(n.input)
            if has_subgraph(n):
                touched |= self.implicit_inputs(n)
        consumers = self.consumers
        for i in touched:
            lst = consumers.get(i)
            if lst:
                lst[:] = [c for c in lst if id(c) not in gone]

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of ``old`` (nodes, captures in subgraphs, graph outputs) read ``new``."""
        if old == new:
            return
        for n in list(self.consumers.get(old, [])):
            self._unindex(n)
            for i, x in enumerate(n.input):
                if x == old:
                    n.input[i] = new
            if old in self.implicit_inputs(n):
                for sg in subgraphs(n):
                    rename_free(sg, old, new)
                self._implicit.pop(id(n), None)
            self._index(n)
            self.edited.append(n)
        if old in self.output_names:
            self._detach(old)
            if self.producer.get(new) is not None and self._renamable(new):
                self._rename_output(new, old)
            else:
                self.add_node("Identity", [new], outputs=[old], name=f"rnnfuse/out/{old}")

    def _renamable(self, name: str) -> bool:
        return (
            name not in self.output_names
            and name not in self._inputs
            and not self.consumers.get(name)
            and self.producer.get(name) is not None
        )

    def _detach(self, old: str) -> None:
        """The old producer of a graph output gives the name up (it is about to be replaced)."""
        old_prod = self.producer.get(old)
        if old_prod is None:
            return
        self._unindex(old_prod)
        for i, o in enumerate(old_prod.output):
            if o == old:
                old_prod.output[i] = self.fresh(old + "/detached")
        if id(old_prod) not in self._removed:
            self._index(old_prod)
            self.edited.append(old_prod)

    def _rename_output(self, new: str, old: str) -> None:
        """Rename the produced tensor ``new`` to ``old`` (used to keep graph output names)."""
        node = self.producer[new]
        self._unindex(node)
        for i, o in enumerate(node.output):
            if o == new:
                node.output[i] = old
        self._index(node)
        self.edited.append(node)

    def _state(self) -> tuple[int, int]:
        """Changes so far (nodes added or rewired, nodes removed): equal states mean the same graph."""
        return (len(self.edited), len(self._graveyard))

    def prune(self) -> int:
        """Drop nodes nothing reads (the remains of fused recurrences); returns how many."""
        if self._pruned == self._state():
            return 0  # nothing changed since the last prune: nothing new is dead
        live = self._live_set()
        dead = [n for n in self.nodes if id(n) not in self._removed and id(n) not in live]
        self.remove_nodes(dead)
        if dead:
            self.nodes = [n for n in self.nodes if id(n) not in self._removed]
        self._pruned = self._state()
        return len(dead)

    # -- finalize ----------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Remove dead nodes and unused initializers, topologically sort, and write back to the proto.

        Linear, and it does no whole-graph work it can prove unneeded: no liveness walk right after a
        prune, no sort of an order no edit disturbed, no proto rewrite or index rebuild of an unchanged node
        list."""
        removed = self._removed
        kept = [n for n in self.nodes if id(n) not in removed] if removed else self.nodes
        if self._pruned == self._state():
            nodes, dropped = kept, False  # every node left is live
        else:
            live = self._live_set()
            nodes = [n for n in kept if id(n) in live]
            dropped = len(nodes) != len(kept)
        sort = bool(self.edited) or not self._input_sorted
        if sort:
            nodes = self.toposort(nodes)
        # the same length and nothing removed, dropped or re-sorted: the proto's own list, as it is
        if len(nodes) != len(self.proto.node) or (
            (removed or dropped or sort) and any(a is not b for a, b in zip(nodes, self.proto.node))
        ):
            del self.proto.node[:]
            self.proto.node.extend(nodes)
            nodes = list(self.proto.node)  # extend copies: index the messages the proto holds
            dropped = True
        self.nodes = nodes
        self._pos = {id(n): (i, 0) for i, n in enumerate(nodes)}
        self._removed = set()
        self._graveyard.clear()
        self.edited = []
        self._input_sorted = True
        if dropped:  # (otherwise the indices are exact: edits kept them so, and no dead node is left in them)
            self.producer.clear()
            self.consumers.clear()
            self._implicit.clear()
            self._index_all(nodes)
        self._pruned = self._state()
        # the initializers and value_info entries still read or defined (from the indices, not the nodes)
        consumers, outputs = self.consumers, set(self.output_names)
        unused = [k for k in self.initializers if not consumers.get(k) and k not in outputs and k not in self._inputs]
        if unused or len(self.initializers) != len(self.proto.initializer):
            drop = set(unused)
            keep = [t for t in self.proto.initializer if t.name not in drop]
            del self.proto.initializer[:]
            self.proto.initializer.extend(keep)
        self.initializers = {t.name: t for t in self.proto.initializer} if unused else self.initializers
        if len(self.proto.value_info):
            defined = self.producer.keys() | self.initializers.keys() | self._inputs
            vis = [v for v in self.proto.value_info if v.name in defined]
            if len(vis) != len(self.proto.value_info):
                del self.proto.value_info[:]
                self.proto.value_info.extend(vis)

    def _live_set(self) -> set[int]:
        live: set[int] = set()
        removed, producer = self._removed, self.producer
        stack = [producer[o] for o in self.output_names if o in producer]
        while stack:
            n = stack.pop()
            k = id(n)
            if k in live or k in removed:
                continue
            live.add(k)
            for i in itertools.chain(n.input, self.implicit_inputs(n)) if has_subgraph(n) else n.input:
                p = producer.get(i)
                if p is not None:
                    stack.append(p)
        return live

    def toposort(self, nodes: list[NodeProto]) -> list[NodeProto]:
        """Stable Kahn sort: among ready nodes, the one with the smallest position goes first.

        Already-sorted input (the common case) is detected in one pass and returned in its original order."""
        pos = self._pos
        order = sorted(nodes, key=lambda n: pos[id(n)])
        index = {id(n): i for i, n in enumerate(order)}
        producer = self.producer

        def reads(n):
            return itertools.chain(n.input, self.implicit_inputs(n)) if has_subgraph(n) else n.input

        in_order = True
        for i, n in enumerate(order):
            for x in reads(n):
                p = producer.get(x)
                if p is not None and index.get(id(p), -1) > i:
                    in_order = False
                    break
            if not in_order:
                break
        if in_order:
            return order
        preds: list[list[int]] = []
        for i, n in enumerate(order):
            ps = []
            for x in reads(n):
                p = producer.get(x)
                if p is not None:
                    j = index.get(id(p))
                    if j is not None and j != i:
                        ps.append(j)
            preds.append(ps)
        indeg = [0] * len(order)
        succ: list[list[int]] = [[] for _ in order]
        for i, ps in enumerate(preds):
            uniq = set(ps)
            indeg[i] = len(uniq)
            for j in uniq:
                succ[j].append(i)
        heap = [i for i in range(len(order)) if indeg[i] == 0]
        heapq.heapify(heap)
        out: list[NodeProto] = []
        while heap:
            i = heapq.heappop(heap)
            out.append(order[i])
            for s2 in succ[i]:
                indeg[s2] -= 1
                if indeg[s2] == 0:
                    heapq.heappush(heap, s2)
        if len(out) != len(order):
            raise RuntimeError("graph has a cycle after rewriting")
        return out


def set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    """Point a tensor at ``length`` bytes of ``location`` from ``offset`` (no data in the proto)."""
    t.ClearField("raw_data")
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = TensorProto.EXTERNAL


def rename_free(g: GraphProto, old: str, new: str) -> None:
    """Rename reads of an outer-scope name inside a subgraph (and its nested subgraphs)."""
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new
        for sg in subgraphs(n):
            rename_free(sg, old, new)
    for o in g.output:
        if o.name == old:
            o.name = new
