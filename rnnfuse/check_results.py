"""What a validation found: a result per compared pair of tensors, and how two tensors are compared.

rnnfuse.validate runs the check models that compute old and new tensors side by side; rnnfuse.cell_check and
rnnfuse.check_groups gather what those runs found. An element agrees when ``|new - old| <= ATOL + RTOL *
|old|``; a NaN must be where the original has one, nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

ATOL = 1e-5
RTOL = 1e-4


@dataclass
class PairResult:
    old: str
    new: str
    max_abs: float = 0.0
    ok: bool = True
    detail: str = ""
    rank: int | None = None  # the compared tensors' rank, as run (None: never compared)


@dataclass
class ValidationResult:
    ran: bool
    skipped_reason: str = ""
    pairs: dict = field(default_factory=dict)  # (old, new) -> PairResult
    runs: int = 0
    light: bool = False  # onnxruntime ran lighter than deployed: no pre-packing or graph optimizations (check_session)

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Each compared original tensor -> its rank as run (what the file declares may differ). Built once:
        the rewrites validated together (11,000 Loops) share it."""
        return {old: r.rank for (old, _), r in self.pairs.items() if r.ok and r.rank is not None}

    def error_for(self, pairs: list[tuple[str, str]]) -> tuple[bool, float, str]:
        ok, err, detail = True, 0.0, ""
        for p in pairs:
            r = self.pairs.get(p)
            if r is None:
                continue
            err = max(err, r.max_abs)
            if not r.ok:
                ok = False
                detail = detail or r.detail
        return ok, err, detail


def first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:200]


def failed_run(e: Exception, pairs, original_runs: Callable[[], bool],
               original_fails: str = "onnxruntime failed on generated inputs",
               rewrite_fails: str = "onnxruntime cannot run the rewrite on generated inputs") -> ValidationResult:
    """The result of a check that raised ``e`` (loading or running it): when the original alone does the same
    (``original_runs()``), the rewrite is what onnxruntime cannot load or run, and every pair fails (a model that
    ran must not come out unable to); otherwise the original cannot: validation is skipped."""
    msg = first_line(e)
    if not original_runs():
        return ValidationResult(False, f"{original_fails} ({msg})")
    res = ValidationResult(True)
    for p in pairs:
        res.pairs[p] = PairResult(*p, ok=False, detail=f"{rewrite_fails} ({msg})")
    return res


def compare(r: PairResult, a: np.ndarray, c: np.ndarray, where: str) -> None:
    if a.shape != c.shape:
        r.ok = False
        r.detail = r.detail or f"shape {c.shape} instead of {a.shape} ({where})"
        return
    r.rank = a.ndim
    if a.size == 0:
        return
    if not np.issubdtype(a.dtype, np.floating):
        if not np.array_equal(a, c):
            r.ok = False
            r.detail = r.detail or f"values differ ({where})"
        return
    a64, c64 = a.astype(np.float64), c.astype(np.float64)
    nan_a, nan_c = np.isnan(a64), np.isnan(c64)
    if np.any(nan_a != nan_c):
        r.ok = False
        r.detail = r.detail or f"NaN where the original has none ({where})"
        return
    diff = np.where(nan_a, 0.0, np.abs(a64 - c64))
    err = float(diff.max())
    r.max_abs = max(r.max_abs, err)
    tol = ATOL + RTOL * np.abs(np.where(nan_a, 0.0, a64))
    if np.any(diff > tol):
        r.ok = False
        r.detail = r.detail or f"max abs error {err:.3g} ({where})"
