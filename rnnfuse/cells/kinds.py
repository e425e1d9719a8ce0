"""The native recurrent op kinds rnnfuse emits, by ONNX op type (recognition tries them in this order)."""

from __future__ import annotations

from ..protos import attr
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


def output_dims(node, name: str) -> tuple | None:
    """The dims of a native op's output ``name`` (``Y``, then the final states) as the ONNX spec fixes them: an
    int where the attributes say (directions, ``hidden_size``), else ``(input index, axis)`` of the input the
    extent is taken from (the sequence and the batch from ``X``; the hidden size from ``R`` when the attribute
    is absent). None for any other op, or an output the op does not have. (The kind is asked before the
    output's place is looked up: a Split of a merged chain's Y has thousands of outputs, asked one by one.)"""
    kind = native_kind(node)
    if kind is None:
        return None
    k = list(node.output).index(name)
    if not 0 <= k < kind.n_outputs:
        return None
    directions = 2 if attr(node, "direction", "forward") == "bidirectional" else 1
    hidden = attr(node, "hidden_size", None) or (2, 2)  # (R is [directions, gates * H, H])
    seq_first = not attr(node, "layout", 0)
    seq, batch = ((0, 0), (0, 1)) if seq_first else ((0, 1), (0, 0))
    if k == 0:  # Y: [seq, directions, batch, H], or [batch, seq, directions, H] with layout 1
        return (seq, directions, batch, hidden) if seq_first else (batch, seq, directions, hidden)
    return (directions, batch, hidden) if seq_first else (batch, directions, hidden)
