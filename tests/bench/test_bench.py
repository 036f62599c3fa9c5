"""`attnres bench`: the suite runs every case at tiny sizes and writes complete JSON, a chart and a table.
No timing assertions: only that every measurement exists, is positive and is reported against its reference."""

from __future__ import annotations

import json

import pytest

from attnres import cli
from attnres.bench.cases import CompiledPeer
from attnres.bench.suite import SuiteConfig
from attnres.bench.timing import copy_bandwidth, median_times

CASE_PREFIXES = ("operator fwd ", "operator fwd+bwd ", "two-phase block fwd ", "fused inference aggregation ",
                 "train step ", "prefill ", "decode ")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--quick", "--no-compile", "--dtypes", "fp32", "--repeats", "1", "--warmup", "0",
            "--decode-repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    return out


def test_json_has_every_case_with_positive_times_and_ratios(quick_run):
    result = json.loads((quick_run / "bench.json").read_text())
    names = [case["name"] for case in result["cases"]]
    for prefix in CASE_PREFIXES:
        assert sum(name.startswith(prefix) for name in names) == 1, (prefix, names)
    assert result["copy_GB/s"] > 0
    for case in result["cases"]:
        assert case["reference"] in case["ms"] and len(case["ms"]) >= 3, case
        assert all(ms > 0 for ms in case["ms"].values()), case
        assert all(r > 0 for r in case["ratio"].values()), case
        assert case["ratio"][case["reference"]] == 1.0
        memory_bound = not case["name"].startswith(("train", "prefill", "decode"))
        assert (case["bytes"] is not None) == memory_bound, case
        if memory_bound:
            assert set(case["GB/s"]) == set(case["ms"]) and all(v > 0 for v in case["of_copy"].values())
        else:
            assert set(case["ms"]) == {"standard", "block", "full"}
    assert any("--no-compile" in note for note in result["notes"])


def test_operator_rows_name_the_backend_and_twin(quick_run):
    result = json.loads((quick_run / "bench.json").read_text())
    op = next(c for c in result["cases"] if c["name"].startswith("operator fwd "))
    assert {"torch.sum", "twin"} <= set(op["ms"])
    assert any(impl.startswith("attnres[") for impl in op["ms"])


def test_chart_is_a_png(quick_run):
    assert (quick_run / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_is_printed(tmp_path, capsys):
    argv = ["bench", "--quick", "--no-compile", "--groups", "bank", "--dtypes", "bf16", "--repeats", "1",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| case | implementation | ms | x reference | GB/s | of copy |" in out
    assert "| fused inference aggregation nvb=3 T=64 d=64 bf16 | bank_aggregate[" in out


def test_compiled_peer_failure_or_slow_compile_is_skipped_with_a_note():
    notes: list[str] = []
    peer = CompiledPeer(enabled=False, timeout=60.0, notes=notes)
    assert peer.ready(lambda: 1, "case") is None and "--no-compile" in notes[0]

    def broken():
        raise RuntimeError("inductor exploded")

    peer.fn = broken
    assert peer.ready(broken, "case A") is None and "inductor exploded" in notes[-1] and peer.fn is None
    peer.fn, peer.timeout = (lambda: 1), 0.0
    assert peer.ready(lambda: sum(range(1000)), "case B") is None and "compile-timeout" in notes[-1]
    assert peer.ready(lambda: 1, "case C") is None  # once skipped, never retried
    peer.fn, peer.timeout = (lambda: 1), 60.0
    call = lambda: 2  # noqa: E731
    assert peer.ready(call, "case D") is call


@pytest.mark.parametrize(
    "overrides, word",
    [({"tokens": 0}, "tokens"), ({"sources": 1}, "sources"), ({"dtypes": ("fp8",)}, "dtypes"),
     ({"groups": ("nope",)}, "groups"), ({"model_heads": 3}, "model_heads"), ({"warmup": -1}, "warmup")],
)
def test_bad_sizes_raise_naming_the_argument(overrides, word):
    with pytest.raises(ValueError, match=word):
        SuiteConfig.quick(**overrides)


def test_median_times_runs_round_robin_and_validates():
    calls: list[str] = []
    times = median_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeats"):
        median_times({"a": lambda: None}, repeats=0)
    assert copy_bandwidth(2**20, repeats=1) > 0
    with pytest.raises(ValueError, match="nbytes"):
        copy_bandwidth(0)
