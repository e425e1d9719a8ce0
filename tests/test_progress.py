"""Messages while rnnfuse works: through the 'rnnfuse' logger for library users, on stderr with ``-v``, and a
per-pass progress bar only when stderr is a terminal (never in pipes, files or CI logs)."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import onnx
import pytest

import rnnfuse

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_masked_bigru_lstm.onnx"


def run(*args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "rnnfuse", *map(str, args)], capture_output=True, text=True,
                          env=env, **kw)


def test_library_users_get_the_messages_through_logging(caplog):
    with caplog.at_level(logging.INFO, logger="rnnfuse"):
        rnnfuse.optimize(onnx.load(EXAMPLE))
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "rnnfuse")
    assert "pass loop: changed in" in text
    assert "fused Loop 'functional_1/lstm_1/while_loop' -> LSTM(hidden=8)" in text


def test_verbose_routes_the_same_messages_to_stderr(tmp_path):
    p = run("optimize", EXAMPLE, tmp_path / "o.onnx", "-v")
    assert p.returncode == 0, p.stderr
    assert "rnnfuse: pass loop: changed in" in p.stderr
    assert "rnnfuse:   fused Loop 'functional_1/lstm_1/while_loop'" in p.stderr
    quiet = run("optimize", EXAMPLE, tmp_path / "q.onnx")
    assert quiet.stderr == ""  # not a terminal, not verbose: no bar, no log lines


def test_progress_bar_only_on_a_terminal(tmp_path):
    pytest.importorskip("tqdm")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # a real size, as a terminal has
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.Popen([sys.executable, "-m", "rnnfuse", "optimize", str(EXAMPLE), str(tmp_path / "o.onnx")],
                         stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = p.stdout.read().decode()
    assert p.wait() == 0
    os.close(master)
    text = err.decode(errors="replace")
    assert "pass loop" in text and "passes [" in text, text
    assert "passes" not in out  # the report on stdout carries no bar
    assert "3 fused, 1 merged" in out
