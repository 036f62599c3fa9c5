"""Upcycle: does continuing a pretrained PreNorm model as AttnRes (`attnres train --init-from`) beat continuing it as it
is; and, from scratch, does Block's gap to standard widen with depth?

Continue: one standard model (12 layers, d=64) pretrained on the shared corpus (400 steps, cosine to a tenth), then
continued from its final/ for K steps (200; a fresh 20-step warm-up, cosine, peak lr 1e-3), one run per continuation
seed (the seed draws the batches; the weights are the pretrained ones, exactly), as
- standard;
- block (block size 2) and full, converted exactly at step 0 (zero pseudo-queries, rescaled mixture), the AttnRes
  parameters at `attnres train`'s 0.1x learning rate;
- block-frozen: Block with `--freeze-base`, the AttnRes parameters alone, at the peak lr (multiplier 1);
- standard-matched: standard for K x Block's step-time ratio steps, the steps it runs in Block's training time (the
  ratio measured side by side in this process, rounds of steps of each model in turn, as experiments/budget.py does).
Each arm's gap to continued standard is paired by seed (the same batches), with its 95% t interval; the
compute-matched gap is Block against standard-matched.

Depth: from scratch, Block (block size 2) against standard at 6, 12 and 24 layers (d=64), the same tokens (300 steps
of 16 x 128 bytes, cosine, peak lr 3e-3), 3 seeds; each depth's gap paired by seed, and the change of the gap from 6
to 24 layers (paired by seed) with its interval.

    python -m experiments.upcycle                          # both parts, seeds 0 1 2
    python -m experiments.upcycle --parts depth            # one part (two processes can share the ledger)

Writes docs/upcycle.json (after every run) and docs/figures/upcycle.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from attnres.analysis.stats import paired_gaps
from attnres.layers.kinds import BLOCK, FULL, STANDARD
from attnres.training import TrainConfig
from experiments.study import COMMON, Ledger, paired_by_seed, progress, step_times, timed_run, verdict

PRETRAIN = dict(layers=12, dim=64, heads=4, residual=STANDARD, steps=400, warmup=40)
CONTINUE = dict(lr=1e-3, warmup=20, block_size=2)
ARMS = {  # continuation arm -> its settings beyond CONTINUE
    STANDARD: dict(residual=STANDARD),
    BLOCK: dict(residual=BLOCK),
    FULL: dict(residual=FULL),
    "block-frozen": dict(residual=BLOCK, freeze_base=True, attn_res_lr_mult=1.0),
}
MATCHED = "standard-matched"  # standard for the steps it runs in Block's training time
DEPTHS = (6, 12, 24)
DEPTH = dict(dim=64, heads=4, block_size=2)
STEP_TIME = "step-time"  # the ledger entry holding the measured step-time ratios


def pretrain_config(args) -> TrainConfig:
    return TrainConfig(**COMMON, **PRETRAIN, seed=0, threads=args.threads, eval_interval=100, log_interval=10,
                       checkpoint_interval=PRETRAIN["steps"], out=str(Path(args.runs) / "pretrain"))


def continue_config(args, arm: str, seed: int, steps: int | None = None) -> TrainConfig:
    settings = {**COMMON, **CONTINUE, **ARMS.get(arm, ARMS[STANDARD])}
    steps = steps or args.steps
    return TrainConfig(**settings, init_from=str(Path(args.runs) / "pretrain" / "final"), seed=seed, steps=steps,
                       threads=args.threads, eval_interval=max(steps // 4, 1), log_interval=10,
                       checkpoint_interval=steps, out=str(Path(args.runs) / f"continue-{arm}-s{seed}"))


def depth_config(args, layers: int, residual: str, seed: int) -> TrainConfig:
    return TrainConfig(**COMMON, **DEPTH, layers=layers, residual=residual, seed=seed, steps=args.depth_steps,
                       threads=args.threads, eval_interval=max(args.depth_steps // 6, 1), log_interval=10,
                       checkpoint_interval=args.depth_steps, out=str(Path(args.runs) / f"depth-L{layers}-{residual}-s{seed}"))


def measure_step_times(args, rounds: int = 5, steps: int = 3) -> dict:
    """Each continuation arm's training-step time over continued standard's, side by side in this process: `rounds`
    rounds of `steps` steps of each model in turn (the same batch, AdamW as in training), the median of the rounds'
    ratios. The runs' own logs are not used: they ran beside other jobs whose load changed."""
    import torch

    from attnres.training.init_from import load_init_from
    from attnres.training.optim import build_optimizer

    torch.set_num_threads(args.threads)
    models = {}
    for arm in ARMS:
        config = continue_config(args, arm, 0)
        model = load_init_from(config)[0]
        models[arm] = model, build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                                             attn_res_lr_mult=config.attn_res_lr_mult, attn_res_weight_decay=0.0)
    batch = torch.randint(0, 256, (COMMON["batch_size"], COMMON["seq_len"]))
    times = step_times(models, batch, rounds, steps)
    ratios = {arm: [t / s for t, s in zip(times[arm], times[STANDARD])] for arm in times if arm != STANDARD}
    return {"kind": STEP_TIME, "ratio": {arm: statistics.median(r) for arm, r in ratios.items()}, "ratios": ratios,
            "seconds": times, "steps_per_round": steps, "threads": args.threads}


