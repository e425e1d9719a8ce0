"""Errors rnnfuse reports to users.

Every error a user can cause (a bad path, a file that is not ONNX, an opset we cannot handle, an output we
cannot write) is a :class:`RnnfuseError` with a one-line message and an exit code. The CLI prints the message
and exits with the code; it never shows a traceback for these.
"""

from __future__ import annotations


class ExitCode:
    """Process exit codes of the ``rnnfuse`` command (documented in README)."""

    OK = 0
    INTERNAL = 1  # a bug in rnnfuse: please report it
    USAGE = 2  # bad command line (argparse also uses 2)
    INPUT = 3  # the input is missing, unreadable, not ONNX, truncated or unsupported
    OUTPUT = 4  # the output cannot be written (or would overwrite the input)
    VALIDATION = 5  # --strict: a requested check failed


class RnnfuseError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = ExitCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InputError(RnnfuseError):
    exit_code = ExitCode.INPUT


class OutputError(RnnfuseError):
    exit_code = ExitCode.OUTPUT


class UsageError(RnnfuseError):
    exit_code = ExitCode.USAGE


class StrictError(RnnfuseError):
    exit_code = ExitCode.VALIDATION


class Decline(Exception):
    """Raised inside a pass when a candidate rewrite is not applied; the message is the reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ProjectedAgain(Decline):
    """A step multiplies the projection it was read through by weights again (a Linear before an LSTMCell):
    the front end reads the projection as the op's input as computed instead (see
    :func:`rnnfuse.inputs.reading_projections`)."""
