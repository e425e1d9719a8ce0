"""onnxruntime sessions of check models, without copying their weights.

A check model (:mod:`rnnfuse.validate`, :mod:`rnnfuse.cell_check`) computes old and new tensors side by side,
so it holds the original's weights and the rewrite's. Handed to onnxruntime as serialised bytes, every weight
is held again in the bytes, again while onnxruntime parses them, again in its tensors and once more when it
pre-packs the matrix products: for a weight-heavy model that was most of rnnfuse's peak memory (~9x the file).

So a check model with big weights is written to a temporary directory instead: each big tensor's bytes go to
one data file, written tensor by tensor from wherever they are (the model's proto, a memory-mapped data file,
an array rnnfuse computed), and the model refers to them as external data, which onnxruntime memory-maps.
Values that are already arrays in memory are also handed to onnxruntime as they are
(``SessionOptions.add_initializer``: it computes with that buffer, no copy). The file still holds the real
values of every tensor, because onnxruntime reads the file, not the handed array, for what it folds while
loading (a Transpose of a weight, say). Pre-packing is off in these sessions: it would copy every weight a
matrix product reads. The unpacked kernels add in another order, so results differ in the last bits, more at
large magnitudes (3e-5 on an LSTM with int8 weights scaled by 50): a failure seen without pre-packing is
checked again with it (rnnfuse.validate, rnnfuse.cell_check), and stands only if it persists in the
computation onnxruntime runs by default. Small step checks are first run *light* the same way: without
onnxruntime's graph optimizations, which cost more to apply to a few hundred nodes than running them does
(32 steps side by side: 8.8 -> 5.4 ms a session); a failure there is checked again as deployed too. (Not for
whole models: a 100k-node model loads 3.5x slower unoptimised.) Nested tensors stored as external data (a Loop body's initializers)
are read into the check model (:func:`materialize_nested`): their relative locations name files beside the
input, not beside the check model. Small check models keep the in-memory route: it is faster and they never
mattered for memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import TYPE_CHECKING, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .model import release_mapped_pages
from .protos import reads_of, tensor_nbytes

if TYPE_CHECKING:
    from .graph import Graph

# a tensor at least this big is a "big" tensor: kept out of the check model's proto (below it: copied in)
BIG_TENSOR_BYTES = 1 << 20
# check models whose big tensors hold at least this much in all take the file route
FILE_ROUTE_BYTES = 16 << 20
_ALIGN = 1 << 16  # onnxruntime memory-maps external data whose offset is a multiple of the allocation granularity

Source = Union[np.ndarray, TensorProto]  # an array (handed to onnxruntime as well), or a tensor held in a proto


def is_big(t: TensorProto) -> bool:
    return tensor_nbytes(t) >= BIG_TENSOR_BYTES


def is_big_array(a: np.ndarray) -> bool:
    return a.dtype != object and a.nbytes >= BIG_TENSOR_BYTES


def without_prepacking(so) -> None:
    """Turn onnxruntime's pre-packing off in ``so``, and with it the memory pattern. With pre-packing off,
    onnxruntime lays every initializer out by its memory-pattern planner when the pattern is on (the default),
    and that planner's cost grows with the square of the initializers (onnxruntime 1.32, optimizations off, an
    elementwise chain with a weight per Add and Mul: 25k / 50k nodes load in 4.5 / 20.7 s, against 1.0 / 2.8 s
    with pre-packing, and 1.1 / 2.8 s without it and without the pattern). A check session is run a few
    times at most: the pattern only plans the memory of repeated runs of one shape."""
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_mem_pattern = False


def options(ort):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    # no memory plan per input shape: a check runs each shape a few times, and planning it costs more than
    # the runs (an 86k-node masked Keras model: 3-5 s for each new batch size, 0.15 s without; values unchanged)
    so.enable_mem_pattern = False
    return so


def takes_file_route(big: dict[str, Source]) -> bool:
    """Whether :func:`open_session` writes a check model with these big tensors to a temporary directory."""
    return sum(s.nbytes if isinstance(s, np.ndarray) else tensor_nbytes(s) for s in big.values()) >= FILE_ROUTE_BYTES


def open_session(ort, model: onnx.ModelProto, big: dict[str, Source], prepack: bool = False, so=None,
                 file_route: bool | None = None, light: bool = False):
    """An onnxruntime session of ``model`` plus the tensors in ``big`` (name -> where its values are), which
    ``model``'s graph does not hold. ``model`` gets them as initializers (inline or external data).

    ``file_route``: None decides by size (``FILE_ROUTE_BYTES``). On the file route pre-packing is off unless
    ``prepack``. ``light``: no graph optimizations (a small step check). The session's ``rnnfuse_light``
    attribute says whether it ran lighter than deployed, either way (a failure seen so is checked again as
    deployed, see rnnfuse.validate.checked_as_deployed). ``so``: the session options (default: 1 thread)."""
    so = so if so is not None else options(ort)
    if light:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if file_route is None:
        file_route = takes_file_route(big)
    if not file_route:
        for name, src in big.items():
            model.graph.initializer.append(_inline(name, src))
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        sess.rnnfuse_route, sess.rnnfuse_light = "memory", light
        return sess
    workdir = tempfile.mkdtemp(prefix="rnnfuse-check-")
    try:
        shared = _write_weights(model, big, os.path.join(workdir, "weights.bin"), "weights.bin")
        path = os.path.join(workdir, "check.onnx")
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        if not prepack:
            without_prepacking(so)
        values = []
        for name, arr in shared.items():
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            values.append((v, arr))  # both must outlive the session
            so.add_initializer(name, v)
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    sess._rnnfuse_shared = values
    sess.rnnfuse_route, sess.rnnfuse_light = "file", light or not prepack
    # the data file stays until the session goes (onnxruntime maps it); then, or at exit, it is removed
    weakref.finalize(sess, shutil.rmtree, workdir, True)
    return sess


def initializer_sources(initializers, tensor_array) -> tuple[list[TensorProto], dict[str, Source]]:
    """Split initializers for :func:`open_session`: ``(kept, big)``, the small ones a check model holds as they
    are, and the big or externally stored ones with where their values are (a memory-mapped array for
    external data, read with ``tensor_array``; else the tensor itself)."""
    kept: list[TensorProto] = []
    big: dict[str, Source] = {}
    for t in initializers:
        if t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"):
            big[t.name] = np.asarray(tensor_array(t))
        elif is_big(t):
            big[t.name] = t
        else:
            kept.append(t)
    return kept, big


def materialize_nested(model: onnx.ModelProto, tensor_array) -> None:
    """Read into ``model`` every tensor stored as external data outside its main graph's initializers (a
    subgraph's initializers, a Constant's value): the check model lives elsewhere than the model its nodes
    were copied from, so their relative locations would name files that are not there. ``tensor_array``
    (``Model.tensor_array``) reads them from where they are."""
    from .protos import tensors_beyond_initializers

    for t in tensors_beyond_initializers(model):
        if t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"):
            t.CopyFrom(numpy_helper.from_array(np.asarray(tensor_array(t)), t.name))


def whole_model_session(ort, proto: onnx.ModelProto, tensor_array, so, prepack: bool = True):
    """A session of a whole model whose weights may be external data (the input's files, spilled new weights,
    weights borrowed from the input file), wherever the process runs: its big and external initializers go
    through :func:`open_session`'s file route, nested external tensors are read in; ``proto`` is not changed."""
    light = onnx.ModelProto()
    _copy_fields(proto, light, skip="graph")
    _copy_fields(proto.graph, light.graph, skip="initializer")
    kept, big = initializer_sources(proto.graph.initializer, tensor_array)
    light.graph.initializer.extend(kept)
    materialize_nested(light, tensor_array)
    return open_session(ort, light, big, prepack=prepack, so=so, file_route=bool(big))


