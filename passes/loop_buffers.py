"""A Loop that collects its per-step outputs in a carried buffer: ``outs[t] = h`` in a TorchScript loop, or
sums them in a carried accumulator: ``acc = acc + y`` (a running sum in a jax carry or a TorchScript loop).

The buffer is a loop-carried tensor the body writes at its iteration's row (``ScatterND(buf, [[i]], row)``,
the row ``h`` put in the buffer's row shape by ``Reshape(Expand(h, ...))`` or ``Unsqueeze``) and reads for
nothing but its shape. After a loop that runs once per step of x, a buffer with one row per step holds the
per-step values stacked time-major, which is what a native op's Y is: the buffer is one more per-step output
of the step. Its length must be provably x's time length (``zeros(x.size(0), B, H)``: read from how the fill
is shaped, :func:`rnnfuse.dims.extent_key`); anything else the body does with the buffer leaves it a
recurrent value the cell maths cannot read, and the loop is declined. An accumulator read for nothing but
its own sum is no state of the cell either: after the loop it holds its start plus every step's ``y``, which
the native op's Y gives summed over time.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rnnfuse import op_args
from rnnfuse.dataflow import reads_shape_only
from rnnfuse.dims import extent_key, time_keys
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr

_VIEWS = ("Reshape", "Expand", "Unsqueeze", "Identity")  # (what puts a step's value in the buffer's row shape)


def row_write(body: Graph, buf_in: str, buf_out: str, iteration: set[str]) -> str | None:
    """The value the body writes into the carried buffer ``buf_in`` at the iteration's row (the body tensor
    under the views that shape it as a row), when ``buf_out`` is that write and the body reads ``buf_in`` for
    nothing else than its shape; else None. ``iteration``: the body tensors that are the iteration number."""
    s = body.producer.get(buf_out)
    if s is None or s.op_type != "ScatterND" or s.input[0] != buf_in or attr(s, "reduction", "none") not in (
            "none", b"none"):
        return None
    if not _index_is(body, s.input[1], iteration):
        return None
    if any(u is not s and not reads_shape_only(body, u) for u in body.uses(buf_in)):
        return None
    value = s.input[2]
    for _ in range(6):
        p = body.producer.get(value)
        if p is None or p.op_type not in _VIEWS:
            break
        value = p.input[0]
    return value


def grown(g: Graph, body: Graph, buf_in: str, buf_out: str, init: str) -> tuple[str, int] | None:
    """``(y, axis)`` when the carried ``buf_in`` starts empty along ``axis`` (0 or 1) and each step appends
    ``y`` to it there, ``buf_out = Concat([buf_in, Unsqueeze(y, axis)], axis)`` (TorchScript's
    ``out = torch.cat([out, h.unsqueeze(1)], 1)``), the body reading ``buf_in`` for nothing else; else None.
    After a loop that runs once per step of x it holds the per-step values stacked along ``axis``."""
    cat = body.producer.get(buf_out)
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or cat.input[0] != buf_in:
        return None
    axis = attr(cat, "axis", 0)
    u = body.producer.get(cat.input[1])
    if axis not in (0, 1) or u is None or u.op_type != "Unsqueeze" or body.uses(cat.input[1]) != [cat]:
        return None
    if op_args.axes(u, g.model.opset, op_args.const_reader(body, u)) != [axis]:
        return None
    if any(n is not cat and not reads_shape_only(body, n) for n in body.uses(buf_in)):
        return None
    if extent_key(g, init, axis) != ("const", 0):  # (empty to begin with: every row is one step's)
        return None
    return u.input[0], axis


def accumulated(body: Graph, acc_in: str, acc_out: str) -> str | None:
    """The per-step value ``y`` when the carried ``acc_in`` only sums it, ``acc_out = acc_in + y`` (either order),
    and the body reads ``acc_in`` for nothing else and hands ``acc_out`` on as nothing else (so y is not
    computed from the sum, and no per-step output holds partial sums); else None."""
    if body.uses(acc_out) or body.output_names.count(acc_out) != 1:
        return None
    s = body.producer.get(acc_out)
    for _ in range(4):  # (through what keeps the value: jax2onnx casts each carried output to its own type)
        if s is None or not (s.op_type == "Identity" or (s.op_type == "Cast" and attr(s, "to") == TensorProto.FLOAT)):
            break
        if len(body.uses(s.input[0])) != 1:
            return None
        s = body.producer.get(s.input[0])
    if s is None or s.op_type != "Add" or len(s.input) != 2 or acc_in not in s.input or s.input[0] == s.input[1]:
        return None
    if len(body.uses(acc_in)) != 1:
        return None
    return s.input[1] if s.input[0] == acc_in else s.input[0]


def _index_is(body: Graph, idx: str, iteration: set[str]) -> bool:
    """Whether ``idx`` is ``[[i]]`` for the iteration number i: i with two unit axes added (by Unsqueeze, or a
    Reshape to [1, 1]), through casts."""
    added, cur = 0, idx
    for _ in range(6):
        if cur in iteration:
            return added == 2
        p = body.producer.get(cur)
        if p is None:
            return False
        if p.op_type == "Unsqueeze":
            axes = op_args.axes(p, body.model.opset, op_args.const_reader(body, p))
            if axes is None:
                return False
            added += len(axes)
        elif p.op_type == "Reshape":
            shape = body.const(p.input[1])
            if shape is None or [int(d) for d in np.ravel(shape)] != [1, 1]:
                return False
            added = 2
        elif p.op_type not in ("Cast", "Identity"):
            return False
        cur = p.input[0]
    return False


def check_buffer_length(g: Graph, init: str, x: str, time_axis: int, axis: int = 0) -> None:
    """Decline unless the buffer ``init`` has one row per time step of ``x`` along its ``axis`` (a loop over T
    steps fills T rows: a longer buffer keeps rows no native output holds, and a fixed length need not be T
    for every input)."""
    if extent_key(g, init, axis) not in time_keys(g, x, time_axis):
        raise Decline("an output buffer whose length is not the number of time steps")
