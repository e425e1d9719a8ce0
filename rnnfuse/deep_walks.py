"""Constant folding that walks back through producers further than Python's stack reaches.

``GraphIndex.const`` folds a value by folding its producer's inputs first, one Python frame or three per
producer. A value at the end of a long chain (an encoder's output a Loop carries in, a sequence computed
by thousands of elementwise nodes) would exhaust the stack. So a walk that reaches ``MAX_FOLD_DEPTH``
producers stops there (:class:`TooDeep`) and :func:`fold_deep` folds the value it stopped at first, from a
fresh stack, then resumes: everything folded on the way is cached by the scopes, so the work stays that of
one walk, and the answers are those of an unbounded recursion.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np

    from .graph_index import GraphIndex

MAX_FOLD_DEPTH = 200  # nested folds before a walk resumes from a fresh stack


class _Depth(threading.local):
    value = 0  # folds in progress in this thread (optimize() may run in several threads at once)


_depth = _Depth()


class TooDeep(BaseException):
    """A fold walk went ``MAX_FOLD_DEPTH`` producers deep at ``name`` of ``scope``. (A BaseException, so that
    no ``except Exception`` around an evaluation on the way takes it for that evaluation failing.)"""

    def __init__(self, scope: "GraphIndex", name: str):
        super().__init__(name)
        self.scope, self.name = scope, name


class folding:
    """Around folding ``name`` of ``scope`` into ``cache`` (the scope's constant cache): counts the depth,
    stops a walk that is too deep, and guards cycles with a None that a stopped walk takes back (it is no
    answer: the value is folded again on resuming). (A class, not a generator: it is entered once per value
    folded, ~19,000 times for a trace's per-step chunk bounds, at a third of the cost.)"""

    __slots__ = ("cache", "name")

    def __init__(self, scope: "GraphIndex", cache: dict, name: str):
        if _depth.value >= MAX_FOLD_DEPTH:
            raise TooDeep(scope, name)
        self.cache, self.name = cache, name

    def __enter__(self) -> None:
        self.cache[self.name] = None  # guards cycles (an invalid graph): a value reading itself is no constant
        _depth.value += 1

    def __exit__(self, kind, exc, tb) -> bool:
        _depth.value -= 1
        if kind is not None and issubclass(kind, TooDeep):
            self.cache.pop(self.name, None)
        return False


def fold_deep(fold_in_scope: Callable[["GraphIndex", str], "np.ndarray | None"], scope: "GraphIndex",
              name: str) -> "np.ndarray | None":
    """``fold_in_scope(scope, name)``, resumed from a fresh stack wherever its walk went too deep (inside a
    fold already, the call is made as it is: the outermost one resumes)."""
    if _depth.value:
        return fold_in_scope(scope, name)
    pending: list[tuple["GraphIndex", str]] = [(scope, name)]
    waiting = {(id(scope), name)}
    val = None
    while pending:
        where, wanted = pending[-1]
        try:
            val = fold_in_scope(where, wanted)
        except TooDeep as deep:
            if (id(deep.scope), deep.name) in waiting:
                return None  # (a cycle of values, an invalid graph: no constant)
            pending.append((deep.scope, deep.name))
            waiting.add((id(deep.scope), deep.name))
            continue
        pending.pop()
    return val
