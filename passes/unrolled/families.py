"""Step-slice families: a tensor sliced at constant indices along one axis (``Gather(S, t)``,
``Squeeze(Slice(S, t, t+1))``, ``Squeeze(Split(S)[t])``) gives the per-step inputs of an unrolled chain; bool
families sliced at the same steps are its candidate masks, and so are hand-written length masks
(``lengths > t`` per step, :class:`LengthMask`) and masks computed from the step input
(:mod:`.derived_masks`), both :class:`StepMask`.
"""

from __future__ import annotations

import functools

import numpy as np
from onnx import NodeProto

from rnnfuse import op_args
from rnnfuse.builder import Builder
from rnnfuse.dataflow import descendants, runtime_values, settled_rank, shape_derived
from rnnfuse.dims import static_dim, takes_whole_axis
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.mask_proof import step_masks_differ
from rnnfuse.row_wise import FLOATS

from .state_roots import unit_groups


SLICERS = ("Gather", "Slice", "Split")  # the ops that take a step of a sequence
STEP_SOURCE_MIN_STEPS = 8  # slices of a family whose steps' values are no sequences themselves (step_sources)

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
        starts, ends, axes, steps = op_args.slice_args_of(g, node)
        if ends is None and starts and axes and steps:
            ends = op_args.inferred_slice_ends(g, node, starts, axes)
        if not starts or not ends or not axes or not steps or len(starts) != len(axes) or set(steps) != {1}:
            return None
        # one axis sliced to one step; any other taken whole (jax's static slices name every axis)
        cut = [0] if len(axes) == 1 else [k for k in range(len(axes)) if not takes_whole_axis(g, src, axes[k],
                                                                                               starts[k], ends[k])]
        if len(cut) != 1:
            return None
        ax, t, e = axes[cut[0]], starts[cut[0]], ends[cut[0]]
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

def _squeezed(g: Graph, name: str, axis: int, unit=None) -> str | None:
    """The single consumer of ``name`` that drops ``axis``: a Squeeze (which fails when run on a longer
    piece), or where the piece is known to hold one element along ``axis`` (``unit()``, asked only then: it
    may need a type), a Gather of its element 0 there (``p[:, 0]`` of each piece of ``x.chunk(T, 1)``), also
    after a Transpose that keeps the other axes in order (jax2onnx's ``p[:, 0]``: ``Gather(Transpose(p,
    [1, 0, 2]), 0)``); if any."""
    users = g.uses(name)
    if len(users) != 1:
        return None
    u = users[0]
    if u.op_type not in ("Gather", "Transpose"):
        unit = None
    elif unit is None or not unit():
        return None
    perm = list(attr(u, "perm") or []) if u.op_type == "Transpose" else []
    rest = [a for a in perm if a != axis]
    if axis in perm and rest == sorted(rest) and len(g.uses(u.output[0])) == 1:
        name, axis = u.output[0], perm.index(axis)  # (the axis moved, the others as they were: the same rows)
        u = g.uses(name)[0]
    if unit is not None and u.op_type == "Gather" and len(u.input) == 2:
        idx, at = g.const(u.input[1]), attr(u, "axis", 0)
        if at < 0:
            at += g.model.rank(name) or 0  # (unknown rank: a negative axis, no match)
        return u.output[0] if at == axis and idx is not None and np.asarray(idx).shape == () and int(idx) in (0, -1) else None
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

_BOOL = 9


def mask_source(g: Graph, src: str) -> str | None:
    """The bool tensor whose 0/1 values a step-sliced family holds: itself (bool), or the bool a Cast to a float
    type and an Unsqueeze of a trailing axis made it from (torch's ``(t < lengths).float().unsqueeze(-1)``)."""
    if g.model.elem_type(src) == _BOOL:
        return src
    p = g.producer.get(src)
    if p is None:
        return None
    if p.op_type == "Cast" and attr(p, "to") in FLOATS and g.model.elem_type(p.input[0]) == _BOOL:
        return p.input[0]
    if p.op_type == "Unsqueeze":
        rank = g.model.rank(p.input[0])
        axes = op_args.axes(p, g.model.opset, op_args.const_reader(g, p))
        if rank is not None and axes in ([rank], [-1]):
            return mask_source(g, p.input[0])
    return None


