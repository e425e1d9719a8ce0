"""Native recurrent cells: one module per ONNX op kind (:mod:`.lstm`, :mod:`.gru`, :mod:`.rnn`), the spec of
a recognised cell (:mod:`.spec`), the recogniser (:mod:`.recognise`) and native ops met inside a step
(:mod:`.native`, registered with the symbolic evaluator on import).

ONNX gate orders: LSTM i, o, f, c; GRU z, r, h; RNN one gate.
"""

from . import native  # noqa: F401  (registers the native ops' step semantics with the evaluator)
from .kind import CellKind
from .kinds import KINDS, kind_of, native_kind
from .recognise import Recognised, fold_offsets, recognise
from .spec import CellSpec

__all__ = ["CellKind", "CellSpec", "KINDS", "Recognised", "fold_offsets", "kind_of", "native_kind", "recognise"]
