"""The versions the GPU machine runs: triton 3.6.0 and transformers 5.17.0 (older than the 5.24 attnres requires:
`benchmarks/gpu_check.sh` carries 5.24, and falls back to 5.17 when that fails to import).

A second interpreter (ATTNRES_MIN_VERSIONS_PYTHON, a venv that `source .ci/min_versions_env.sh` builds on top of the
project's environment) runs the model configuration and modeling tests and the ahead-of-time GPU compile of every
Triton kernel for sm_90 there. Not part of CI: with a cold Triton cache its compile alone takes minutes that the CI
budget does not have. Without the interpreter these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "ATTNRES_MIN_VERSIONS_PYTHON"
VERSIONS = {"triton": "3.6.0", "transformers": "5.17.0"}


@pytest.fixture(scope="module")
def python() -> str:
    path = os.environ.get(PYTHON_ENV)
    if not path:
        pytest.skip(f"{PYTHON_ENV} not set (source .ci/min_versions_env.sh to build the venv)")
    if not Path(path).exists():
        pytest.fail(f"{PYTHON_ENV}={path}: no such interpreter")
    return path


def run(python: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_interpreter_has_the_minimum_versions(python):
    code = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in ('triton', 'transformers')}))"
    proc = run(python, "-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == VERSIONS


def test_models_and_the_gpu_compile_pass_there(python):
    tests = ["tests/models/test_config_errors.py", "tests/models/test_modeling.py", "tests/ops/test_gpu_compile.py"]
    proc = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not sm_100", *tests, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "skipped" not in proc.stdout.splitlines()[-1]
