"""A tensor's values as the model holds them: raw bytes read directly as an array, and the value of a
Constant node read without the folding dispatch (an unrolled export has a few Constants per step).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
from onnx import AttributeProto, NodeProto, TensorProto, numpy_helper

if TYPE_CHECKING:
    from .model import Model

# element types whose raw bytes are the array as numpy reads them on a little-endian machine (what
# numpy_helper.to_array does for them, without its per-call type-table lookups: ~3x faster on the 18,000
# small Constants of a 6,000-step unrolled export)
_RAW_DTYPES = {
    getattr(TensorProto, k): np.dtype(v)
    for k, v in (("FLOAT", "float32"), ("DOUBLE", "float64"), ("INT8", "int8"), ("INT16", "int16"),
                 ("INT32", "int32"), ("INT64", "int64"), ("UINT8", "uint8"), ("UINT16", "uint16"),
                 ("UINT32", "uint32"), ("UINT64", "uint64"), ("BOOL", "bool"))
} if sys.byteorder == "little" else {}


def raw_array(t: TensorProto) -> np.ndarray:
    """``numpy_helper.to_array(t)`` for a tensor held in the model: the same (read-only) array over its raw
    bytes, read directly for the common element types."""
    dtype = _RAW_DTYPES.get(t.data_type)
    if dtype is not None and t.data_location != TensorProto.EXTERNAL and t.HasField("raw_data") and not t.HasField("segment"):
        return np.frombuffer(t.raw_data, dtype=dtype).reshape(t.dims)
    return numpy_helper.to_array(t)


UNREADABLE = object()  # a Constant whose externally stored tensor cannot be read: not a constant, not folded


def constant_value(node: NodeProto, model: "Model"):
    """The value of a Constant holding one tensor of raw bytes, read as :mod:`rnnfuse.fold` reads it, without
    the folding dispatch (an unrolled export has a few Constants per step); None for any other form.

    A tensor ``onnx.save(convert_attribute=True)`` stored as external data is read from the model's own
    directory (memory-mapped, as initializers are), never from the working directory, where another file of
    that name could supply other values; when it cannot be read, the answer is :data:`UNREADABLE`."""
    attrs = node.attribute
    if len(attrs) != 1 or node.domain not in ("", "ai.onnx"):
        return None
    a = attrs[0]
    if a.name != "value" or a.type != AttributeProto.TENSOR:
        return None
    t = a.t
    if t.data_location == TensorProto.EXTERNAL:
        try:
            return model.tensor_array(t)
        except Exception:  # (no model directory, a missing or short file, an element type with no array)
            return UNREADABLE
    if t.data_type not in _RAW_DTYPES:
        return None
    try:
        return raw_array(t)
    except Exception:  # (bytes that do not fill the dims, a segment, ...: the fold decides, as before this reader)
        return None
