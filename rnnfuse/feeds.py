"""Random inputs and padding patterns, for validation (rnnfuse.validate, rnnfuse.cell_check) and benchmarks
(rnnfuse.bench), in one place.

Validation wants adversarial inputs: masks where row 0 is full and row 1 empty, lengths anywhere from 0 to
T, index inputs from 0. Benchmarks want realistic ones: every row at least half full, index inputs from 1
(0 is the padding token of Embedding(mask_zero=True)). Both draw from the same rules with those settings.
"""

from __future__ import annotations

import numpy as np

from .dims import SCALAR_RESHAPES, keeps_value, value_source
from .graph import Graph

MASK_KINDS = ("post", "pre", "gappy")  # and "full": every step valid


def index_ranges(g: Graph) -> dict[str, int]:
    """Integer graph inputs used as Gather indices into a constant table: name -> table size."""
    out: dict[str, int] = {}
    for name in g.input_names:
        for n in g.uses(name):
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name:
                table = g.const(n.input[0])
                if table is not None:
                    ax = 0
                    for a in n.attribute:
                        if a.name == "axis":
                            ax = a.i
                    out[name] = min(out.get(name, 1 << 30), int(table.shape[ax]))
    return out


# validation draws an integer input a Loop runs as its trip count from 1 to TRIP_COUNTS - 1: TorchScript's
# ``torch.stack`` of the steps of ``range(n)`` fails at n = 0, and n past x's length reads past its end
TRIP_COUNTS = 3


def _keeps_count(n) -> bool:
    return keeps_value(n) or n.op_type in SCALAR_RESHAPES


def trip_count_inputs(g: Graph) -> set[str]:
    """Graph inputs a Loop reads as its trip count, as they are or through value-keeping casts and reshapes."""
    sources = {value_source(g, n.input[0], _keeps_count) for n in g.nodes_of("Loop") if n.input and n.input[0]}
    return (sources & set(g.input_names)) - set(g.initializers)


def random_values(shape, np_t, rng: np.random.Generator, *, scale: float = 1.0, p_true: float = 0.7,
                  index_range: int = 3, lowest_index: int = 0) -> np.ndarray:
    """Random values of a dtype: normal floats times ``scale``; booleans true with ``p_true``; integers
    (indices) in ``[lowest_index, index_range)`` (at least one value)."""
    if np.issubdtype(np_t, np.floating):
        return (rng.standard_normal(shape) * scale).astype(np_t)
    if np_t == np.bool_:
        return rng.random(shape) < p_true
    return rng.integers(lowest_index, max(index_range, lowest_index + 1), size=shape).astype(np_t)


def valid_steps(kind: str, T: int, B: int, rng: np.random.Generator, *, realistic: bool = False) -> np.ndarray:
    """A ``[T, B]`` boolean pattern of valid steps: ``post`` (valid then padded), ``pre`` (padded then
    valid), ``gappy`` (any steps) or ``full``.

    Adversarial (validation): with two rows or more, row 0 is full and row 1 empty, other rows any length
    from 0 to T; gappy rows keep ~60% of their steps. Realistic (``realistic=True``, benchmarks): row 0 is
    full, other rows at least half full; gappy rows keep ~70%."""
    if kind not in MASK_KINDS and kind != "full":
        raise ValueError(f"unknown padding pattern {kind!r}")
    P = np.zeros((T, B), dtype=bool)
    if kind == "full":
        P[:] = True
        return P
    for b in range(B):
        if realistic:
            L = int(rng.integers(max(1, T // 2), T + 1)) if b else T
            if kind == "gappy":
                P[:, b] = ~(rng.random(T) < 0.3)
                continue
        elif kind == "gappy":
            P[:, b] = rng.random(T) < 0.6
            if b == 1:
                P[:, b] = False
            continue
        else:
            L = [T, 0][b] if b < 2 and B > 1 else int(rng.integers(0, T + 1))
        if kind == "post":
            P[:L, b] = True
        elif kind == "pre":
            P[T - L :, b] = True
    return P


# the size of a symbolic dimension that is neither the batch nor the time axis (by name or by position)
OTHER_DIM_SIZE = 3


def input_sizes(name: str, shape: list, dims: dict, batch: int, time: int) -> tuple[list[int], list[str | None]]:
    """The sizes a model input runs at, and each dimension's role ("batch", "time" or None: static, or
    another symbolic dimension). Validation and benchmarks both size inputs by this one rule.

    A static dimension keeps its size. A symbolic one is the batch or the time axis by its name
    (:func:`~rnnfuse.protos.dim_role`), else by its position among this input's symbolic dimensions: the first
    is the batch, the second the time axis -- except that in a rank-3 (or more) input whose first two
    dimensions have exactly one static one, the symbolic one takes the role of its own position (``[2, ?, F]``
    is a fixed batch with a free time axis, ``[?, 50, F]`` a free batch, batch-first, ``[?, F, ?]`` features
    first: batch, then time). Any further symbolic dimension is ``OTHER_DIM_SIZE``. ``dims`` (dimension name, or input and position for an unnamed one ->
    (size, role)) is shared by the inputs of one run, so one name is one size everywhere."""
    from .protos import dim_role

    concrete: list[int] = []
    roles: list[str | None] = []
    sym_pos = 0
    for d in shape:
        if isinstance(d, int) and d > 0:
            concrete.append(d)
            roles.append(None)
            continue
        key = d if isinstance(d, str) else f"{name}:{len(concrete)}"
        if key not in dims:
            role = dim_role(d)
            if role is None and sym_pos < 2:
                pos = sym_pos
                lead = [isinstance(x, int) and x > 0 for x in shape[:2]]
                if len(shape) >= 3 and lead.count(True) == 1 and len(concrete) < 2:
                    pos = len(concrete)
                role = ("batch", "time")[pos]
                if role in roles:  # ([?, F, ?], features first: the later one is the other role)
                    role = next((r for r in ("batch", "time") if r not in roles), None)
            dims[key] = (batch, "batch") if role == "batch" else (time, "time") if role == "time" else (OTHER_DIM_SIZE, None)
        sym_pos += 1
        concrete.append(dims[key][0])
        roles.append(dims[key][1])
    return concrete, roles
