"""Budget: the gap between AttnRes and the PreNorm baseline against tokens trained, and against training time.

Two model sizes (6 layers d=64, and 12 layers d=64), Block AttnRes (block size 2) and standard, three seeds, trained
with a warmup-stable-decay schedule (100 warm-up steps, peak lr 3e-3, the last fifth decaying to a tenth). One run
per (size, residual, seed) goes to the largest budget; each smaller budget branches its decay from that run's
checkpoint at its own decay start (`attnres train --branch-from`), which ends exactly as a run of that budget from
scratch would (tests/training/test_branch.py), at the cost of the decay steps only.

    python -m experiments.budget                      # 150/300/600/1200 steps (8x), seeds 0 1 2, both sizes
    python -m experiments.budget --seeds 0 --sizes L6-d64 --budgets 150 300     # a smaller grid
    python -m experiments.budget --measure-step-time     # Block's step-time ratio per size, for compute-matched gaps

Per budget: the validation loss of every run, the gap (Block minus standard, paired by seed) with its mean, standard
deviation and 95% t interval, and the compute-matched gap: Block at budget B against standard at the tokens it trains
in the same time (B times Block's step-time ratio; interpolated in log tokens between standard's budgets, so only
where that stays inside them). The ratio is measured side by side in one process (`--measure-step-time`, rounds of
steps of each model in turn), not from the runs' logs: on a shared machine their load differs run to run.
Writes docs/budget.json (after every run), docs/budget_step_time.json and docs/figures/budget.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

from attnres.analysis.stats import paired_gaps
from attnres.atomic import atomic_write_text
from attnres.training import TrainConfig
from attnres.training.optim import wsd_decay_start
from experiments.study import COMMON, Ledger, progress, step_times, timed_run, verdict

SIZES = {"L6-d64": dict(layers=6, dim=64, heads=4, block_size=2), "L12-d64": dict(layers=12, dim=64, heads=4, block_size=2)}
WARMUP, DECAY = 100, 0.2
STEP_TIME_JSON = "docs/budget_step_time.json"


def run_name(size: str, residual: str, seed: int, budget: int) -> str:
    return f"{size}-{residual}-s{seed}-b{budget}"


def config_for(args, size: str, residual: str, seed: int, budget: int, branch_from: str | None = None) -> TrainConfig:
    return TrainConfig(
        **COMMON, **SIZES[size], residual=residual, seed=seed, steps=budget, warmup=WARMUP, schedule="wsd",
        decay_fraction=DECAY, attn_res_lr_mult=args.attn_res_lr_mult, threads=args.threads, log_interval=10,
        eval_interval=max(budget // 6, 10), checkpoint_interval=math.gcd(*decay_starts(args.budgets)),
        keep_checkpoints=10_000, branch_from=branch_from, out=str(Path(args.runs) / run_name(size, residual, seed, budget)),
    )


def decay_starts(budgets: list[int]) -> list[int]:
    return [wsd_decay_start(steps=b, warmup=WARMUP, decay_fraction=DECAY) for b in budgets]


def run_seed(args, ledger: Ledger, size: str, residual: str, seed: int) -> None:
    """The largest budget's run, then each smaller budget's branch from it."""
    top = max(args.budgets)
    main_name = run_name(size, residual, seed, top)
    if main_name not in ledger:
        record = timed_run(config_for(args, size, residual, seed, top))
        ledger.add(main_name, {"size": size, "residual": residual, "seed": seed, "budget": top, **record})
        progress(main_name, record)
    main = ledger.runs[main_name]
    clock = dict(main["train_s_by_step"])
    for budget, start in zip(args.budgets, decay_starts(args.budgets)):
        name = run_name(size, residual, seed, budget)
        if budget == top or name in ledger:
            continue
        source = Path(args.runs) / main_name / "checkpoints" / f"step-{start:06d}"
        record = timed_run(config_for(args, size, residual, seed, budget, branch_from=str(source)))
        # the branch's own steps, plus the steps of the run it branched from up to its start
        record["train_s"] += clock[start]
        ledger.add(name, {"size": size, "residual": residual, "seed": seed, "budget": budget, "branched_at": start,
                          **record})
        progress(name, record)


def summarise(runs: dict, ratios: dict[str, float] | None = None) -> list[dict]:
    """Per (size, budget): each residual's losses by seed, the gap paired by seed, and, given Block's step-time ratio
    per size (`ratios`, from `measure_step_time`), the compute-matched gap."""
    rows = []
    for size in sorted({r["size"] for r in runs.values()}):
        mine = [r for r in runs.values() if r["size"] == size]
        by = {(r["residual"], r["seed"], r["budget"]): r for r in mine}
        budgets = sorted({r["budget"] for r in mine})
        seeds = sorted({r["seed"] for r in mine})
        ratio = (ratios or {}).get(size)
        for budget in budgets:
            both = [s for s in seeds if ("standard", s, budget) in by and ("block", s, budget) in by]
            gaps = [by["block", s, budget]["val_loss"] - by["standard", s, budget]["val_loss"] for s in both]
            matched = []
            for s in both:
                standard = sorted((b, by["standard", s, b]["val_loss"]) for b in budgets if ("standard", s, b) in by)
                at = interpolate_log(standard, budget * ratio) if ratio else None
                if at is not None:
                    matched.append(by["block", s, budget]["val_loss"] - at)
            stats, matched_stats = paired_gaps(gaps), paired_gaps(matched)
            rows.append({
                "size": size, "budget": budget, "tokens": budget * mine[0]["tokens"] // mine[0]["steps"],
                "num_params": {res: next((r["num_params"] for r in mine if r["residual"] == res), None)
                               for res in ("standard", "block")},
                "val_loss": {res: {str(s): by[res, s, budget]["val_loss"] for s in seeds if (res, s, budget) in by}
                             for res in ("standard", "block")},
                "gap": stats, "verdict": verdict(stats),
                "step_time_ratio": ratio, "compute_matched_gap": matched_stats,
                "compute_matched_verdict": verdict(matched_stats),
            })
    return rows


def measure_step_time(args, size: str, rounds: int, steps: int) -> dict:
    """Block's training-step time over standard's for `size`, side by side in this process: `rounds` rounds of
    `steps` steps of each model in turn (the same random batch, AdamW as in training), the median of the rounds'
    ratios. The runs' own logged step times are not used: they ran beside other jobs whose load changed."""
    import torch

    from attnres.training.loop import build_model
    from attnres.training.optim import build_optimizer

    torch.set_num_threads(args.threads)
    config = config_for(args, size, "standard", 0, max(args.budgets))
    batch = torch.randint(0, 256, (config.batch_size, config.seq_len))
    models = {}
    for residual in ("standard", "block"):
        model = build_model(dataclasses.replace(config, residual=residual), 256).train()
        models[residual] = (model, build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                                                   attn_res_lr_mult=config.attn_res_lr_mult, attn_res_weight_decay=0.0))

    times = step_times(models, batch, rounds, steps)
    ratios = [b / s for b, s in zip(times["block"], times["standard"])]
    return {"ratio": statistics.median(ratios), "ratios": ratios, "seconds": times, "steps_per_round": steps,
            "threads": args.threads}


