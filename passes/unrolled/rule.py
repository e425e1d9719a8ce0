"""The pass: find families, thread chains, turn each chain into a recurrence; repeat while new chains
appear (a stack of layers: fusing one layer turns the next one's inputs into a family). When the slice
families give nothing more, chains whose steps read other state-independent inputs (:mod:`.step_inputs`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from rnnfuse.builder import Builder
from rnnfuse.cells.kinds import KINDS
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, Model
from rnnfuse.protos import CONTROL_FLOW
from rnnfuse.findings import Options, PassResult
from rnnfuse.rewrite import apply_recurrences, declined
from rnnfuse.signature import Signer
from rnnfuse.symbolic import weight_ops

from .chains import Chain, find_chains, intervals
from .derived_masks import derived_masks
from .families import SLICERS, bool_families, find_families, is_row_family, length_masks, mask_leaves, unproven_masks
from .whole_inputs import WholeInputs
from .family_filter import KnownRegions, layout_decline, may_hold_chains
from .outputs import LastStepUnused
from .recomputed import recompute_reads
from .roles import FirstStepDiffers, chain_recurrence
from .step_inputs import virtual_families


class FuseChains:
    """Rewrite unrolled per-step cell chains into native ops (repeats while new chains appear: stacks)."""

    name = "unrolled"
    max_rounds = 8
    max_virtual = 8  # chains of other step inputs tried per round

    @property
    def fuses_only_with(self) -> frozenset:
        return weight_ops()  # every cell multiplies its state by a weight matrix

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        tried: set = set()
        pending: dict = {}  # chain key -> its decline, reported only if the chain still exists at the end
        whole = WholeInputs(g)
        # what the last search found, while the graph is still the one it searched (nothing committed since):
        # the chains left to report are then those, and the report needs no second search of the whole graph
        last: tuple[set, list] | None = None
        not_sequences: set[str] = set()  # sources of slice families skipped for their layout, whose steps combine
        for _ in range(self.max_rounds):
            fams = find_families(g)
            # dead code (an exporter's unused per-step values) is no reader of a step's values; pruned only
            # where there are steps (a graph without families pays no liveness walk)
            if fams and g.prune():
                fams = find_families(g)
            if not fams:
                last = (set(), [])
                break
            signer = Signer(g)
            may_chain = _MayChain(g, fams)
            fams.update(whole.families(fams, signer, may_chain))
            not_sequences = may_chain.not_sequences  # (the last round's: what the graph holds at the end)
            order = g.ordered_live_nodes()
            search = _Search(fams, bool_families(g, fams), order, length_masks(g), signer, may_chain, {}, whole.labels)
            seen_now: set = set()
            recs, chained = self.slice_chains(g, search, tried, pending, seen_now)
            vfams = None
            if not recs:
                vfams = virtual_families(g, order, fams)
                recs = self.virtual_chains(g, order, vfams, signer, tried, pending, seen_now)
            pending = {k: v for k, v in pending.items() if k in seen_now}
            chain_keys = {k for k in seen_now if len(k) == 5}
            if not recs:
                last = (chain_keys, vfams)
                break
            # what the search held (intervals and signatures over the whole graph, the chains' steps) is not
            # needed to validate and commit: it goes before the rewrites' own memory comes
            order = signer = search = None
            n_before, modified_before = len(res.findings), res.modified
            mark = g.edit_mark()
            apply_recurrences(g, ctx, self.name, recs, res)
            if not any(f.status == "fused" for f in res.findings[n_before:]):
                if res.modified == modified_before:
                    last = (chain_keys, vfams)
                break
            if not _may_expose_chains(g, mark, chained):
                # the search of the rest waits for the pipeline's next round (the graph changed, so there is
                # one), which sees it after the clean-ups shrank it (a bidirectional layer's 14,000 per-step
                # reads, merged by step-maps); only declines, if any, ask which chains are left now
                last = None if pending else (set(), [])
                break
        # declines of "chains" that disappeared once real chains were fused (e.g. per-layer initial states
        # sliced from one tensor) were not recurrences: only what remains is reported
        final = self._remaining(g, whole, last)
        # (a chain of step inputs that declines for the reason its slice family's chain did is that chain)
        real = {v.reason for k, v in pending.items() if k in final and len(k) == 5}
        res.findings.extend(v for k, v in pending.items() if k in final and (len(k) == 5 or v.reason not in real))
        whole.drop_unused()
        not_sequences -= whole.time_major_sources()  # (searched over their time-major copies)
        if not_sequences:
            res.notes.append(f"{len(not_sequences)} tensor(s) sliced into steps that combine values are not [T, B, F] "
                             f"or [B, T, F] sequences (e.g. '{min(not_sequences)}'): no chain searched over them")
        return res

    def slice_chains(self, g: Graph, search: "_Search", tried: set, pending: dict, seen: set
                     ) -> tuple[list, set[str]]:
        """The recurrences of the chains over the slice families of ``search`` not ``tried`` before (each
        chain's key added to ``seen`` and ``tried``, its decline to ``pending``), and the sources of the chains."""
        recs, chained = [], set()
        for src, axis in search.fams:
            found = _family_chains(g, search, src, axis)
            if found is None:
                continue
            iv, chains, mask_srcs = found
            for chain in chains:
                key = chain.key(src, axis)
                seen.add(key)
                if key in tried:
                    continue
                tried.add(key)
                chained.add(src)
                named = f"'{src}' (axis {axis})"
                try:
                    rec = _recurrence(g, src, axis, chain, iv, search.signer, mask_srcs)
                    if src in search.labels:
                        rec.where = rec.where.replace(f"over {named}", f"over {search.labels[src]}")
                    recs.append((rec, {}))
                except Decline as d:
                    where = chain.describe(search.labels.get(src, named))
                    pending[key] = declined(self.name, "chain", where, d.reason + unproven_masks(g, search.fams, iv, search.memo))
        return recs, chained

    @staticmethod
    def _remaining(g: Graph, whole: WholeInputs, last: tuple[set, list | None] | None) -> set:
        """The keys of the chains the graph holds now: those of ``last`` (the last search, on this same graph:
        its chain keys, and its virtual families if it listed them), else found by searching again."""
        if last is not None:
            chain_keys, vfams = last
            if vfams is None:
                fams = find_families(g)
                fams.update(whole.families(fams, Signer(g), _MayChain(g, fams)))
                vfams = virtual_families(g, g.ordered_live_nodes(), fams) if fams else []
            return chain_keys | {("inputs", vf[0]) for vf in vfams}
        final = set()
        fams = find_families(g)
        signer = Signer(g)
        may_chain = _MayChain(g, fams)
        fams.update(whole.families(fams, signer, may_chain))
        order = g.ordered_live_nodes() if fams else []
        search = _Search(fams, bool_families(g, fams), order, length_masks(g) if fams else [], signer, may_chain, {},
                         whole.labels)
        for src, axis in fams:
            found = _family_chains(g, search, src, axis)
            final.update(chain.key(src, axis) for chain in (found[1] if found is not None else ()))
        if fams:
            final |= {("inputs", vf[0]) for vf in virtual_families(g, order, fams)}
        return final

    def virtual_chains(self, g: Graph, order: list, vfams: list, signer: Signer, tried: set, pending: dict, seen: set) -> list:
        """Recurrences of the chains whose steps read other state-independent inputs than the slices of one
        tensor in step order (``vfams``): their inputs stacked (``Concat`` of ``Unsqueeze``) are the sequence."""
        recs = []
        # (each family costs one intervals pass over the graph: the longest few are tried, so a graph full of
        # short pseudo-chains stays linear)
        for vf in sorted(vfams, key=len, reverse=True)[: self.max_virtual]:
            key = ("inputs", vf[0])
            seen.add(key)
            if key in tried:
                continue
            tried.add(key)
            t = _step_input_type(g, vf)
            if t is None:
                continue
            iv = intervals(g, order, {u: k for k, u in vf.items()})
            chains = [c for c in find_chains(g, vf, iv) if c.direction == "forward"]
            if not chains:
                continue
            added_before = len(g.nodes)
            b = Builder(g, g.producer.get(vf[len(vf) - 1]), "rnnfuse/step_inputs")
            src = b.op("Concat", *[b.unsqueeze(u, [0]) for _, u in sorted(vf.items())], axis=0)
            g.model.declare(src, (t[0], [len(vf)] + list(t[1])))
            made = g.nodes[added_before:]
            got = []
            for chain in chains:
                try:
                    rec = _recurrence(g, src, 0, chain, iv, signer, {})
                except Decline as d:
                    where = chain.describe(vf.describe())
                    pending[key] = declined(self.name, "chain", where, d.reason)
                    continue
                rec.where = rec.where.replace(f"over '{src}' (axis 0)", f"over {vf.describe()}")
                got.append((rec, {}))
            if not got:
                g.remove_nodes(made)
            recs.extend(got)
        return recs


class _MayChain:
    """Whether a family may hold a chain rnnfuse fuses (family_filter: its layout, and its steps combining
    values with something from outside their own regions), asked once a family a round: first without its
    masks (whether to build its whole-sequence input maps, see whole_inputs: a family that cannot chain
    gives maps that cannot either, their steps' regions being parts of its steps'), then with them (whether
    to walk its intervals). Without the masks more nodes combine, so a family that cannot chain without
    them cannot with them."""

    def __init__(self, g: Graph, fams: dict):
        self.g, self.fams = g, fams
        self.unmasked: dict[tuple, bool] = {}
        self.combining: dict[tuple, bool] = {}  # whether the family's steps combine values, its layout aside
        self.not_sequences: set[str] = set()  # sources of families declined for their layout, whose steps combine
        self.regions: dict[tuple, KnownRegions] = {}  # what the last call for a family that passed computed

    def __call__(self, key: tuple, mask_fam: dict | None = None) -> bool:
        found = self.unmasked.get(key)
        if found is None:
            src, axis = key
            fam = self.fams[key]
            regions: dict = {}
            found = self.unmasked[key] = self.combining[key] = may_hold_chains(self.g, fam, regions=regions)
            if found and layout_decline(self.g, src, axis) is not None:
                self.not_sequences.add(src)
                found = self.unmasked[key] = False
            if found:
                self.regions[key] = KnownRegions(self.g, None, regions)
        if not found or not mask_fam:
            return found
        regions = {}
        found = may_hold_chains(self.g, self.fams[key], mask_fam, regions)
        if found:
            self.regions[key] = KnownRegions(self.g, mask_fam, regions)
        else:
            self.regions.pop(key, None)  # (no search follows: the unmasked regions are not held to the round's end)
        return found

    def combines(self, key: tuple) -> bool:
        """Whether some step of the family combines its values with another's, whatever its layout (whether a
        family over another axis is worth a copy in a layout the native ops read)."""
        if key not in self.combining:
            self.combining[key] = may_hold_chains(self.g, self.fams[key])
        return self.combining[key]

    def known_regions(self, key: tuple, mask_fam: dict | None) -> KnownRegions | None:
        """The regions the last call for ``key`` computed, if the graph and the masks are still those (once)."""
        known = self.regions.pop(key, None)
        return known if known is not None and known.usable(self.g, mask_fam) else None


class _Search(NamedTuple):
    """What a round's search for chains holds for every family."""

    fams: dict  # (source, axis) -> {step: slice}
    bools: list  # families.bool_families of fams
    order: list  # the live nodes in graph order
    lengths: list  # families.length_masks
    signer: Signer
    may_chain: _MayChain
    memo: dict  # what a search works out once for all its families (see _computed_from)
    labels: dict  # a whole tensor rnnfuse built -> how a report names its sequence (WholeInputs.labels)


def _family_chains(g: Graph, search: _Search, src: str, axis: int):
    """``(intervals, chains, mask sources)`` of the slice family ``(src, axis)``, or None when it can hold no
    chain rnnfuse fuses: a bool family (masks, read by the chains over the data), a family of rows, or one
    :class:`_MayChain` rules out (slices of no ``[T, B, F]`` / ``[B, T, F]`` sequence, whose every chain would
    be declined for its layout; steps that combine their values with nothing that may come from another
    step). Only the others cost an intervals walk, which reads everything downstream."""
    if g.model.elem_type(src) == 9 or is_row_family(g, src) or not search.may_chain((src, axis)):
        return None
    fam = search.fams[(src, axis)]
    step_masks = search.lengths + derived_masks(g, search.fams, (src, axis), search.signer)
    leaves, mask_fam, mask_srcs = mask_leaves(g, search.fams, fam, step_masks, search.bools)
    if not search.may_chain((src, axis), mask_fam):
        return None
    iv = intervals(g, _computed_from(g, search, leaves), leaves)
    return iv, find_chains(g, fam, iv, mask_fam, search.may_chain.known_regions((src, axis), mask_fam)), mask_srcs


def _computed_from(g: Graph, search: _Search, leaves: dict) -> list:
    """The nodes of ``search.order`` computed from ``leaves``, in that order: the only nodes an intervals walk
    gives a span (every other has no input with one), found from the leaves' readers rather than by a walk of
    the whole graph per family (800 cells side by side, each over an input of its own, walked 90,000 nodes
    800 times: 76 s). The whole order when they are a big part of it."""
    order = search.order
    reached = g.downstream(list(leaves), limit=len(order) // 4)
    if reached is None:
        return order
    if "rank" not in search.memo:
        search.memo["rank"] = {id(n): i for i, n in enumerate(order)}
    rank = search.memo["rank"]
    return sorted((n for n in reached if id(n) in rank), key=lambda n: rank[id(n)])


def _may_expose_chains(g: Graph, mark: tuple, sources: set[str]) -> bool:
    """Whether the round that fused chains from ``sources`` (its edits since ``mark``) may have made chains
    the next round would find. A fusion does by what it adds and by what it removes:

    - a stacked layer's cells read the fused layer's per-step outputs, now the steps of a new family: asked as
      whether a matmul (or a node holding subgraphs) reads, directly or not, what an emitted native op
      computes (emitted native ops downstream, a stack fused at once, are no such cell);
    - a family holds one value a step, the first slice met: where a step was sliced twice (no dedupe run
      before), the other slices' chain is found once the first chain's are gone, as another slicer of a
      source that remains once the dead nodes are dropped.

    Otherwise the next round could only find what this one did not, once the rest of the graph changed: left
    to the pipeline's next round."""
    edited = g.edited_since(mark)
    if edited is None:
        return True
    g.prune()  # (the graph's next finalize or round would: it does not do it twice)
    if any(r.op_type in SLICERS for src in sources for r in g.uses(src)):
        return True
    made = [o for n in edited if n.op_type in KINDS and g.alive(n) for o in n.output if o]
    return g.feeds_op(made, weight_ops() | CONTROL_FLOW)


def _step_input_type(g: Graph, vf) -> tuple[int, list] | None:
    """The type of the step inputs of ``vf``, every one ``[B, F]`` with one F, or None when they are of other
    ranks or of two known widths. A width inference could not tell (a ``Tile`` by the batch, read from a
    shape, in one step) leaves the stack's F unknown: the fused op's validation runs the stack."""
    by_step = {k: g.model.known_type(u) for k, u in vf.items()}
    t = by_step.get(0)
    types = list(by_step.values())
    if any(tu is None or tu[1] is None or len(tu[1]) != 2 for tu in [t, *types]):
        return None
    widths = {tu[1][1] for tu in types}
    if len(widths) == 1:
        return t[0], list(t[1])
    if len({w for w in widths if isinstance(w, int)}) > 1:
        return None
    return t[0], [t[1][0], None]


def _recurrence(g: Graph, src: str, axis: int, chain: Chain, iv, signer: Signer, mask_srcs: dict):
    """The chain's recurrence, tried again as each decline allows, once each: a chain whose first step is another
    cell (or starts from another state) from its second step on, the first kept as it is (its h the initial
    state); one whose last step computes no state anyone reads (only a head of its own) up to the step before,
    the last kept as it is (reading the op's final h); one whose inner values are read outside with those that
    only rearrange a step's leaves recomputed there (:mod:`.recomputed`). The decline reported is the last one
    before the recomputation, which is undone if the chain still declines."""
    made: list = []  # the last recognition tried (its findings: what may be recomputed)
    tried: set[str] = set()
    undo, reported = None, None
    while True:
        try:
            return chain_recurrence(g, src, axis, chain, iv, signer, mask_srcs, made)
        except Decline as d:
            reported = reported if undo is not None else d
            end = "first" if isinstance(d, FirstStepDiffers) else "last" if isinstance(d, LastStepUnused) else None
            if end is not None and end not in tried and len(chain.steps) >= 3:
                tried.add(end)
                chain = replace(chain, steps=chain.steps[1:] if end == "first" else chain.steps[:-1])
                continue
            if "recompute" not in tried and made:
                tried.add("recompute")
                undo = recompute_reads(g, made[-1])
                if undo is not None:
                    continue
            if undo is not None:
                undo()
            raise reported from None