def find_families(g: Graph) -> dict[tuple[str, int], dict[int, str]]:
    """(source, axis) -> {step: the step's slice} of every family that may be the steps of a sequence: data,
    a mask, a row family. A cell's gates viewed as ``[B, G, W]`` and sliced per gate are values of a step (see
    :func:`step_sources`): left out before their types are asked, which costs an inference each (two a step)."""
    fams = _slice_families(g)
    views = [key for key in fams if unit_groups(g, key[0])]
    if views:
        typed_long = {key: v for key, v in fams.items() if len(v) >= STEP_SOURCE_MIN_STEPS and _may_be_steps(g, key, v)}
        gone = step_sources(g, {**typed_long, **{key: fams[key] for key in views}}, views)
        fams = {key: v for key, v in fams.items() if key not in gone}
    return {key: v for key, v in fams.items() if _may_be_steps(g, key, v)}


def _may_be_steps(g: Graph, key: tuple[str, int], fam: dict[int, str]) -> bool:
    """Whether a family's source may be a sequence by its type: data is [T, B, F] (or batch-first); a mask
    [T, B, 1] or [T, B] (bool families are masks); any other [T, B] or [B, T] tensor holds one value a row per
    step, what a step may compute its mask from (a float or integer mask input compared with 0: see
    is_row_family)."""
    src = key[0]
    if len(fam) < 2:
        return False
    if settled_rank(g, src) not in (None, 2, 3):
        return False  # (no inference asked: a transformer's 600 q, k, v unbinds of a rank-4 tensor)
    et, rank = g.model.elem_type(src), g.model.rank(src)
    if rank != 2 and et is not None and et not in FLOATS + (_BOOL,):
        return False
    return rank is None or rank in (2, 3)


def _slice_families(g: Graph) -> dict[tuple[str, int], dict[int, str]]:
    """(source, axis) -> {index: slice} of every tensor sliced at constant indices along one axis."""
    fams: dict[tuple[str, int], dict[int, str]] = {}
    slicers = g.nodes_of(*SLICERS)
    runtime = runtime_values(g) if slicers else frozenset()  # (a slice of a runtime value needs no walk back)
    for n in slicers:
        if n.input[0] not in runtime and shape_derived(g, n.input[0]):
            # a constant or a shape (Keras' ``Cast(Shape(x))[0]``): no sequence, asked without folding (a fold
            # of a shape infers its tensor's type: 1,200 cones a transformer, a whole Keras layer's here)
            continue
        if n.op_type == "Split":
            ax = attr(n, "axis", 0)
            if ax < 0:
                rank = g.model.rank(n.input[0])
                if rank is None:
                    continue
                ax += rank
            # whether its parts hold one step each: asked once, and only for a part a Gather reads (a static
            # length may need a type: asked of every unbind's Split, it inferred 3,000 blocks' cones)
            unit = functools.cache(lambda n=n, ax=ax: _unit_parts(g, n, ax))
            for t, o in enumerate(n.output):
                x = _squeezed(g, o, ax, unit)
                if x is None and ax == 1 and weighed(g, o) and g.model.rank(n.input[0]) == 2 and unit():
                    x = o  # x.split(1, 1) of a [B, T] x: the step's [B, 1] column as it is (as x[:, t:t+1] below)
                if x is not None:
                    fams.setdefault((n.input[0], ax), {})[t] = x
            continue
        ai = _axis_index(g, n)
        if ai is None:
            continue
        src, ax, t = ai
        x = n.output[0]
        if n.op_type == "Slice":
            x = _squeezed(g, x, ax, unit=lambda: True)  # (one element: [t, t + 1))
            if x is None and ax == 1 and g.model.rank(src) == 2:
                x = n.output[0]  # mask[:, t:t+1] of a [B, T] mask: the step's [B, 1] mask (or its source) as it is
            if x is None:
                continue
        fam = fams.setdefault((src, ax), {})
        if t in fam:
            continue  # the same slice taken twice: keep the first (dedupe makes them one)
        fam[t] = x
    return fams


def weighed(g: Graph, name: str) -> bool:
    """Whether ``name`` is multiplied by weights (or concatenated for that): asked before a Split's part is
    typed (every LSTMCell step splits its gates on axis 1: 24,000 rank queries in a 6,000-step chain)."""
    return any(u.op_type in ("MatMul", "Gemm", "Concat") for u in g.uses(name))


