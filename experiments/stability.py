"""Stability: final validation loss against peak learning rate and warm-up length, for standard, Block and Full.

`attnres compare`'s model (6 layers, d=96, Block size 2) and data, 200 steps of 16 x 128 bytes, AdamW with a cosine
decay to a tenth, the AttnRes parameters at `attnres train`'s 0.1x learning rate, seed 0. Peak lr 1e-3 to 1e-2, a
short warm-up (20 steps, a tenth of the run) and a long one (100 steps, half of it). A run whose
loss or gradient norm becomes NaN or inf is recorded as diverged at that step; one that never gets below 2.9
nats/byte as stuck. The steps a run spends on the plateau between 3.2 and 2.9 nats/byte (where short warm-ups stall
PreNorm: docs/warmup_stall.md) measure a stall.

    python -m experiments.stability                       # 4 lrs x 2 warm-ups x 3 residuals, about 40 minutes
    python -m experiments.stability --lrs 3e-3 --warmups 20   # a smaller grid

Writes docs/stability.json (after every run) and docs/figures/stability.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnres.layers.kinds import BLOCK, FULL, STANDARD
from attnres.training import TrainConfig, TrainingDiverged
from experiments.study import COMMON, PLATEAU, Ledger, plateau_steps, progress, steps_to, timed_run

RESIDUALS = (STANDARD, BLOCK, FULL)  # the order its tables report them in


def run_name(residual: str, lr: float, warmup: int, seed: int) -> str:
    return f"{residual}-lr{lr:g}-w{warmup}-s{seed}"


def config_for(args, residual: str, lr: float, warmup: int, seed: int) -> TrainConfig:
    return TrainConfig(
        **{**COMMON, "lr": lr}, layers=6, dim=96, block_size=2, residual=residual, seed=seed, steps=args.steps,
        warmup=warmup, threads=args.threads, eval_interval=20, log_interval=10, checkpoint_interval=args.steps,
        out=str(Path(args.runs) / run_name(residual, lr, warmup, seed)),
    )


def run_one(config: TrainConfig) -> dict:
    try:
        return timed_run(config)
    except TrainingDiverged as e:
        return {"diverged_at": e.step, "val_loss": None}


def outcome(record: dict) -> str:
    """'diverged' (NaN or inf), 'stuck' (never below the plateau's lower edge), or 'trained'."""
    if record.get("diverged_at") is not None:
        return "diverged"
    return "stuck" if steps_to(record["val_curve"], PLATEAU[1]) is None else "trained"


def summarise(runs: dict) -> list[dict]:
    """Per (warm-up, lr): each residual's outcome, final validation loss and steps spent on the plateau."""
    rows = {}
    for r in runs.values():
        row = rows.setdefault((r["warmup"], r["lr"]), {"warmup": r["warmup"], "lr": r["lr"]})
        row[r["residual"]] = {"outcome": outcome(r), "val_loss": r["val_loss"], "diverged_at": r.get("diverged_at"),
                              "plateau_steps": plateau_steps(r["val_curve"]) if "val_curve" in r else None}
    return [rows[k] for k in sorted(rows)]


def draw(runs: dict, path: Path) -> Path:
    """One panel per warm-up: final validation loss against peak lr, one line per residual; a diverged run is an x at
    the top of the panel, a stuck one a hollow marker."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    warmups = sorted({r["warmup"] for r in runs.values()})
    fig, axes = plt.subplots(1, len(warmups), figsize=(4.6 * len(warmups), 3.9), sharey=True, squeeze=False)
    finite = [r["val_loss"] for r in runs.values() if outcome(r) != "diverged"]
    top = max(finite) + 0.1 if finite else 4.0
    for ax, warmup in zip(axes[0], warmups):
        for i, residual in enumerate(RESIDUALS):
            mine = sorted((r for r in runs.values() if r["warmup"] == warmup and r["residual"] == residual),
                          key=lambda r: r["lr"])
            ok = [r for r in mine if outcome(r) != "diverged"]
            ax.plot([r["lr"] for r in ok], [r["val_loss"] for r in ok], "-", color=f"C{i}", label=residual)
            for r in ok:
                ax.plot(r["lr"], r["val_loss"], "o", color=f"C{i}", mfc="none" if outcome(r) == "stuck" else f"C{i}")
            for r in mine:
                if outcome(r) == "diverged":
                    ax.plot(r["lr"], top, "x", color=f"C{i}", ms=9, mew=2)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"warm-up {warmup} steps", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final validation loss (nats per byte)")
    axes[0][0].legend(fontsize=8, title=f"x: diverged, hollow: never below {PLATEAU[1]}", title_fontsize=7)
    fig.suptitle("Stability: 6 layers, d=96, 200 steps (docs/stability.json)", fontsize=10)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 2.5e-3, 5e-3, 1e-2])
    p.add_argument("--warmups", nargs="+", type=int, default=[20, 100])
    p.add_argument("--residuals", nargs="+", choices=RESIDUALS, default=list(RESIDUALS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default: %(default)s)")
    p.add_argument("--runs", default="runs/stability", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/stability.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/stability.png", help="(default: %(default)s)")
    args = p.parse_args(argv)
    setup = {k: v for k, v in config_for(args, "standard", args.lrs[0], args.warmups[0], 0).to_dict().items()
             if k in ("layers", "dim", "block_size", "steps", "schedule", "min_lr_ratio", "weight_decay",
                      "attn_res_lr_mult", "seq_len", "batch_size", "max_bytes", "eval_batches", "threads")}
    ledger = Ledger(args.json, "final validation loss (nats/byte) and curve by peak lr, warm-up and residual",
                    {**setup, "plateau_band": PLATEAU},
                    "experiments.stability", p, argv, summarise)
    for seed in args.seeds:
        for warmup in args.warmups:
            for lr in args.lrs:
                for residual in args.residuals:
                    name = run_name(residual, lr, warmup, seed)
                    if name in ledger:
                        continue
                    record = run_one(config_for(args, residual, lr, warmup, seed))
                    ledger.add(name, {"residual": residual, "lr": lr, "warmup": warmup, "seed": seed, **record})
                    if outcome(record) == "diverged":
                        print(f"{name}: diverged at step {record['diverged_at']}", flush=True)
                    else:
                        progress(name, record)
                    draw(ledger.runs, Path(args.figure))
    ledger.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
