"""The next check session opened while the current one runs.

Some checks run one onnxruntime session after another: a long check's pieces (:mod:`rnnfuse.piecewise_runs`),
a big masked check's groups (:mod:`rnnfuse.check_groups`). Opening a session is most of a piece's cost, and
onnxruntime releases the GIL for much of it and for its runs, so the next session is opened on one worker
thread while this thread runs the current one, compares its values and lets it go. The next one's model is
built here first (it reads the graph, which no other thread touches); only the opening, which reads nothing
but that model, is the worker's. At most two sessions are open at once.

Measured through the CLI side by side (onnxruntime 1.32, 2 cores, one intra-op thread a session; medians of 2,
benchmarks/results/session45_ahead_*): 11,110 stacked Loops validated in 49 pieces 26.2 -> 24.9 s, 999 masked
Loops in 25 groups 14.7 -> 13.9 s; the same output bytes; CPU time rises a little (the second core works).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Opening:
    """A session being opened: :meth:`result` gives ``(session, extra)`` (``extra``: what building its model
    gave besides), or raises what building the model or opening the session raised, as a call made here
    would have."""

    def __init__(self, future: Future | None = None, error: BaseException | None = None, extra: Any = None):
        self._future, self._error, self.extra = future, error, extra

    def result(self) -> tuple[Any, Any]:
        if self._error is not None:
            raise self._error
        return self._future.result(), self.extra


class SessionsAhead:
    """Opens sessions on one worker thread (``threaded``; else at once, in this thread: a single session has
    nothing to overlap with). A context manager: leaving it waits for an opening under way and drops those
    not started (a check that ended early opens nothing more), so take every opening inside it."""

    def __init__(self, threaded: bool = True):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rnnfuse-session") if threaded else None

    def open(self, build: Callable[[], tuple], open_session: Callable[..., Any]) -> Opening:
        """``build()`` -> ``(model, big, extra)`` here, then ``open_session(model, big)`` on the worker."""
        try:
            model, big, extra = build()
            if self._pool is not None:
                return Opening(self._pool.submit(open_session, model, big), extra=extra)
            done: Future = Future()
            done.set_result(open_session(model, big))
            return Opening(done, extra=extra)
        except Exception as e:
            return Opening(error=e)

    def __enter__(self) -> "SessionsAhead":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
