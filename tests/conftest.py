"""Shared test fixtures: real exporter models, generated once per session.

The generators in ``tests/exporters/`` export models with the real frameworks (Keras 3 and tf_keras through
tf2onnx, torch trace/dynamo/TorchScript, JAX/Flax through jax2onnx) and store the framework's own outputs
beside them. They run as subprocesses (tf_keras needs TF_USE_LEGACY_KERAS=1 before TensorFlow is imported). Set
``RNNFUSE_FIXTURE_CACHE=DIR`` to reuse generated models across test sessions (keyed by the generator's
source and library versions); by default they are generated into a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
EXPORTERS = HERE / "exporters"

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _versions() -> str:
    out = []
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("tensorflow", "tf2onnx", "keras", "tf_keras", "torch", "onnx"):
        # TensorFlow is installed as `tensorflow` (what .[test] asks for) or, by hand, as `tensorflow-cpu`
        for dist in (mod, "tensorflow-cpu") if mod == "tensorflow" else (mod,):
            try:
                out.append(f"{mod}={version(dist)}")
                break
            except PackageNotFoundError:
                continue
        else:
            out.append(f"{mod}=?")
    return ",".join(out)


def generate(tmp_path_factory, script: str, args: list[str], tag: str) -> Path:
    """Run an exporter script once; returns the directory holding its cases."""
    src = (EXPORTERS / script).read_bytes()
    key = hashlib.sha1(src + " ".join(args).encode() + _versions().encode()).hexdigest()[:16]
    cache = os.environ.get("RNNFUSE_FIXTURE_CACHE")
    if cache:
        out = Path(cache) / f"{tag}-{key}"
        if (out / ".done").exists():
            return out
    else:
        out = tmp_path_factory.mktemp(tag)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(EXPORTERS / script), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (out / ".done").write_text(proc.stdout[-20000:])
    return out


def load_cases(directory: Path) -> list[dict]:
    cases = []
    for j in sorted(directory.glob("*.json")):
        meta = json.loads(j.read_text())
        meta["onnx"] = str(j.with_suffix(".onnx"))
        meta["npz"] = str(j.with_suffix(".npz"))
        cases.append(meta)
    return cases


@pytest.fixture(scope="session")
def keras3_dir(tmp_path_factory):
    return generate(tmp_path_factory, "keras_cases.py", ["--backend", "keras3"], "keras3")


@pytest.fixture(scope="session")
def tf_keras_dir(tmp_path_factory):
    return generate(tmp_path_factory, "keras_cases.py", ["--backend", "tf_keras"], "tf_keras")


@pytest.fixture(scope="session")
def torch_dir(tmp_path_factory):
    return generate(tmp_path_factory, "torch_cases.py", [], "torch")


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory):
    return generate(tmp_path_factory, "variant_cases.py", [], "variants")


@pytest.fixture(scope="session")
def jax_dir(tmp_path_factory):
    return generate(tmp_path_factory, "jax_cases.py", [], "jax")
