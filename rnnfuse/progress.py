"""What rnnfuse says while it works: log messages for everyone, a progress bar for people at a terminal.

Every pass reports through the standard ``logging`` module, logger ``"rnnfuse"``: one INFO line per pass (what it
changed, how long it took), one INFO line per recurrence found, DEBUG lines for the pass's notes. Library users
see them with ``logging.basicConfig(level=logging.INFO)``; ``rnnfuse -v`` shows the same lines on stderr.

The command line also shows a per-pass progress bar while it works (a 100k-node graph takes seconds), drawn by
tqdm (the optional extra ``rnnfuse[progress]``) on stderr and only when stderr is a terminal, so pipes, files
and CI logs never see it. Without tqdm there is no bar; the log lines are unaffected.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys

logger = logging.getLogger("rnnfuse")

_bar: contextvars.ContextVar = contextvars.ContextVar("rnnfuse_progress_bar", default=None)


def _pass_name(p) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__)


@contextlib.contextmanager
def progress_bar(enabled: bool = True, stream=None):
    """While the block runs, passes advance a tqdm bar on ``stream`` (stderr) if it is a terminal."""
    stream = stream if stream is not None else sys.stderr
    bar = None
    if enabled and getattr(stream, "isatty", lambda: False)():
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=0, file=stream, unit="pass", leave=False, dynamic_ncols=True,
                       bar_format="{desc} {bar} {n_fmt}/{total_fmt} passes [{elapsed}]")
    token = _bar.set(bar)
    try:
        yield bar
    finally:
        _bar.reset(token)
        if bar is not None:
            bar.close()


def finish() -> None:
    """Take the bar off the terminal before the command prints its report."""
    bar = _bar.get()
    if bar is not None:
        bar.close()
        _bar.set(None)


def step(message: str) -> None:
    """A stage of the command (loading, writing, timing): logged, and shown on the bar."""
    logger.info("%s", message)
    bar = _bar.get()
    if bar is not None:
        bar.set_description_str(message[:60])


def pass_started(p, index: int, total: int) -> None:
    name = _pass_name(p)
    logger.debug("pass %s (%d/%d) started", name, index + 1, total)
    bar = _bar.get()
    if bar is not None:
        if index == 0 and (not bar.total or bar.n >= bar.total):  # the first or another round of passes
            bar.total = bar.n + total
            bar.refresh()
        bar.set_description_str(f"pass {name}")


def pass_finished(result, index: int, total: int) -> None:
    logger.info("pass %s: %s in %.1f ms", result.name, "changed" if result.modified else "no change",
                result.seconds * 1000)
    for f in result.findings:
        logger.info("  %s", f.line())
    for n in result.notes:
        logger.debug("    %s", n)
    bar = _bar.get()
    if bar is not None:
        bar.update(1)


def log_to_stderr(level: int = logging.INFO) -> logging.Handler:
    """What ``-v`` does: the ``rnnfuse`` logger's messages on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("rnnfuse: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
