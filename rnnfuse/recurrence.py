"""What a found recurrence is, independent of the front end (Loop, Scan or unrolled chain) that found it.

A :class:`Recurrence` says: run ``cell`` over the time-major input ``x`` (``[T, B, F]``) in processing order,
with an optional step mask ``mask`` (``[T, B]`` or ``[T, B, 1]`` bool, also in processing order) whose
false steps leave every state unchanged; start from ``h0``/``c0``; and here are the tensors of the original
graph that hold the per-step outputs and the final states. The emitter turns it into a native op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import NodeProto

from .cells import CellSpec

# what a per-step output holds at steps whose mask is false
CARRY = "carry"  # the previous step's output (Keras' default for return_sequences)
ZERO = "zero"  # zeros (Keras Bidirectional / zero_output_for_mask)
NONE = "none"  # the recurrence is not masked


@dataclass
class Init:
    """An initial value: a tensor of the graph, or a constant fill (0.0 = zeros)."""

    tensor: str | None = None
    fill: float | None = 0.0
    lead: int = 0  # the tensor is [1, B, H] (1) rather than [B, H] (0)

    @property
    def is_zero(self) -> bool:
        return self.tensor is None and self.fill == 0.0

    def describe(self) -> str:
        return self.tensor if self.tensor else f"fill({self.fill:g})"


@dataclass
class SeqOutput:
    tensor: str  # [T, B, H], time-major, in processing order
    fill: str = NONE  # CARRY | ZERO | NONE
    init: Init = field(default_factory=Init)  # CARRY: the output before the first valid step
    time_axis: int = 0  # the tensor is [T, B, H] (0), [B, T, H] (1: torch.stack(outs, 1)) or [B, H, T] (2)
    reversed: bool = False  # the tensor is stacked in reverse processing order
    internal: bool = False  # not a tensor of the graph: the input of the next layer of the same step
    head: object = None  # a rnnfuse.step_heads.StepHead applied to every step (the output is head(h_t))
    # the tensor is this start plus every step's value (a carried running sum, acc = acc + y_t), not the steps
    accumulate: str = ""
    # (with a head, in a masked recurrence) the head's value is zeros at masked steps: ``where(m, head(h), 0)``
    zero_masked: bool = False


@dataclass
class StepRead:
    """The hidden state after one step, read by the graph beside the recurrence (a head applied per step,
    outputs concatenated on features, ``stack(ys[1:])``): the emitter gives it that step's slice of Y."""

    tensor: str  # [B, H] (or [1, B, H] with lead 1)
    step: int  # the step's index in processing order
    fill: str = NONE  # CARRY for a masked recurrence: the state is kept at masked steps
    init: Init = field(default_factory=Init)  # CARRY: the state before the first valid step
    lead: int = 0


@dataclass
class FinalOutput:
    tensor: str  # [B, H]
    which: str  # "h" or "c"
    init: Init = field(default_factory=Init)  # the value when a row has no valid step
    lead: int = 0  # the tensor is [1, B, H] (1) rather than [B, H] (0)


@dataclass
class CountOutput:
    """The final value of a counter the loop carried beside the cell (``t = t + 1`` each step, from ``start``):
    ``start`` plus the number of steps, which is the time extent of ``of`` on ``axis`` (the loop was proven to
    run once per step of it)."""

    tensor: str  # the counter's final value in the original graph
    start: str  # the counter's initial value
    of: str  # a tensor whose ``axis`` is the time axis
    axis: int


@dataclass
class CellCheck:
    """One step of the original graph, to compare numerically with a one-step native op.

    Used instead of whole-model validation when the model is too big to run cheaply (long unrolled
    chains): every other step was proven identical to this one structurally or symbolically."""

    nodes: list  # NodeProtos of the step, in graph order
    inputs: dict  # tensor -> "x" | "h" | "c"
    outputs: dict  # tensor -> "h" | "c"
    zero: set = field(default_factory=set)  # states that are zero in this step (a folded first step)
    batch: int | None = None  # a batch size baked into the step (static exports), else any
    fills: dict = field(default_factory=dict)  # tensors of runtime shape [B, H] filled with one value
    x_projection: tuple | None = None  # (K, b): the step reads x @ K + b, computed outside the loop
    # a masked step's mask values -> (elem type, dims after the batch): fed valid at some rows, padding at others
    masks: dict = field(default_factory=dict)
    mask_valid: bool = True  # the mask's value at valid rows (False: it is true at padding)


