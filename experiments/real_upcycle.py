"""What continued training with AttnRes gives a real pretrained model: SmolLM2-135M-Instruct (`attnres fetch
smollm2-135m`) continued on real text as itself (standard), as Block (block size 5) and as Full, both converted
exactly at step 0, and as Block with its base frozen.

Every arm is one `attnres train --init-from FOLDER` run (`attnres.training.train`, what the command runs) on the same
tokens with the same schedule: the Python standard library's sources in SmolLM2's own tokenizer, the last 5% of the
files held out for validation, K steps of 2 x 256 tokens, a 5-step warm-up and cosine to a tenth of a fine-tuning peak
lr of 5e-5. Block and Full train their AttnRes parameters (pseudo-queries and key gains, from zero queries) at the
same lr as the base (`--attn-res-lr-mult 1`: with Adam each query coordinate moves by about the lr a step, and a score
sums d = 576 of them); frozen-base Block trains them alone, at 10x. One run per seed (the seed draws the batches; the
weights are the pretrained ones, exactly); each arm's gap to continued standard is paired by seed with its 95% t
interval. Compute-matched: standard for K x Block's step-time ratio steps, the ratio measured side by side in this
process (rounds of steps of each model in turn).

After each AttnRes run, the mean depth weights of its final model on held-out text (which sources each point reads:
the paper's figure 8) go into the ledger and the figure.

    python -m experiments.real_upcycle                 # every arm, seeds 0 1 2 (resumes where it stopped)
    python -m experiments.real_upcycle --device cuda   # the same study on a GPU

Writes docs/real_upcycle.json (after every run), docs/figures/real_upcycle.png and docs/figures/real_depth_weights.png.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from attnres.layers.kinds import BLOCK, FULL, STANDARD
from attnres.training import TrainConfig
from experiments.study import Ledger, paired_by_seed, progress, step_times, timed_run, verdict

MODEL = "smollm2-135m"
DATA = dict(data="stdlib", max_bytes=4 * 2**20, seq_len=256, batch_size=2, eval_batches=16)
CONTINUE = dict(lr=5e-5, warmup=5, block_size=5, attn_res_lr_mult=1.0)
ARMS = {  # arm -> its settings beyond CONTINUE
    STANDARD: dict(residual=STANDARD),
    BLOCK: dict(residual=BLOCK),
    FULL: dict(residual=FULL),
    "block-frozen": dict(residual=BLOCK, freeze_base=True, attn_res_lr_mult=10.0),
}
MATCHED = "standard-matched"  # standard for the steps it runs in Block's training time
STEP_TIME = "step-time"
ORDER = (STANDARD, BLOCK, MATCHED, FULL, "block-frozen")


def continue_config(args, arm: str, seed: int, steps: int | None = None) -> TrainConfig:
    steps = steps or args.steps
    settings = {**CONTINUE, "warmup": min(CONTINUE["warmup"], steps), **ARMS.get(arm, ARMS[STANDARD])}
    return TrainConfig(**DATA, **settings, init_from=str(args.folder), seed=seed,
                       steps=steps, threads=args.threads, device=args.device, eval_interval=max(steps // 2, 1),
                       log_interval=5, checkpoint_interval=max(steps // 2, 1), resume=True, progress=False,
                       out=str(Path(args.runs) / f"{arm}-s{seed}"))


def measure_step_times(args, rounds: int = 5, steps: int = 2) -> dict:
    """Each arm's training-step time over standard's, side by side in this process (the same batch, the runs'
    optimizer): the median of `rounds` rounds' ratios."""
    import torch

    from attnres.training.init_from import load_init_from
    from attnres.training.optim import build_optimizer

    torch.set_num_threads(args.threads)
    models = {}
    for arm in ARMS:
        config = continue_config(args, arm, 0)
        model, tokenizer, pretrained = load_init_from(config)
        pretrained.load(model, args.device if args.device != "auto" else "cpu", seed=0, progress=False)
        models[arm] = model, build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                                             attn_res_lr_mult=config.attn_res_lr_mult, attn_res_weight_decay=0.0)
    device = next(models[STANDARD][0].parameters()).device
    batch = torch.randint(0, tokenizer.vocab_size, (DATA["batch_size"], DATA["seq_len"]), device=device)
    times = step_times(models, batch, rounds, steps)
    ratios = {arm: [t / s for t, s in zip(times[arm], times[STANDARD])] for arm in times if arm != STANDARD}
    return {"kind": STEP_TIME, "ratio": {arm: statistics.median(r) for arm, r in ratios.items()}, "ratios": ratios,
            "seconds": times, "steps_per_round": steps, "threads": args.threads}


def depth_weights(run_dir: Path, threads: int) -> list[list[float]]:
    """The mean depth weights of a run's final model at each aggregation point, on held-out text."""
    import torch
    from transformers import AutoModelForCausalLM

    from attnres.analysis.profile import depth_profile
    from attnres.training.data import HFTokenizer, eval_batches, read_corpus, tokenize_and_split

    torch.set_num_threads(threads)
    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    splits = tokenize_and_split(read_corpus(DATA["data"], DATA["max_bytes"]), HFTokenizer(str(final)), 0.05)
    batch = eval_batches(splits.val, DATA["seq_len"], 4, 1)[0]
    return [w.tolist() for w in depth_profile(model, batch).weights]


