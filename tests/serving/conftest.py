"""The vLLM tests drive the Python of a venv of their own (vLLM's install is large and pins its own torch build),
named by ATTNRES_VLLM_PYTHON; `.ci/vllm_env.sh` builds it and exports that variable. Without it they fail, never skip."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

VLLM_PYTHON_ENV = "ATTNRES_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
# small and deterministic: fp32, no graph capture or compilation, a KV cache of 64 MiB (the CPU backend would reserve
# most of the machine's memory), blocks of 32 tokens so that a short shared prompt fills cached blocks
ENGINE = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=128,
    max_num_seqs=16,
    block_size=32,
    gpu_memory_utilization=0.1,
    kv_cache_memory_bytes=64 << 20,
)


def vllm_env() -> dict:
    """The environment of a vLLM subprocess: one CPU thread per process, the engine in-process (its errors then reach
    the caller whole)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        pytest.fail(
            f"{VLLM_PYTHON_ENV} is not set: the vLLM tests need vLLM's own venv. Build it with "
            f"`source .ci/vllm_env.sh` (about 3.4 GB, a few minutes), which exports {VLLM_PYTHON_ENV}",
            pytrace=False,
        )
    if not Path(python).is_file():
        pytest.fail(f"{VLLM_PYTHON_ENV}={python} does not exist; rebuild it with `source .ci/vllm_env.sh`", pytrace=False)
    return python


def run_worker(python: str, cases: list[dict], folder: Path, engine: dict = ENGINE, timeout: float = 900) -> dict:
    """Serve `cases` (tests/serving/worker.py) in one vLLM process; the results by case name."""
    spec, out = folder / "spec.json", folder / "out.json"
    spec.write_text(json.dumps(dict(engine=engine, cases=cases)))
    proc = subprocess.run(
        [python, str(WORKER), str(spec), str(out)], env=vllm_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        pytest.fail(f"the vLLM worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())
