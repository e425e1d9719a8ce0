"""A recognised cell: which native op kind, its sizes and activations, and its weights as exact references.

:class:`CellSpec` is the one object every later stage reads (emitter, validator, report). What differs
between LSTM, GRU and RNN is not here but in the spec's :class:`~rnnfuse.cells.kind.CellKind`; kind-specific
data (a GRU's ``linear_before_reset`` and the form of its candidate) lives in ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..symbolic import Lin, Poly

if TYPE_CHECKING:
    from .kind import CellKind


@dataclass
class CellSpec:
    """Everything a native op needs, with weights kept as exact references to the model's constants."""

    kind: "CellKind"
    hidden: int
    input_size: int
    x_key: tuple
    h_key: tuple
    gates: dict  # gate name -> Lin over x (and h), in the kind's gate names
    acts: tuple  # ONNX activation list for one direction: ((name, params), ...)
    clip: float | None = None
    extra: dict = field(default_factory=dict)  # kind-specific data, read only by the kind
    notes: list = field(default_factory=list)

    @property
    def op(self) -> str:
        """The ONNX op type (``LSTM``, ``GRU``, ``RNN``)."""
        return self.kind.op

    def describe(self) -> str:
        extra = list(self.kind.describe_extras(self))
        if tuple(self.acts) != self.kind.default_acts:
            extra.append("activations=" + ",".join(act_name(a) for a in self.acts))
        if self.clip is not None:
            extra.append(f"clip={self.clip:g}")
        return f"{self.op}(hidden={self.hidden}" + "".join(", " + e for e in extra) + ")"

    # ---- weights in ONNX layout (one direction)
    def weights(self, dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``W [1, G*H, I]``, ``R [1, G*H, H]`` and ``B [1, 2*G*H]`` as arrays."""
        Ws, Rs, Bs = self.weight_parts(dtype)
        W = np.concatenate(Ws, 0)[None].astype(dtype, copy=False)
        R = np.concatenate(Rs, 0)[None].astype(dtype, copy=False)
        B = np.concatenate(Bs, 0)[None].astype(dtype, copy=False)
        return W, R, B

    def weight_parts(self, dtype=np.float32) -> tuple[list, list, list]:
        """Per-gate blocks of W [H, I], R [H, H] and the bias halves, in ONNX order (views where possible)."""
        Ws, Rs, Wbs, Rbs = [], [], [], []
        for g in self.kind.gates:
            w, r, wb, rb = self.kind.gate_blocks(self, g, dtype)
            Ws.append(w)
            Rs.append(r)
            Wbs.append(wb)
            Rbs.append(rb)
        return Ws, Rs, Wbs + Rbs

    def has_bias(self) -> bool:
        return any(lin.biases for lin in self.all_lins())

    def all_lins(self) -> list[Lin]:
        """Every affine map of the cell (the gates and any the kind keeps in ``extra``)."""
        return list(self.gates.values()) + [v for v in self.extra.values() if isinstance(v, Lin)]

    def step_polys(self, x: Poly, h: Poly, c: Poly | None = None) -> dict[str, Poly]:
        """Polynomials of the new states (``'h'`` and, for LSTM, ``'c'``) for symbolic x, h, c."""
        return self.kind.step_polys(self, x, h, c)


def act_name(a) -> str:
    name, params = a
    return name + (f"({','.join(f'{p:g}' for p in params)})" if params else "")
