"""Loading and saving models safely.

Every problem with the input becomes an :class:`~rnnfuse.errors.InputError` naming it; every problem with the
output an :class:`~rnnfuse.errors.OutputError`. Outputs are written to a temporary file in the destination
directory and renamed into place, so a failed run never leaves a partial file and never touches an existing
output. Models that came with external data, or that would exceed protobuf's 2 GB limit, are written with
their tensors in a ``<output>.data`` file beside the model.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import onnx
from google.protobuf.message import DecodeError

from .errors import InputError, OutputError

MIN_OPSET = 7  # the native recurrent ops' semantics rnnfuse emits exist since opset 7
PROTO_LIMIT = 2**31 - 1
EXTERNAL_THRESHOLD = 1024  # tensors at least this large go to the external data file


def _max_opset() -> int:
    return onnx.defs.onnx_opset_version()


def uses_external_data(model: onnx.ModelProto) -> bool:
    from onnx.external_data_helper import uses_external_data as _uses

    from .protos import all_tensors

    return any(_uses(t) for t in all_tensors(model))


def load(path: str) -> tuple[onnx.ModelProto, bool]:
    """Load ``path``; returns (model, had_external_data).

    External data is *not* read into memory: tensors stay where they are and are memory-mapped when a pass
    needs their values (see :meth:`rnnfuse.graph.Model.tensor_array`), then streamed into the output's data
    file when it is written. The model's directory is recorded in ``model_dir(model)``."""
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
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise InputError(f"{path} is not a valid ONNX model (it is truncated or not ONNX: {_short(e)})") from None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # protobuf raises a variety of errors on garbage
        raise InputError(f"{path} is not a valid ONNX model ({_short(e)})") from None
    check_model_header(model, path)
    external = _may_name_external_data(path) and uses_external_data(model)
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
            need = int(info.get("offset", 0)) + int(info.get("length", 0))
            if os.path.getsize(loc) < need:
                raise InputError(f"external data file {info.get('location')} of {path} is truncated")
        _inline_attribute_tensors(model, base)
        _MODEL_DIRS[id(model)] = base
    return model, external


_MODEL_DIRS: dict[int, str] = {}

# A tensor attribute stored as external data (``onnx.save(convert_attribute=True)``: a Constant's value,
# ConstantOfShape's fill) is read into the model when it is small, so that every reader of attributes sees its
# values (onnx would look for the file in the working directory, not the model's): each of at most 16 MiB,
# 256 MiB in all (a fill or a shape, whatever the total). A larger Constant stays where it is; its value is
# memory-mapped from the model's directory when asked (GraphIndex.const), and the output's data file receives
# it as it receives initializers.
_INLINE_ATTRIBUTE_BYTES = 16 << 20
_INLINE_ATTRIBUTES_TOTAL = 256 << 20
_ALWAYS_INLINE_BYTES = 1024


def _inline_attribute_tensors(model: onnx.ModelProto, base: str) -> None:
    from onnx.external_data_helper import load_external_data_for_tensor

    from .protos import attribute_tensors

    total = 0
    for t in attribute_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        size = int(info["length"]) if "length" in info else os.path.getsize(os.path.join(base, info["location"]))
        if size > _ALWAYS_INLINE_BYTES and (size > _INLINE_ATTRIBUTE_BYTES or total + size > _INLINE_ATTRIBUTES_TOTAL):
            continue
        total += size
        load_external_data_for_tensor(t, base)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def _may_name_external_data(path: str) -> bool:
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


