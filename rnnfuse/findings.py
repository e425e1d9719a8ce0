"""What passes report: a :class:`Finding` per recurrence (fused, with the validation error, or declined,
with the reason), a :class:`PassReport` per pass, the :class:`Report` of a run, and the :class:`Options` passes
read. Below the passes and the pipeline, so both import it and neither imports the other.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Callable, Protocol, Union

import onnx

from .protos import CONTROL_FLOW as _SUBGRAPH_OPS
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

    def to_dict(self) -> dict:
        """The finding's fields (its lists copied): ``dataclasses.asdict`` copies deeply, field by field, and
        a report of 50,000 declined Loops took 0.9 s to build so."""
        d = {name: getattr(self, name) for name in _finding_fields()}
        d["notes"], d["warnings"] = list(self.notes), list(self.warnings)
        return d

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


@functools.lru_cache(maxsize=None)
def _finding_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Finding))


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
    """A pass may also say ``fuses_only_with``: the op types (any domain, any depth of subgraph) without which
    it reports nothing fused or merged. A model none of whose passes can fuse anything is copied as it is,
    from its file's bytes, without being loaded (:mod:`rnnfuse.prescreen`); a pass that does not say is taken
    to be able to fuse anything. Clean-ups that only tidy around other passes' rewrites say ``frozenset()``."""

    name: str

    def run(self, model: Model, ctx: Options) -> PassResult: ...


PassLike = Union[Pass, Callable[[Model, Options], object]]


def op_counts(graph: onnx.GraphProto, index=None) -> Counter:
    """How many nodes of each op type ``graph`` holds, its subgraphs' included, in order of first appearance.
    ``index``: the graph's GraphIndex, whose op-type index answers for the main graph when it is as loaded
    (no node of a 100k-node graph is read then)."""
    c: Counter = Counter()
    stack = [graph]
    known = index.op_type_counts() if index is not None else None
    if known is not None:
        c.update(known[0])
        stack = [sg for n in known[1] for sg in subgraphs(n)]
    while stack:
        g = stack.pop()
        for n in g.node:
            op = n.op_type
            c[op] += 1
            if op in _SUBGRAPH_OPS or n.domain:  # (only these may hold graphs: no generator per node)
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
    # seconds of each phase of a command-line run around the passes (load, guard, write; the passes are
    # ``seconds``): where a big model's time goes outside the passes, in the JSON report
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def findings(self) -> list[Finding]:
        return [f for p in self.passes for f in p.findings]

    def pass_through(self, reason: str) -> None:
        """The model is not examined, for ``reason`` (see :func:`rnnfuse.model_io.unsupported_reason`)."""
        self.notes.append(f"passed through unchanged: {reason}")
        self.unsupported = reason
        self.ops_after = dict(self.ops_before)

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
        findings = self.findings  # (one list: a report of 50,000 declines walks it three times)
        by_status = Counter(f.status for f in findings)
        return {
            "input": self.input_path,
            "output": self.output_path,
            "seconds": round(self.seconds, 4),
            "nodes_before": sum(self.ops_before.values()),
            "nodes_after": sum(self.ops_after.values()),
            "ops_before": dict(sorted(self.ops_before.items())),
            "ops_after": dict(sorted(self.ops_after.items())),
            "notes": self.notes,
            # (what each recurrence became, in one place: the reasons of the declined ones are otherwise only
            # in their pass's findings below)
            "fused": by_status["fused"],
            "merged": by_status["merged"],
            "declined": [{"front": f.front, "where": f.where, "reason": f.reason} for f in findings
                         if f.status == "declined"],
            "rounds": self.rounds,
            "unsupported": self.unsupported,
            **({"phases": {k: round(v, 4) for k, v in self.phases.items()}} if self.phases else {}),
            "passes": [
                {
                    "name": p.name,
                    "modified": p.modified,
                    "seconds": round(p.seconds, 4),
                    "notes": p.notes,
                    "findings": [f.to_dict() for f in p.findings],
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
