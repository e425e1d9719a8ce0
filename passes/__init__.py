"""The rewrite rules of rnnfuse, installed as ``rnnfuse.passes``.

``default_passes()`` is the standard pipeline; each pass is also usable on its own.
"""

from __future__ import annotations


def default_passes() -> list:
    from .loop import FuseLoops

    return [FuseLoops()]
