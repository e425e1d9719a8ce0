"""Passes, pipelines and the report they fill in.

A pass is anything with a ``name`` and ``run(model, ctx) -> PassResult``; plain functions
``f(model, ctx)`` returning a bool (modified) or a :class:`PassResult` work too. Each recurrence a pass finds is
a :class:`Finding`: fused (with the validation error) or declined (with the reason).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Protocol, Union

import onnx

from . import progress
from .graph import Model, subgraphs


@dataclass
class Finding:
    pass_name: str
    front: str  # Loop | Scan | chain | native-pair ...
    where: str
    status: str  # fused | declined | merged
    reason: str = ""
    cell: str = ""
    hidden: int | None = None
    direction: str = ""
    masked: bool = False
    path: str = ""  # unmasked | exact | post-padded
    max_error: float | None = None
    validation: str = ""  # "ok", "skipped: ...", "failed: ..."
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # shown on the report line (e.g. not portable to OpenVINO)

    def line(self) -> str:
        head = f"{self.front} '{self.where}'"
        if self.status in ("declined", "kept"):
            what = f" ({self.cell})" if self.cell else ""
            return f"{self.status} {head}{what}: {self.reason}"
        bits = [self.cell]
        if self.direction:
            bits.append(self.direction)
        if self.masked:
            bits.append(f"masked, {self.path} path")
        if self.validation:
            bits.append(f"validation {self.validation}")
        verb = "merged" if self.status == "merged" else "fused"
        s = f"{verb} {head} -> " + ", ".join(b for b in bits if b)
        if self.path == "post-padded":
            s += " [assumes post-padded masks]"
        for w in self.warnings:
            s += f" [{w}]"
        return s


@dataclass
class PassReport:
    """What one rnnfuse pass did (not onnx-ir's ``passes.PassResult``, which carries a model)."""

    name: str
    modified: bool = False
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# the name rnnfuse's own passes were written with; the public name is PassReport (``rnnfuse.PassResult`` still
# works, with a DeprecationWarning, so that it no longer shadows ``onnx_ir.passes.PassResult``)
PassResult = PassReport


@dataclass
class Options:
    validate: bool = True
    post_padded: bool = False
    seed: int = 0
    log: Callable[[str], None] | None = None
    keep: set = field(default_factory=set)  # locations (Finding.where) to leave as they are
    portable: bool = False  # decline fusions whose native op OpenVINO cannot compile (rnnfuse.portability)


class Pass(Protocol):
    name: str

    def run(self, model: Model, ctx: Options) -> PassResult: ...


PassLike = Union[Pass, Callable[[Model, Options], object]]


def op_counts(graph: onnx.GraphProto) -> Counter:
    c: Counter = Counter()
    stack = [graph]
    while stack:
        g = stack.pop()
        for n in g.node:
            c[n.op_type] += 1
            stack.extend(subgraphs(n))
    return c


@dataclass
class Report:
    passes: list[PassResult] = field(default_factory=list)
    ops_before: dict = field(default_factory=dict)
    ops_after: dict = field(default_factory=dict)
    seconds: float = 0.0
    input_path: str = ""
    output_path: str = ""
    notes: list[str] = field(default_factory=list)
    rounds: int = 1  # how many rounds of passes ran (see Pipeline.run)
    unsupported: str = ""  # why the model was passed through without running any pass

    @property
    def findings(self) -> list[Finding]:
        return [f for p in self.passes for f in p.findings]

    @property
    def fused(self) -> list[Finding]:
        return [f for f in self.findings if f.status in ("fused", "merged")]

    @property
    def declined(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "declined"]

    @property
    def modified(self) -> bool:
        return any(p.modified for p in self.passes)

    def to_dict(self) -> dict:
        return {
            "input": self.input_path,
            "output": self.output_path,
            "seconds": round(self.seconds, 4),
            "nodes_before": sum(self.ops_before.values()),
            "nodes_after": sum(self.ops_after.values()),
            "ops_before": dict(sorted(self.ops_before.items())),
            "ops_after": dict(sorted(self.ops_after.items())),
            "notes": self.notes,
            "rounds": self.rounds,
            "unsupported": self.unsupported,
            "passes": [
                {
                    "name": p.name,
                    "modified": p.modified,
                    "seconds": round(p.seconds, 4),
                    "notes": p.notes,
                    "findings": [asdict(f) for f in p.findings],
                }
                for p in self.passes
            ],
        }

    def op_change_line(self, interesting=("Loop", "Scan", "LSTM", "GRU", "RNN")) -> str:
        b, a = self.ops_before, self.ops_after
        parts = [f"{k} {b.get(k, 0)}->{a.get(k, 0)}" for k in interesting if b.get(k, 0) or a.get(k, 0)]
        return f"nodes {sum(b.values())} -> {sum(a.values())}" + ("; " + ", ".join(parts) if parts else "")

    def to_text(self, verbose: bool = False) -> str:
        lines = []
        for f in self.findings:
            lines.append("  " + f.line())
            if verbose:
                for n in f.notes:
                    lines.append("      " + n)
                if f.max_error is not None:
                    lines.append(f"      max abs error vs original: {f.max_error:.3g}")
        if not self.findings and not self.unsupported:
            native = [f"{k} {self.ops_before[k]}" for k in ("LSTM", "GRU", "RNN") if self.ops_before.get(k)]
            lines.append(f"  recurrences already native ({', '.join(native)}): nothing to fuse" if native
                         else "  no recurrences found")
        n_fused = sum(1 for f in self.findings if f.status == "fused")
        n_merged = sum(1 for f in self.findings if f.status == "merged")
        head = f"{n_fused} fused" + (f", {n_merged} merged" if n_merged else "")
        head += f", {len(self.declined)} declined; {self.op_change_line()}"
        out = [head] + lines
        for n in self.notes:
            out.append("  note: " + n)
        if verbose:
            for p in self.passes:
                out.append(f"  pass {p.name}: {'changed' if p.modified else 'no change'} in {p.seconds * 1000:.1f} ms")
                for n in p.notes:
                    out.append(f"      {n}")
        return "\n".join(out)


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

    def run(self, model: Model, options: Options | None = None) -> Report:
        """Run the passes over ``model`` in place, round after round, until a round changes nothing.

        A model rnnfuse cannot work on (see :func:`rnnfuse.model_io.unsupported_reason`) is not touched; the
        report's note says why. When nothing was fused, ``model`` may still hold clean-up edits: callers that
        hand a model back use the input instead (:func:`rnnfuse.guard.settle`)."""
        from .model_io import unsupported_reason

        ctx = options or Options()
        rep = Report()
        t0 = time.perf_counter()
        rep.ops_before = dict(op_counts(model.proto.graph))
        reason = unsupported_reason(model.proto)
        if reason is not None:
            rep.notes.append(f"passed through unchanged: {reason}")
            rep.unsupported = reason
            rep.ops_after = dict(rep.ops_before)
            rep.seconds = time.perf_counter() - t0
            return rep
        rounds: list[list[PassResult]] = []
        view = model
        while True:
            results = []
            for i, p in enumerate(self.passes):
                progress.pass_started(p, i, len(self.passes))  # the 'rnnfuse' logger, and a bar on a terminal
                results.append(_run_one(p, view, ctx))
                progress.pass_finished(results[-1], i, len(self.passes))
            view.graph.finalize()
            rounds.append(results)
            fused = any(f.status in FUSED_STATUSES for r in results for f in r.findings)
            changed = any(r.modified for r in results)
            if not changed or (not fused and len(rounds) == 1):
                break
            if len(rounds) == MAX_ROUNDS:
                rep.notes.append(f"stopped after {MAX_ROUNDS} rounds of passes that still reported changes")
                break
            view = view.next_round()
        rep.passes = _merge_rounds(rounds)
        rep.rounds = len(rounds)
        if ctx.log:
            for f in rep.findings:
                ctx.log(f.line())
        rep.ops_after = dict(op_counts(model.proto.graph))
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
        rep = self.run(model, Options(**options))
        if settle(rep, model.proto, lambda: proto):
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
