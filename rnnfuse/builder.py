"""``Builder``: adds the nodes and constants a rewrite emits, next to an anchor node, in the forms the model's
opset takes (a Squeeze's axes as an attribute or an input, a Split's sizes, a Slice's constant bounds ...)."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from .errors import Decline
from .graph import Graph
from .symbolic.algebra import content_digest

# weights at least this big are spilled to disk when the model's weights are external data (or borrowed from its
# file, see rnnfuse.model_io): the new LSTM W/R then never enter the proto, where they would stay until the
# end and be serialised again on save (75 MB chain of input = hidden = 1536: peak RSS 524 -> 302 MB), and
# validation hands their memory-mapped pages to onnxruntime (rnnfuse.check_session)
SPILL_BYTES = 1 << 20


class Builder:
    """Adds nodes near an anchor, with opset-aware helpers."""

    def __init__(self, g: Graph, anchor: NodeProto | None, prefix: str):
        self.g, self.anchor, self.prefix = g, anchor, prefix
        self.opset = g.model.opset
        self._consts: dict = {}

    def op(self, op_type: str, *inputs: str, n: int = 1, **attrs):
        if op_type == "Slice" and self.opset < 10:
            x, bounds = self._slice_attributes(inputs)
            inputs, attrs = (x,), {**attrs, **bounds}
        outs = self.g.add_node(op_type, list(inputs), n, name=f"{self.prefix}/{op_type}", anchor=self.anchor, **attrs)
        return outs if n > 1 else outs[0]

    def _slice_attributes(self, inputs) -> tuple[str, dict]:
        """``(data, attributes)``: a Slice written with bound inputs (opset 10 on) in the form opsets 1-9 take,
        its starts, ends and axes as attributes. Only constant bounds with steps of 1 have that form."""
        bounds = [self.g.const(name) for name in inputs[1:]]
        if any(b is None for b in bounds) or (len(bounds) > 3 and np.any(np.asarray(bounds[3]) != 1)):
            raise Decline(f"a slice with computed bounds or steps needs opset 10; the model has opset {self.opset}")
        return inputs[0], {k: [int(v) for v in np.ravel(b)] for k, b in zip(("starts", "ends", "axes"), bounds)}

    def const(self, arr, hint: str = "const") -> str:
        arr = np.asarray(arr)
        key = (hint, arr.dtype.str, arr.shape, arr.tobytes()) if arr.size <= 16 else None
        if key is not None and key in self._consts:
            return self._consts[key]
        name = self.g.add_initializer(arr, f"{self.prefix}/{hint}")
        if key is not None:
            self._consts[key] = name
        return name

    def stacked(self, parts: list, hint: str, dtype=np.float32) -> str:
        """An initializer ``concat(parts)[None]``: big ones are written straight to a spill file (external
        data, memory-mapped) instead of being built in memory -- models loaded with external data only."""
        rows = sum(int(p.shape[0]) for p in parts)
        tail = tuple(parts[0].shape[1:])
        nbytes = rows * int(np.prod(tail) if tail else 1) * np.dtype(dtype).itemsize
        if nbytes < SPILL_BYTES or self.g.model.external_dir is None:
            return self._weight(np.concatenate(parts, 0)[None].astype(dtype, copy=False), hint)
        return self.g.add_spilled_initializer(parts, (1, rows) + tail, dtype, f"{self.prefix}/{hint}")

    def _weight(self, arr: np.ndarray, hint: str) -> str:
        """An emitted weight as an initializer, the one already written with these values if there is one:
        two ops over one x with equal weights and inputs are then one node to Dedupe, which compares a weight
        of more than 64 elements by name (a chain whose final h and c are stacked, ``torch.stack([h, c])``, is
        found once for each and emitted twice: two ops computing the same, where one is asked for)."""
        key = content_digest(arr)
        known = self.g.model.facts.emitted_weights
        name = known.get(key)
        if name is not None and name in self.g.initializers and np.array_equal(self.g.const(name), arr):
            return name
        name = known[key] = self.const(arr, hint)
        return name

    def i64(self, *vals) -> str:
        return self.const(np.array(vals, dtype=np.int64), "i64")

    def split(self, x: str, sizes: list[int], axis: int = 0) -> list[str]:
        """``x`` cut along ``axis`` into consecutive parts of ``sizes`` (two or more): one node, where a Slice
        per part needs two constants of its own."""
        if self.opset >= 13:
            return self.op("Split", x, self.i64(*sizes), n=len(sizes), axis=axis)
        return self.op("Split", x, n=len(sizes), axis=axis, split=list(sizes))

    def squeeze(self, x: str, axes: list[int]) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", x, self.i64(*axes))
        return self.op("Squeeze", x, axes=axes)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.i64(*axes))
        return self.op("Unsqueeze", x, axes=axes)

    def reduce_sum(self, x: str, axes: list[int], keepdims: int = 0) -> str:
        if self.opset >= 13:
            return self.op("ReduceSum", x, self.i64(*axes), keepdims=keepdims)
        return self.op("ReduceSum", x, axes=axes, keepdims=keepdims)

    def flip0(self, x: str) -> str:
        """Reverse axis 0."""
        return self.op("Slice", x, self.i64(-1), self.i64(-(2**63)), self.i64(0), self.i64(-1))

    def dim(self, x: str, axis: int) -> str:
        """``shape(x)[axis]`` as a 1-element int64 tensor."""
        return self.op("Slice", self.op("Shape", x), self.i64(axis), self.i64(axis + 1), self.i64(0))
