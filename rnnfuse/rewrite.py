"""Apply found rewrites: candidates built beside the original, validated together, committed if they match.

Every rewriting pass ends in :func:`apply_rewrites` (recurrences through :func:`apply_recurrences`, which
emits them first), so validation, judging and committing are the same whatever found the rewrite.
Candidates are added next to the original nodes; one validation model compares every old/new pair; a
candidate that fails is simply never connected (dead-code removal drops it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from onnx import helper

from .emit import EmitCache, emit
from . import feeds
from . import portability
from .errors import Decline
from .graph import Graph
from .protos import holds_op_type
from .findings import Finding, Options, PassResult
from .recurrence import Recurrence
from .cell_check import validate_cells_together
from .head_probes import probe_pairs
from .kept_declines import KeptDeclines, unaffected
from .op_args import TO_THE_END
from .validate import validate

# beyond this many nodes, onnxruntime takes seconds just to load the model: recurrences that carry a
# step-level check (unrolled chains) are validated step by step instead
WHOLE_MODEL_LIMIT = 4000
# a masked chain's whole-model run also checks the mask plumbing (lengths, the exact path's compaction, the
# outputs at padded steps), which its step checks do not: it keeps it up to a model that costs ~5 s to run
# so; beyond, its steps are checked with their masks fed (a 100k-node masked chain run whole: 57 s, 721 MB)
MASKED_WHOLE_MODEL_LIMIT = 20000


@dataclass
class Rewrite:
    """A rewrite built beside the original graph and not yet connected."""

    finding: Finding
    replacements: dict  # original tensor -> new tensor: what validation compares and commit connects
    remove: tuple = ()  # original nodes that die with the rewrite
    masks: dict = field(default_factory=dict)  # mask tensor -> (pattern kind, time axis) for validation
    fail_reason: str = "the rewrite does not reproduce the original"
    aliases: dict = field(default_factory=dict)  # further old -> existing tensor replacements (pass-through values)
    cell_rec: Recurrence | None = None  # a recurrence with step checks: validated per step in a big model
    gate: Callable[[Finding], bool] | None = None  # a last word before judging (False: leave it uncommitted)
    # pairs validated in place of the replacements: a smaller rewrite proven to stand for this one, built beside
    # it and never connected (a big model's merge of per-step native ops, a stack of per-step maps: their
    # first few, passes/step_chains.prefix_check and passes/step_maps._prefix_check)
    proxy: dict | None = None
    proxy_how: str = ""  # what the proxy is, for the finding's validation note
    # the least time length the rewrite is checked at: a loop over x from step s runs no step below s + 1, where
    # an empty scan output's shape is onnxruntime's guess ((0, 0, H) from a Loop), not the model's
    min_time: int = 1

    def checked_pairs(self) -> list[tuple[str, str]]:
        return list((self.proxy if self.proxy is not None else self.replacements).items())


def finding_for(pass_name: str, rec: Recurrence) -> Finding:
    c = rec.cell
    return Finding(
        pass_name,
        rec.front,
        rec.where,
        "fused",
        cell=c.describe(),
        hidden=c.hidden,
        masked=rec.masked,
    )


def declined(pass_name: str, front: str, where: str, reason: str, cell: str = "") -> Finding:
    return Finding(pass_name, front, where, "declined", reason=reason, cell=cell)


def judge(f: Finding, vr, pairs: list, fail_reason: str, how: str = "") -> bool:
    """Record a validation result on a finding; returns False when the rewrite must be dropped."""
    if vr is None:
        f.validation = "skipped (--no-validate)"
        return True
    if not vr.ran:
        f.validation = f"skipped ({vr.skipped_reason})"
        return True
    ok, err, detail = vr.error_for(pairs)
    f.max_error = err
    if not ok:
        f.status, f.reason, f.validation = "declined", f"{fail_reason}: {detail}", "failed"
        return False
    f.validation = f"ok ({how + ', ' if how else ''}max abs error {err:.1e}, {vr.runs} runs)"
    return True


def commit(g: Graph, replacements: dict, remove, long_lists: set[str] | None = None,
           ranks: dict[str, int] | None = None) -> None:
    """Make every reader of each old tensor read its new one, then drop the replaced nodes. ``long_lists``
    (a set): gains the values read by 64+ nodes whose reader lists still hold removed nodes, for the caller
    to filter once (see :meth:`Graph.remove_node`); by default they are filtered here. ``ranks``: old tensor
    -> its rank as validation ran it (see :func:`_restated`)."""
    model = g.model
    for old, new in replacements.items():
        t = model.settled_type(old)
        if ranks and old in ranks and _restated(g, old, new, t, ranks[old]):
            pass
        elif t is not None and t[1] is not None:
            model.declare(new, t)  # the new tensor holds what the old one did: same type and shape
        g.replace_uses(old, new)
    deferred: set[str] = set() if long_lists is None else long_lists
    for n in remove:  # (a merged chain of 2,700 native ops read one weight each: 0.6 s of rescans)
        g.remove_node(n, deferred)
    if long_lists is None:
        g.drop_removed_readers(deferred)


def _restated(g: Graph, old: str, new: str, t, rank: int) -> bool:
    """Whether the file declares a replaced tensor with another rank than the ``rank`` validation ran it at
    (the original's, equal to the new tensor's), the new tensor's declaration then taken where it has that
    rank (for a graph output, restated). TorchScript declares ``x.unbind(a)``'s steps, and what is stacked
    from them, one axis too many (its ``SplitToSequence`` with ``split=1``, whose chunks onnxruntime squeezes
    by ``keepdims=0``), which strict shape inference then refuses beside the native op's true rank."""
    mine = g.model.declared_type(new)
    if t is None or t[1] is None or len(t[1]) == rank or mine is None or mine[1] is None or len(mine[1]) != rank:
        return False
    if not g.is_graph_output(old):
        return True  # (the old tensor goes: its declaration is not carried over)
    for vi in g.proto.output:
        if vi.name == old and vi.type.HasField("tensor_type"):
            vi.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(t[0], list(mine[1])).tensor_type.shape)
    g.model.restate(old, (t[0], list(mine[1])))
    return True


