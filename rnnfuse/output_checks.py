"""Fail early, before any work, when an output must not or cannot be written: the model file, and the data
file its tensors may go to (``<output>.data``), which may be a file the input itself reads its tensors from."""

from __future__ import annotations

import os

import onnx

from .errors import OutputError


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


def check_data_writable(out_path: str, in_path: str, in_place: bool, force: bool, external: str) -> None:
    """Refuse an output whose tensors may be written to ``<output>.data`` when that file exists and is one the
    input reads its own tensors from (replacing it would corrupt the input, ``--force`` or not: ``optimize
    a.onnx b.onnx`` where a.onnx keeps its weights in b.onnx.data), or, without ``force``, any other existing
    file. ``external``: the ``--external-data`` choice (auto: the output has a data file when the input has
    one, or is too big for one file). The run's own input in place (``--in-place``) replaces its own files."""
    from .model_io import PROTO_LIMIT, may_name_external_data

    data = os.path.abspath(out_path) + ".data"
    if external == "never" or not os.path.exists(data):
        return
    if in_place and os.path.exists(out_path) and os.path.exists(in_path) and os.path.samefile(in_path, out_path):
        return
    if external == "auto" and not may_name_external_data(in_path) and os.path.getsize(in_path) < PROTO_LIMIT >> 1:
        return  # (no data file written: the input has none and the output stays well under 2 GB)
    if any(os.path.exists(f) and os.path.samefile(f, data) for f in _data_files(in_path)):
        raise OutputError(f"the output's data file {data} holds the input's tensors: writing it would corrupt "
                          f"{in_path} (choose another output name)")
    if not force:
        raise OutputError(f"output data file already exists: {data} (use --force to replace it)")


def _data_files(in_path: str) -> set[str]:
    """The files the model at ``in_path`` reads external tensors from (read only when asked: the output's data
    file exists, which is rare)."""
    try:
        model = onnx.load(in_path, load_external_data=False)
    except Exception:  # (the load of the run itself reports a bad input, with its own message)
        return set()
    from .protos import all_tensors

    base = os.path.dirname(os.path.abspath(in_path))
    return {os.path.join(base, e.value) for t in all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}
