"""The types ONNX shape inference gives one model's values, as the do-no-harm guard's region needs them
(:mod:`rnnfuse.changed_region`): the values asked together typed by one inference over the nodes they are
computed from (their cone), or over the whole model when that cone is a big part of it, each on a copy without
weights' data; with the types the run already knows taken where inference may stop."""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import ModelProto, NodeProto, TensorProto

from .load_time_values import LoadTimeValues
from .model_parts import LocalFunctions
from .protos import free_names, has_subgraph, reads_of, subgraphs
from .tensor_types import SKELETON_DATA_BYTES, copy_node_skeleton, skeleton_initializer

# a value's type is inferred over the nodes it is computed from up to this share of the model; beyond, over the
# whole model (copied in bulk: per node, a cone's walk and copy cost ~0.6x what inference does)
MAX_CONE_SHARE = 0.5

# what an optimizer run knows of a value's type without new inference: name -> (elem_type, dims) or None
Established = Callable[[str], "tuple[int, list | None] | None"]


class InferredTypes:
    """Inferred types of one model's values, each inferred over the nodes it is computed from: the values
    asked together are typed by one inference of their cones, or of the whole model once those cones are a
    big part of it (later questions are then answered from it); either on a copy holding small constants'
    data and only the types of weights (tensor_types.skeleton_initializer). A value inference cannot type is
    absent from ``types``."""

    def __init__(self, model: ModelProto, borrow: Callable[[str], bytes | None] = lambda name: None,
                 nodes: list[NodeProto] | None = None, producer: dict[str, int] | None = None, whole: bool = False):
        """``borrow``: a value's type known from elsewhere (for values computed as in a model already typed:
        the same nodes from the same inputs and weights), or None; inference stops at such values (but for
        those whose contents the load knows, rnnfuse.load_time_values: it walks through). ``nodes``
        and ``producer`` (value -> its producer's position): the model's, when the caller has them. ``whole``:
        infer the whole model at the first question, not walking a cone first that would prove too big."""
        self.model = model
        self._nodes, self._producer = nodes, producer  # (the input model's are listed only if a cone is walked)
        self.types = TypeTable()
        self.asked: set[str] = set()
        self.whole, self.whole_first = False, whole
        self.borrow = borrow
        self.borrowed: dict[str, bytes] = {}  # (the values a walk stopped at, with the types taken for them)
        self._load_time: LoadTimeValues | None = None
        self._maps: dict[str, dict] = {}  # (see _by_name)
        self._functions: LocalFunctions | None = None

    @property
    def nodes(self) -> list[NodeProto]:
        if self._nodes is None:
            self._nodes = list(self.model.graph.node)
        return self._nodes

    @property
    def producer(self) -> dict[str, int]:
        if self._producer is None:
            self._producer = {o: i for i, n in enumerate(self.nodes) for o in n.output if o}
        return self._producer

    def ask(self, names) -> "InferredTypes | None":
        """Type ``names`` (those not asked before); None when inference fails."""
        want = [n for n in names if n not in self.asked and n not in self.types]  # (typed by an earlier cone)
        if not want or self.whole:
            return self
        self.asked.update(want)
        self.types.update((n, t) for n in want if (t := self._borrowed(n)) is not None)
        want = [n for n in want if n not in self.borrowed]
        if not want:
            return self
        cone = None if self.whole_first else self._cone(want)
        self.whole = cone is None
        # (handed over serialised: the copy is let go before inference makes its own two)
        got = inferred_types((self._whole_model() if cone is None else self._cone_model(cone, want)).SerializeToString())
        if got is None:
            return None
        # (a whole model's types are read as asked, its inferred graph kept: there is one; a cone's are read at
        # once and the graph let go: many waves re-infer a shared upstream, and keeping each graph took 720 MB)
        self.types.update(got if cone is None else got.as_dict())
        return self

    def _borrowed(self, name: str) -> bytes | None:
        t = self.borrowed.get(name)
        if t is None:
            t = self.borrow(name)  # (an answer of None may change: asked again)
            if t is not None:
                self.borrowed[name] = t
        return t

    def _cone(self, names: list[str]) -> list[int] | None:
        """The positions of the nodes ``names`` are computed from, not past the values whose types are
        borrowed (but for those whose contents the load knows: declared as inputs, they would hide what a
        Reshape's inference reads), in graph order; None past half the model (MAX_CONE_SHARE) (then it is
        inferred whole)."""
        seen: set[int] = set()
        stack = [self.producer[n] for n in names if n in self.producer and not self._stops_at(n)]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if len(seen) > MAX_CONE_SHARE * len(self.nodes):
                return None
            stack.extend(self.producer[r] for r in reads_of(self.nodes[i])
                         if r in self.producer and self.producer[r] not in seen and not self._stops_at(r))
        return sorted(seen)

    @property
    def load_time(self) -> LoadTimeValues:
        """Which of the model's values its load may know the contents of (rnnfuse.load_time_values)."""
        if self._load_time is None:
            self._load_time = LoadTimeValues(self.model.graph, self.nodes, self.producer)
        return self._load_time

    def _stops_at(self, name: str) -> bool:
        """Whether a cone stops at ``name``: a value whose type is borrowed, or one an earlier question of this
        model typed (its type is taken as its cone's inference gave it, so a change spreading down a chain one
        wave at a time infers each node once, not the shared upstream once a wave), unless the load knows its
        contents. (Declared as an input of the next cone: inference names the dims it invents ``unk__N`` avoiding
        the names its inputs use, and the guard compares such dims as unknown.)"""
        t = self._borrowed(name) or self.types.get(name)
        if t is None or self.load_time.carries(name, t):
            return False
        self.borrowed.setdefault(name, t)  # (a type an earlier question gave: declared so by _cone_model)
        return True

    def _whole_model(self) -> ModelProto:
        """The whole model as :meth:`_cone_model` would copy every node, in bulk (node by node, what each reads
        worked out, 0.5 s at 100,000 nodes): a node holding subgraphs as a skeleton, initializers too."""
        src, m = self.model.graph, ModelProto()
        m.ir_version = self.model.ir_version
        m.opset_import.extend(self.model.opset_import)
        m.functions.extend(self.model.functions)
        g = m.graph
        g.node.extend(src.node)
        for i in [i for i, n in enumerate(self.nodes) if has_subgraph(n)]:
            g.node[i].Clear()
            copy_node_skeleton(self.nodes[i], g.node[i], SKELETON_DATA_BYTES)
        g.input.extend(src.input)
        g.initializer.extend(skeleton_initializer(t) for t in src.initializer)
        g.output.extend(src.output)
        if len(src.value_info):
            produced = self.producer
            g.value_info.extend(v for v in src.value_info if v.name in produced)  # (not an input's or a weight's)
        return m

    def _cone_model(self, cone, names: list[str]) -> ModelProto:
        """The nodes at positions ``cone`` (graph order) as a model for inference, ``names`` its outputs and
        the values it reads whose types are borrowed typed inputs."""
        borrowed = self.borrowed
        g = self.model.graph
        m = ModelProto()
        m.ir_version = self.model.ir_version
        m.opset_import.extend(self.model.opset_import)
        sub = m.graph
        sub.node.extend(_node_skeleton(n) if has_subgraph(n) else n for n in map(self.nodes.__getitem__, cone))
        if self._functions is None:
            self._functions = LocalFunctions(self.model.functions)
        m.functions.extend(self._functions.needed_by(sub.node))  # (a cone a wave: not every function each)
        produced = {o for n in sub.node for o in n.output if o}
        needed = {i for n in sub.node for i in n.input if i and i not in produced}
        for n in sub.node:
            if has_subgraph(n):
                for sg in subgraphs(n):
                    needed |= free_names(sg) - produced
        inputs = self._by_name("input")
        sub.input.extend(g.input[inputs[name]] for name in sorted(needed & inputs.keys()))
        weights = self._by_name("initializer")
        sub.initializer.extend(skeleton_initializer(g.initializer[weights[name]]) for name in sorted(needed & weights.keys()))
        for name in sorted(needed & borrowed.keys()):
            vi = sub.input.add()
            vi.name = name
            vi.type.ParseFromString(borrowed[name])
        declarations, k = self._by_name("value_info"), len(g.value_info)  # (an output's place: k + its index)
        declared = {o: g.value_info[i] if i < k else g.output[i - k]
                    for n in sub.node for o in n.output if (i := declarations.get(o)) is not None}
        for name in names:  # (a graph output keeps its declared type, as in the model)
            out = sub.output.add()
            if name in declared:
                out.CopyFrom(declared[name])
            else:
                out.name = name
        sub.value_info.extend(v for name, v in declared.items() if name not in names)
        return m

    def _by_name(self, field: str) -> dict[str, int]:
        """Name -> place of the model graph's ``input`` or ``initializer`` entries, or of its ``value_info`` then
        ``output`` declarations (the last of a name): mapped once for every cone (a wave a cone, each scanning 40,000
        declarations, took 19 s), by place (a map of 80,000 protobuf messages' Python objects took 28 MB)."""
        found = self._maps.get(field)
        if found is None:
            g = self.model.graph
            entries = (*g.value_info, *g.output) if field == "value_info" else getattr(g, field)
            found = self._maps[field] = {e.name: i for i, e in enumerate(entries)}
        return found


