"""Apply found recurrences: emit candidates, validate them together, commit the ones that match.

Every fusion pass ends here, so emission, validation and reporting are the same whatever found the
recurrence. Candidates are added next to the original nodes; one validation model compares every
old/new pair; a candidate that fails is simply never connected (dead-code removal drops it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .emit import EmitCache, Emission, emit
from . import portability
from .errors import Decline
from .graph import Graph
from .findings import Finding, Options, PassResult
from .recurrence import Recurrence
from .cell_check import validate_cells
from .validate import validate

# beyond this many nodes, onnxruntime takes seconds just to load the model: recurrences that carry a
# step-level check (unrolled chains) are validated step by step instead
WHOLE_MODEL_LIMIT = 4000


@dataclass
class Candidate:
    rec: Recurrence
    emission: Emission
    finding: Finding
    aliases: dict  # extra old -> existing tensor replacements (pass-through values)


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


def commit(g: Graph, replacements: dict, remove) -> None:
    """Make every reader of each old tensor read its new one, then drop the replaced nodes."""
    model = g.model
    for old, new in replacements.items():
        t = model.known_type(old)
        if t is not None and t[1] is not None:
            model.declare(new, t)  # the new tensor holds what the old one did: same type and shape
        g.replace_uses(old, new)
    for n in remove:
        g.remove_node(n)


def apply_recurrences(
    g: Graph, ctx: Options, pass_name: str, recs: list[tuple[Recurrence, dict]], result: PassResult
) -> None:
    """Emit, validate and commit ``recs`` (each with its pass-through aliases); fill ``result``."""
    cache = EmitCache()
    cands: list[Candidate] = []
    for rec, aliases in recs:
        f = finding_for(pass_name, rec)
        if rec.where in ctx.keep:
            f.status, f.reason = "kept", "left as it is on request (measured faster, or --keep)"
            result.findings.append(f)
            continue
        if not portability.check_recurrence(f, rec, ctx):
            result.findings.append(f)
            continue
        try:
            em = emit(g, rec, cache, post_padded=ctx.post_padded, portable=getattr(ctx, "portable", False))
        except Decline as d:
            result.findings.append(declined(pass_name, rec.front, rec.where, d.reason, rec.cell.describe()))
            continue
        f.direction = em.direction
        f.path = em.path
        portability.check_masked_direction(f, em.direction, em.mask is not None, ctx)
        f.notes.extend(rec.notes)
        cands.append(Candidate(rec, em, f, aliases))
    if not cands:
        return
    big = len(g.nodes) > WHOLE_MODEL_LIMIT
    by_cell = [c for c in cands if big and c.rec.cell_checks]
    cands_whole = [c for c in cands if not (big and c.rec.cell_checks)]
    if ctx.validate:
        for c in by_cell:
            vr = validate_cells(g, c.rec, seed=ctx.seed)
            judge(c.finding, vr, list(vr.pairs), "the native cell does not reproduce the step",
                  f"per step, {len(c.rec.cell_checks)} step kinds")
    if ctx.validate and cands_whole:
        pairs = [(old, new) for c in cands_whole for old, new in c.emission.replacements.items()]
        masks = {
            c.emission.mask: ("post" if c.emission.path == "post-padded" else "any", c.emission.mask_time_axis)
            for c in cands_whole
            if c.emission.mask
        }
        vr = validate(g, pairs, masks, seed=ctx.seed)
        for c in cands_whole:
            judge(c.finding, vr, list(c.emission.replacements.items()), "the native op does not reproduce the original")
    if not ctx.validate:
        for c in cands:
            c.finding.validation = "skipped (--no-validate)"
    for c in cands:
        result.findings.append(c.finding)
        if c.finding.status == "declined":
            continue
        commit(g, {**c.emission.replacements, **c.aliases}, c.rec.remove)
        result.modified = True
    if result.modified:
        g.prune()


def fuse_nodes(model, ctx: Options, pass_name: str, op_type: str, front: str, recurrence_of) -> PassResult:
    """The body of a front end that looks at every ``op_type`` node (Loop, Scan): find, then apply."""
    g = model.graph
    res = PassResult(pass_name)
    recs = []
    for node in [n for n in g.live_nodes() if n.op_type == op_type]:
        try:
            recs.append(recurrence_of(g, node))
        except Decline as d:
            res.findings.append(declined(pass_name, front, node.name or node.output[0], d.reason))
    apply_recurrences(g, ctx, pass_name, recs, res)
    return res
