"""README.md runs: every fenced code block in it is executed or checked here.

* ``python`` blocks run as standalone scripts in a fresh directory where the example model stands in for
  ``model.onnx`` (blocks that use an exporter are skipped when it is not installed).
* ``bash`` blocks: every ``rnnfuse ...`` command runs (as ``python -m rnnfuse``) and must succeed; install and
  test-suite commands are recognised and not run (they are what CI itself does).
* ``text`` blocks are either the sample output of the command before them, which must be what the tool prints
  (timings aside), or the synopsis, which must list every option each subcommand accepts and nothing else.
A block without a language tag fails: nothing in the README escapes this test.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "keras_masked_bigru_lstm.onnx"
# commands README shows that this test does not run: installing, and running this very suite
NOT_RUN = (re.compile(r"^pip install "), re.compile(r"^python -m pytest\b"))


def blocks() -> list[tuple[int, str, str]]:
    """(line number, language, text) of every fenced block."""
    out, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            start, lang, body = i + 1, m.group(1), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((start, lang, "\n".join(body) + "\n"))
        i += 1
    return out


def of(lang: str) -> list:
    return [pytest.param(text, id=f"line{line}") for line, lg, text in blocks() if lg == lang]


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A directory like the repository root for a user: the example in examples/ and as model.onnx."""
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "examples" / EXAMPLE.name)
    shutil.copy(EXAMPLE, tmp_path / "model.onnx")
    return tmp_path


def env() -> dict:
    e = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    e.pop("RNNFUSE_DEBUG", None)
    return e


def rnnfuse_cli(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    args = cmd.split()[1:]
    return subprocess.run([sys.executable, "-m", "rnnfuse", *args], cwd=cwd, capture_output=True, text=True, env=env())


def test_every_block_is_tagged():
    untagged = [line for line, lang, _ in blocks() if lang not in ("python", "bash", "text")]
    assert untagged == [], f"README blocks at lines {untagged} need a python/bash/text tag (and a check here)"


@pytest.mark.parametrize("code", of("python"))
def test_python_block_runs(code, workdir):
    for module in ("torch", "tensorflow", "tf2onnx", "keras", "onnx_ir", "onnx_graphsurgeon", "jax", "jax2onnx"):
        if re.search(rf"^\s*import {module}\b|^\s*from {module}\b|import .*\b{module}\b", code, re.M):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{module} is not installed")
    script = workdir / "block.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], cwd=workdir, capture_output=True, text=True, env=env())
    assert p.returncode == 0, f"README block failed:\n{code}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("code", of("bash"))
def test_shell_block_runs(code, workdir):
    ran = 0
    for line in code.splitlines():
        line = line.split("  #")[0].strip()
        for cmd in filter(None, (c.strip() for c in line.split("&&"))):
            if any(r.search(cmd) for r in NOT_RUN):
                continue
            assert cmd.startswith("rnnfuse "), f"README shell command this test does not know how to run: {cmd}"
            p = rnnfuse_cli(cmd, workdir)
            assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
            ran += 1
    assert ran or all(any(r.search(c.strip()) for r in NOT_RUN) for c in code.replace("&&", "\n").splitlines() if c.strip())


_ERROR = re.compile(r"max abs error (\d\.\de[+-]\d+)")


def _normalise(text: str) -> list[str]:
    """The lines, without the run time and the validation errors (onnxruntime's kernels round differently from
    one release to the next: the errors are checked to be small instead)."""
    return [_ERROR.sub("max abs error E", re.sub(r"done in \d+\.\d+ s", "done in N s", line.rstrip()))
            for line in text.strip().splitlines()]


def test_sample_output_is_what_the_tool_prints(workdir):
    (sample,) = [t for _, lang, t in blocks() if lang == "text" and t.startswith("rnnfuse examples/")]
    first = sample.splitlines()[0]  # "rnnfuse IN -> OUT"
    m = re.match(r"rnnfuse (\S+) -> (\S+)$", first)
    p = rnnfuse_cli(f"rnnfuse optimize {m.group(1)} {m.group(2)}", workdir)
    assert p.returncode == 0, p.stderr
    assert _normalise(p.stdout) == _normalise(sample)
    errors = [float(e) for e in _ERROR.findall(p.stdout)]
    assert len(errors) == len(_ERROR.findall(sample)) and max(errors) < 1e-5, errors


def _help_options(command: str) -> list[set[str]]:
    """The options ``rnnfuse COMMAND --help`` lists, each as the set of its spellings ({'-q', '--quiet'})."""
    p = subprocess.run([sys.executable, "-m", "rnnfuse", command, "--help"], capture_output=True, text=True, env=env())
    groups = []
    for line in p.stdout.splitlines():
        m = re.match(r"^  (-[^ ].*?)(?:  |$)", line)  # an option line: two spaces, then its spellings
        if m:
            names = {n.split()[0] for n in m.group(1).split(", ")}
            if names != {"-h", "--help"}:
                groups.append(names)
    return groups


@pytest.mark.parametrize("command", ["optimize", "inspect", "bench"])
def test_synopsis_is_complete(command):
    (synopsis,) = [t for _, lang, t in blocks() if lang == "text" and t.startswith("rnnfuse optimize IN.onnx")]
    # this command's part: from its line to the next "rnnfuse <command>" line
    part = re.search(rf"^rnnfuse {command}\b.*?(?=^rnnfuse |^python -m|\Z)", synopsis, re.M | re.S).group(0)
    part = re.sub(r"#.*", "", part)
    listed = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", part))
    accepted = _help_options(command)
    missing = [sorted(g) for g in accepted if not g & listed]
    assert missing == [], f"README synopsis of '{command}' misses {missing}"
    unknown = listed - set().union(*accepted)
    assert unknown == set(), f"README synopsis of '{command}' lists options it does not take: {sorted(unknown)}"


def test_bug_report_fields_exist(workdir):
    """The fields README's "When something is declined" asks users to paste are in `inspect --json`."""
    import json

    p = rnnfuse_cli("rnnfuse inspect model.onnx --json report.json", workdir)
    assert p.returncode == 0, p.stderr
    d = json.loads((workdir / "report.json").read_text())
    assert {"rnnfuse", "onnx", "onnxruntime"} <= set(d["versions"]) and d["ops_before"]
    findings = [f for p in d["passes"] for f in p["findings"]]
    assert findings and all({"status", "front", "where", "cell", "reason", "notes"} <= set(f) for f in findings)
    text = README.read_text()
    for field in ("versions", "ops_before", "passes[].findings[]", "front", "where", "cell", "reason", "notes"):
        assert f"`{field}`" in text
