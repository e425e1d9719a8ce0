"""The rewrite rules of rnnfuse, installed as ``rnnfuse.passes``.

``default_passes()`` is the standard pipeline; each pass is also usable on its own.
"""

from __future__ import annotations


def default_passes() -> list:
    from .bidirectional import MergeBidirectional, ReverseInputs
    from .cleanup import DropNoOps, InlineConstantIfs, SkipRoundTrips
    from .dedupe import Dedupe
    from .concat_slices import MergeConsecutiveSlices
    from .flips import CancelFlips
    from .loop import FuseLoops
    from .row_writes import AssembleRowWrites
    from .scan import FuseScans
    from .step_chains import MergeStepChains
    from .step_maps import StackStepMaps
    from .unrolled import FuseChains

    return [
        InlineConstantIfs(),  # first: shape bookkeeping inside If(rank > 2) becomes plain nodes the front ends read
        DropNoOps(),  # float->float Casts and Identities around each step hide shared inputs and time flips
        Dedupe(),  # per-step copies of one slice or weight become one tensor, so steps and families line up
        FuseLoops(),  # the three front ends, each turning what it finds into native ops
        FuseScans(),
        FuseChains(),  # after the loops: a chain may read a fused layer's output (a stack)
        MergeStepChains(),  # a layer called once per step (decoders): the per-step native ops become one
        MergeConsecutiveSlices(),  # ... reading x cut in steps: one slice, before the passes below validate over it
        AssembleRowWrites(),  # outputs written into a preallocated buffer row by row (outs[t] = h): Y itself
        StackStepMaps(),  # a per-step head (fc(h_t), cat([h1_t, h2_t])) stacked on time: applied to Y at once
        ReverseInputs(),  # native ops (fused or exported) reading a time-reversed input run in reverse instead
        Dedupe(),  # the forward and reverse halves of a layer now read one X and one sequence_lens ...
        MergeBidirectional(),  # ... which is what pairing them into one bidirectional op needs
        CancelFlips(),  # a reverse op's output flipped back by the exporter: two flips cancel
        SkipRoundTrips(),  # stacked masked layers: no scatter back to time order only to gather again
        MergeConsecutiveSlices(),  # merged per-step ops: x cut in steps and Y put back together are one slice each
        Dedupe(),  # last: mask plumbing the rewrites built per layer is shared
    ]
