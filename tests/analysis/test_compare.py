"""`attnres compare`'s verdict (synthetic per-seed losses), its table, seeds, and the settings it quotes."""

import json
import math
import statistics
from pathlib import Path

import pytest

from attnres.analysis.report import SUMMARY, compare, format_table, judge, pooled_seed_std, seed_losses
from attnres.cli import main
from attnres.commands import compare as compare_command
from attnres.training import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def test_pooled_seed_std_pools_each_kind_around_its_own_mean():
    losses = {"standard": [1.70, 1.72], "block": [1.60, 1.64], "full": [1.5]}
    std, dof = pooled_seed_std(losses)
    assert dof == 2  # one from each kind with two seeds; a single seed adds none
    assert std == pytest.approx(math.sqrt((2 * 0.01**2 + 2 * 0.02**2) / 2))
    assert pooled_seed_std({"standard": [1.7], "block": [1.6]}) is None


def test_a_gap_whose_t_interval_spans_zero_reads_within_seed_noise():
    # std 0.0283 (pooled, 2 dof), n = 2 each: standard error of a gap 0.0283; gap -0.03 +- 4.303 * 0.0283
    losses = {"standard": [1.70, 1.74], "block": [1.67, 1.71]}
    v = judge(losses, budget="300 steps")
    assert v["noise_std"] == pytest.approx(math.sqrt(0.02**2 * 2 * 2 / 2))
    gap = v["gaps"]["block"]
    assert gap["verdict"] == "noise"
    assert gap["gap"] == pytest.approx(-0.03)
    assert gap["se"] == pytest.approx(v["noise_std"])
    half = 4.303 * v["noise_std"]
    assert gap["ci95"] == pytest.approx([-0.03 - half, -0.03 + half])
    assert "Block -0.0300: within seed noise at this budget (95% t interval -0.1517 to +0.0917)" in v["line"]
    assert v["line"].startswith("At 300 steps, 2 seeds per residual, seed spread (std) ")
    assert "leads" not in v["line"]


def test_a_gap_over_two_standard_errors_of_two_seeds_is_still_noise():
    """Two standard errors treat the spread of two seeds as known; its t interval (2 dof: 4.3 standard errors)
    does not: a gap of 2.8 standard errors is within the noise."""
    gap = judge({"standard": [1.70, 1.74], "block": [1.62, 1.66]})["gaps"]["block"]
    assert gap["gap"] == pytest.approx(-0.08) and 2 * gap["se"] < 0.08 < 4.303 * gap["se"]
    assert gap["verdict"] == "noise"


def test_a_gap_whose_t_interval_excludes_zero_reads_as_a_lead_in_seed_spreads():
    losses = {"standard": [1.72, 1.74], "block": [1.65, 1.67], "full": [1.73, 1.75]}
    v = judge(losses)
    std = v["noise_std"]
    assert std == pytest.approx(statistics.stdev([1.72, 1.74]))
    assert v["gaps"]["block"]["verdict"] == "lead"
    assert v["gaps"]["block"]["in_std"] == pytest.approx(0.07 / std)
    assert f"Block leads standard by 0.0700 nats/byte ({0.07 / std:.1f} seed spreads; 95% t interval" in v["line"]
    assert v["gaps"]["full"]["verdict"] == "noise"  # +0.01 +- 3.182 (3 dof) * 0.0141
    # the baseline ahead by more than the noise reads the other way round
    behind = judge({"standard": [1.60, 1.61], "full": [1.70, 1.71]})
    assert behind["gaps"]["full"]["verdict"] == "behind"
    assert "standard leads Full by 0.1000 nats/token" in judge({"standard": [1.60, 1.61], "full": [1.70, 1.71]},
                                                              unit="nats/token")["line"]
    # identical seeds: no spread, any gap is a lead and the summary stays plain JSON
    same = judge({"standard": [1.6, 1.6], "block": [1.5, 1.5]})
    assert same["gaps"]["block"]["verdict"] == "lead" and "no spread between the seeds" in same["line"]
    assert judge({"standard": [1.6, 1.6], "block": [1.6, 1.6]})["gaps"]["block"]["verdict"] == "noise"
    json.dumps(same, allow_nan=False)


