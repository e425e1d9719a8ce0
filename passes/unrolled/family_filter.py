"""Which step-sliced families are worth searching for chains: tests that read a family's steps alone.

Threading a family's chains gives every node the span of steps it depends on (``chains.intervals``), a walk
of everything downstream of the family. A graph of many families that hold no chain paid that walk per
family: quadratic. A family is searched only if its source is a sequence a native op reads
(:func:`layout_decline`) and its steps combine their values with something that may come from another step
(:func:`may_hold_chains`).
"""

from __future__ import annotations

from rnnfuse.dataflow import closure, given_constants, runtime_values, settled_rank
from rnnfuse.graph import Graph

from .chains import may_read_older, x_region


def layout_decline(g: Graph, src: str, axis: int) -> str | None:
    """Why no chain over slices of ``src`` along ``axis`` is fused, whatever its steps hold: the native ops
    read a ``[T, B, F]`` (or, transposed, ``[B, T, F]``) sequence. None: the layout fits."""
    rank = g.model.rank(src)
    if rank is None:  # (a cone too big to infer as a filter, a stacked layer's input: what its op says)
        rank = settled_rank(g, src)
    if rank != 3 or axis not in (0, 1):
        return f"the per-step inputs are slices of a rank-{rank} tensor along axis {axis}"
    return None


def may_hold_chains(g: Graph, fam: dict[int, str], mask_fam: dict[int, dict] | None = None,
                    regions: dict | None = None) -> bool:
    """Whether some step of the family combines its x-local values with a value that may come from another
    step: what chains.find_chains looks for first (its older-step reads), asked of the steps' x-local regions
    alone (each bounded by its combining nodes), with no intervals. No chain is missed: the regions are taken
    with every given constant (find_chains keeps a subset of them), so a node its regions hold as local is
    here local too, or combining itself, reading a given constant, which counts; the inputs skipped are those
    find_chains skips whatever the intervals say (constants, shapes, the step's own values and masks, a
    Concat stacking several other steps' values). ``regions``: filled with each step's ``(mask-only values,
    x-local region, combining nodes)``, taken with :func:`rnnfuse.dataflow.given_constants` (the search may
    use them when its own given constants are those: see :class:`KnownRegions`)."""
    mask_fam = mask_fam or {}
    given = given_constants(g)
    runtime = runtime_values(g)
    xs = set(fam.values())
    regions = {} if regions is None else regions
    for t, x in fam.items():
        mask_local = closure(g, mask_fam[t], 64)[0] if t in mask_fam else set()
        regions[t] = (mask_local, *x_region(g, x, mask_local, given))
    local_step = {v: t for t, (_, local, _) in regions.items() for v in local}
    for t, (mask_local, local, combining) in regions.items():
        mask_t = mask_fam.get(t, {})
        for c in combining:
            if c.op_type == "Concat" and len({local_step[i] for i in c.input if i in local_step} - {t}) > 1:
                continue  # (it stacks several other steps' values: as chains.find_chains skips it)
            if any(may_read_older(g, i, (local, mask_local, xs, mask_t), runtime, given) for i in c.input):
                return True
    return False


class KnownRegions:
    """The steps' regions the pre-check computed for a family, handed to the chain search (which computes
    the same ones: 16 walks over the steps of 1,041 cells side by side), valid while the graph is as it was
    (its edit mark) and for the same masks; the search takes them when its given constants are the
    pre-check's."""

    def __init__(self, g: Graph, mask_fam: dict | None, regions: dict):
        self.mark, self.mask_fam, self.given, self.regions = g.edit_mark(), mask_fam or {}, given_constants(g), regions

    def usable(self, g: Graph, mask_fam: dict | None) -> bool:
        return self.mark == g.edit_mark() and self.mask_fam == (mask_fam or {})