def _node_skeleton(n: NodeProto) -> NodeProto:
    skeleton = NodeProto()
    copy_node_skeleton(n, skeleton, SKELETON_DATA_BYTES)
    return skeleton


def inferred_types(model: "ModelProto | bytes") -> "InferredGraphTypes | None":
    """Value name -> its type as ONNX shape inference gives ``model`` (a cone model: declared inputs and
    outputs included); a value inference cannot type is absent. None when inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)  # (as onnxruntime's load infers)
    except Exception:  # (inference errors: the region cannot be judged, the whole model is loaded)
        return None
    return InferredGraphTypes(inferred)


class _TypeLookup:
    """``in`` and ``[]`` over a ``get`` (name -> serialised type, or None)."""

    def get(self, name: str, default=None):
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> bytes:
        t = self.get(name)
        if t is None:
            raise KeyError(name)
        return t


class InferredGraphTypes(_TypeLookup):
    """The types one inference gave (name -> serialised TypeProto), read from its graph as asked: of the
    100,000 types a whole model's inference gives, the region asks a few dozen, and serialising them all took
    0.2 s. A name's type is its last declaration of a known type among the graph's inputs, outputs and
    value_info (sequences, optionals: compared whole), else its initializer's."""

    def __init__(self, model: ModelProto):
        g = model.graph
        self._model = model  # (the declarations below are its)
        self._declared = [{vi.name: vi for vi in g.value_info}, {vi.name: vi for vi in g.output},
                          {vi.name: vi for vi in g.input}]  # (latest first)
        self._initializers = {t.name: t for t in g.initializer}
        self._read: dict[str, bytes | None] = {}

    def get(self, name: str, default=None):
        if name not in self._read:
            self._read[name] = self._type_of(name)
        t = self._read[name]
        return default if t is None else t

    def as_dict(self) -> dict[str, bytes]:
        """Every type, read at once."""
        g, types = self._model.graph, {}
        for vi in (*g.input, *g.output, *g.value_info):
            if (t := _known_type(vi)) is not None:
                types[vi.name] = t
        for t in g.initializer:
            types.setdefault(t.name, _tensor_type(t).SerializeToString())
        return types

    def _type_of(self, name: str) -> bytes | None:
        for declared in self._declared:
            vi = declared.get(name)
            if vi is not None and (t := _known_type(vi)) is not None:
                return t
        t = self._initializers.get(name)
        return None if t is None else _tensor_type(t).SerializeToString()


