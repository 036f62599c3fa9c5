"""`attnres bench`: the suite runs every case at tiny sizes and writes complete JSON, a chart and a table.
No timing assertions: only that every measurement exists, is positive and is reported against its reference."""

from __future__ import annotations

import functools
import json

import pytest

from attnres import cli
from attnres.bench.cases import CaseResult, CompiledPeer
from attnres.bench.config import SuiteConfig
from attnres.bench.timing import copy_bandwidth, median_times, round_times

CASE_PREFIXES = ("operator fwd ", "operator fwd+bwd ", "residual stream fwd+bwd ", "residual stream inference ",
                 "fused inference aggregation ", "train step ", "prefill ", "decode ", "small train step ")
MODEL_PREFIXES = ("train", "prefill", "decode", "small", "residual stream")


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
        memory_bound = not case["name"].startswith(MODEL_PREFIXES)
        assert (case["bytes"] is not None) == memory_bound, case
        if memory_bound:
            assert set(case["GB/s"]) == set(case["ms"]) and all(v > 0 for v in case["of_copy"].values())
        elif case["name"].startswith("residual stream"):
            assert set(case["ms"]) == {"standard", "block one-shot", "block two-phase"}
        else:
            assert set(case["ms"]) == {"standard", "block", "full"}
    assert any("--no-compile" in note for note in result["notes"])


def test_model_rows_give_the_spread_of_the_per_round_ratio(quick_run):
    result = json.loads((quick_run / "bench.json").read_text())
    for case in result["cases"]:
        if not case["name"].startswith(("train", "prefill", "decode", "small")):
            assert "round_ratio" not in case, case
            continue
        spread = case["round_ratio"]
        assert set(spread) == set(case["ms"])
        assert spread[case["reference"]] == {"min": 1.0, "median": 1.0, "max": 1.0}
        assert all(0 < r["min"] <= r["median"] <= r["max"] for r in spread.values()), spread


def test_round_ratios_pair_each_round_with_the_reference_of_that_round():
    case = CaseResult.from_rounds("x", "ref", {"ref": [1.0, 2.0, 4.0], "a": [1.5, 2.0, 2.0]})
    assert case.seconds == {"ref": 2.0, "a": 2.0}
    assert case.ratios()["a"] == 1.0  # the ratio of medians
    assert case.round_ratios()["a"] == {"min": 0.5, "median": 1.0, "max": 1.5}  # 1.5, 1.0 and 0.5 round by round
    assert CaseResult("y", "ref", {"ref": 1.0}).round_ratios() is None


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


def test_median_times_runs_rotating_rounds_and_validates():
    calls: list[str] = []
    fns = {k: functools.partial(calls.append, k) for k in "abc"}
    times = median_times(fns, repeats=4, warmup=1)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab") + list("abc")
    assert set(times) == set("abc") and all(t >= 0 for t in times.values())
    calls.clear()
    times = median_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    rounds = round_times({"a": lambda: None, "b": lambda: None}, repeats=4, warmup=0)
    assert {k: len(v) for k, v in rounds.items()} == {"a": 4, "b": 4}
    with pytest.raises(ValueError, match="repeats"):
        median_times({"a": lambda: None}, repeats=0)
    assert copy_bandwidth(2**20, repeats=1) > 0
    with pytest.raises(ValueError, match="nbytes"):
        copy_bandwidth(0)


def test_fast_norms_keep_every_output_and_gradient_and_the_fused_prenorms():
    import copy

    import torch

    from attnres.bench.models import build_models, fast_norms

    built = build_models(dim=32, layers=2, heads=2, vocab=64, block_size=1, max_tokens=16)
    ids = torch.randint(0, 64, (2, 12))
    for kind, model in built.items():
        fast = copy.deepcopy(model)
        assert fast_norms(fast) == 5  # two PreNorms a layer and the final norm
        runs = []
        for m in (model, fast):
            m.zero_grad(set_to_none=True)
            loss = m(ids, labels=ids).loss
            loss.backward()
            runs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        torch.testing.assert_close(runs[1][0], runs[0][0])
        assert runs[1][1].keys() == runs[0][1].keys()
        for name, grad in runs[0][1].items():
            torch.testing.assert_close(runs[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=f"{kind} {name}")
        with torch.no_grad():
            torch.testing.assert_close(fast(ids).logits, model(ids).logits)
        if kind != "standard":  # the AttnRes PreNorms stay fused: the family norms' forward is never called
            calls = []
            layer_norm = fast.model.layers[1].input_layernorm
            forward = layer_norm.forward
            layer_norm.forward = lambda x: calls.append(1) or forward(x)
            fast(ids)
            assert not calls
