"""Passes, pipelines and the report they fill in.

A pass is anything with a ``name`` and ``run(model, ctx) -> PassResult``; plain functions
``f(model, ctx)`` returning a bool (modified) or a :class:`PassResult` work too. Each recurrence a pass finds is
a :class:`Finding`: fused (with the validation error) or declined (with the reason).
"""

from __future__ import annotations

import time
from typing import Iterable

import onnx

from . import progress
from .findings import (  # noqa: F401  (re-exported: the public names have always been here)
    Finding,
    Options,
    Pass,
    PassLike,
    PassReport,
    PassResult,
    Report,
    op_counts,
)
from .graph import Model


def _run_one(p: PassLike, model: Model, ctx: Options) -> PassResult:
    name = getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__)
    t0 = time.perf_counter()
    if hasattr(p, "run"):
        r = p.run(model, ctx)
    else:
        r = p(model, ctx)
    if not isinstance(r, PassResult):
        r = PassResult(name, modified=bool(r))
    r.seconds = time.perf_counter() - t0
    return r


# A round runs every pass once. Fusing one recurrence can expose another (a stacked layer whose trip count is
# proven only once the layer feeding it is a native op; a pair that merges once both halves are fused), so the
# rounds repeat until one fuses nothing and changes nothing: one run reaches the fixed point, and optimizing an
# optimized model changes nothing. The bound only stops a pass that keeps claiming changes (a bug).
MAX_ROUNDS = 6

FUSED_STATUSES = ("fused", "merged")


def _merge_rounds(rounds: list[list[PassResult]]) -> list[PassResult]:
    """One result per pass: what it fused in any round, what it declined in the last round it ran."""
    merged = []
    for i, last in enumerate(rounds[-1]):
        results = [r[i] for r in rounds]
        m = PassResult(last.name, modified=any(r.modified for r in results))
        m.seconds = sum(r.seconds for r in results)
        for r in results:
            m.findings.extend(f for f in r.findings if f.status in FUSED_STATUSES)
            m.notes.extend(n for n in r.notes if n not in m.notes)
        m.findings.extend(f for f in last.findings if f.status not in FUSED_STATUSES)
        merged.append(m)
    return merged


