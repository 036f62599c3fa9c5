"""The results page is what `python -m experiments.results` makes of the committed JSON, and the studies' statistics
are right on data whose answer is known."""

import argparse
import json
import math
from pathlib import Path

import pytest

from attnres.analysis.stats import paired_gaps, seeds_to_resolve
from experiments import budget, query_lr, results, stability, upcycle, warmup_stall
from experiments.study import Ledger, study_command, verdict

ROOT = Path(__file__).resolve().parents[2]


def test_results_page_is_generated_from_the_committed_json():
    assert (ROOT / "docs" / "results.md").read_text(encoding="utf-8") == results.page(), \
        "docs/results.md is stale: run python -m experiments.results"


def test_gap_interval_is_the_t_interval():
    stats = paired_gaps([-0.035, -0.025, -0.03])
    half = 4.303 * 0.005 / math.sqrt(3)  # t_{0.975, 2} * std / sqrt(n)
    assert stats["mean"] == pytest.approx(-0.03) and stats["std"] == pytest.approx(0.005)
    assert stats["ci95"] == pytest.approx([-0.03 - half, -0.03 + half])
    assert verdict(stats) == "AttnRes lower (95% interval below 0)"
    assert verdict(paired_gaps([-0.03, 0.01, -0.02])) == "no measurable difference (95% interval spans 0)"
    assert verdict(paired_gaps([0.01])) == "one seed: no interval" and verdict(paired_gaps([])) == "not measured"


def test_seeds_to_resolve_is_the_fewest_whose_interval_fits():
    # spread 0.0088: 5 seeds give 2.776 * 0.0088 / sqrt(5) = 0.0109, 6 give 2.571 * 0.0088 / sqrt(6) = 0.0092
    assert seeds_to_resolve(0.0088, 0.01) == 6
    assert seeds_to_resolve(0.001, 0.01) == 2  # 12.706 * 0.001 / sqrt(2) = 0.009
    assert seeds_to_resolve(1.0, 0.01, most=50) is None


def study_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--mult", type=float, default=0.1)
    p.add_argument("--flag", action="store_true")
    return p


def test_study_command_drops_only_options_that_pick_part_of_the_grid():
    p = study_parser()
    assert study_command("s", p, []) == "python -m s"
    assert study_command("s", p, ["--seeds", "2", "0"]) == "python -m s"  # a part: the bare command completes it
    assert study_command("s", p, ["--seeds", "0", "5"]) == "python -m s --seeds 0 5"  # seed 5 is not in it
    assert study_command("s", p, ["--mult", "0.3", "--flag"]) == "python -m s --mult 0.3 --flag"


def test_ledgers_of_parts_run_side_by_side_merge(tmp_path):
    """Two processes of one study (e.g. one seed each) each add their runs; the file keeps both, the command that
    reproduces the whole, and both invocations."""
    path, p = tmp_path / "study.json", study_parser()
    first = Ledger(path, "w", {}, "s", p, ["--seeds", "0"], summarise=lambda runs: sorted(runs))
    second = Ledger(path, "w", {}, "s", p, ["--seeds", "1"], summarise=lambda runs: sorted(runs))
    first.add("a", {"val_loss": 1.0})
    second.add("b", {"val_loss": 2.0})
    data = json.loads(path.read_text())
    assert data["runs"] == {"a": {"val_loss": 1.0}, "b": {"val_loss": 2.0}} and data["summary"] == ["a", "b"]
    assert data["command"] == "python -m s"
    assert data["invocations"] == ["python -m s --seeds 0", "python -m s --seeds 1"]
    assert "a" in Ledger(path, "w", {}, "s", p, [], summarise=sorted)  # a rerun skips what is there


def fake_budget_runs() -> dict:
    """Standard's loss falls by 0.1 per doubling of steps; Block is 0.02 lower at every budget."""
    runs = {}
    for seed, noise in enumerate((0.0, 0.004, -0.004)):
        for b in (100, 200, 400):
            for res, shift in (("standard", 0.0), ("block", -0.02)):
                runs[f"{res}-{seed}-{b}"] = {
                    "size": "L6", "residual": res, "seed": seed, "budget": b, "steps": b, "tokens": b * 2048,
                    "num_params": 1, "val_loss": 3.0 - 0.1 * math.log2(b / 100) + shift + noise,
                    **({} if b == 400 else {"branched_at": b - 20}),
                }
    return runs


