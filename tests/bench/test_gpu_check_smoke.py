"""benchmarks/gpu_check.sh --smoke: every stage of the GPU check runs on CPU (tiny sizes, Triton interpreted), its
parity checks compare the kernels with the torch path for real, and the report holds every stage. No timing assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_model_check as check  # noqa: E402

import triton  # noqa: F401 - a dev dependency: missing, the tests error


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    """The report of one `gpu_check.sh --smoke`, in a folder of its own."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = {**os.environ, "GPU_CHECK_JSON": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "PASS  parity: block two-phase fp32" in proc.stdout
    assert "PASS  parity: block two-phase fp32" in out.with_suffix(".log").read_text()  # the run's own log
    return out


@pytest.fixture(scope="module")
def report(smoke_out) -> dict:
    return json.loads(smoke_out.read_text())


def test_only_the_report_and_the_log_are_left(smoke_out, report):
    """The GPU machine returns at most 8 files: each stage's own JSON goes once the report holds it."""
    files = sorted(str(f.relative_to(smoke_out.parent)) for f in smoke_out.parent.rglob("*") if f.is_file())
    assert files == ["gpu_check.json", "gpu_check.log"], files
    assert report["vllm"]["status"] == "not run"


def test_every_stage_ran(report):
    assert report["smoke"] is True
    assert list(report["stages"]) == list(check.STAGES)
    for name, stage in report["stages"].items():
        assert stage["status"] == ("skipped" if name == "op_tests" else "ok"), (name, stage)
        assert not stage.get("errors"), (name, stage["errors"])


def test_parity_compares_the_kernels_with_the_torch_path(report):
    parity = report["stages"]["parity"]["result"]
    assert set(parity) == {name for name, *_ in check.PARITY_CASES}
    for name, row in parity.items():
        assert row["passed"] and row["routed"], (name, row)
        # a real comparison: the two paths differ by rounding, not zero (the same path twice would give exactly 0)
        assert 0 < row["kernels_vs_torch"]["grad"] < 0.2, (name, row)
        assert row["gradients"] > 10
    assert {"depth_stats_fwd", "merge_prefix_bwd"} <= set(parity["block two-phase fp32"]["kernel_calls"])
    assert "merge_prefix_fwd" not in parity["block one-shot fp32"]["kernel_calls"]


def test_decode_variants_match_the_reference(report):
    decode = report["stages"]["decode"]["result"]
    variants = [k for k in decode if k != "reference"]
    assert len(variants) == 3 and any("compile" in k for k in variants)
    for name in variants:
        row = decode[name]
        assert row["passed"] and row["tokens_equal"] and row["kernel_calls"]["bank_aggregate"] > 0, (name, row)
    assert "static buffers" in variants[-1]  # the CUDA graph variant last: a failed capture can poison the context


def test_memory_timing_and_operator_rows(report):
    memory = report["stages"]["memory"]["result"]
    assert {name for name, *_ in check.MEMORY_KINDS} == set(memory)
    assert all(row["saved_MiB"] > 0 for row in memory.values())
    timing = report["stages"]["timing"]["result"]
    for case in ("train", "prefill", "decode"):
        assert set(timing[case]["ratio"]) == {"standard", "block", "full"}
        assert all(ms > 0 for ms in timing[case]["ms"].values())
    rows = report["stages"]["op_hbm"]["result"]["rows"]
    assert {"attnres triton", "fla naive_attnres"} <= {r["impl"] for r in rows}
    assert {t["target"].split(" ")[0] for t in report["targets"]} >= {"op", "train", "decode"}


def run(grad_scale: float = 1.0) -> tuple:
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(5, generator=g), "b": torch.randn(3, generator=g), "zero": torch.zeros(2)}
    return torch.tensor(2.0), {k: v * grad_scale for k, v in grads.items()}


def test_verdict_fails_a_wrong_gradient_and_a_silent_fallback():
    truth, near = run(), run(1 + 1e-7)
    ok = check.parity_verdict(truth, near, near, {}, {"fwd": 3, "bwd": 3}, ("fwd", "bwd"), 1e-5)
    assert ok["passed"]
    wrong = check.parity_verdict(truth, near, run(1.01), {}, {"fwd": 3, "bwd": 3}, ("fwd", "bwd"), 1e-5)
    assert not wrong["passed"] and wrong["kernels_vs_fp64"]["grad"] == pytest.approx(0.01, rel=1e-3)
    fallback = check.parity_verdict(truth, near, near, {}, {"fwd": 3}, ("fwd", "bwd"), 1e-5)
    assert not fallback["passed"] and not fallback["routed"]
    torch_ran_kernels = check.parity_verdict(truth, near, near, {"fwd": 1}, {"fwd": 3, "bwd": 3}, ("fwd", "bwd"), 1e-5)
    assert not torch_ran_kernels["passed"]
    # a gradient that should vanish but does not is measured at the median gradient's scale
    leaky = run()
    leaky[1]["zero"] = torch.full((2,), 0.5)
    assert not check.parity_verdict(truth, near, leaky, {}, {"fwd": 1, "bwd": 1}, ("fwd", "bwd"), 1e-5)["passed"]