def matched_steps(args, ledger: Ledger) -> int:
    return round(args.steps * ledger.runs[STEP_TIME]["ratio"][BLOCK])


def run_continue(args, ledger: Ledger) -> None:
    if "pretrain" not in ledger:
        record = timed_run(pretrain_config(args))
        ledger.add("pretrain", {"kind": "pretrain", **record})
        progress("pretrain", record)
    if STEP_TIME not in ledger:
        ledger.add(STEP_TIME, measure_step_times(args))
        print(f"step time over standard: {ledger.runs[STEP_TIME]['ratio']}", flush=True)
    for seed in args.seeds:  # seed by seed, Block and its compute-matched standard first
        for arm in (STANDARD, BLOCK, MATCHED, FULL, "block-frozen"):
            name = f"continue-{arm}-s{seed}"
            if name in ledger:
                continue
            steps = matched_steps(args, ledger) if arm == MATCHED else args.steps
            record = timed_run(continue_config(args, arm, seed, steps))
            ledger.add(name, {"kind": "continue", "arm": arm, "seed": seed, **record})
            progress(name, record)
            draw(ledger.runs, Path(args.figure))


def run_depth(args, ledger: Ledger) -> None:
    for seed in args.seeds:
        for layers in DEPTHS:
            for residual in (STANDARD, BLOCK):
                name = f"depth-L{layers}-{residual}-s{seed}"
                if name in ledger:
                    continue
                record = timed_run(depth_config(args, layers, residual, seed))
                ledger.add(name, {"kind": "depth", "layers": layers, "residual": residual, "seed": seed, **record})
                progress(name, record)
                draw(ledger.runs, Path(args.figure))



def summarise(runs: dict) -> dict:
    by_arm: dict[str, dict[int, float]] = {}
    by_depth: dict[tuple[int, str], dict[int, float]] = {}
    for r in runs.values():
        if r.get("kind") == "continue":
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r["val_loss"]
        elif r.get("kind") == "depth":
            by_depth.setdefault((r["layers"], r["residual"]), {})[r["seed"]] = r["val_loss"]
    standard = by_arm.get(STANDARD, {})
    pretrain = runs.get("pretrain", {}).get("val_loss")
    arms = []
    for arm in [a for a in ARMS if a != STANDARD]:
        gap = paired_by_seed(by_arm.get(arm, {}), standard)
        arms.append({"arm": arm, "gap_to_standard": gap, "verdict": verdict(gap),
                     "minus_pretrained": paired_gaps([v - pretrain for v in by_arm.get(arm, {}).values()])
                     if pretrain else None})
    matched = paired_by_seed(by_arm.get(BLOCK, {}), by_arm.get(MATCHED, {}))
    depth = []
    for layers in DEPTHS:
        gap = paired_by_seed(by_depth.get((layers, BLOCK), {}), by_depth.get((layers, STANDARD), {}))
        depth.append({"layers": layers, "gap": gap, "verdict": verdict(gap)})

    def gaps_by_seed(layers: int) -> dict[int, float]:
        block, std = by_depth.get((layers, BLOCK), {}), by_depth.get((layers, STANDARD), {})
        return {s: block[s] - std[s] for s in block.keys() & std.keys()}

    widening = paired_by_seed(gaps_by_seed(DEPTHS[-1]), gaps_by_seed(DEPTHS[0]))
    step0 = [r["val_curve"][0][1] - pretrain for r in runs.values() if r.get("kind") == "continue" and pretrain]
    return {
        "pretrain_val_loss": pretrain,
        # every continuation's first evaluation against the pretrained model's last: the conversion is exact
        "step0_minus_pretrain_max_abs": max(map(abs, step0)) if step0 else None,
        "step_time_ratio": runs.get(STEP_TIME, {}).get("ratio"),
        "continue_val_loss": {arm: {str(s): v for s, v in sorted(seeds.items())} for arm, seeds in by_arm.items()},
        "continue": arms,
        "compute_matched": {"what": f"{BLOCK} minus {MATCHED}", "gap": matched, "verdict": verdict(matched),
                            "standard_steps": next((r["steps"] for r in runs.values() if r.get("arm") == MATCHED), None)},
        "depth_val_loss": {f"L{layers}-{res}": {str(s): v for s, v in sorted(seeds.items())}
                           for (layers, res), seeds in sorted(by_depth.items())},
        "depth": depth,
        "depth_widening": {"what": f"gap at L{DEPTHS[-1]} minus gap at L{DEPTHS[0]} (negative: AttnRes gains with "
                           f"depth)", "gap": widening, "verdict": verdict(widening)},
    }