def _inline(name: str, src: Source) -> TensorProto:
    if isinstance(src, np.ndarray):
        return numpy_helper.from_array(np.asarray(src), name)
    t = TensorProto()
    t.CopyFrom(src)
    t.name = name
    return t


def _write_weights(model: onnx.ModelProto, big: dict[str, Source], path: str, location: str) -> dict[str, np.ndarray]:
    """Write every big tensor's bytes to ``path`` and add it to ``model`` as external data there; returns the
    arrays to hand to onnxruntime as well."""
    from .protos import set_external

    shared: dict[str, np.ndarray] = {}
    with open(path, "wb") as f:
        for name, src in big.items():
            pos = f.tell()
            if pos % _ALIGN:
                f.write(b"\0" * (_ALIGN - pos % _ALIGN))
                pos = f.tell()
            t = TensorProto()
            t.name = name
            if isinstance(src, np.ndarray):
                arr = src if src.flags.c_contiguous else np.ascontiguousarray(src)
                t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
                t.dims.extend(arr.shape)
                _write_array(f, arr)
                # (writing it read every page: they come back as onnxruntime computes with them, one weight at
                # a time, instead of every weight of the check model staying resident at once)
                release_mapped_pages(arr)
                shared[name] = arr
                length = arr.nbytes
            else:
                t.data_type = src.data_type
                t.dims.extend(src.dims)
                if src.HasField("raw_data"):
                    data = src.raw_data  # (a transient copy of one tensor)
                    f.write(data)
                    length = len(data)
                    del data
                else:
                    arr = numpy_helper.to_array(src)
                    _write_array(f, arr)
                    length = arr.nbytes
            set_external(t, location, pos, length)
            model.graph.initializer.append(t)
    return shared


