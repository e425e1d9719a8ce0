"""The model types of the ONNX ecosystem, in and out of rnnfuse.

rnnfuse works on an ``onnx.ModelProto``. Users also hold an ``onnx_ir.Model`` (what torch's dynamo exporter
and onnxscript hand out), an ``onnx_graphsurgeon.Graph`` (TensorRT users' graph) or just a file path.
:func:`to_proto` turns any of them into a ModelProto and returns the function that turns the fused proto back
into the kind the caller gave, so :func:`rnnfuse.optimize` returns what it was given. onnx-ir and
onnx-graphsurgeon are optional: they are imported only when an object of theirs is passed in, recognised by
its module name, so the base install stays onnx + onnxruntime + numpy.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import onnx


def _module_of(obj: Any) -> str:
    return type(obj).__module__ or ""


def is_ir_model(obj: Any) -> bool:
    return _module_of(obj).startswith("onnx_ir") and type(obj).__name__ == "Model"


def is_graphsurgeon_graph(obj: Any) -> bool:
    return _module_of(obj).startswith("onnx_graphsurgeon") and type(obj).__name__ == "Graph"


def to_proto(model: Any) -> tuple[onnx.ModelProto, Callable[[onnx.ModelProto], Any], bool]:
    """``(proto, back, fresh)``: the model as a ModelProto, the conversion back to the caller's kind, and
    whether ``proto`` is a new object (so the pipeline need not copy it again)."""
    if isinstance(model, onnx.ModelProto):
        return model, lambda p: p, False
    if isinstance(model, (str, os.PathLike)):
        # a path: load it whole (external data included) so the returned proto is self-contained
        return onnx.load(os.fspath(model)), lambda p: p, True
    if is_ir_model(model):
        import onnx_ir as ir

        return ir.to_proto(model), ir.from_proto, True
    if is_graphsurgeon_graph(model):
        import onnx_graphsurgeon as gs

        # do_type_check=False: a graph whose tensors lack dtypes round-trips as it came (rnnfuse reads what
        # it needs and declines what it cannot type)
        return gs.export_onnx(model, do_type_check=False), gs.import_onnx, True
    raise TypeError(
        "rnnfuse.optimize takes an onnx.ModelProto, an onnx_ir.Model, an onnx_graphsurgeon.Graph or a path, "
        f"not {type(model).__module__}.{type(model).__name__}"
    )


def replace_ir_model_contents(target, source) -> None:
    """Make the ``onnx_ir.Model`` ``target`` hold ``source``'s graph, functions and IR version, keeping the
    object itself (what an in-place pass must return)."""
    target.graph = source.graph
    target.ir_version = source.ir_version
    target.functions.clear()
    target.functions.update(source.functions)