@dataclass
class InputPrep:
    """How the native op's input is made from ``Recurrence.x`` (and its mask from ``Recurrence.mask``) when the
    rewrite is emitted. Finding adds no nodes: a front end says what to build here and the emitter builds it,
    so a declined candidate leaves the graph as it was."""

    # x is read time-reversed the way each of these nodes of the graph reverses its own input
    # (ReverseSequence, Slice with step -1, Gather of T-1 .. 0), innermost first; the mask is not flipped
    flips: tuple = ()
    # (start, stop, axis): the recurrence runs over these steps of x and of the mask only
    steps: tuple[int, int, int] | None = None
    # a runtime number of steps (a scalar integer of the graph: a loop's trip count M): the recurrence runs over
    # steps start .. start + max(M, 0) - 1 of ``steps`` only (TorchScript's ``for t in range(n)``)
    count: str | None = None
    # the step mask is the step number compared with per-row lengths (a hand-written length mask): an object
    # whose ``build(graph, x, time_axis, anchor)`` adds the [T, B] mask ([B, T] for time axis 1) and names it
    lengths: object = None
    # x is a row-wise map of ``Recurrence.x`` (what a Loop body computes from its step before the cell): an
    # object whose ``build(graph, x, anchor)`` applies it to every step of x at once and names the result
    input_map: object = None
    # the Ys of other layers of a stacked step that a residual cell reads beside x, the Y of the layer below it
    # (GNMT's ``c3(h2 + h1)``): internal sequence outputs, laid out like x, concatenated right after it
    ys_beside: tuple = ()
    # sequences the steps read beside x (``lax.scan`` over ``(x, x2)``): the op reads x and these concatenated
    # on features, in this order (after ``ys_beside``)
    side_by_side: tuple = ()
    # those sequences are laid out [B, T, F] where x is [T, B, F] (a residual layer's x beside the Y below it)
    side_batch_first: bool = False
    # an ``input_map`` applied to each of those sequences first (a residual layer reads the step input the
    # bottom layer reads, which the loop maps from x)
    side_map: object = None


@dataclass
class Recurrence:
    front: str  # "Loop" | "Scan" | "chain" | ...
    where: str  # a human-readable location (node name)
    cell: CellSpec
    x: str  # time-major input in processing order (once ``x_prep`` is built)
    h0: Init = field(default_factory=Init)
    c0: Init = field(default_factory=Init)
    mask: str | None = None
    mask_batch_first: bool | None = None  # the mask's layout where it is not x's ([B, T] beside a time-major x)
    mask_cut: bool = False  # the mask may be longer than x (its length is not provably x's): read its first T steps
    # ``mask`` is true at padded steps (a padding mask, ``Where(pad, h_prev, h_new)``): the op's is its negation
    mask_negated: bool = False
    # the front end computed ``mask`` (t compared with per-row lengths): the original graph does not read it,
    # so validation must not override it; "post" when every row's valid steps come first by construction
    mask_made: str = ""
    seq_outputs: list[SeqOutput] = field(default_factory=list)
    finals: list[FinalOutput] = field(default_factory=list)
    step_reads: list[StepRead] = field(default_factory=list)
    row_steps: list = field(default_factory=list)  # rnnfuse.row_steps.RowStep: a state at one step per row
    counts: list[CountOutput] = field(default_factory=list)  # final values of counters carried beside the cell
    remove: list[NodeProto] = field(default_factory=list)  # nodes that die with the rewrite
    anchor: NodeProto | None = None
    x_time_axis: int = 0  # x is [T, B, F] (0), [B, T, F] (1) or [B, F, T] (2: a Conv1d's output read as x[:, :, t])
    x_reversed: bool = False  # processing order is x read from its last step to its first
    notes: list[str] = field(default_factory=list)
    cell_checks: list[CellCheck] = field(default_factory=list)
    # several cells in one step (a stacked step): one Recurrence per cell sharing ``stack``, bottom first,
    # applied all or none; ``x_internal``: x names an ``internal`` SeqOutput of the layer below
    stack: str = ""
    x_internal: bool = False
    x_prep: InputPrep = field(default_factory=InputPrep)

    @property
    def masked(self) -> bool:
        return self.mask is not None

    def describe(self) -> str:
        return f"{self.front} '{self.where}'"
