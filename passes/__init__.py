"""The rewrite rules of rnnfuse, installed as ``rnnfuse.passes``.

``default_passes()`` is the standard pipeline; each pass is also usable on its own.
"""

from __future__ import annotations


def default_passes() -> list:
    from .bidirectional import MergeBidirectional, ReverseInputs
    from .cleanup import CancelFlips, Dedupe, DropNoOps, InlineConstantIfs, SkipRoundTrips
    from .loop import FuseLoops
    from .scan import FuseScans
    from .unrolled import FuseChains

    return [InlineConstantIfs(), DropNoOps(), Dedupe(), FuseLoops(), FuseScans(), FuseChains(), ReverseInputs(), Dedupe(), MergeBidirectional(), CancelFlips(), SkipRoundTrips(), Dedupe()]