def test_a_stage_that_hangs_or_fails_loses_only_itself(tmp_path, monkeypatch):
    def hang(stage, path, smoke, seconds):
        rec = check.Recorder(path)
        rec.set("measured", 1.0)  # what a stage measured before it hung stays
        time.sleep(60)

    monkeypatch.setattr(check, "child", hang)
    started = time.monotonic()
    got = check.run_stage("memory", 2.0, True, tmp_path)
    assert got["status"] == "timeout" and got["result"] == {"measured": 1.0}
    assert time.monotonic() - started < 30

    def fail(stage, path, smoke, seconds):
        rec = check.Recorder(path)
        try:
            raise RuntimeError("CUDA error: an illegal memory access")
        except RuntimeError as exc:
            rec.error("stage", exc)
        os._exit(1)

    monkeypatch.setattr(check, "child", fail)
    got = check.run_stage("timing", 30.0, True, tmp_path)
    assert got["status"] == "failed" and "illegal memory access" in got["errors"]["stage"]
    assert "RuntimeError" in got["tracebacks"]["stage"]


def test_op_hbm_reports_copy_fractions_and_the_peer(report):
    rows = report["stages"]["op_hbm"]["result"]["rows"]
    assert all(r["of_copy"] > 0 for r in rows)
    assert report["stages"]["op_hbm"]["result"]["fla"]  # the peer's version, or why it does not import


def test_the_headline_stage_runs_first_with_its_whole_limit():
    """With the deadline gpu_check.sh passes (540 s less the install), op_hbm, right after env, gets its whole limit
    while every later stage keeps the least it is worth starting with; the limits of all fit one 600 s call."""
    assert check.STAGES[:2] == ("env", "op_hbm")
    deadline = 530
    later = sum(least for stage, (_, least) in check.LIMITS.items() if stage not in ("env", "op_hbm"))
    most, _ = check.LIMITS["op_hbm"]
    assert deadline - check.LIMITS["env"][0] - later >= most >= 200  # fla's case alone needs about 200 s
    assert "GPU_CHECK_SECONDS:-540" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def test_the_whole_check_fits_one_device_call():
    """The budget, then gpu_model_check.py's kill past it and the vLLM stage's least limit, under the 600 s a device
    call may run (its last stage may overrun the deadline by the 10 s a hung child is given to terminate)."""
    import re

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    budget = int(re.search(r"GPU_CHECK_SECONDS:-(\d+)", script).group(1))
    model = re.search(r'timeout -k (\d+) "\$\(\(left \+ (\d+)\)\)" "\$PYTHON" benchmarks/gpu_model_check', script)
    vllm = re.search(r'timeout -k (\d+) "\$\(\(left > (\d+) \? left : \2\)\)" "\$PYTHON" benchmarks/bench_vllm', script)
    (kill, past), (vllm_kill, vllm_least) = map(int, model.groups()), map(int, vllm.groups())
    assert past >= 10 + 5  # the last stage's overrun and the report's writing come before the kill
    assert budget + past + kill + vllm_least + vllm_kill <= 590


def test_a_stale_stage_file_is_not_read_as_this_runs(tmp_path, monkeypatch):
    (tmp_path / "memory.json").write_text(json.dumps({"result": {"old": 1}, "errors": {}}))

    def crash(stage, path, smoke, seconds):
        os._exit(1)

    monkeypatch.setattr(check, "child", crash)
    got = check.run_stage("memory", 30.0, True, tmp_path)
    assert got["status"] == "failed" and got["result"] == {}


def test_one_failing_op_hbm_case_loses_only_itself(tmp_path, monkeypatch):
    import gpu_bench

    def fine(shape, args, device, *rest):
        rest[-1].append(gpu_bench.Row(shape.name, "attnres triton", "fwd", 1.0, 10.0, 0.1))

    def broken(shape, args, device, rows):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpu_bench, "run_shape", fine)
    monkeypatch.setattr(gpu_bench, "run_bank_shape", broken)
    monkeypatch.setattr(gpu_bench, "run_merge_shape", fine)
    rec = check.Recorder(tmp_path / "op_hbm.json")
    check.stage_op_hbm(rec, check.SMOKE_SIZES, torch.device("cpu"), True, 60.0)
    assert "out of memory" in rec.errors[gpu_bench.SMOKE_BANK_SHAPES[0].name]
    assert len(rec.data["rows"]) == 2 and all(r["of_copy"] > 0 for r in rec.data["rows"])


