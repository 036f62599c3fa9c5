"""benchmarks/bench_vllm.py as the vLLM stage of benchmarks/gpu_check.sh runs it (`--if-installed`): a Python without
vLLM (this test's, like the GPU machine's) writes a "not run" record naming the reason and exits 0; without the flag
the benchmark does not pretend to have run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from tests.serving.conftest import REPO

BENCH = REPO / "benchmarks" / "bench_vllm.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # as gpu_check.sh runs it


def setup_module():
    # the suite's own Python has no vLLM (it lives in ATTNRES_VLLM_PYTHON's venv); with it, these would benchmark
    assert importlib.util.find_spec("vllm") is None, f"{sys.executable} has vllm: run these tests without it"


def test_without_vllm_the_stage_records_not_run(tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--if-installed", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["status"] == "not run"
    assert record["why"].startswith("vllm is not installed on this machine") and sys.executable in record["why"]


def test_without_vllm_and_without_the_flag_it_fails(tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--layers", "1", "--repeats", "1", "--runs", "1", "--out",
                           str(out)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode != 0 and "No module named 'vllm'" in proc.stderr
    assert not out.exists()