def _write_array(f, arr: np.ndarray) -> None:
    """Write a C-contiguous array's bytes in blocks (a memory-mapped array is not read whole into memory)."""
    flat = arr.reshape(-1)
    step = max(1, (32 << 20) // max(1, arr.itemsize))
    for i in range(0, flat.size, step):
        f.write(memoryview(np.ascontiguousarray(flat[i : i + step]).view(np.uint8)))  # (any element type)


# -- a model's structure without its weights ---------------------------------------------------------------

def weight_heavy(model: onnx.ModelProto) -> bool:
    """Whether the main graph's external or big initializers hold at least ``FILE_ROUTE_BYTES``, or any
    initializer is stored as external data (its file is beside the input, not beside a copy)."""
    total = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            return True
        n = tensor_nbytes(t)
        if n >= BIG_TENSOR_BYTES:
            total += n
    return total >= FILE_ROUTE_BYTES


def write_skeleton(model: onnx.ModelProto, workdir: str) -> str:
    """Write ``model`` to ``workdir`` with its big and external initializers pointing into a sparse data file of
    their size (zeros, neither on disk nor in memory); returns the model's path. For checks of a model's
    structure and types (``onnx.checker``, whether onnxruntime loads it), which never read those values; the
    weights are neither copied nor serialised."""
    from .protos import set_external

    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, skip="graph")
    _copy_fields(model.graph, skeleton.graph, skip="initializer")
    end = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL or tensor_nbytes(t) >= BIG_TENSOR_BYTES:
            h = skeleton.graph.initializer.add()
            h.name, h.data_type = t.name, t.data_type
            h.dims.extend(t.dims)
            end += -end % _ALIGN
            set_external(h, "zeros.bin", end, tensor_nbytes(t))
            end += tensor_nbytes(t)
        else:
            skeleton.graph.initializer.add().CopyFrom(t)
    with open(os.path.join(workdir, "zeros.bin"), "wb") as f:
        f.truncate(end)
    path = os.path.join(workdir, "model.onnx")
    with open(path, "wb") as f:
        f.write(skeleton.SerializeToString())
    return path


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of message ``src`` into ``dst`` but ``skip`` (which may hold every weight)."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        target = getattr(dst, fd.name)
        if hasattr(target, "extend"):  # a repeated field
            target.extend(value)
        elif hasattr(target, "CopyFrom"):  # a message
            target.CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def fed_input(name: str, values: list[np.ndarray]) -> onnx.ValueInfoProto:
    """The graph input of a tensor that will be fed ``values``: their element type, their rank and each dim
    they all share (the others unnamed). The shape is what the values have, so it constrains nothing; it
    spares onnxruntime's session set-up, which takes ~3x as long over nodes reading inputs of unknown rank."""
    rank = values[0].ndim
    if any(v.ndim != rank for v in values):
        shape = None
    else:
        shape = [d if all(v.shape[k] == d for v in values) else None for k, d in enumerate(values[0].shape)]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(values[0].dtype), shape)


def model_of(g: "Graph", nodes: list[onnx.NodeProto], outputs: list, given: dict[str, list[np.ndarray]], name: str,
             extra_initializers: list | None = None, reads=reads_of) -> tuple[onnx.ModelProto, dict[str, Source]]:
    """A model of ``nodes`` (in topological order; copied into it) of ``g``'s model, with the weights and graph inputs
    they read, the tensors in ``given`` (name -> the values it will be fed, one per input set) as inputs too
    (see :func:`fed_input`), and ``outputs``; its big weights are returned apart (see
    :func:`rnnfuse.check_session.open_session`). ``reads``: what a node reads (protos.reads_of, or a caller's
    memo of it)."""
    used = set()
    for n in nodes:
        used.update(reads(n))
    proto = g.model.proto
    m = onnx.ModelProto()
    m.ir_version = proto.ir_version
    m.opset_import.extend(proto.opset_import)
    graph = m.graph  # (built in place: a graph copied into the model would hold every weight twice)
    graph.name = name
    graph.node.extend(nodes)
    # (looked up by name, in name order: a piece of a graph with 33,000 weights reads a few of them, and going
    # through them all for each piece of a long run made the runs quadratic)
    inits = g.initializers
    kept, big = initializer_sources([inits[i] for i in sorted(used) if i in inits and i not in given],
                                    g.model.tensor_array)
    graph.initializer.extend(kept + (extra_initializers or []))
    for vi in g.proto.input:
        if vi.name in used and vi.name not in g.initializers and vi.name not in given:
            graph.input.append(vi)
    for tname, values in given.items():
        if tname in used:
            graph.input.append(fed_input(tname, values))
    graph.output.extend(outputs)
    m.functions.extend(g.model.local_functions.needed_by(graph.node))  # (its nodes' and their subgraphs' calls)
    materialize_nested(m, g.model.tensor_array)
    return m, big