def apply_recurrences(
    g: Graph, ctx: Options, pass_name: str, recs: list[tuple[Recurrence, dict]], result: PassResult
) -> None:
    """Emit ``recs`` (each with its pass-through aliases), then validate and commit them; fill ``result``."""
    cache = EmitCache()
    rewrites: list[Rewrite] = []
    links: dict[str, str] = {}  # a layer's internal Y -> its emitted tensor (the next layer's input)
    stacks: dict[str, Rewrite | None] = {}  # the layers of one step: one rewrite, or None once one failed
    for rec, aliases in recs:
        f = finding_for(pass_name, rec)
        if rec.stack and rec.stack in stacks and stacks[rec.stack] is None:
            continue  # a layer below was not emitted: the step stays as it is
        if rec.where in ctx.keep:
            f.status, f.reason = "kept", "left as it is on request (measured faster, or --keep)"
            result.findings.append(f)
            _drop_stack(rec, stacks, rewrites)
            continue
        if not portability.check_recurrence(f, rec, ctx):
            result.findings.append(f)
            _drop_stack(rec, stacks, rewrites)
            continue
        if rec.x_internal:  # (the Ys of the layers below it, as emitted)
            rec.x = links[rec.x]
            rec.x_prep.ys_beside = tuple(links[y] for y in rec.x_prep.ys_beside)
        for so in rec.seq_outputs:  # a head over cells side by side reads the Y of the cells emitted before
            if so.head is not None and so.head.layer_h:
                so.head.layer_h = {name: links.get(y, y) for name, y in so.head.layer_h.items()}
        try:
            em = emit(g, rec, cache, post_padded=ctx.post_padded, portable=getattr(ctx, "portable", False))
        except Decline as d:
            result.findings.append(declined(pass_name, rec.front, rec.where, d.reason, rec.cell.describe()))
            _drop_stack(rec, stacks, rewrites)
            continue
        for so in rec.seq_outputs:
            if so.internal:
                links[so.tensor] = em.replacements.pop(so.tensor)
        f.direction = em.direction
        f.path = em.path
        # (masked whatever the mask: one the original reads, or one made from lengths)
        portability.check_masked_direction(f, em.direction, em.path != "unmasked", ctx)
        f.notes.extend(rec.notes)
        masks = {em.mask: ("post" if em.path == "post-padded" else "any", em.mask_time_axis)} if em.mask else {}
        rw = Rewrite(f, em.replacements, tuple(rec.remove), masks, "the native op does not reproduce the original",
                     aliases, rec if rec.cell_checks else None)
        steps = rec.x_prep.steps
        if steps is not None and steps[1] >= TO_THE_END:  # (x from step s on: see Rewrite.min_time)
            # (a runtime step count: validation draws trip counts 1 .. feeds.TRIP_COUNTS - 1, all within x)
            rw.min_time = steps[0] + (feeds.TRIP_COUNTS if rec.x_prep.count is not None else 1)
        if em.head_probes and not rec.stack and rec.anchor is not None:  # (a stacked step: validated whole)
            rw.proxy = probe_pairs(g, rec.anchor, em.replacements, em.head_probes)
            rw.proxy_how = "the head at its probe points" if rw.proxy is not None else ""
        if rec.stack and rec.stack in stacks:  # the next layer of a stacked step joins the step's rewrite
            whole = stacks[rec.stack]
            whole.finding.cell += (" -> " if rec.x_internal else " + ") + f.cell  # (stacked on / beside the last)
            whole.replacements.update(rw.replacements)
            whole.remove += rw.remove
            whole.masks.update(masks)
            whole.aliases.update(aliases)
            whole.min_time = max(whole.min_time, rw.min_time)
            continue
        if rec.stack:
            stacks[rec.stack] = rw
            f.notes.append("several cells in one step: one native op per cell, each reading the Y of the one below")
        rewrites.append(rw)
    apply_rewrites(g, ctx, rewrites, result)