def default_opset(model: onnx.ModelProto) -> int | None:
    """The default-domain opset a model imports (IR < 3 models imported opset 1 implicitly)."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1 if model.ir_version < 3 else None


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:160]


def check_writable(out_path: str, in_path: str | None = None, in_place: bool = False, force: bool = True) -> None:
    """Fail early, before any work, if ``out_path`` cannot or must not be written.

    ``force=False`` refuses to replace an existing file (as gzip and zstd do): a swapped pair of arguments
    (``optimize fused.onnx model.onnx``) must not silently destroy the user's original model."""
    if not out_path:
        raise OutputError("no output file given")
    if os.path.isdir(out_path):
        raise OutputError(f"output is a directory: {out_path}")
    same_file = bool(in_path) and os.path.exists(out_path) and os.path.exists(in_path) and os.path.samefile(in_path, out_path)
    if same_file and not in_place:
        raise OutputError(f"output would overwrite the input {in_path} (use --in-place to allow it)")
    if os.path.exists(out_path) and not force and not same_file:
        raise OutputError(f"output file already exists: {out_path} (use --force to replace it)")
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise OutputError(f"output directory does not exist: {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"output directory is not writable: {parent}")
    if os.path.exists(out_path) and not os.access(out_path, os.W_OK):
        raise OutputError(f"output file is not writable: {out_path}")


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

    With external data, every tensor of ``EXTERNAL_THRESHOLD`` bytes or more goes to ``<output>.data``:
    tensors still stored in the input's data file (``source_dir``) are copied in chunks, never loaded whole."""
    out_path = os.path.abspath(out_path)
    parent = os.path.dirname(out_path)
    base = os.path.basename(out_path)
    if external is None:
        external = estimated_size(model) > PROTO_LIMIT - (64 << 20) or _has_unloaded(model)
    tmpdir = None
    try:
        tmpdir = tempfile.mkdtemp(prefix=".rnnfuse-", dir=parent)
        tmp_model = os.path.join(tmpdir, base)
        written = [out_path]
        if external:
            data_name = base + ".data"
            tmp_data = os.path.join(tmpdir, data_name)
            _write_external(model, tmp_data, data_name, source_dir)
            os.replace(tmp_data, os.path.join(parent, data_name))
            written.append(os.path.join(parent, data_name))
        elif _has_unloaded(model):
            raise OutputError("the model has tensors in external data; write it with --external-data auto or always")
        with open(tmp_model, "wb") as f:
            f.write(model.SerializeToString())
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


def _write_external(model: onnx.ModelProto, data_path: str, location: str, source_dir: str | None) -> None:
    from .protos import all_tensors

    from .graph import set_external

    align = 4096
    with open(data_path, "wb") as out:
        for t in all_tensors(model):
            unloaded = t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data")
            if not unloaded:
                if not t.HasField("raw_data") or len(t.raw_data) < EXTERNAL_THRESHOLD:
                    continue
            pos = out.tell()
            if pos % align:
                out.write(b"\0" * (align - pos % align))
                pos = out.tell()
            if unloaded:
                info = {e.key: e.value for e in t.external_data}
                if source_dir is None and not os.path.isabs(info["location"]):
                    raise ValueError(f"tensor '{t.name}' is stored externally but its file is unknown")
                loc = info["location"]
                src = loc if os.path.isabs(loc) else os.path.join(source_dir, loc)
                length = int(info.get("length", 0)) or os.path.getsize(src) - int(info.get("offset", 0))
                with open(src, "rb") as f:
                    f.seek(int(info.get("offset", 0)))
                    left = length
                    while left:
                        chunk = f.read(min(left, 64 << 20))
                        if not chunk:
                            raise ValueError(f"external data of '{t.name}' is truncated")
                        out.write(chunk)
                        left -= len(chunk)
            else:
                length = len(t.raw_data)
                out.write(t.raw_data)
                t.ClearField("raw_data")
            set_external(t, location, pos, length)


def estimated_size(model: onnx.ModelProto) -> int:
    """Serialized size, estimated without serializing (ByteSize fails beyond 2 GB)."""
    from .protos import all_tensors

    total = 0
    for t in all_tensors(model):
        total += len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data) + len(t.double_data))
    return total + 4 * len(model.graph.node) * 64
