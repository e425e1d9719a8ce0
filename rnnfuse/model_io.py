"""Loading and saving models safely.

Every problem with the input becomes an :class:`~rnnfuse.errors.InputError` naming it; every problem with the
output an :class:`~rnnfuse.errors.OutputError`. Outputs are written to a temporary file in the destination
directory and renamed into place, so a failed run never leaves a partial file and never touches an existing
output. Models that came with external data, or that would exceed protobuf's 2 GB limit, are written with
their tensors in a ``<output>.data`` file beside the model.

A large single-file model *lends* its big weights: :func:`load` leaves them in the file and makes them
external data pointing back into it (see :mod:`rnnfuse.wire`), so they are memory-mapped when a pass reads
them instead of being held by the parsed proto; :func:`save` writes them back inline, copied from the file
while the output is written. What the user gets is the same single file.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import onnx
from google.protobuf.message import DecodeError

from .errors import InputError, OutputError
from .protos import data_bytes, default_opset, external_length, tensor_nbytes
from .tensor_types import SKELETON_DATA_BYTES

MIN_OPSET = 7  # the native recurrent ops' semantics rnnfuse emits exist since opset 7
PROTO_LIMIT = 2**31 - 1
EXTERNAL_THRESHOLD = 1024  # tensors at least this large go to the external data file
# integer tensors up to this size stay inline whatever the threshold: they are what ops read as shapes, sizes,
# axes and bounds, whose data onnx's shape inference reads while onnxruntime loads the model and cannot read
# from a data file ("Cannot parse data from external tensors": a merged chain's Split of 1,000 step sizes)
INLINE_INTEGERS_UP_TO = 1 << 20
_INTEGER_TYPES = frozenset((onnx.TensorProto.INT64, onnx.TensorProto.INT32))
# a single-file model at least this large lends its initializers of BORROW_MIN_TENSOR bytes or more (below it,
# parsing the whole file costs less than it is worth)
BORROW_MIN_FILE = 16 << 20
BORROW_MIN_TENSOR = 1 << 20


def _max_opset() -> int:
    return onnx.defs.onnx_opset_version()


def uses_external_data(model: onnx.ModelProto) -> bool:
    from onnx.external_data_helper import uses_external_data as _uses

    from .protos import all_tensors

    return any(_uses(t) for t in all_tensors(model))


def load(path: str, borrow: bool = False, read_small: bool = True) -> tuple[onnx.ModelProto, bool]:
    """Load ``path``; returns (model, had_external_data).

    External data is *not* read into memory: tensors stay where they are and are memory-mapped when a pass
    needs their values (see :meth:`rnnfuse.graph.Model.tensor_array`), then streamed into the output's data
    file when it is written. The model's directory is recorded in ``model_dir(model)``.

    ``borrow=True``: a single file of ``BORROW_MIN_FILE`` bytes or more keeps its big initializers in the file
    the same way (``borrowed_from(model)`` names it; ``had_external_data`` stays False: the output is one
    file again). Its proto then has external tensors only :class:`~rnnfuse.graph.Model` (given
    ``model_dir``) and :func:`save` can read: a caller handing the proto to onnxruntime loads without it.

    Small external tensors are read in (see ``_ALWAYS_INLINE_BYTES``); ``read_small=False`` leaves all but
    the tensor attributes where they are, for a model written back as it was."""
    if not path:
        raise InputError("no input file given")
    if not os.path.exists(path):
        raise InputError(f"input file not found: {path}")
    if os.path.isdir(path):
        raise InputError(f"input is a directory, not an ONNX file: {path}")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from None
    if size == 0:
        raise InputError(f"input file is empty: {path}")
    if borrow and size >= BORROW_MIN_FILE:
        model = _load_borrowing(path)
        if model is not None:
            check_model_header(model, path)
            _forget(model)
            _MODEL_DIRS[id(model)] = os.path.dirname(os.path.abspath(path))
            _BORROWED[id(model)] = os.path.abspath(path)
            return model, False
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise InputError(f"{path} is not a valid ONNX model (it is truncated or not ONNX: {_short(e)})") from None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # protobuf raises a variety of errors on garbage
        raise InputError(f"{path} is not a valid ONNX model ({_short(e)})") from None
    check_model_header(model, path)
    _forget(model)
    external = may_name_external_data(path) and uses_external_data(model)
    if external:
        base = os.path.dirname(os.path.abspath(path))
        from .protos import all_tensors

        for t in all_tensors(model):
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            loc = os.path.join(base, info.get("location", ""))
            if not os.path.isfile(loc):
                raise InputError(f"external data of {path} is missing: {info.get('location', '?')}")
            need = int(info.get("offset", 0)) + external_length(t)
            if os.path.getsize(loc) < need:
                raise InputError(f"external data file {info.get('location')} of {path} is truncated")
            if read_small and external_length(t) <= _ALWAYS_INLINE_BYTES:
                _read_in(t, base)
        _inline_attribute_tensors(model, base)
        _MODEL_DIRS[id(model)] = base
    return model, external


_MODEL_DIRS: dict[int, str] = {}
_BORROWED: dict[int, str] = {}  # models whose big initializers stay in their own .onnx file -> that file


def _forget(model: onnx.ModelProto) -> None:
    """Drop what an earlier model at the same address left in the tables above (protos take no weak
    references, so an entry outlives its model; a process that loads many models must not read a stale one)."""
    _MODEL_DIRS.pop(id(model), None)
    _BORROWED.pop(id(model), None)


def borrowed_from(model: onnx.ModelProto) -> str | None:
    """The single ``.onnx`` file a model loaded with ``borrow=True`` left its big initializers in, or None."""
    return _BORROWED.get(id(model))


def _load_borrowing(path: str) -> onnx.ModelProto | None:
    """The model of a single-file ``path`` with its big initializers left in the file as external data, or
    None when it does not apply or anything about the file is unexpected (the caller then loads it whole,
    with protobuf's own errors for a damaged file)."""
    import mmap

    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        try:
            data, borrowed = _borrowed_bytes(mm, os.path.basename(path))
        finally:
            try:
                mm.close()
            except BufferError:  # (a slice still referenced: the map goes with it)
                pass
    if data is None:
        return None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:  # (protobuf's errors vary: the whole-file load says what is wrong)
        return None
    del data
    # the borrowed bytes must be what the tensor says it is, as numpy_helper would insist when reading them
    inits = model.graph.initializer
    for b in borrowed:
        if b.index >= len(inits):
            return None
        t = inits[b.index]
        if any(d < 0 for d in t.dims) or tensor_nbytes(t) != b.length:  # (0 for strings and unknown types)
            return None
    return model


def _borrowed_bytes(mm, location: str):
    """(serialized model without the borrowed bytes, what was borrowed), or (None, None)."""
    from . import wire

    try:
        pieces, borrowed = wire.borrow_plan(mm, location, BORROW_MIN_TENSOR)
    except (wire.WireError, UnicodeEncodeError, IndexError):
        return None, None
    if not borrowed:
        return None, None
    # a file that may name external data anywhere outside the borrowed bytes (a Constant's, a subgraph's) takes
    # the external-data path whole: its own directory and data files, and "had external data" on output
    spans = [0] + [x for b in sorted(borrowed, key=lambda b: b.offset) for x in (b.offset, b.offset + b.length)] + [len(mm)]
    for a, z in zip(spans[::2], spans[1::2]):
        if mm.find(b"location", a, z) >= 0:
            return None, None
    data = b"".join(pieces)
    del pieces
    return data, borrowed

# A tensor stored as external data is read into the model when it is small, so that every reader sees its
# values as if it were held inline:
# - any tensor of at most ``SKELETON_DATA_BYTES``, the ones shape inference reads the values of (a Reshape's
#   target, an Unsqueeze's axes, a Slice's bounds as initializers: ``onnx.save(size_threshold=0)`` puts those in
#   the data file too, and inference, which reads no file, would not know a mask's rank without them);
# - a tensor attribute (``onnx.save(convert_attribute=True)``: a Constant's value, ConstantOfShape's fill) of at
#   most 16 MiB, 256 MiB in all, so that every reader of attributes sees its values (onnx would look for the
#   file in the working directory, not the model's). A larger Constant stays where it is; its value is
#   memory-mapped from the model's directory when asked (GraphIndex.const), and the output's data file
#   receives it as it receives initializers.
# Written with external data again, what is under EXTERNAL_THRESHOLD (an integer tensor: INLINE_INTEGERS_UP_TO)
# stays inline, the rest goes to the file.
_ALWAYS_INLINE_BYTES = SKELETON_DATA_BYTES
_INLINE_ATTRIBUTE_BYTES = 16 << 20
_INLINE_ATTRIBUTES_TOTAL = 256 << 20


def _inline_attribute_tensors(model: onnx.ModelProto, base: str) -> None:
    """The tensor attributes stored as external data read in (see above; the small tensors were, as
    :func:`load` checked their files)."""
    from .protos import attribute_tensors

    total = 0
    for t in attribute_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        size = external_length(t)
        if size > _INLINE_ATTRIBUTE_BYTES or total + size > _INLINE_ATTRIBUTES_TOTAL:
            continue
        total += size
        _read_in(t, base)


def _read_in(t: onnx.TensorProto, base: str) -> None:
    """Hold an external tensor's bytes in the tensor itself, read from where the model's directory says, as
    the memory-mapped reads do (onnx's own reader refuses a data file that is a symbolic link, as a Hugging
    Face cache holds them; :func:`load` checked the file is there and long enough)."""
    src, offset, length = _external_source(t, base)
    with open(src, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise InputError(f"external data of tensor '{t.name}' is truncated")
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    t.raw_data = data


def may_name_external_data(path: str) -> bool:
    """False when the file's bytes never spell ``location``, the key every external tensor must give (in
    any of onnx's formats): a memory scan instead of a walk over every tensor of a 100k-node model."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return mm.find(b"location") >= 0
    except (OSError, ValueError):
        return True  # (cannot map it: ask the tensors)


def model_dir(model: onnx.ModelProto) -> str | None:
    """The directory external tensors of a model loaded by :func:`load` are relative to."""
    return _MODEL_DIRS.get(id(model))


def check_model_header(model: onnx.ModelProto, path: str = "model") -> None:
    """Refuse what is not an ONNX model at all (no graph, no IR version)."""
    if not model.HasField("graph") or model.ir_version <= 0:
        raise InputError(f"{path} is not an ONNX model (no graph or IR version)")


def unsupported_reason(model: onnx.ModelProto) -> str | None:
    """Why rnnfuse cannot work on a valid ONNX model, or None when it can.

    Such a model is not an error: it is passed through unchanged (a user may run rnnfuse over a whole folder of
    models). The native recurrent ops rnnfuse writes exist from opset 7; a model from a newer ONNX than the
    installed one cannot be checked or shape-inferred here; a model importing only ``ai.onnx.ml`` (tree
    ensembles, label encoders) has no default-domain ops to fuse."""
    if model.ir_version > onnx.IR_VERSION:
        return f"IR version {model.ir_version} is newer than the installed onnx supports ({onnx.IR_VERSION})"
    opset = default_opset(model)
    if opset is None:
        return "it imports no default-domain (ai.onnx) opset, so it holds no recurrence to fuse"
    if opset < MIN_OPSET:
        return f"it uses opset {opset}; the native recurrent ops rnnfuse writes need opset {MIN_OPSET} or newer"
    if opset > _max_opset():
        return f"it uses opset {opset}, newer than the installed onnx supports ({_max_opset()})"
    return None


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:160]


def copy_unchanged(in_path: str, out_path: str) -> None:
    """Write the input's bytes to ``out_path`` atomically (the output of a run that changed nothing)."""
    if os.path.exists(out_path) and os.path.samefile(in_path, out_path):
        return
    out_path = os.path.abspath(out_path)
    parent = os.path.dirname(out_path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rnnfuse-", dir=parent)
        os.close(fd)
        shutil.copyfile(in_path, tmp)
        os.replace(tmp, out_path)
        tmp = None
    except OSError as e:
        raise OutputError(f"cannot write {out_path}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def save(model: onnx.ModelProto, out_path: str, external: bool | None = None, source_dir: str | None = None) -> list[str]:
    """Write ``model`` atomically; returns the files written. ``external=None`` decides by size.

    With external data, every tensor of ``EXTERNAL_THRESHOLD`` bytes or more goes to ``<output>.data`` (but
    integer ones up to ``INLINE_INTEGERS_UP_TO``, read as shapes).
    Without, tensors still stored elsewhere (borrowed from the input file, in the input's data file, spilled)
    are written inline, copied from there while the file is written. Either way they are copied in chunks,
    never loaded whole; ``source_dir`` (default: the model's directory) is where relative locations are."""
    out_path = os.path.abspath(out_path)
    parent = os.path.dirname(out_path)
    base = os.path.basename(out_path)
    if source_dir is None:
        source_dir = model_dir(model)
    too_big = estimated_size(model) > PROTO_LIMIT - (64 << 20)
    if external is None:
        external = too_big
    tmpdir = None
    try:
        tmpdir = tempfile.mkdtemp(prefix=".rnnfuse-", dir=parent)
        tmp_model = os.path.join(tmpdir, base)
        written = [out_path]
        if external:
            data_name = base + ".data"
            tmp_data = os.path.join(tmpdir, data_name)
            if _write_external(model, tmp_data, data_name, source_dir):
                os.replace(tmp_data, os.path.join(parent, data_name))
                written.append(os.path.join(parent, data_name))
            # (else every tensor is held inline, a model of small tensors: no empty data file beside it)
            with open(tmp_model, "wb") as f:
                f.write(model.SerializeToString())
        elif too_big and _has_unloaded(model):
            raise OutputError("the model is over 2 GB; write it with --external-data auto or always")
        else:
            _write_inline(model, tmp_model, source_dir)
        os.replace(tmp_model, out_path)
        return written
    except OSError as e:
        raise OutputError(f"cannot write {out_path}: {e.strerror or e}") from None
    except ValueError as e:
        raise OutputError(f"cannot write {out_path}: {_short(e)}") from None
    finally:
        if tmpdir and os.path.isdir(tmpdir):
            shutil.rmtree(tmpdir, ignore_errors=True)


def _has_unloaded(model: onnx.ModelProto) -> bool:
    from .protos import all_tensors

    return any(t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data") for t in all_tensors(model))


def _external_source(t: onnx.TensorProto, source_dir: str | None) -> tuple[str, int, int]:
    """(file, offset, length) of an unloaded external tensor's bytes."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    if not loc or (source_dir is None and not os.path.isabs(loc)):
        raise ValueError(f"tensor '{t.name}' is stored externally but its file is unknown")
    src = loc if os.path.isabs(loc) else os.path.join(source_dir, loc)
    offset = int(info.get("offset", 0))
    return src, offset, external_length(t)


def _copy_range(src: str, offset: int, length: int, out, name: str) -> None:
    """Append ``length`` bytes of ``src`` from ``offset`` to the unbuffered file ``out``: by the kernel where
    it can (no copy in our memory), else in 16 MiB chunks."""
    with open(src, "rb") as f:
        left, pos = length, offset
        kernel = hasattr(os, "copy_file_range")
        while left:
            if kernel:
                try:
                    n = os.copy_file_range(f.fileno(), out.fileno(), left, pos)
                except OSError:  # (another file system, an old kernel: plain reads)
                    kernel = False
                    continue
                if n == 0:  # (some file systems copy nothing rather than fail: plain reads tell)
                    kernel = False
                    continue
            else:
                f.seek(pos)
                chunk = f.read(min(left, 16 << 20))
                n = len(chunk)
                _write_all(out, chunk)
            if n == 0:
                raise ValueError(f"external data of '{name}' is truncated")
            left -= n
            pos += n


def _write_all(out, data) -> None:
    """``out.write`` on an unbuffered file may write less than it is given."""
    view = memoryview(data)
    while len(view):
        view = view[out.write(view):]


def _write_inline(model: onnx.ModelProto, path: str, source_dir: str | None) -> None:
    """Serialize ``model`` to ``path`` as one file, its unloaded external tensors inline (see :func:`_inline`):
    those tensors are never held in memory, only the rest of the model's serialization."""
    with open(path, "wb", buffering=0) as out:
        _inline(model, out, source_dir)


def _inline(model: onnx.ModelProto, out, source_dir: str | None) -> None:
    """Write ``model`` to ``out``, its unloaded external tensors inline.

    Each such tensor holds a unique marker as its ``raw_data`` while the (now small) model is serialized; the
    bytes are then written with every marker replaced by the tensor's bytes, copied from their file, and the
    length prefixes around it rewritten (:func:`rnnfuse.wire.splice_plan`). The tensors are given back their
    external fields afterwards. The result is the bytes ``onnx.save`` of the fully loaded model writes (a
    tensor read in from external data has no ``data_location`` field, as if it had always been inline)."""
    from . import wire
    from .protos import all_tensors

    holes = [t for t in all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data")]
    if not holes:
        _write_all(out, model.SerializeToString())
        return
    sources = [_external_source(t, source_dir) for t in holes]
    prefix = b"\0rnnfuse-hole\0" + os.urandom(16)
    markers = {prefix + i.to_bytes(4, "little"): i for i in range(len(holes))}
    kept = [[(e.key, e.value) for e in t.external_data] for t in holes]
    try:
        for t, m in zip(holes, markers):
            del t.external_data[:]
            t.ClearField("data_location")
            t.raw_data = m
        data = model.SerializeToString()
    finally:
        for t, entries in zip(holes, kept):
            t.ClearField("raw_data")
            del t.external_data[:]
            for k, v in entries:
                e = t.external_data.add()
                e.key, e.value = k, v
            t.data_location = onnx.TensorProto.EXTERNAL
    for p in wire.splice_plan(data, markers, [s[2] for s in sources]):
        if isinstance(p, int):
            _copy_range(*sources[p], out, holes[p].name)
        else:
            _write_all(out, p)


def _write_external(model: onnx.ModelProto, data_path: str, location: str, source_dir: str | None) -> int:
    """Write the tensors held elsewhere or of ``EXTERNAL_THRESHOLD`` bytes or more (integer ones: more than
    ``INLINE_INTEGERS_UP_TO``) to ``data_path``, each pointed there; returns how many."""
    from .protos import all_tensors

    from .graph import set_external

    align = 4096
    count = 0
    with open(data_path, "wb", buffering=0) as out:
        for t in all_tensors(model):
            unloaded = t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data")
            if not unloaded:
                size = len(t.raw_data) if t.HasField("raw_data") else 0
                if size < EXTERNAL_THRESHOLD or (t.data_type in _INTEGER_TYPES and size <= INLINE_INTEGERS_UP_TO):
                    continue
            pos = out.seek(0, os.SEEK_CUR)
            if pos % align:
                _write_all(out, b"\0" * (align - pos % align))
                pos += align - pos % align
            if unloaded:
                src, offset, length = _external_source(t, source_dir)
                _copy_range(src, offset, length, out, t.name)
            else:
                length = len(t.raw_data)
                _write_all(out, t.raw_data)
                t.ClearField("raw_data")
            set_external(t, location, pos, length)
            count += 1
    return count


def estimated_size(model: onnx.ModelProto) -> int:
    """Serialized size, estimated without serializing (ByteSize fails beyond 2 GB)."""
    return data_bytes(model) + 4 * len(model.graph.node) * 64