def run_all(args, ledger: Ledger) -> None:
    if STEP_TIME not in ledger:
        ledger.add(STEP_TIME, measure_step_times(args))
        print(f"step time over standard: {ledger.runs[STEP_TIME]['ratio']}", flush=True)
    for seed in args.seeds:
        for arm in ORDER:
            name = f"{arm}-s{seed}"
            if name in ledger:
                continue
            steps = round(args.steps * ledger.runs[STEP_TIME]["ratio"][BLOCK]) if arm == MATCHED else args.steps
            config = continue_config(args, arm, seed, steps)
            record = timed_run(config)
            run_dir = Path(config.out)
            if arm in (BLOCK, FULL, "block-frozen"):
                record["depth_weights"] = depth_weights(run_dir, args.threads)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # resuming is done; the final model stays
            ledger.add(name, {"kind": "continue", "arm": arm, "seed": seed, **record})
            progress(name, record)
            draw(ledger.runs, Path(args.figure))



def summarise(runs: dict) -> dict:
    by_arm: dict[str, dict[int, float]] = {}
    step0: list[tuple[int, float]] = []  # each run's first evaluation (step, loss)
    for r in runs.values():
        if r.get("kind") == "continue":
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r["val_loss"]
            step0.append(r["val_curve"][0])
    standard = by_arm.get(STANDARD, {})
    arms = [{"arm": arm, "gap_to_standard": (gap := paired_by_seed(by_arm.get(arm, {}), standard)), "verdict": verdict(gap)}
            for arm in ORDER if arm != STANDARD]
    matched = paired_by_seed(by_arm.get(BLOCK, {}), by_arm.get(MATCHED, {}))
    return {
        # every run's evaluation at step 0: the pretrained model's own loss, for every arm (the conversion is exact)
        "step0_val_loss": sorted({round(v, 6) for s, v in step0 if s == 0}),
        "step_time_ratio": runs.get(STEP_TIME, {}).get("ratio"),
        "val_loss": {arm: {str(s): v for s, v in sorted(seeds.items())} for arm, seeds in by_arm.items()},
        "continue": arms,
        "compute_matched": {"what": f"{BLOCK} minus {MATCHED}", "gap": matched, "verdict": verdict(matched),
                            "standard_steps": next((r["steps"] for r in runs.values() if r.get("arm") == MATCHED), None)},
    }


def draw(runs: dict, path: Path) -> list[Path]:
    """The gaps (mean, 95% interval, seeds as dots) and the depth weights of seed 0's Block and Full models."""
    from attnres.analysis.plots import save_figure  # first: it selects the file-only backend
    import matplotlib.pyplot as plt

    from attnres.analysis.profile import depth_weight_matrix

    summary = summarise(runs)
    rows = [(r["arm"], r["gap_to_standard"]) for r in summary["continue"]]
    rows.append((f"{BLOCK}\n(compute-matched)", summary["compute_matched"]["gap"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    for x, (_, g) in enumerate(rows):
        if not g["n"]:
            continue
        ax.plot([x] * g["n"], g["gaps"], ".", color="grey", alpha=0.6)
        low, high = g["ci95"] or (g["mean"], g["mean"])
        ax.errorbar([x], [g["mean"]], yerr=[[g["mean"] - low], [high - g["mean"]]], fmt="o", color="C0", capsize=4)
    ax.axhline(0, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_ylabel("arm minus continued standard (nats/token)")
    ax.set_title("SmolLM2-135M continued: mean gap, 95% t interval, seeds as dots", fontsize=9)
    paths = [save_figure(fig, path)]

    profiles = [(arm, runs[f"{arm}-s0"]["depth_weights"]) for arm in (BLOCK, FULL) if "depth_weights" in
                runs.get(f"{arm}-s0", {})]
    if profiles:
        import torch

        fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 7), squeeze=False)
        for ax, (arm, weights) in zip(axes[0], profiles):
            mat = depth_weight_matrix([torch.tensor(w) for w in weights])
            im = ax.imshow(mat.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_ylabel("aggregation point (2i: before attention of layer i, 2i+1: before its MLP; last: final)")
            ax.set_xlabel("source (0 = embedding" + (", last = current block prefix)" if arm == BLOCK else ")"))
            ax.set_title(f"{arm}: mean depth weights after continued training (seed 0)", fontsize=9)
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="mean depth weight")
        paths.append(save_figure(fig, path.with_name("real_depth_weights.png")))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=50, help="continuation steps K (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="(default: %(default)s)")
    p.add_argument("--folder", default=None, help="the pretrained folder (default: `attnres fetch smollm2-135m`'s)")
    p.add_argument("--runs", default="runs/real_upcycle", help="run folders (default: %(default)s)")
    p.add_argument("--json", default="docs/real_upcycle.json", help="results (default: %(default)s)")
    p.add_argument("--figure", default="docs/figures/real_upcycle.png", help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.folder is None:
        from attnres.models.fetch import fetch

        args.folder = fetch(MODEL)
    setup = {"model": MODEL, "data": DATA, "continue": {**CONTINUE, "steps": args.steps, "schedule": "cosine",
             "arms": ARMS}, "threads": args.threads, "device": args.device}
    ledger = Ledger(args.json, "validation loss (nats/token) of SmolLM2-135M-Instruct continued as standard, Block, "
                    "Full and frozen-base Block on the Python standard library's sources", setup,
                    "experiments.real_upcycle", p, argv, summarise)
    run_all(args, ledger)
    ledger.save()
    draw(ledger.runs, Path(args.figure))
    for row in summarise(ledger.runs)["continue"]:
        g = row["gap_to_standard"]
        print(f"{row['arm']}: {g['mean'] if g['n'] else float('nan'):+.4f} (n={g['n']}), {row['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
