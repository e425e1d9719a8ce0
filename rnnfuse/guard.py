"""Do no harm: decide what an optimization run hands back.

rnnfuse's clean-ups (constant-``If`` inlining, no-op removal, de-duplication) exist to expose recurrences to
the fusion passes. They are not the product: when nothing was fused, the caller gets the input model back as
it was (the command line copies the input file byte for byte). When something was fused, the rewritten model
must be at least as valid as the input: if the input passes ``onnx.checker`` (full check, strict shape
inference) or loads in onnxruntime, the output must too; otherwise every rewrite is undone and the findings
say why. Each rewrite was already validated numerically; this guards the graph as a whole (a clean-up can
expose a shape that strict inference refuses, as the ``affine_grid`` function expansions in onnx's backend
tests showed). A big model is judged by the part the run changed (rnnfuse.changed_region) when that part
passes both checks and the graph around it is wired soundly; otherwise by the whole, which onnxruntime is
handed in pieces when it is big (rnnfuse.load_in_pieces: its load grows faster than the nodes).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Callable

import onnx

from .findings import Report

# beyond this much weight data, a second onnxruntime session (or a serialised copy for the checker) would
# hold the model twice: the whole-model checks are skipped there and the report says so
MAX_CHECK_BYTES = 1 << 30


def checker_error(proto: onnx.ModelProto | bytes | str) -> str | None:
    """The first line of ``onnx.checker``'s complaint (full check), or None when it accepts the model
    (given as a proto, serialised, or the path of a file)."""
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:  # the checker raises ValidationError, InferenceError, or protobuf errors
        return _first_line(e)
    return None


def onnxruntime_error(proto: onnx.ModelProto | bytes | str) -> str | None:
    """Why onnxruntime refuses to load the model (given as a proto, serialised, or the path of a file), or
    None when it loads."""
    import onnxruntime as ort

    from .check_session import without_prepacking

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if isinstance(proto, str):  # (a weightless copy: pre-packing would only copy its zeros)
        without_prepacking(so)
    try:
        data = proto if isinstance(proto, (bytes, str)) else proto.SerializeToString()
        ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types for invalid graphs
        return _first_line(e)
    return None


def harm(after: onnx.ModelProto, before: Callable[[], onnx.ModelProto], established=None) -> str | None:
    """Why ``after`` is less valid than the model ``before()`` returns, or None when it is not.

    ``before`` is called only when ``after`` fails a check (the command line re-reads the input then).
    ``established``: types the run inferred (see changed_region.region_model), or None."""
    original: list[onnx.ModelProto] = []

    def _before() -> onnx.ModelProto:
        if not original:
            original.append(before())
        return original[0]

    from .changed_region import SCOPED_NODES, NodeScan
    from .protos import call_sizes, nodes_within

    if not _can_check(after):
        return None
    # (a big model's nodes read once for the region, the wiring and the pieces. Big counting the nodes
    # onnxruntime sets up: its subgraphs' and the bodies of the local functions it calls. 2,273 Ifs with
    # 40-node branches in 9,365 main-graph nodes were checked and loaded whole, 5.1 s of a 6.5 s run, now
    # 0.3 s; 9,700 calls of 11-node functions, 7.3 s)
    big = nodes_within(after.graph, SCOPED_NODES, call_sizes(after)) >= SCOPED_NODES
    scan = NodeScan(after) if big else None
    if _region_passes(after, _before, established, scan):
        return None  # (its changed region passes: the whole is not serialised or written for the checks)
    # (the input, read for the region, is let go before the whole is serialised and checked: it is read again
    # only if a check fails. 11,110 fused Loops held their 66 MB input beside the checker's copy of the whole)
    original.clear()
    with _checkable(after, can=True) as data:  # (asked above: a walk over every node's tensors)
        if data is None:
            return None
        pieces = _pieces(after, data, scan)
        err, types = _checker_error_typing(data, pieces)
        if err is not None and _check_before(checker_error, _before) is None:
            return f"onnx.checker rejects the rewritten model, which it accepts as given ({err})"
        err = _load_error(data, pieces, types)
    if err is not None and _check_before(onnxruntime_error, _before) is None:
        return f"onnxruntime cannot load the rewritten model, which it loads as given ({err})"
    return None


def _region_passes(after: onnx.ModelProto, before: Callable[[], onnx.ModelProto], established, scan) -> bool:
    """Whether the part of a big rewritten model that differs from its input (see rnnfuse.changed_region)
    passes both checks, and the whole graph's wiring is sound: then the whole model passes where the input
    did, and the whole is neither loaded (onnxruntime's load grows faster than the nodes: 13 s for 100,000)
    nor checked (the checker's copy and strict inference of 100,000 nodes: 0.5 s and 170 MB). False (check
    the whole, as for a small model) when the model is small, the region cannot stand alone, or a check of
    it fails: what the whole model's checks say then decides."""
    from .changed_region import region_model, wiring_error

    if scan is None or wiring_error(after, scan) is not None:
        return False
    region = region_model(after, before(), established, scan)
    if region is None:
        return False
    with _checkable(region) as data:
        if data is None:
            return False
        pieces = _pieces(region, data)
        err, types = _checker_error_typing(data, pieces)
        return err is None and _load_error(data, pieces, types) is None


def _pieces(model: onnx.ModelProto, data, scan=None):
    """``model`` cut into pieces onnxruntime loads apart (rnnfuse.load_in_pieces), or None: small, not
    serialised (a copy without weights is loaded whole), or not to be judged by pieces."""
    from .load_in_pieces import Pieces

    return Pieces.cut(model, scan) if isinstance(data, bytes) else None


def _checker_error_typing(data, pieces) -> tuple[str | None, dict | None]:
    """:func:`checker_error`, and when ``pieces`` need them, the types of the values crossing between them
    (None: not all typed, or the checker refused the model). Those are inferred with data propagation, as
    onnxruntime's load infers them (a Reshape to ``Shape(w)`` has w's dims there, and a piece declared
    with fewer would check less); the checker's verdict stays its own (no propagation)."""
    err = checker_error(data)
    if err is not None or pieces is None:
        return err, None
    if not pieces.crossing:
        return None, {}
    try:
        inferred = onnx.shape_inference.infer_shapes(data, data_prop=True)
    except Exception:  # (whatever it raises: no types, the whole model is loaded)
        return None, None
    return None, pieces.types_of(inferred)


def _load_error(data, pieces, types) -> str | None:
    """Why onnxruntime refuses the model: None when every piece of a cut model loads; otherwise (a piece
    refused, a crossing value untyped, or not cut) what loading the whole model says."""
    if pieces is not None and types is not None and pieces.load(types):
        return None
    return onnxruntime_error(data)


def _check_before(check: Callable, before: Callable[[], onnx.ModelProto]) -> str | None:
    with _checkable(before()) as data:
        return "not checked" if data is None else check(data)


@contextlib.contextmanager
def _checkable(model: onnx.ModelProto, can: bool | None = None):
    """What the checks read: the serialised model; for a weight-heavy one, or one whose weights are external
    data, the path of a copy without its weights (see check_session.write_skeleton: the checks never read
    weight values, and a serialised copy would hold every weight again); None when it cannot be checked (a
    tensor inside a node or subgraph stored as external data; a model too big to serialise). ``can``: what
    :func:`_can_check` says of ``model``, when the caller asked it already."""
    from .check_session import weight_heavy, write_skeleton

    if not (_can_check(model) if can is None else can):
        yield None
        return
    if weight_heavy(model):
        workdir = tempfile.mkdtemp(prefix="rnnfuse-guard-")
        try:
            yield write_skeleton(model, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    try:
        data: onnx.ModelProto | bytes = model.SerializeToString()  # (once, for both checks)
    except Exception:  # (too large to serialise: each check says so itself)
        data = model
    yield data


def _can_check(model: onnx.ModelProto) -> bool:
    """Whether :func:`_checkable` gives the checks something to read (no tensor beyond the main graph's
    initializers stored as external data; not over ``MAX_CHECK_BYTES`` of data held, unless weight-heavy)."""
    from .check_session import weight_heavy
    from .protos import data_bytes

    return not _external_beyond_initializers(model) and (weight_heavy(model) or data_bytes(model) <= MAX_CHECK_BYTES)


def _external_beyond_initializers(model: onnx.ModelProto) -> bool:
    """Whether a tensor other than a main-graph initializer is stored as external data."""
    from .protos import tensors_beyond_initializers

    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in tensors_beyond_initializers(model))


def undo_all(report: Report, reason: str) -> None:
    """Record on the report that every rewrite of this run was undone, and why."""
    for f in report.findings:
        if f.status in ("fused", "merged"):
            f.status, f.reason = "declined", f"undone: {reason}"
    for p in report.passes:
        p.modified = False
    report.ops_after = dict(report.ops_before)
    report.notes.append(f"every rewrite was undone: {reason}")


def settle(report: Report, after: onnx.ModelProto, before: Callable[[], onnx.ModelProto], established=None) -> bool:
    """Decide whether the run's rewritten model is kept; returns True when it is.

    False means the caller must hand back the input unchanged: nothing was fused (clean-ups alone never
    change a model), the model was passed through as unsupported, or the rewrite would harm it.
    ``established``: the run's :meth:`~rnnfuse.model.Model.established_type` (what it inferred is not
    inferred again for the values it left as they were)."""
    if not report.fused:
        report.ops_after = dict(report.ops_before)
        return False
    reason = harm(after, before, established)
    if reason is not None:
        undo_all(report, reason)
        return False
    return True


def _first_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:200]