def test_budget_gap_and_compute_matched_gap():
    rows = budget.summarise(fake_budget_runs(), ratios={"L6": 2.0})  # Block's steps twice as slow
    assert [r["budget"] for r in rows] == [100, 200, 400]
    for r in rows:
        assert r["gap"]["mean"] == pytest.approx(-0.02) and r["gap"]["std"] == pytest.approx(0.0, abs=1e-12)
        assert r["step_time_ratio"] == pytest.approx(2.0)
    # Block at 100 steps costs what standard does at 200, where standard is 0.1 lower: compute-matched gap +0.08
    assert rows[0]["compute_matched_gap"]["mean"] == pytest.approx(0.08)
    assert rows[1]["compute_matched_gap"]["mean"] == pytest.approx(0.08)
    assert rows[2]["compute_matched_gap"]["n"] == 0  # 800 standard steps were not trained: no extrapolation
    assert budget.summarise(fake_budget_runs())[0]["compute_matched_gap"]["n"] == 0  # no ratio measured: none


def test_compute_matched_interpolates_in_log_steps():
    assert budget.interpolate_log([(100, 3.0), (400, 2.8)], 200) == pytest.approx(2.9)
    assert budget.interpolate_log([(100, 3.0), (400, 2.8)], 401) is None


def test_query_lr_conclusion_keeps_an_unresolved_default():
    runs = {}
    for seed in range(3):
        runs[f"s{seed}"] = {"residual": "standard", "seed": seed, "val_loss": 2.0}
        for mult, loss in ((0.1, 1.99), (1.0, 1.98 + 0.02 * (seed == 1))):
            runs[f"b{mult}{seed}"] = {"residual": "block", "seed": seed, "attn_res_lr_mult": mult,
                                      "val_loss": loss + 0.001 * seed}
    text = results.query_lr_conclusion({"runs": runs})
    assert text.startswith("1 has the lowest mean loss") and "The default stays 0.1" in text


def test_short_budget_pairs_a_summary_without_baseline_with_its_baseline_only_if_settings_agree():
    def summary(mult, losses, lr=3e-3):
        return {"config": {"attn_res_lr_mult": mult, "lr": lr, "residual": "block", "out": "x"}, "seeds": [0, 1],
                "runs": {res: {"seeds": [{"seed": s, "val_loss": v} for s, v in enumerate(vs)]}
                         for res, vs in losses.items()}}
    main = summary(1.0, {"standard": [2.0, 2.2], "block": [1.9, 2.0]})
    other = summary(0.1, {"block": [2.1, 2.1]})
    losses = results.compare_losses(other, baseline=main)
    assert losses == {"block": {0: 2.1, 1: 2.1}, "standard": {0: 2.0, 1: 2.2}}
    assert results.paired(losses, "block")["gaps"] == pytest.approx([0.1, -0.1])
    with pytest.raises(ValueError, match="query lr multiplier"):
        results.compare_losses(summary(0.1, {"block": [2.1, 2.1]}, lr=1e-3), baseline=main)