def test_one_seed_is_judged_by_a_spread_measured_elsewhere_or_not_at_all():
    losses = {"standard": [1.70], "block": [1.60]}
    noise = judge(losses, noise_std=0.06, noise_dof=6, noise_source="an experiment")  # 0.1 < 2.447 * 0.085
    assert noise["gaps"]["block"]["verdict"] == "noise" and "an experiment" in noise["line"]
    lead = judge(losses, noise_std=0.02, noise_dof=6, noise_source="an experiment")
    assert lead["gaps"]["block"]["verdict"] == "lead" and "1 seed per residual" in lead["line"]
    with pytest.raises(ValueError, match="noise_dof"):
        judge(losses, noise_std=0.02)
    unknown = judge(losses)
    assert unknown["gaps"]["block"]["verdict"] == "unknown" and "no seed spread" in unknown["line"]
    assert "No standard run" in judge({"block": [1.6, 1.61]})["line"]


def test_table_shows_mean_and_per_seed_values():
    prof = {"residual": "standard", "weights": [], "mixture_rms": [], "output_rms": [], "grad_norms": []}
    summary = {"runs": {
        "standard": {"val_loss": 1.71, "num_params": 1000, "tokens_per_s": 5000.0, "profile": prof,
                     "seeds": [{"seed": 0, "val_loss": 1.70}, {"seed": 1, "val_loss": 1.72}]},
        "block": {"val_loss": 1.65, "num_params": 1010, "tokens_per_s": 4000.0, "profile": prof,
                  "seeds": [{"seed": 0, "val_loss": 1.64}, {"seed": 1, "val_loss": 1.66}]},
    }}
    table = format_table(summary)
    assert "| standard | 1.7100 | 1.7000, 1.7200 |  | 1,000 | 5,000 |" in table
    assert "| block | 1.6500 | 1.6400, 1.6600 | -0.0600 | 1,010 | 4,000 |" in table
    # a summary written before seeds were recorded still tabulates
    del summary["runs"]["block"]["seeds"]
    assert "| block | 1.6500 | 1.6500 | -0.0600 |" in format_table(summary)


