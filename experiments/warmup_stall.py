"""Warm-up stall: does the PreNorm baseline stall under a short warm-up where AttnRes trains through?

`attnres compare`'s model (6 layers, d=96, Block size 2, 300 steps of 16 x 128 bytes, AdamW lr 3e-3 cosine, the
AttnRes parameters at the full learning rate) trained with several linear warm-ups, standard and Block, validation
loss every 20 steps. Every finished run is added to the JSON (written atomically) and the figure is redrawn, so an
interrupted experiment keeps what it measured and a rerun skips the runs already in the JSON.

    python -m experiments.warmup_stall                    # standard and Block, warm-up 30/60/100/150/200, seeds 0, 1
    python -m experiments.warmup_stall --seeds 0 --warmups 30 100   # a smaller grid

One thread per run by default (`--threads`), one run at a time. Writes docs/warmup_stall.json and
docs/figures/warmup_stall.png; docs/warmup_stall.md states what the data shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from attnres.layers.kinds import STANDARD
from attnres.training import TrainConfig
from experiments.study import LEARNED, PLATEAU, Ledger, plateau_steps, steps_to, timed_run


def run_name(residual: str, warmup: int, lr: float, seed: int) -> str:
    return f"{residual}-w{warmup}-lr{lr:g}-s{seed}"


def config_for(args, residual: str, warmup: int, lr: float, seed: int) -> TrainConfig:
    return TrainConfig(
        data="stdlib", max_bytes=4 * 2**20, steps=args.steps, layers=6, dim=96, block_size=2, seq_len=128,
        batch_size=16, lr=lr, warmup=warmup, attn_res_lr_mult=1.0, seed=seed, eval_interval=args.eval_interval,
        checkpoint_interval=args.steps, residual=residual, threads=args.threads, progress=False, overwrite=True,
        out=str(Path(args.runs) / run_name(residual, warmup, lr, seed)),
    )


def summarise(runs: dict) -> list[dict]:
    """Per (residual, warm-up, lr): final validation loss over seeds, the step each seed first got below `LEARNED`
    and the steps it spent in the `PLATEAU` band."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs.values():
        groups.setdefault((r["residual"], r["warmup"], r["lr"]), []).append(r)
    rows = []
    for (residual, warmup, lr), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        losses = [r["val_loss"] for r in sorted(rs, key=lambda r: r["seed"])]
        rows.append({
            "residual": residual, "warmup": warmup, "lr": lr, "seeds": sorted(r["seed"] for r in rs),
            "val_losses": losses, "mean": statistics.mean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else None,
            "steps_to_learned": [steps_to(r["val_curve"], LEARNED) for r in sorted(rs, key=lambda r: r["seed"])],
            "plateau_steps": [plateau_steps(r["val_curve"]) for r in sorted(rs, key=lambda r: r["seed"])],
        })
    return rows


def markdown(runs: dict) -> str:
    """One row per (lr, warm-up): each residual's final validation loss (mean, per seed), Block minus standard,
    and the steps each seed spent in the `PLATEAU` band."""
    rows = {(r["lr"], r["warmup"], r["residual"]): r for r in summarise(runs)}
    residuals = sorted({k[2] for k in rows}, key=lambda x: (x != STANDARD, x))
    head = ["lr", "warm-up"] + [f"{x} (per seed)" for x in residuals] + [f"{x} - standard" for x in residuals[1:]]
    head += [f"{x}: steps from {PLATEAU[0]} to {PLATEAU[1]}" for x in residuals]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for lr, warmup in sorted({k[:2] for k in rows}):
        got = [rows.get((lr, warmup, x)) for x in residuals]
        cells = [f"{lr:g}", str(warmup)]
        cells += [f"{g['mean']:.3f} ({', '.join(f'{v:.3f}' for v in g['val_losses'])})" if g else "" for g in got]
        base = got[0]
        cells += [f"{g['mean'] - base['mean']:+.3f}" if g and base else "" for g in got[1:]]
        cells += [", ".join(str(s) for s in g["plateau_steps"]) if g else "" for g in got]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(runs: dict, path: Path) -> Path:
    """Validation loss against step, one panel per warm-up (and lr), standard and Block in each, one line per seed."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt

    panels = sorted({(r["lr"], r["warmup"]) for r in runs.values()})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.8), sharey=True, squeeze=False)
    colors = {"standard": "C0", "block": "C1", "full": "C2"}
    for ax, (lr, warmup) in zip(axes[0], panels):
        for r in sorted(runs.values(), key=lambda r: (r["residual"], r["seed"])):
            if (r["lr"], r["warmup"]) != (lr, warmup):
                continue
            steps, losses = zip(*r["val_curve"])
            ax.plot(steps, losses, "-", marker=".", color=colors.get(r["residual"], "C3"),
                    alpha=1.0 if r["seed"] == 0 else 0.5, label=f"{r['residual']} seed {r['seed']}")
        ax.axvline(warmup, color="grey", lw=0.8, ls=":")
        ax.set_title(f"warm-up {warmup} steps, lr {lr:g}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(1.5, 3.6)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats per byte)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("6 layers, d=96, 300 steps of 16 x 128 bytes: validation loss by warm-up (dotted: end of warm-up)",
                 fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--residuals", nargs="+", default=["standard", "block"])
    p.add_argument("--warmups", nargs="+", type=int, default=[30, 60, 100, 150, 200])
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-3])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    p.add_argument("--runs", default="runs/warmup_stall", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/warmup_stall.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/warmup_stall.png", help="(default: %(default)s)")
    args = p.parse_args(argv)

    setup = {k: v for k, v in config_for(args, "standard", 0, args.lrs[0], 0).to_dict().items()
             if k in ("layers", "dim", "block_size", "seq_len", "batch_size", "steps", "schedule", "min_lr_ratio",
                      "weight_decay", "attn_res_lr_mult", "max_bytes", "eval_batches", "threads")}
    ledger = Ledger(args.json, "attnres compare's model and data; final validation loss (nats/byte) and its curve by "
                    "warm-up, residual and seed", {**setup, "learned_threshold": LEARNED, "plateau_band": PLATEAU},
                    "experiments.warmup_stall", p, argv, summarise)
    # seed by seed, so the first seed of every setting lands first; the baseline first within a seed
    for seed in args.seeds:
        for lr in args.lrs:
            for residual in args.residuals:
                for warmup in args.warmups:
                    name = run_name(residual, warmup, lr, seed)
                    if name in ledger:
                        continue
                    record = timed_run(config_for(args, residual, warmup, lr, seed))
                    ledger.add(name, {"residual": residual, "warmup": warmup, "lr": lr, "seed": seed, **record})
                    print(f"{name}: val {record['val_loss']:.4f}, below {LEARNED} at step "
                          f"{steps_to(record['val_curve'], LEARNED)}, {record['wall_s']:.0f} s wall", flush=True)
                    draw(ledger.runs, Path(args.figure))
    ledger.save()
    draw(ledger.runs, Path(args.figure))
    print(markdown(ledger.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