def _unit_parts(g: Graph, split: NodeProto, axis: int) -> bool:
    """Whether every part of ``split`` is known to hold one element along ``axis``: its ``split`` sizes are
    all 1, or none are given and the axis is as long as there are parts."""
    if len(split.input) > 1 and split.input[1]:
        sizes = g.const(split.input[1])
        return sizes is not None and bool(np.all(np.asarray(sizes) == 1))
    return static_dim(g, split.input[0], axis) == len(split.output)


def is_row_family(g: Graph, src: str) -> bool:
    """Whether the family of ``src``'s slices holds one value a row per step that is no mask itself (a float
    or integer ``[B, T]`` tensor): no data of a chain, but a step may compute its mask from it."""
    return g.model.rank(src) == 2 and mask_source(g, src) is None

def step_sources(g: Graph, fams: dict, keys: list, min_steps: int = STEP_SOURCE_MIN_STEPS) -> set[tuple[str, int]]:
    """Of the families ``keys``, those whose source is a value of the steps of a long family (``min_steps``
    slices or more): computed from its slices, but not from both its first and its last one (a sequence is
    computed from none, as the input, or from every step, as a layer's stacked output). A cell's gates viewed as
    ``[B, G, W]`` (``gates.view(B, 4, H)``) and sliced per gate look like a family of G steps; trying each such
    "chain" (one or two per step) searched the whole graph: quadratic in the steps. (Per long family, only when
    there are ``keys``: a walk from its first slice, one from its last, and from the others only what the
    first's did not reach.)"""
    out: set[tuple[str, int]] = set()
    for fam in [fam for fam in fams.values() if len(fam) >= min_steps] if keys else ():
        first, last = descendants(g, [fam[min(fam)]]), descendants(g, [fam[max(fam)]])
        any_step = descendants(g, fam.values(), known=first)  # (a chain's later steps are the first's descendants)
        out.update(key for key in keys
                   if fams[key] is not fam and key[0] in any_step and not (key[0] in first and key[0] in last))
    return out


def unproven_masks(g: Graph, fams: dict, iv, memo: dict) -> str:
    """A note for a declined chain whose steps read a float ``[B, T]`` tensor one column a step, as a mask is
    read (``h = m * new + (1 - m) * h``): nothing proves its values 0 or 1, so it is no mask and the chain reads
    it as a carried value. What is read as one: a bool, or a comparison cast to float. "" when none is read.
    ``memo``: the search's, which keeps those tensors' families (found once, whatever the declines)."""
    if "float_rows" not in memo:
        memo["float_rows"] = [(src, fam) for (src, _), fam in fams.items()
                              if g.model.elem_type(src) in FLOATS and is_row_family(g, src)]
    for src, fam in memo["float_rows"]:
        if any(iv.nodes.get(id(u)) is not None for v in fam.values() for u in g.uses(v)):
            return (f"; the steps read '{src}' one column a step, a float tensor not known to hold only 0 and 1: "
                    "no mask (a bool mask, or a comparison cast to float, is read as one)")
    return ""


def bool_families(g: Graph, fams: dict) -> list[tuple[tuple[str, int], dict]]:
    """``((mask source, axis), family)`` of the families of ``fams`` that slice a bool tensor (or its float
    cast): the candidate masks of every data family, listed once for all of them (per data family, it was
    a type query per family: quadratic in a graph of 1,500 families)."""
    out = []
    for (msrc, maxis), mf in fams.items():
        m = mask_source(g, msrc)
        if m is not None:
            out.append(((m, maxis), mf))
    return out


def mask_leaves(g: Graph, fams: dict, fam: dict, step_masks: list | None = None,
                bools: list | None = None) -> tuple[dict, dict, dict]:
    """Interval leaves for a data family and the bool families sliced at the same steps (candidate masks):
    (tensor -> step, step -> {mask slice -> symbol}, symbol -> (mask source, axis)). A :class:`StepMask`'s
    source is itself (built only for a chain that is fused), its "axis" the offset of its steps. ``bools``:
    :func:`bool_families` of ``fams``, if the caller has it."""
    leaves = {x: t for t, x in fam.items()}
    mask_fam: dict[int, dict] = {}
    mask_srcs: dict[str, tuple] = {}
    # (not the data family itself: an input cast from bool, a one-hot say, is data that happens to be 0/1)
    bool_fams = [(key, mf) for key, mf in (bool_families(g, fams) if bools is None else bools) if mf != fam]
    for sm in step_masks or ():
        got = sm.slices(set(fam), g, fam)
        if got is not None:
            bool_fams.append(((sm, got[0]), got[1]))  # (a step mask's "axis" is its index offset)
    for (msrc, maxis), mf in bool_fams:
        if set(mf) != set(fam):
            continue
        sym = f"m{len(mask_srcs)}"
        mask_srcs[sym] = (msrc, maxis)
        for t, m in mf.items():
            leaves[m] = t
            mask_fam.setdefault(t, {})[m] = sym
    return leaves, mask_fam, mask_srcs