def _drop_stack(rec: Recurrence, stacks: dict, rewrites: list) -> None:
    """A layer of a stacked step cannot be written: none of the step's layers is (the step stays whole)."""
    if not rec.stack:
        return
    if stacks.get(rec.stack) is not None:
        rewrites.remove(stacks[rec.stack])
    stacks[rec.stack] = None


def apply_rewrites(g: Graph, ctx: Options, rewrites: list[Rewrite], result: PassResult, prune: bool = True) -> None:
    """The one applier: validate the candidates together (per step for big models' recurrences that carry
    step checks), judge each, commit the ones that hold; their findings go to ``result`` in order."""
    if not rewrites:
        return
    n = len(g.nodes)
    by_cell = [r for r in rewrites if r.cell_rec is not None
               and n > (MASKED_WHOLE_MODEL_LIMIT if r.cell_rec.mask is not None else WHOLE_MODEL_LIMIT)]
    whole = [r for r in rewrites if all(r is not c for c in by_cell)]
    results: dict[int, object] = {}
    g.release_arrays()  # (the values read while finding these are not needed to validate or commit them)
    if ctx.validate:
        for r, vr in zip(by_cell, validate_cells_together(g, [r.cell_rec for r in by_cell], seed=ctx.seed)):
            if not vr.ran:  # (a step that cannot be checked alone, e.g. reading a runtime value: the whole model is)
                whole.append(r)
                continue
            judge(r.finding, vr, list(vr.pairs), "the native cell does not reproduce the step",
                  f"per step, {len(r.cell_rec.cell_checks)} step kinds")
        if whole:
            pairs = [p for r in whole for p in r.checked_pairs()]
            masks = {m: how for r in whole for m, how in r.masks.items()}
            min_time = max(r.min_time for r in whole)
            vr = validate(g, pairs, masks, seed=ctx.seed, min_time=min_time)
            if not vr.ran and any(r.proxy is not None for r in whole):
                # a check that did not run is the original's failing, judged as skipped: a proxy is the
                # optimizer's own construction, and it is in every pair's check model, so the batch is checked
                # again on the rewrites' own pairs (they may then say so)
                for r in whole:
                    r.proxy, r.proxy_how = None, ""
                vr = validate(g, [p for r in whole for p in r.checked_pairs()], masks, seed=ctx.seed, min_time=min_time)
            for r in whole:
                results[id(r)] = vr
    # (the reader lists that still hold removed nodes are filtered once, after every commit: 1,600 stacked
    # Loops all read one trip count, and filtering its list per commit was quadratic)
    long_lists: set[str] = set()
    for r in rewrites:
        f = r.finding
        result.findings.append(f)
        if r.gate is not None and not r.gate(f):
            continue
        if id(r) in results or not ctx.validate:
            if not judge(f, results.get(id(r)), r.checked_pairs(), r.fail_reason, r.proxy_how):
                continue
        elif f.status == "declined":
            continue
        vr = results.get(id(r))
        commit(g, {**r.replacements, **r.aliases}, r.remove, long_lists,
               vr.ranks if vr is not None and f.validation.startswith("ok") else None)
        result.modified = True
    g.drop_removed_readers(long_lists)
    if result.modified and prune:
        g.prune()


