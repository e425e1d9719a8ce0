"""Step-slice families: a tensor sliced at constant indices along one axis (``Gather(S, t)``,
``Squeeze(Slice(S, t, t+1))``, ``Squeeze(Split(S)[t])``) gives the per-step inputs of an unrolled chain; bool
families sliced at the same steps are its candidate masks.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args
from rnnfuse.dims import static_dim
from rnnfuse.graph import Graph, attr


_SLICERS = ("Gather", "Slice", "Split")

def _axis_index(g: Graph, node: NodeProto) -> tuple[str, int, int] | None:
    """(source, axis, index) if ``node`` takes one slice at a constant index (rank kept or reduced)."""
    src = node.input[0]
    if node.op_type == "Gather":
        idx = g.const(node.input[1])
        if idx is None or np.asarray(idx).ndim != 0:
            return None
        ax = attr(node, "axis", 0)
        t = int(idx)
    elif node.op_type == "Slice":
        starts, ends, axes, steps = op_args.slice_args(node, g.model.opset, op_args.const_reader(g, node))
        if not starts or not ends or len(starts) != 1 or not axes or steps != [1]:
            return None
        ax, t, e = axes[0], starts[0], ends[0]
        if e != t + 1 and not (t == -1 and e >= 2**31 - 1):
            return None
    else:
        return None
    if ax < 0:
        rank = g.model.rank(src)
        if rank is None:
            return None
        ax += rank
    if t < 0:
        d = static_dim(g, src, ax)
        if d is None:
            return None
        t += d
    return src, ax, t

def _squeezed(g: Graph, name: str, axis: int) -> str | None:
    """The single consumer of ``name`` that drops ``axis`` (Squeeze/Reshape), if any."""
    users = g.uses(name)
    if len(users) != 1:
        return None
    u = users[0]
    if u.op_type == "Squeeze":
        axes = op_args.axes(u, g.model.opset, op_args.const_reader(g, u))
        if axes is not None and any(a < 0 for a in axes):
            rank = g.model.rank(name)
            if rank is None:
                return None
            axes = [a + rank if a < 0 else a for a in axes]
        if axes == [axis]:
            return u.output[0]
    return None

def find_families(g: Graph) -> dict[tuple[str, int], dict[int, str]]:
    fams: dict[tuple[str, int], dict[int, str]] = {}
    for n in g.nodes_of(*_SLICERS):
        if g.const(n.input[0]) is not None:
            continue
        if n.op_type == "Split":
            ax = attr(n, "axis", 0)
            if ax < 0:
                rank = g.model.rank(n.input[0])
                if rank is None:
                    continue
                ax += rank
            for t, o in enumerate(n.output):
                x = _squeezed(g, o, ax)
                if x is not None:
                    fams.setdefault((n.input[0], ax), {})[t] = x
            continue
        ai = _axis_index(g, n)
        if ai is None:
            continue
        src, ax, t = ai
        x = n.output[0]
        if n.op_type == "Slice":
            x = _squeezed(g, x, ax)
            if x is None:
                continue
        fam = fams.setdefault((src, ax), {})
        if t in fam:
            continue  # the same slice taken twice: keep the first (dedupe makes them one)
        fam[t] = x
    floats = (1, 10, 11, 16)  # float, float16, double, bfloat16 (bool families are masks)
    out = {}
    for (src, ax), v in fams.items():
        et, rank = g.model.elem_type(src), g.model.rank(src)
        if len(v) < 2 or (et is not None and et not in floats + (9,)):
            continue
        if rank is not None and rank != 3 and not (et == 9 and rank == 2):
            continue  # data is [T, B, F] (or batch-first); a mask [T, B, 1] or [T, B]
        out[(src, ax)] = v
    return out

def mask_leaves(g: Graph, fams: dict, fam: dict) -> tuple[dict, dict, dict]:
    """Interval leaves for a data family and the bool families sliced at the same steps (candidate masks):
    (tensor -> step, step -> {mask slice -> symbol}, symbol -> (mask source, axis))."""
    leaves = {x: t for t, x in fam.items()}
    mask_fam: dict[int, dict] = {}
    mask_srcs: dict[str, tuple] = {}
    for (msrc, maxis), mf in fams.items():
        if g.model.elem_type(msrc) != 9 or set(mf) != set(fam):
            continue
        sym = f"m{len(mask_srcs)}"
        mask_srcs[sym] = (msrc, maxis)
        for t, m in mf.items():
            leaves[m] = t
            mask_fam.setdefault(t, {})[m] = sym
    return leaves, mask_fam, mask_srcs