class TypeTable(_TypeLookup):
    """Value name -> serialised type, from several inferences and from types set by hand, a later answer
    before an earlier one (as dict.update would have it), each inference's read as asked
    (:class:`InferredGraphTypes`)."""

    def __init__(self):
        self._layers: list = []  # (dicts and InferredGraphTypes, oldest first)

    def update(self, types) -> None:
        """Add ``types``: an InferredGraphTypes, or (name, type) pairs."""
        if isinstance(types, InferredGraphTypes):
            self._layers.append(types)
            return
        pairs = dict(types)
        if pairs:
            if self._layers and isinstance(self._layers[-1], dict):
                self._layers[-1].update(pairs)
            else:
                self._layers.append(pairs)

    def get(self, name: str, default=None):
        for layer in reversed(self._layers):
            t = layer.get(name)
            if t is not None:
                return t
        return default


def _known_type(vi: onnx.ValueInfoProto) -> bytes | None:
    """A declaration's type, serialised, when it says something (a tensor's element type; a sequence's or an
    optional's type, compared whole)."""
    if vi.type.HasField("tensor_type"):
        return vi.type.SerializeToString() if vi.type.tensor_type.elem_type else None
    return vi.type.SerializeToString() if vi.type.WhichOneof("value") is not None else None


def established_types(established: Established | None) -> Callable[[str], bytes | None]:
    """``established`` as serialised TypeProtos (a type of unknown rank is no answer: inference decides)."""
    if established is None:
        return lambda name: None
    out: dict[str, bytes | None] = {}

    def known(name: str) -> bytes | None:
        if name not in out:
            t = established(name)
            out[name] = None if t is None or t[1] is None else onnx.helper.make_tensor_type_proto(t[0], t[1]).SerializeToString()
        return out[name]

    return known


def same_known_type(a: bytes | None, b: bytes | None) -> bool:
    """Whether two inferred types are known and the same, the dims inference invented on its own (``unk__N``,
    numbered in the order it meets them, so not the same names in two models) taken as unknown dims."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    ta, tb = onnx.TypeProto(), onnx.TypeProto()
    ta.ParseFromString(a)
    tb.ParseFromString(b)
    for t in (ta, tb):
        if t.HasField("tensor_type"):
            for d in t.tensor_type.shape.dim:
                if d.dim_param.startswith("unk__"):
                    d.ClearField("dim_param")
    return ta.SerializeToString(deterministic=True) == tb.SerializeToString(deterministic=True)


def _tensor_type(t: TensorProto) -> onnx.TypeProto:
    tp = onnx.TypeProto()
    tp.tensor_type.elem_type = t.data_type
    for d in t.dims:
        tp.tensor_type.shape.dim.add().dim_value = d
    return tp