class Pipeline:
    """An ordered list of passes, run over one :class:`Model`.

    >>> pipe = Pipeline.default()            # the standard passes
    >>> pipe = Pipeline([*Pipeline.default().passes, my_pass])
    >>> new_model, report = pipe(model_proto)
    """

    def __init__(self, passes: Iterable[PassLike] | None = None):
        self.passes: list[PassLike] = list(passes) if passes is not None else default_passes()

    @classmethod
    def default(cls) -> "Pipeline":
        return cls(default_passes())

    def names(self) -> list[str]:
        return [getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__) for p in self.passes]

    def fusion_needs(self) -> frozenset[str] | None:
        """The op types without which no pass of this pipeline fuses anything (see :class:`Pass`), or None
        when a pass does not say (then any model may hold something to fuse)."""
        needs: set[str] = set()
        for p in self.passes:
            only = getattr(p, "fuses_only_with", None)
            if only is None:
                return None
            needs |= only
        return frozenset(needs)

    def run(self, model: Model, options: Options | None = None, write_unfused: bool = True) -> Report:
        """Run the passes over ``model`` in place, round after round, until a round changes nothing.

        A model rnnfuse cannot work on (see :func:`rnnfuse.model_io.unsupported_reason`) is not touched; the
        report's note says why. When nothing was fused, ``model`` may still hold clean-up edits: callers that
        hand a model back use the input instead (:func:`rnnfuse.guard.settle`). Such a caller passes
        ``write_unfused=False``: a first round that fused nothing is then not written back to ``model.proto``,
        which is left part-edited, fit only to be dropped."""
        from .model_io import unsupported_reason

        ctx = options or Options()
        rep = Report()
        t0 = time.perf_counter()
        rep.ops_before = dict(op_counts(model.proto.graph, model.graph))
        reason = unsupported_reason(model.proto)
        if reason is not None:
            rep.pass_through(reason)
            rep.seconds = time.perf_counter() - t0
            return rep
        rounds: list[list[PassResult]] = []
        view = model
        # (declines are kept from one round to the next of this run, not from an earlier run on the same model)
        model.facts.kept_declines = model.facts.round_edits = None
        written = False  # whether a round wrote its graph back to the proto
        while True:
            results = []
            for i, p in enumerate(self.passes):
                progress.pass_started(p, i, len(self.passes))  # the 'rnnfuse' logger, and a bar on a terminal
                results.append(_run_one(p, view, ctx))
                progress.pass_finished(results[-1], i, len(self.passes))
            rounds.append(results)
            fused = any(f.status in FUSED_STATUSES for r in results for f in r.findings)
            changed = any(r.modified for r in results)
            if not fused and len(rounds) == 1 and not write_unfused:
                # (clean-ups alone are never kept: no liveness walk, sort or write-back of what the caller drops;
                # a transformer's 15,520 merged duplicates and 4,850 no-op Casts read through cost 0.8 s)
                break
            if changed or fused:
                view.graph.finalize()
                written = True
            # (else the proto is left as it came: nothing was rewritten, and a caller hands back the input
            # anyway, so no liveness walk, sort or write-back of a model nothing happened to)
            if not changed or (not fused and len(rounds) == 1):
                break
            if len(rounds) == MAX_ROUNDS:
                rep.notes.append(f"stopped after {MAX_ROUNDS} rounds of passes that still reported changes")
                break
            view = view.next_round()
        rep.passes = _merge_rounds(rounds)
        rep.rounds = len(rounds)
        note = _overridable_weights_note(model.proto.graph)
        if note:
            rep.notes.append(note)
        if ctx.log:
            for f in rep.findings:
                ctx.log(f.line())
        rep.ops_after = dict(op_counts(model.proto.graph)) if written else dict(rep.ops_before)
        rep.seconds = time.perf_counter() - t0
        return rep

    def __call__(self, proto: onnx.ModelProto, copy: bool = True, **options) -> tuple[onnx.ModelProto, Report]:
        """Optimize a ModelProto; returns ``(model, report)``.

        With ``copy=True`` (the default) ``proto`` is left as it is. When nothing is fused, or a rewrite would
        leave a model less valid than the input, the returned model is the input unchanged (a copy of it, or
        ``proto`` itself restored when ``copy=False``)."""
        from .guard import settle

        work = onnx.ModelProto()
        work.CopyFrom(proto)
        model = Model(work)
        rep = self.run(model, Options(**options), write_unfused=False)  # (settled below)
        if settle(rep, model.proto, lambda: proto, model.established_type):
            result = model.proto
        else:
            result = onnx.ModelProto()
            result.CopyFrom(proto)
        if copy:
            return result, rep
        if result is not proto:
            proto.CopyFrom(result)
        return proto, rep


def default_passes() -> list[PassLike]:
    from .passes import default_passes as dp

    return dp()


def _overridable_weights_note(graph: onnx.GraphProto) -> str | None:
    """A note when initializers are also graph inputs (torch's ``keep_initializers_as_inputs=True``): a caller
    may feed other values there, so no pass takes them for constant weights (as onnxruntime's optimizers do
    not), and the recurrences that read them stay as they are, a chain without even a decline of its own."""
    inputs = {v.name for v in graph.input}
    both = [t.name for t in graph.initializer if t.name in inputs]
    if not both:
        return None
    return (f"{len(both)} initializer(s) are also graph inputs (e.g. '{both[0]}'): a caller may override them, so "
            "they are not taken for constant weights; to fuse what reads them, export without them as inputs "
            "(torch: keep_initializers_as_inputs=False) or drop them from the graph's inputs")
