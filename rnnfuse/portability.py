"""Which native ops other runtimes can run: the ``--portable`` option and the report's warning.

A fused op with a ``HardSigmoid`` gate (Keras ``hard_sigmoid``) is valid ONNX that onnxruntime runs, but
OpenVINO's CPU plugin refuses to compile it. Measured with OpenVINO 2026.4 on one-op LSTM/GRU/RNN models, one
activation changed at a time: Sigmoid, Tanh and Relu compile in every position; HardSigmoid fails with
"Unsupported activation function"; LeakyRelu, ThresholdedRelu, Elu, Softsign, Softplus, Affine and ScaledTanh
fail in the sequence-to-TensorIterator conversion. (``clip`` compiles, as a generic loop.)

Without ``--portable`` such a fusion is applied and its finding carries a warning; with it, the recurrence is
declined with that reason and keeps its original form.

Masks: with dynamic shapes OpenVINO 2026.4 runs a native op on its sequence kernel even when
``sequence_lens`` is computed, and that kernel ignores ``sequence_lens``: ``Y`` before a row's length is
right for a forward op, but a reverse op starts at the last step of the whole axis, and ``Y_h`` / ``Y_c``
are the states after the last step (with static shapes it runs a generic loop that honours them).
rnnfuse never reads ``Y_h`` of a masked op (it reads ``Y``); ``--portable`` also emits a masked reverse
layer as a forward op over each row's valid steps reversed (``ReverseSequence``, so no bidirectional merge),
and declines a masked LSTM whose final cell state is used (``Y_c`` is the only source for it). Without
``--portable`` those fusions warn.
"""

from __future__ import annotations

from .findings import Finding, Options

OPENVINO_ACTIVATIONS = ("Sigmoid", "Tanh", "Relu")


def openvino_problem(activations) -> str:
    """The activation names in ``activations`` that OpenVINO cannot compile, comma-separated ('' if none)."""
    ok = {x.lower() for x in OPENVINO_ACTIVATIONS}
    bad: list[str] = []
    for a in activations or ():
        name = a.decode() if isinstance(a, bytes) else str(a)
        if name.lower() not in ok and name not in bad:
            bad.append(name)
    return ", ".join(bad)


def cell_activations(cell) -> list[str]:
    """The activation names of a cell spec (one direction)."""
    return [kind for kind, _ in cell.acts]


def check(f: Finding, activations, ctx: Options, replaces_native: bool = False) -> bool:
    """Mark a fusion whose native op OpenVINO cannot compile: a warning on the finding, or (``--portable``)
    declined with the reason. Returns False when the fusion must not be applied. A rewrite of native ops
    that already had these activations (a merged pair) only warns: declining it would not make the model
    portable."""
    bad = openvino_problem(activations)
    if not bad:
        return True
    supported = ", ".join(OPENVINO_ACTIVATIONS)
    if getattr(ctx, "portable", False) and not replaces_native:
        f.status = "declined"
        f.reason = f"the native op would use {bad}, which OpenVINO's CPU plugin cannot compile (it supports {supported}; --portable)"
        return False
    f.warnings.append(f"will not compile on OpenVINO: {bad} (its CPU plugin supports {supported})")
    return True


def check_recurrence(f: Finding, rec, ctx: Options) -> bool:
    """``check`` for a fused recurrence, plus a masked LSTM's final cell state (``Y_c`` past a row's length
    is what OpenVINO's sequence kernel returns). Returns False when the fusion must not be applied."""
    if not check(f, cell_activations(rec.cell), ctx):
        return False
    if rec.mask is None or not any(fo.which == "c" for fo in rec.finals):
        return True
    why = "OpenVINO's sequence kernel ignores sequence_lens with dynamic shapes"
    if getattr(ctx, "portable", False):
        f.status = "declined"
        f.reason = f"a masked LSTM's final cell state can only come from Y_c, which {why} (--portable)"
        return False
    f.warnings.append(f"final cell state wrong on OpenVINO: {why}; --portable declines it")
    return True


def check_masked_direction(f: Finding, direction: str, masked: bool, ctx: Options) -> None:
    """Warn about a masked reverse op (``--portable`` emits it as a forward op over reversed rows instead)."""
    if masked and direction == "reverse" and not getattr(ctx, "portable", False):
        f.warnings.append("wrong on OpenVINO: a masked reverse op (its sequence kernel ignores sequence_lens "
                          "with dynamic shapes); --portable avoids it")
