"""The native recurrent op kinds rnnfuse emits, by ONNX op type (recognition tries them in this order)."""

from __future__ import annotations

from .gru import GRU
from .kind import CellKind
from .lstm import LSTM
from .rnn import RNN

KINDS: dict[str, CellKind] = {k.op: k for k in (RNN, GRU, LSTM)}


def kind_of(op_type: str) -> CellKind | None:
    return KINDS.get(op_type)


def native_kind(node) -> CellKind | None:
    """The kind of a standard-domain native recurrent node, else None."""
    if node.domain not in ("", "ai.onnx"):
        return None
    return KINDS.get(node.op_type)
