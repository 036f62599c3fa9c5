"""Query learning rate: Block AttnRes with its pseudo-queries and key gains at 0.1x, 0.3x and 1x the learning rate, at
the budget study's largest budget.

The budget study's setting (experiments/budget.py: WSD, 100 warm-up steps, peak lr 3e-3) on its 6-layer d=64 model,
1200 steps, three seeds. The 0.1x runs and the standard baseline are the budget study's own (docs/budget.json, the
same settings and seeds); this study trains the other multipliers. `attnres train --attn-res-lr-mult` defaults to
0.1 (a 600-step measurement, docs/design.md section 10); this checks it at twice that budget.

    python -m experiments.query_lr                 # 0.3x and 1x, seeds 0 1 2, about 30 minutes
    python -m experiments.query_lr --mults 1 --seeds 0

Writes docs/query_lr.json (after every run) and docs/figures/query_lr.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from attnres.analysis.stats import paired_gaps
from attnres.layers.kinds import BLOCK, STANDARD
from experiments import budget
from experiments.study import Ledger, progress, timed_run, verdict

SIZE, BUDGET = "L6-d64", 1200


def run_name(mult: float, seed: int) -> str:
    return f"{SIZE}-block-x{mult:g}-s{seed}-b{BUDGET}"


def baseline_runs(path: Path) -> dict:
    """The budget study's runs of this size and budget: standard, and Block at its multiplier."""
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text(encoding="utf-8"))
    mult = saved["setup"]["attn_res_lr_mult"]
    out = {}
    for r in saved["runs"].values():
        if r["size"] == SIZE and r["budget"] == BUDGET:
            out[f"{SIZE}-{r['residual']}" + (f"-x{mult:g}" if r["residual"] == BLOCK else "") + f"-s{r['seed']}"] = {
                **r, "attn_res_lr_mult": mult if r["residual"] == BLOCK else None, "source": str(path)}
    return out


def summarise(runs: dict) -> list[dict]:
    """Per multiplier: Block's losses by seed and its gap to standard, paired by seed."""
    standard = {r["seed"]: r["val_loss"] for r in runs.values() if r["residual"] == STANDARD}
    rows = []
    for mult in sorted({r["attn_res_lr_mult"] for r in runs.values() if r["residual"] == BLOCK}):
        block = {r["seed"]: r["val_loss"] for r in runs.values() if r["residual"] == BLOCK and r["attn_res_lr_mult"] == mult}
        stats = paired_gaps([block[s] - standard[s] for s in sorted(block) if s in standard])
        rows.append({"attn_res_lr_mult": mult, "val_loss": {str(s): v for s, v in sorted(block.items())},
                     "mean": statistics.mean(block.values()), "gap": stats, "verdict": verdict(stats)})
    return rows


def draw(runs: dict, path: Path) -> Path:
    """Block minus standard (95% interval) against the multiplier."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt

    rows = [r for r in summarise(runs) if r["gap"]["n"]]
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    xs = [r["attn_res_lr_mult"] for r in rows]
    ys = [r["gap"]["mean"] for r in rows]
    err = [[r["gap"]["mean"] - r["gap"]["ci95"][0] if r["gap"]["ci95"] else 0 for r in rows],
           [r["gap"]["ci95"][1] - r["gap"]["mean"] if r["gap"]["ci95"] else 0 for r in rows]]
    ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3)
    for r in rows:
        ax.plot([r["attn_res_lr_mult"]] * len(r["gap"]["gaps"]), r["gap"]["gaps"], ".", color="grey")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("learning-rate multiplier of the pseudo-queries and key gains")
    ax.set_ylabel("Block minus standard (nats/byte)")
    ax.set_title(f"{SIZE}, {BUDGET} WSD steps: gap by query lr (95% interval)", fontsize=9)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mults", nargs="+", type=float, default=[0.3, 1.0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    p.add_argument("--budget-json", default="docs/budget.json", help="the budget study's results (default: %(default)s)")
    p.add_argument("--runs", default="runs/query_lr", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/query_lr.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/query_lr.png", help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.budgets = [BUDGET]
    ledger = Ledger(args.json, "final validation loss (nats/byte) of Block AttnRes by the learning-rate multiplier of "
                    "its pseudo-queries and key gains, and of standard (the budget study's runs)",
                    {"size": SIZE, "budget": BUDGET, **budget.SIZES[SIZE]}, "experiments.query_lr", p, argv, summarise)
    def refresh() -> None:  # the budget study may be running beside this one
        ledger.runs.update(baseline_runs(Path(args.budget_json)))

    for seed in args.seeds:
        for mult in args.mults:
            name = run_name(mult, seed)
            if name in ledger:
                continue
            args.attn_res_lr_mult = mult
            config = budget.config_for(args, SIZE, "block", seed, BUDGET)
            record = timed_run(dataclasses.replace(config, out=str(Path(args.runs) / name)))
            refresh()
            ledger.add(name, {"size": SIZE, "residual": "block", "seed": seed, "budget": BUDGET,
                              "attn_res_lr_mult": mult, **record})
            progress(name, record)
            draw(ledger.runs, Path(args.figure))
    refresh()
    ledger.save()
    for row in summarise(ledger.runs):
        print(f"x{row['attn_res_lr_mult']:g}: Block {row['mean']:.4f}, gap {row['gap']['mean']:+.4f} "
              f"(n={row['gap']['n']}), {row['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
