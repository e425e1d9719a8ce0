"""Deciding from a model file's bytes alone that nothing in it can be fused.

Every pass says which op types it needs to find anything to fuse (``fuses_only_with``: a Loop, a Scan, a
weight matmul, a native recurrent op). A model holding none of them, at any depth, comes out of a full run
as it went in, so the CLI need not load it: one walk over the file's fields (:func:`rnnfuse.wire.outline`,
0.2 s and no per-node objects for a 100k-node graph) and a byte copy give the same output and the same
report as loading it, indexing it and running every pass would (1 s and 15x the file in memory).

Anything the walk does not expect, and any model that names external data, takes the full path, which
gives its usual errors and writes the tensors out as it always does.
"""

from __future__ import annotations

import mmap
import os
import time

from .findings import Report
from .model_io import may_name_external_data, unsupported_reason
from .wire import WireError, may_name_an_op, outline


def report_if_nothing_to_fuse(path: str, needs: frozenset[str] | None) -> Report | None:
    """The report of a run over the model file ``path`` that fuses nothing, when its bytes show that no node
    of the op types ``needs`` (see :meth:`rnnfuse.pipeline.Pipeline.fusion_needs`) is in it; None when one
    may be, or when the file is anything but a plain single-file model the walk understands."""
    if needs is None:
        return None
    t0 = time.perf_counter()
    try:
        if not os.path.isfile(path) or os.path.getsize(path) == 0 or may_name_external_data(path):
            return None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if may_name_an_op(mm, needs):
                return None  # (the full path decides, as it would after the walk found one)
            found = outline(mm, stop_at=needs)
    except (OSError, ValueError, WireError):  # (UnicodeDecodeError is a ValueError)
        return None
    if found is None:
        return None
    report = Report(ops_before=dict(found.ops), ops_after=dict(found.ops), rounds=0)
    reason = unsupported_reason(found)
    if reason is not None:
        report.pass_through(reason)
    else:
        report.notes.append(f"nothing to fuse: no {', '.join(sorted(needs))} node (the file was read, not loaded)")
    report.seconds = time.perf_counter() - t0
    return report
