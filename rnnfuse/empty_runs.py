"""Runs of no steps: what the native ops do on an empty sequence, and what the emitter adds so that a fused
recurrence still answers as the original did.

A Loop over a time axis of length 0 runs no iteration: its stacked outputs are empty and its final states are
the initial ones (onnxruntime's Scan refuses an empty sequence). onnxruntime's native ops differ there
(measured with 1.32):

* ``GRU`` with no ``sequence_lens`` **aborts the process** ("terminate called without an active exception"):
  a serving process dies where the original returned (or raised an error a caller can catch). Given
  ``sequence_lens`` it runs: ``Y`` is empty and ``Y_h`` zeros.
* ``LSTM`` and ``RNN`` run either way, and ``Y_h`` / ``Y_c`` are zeros, not the initial states. (Before 1.26,
  measured 1.18-1.25.1, the ``RNN`` crashes with a segmentation fault, lengths or not: nothing here avoids that.)

So where the time length may be 0 at run time (it is not a known positive number), a GRU reads the full
lengths (every row's length is the time length: the same results at every other length), and a final state
whose initial value is not zeros is taken from the initial value when there are no steps. Where the length is
a known number (a traced chain, a fixed-size input), nothing is added.
"""

from __future__ import annotations

from onnx import TensorProto

from .builder import Builder
from .dims import extent_key
from .graph import Graph


def may_run_empty(g: Graph, x: str, time_axis: int) -> bool:
    """Whether ``x``'s time length may be 0 when the model runs: it is not known to be a positive number."""
    key = extent_key(g, x, time_axis)
    return not (key is not None and key[0] == "const" and isinstance(key[1], int) and key[1] > 0)


def full_lengths(b: Builder, x: str) -> str:
    """``sequence_lens`` saying every row of the time-major ``x`` ([T, B, F]) runs all T steps: [B] int32 T.
    (rnnfuse.time_flips.full_lengths_of knows them again: a pass that turns the op around rebuilds them.)
    (Four small nodes and the op's lengths path: ~4 us a run in onnxruntime 1.32, where the op takes 50+.)"""
    steps = b.op("Cast", _extent(b, x, 0), to=TensorProto.INT32)
    return b.op("Expand", steps, _extent(b, x, 1))


def has_steps(b: Builder, x: str) -> str:
    """[1] bool: whether the time-major ``x`` has at least one step (broadcasts against a [B, H] state)."""
    return b.op("Greater", _extent(b, x, 0), b.i64(0))


def _extent(b: Builder, x: str, axis: int) -> str:
    """``shape(x)[axis]`` as a 1-element int64 tensor: one ``Shape`` node from opset 15 (its start and end),
    else a ``Slice`` of the shape."""
    if b.opset >= 15:
        return b.op("Shape", x, start=axis, end=axis + 1)
    return b.dim(x, axis)