def draw(runs: dict, path: Path) -> Path:
    """Left: each continuation arm's gap to continued standard (and Block's compute-matched gap), mean with its 95%
    interval and the seeds as dots. Right: Block minus standard from scratch against depth."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt

    summary = summarise(runs)
    rows = [(r["arm"], r["gap_to_standard"]) for r in summary["continue"]]
    rows.append((f"{BLOCK}\n(compute-matched)", summary["compute_matched"]["gap"]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, points, xlabel in (
        (ax, [(i, g) for i, (_, g) in enumerate(rows)], None),
        (bx, [(r["layers"], r["gap"]) for r in summary["depth"]], "decoder layers (d=64, from scratch)"),
    ):
        for x, g in points:
            if not g["n"]:
                continue
            axis.plot([x] * g["n"], g["gaps"], ".", color="grey", alpha=0.6)
            low, high = g["ci95"] or (g["mean"], g["mean"])
            axis.errorbar([x], [g["mean"]], yerr=[[g["mean"] - low], [high - g["mean"]]], fmt="o", color="C0",
                          capsize=4)
        axis.axhline(0, color="grey", lw=0.8)
        axis.grid(alpha=0.3)
        if xlabel:
            axis.set_xlabel(xlabel)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_ylabel("arm minus continued standard (nats/byte)")
    ax.set_title(f"continued from a pretrained L{PRETRAIN['layers']}-d{PRETRAIN['dim']} standard model", fontsize=9)
    bx.set_xscale("log", base=2)
    bx.set_xticks(DEPTHS, [str(d) for d in DEPTHS])
    bx.set_ylabel("Block minus standard (nats/byte)")
    bx.set_title("from scratch, same tokens", fontsize=9)
    fig.suptitle("Upcycle: mean gap with its 95% t interval, seeds as dots (docs/upcycle.json)", fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=["continue", "depth"], default=["continue", "depth"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200, help="continuation steps K (default: %(default)s)")
    p.add_argument("--depth-steps", type=int, default=300, help="from-scratch steps (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    p.add_argument("--runs", default="runs/upcycle", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/upcycle.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/upcycle.png", help="(default: %(default)s)")
    args = p.parse_args(argv)
    shared = {k: v for k, v in COMMON.items() if k not in ("progress", "overwrite")}
    setup = {"data": shared, "pretrain": PRETRAIN, "continue": {**CONTINUE, "steps": args.steps, "arms": ARMS},
             "depth": {**DEPTH, "layers": list(DEPTHS), "steps": args.depth_steps,
                       "lr": COMMON["lr"], "schedule": "cosine"}, "threads": args.threads}
    ledger = Ledger(args.json, "validation loss (nats/byte) of a pretrained standard model continued as standard, "
                    "Block, Full and frozen-base Block, and of Block against standard from scratch by depth",
                    setup, "experiments.upcycle", p, argv, summarise)
    for part in args.parts:
        (run_continue if part == "continue" else run_depth)(args, ledger)
    ledger.save()
    draw(ledger.runs, Path(args.figure))
    summary = summarise(ledger.runs)
    for row in summary["continue"]:
        g = row["gap_to_standard"]
        print(f"continue {row['arm']}: {g['mean'] if g['n'] else float('nan'):+.4f} (n={g['n']}), {row['verdict']}")
    for row in summary["depth"]:
        g = row["gap"]
        print(f"depth L{row['layers']}: {g['mean'] if g['n'] else float('nan'):+.4f} (n={g['n']}), {row['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