# per-step comparisons of a lengths tensor with the step index (``t < L`` is traced as ``Greater(L, t)``, ``t + 1
# <= L`` as ``LessOrEqual(t + 1, L)``): any of them, either way round, with any constant offset of the step is
# one bool per step, the slice at that step of ``op(L, arange(T) + offset)``; what it means to the state
# (which select branch is kept) is the step analysis' business, as for any mask.
_LENGTH_COMPARE = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual")


class StepMask:
    """Per-step masks the graph computes step by step from values that are not per-step slices (lengths, the
    step's input), which rnnfuse can compute for all steps at once: a candidate mask of a chain like a bool
    family (:func:`mask_leaves`)."""

    def slices(self, steps: set, g: Graph | None = None, data: dict | None = None) -> tuple[object, dict] | None:
        """``(offset, step -> mask)`` when these masks are those of ``steps`` shifted by one offset, else None
        (``data``: the chain's data slice of each step, where the steps' order is to be read from the graph)."""
        raise NotImplementedError

    def source(self, g: Graph, axis: int, length: int, off: int, anchor: NodeProto | None) -> str:
        """The whole mask laid out like the data (time along ``axis``), built for a chain being fused; every
        step's mask becomes its slice of it."""
        raise NotImplementedError

    # the tensor the steps' masks are computed from, and its time axis (None: lengths, not sliced per step)
    proof_source: tuple[str, int | None]

    def read_steps(self, g: Graph, b, mask: str, axis: int, length: int, computed: dict[int, NodeProto]) -> None:
        """Each step's mask node ``computed[t]`` becomes ``Gather(mask, t, axis)``, in place (the same output,
        its readers as they were), once ``mask`` (``length`` steps) is shown to hold what each computed
        (rnnfuse.mask_proof: validation compares the steps given the mask, never the masks themselves)."""
        source, source_axis = self.proof_source
        why = step_masks_differ(g, mask, axis, {t: n.output[0] for t, n in computed.items()}, source, length,
                                source_axis)
        if why is not None:
            raise Decline(why)
        g.rewrite_many_in_place((n, "Gather", [mask, b.const(np.array(t, np.int64), "t")], {"axis": axis})
                                for t, n in computed.items())