def fake_upcycle(block_shift: float, matched_shift: float, depth_shift: dict[int, float]) -> dict:
    """An upcycle ledger: each continuation seed moves every arm alike (the batches); Block is `block_shift` from
    continued standard, standard-matched `matched_shift` from Block; from scratch, Block is `depth_shift[L]` from
    standard at L layers."""
    runs = {"pretrain": {"kind": "pretrain", "val_loss": 2.0, "num_params": 1000, "train_s": 10.0, "cpu_s": 5.0},
            "step-time": {"kind": "step-time", "ratio": {"block": 1.2, "full": 1.3, "block-frozen": 1.1}}}
    for seed, noise in enumerate((0.0, 0.05, -0.05)):
        wobble = 0.001 * (seed - 1)  # the paired gaps vary a little
        arms = {"standard": 1.8, "block": 1.8 + block_shift + wobble, "full": 1.8 + wobble,
                "block-frozen": 1.99 - 0.0001 * seed, "standard-matched": 1.8 + block_shift - matched_shift}
        for arm, loss in arms.items():
            runs[f"continue-{arm}-s{seed}"] = {
                "kind": "continue", "arm": arm, "seed": seed, "val_loss": loss + noise * (arm != "block-frozen"),
                "val_curve": [[0, 2.0], [200, loss]], "steps": 240 if arm == "standard-matched" else 200,
                "train_s": 10.0, "cpu_s": 5.0}
        for layers, shift in depth_shift.items():
            for residual in ("standard", "block"):
                runs[f"depth-L{layers}-{residual}-s{seed}"] = {
                    "kind": "depth", "layers": layers, "residual": residual, "seed": seed, "train_s": 10.0,
                    "cpu_s": 5.0, "val_loss": 2.0 + 0.01 * layers + noise + (shift + wobble) * (residual == "block")}
    setup = json.loads((ROOT / "docs" / "upcycle.json").read_text())["setup"]
    return {"command": "python -m experiments.upcycle", "setup": setup, "runs": runs,
            "summary": upcycle.summarise(runs)}


def test_upcycle_section_reads_its_intervals():
    """Block 0.01 lower than continued standard and still lower at equal time; the gap widening with depth."""
    data = fake_upcycle(-0.01, -0.005, {6: 0.0, 12: -0.02, 24: -0.04})
    text = "\n".join(results.upcycle_section(data))
    assert ("| Block | 3 | 1.7900 ± 0.0495 | -0.0100 [-0.0125, -0.0075] | AttnRes lower (95% interval below 0) "
            "| 1.20x |") in text
    assert "lies below 0 for Block; above 0 for frozen-base Block (`--freeze-base`); it spans 0 for Full." in text
    assert "Block minus that run: -0.0050 [" in text and "upcycling pays here even at equal compute" in text
    assert "Gap at 24 layers minus gap at 6, paired by seed: -0.0400 [" in text
    assert "the gap widens with depth (AttnRes gains more)" in text and "are noisy" not in text
    assert "the deeper models have not caught up" in text  # standard's loss rises with depth in the fake
    readme = results.upcycle_readme(data)
    assert readme.startswith("Continuing a pretrained standard model (L12-d64, 200 steps, 3 seeds), Block ends -0.0100")
    assert readme.endswith("Block minus standard is -0.0050 [-0.0075, -0.0025].")


def test_upcycle_section_says_when_it_does_not_pay():
    data = fake_upcycle(-0.01, 0.03, {6: 0.0, 24: 0.0})
    text = "\n".join(results.upcycle_section(data))
    assert "gains a little against continued standard training at equal steps" in text
    assert "loses at equal training time" in text and "Neither shows upcycling paying for its cost." in text
    assert "the gap does not measurably widen with depth here" in text


def test_readme_quotes_the_committed_upcycle_study():
    data = json.loads((ROOT / "docs" / "upcycle.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert " ".join(results.upcycle_readme(data).split()) in " ".join(readme.split()), \
        "README.md's upcycling figures differ from docs/upcycle.json: paste results.upcycle_readme(data)"


@pytest.mark.parametrize("module", [budget, stability, query_lr, upcycle, warmup_stall, results])
def test_every_study_script_parses_its_command_line(module, capsys):
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_every_study_builds_its_run_configs(tmp_path):
    """The settings each study trains with are valid `TrainConfig`s (what a rerun of its command starts from)."""
    args = argparse.Namespace(attn_res_lr_mult=0.1, threads=1, runs=str(tmp_path), budgets=[150, 300], steps=200,
                              eval_interval=20)
    assert budget.config_for(args, "L12-d64", "block", 0, 300).layers == 12
    assert stability.config_for(args, "full", 1e-2, 20, 0).lr == 1e-2
    assert warmup_stall.config_for(args, "standard", 30, 3e-3, 1).warmup == 30
