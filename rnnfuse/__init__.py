"""rnnfuse: find recurrences in ONNX graphs and rewrite them into native LSTM / GRU / RNN ops.

>>> import onnx, rnnfuse
>>> model = onnx.load("model.onnx")
>>> fused, report = rnnfuse.optimize(model)
>>> print(report.to_text())

``optimize`` also takes an ``onnx_ir.Model``, an ``onnx_graphsurgeon.Graph`` or a path, and returns the kind it
was given; ``rnnfuse.FuseRecurrencesPass`` is an ``onnx_ir.passes.InPlacePass`` (needs ``rnnfuse[ir]``).
"""

from __future__ import annotations

import os as _os

# Installed, the rules live in ``rnnfuse/passes`` (pyproject maps the top-level ``passes/`` there). Run from a
# source checkout (``python -m rnnfuse`` or pytest in the repository root put it first on sys.path), they are
# found in the sibling ``passes/`` directory.
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "passes")) and _os.path.isfile(_os.path.join(_here, _os.pardir, "passes", "__init__.py")):
    __path__.append(_os.path.dirname(_here))  # noqa: F821 (the package's own __path__)

from .errors import Decline, RnnfuseError
from .graph import Graph, Model
from .pipeline import Finding, Options, Pass, PassReport, Pipeline, Report

__version__ = "0.1.0"

__all__ = [
    "optimize",
    "Pipeline",
    "Pass",
    "PassReport",
    "Report",
    "Finding",
    "Options",
    "Model",
    "Graph",
    "Decline",
    "RnnfuseError",
]


def __getattr__(name: str):
    # optional dependencies load on first use: ``import rnnfuse`` needs only onnx, onnxruntime and numpy
    if name == "FuseRecurrencesPass":
        try:
            from .ir_pass import FuseRecurrencesPass
        except ImportError as e:
            raise ImportError(f'rnnfuse.FuseRecurrencesPass needs onnx-ir: pip install "rnnfuse[ir]" ({e})') from None
        return FuseRecurrencesPass
    if name == "PassResult":
        import warnings

        warnings.warn("rnnfuse.PassResult is now rnnfuse.PassReport (PassResult is onnx_ir.passes' name)",
                      DeprecationWarning, stacklevel=2)
        return PassReport
    raise AttributeError(f"module 'rnnfuse' has no attribute '{name}'")


def optimize(
    model,
    *,
    post_padded: bool = False,
    validate: bool = True,
    passes=None,
    copy: bool = True,
    seed: int = 0,
    portable: bool = False,
):
    """Fuse every recurrence rnnfuse can prove equivalent; returns ``(new_model, report)``.

    ``model`` is an ``onnx.ModelProto``, an ``onnx_ir.Model``, an ``onnx_graphsurgeon.Graph`` or a path to an
    ``.onnx`` file; ``new_model`` is of the same kind (a ``ModelProto`` for a path). The input object is not
    changed (``copy=False`` lets a ModelProto be edited in place instead of copied).
    ``post_padded=True`` promises that every mask is post-padded (valid steps first), which allows the
    leaner graph; by default fused masked layers are exact for any mask. ``validate=False`` skips the
    numeric check of each rewrite against the original. ``passes`` replaces the default pipeline.
    ``portable=True`` declines fusions whose native op OpenVINO cannot compile (e.g. HardSigmoid gates);
    by default they are applied and their findings warn.
    """
    from .interop import to_proto

    proto, back, fresh = to_proto(model)
    pipe = Pipeline(passes) if passes is not None else Pipeline.default()
    fused, report = pipe(proto, copy=copy and not fresh, post_padded=post_padded, validate=validate, seed=seed,
                         portable=portable)
    return back(fused), report