def test_a_peer_that_raises_anything_at_import_is_reported_not_fatal(monkeypatch):
    real = check.importlib.import_module

    def imports(name, *args):
        if name.startswith("fla"):
            raise RuntimeError("Found no NVIDIA driver on your system")
        return real(name, *args)

    monkeypatch.setattr(check.importlib, "import_module", imports)
    assert check.fla_status() == "not importable (RuntimeError: Found no NVIDIA driver on your system)"


def test_operator_inputs_are_drawn_on_the_device(monkeypatch):
    """The K3 shapes need about 1e9 normal samples: drawn on the CPU and copied they take minutes."""
    import gpu_bench

    draws, real = [], torch.randn

    def randn(*size, **kwargs):
        draws.append(kwargs.get("device"))
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, "randn", randn)
    device = torch.device("cpu")
    gpu_bench.make_inputs(gpu_bench.SMOKE_SHAPES[0], device)
    gpu_bench.make_bank_inputs(gpu_bench.SMOKE_BANK_SHAPES[0], device)
    assert draws and all(d == device for d in draws), draws


def test_the_kernel_tests_run_with_one_config_and_keep_their_log(tmp_path, monkeypatch):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\n"
        "def test_one_config():\n"
        f"    assert os.environ.get({check.SINGLE_CONFIG_ENV!r}) == '1'\n"
        "    print('probe ran')\n")
    monkeypatch.setattr(check, "OP_TESTS", [str(probe), "-s"])
    got = check.run_op_tests(60.0, tmp_path / "op_tests.log")
    assert got["status"] == "ok", got
    log = (tmp_path / "op_tests.log").read_text()
    assert "probe ran" in log and "1 passed" in got["result"]["summary"]


def fake_wheel(folder: Path, dist: str, version: str) -> Path:
    """A pure-Python wheel of `dist` at `version` whose module records its version."""
    import zipfile

    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_wheels_install_where_the_package_is_missing_or_at_another_version(tmp_path):
    """The GPU machine has transformers, at 5.17: a package installed at any version is not enough."""
    import importlib.metadata

    import gpu_wheels

    have = importlib.metadata.version("einops")
    site = tmp_path / "site"
    (tmp_path / "old").mkdir()
    lines = gpu_wheels.install([fake_wheel(tmp_path / "old", "einops", "0.0.1"),
                                fake_wheel(tmp_path / "old", "attnres_absent_probe", "1.0")], site)
    assert f"einops 0.0.1: from {tmp_path / 'old' / 'einops-0.0.1-py3-none-any.whl'} (found: {have})" in lines
    assert any(line.startswith("attnres_absent_probe 1.0: from") and "(found: none)" in line for line in lines)
    assert (site / "einops" / "__init__.py").read_text() == "VERSION = '0.0.1'\n"
    assert (site / "attnres_absent_probe").is_dir()

    (tmp_path / "same").mkdir()
    lines = gpu_wheels.install([fake_wheel(tmp_path / "same", "einops", have)], site)
    assert lines == [f"einops {have}: installed"] and not site.exists()  # emptied, nothing to install


def test_the_carried_transformers_is_the_one_attnres_requires():
    """download_wheels.sh carries a transformers that pyproject accepts (it refuses 5.17, the GPU machine's)."""
    import re

    from packaging.requirements import Requirement

    script = (ROOT / "benchmarks" / "download_wheels.sh").read_text()
    carried = dict(re.findall(r"([\w.-]+)==([\w.]+)", re.search(r"PACKAGES=\((.*?)\)", script).group(1)))
    pyproject = (ROOT / "pyproject.toml").read_text()
    required = Requirement(re.search(r'"(transformers[<>=~!][^"]*)"', pyproject).group(1))
    assert "transformers" in carried and required.specifier.contains(carried["transformers"])
    assert not required.specifier.contains("5.17.0")


def test_the_real_model_stage_reports_both_cases(report):
    """benchmarks/real_model.py's record (a tiny llama in the dry run): the training step and the decode, each with the
    original's time and the ratios to it of its copy (the noise floor) and of the standard, Block and Full
    conversions."""
    stage = report["real_model"]
    assert [(r["case"], r["dtype"]) for r in stage["results"]] == [("train", "fp32"), ("decode", "fp32")]
    for row in stage["results"]:
        assert row["ms"]["original"] > 0
        assert set(row["ratio"]) == {"copy", "standard", "block", "full"} and all(r > 0 for r in row["ratio"].values())
