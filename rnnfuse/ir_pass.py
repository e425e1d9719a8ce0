"""rnnfuse as an ``onnx_ir.passes.InPlacePass``: fuse recurrences inside an onnx-ir pass pipeline.

>>> import onnx_ir as ir
>>> from rnnfuse.ir_pass import FuseRecurrencesPass
>>> result = ir.passes.PassManager([FuseRecurrencesPass()])(ir.load("model.onnx"))
>>> result.modified, result.model

Needs ``onnx-ir`` (``pip install "rnnfuse[ir]"``); importing this module imports it, ``import rnnfuse`` does
not. The pass serialises the model, runs rnnfuse's pipeline on the proto (every rewrite proven and validated
as usual) and, when something was fused, puts the fused graph into the same ``ir.Model`` object. When nothing
was fused the model is not touched and the result says ``modified=False``. The last run's
:class:`rnnfuse.Report` is kept in ``self.report`` (what was fused, what was declined and why).
"""

from __future__ import annotations

import onnx_ir as ir

from .interop import replace_ir_model_contents


class FuseRecurrencesPass(ir.passes.InPlacePass):
    """Rewrite Loop / Scan / unrolled recurrences into native ONNX LSTM, GRU and RNN ops, in place."""

    def __init__(self, *, post_padded: bool = False, validate: bool = True, seed: int = 0, portable: bool = False,
                 passes=None):
        super().__init__()
        self.post_padded = post_padded
        self.portable = portable
        self.validate = validate
        self.seed = seed
        self.passes = passes
        self.report = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from .pipeline import Pipeline

        pipe = Pipeline(self.passes) if self.passes is not None else Pipeline.default()
        proto = ir.to_proto(model)
        fused, self.report = pipe(proto, copy=False, post_padded=self.post_padded, validate=self.validate,
                                  seed=self.seed, portable=self.portable)
        if not self.report.fused:  # do no harm: nothing fused, nothing changed
            return ir.passes.PassResult(model, modified=False)
        replace_ir_model_contents(model, ir.from_proto(fused))
        return ir.passes.PassResult(model, modified=True)