def test_compare_trains_every_seed_and_writes_the_verdict(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    base = TrainConfig(data=str(corpus), max_bytes=20_000, layers=2, dim=16, heads=2, ffn=32, seq_len=16,
                       batch_size=2, steps=3, warmup=1, eval_interval=3, eval_batches=1, log_interval=1,
                       checkpoint_interval=100, progress=False, threads=1)
    out = tmp_path / "cmp"
    summary = compare(base, ["standard", "block"], out, seeds=[3, 4])
    assert summary["seeds"] == [3, 4] and summary["config"]["seed"] == 3
    assert {"standard", "block", "standard-s4", "block-s4"} <= {p.name for p in out.iterdir()}
    for run in summary["runs"].values():
        assert [s["seed"] for s in run["seeds"]] == [3, 4]
        assert run["val_loss"] == pytest.approx(statistics.mean(s["val_loss"] for s in run["seeds"]))
    assert summary["verdict"] == judge({k: [s["val_loss"] for s in r["seeds"]] for k, r in summary["runs"].items()},
                                       budget="3 steps (0.00M tokens)")
    assert json.loads((out / SUMMARY).read_text()) == summary
    with pytest.raises(ValueError, match="seeds"):
        compare(base, ["standard"], out, seeds=[1, 1])


def test_compare_command_prints_table_and_closing_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "cmp"
    args = ["compare", "--data", str(corpus), "--max-bytes", "20000", "--layers", "2", "--dim", "16",
            "--seq-len", "16", "--batch-size", "2", "--steps", "3", "--residuals", "standard", "block",
            "--threads", "1", "--out", str(out)]
    assert main(args + ["--seeds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| residual | val loss (mean) | per seed |" in printed
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["config"]["warmup"] == 3  # the default warm-up, clamped to the steps
    assert summary["noise"]["std"] == compare_command.MEASURED_SEED_STD  # one seed: the measured spread
    assert summary["noise"]["dof"] == compare_command.MEASURED_SEED_DOF
    assert summary["verdict"]["line"] in printed and "1 seed per residual" in printed
    assert main(args) == 0  # the default: two seeds, judged by their own spread
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["seeds"] == [0, 1] and "noise" not in summary
    assert "2 seeds per residual" in capsys.readouterr().out
    assert main(args + ["--seeds", "0"]) == 2


def test_the_quoted_warmup_and_seed_spread_are_those_of_the_committed_experiment():
    """`attnres compare` quotes its warm-up, its one-seed noise and a table from docs/warmup_stall.json: they must
    agree with it, and the warm-up must be the shortest at which PreNorm ends within the seed spread of its best."""
    data = json.loads((ROOT / "docs" / "warmup_stall.json").read_text())
    groups = {}
    for r in data["runs"].values():
        assert r["lr"] == 3e-3 and r["steps"] == 300
        groups.setdefault((r["residual"], r["warmup"]), []).append(r["val_loss"])
    unstalled = {k: v for k, v in groups.items() if k[1] >= compare_command.WARMUP}
    assert {r for r, _ in unstalled} == {"standard", "block"} and all(len(v) >= 2 for v in unstalled.values())
    std, dof = pooled_seed_std(unstalled)
    assert compare_command.MEASURED_SEED_STD == pytest.approx(std, abs=5e-5)
    assert compare_command.MEASURED_SEED_DOF == dof
    standard = {w: statistics.mean(v) for (r, w), v in groups.items() if r == "standard"}
    best = min(standard.values())
    assert min(w for w, m in standard.items() if m - best < std) == compare_command.WARMUP
    assert all(m - best < std for w, m in standard.items() if w >= compare_command.WARMUP)
    # the table in `attnres compare --help`
    rows = [line.split() for line in compare_command.WARMUP_HELP.splitlines() if line[:2] == "  " and line.split()]
    quoted = {int(row[0]): row for row in rows if row[0].isdigit()}
    assert set(quoted) == {w for _, w in groups}
    for w, row in quoted.items():
        std_mean, block_mean = statistics.mean(groups["standard", w]), statistics.mean(groups["block", w])
        assert row[1] == f"{std_mean:.3f}" and row[4] == f"{block_mean:.3f}"
        assert row[7] == f"{block_mean - std_mean:+.3f}"
        assert row[2:4] == [f"({groups['standard', w][0]:.3f},", f"{groups['standard', w][1]:.3f})"]


def test_readme_quick_start_table_is_the_committed_compare_run():
    """The README's Quick-start table and closing line are those of docs/compare_summary.json (a real run)."""
    summary = json.loads((ROOT / "docs" / "compare_summary.json").read_text())
    readme = (ROOT / "README.md").read_text()
    table = format_table(summary)
    assert table in readme
    assert " ".join(summary["verdict"]["line"].split()) in " ".join(readme.split())  # wrapped in the README
    assert summary["config"]["warmup"] == compare_command.WARMUP and summary["seeds"] == [0, 1]
    # the same job at torch's default thread count, from a fresh clone, as the README quotes it
    default = json.loads((ROOT / "docs" / "compare_summary_default_threads.json").read_text())
    assert {k: default["config"][k] for k in summary["config"]} == {**summary["config"], "threads": None}
    quoted = ", ".join(f"{name} {default['runs'][kind]['val_loss']:.4f} against {summary['runs'][kind]['val_loss']:.4f}"
                       for name, kind in (("Block", "block"), ("Full", "full")))
    assert f"standard identical, {quoted};" in " ".join(readme.split())
    assert seed_losses(default)["standard"] == seed_losses(summary)["standard"]