class LengthMask(StepMask):
    """Per-step masks written as comparisons of one runtime tensor ``L`` (``[B]`` or ``[B, 1]``, the lengths)
    with a constant step index: ``m_t = op(L, t + offset)`` (or ``op(t + offset, L)``). They are the slices of
    ``M = op(L, arange(T) + offset)`` laid out like the data; :meth:`source` builds ``M`` for a chain being
    fused and makes every comparison read its slice of ``M`` (the same values), so that what validation
    overrides (``M``) is what the original steps read too."""

    def __init__(self, lengths: str, op: str, pos: int, dtype, nodes: dict):
        self.lengths, self.op, self.pos, self.dtype = lengths, op, pos, dtype
        self.nodes = nodes  # constant step index -> the comparison node
        self.built: tuple | None = None  # (axis, length, offset, source) once built
        self.proof_source = (lengths, None)

    def __repr__(self) -> str:
        return f"{self.op}({self.lengths}, t)"

    def slices(self, steps: set, g: Graph | None = None, data: dict | None = None) -> tuple[tuple, dict] | None:
        """``((offset, sign), step -> mask slice)`` when the comparisons' indices are ``offset + sign * t`` over
        ``steps``: rising (``t < L``) or falling (a pre-padded ``L >= T - t``). Where both fit (consecutive
        indices), falling only when both ends say so: the lowest constant's mask is combined with values computed
        from the last step's data slice (``data``: step -> slice) first, the highest constant's with the first's."""
        if not steps:
            return None
        t0 = min(steps)
        fits = [(off, sign) for off, sign in ((min(self.nodes) - t0, 1), (max(self.nodes) + t0, -1))
                if {sign * (c - off) for c in self.nodes} == set(steps)]
        if not fits:
            return None
        if len(fits) == 2 and g is not None and data is not None:  # (both ends' steps must say "falling")
            step_of = {x: t for t, x in data.items()}
            low, high = (_nearest_step(g, self.nodes[c].output[0], step_of) for c in (min(self.nodes), max(self.nodes)))
            fits = fits[1:] if (low, high) == (max(steps), t0) != (t0, max(steps)) else fits
        off, sign = fits[0]
        return (off, sign), {sign * (c - off): n.output[0] for c, n in self.nodes.items()}

    def source(self, g: Graph, axis: int, length: int, off: tuple, anchor: NodeProto | None) -> str:
        """``M`` over steps ``0..length-1`` along ``axis`` (the data's time axis), ``off``: the indices'
        ``(offset, sign)``; the comparisons of those steps become ``Gather(M, t, axis)``."""
        if self.built is not None:
            if self.built[:3] != (axis, length, off):
                raise Decline("a length mask read by chains laid out differently")
            return self.built[3]

        b = Builder(g, anchor, "rnnfuse/length_mask")
        rank = (g.model.rank(self.lengths) or 1) + 1
        shape = [1] * rank
        shape[axis] = length
        offset, sign = off
        steps = b.const((offset + sign * np.arange(length)).astype(self.dtype).reshape(shape), "steps")
        lengths = b.unsqueeze(self.lengths, [axis])
        mask = b.op(self.op, *((lengths, steps) if self.pos == 0 else (steps, lengths)))
        dims: list = [None] * (rank - 1)
        if rank == 3:
            dims[-1] = 1
        dims.insert(axis, length)
        g.model.declare(mask, (9, dims))
        self.read_steps(g, b, mask, axis, length,
                        {sign * (c - offset): n for c, n in self.nodes.items() if 0 <= sign * (c - offset) < length})
        self.built = (axis, length, off, mask)
        return mask


def length_masks(g: Graph) -> list[LengthMask]:
    """The hand-written length masks of the graph: for each lengths tensor (a runtime ``[B]`` or ``[B, 1]``
    value), comparison and side, the comparisons with at least two distinct integer constants."""
    runtime = runtime_values(g)
    groups: dict[tuple, dict[int, NodeProto]] = {}
    dtypes: dict[tuple, np.dtype] = {}
    for n in g.nodes_of(*_LENGTH_COMPARE):
        if len(n.input) != 2:
            continue
        for pos in (0, 1):
            L, c = n.input[pos], n.input[1 - pos]
            cv = g.const(c)
            if cv is not None and L in runtime:
                break
        else:
            continue
        cv = np.asarray(cv)
        rank = g.model.rank(L)
        if cv.size != 1 or rank not in (1, 2) or (rank == 2 and static_dim(g, L, 1) != 1) or cv.ndim > rank:
            continue
        v = float(cv.ravel()[0])
        if v != int(v):
            continue
        key = (L, n.op_type, pos)
        grp = groups.setdefault(key, {})
        if int(v) in grp:
            continue  # the same comparison twice (dedupe makes them one)
        grp[int(v)] = n
        dtypes[key] = cv.dtype
    return [LengthMask(L, op, pos, dtypes[(L, op, pos)], nodes)
            for (L, op, pos), nodes in groups.items() if len(nodes) >= 2]


def _nearest_step(g: Graph, mask: str, step_of: dict, budget: int = 2048) -> int | None:
    """The step whose data slice the values ``mask`` is combined with (by the nodes reading it, or what is
    computed from it alone: an Unsqueeze, a Cast, ``1 - m``) are computed from first, going back op by op: a
    step's select reads that step's cell, the step before's only through it. None where none is found within
    ``budget`` nodes."""
    alone, frontier, others = {mask}, [mask], []
    for _ in range(4):
        nxt = []
        for v in frontier:
            for n in g.uses(v):
                rest = [i for i in n.input if i and i not in alone and g.const(i) is None]
                if rest:
                    others += rest
                elif not alone.issuperset(n.output):
                    alone.update(n.output)
                    nxt.extend(n.output)
        frontier = nxt
    seen: set[int] = set()
    level = others
    while level and len(seen) < budget:
        nxt = []
        for v in level:
            if v in step_of:
                return step_of[v]
            p = g.producer.get(v)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                nxt.extend(i for i in p.input if i and i not in alone)
        level = nxt
    return None
