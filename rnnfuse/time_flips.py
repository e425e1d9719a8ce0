"""A full reversal of the time axis: which tensor a value is, read backwards in time.

``time_flip_source`` finds ``x`` behind a full reversal of the time axis: ``ReverseSequence`` with every
length equal to T, a ``Slice`` with step -1, or a ``Gather`` of the indices T-1 .. 0, constant or computed
from the shape as ``jnp.flip`` / ``torch.flip`` exporters write it (``T - 1`` is read as index terms, so any
spelling of it is seen).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import op_args
from .dims import dim_key, time_dim_key, value_source
from .graph import Graph, attr
from .index_order import reversed_order
from .index_terms import scalar_term, size_term


def full_lengths_of(g: Graph, lens: str, x: str, time_axis: int = 0) -> bool:
    """True if every entry of ``lens`` (a ``sequence_lens``) equals the time length of ``x``: each row runs whole
    (a constant, or a broadcast of that length, as the emitter's :func:`rnnfuse.empty_runs.full_lengths` builds)."""
    tkey = time_dim_key(g, x, time_axis)
    c = g.const(lens)
    if c is not None:
        flat = np.asarray(c).ravel()
        return tkey[0] == "const" and flat.size > 0 and bool(np.all(flat == tkey[1]))
    scope = g.scope_of(lens)
    n = scope.producer.get(value_source(scope, lens)) if scope else None
    if n is None:
        return False
    if n.op_type in ("Expand", "Tile"):
        k = dim_key(g, n.input[0])
        return k is not None and k == tkey
    if n.op_type == "ConstantOfShape":
        v = attr(n, "value")
        return v is not None and tkey[0] == "const" and int(np.asarray(v).ravel()[0]) == tkey[1]
    return False


def _descending_indices(g: Graph, idx: str, length_of: Callable[[], tuple]) -> bool:
    """True if ``idx`` holds [T-1, T-2, ..., 0] for the time length keyed ``length_of()``: a constant, a
    ``Range(T-1, -1, -1)``, or ``(T-1) - Range(0, T, 1)``. The length is asked only of indices of such a form
    (its key may need a type: a fused masked op's compacting Gather asked one each, 0.4 ms)."""
    c = g.const(idx)
    if c is not None:
        arr = np.asarray(c)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.tolist() != list(range(arr.size - 1, -1, -1)):
            return False
        length = length_of()
        return length[0] == "const" and length[1] == arr.size
    scope = g.scope_of(idx)
    n = scope.producer.get(value_source(scope, idx)) if scope is not None else None
    if n is None:
        return False
    if n.op_type == "Range" and len(n.input) == 3:
        if [scalar_term(g, i) for i in n.input[1:]] == [("c", -1), ("c", -1)]:
            return scalar_term(g, n.input[0]) == size_term(length_of(), -1)
    elif n.op_type == "Sub" and len(n.input) == 2 and g.model.shape(n.input[0]) in ([], [1]):
        # (a [1, 1] start would add an axis to the Gather)
        r = scope.producer.get(n.input[1])
        if r is not None and r.op_type == "Range" and len(r.input) == 3:
            length = length_of()
            if (scalar_term(g, n.input[0]) == size_term(length, -1)
                    and [scalar_term(g, i) for i in r.input] == [("c", 0), size_term(length), ("c", 1)]):
                return True
    # (other spellings: an iota reversed by arithmetic or a Gather, reshaped, broadcast to its own shape)
    order = reversed_order(g, idx)
    return order is not None and order == size_term(length_of()) and g.model.rank(idx) == 1


def time_flip_source(g: Graph, name: str, time_axis: int = 0) -> str | None:
    """If ``name`` is its source reversed along ``time_axis`` (every row entirely), that source."""
    scope = g.scope_of(name)
    if scope is None:
        return None
    n = scope.producer.get(name)
    if n is None:
        return None
    if n.op_type == "ReverseSequence":
        if attr(n, "time_axis", 0) != time_axis:
            return None
        if full_lengths_of(g, n.input[1], n.input[0], time_axis):
            return n.input[0]
        return None
    if n.op_type == "Slice":
        starts, ends, axes, steps = op_args.slice_args_of(g, n)
        if starts is None or ends is None or axes is None or steps is None:
            return None
        rank = g.model.rank(n.input[0]) if any(a < 0 for a in axes) else None  # (asked for a negative axis only)
        axes = [a + rank if a < 0 and rank else a for a in axes]
        if len(axes) == 1 and axes[0] == time_axis and steps == [-1] and starts[0] in (-1, 2**63 - 1, 2**31 - 1) and ends[0] <= -(2**31):
            return n.input[0]
    if n.op_type == "Gather" and len(n.input) == 2:
        axis = attr(n, "axis", 0)
        rank = g.model.rank(n.input[0]) if axis < 0 else None  # (a fused op's compacting Gathers: 0.65 ms a type)
        if rank is not None:
            axis += rank
        if axis == time_axis and _descending_indices(g, n.input[1], lambda: time_dim_key(g, n.input[0], time_axis)):
            return n.input[0]
    return None