def recurrences_of(g, node, recurrence_of) -> list:
    """The recurrences ``recurrence_of`` finds in ``node`` (one, or the layers of a stacked step), the types of
    what it reads from outside settled first: its analysis decides on them, asked in many places as filters,
    so they are inferred whole, not left to whatever an earlier query happened to infer. Declines raise."""
    g.model.settle_types([i for i in node.input if i] + sorted(g.implicit_inputs(node)))
    found = recurrence_of(g, node)
    return found if isinstance(found, list) else [found]


def fuse_nodes(model, ctx: Options, pass_name: str, op_type: str, front: str, recurrence_of,
               body_needs: frozenset[str] = frozenset(), parts_of=None) -> PassResult:
    """The body of a front end that looks at every ``op_type`` node (Loop, Scan): find, then apply.
    ``body_needs``: op types of which a body must hold one to be worth analysing (a weight product: a body
    without one holds no cell); any other is declined after a scan of its op types, its graph not indexed
    (25,000 small Loops with no cell: 3 s of indexing and type queries saved). ``parts_of(g, node,
    recurrence_of)``: ``(recurrences, [(part, reason)], node, settle)`` of the parts a node splits into, tried
    before the node whole (see passes.loop_split): the parts' recurrences and declines and what to call once
    they were applied, or none and the node to analyse whole (the node, or its copy)."""
    g = model.graph
    res = PassResult(pass_name)
    recs, settles = [], []
    facts = g.model.facts
    if facts.kept_declines is None:
        facts.kept_declines = KeptDeclines()
    kept, fresh = facts.kept_declines, []

    def unaffected_here():
        if not fresh:  # (one walk a pass, and only where a decline was kept: see rnnfuse.kept_declines)
            fresh.append(unaffected(g, facts.round_edits))
        return fresh[0]

    for node in g.nodes_of(op_type):
        reason = kept.kept(pass_name, node, g.model, unaffected_here)
        if reason is not None:
            res.findings.append(declined(pass_name, front, node.name or node.output[0], reason))
            continue
        if body_needs and not holds_op_type(node, body_needs):
            reason = f"no cell: its body multiplies nothing by a weight matrix ({', '.join(sorted(body_needs))})"
            res.findings.append(declined(pass_name, front, node.name or node.output[0], reason))
            kept.keep(pass_name, node, reason)
            continue
        try:
            if parts_of is not None:
                part_recs, part_declines, node, settle = parts_of(g, node, recurrence_of)
                if part_recs:
                    recs.extend(part_recs)
                    settles.append(settle)
                    res.findings.extend(declined(pass_name, front, p.name or p.output[0], why)
                                        for p, why in part_declines)
                    continue
            recs.extend(recurrences_of(g, node, recurrence_of))
        except Decline as d:
            res.findings.append(declined(pass_name, front, node.name or node.output[0], d.reason))
            kept.keep(pass_name, node, d.reason)
    apply_recurrences(g, ctx, pass_name, recs, res)
    for settle in settles:
        settle()
    return res
