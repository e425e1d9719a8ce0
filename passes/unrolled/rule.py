"""The pass: find families, thread chains, turn each chain into a recurrence; repeat while new chains
appear (a stack of layers: fusing one layer turns the next one's inputs into a family).
"""

from __future__ import annotations

from rnnfuse.errors import Decline
from rnnfuse.graph import Model
from rnnfuse.findings import Options, PassResult
from rnnfuse.rewrite import apply_recurrences, declined
from rnnfuse.signature import Signer

from .chains import find_chains, intervals
from .families import find_families, length_masks, mask_leaves
from .roles import chain_recurrence


class FuseChains:
    """Rewrite unrolled per-step cell chains into native ops (repeats while new chains appear: stacks)."""

    name = "unrolled"
    max_rounds = 8

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        tried: set = set()
        pending: dict = {}  # chain key -> its decline, reported only if the chain still exists at the end
        for _ in range(self.max_rounds):
            fams = find_families(g)
            # dead code (an exporter's unused per-step values) is no reader of a step's values; pruned only
            # where there are steps (a graph without families pays no liveness walk)
            if fams and g.prune():
                fams = find_families(g)
            if not fams:
                break
            order = g.ordered_live_nodes()
            lengths = length_masks(g)
            signer = Signer(g)
            recs = []
            seen_now: set = set()
            for (src, axis), fam in fams.items():
                if g.model.elem_type(src) == 9:
                    continue  # bool families are masks, read by the chains over the data
                leaves, mask_fam, mask_srcs = mask_leaves(g, fams, fam, lengths)
                iv = intervals(g, order, leaves)
                for chain in find_chains(g, fam, iv, mask_fam):
                    key = (src, axis, chain.direction, chain.steps[0].t)
                    seen_now.add(key)
                    if key in tried:
                        continue
                    tried.add(key)
                    try:
                        recs.append((chain_recurrence(g, src, axis, chain, iv, signer, mask_srcs), {}))
                    except Decline as d:
                        where = f"{chain.direction} chain over '{src}' (axis {axis})"
                        pending[key] = declined(self.name, "chain", where, d.reason)
            pending = {k: v for k, v in pending.items() if k in seen_now}
            if not recs:
                break
            n_before = len(res.findings)
            apply_recurrences(g, ctx, self.name, recs, res)
            if not any(f.status == "fused" for f in res.findings[n_before:]):
                break
        # declines of "chains" that disappeared once real chains were fused (e.g. per-layer initial states
        # sliced from one tensor) were not recurrences: only what remains is reported
        final = set()
        fams = find_families(g)
        order = g.ordered_live_nodes() if fams else []
        lengths = length_masks(g) if fams else []
        for (src, axis), fam in fams.items():
            if g.model.elem_type(src) == 9:
                continue
            leaves, mask_fam, _ = mask_leaves(g, fams, fam, lengths)
            iv = intervals(g, order, leaves)
            for chain in find_chains(g, fam, iv, mask_fam):
                final.add((src, axis, chain.direction, chain.steps[0].t))
        res.findings.extend(v for k, v in pending.items() if k in final)
        return res