def step_time_ratios(path: str | Path = STEP_TIME_JSON) -> dict[str, float] | None:
    """Block's measured step-time ratio per size (`--measure-step-time`'s file; None before it is measured)."""
    path = Path(path)
    return ({size: m["ratio"] for size, m in json.loads(path.read_text(encoding="utf-8"))["sizes"].items()}
            if path.is_file() else None)


def interpolate_log(points: list[tuple[int, float]], x: float) -> float | None:
    """The loss at `x` steps, linear in log(steps) between the two budgets around it (None outside them)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1] if points and x == points[-1][0] else None


def draw(runs: dict, path: Path, ratios: dict[str, float] | None = None) -> Path:
    """Left: validation loss against tokens, per size and residual (mean over seeds, seeds as dots). Right: the gap
    against tokens with its 95% interval, by tokens and compute-matched."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = summarise(runs, ratios)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, size in enumerate(sorted({r["size"] for r in rows})):
        mine = [r for r in rows if r["size"] == size]
        tokens = [r["tokens"] for r in mine]
        for res, style, marker in (("standard", "-", "o"), ("block", "--", "s")):
            means = [statistics.mean(r["val_loss"][res].values()) if r["val_loss"][res] else math.nan for r in mine]
            ax.plot(tokens, means, style, color=f"C{i}", marker=marker, mfc="none", label=f"{size} {res}")
            for t, r in zip(tokens, mine):
                ax.plot([t] * len(r["val_loss"][res]), list(r["val_loss"][res].values()), ".", color=f"C{i}", alpha=0.4)
        for key, marker, shift in (("gap", "o", 1.0), ("compute_matched_gap", "s", 1.04)):
            pts = [(r["tokens"] * shift, r[key]) for r in mine if r[key]["n"]]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = [g["mean"] for _, g in pts]
            err = [[g["mean"] - g["ci95"][0] if g["ci95"] else 0 for _, g in pts],
                   [g["ci95"][1] - g["mean"] if g["ci95"] else 0 for _, g in pts]]
            bx.errorbar(xs, ys, yerr=err, fmt=marker + ("-" if key == "gap" else ":"), color=f"C{i}", capsize=3,
                        label=f"{size}, {'by tokens' if key == 'gap' else 'compute-matched'}")
    for a in (ax, bx):
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
        a.set_xlabel("training tokens")
        a.grid(alpha=0.3)
    ax.set_ylabel("validation loss (nats per byte)")
    ax.legend(fontsize=7)
    bx.axhline(0, color="grey", lw=0.8)
    bx.set_ylabel("Block minus standard (nats/byte)")
    bx.legend(fontsize=7)
    fig.suptitle("Budget: WSD runs with decays branched at each budget (docs/budget.json)", fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--budgets", nargs="+", type=int, default=[150, 300, 600, 1200], help="steps (default: %(default)s)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--attn-res-lr-mult", type=float, default=0.1, help="(default: %(default)s, `attnres train`'s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    p.add_argument("--runs", default="runs/budget", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/budget.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/budget.png", help="(default: %(default)s)")
    p.add_argument("--measure-step-time", metavar="JSON", nargs="?", const=STEP_TIME_JSON,
                   help="only measure Block's step-time ratio per size, side by side in one process, into JSON "
                   "(default: docs/budget_step_time.json); the compute-matched gaps use it")
    args = p.parse_args(argv)
    if min(args.budgets) <= WARMUP:
        p.error(f"--budgets: expected budgets above the {WARMUP}-step warm-up, got {min(args.budgets)}")
    args.budgets = sorted(set(args.budgets))
    if args.measure_step_time:
        measured = {size: measure_step_time(args, size, rounds=7, steps=5) for size in args.sizes}
        command = shlex.join(["python", "experiments/budget.py", *(sys.argv[1:] if argv is None else argv)])
        atomic_write_text(Path(args.measure_step_time), json.dumps({"command": command, "sizes": measured}, indent=1))
        for size, m in measured.items():
            print(f"{size}: Block step time {m['ratio']:.3f}x standard (rounds {', '.join(f'{r:.2f}' for r in m['ratios'])})")
        return 0
    setup = {k: v for k, v in config_for(args, args.sizes[0], "standard", 0, max(args.budgets)).to_dict().items()
             if k in ("lr", "warmup", "schedule", "decay_fraction", "min_lr_ratio", "weight_decay", "attn_res_lr_mult",
                      "seq_len", "batch_size", "max_bytes", "eval_batches", "threads")}
    ratios = step_time_ratios()
    ledger = Ledger(args.json, "validation loss (nats/byte) of standard and Block AttnRes by budget, size and seed; "
                    "WSD decays branched from one run per (size, residual, seed)",
                    {**setup, "sizes": SIZES, "budgets": args.budgets}, "experiments.budget", p, argv,
                    lambda runs: summarise(runs, ratios))
    for seed in args.seeds:  # seed by seed: every size and budget gets its first seeds first
        for size in args.sizes:
            for residual in ("standard", "block"):
                run_seed(args, ledger, size, residual, seed)
                draw(ledger.runs, Path(args.figure), ratios)
    ledger.save()
    for row in summarise(ledger.runs, ratios):
        g = row["gap"]
        print(f"{row['size']} {row['budget']} steps: gap {g['mean']:+.4f} (n={g['n']}), {row['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
