"""Small-scale reproduction of the paper's comparison (DESIGN section 9): standard vs Full vs Block AttnRes.

Every run trains a byte-level LM on the Python standard library's sources with the same tokens, seeds and schedule;
AttnRes runs sweep the learning-rate multiplier of their pseudo-queries and key gains. Finished runs are kept
(`<out>/runs/<name>/`), so an interrupted reproduction continues where it stopped. The results page (`--page`,
default docs/results.md) gets the tables, the per-layer magnitude pictures and the exact command.

    python experiments/reproduce.py            # the full grid (24 runs), about an hour on 2 cores
    python experiments/reproduce.py --quick    # a smoke test of the whole pipeline in a minute or two
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from tqdm import tqdm

from attnres.analysis import depth_profile
from attnres.analysis.plots import plot_layer_curves
from attnres.analysis.report import profile_batch, profile_from_json, profile_to_json
from attnres.training import TrainConfig, train
from attnres.training.checkpoint import atomic_write_text

PAPER = """Paper (Kimi Team 2026), for scale: Block AttnRes (N=8) about 0.02 lower validation loss than PreNorm at every
size from 194M to 528M activated parameters; at 436M: baseline 1.766, Full 1.737, Block 1.746. DESIGN section 9,
byte-level stdlib LM, 600 steps: 6 layers d=128: PreNorm 1.990, Block 1.965, Full 1.956 with the AttnRes
parameters at 0.1x the learning rate (2.088 and 2.049 at 1x)."""

SIZES = {
    "L6-d64": dict(layers=6, dim=64, heads=4, block_size=2),
    "L12-d64": dict(layers=12, dim=64, heads=4, block_size=3),
}


def grid(args) -> list[tuple[str, str, str, float, int, TrainConfig]]:
    """(name, size, residual, lr multiplier, seed, config) of every run, standard first. The multiplier is swept
    at the first size; the deeper size (the slower one) runs AttnRes at `--deep-mult` only."""
    runs = []
    for i, (size, shape) in enumerate(SIZES.items()):
        for residual in ("standard", "full", "block"):
            mults = [1.0] if residual == "standard" else args.mults if i == 0 else [args.deep_mult]
            for mult in mults:
                for seed in range(args.seeds):
                    name = f"{size}-{residual}-x{mult:g}-s{seed}"
                    config = TrainConfig(
                        residual=residual, attn_res_lr_mult=mult, seed=seed, steps=args.steps,
                        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, max_bytes=args.max_bytes,
                        eval_interval=max(args.steps // 4, 1), eval_batches=args.eval_batches,
                        checkpoint_interval=args.steps, out=str(Path(args.out) / "runs" / name), progress=False,
                        **shape,
                    )
                    runs.append((name, size, residual, mult, seed, config))
    return runs


def _run_one(job) -> tuple[str, dict]:
    """One training run in a worker process (one thread: the workers share the machine's cores)."""
    name, size, residual, mult, seed, config, batch = job
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = train(dataclasses.replace(config, overwrite=True))
    entry = {"size": size, "residual": residual, "mult": mult, "seed": seed, "val_loss": result.final_val_loss,
             "num_params": result.num_params, "tokens_per_s": result.tokens_per_s,
             "seconds": time.perf_counter() - start}
    if seed == 0:
        entry["profile"] = profile_to_json(depth_profile(result.model, torch.tensor(batch)))
    return name, entry


def run_all(args) -> dict:
    results_path = Path(args.out) / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    runs = grid(args)
    batch = profile_batch(runs[0][-1], 4).tolist()  # plain lists cross the process boundary without shared memory
    todo = [(*run, batch) for run in runs if run[0] not in results]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_one, job) for job in todo]
        for future in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run"):
            name, entry = future.result()
            results[name] = entry
            atomic_write_text(results_path, json.dumps(results, indent=1))  # each finished run survives a crash
    return results


def summarise(results: dict) -> list[dict]:
    """Mean and spread of the final validation loss per size, residual and multiplier."""
    groups: dict[tuple, list[float]] = {}
    for r in results.values():
        groups.setdefault((r["size"], r["residual"], r["mult"]), []).append(r["val_loss"])
    rows = []
    for (size, residual, mult), losses in sorted(groups.items()):
        base = groups.get((size, "standard", 1.0))
        rows.append({
            "size": size, "residual": residual, "mult": mult, "n": len(losses), "mean": statistics.mean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "delta": statistics.mean(losses) - statistics.mean(base) if base else float("nan"),
        })
    return rows


def write_page(args, results: dict, page: Path) -> None:
    rows = summarise(results)
    figures = page.parent / "figures"
    pics = []
    for size in SIZES:
        profiles = {
            f"{r['residual']} x{r['mult']:g}": profile_from_json(r["profile"])
            for r in results.values() if r["size"] == size and "profile" in r
        }
        if profiles:
            path = plot_layer_curves(profiles, figures / f"reproduce_layers_{size}.png")
            pics.append((size, path.relative_to(page.parent)))
    cfg = next(iter(grid(args)))[-1]
    lines = [
        "# Reproduction: standard vs Full vs Block AttnRes at small scale",
        "",
        f"Byte-level LM on the Python {sys.version_info.major}.{sys.version_info.minor} standard library sources "
        f"({args.max_bytes:,} bytes, 5% held out), {args.steps} steps of {args.batch_size} x {args.seq_len} bytes, "
        f"AdamW lr {args.lr} cosine with warm-up, {args.seeds} seeds per cell. Validation loss in nats per byte "
        f"at the last step (mean ± standard deviation over seeds). `x` is the learning-rate multiplier of the AttnRes "
        f"pseudo-queries and key gains. Block size counted in decoder layers.",
        "",
        "Command:",
        "",
        "```bash",
        " ".join(["python experiments/reproduce.py", *(shlex.quote(a) for a in sys.argv[1:])]),
        "```",
        "",
        "| size | residual | x | seeds | val loss | vs standard |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        delta = "" if r["residual"] == "standard" else f"{r['delta']:+.4f}"
        lines.append(f"| {r['size']} | {r['residual']} | {r['mult']:g} | {r['n']} | {r['mean']:.4f} ± {r['std']:.4f} | {delta} |")
    lines += ["", "Per-sublayer magnitudes and gradient norms (seed 0 of each cell):", ""]
    lines += [f"![{size}]({path})" for size, path in pics]
    lines += ["", PAPER, "", f"Model settings: {json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k in ('heads', 'warmup', 'weight_decay', 'grad_clip', 'attn_res_weight_decay')})}."]
    atomic_write_text(page, "\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/reproduce", help="folder of the runs and results.json (default: %(default)s)")
    p.add_argument("--page", default="docs/results.md", help="results page to write (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="runs trained at once, one thread each (default: %(default)s)")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--mults", type=float, nargs="+", default=[1.0, 0.1],
                   help="AttnRes lr multipliers swept at the first size (default: 1 0.1)")
    p.add_argument("--deep-mult", type=float, default=0.1, help="AttnRes lr multiplier at the deeper size (default: 0.1)")
    p.add_argument("--max-bytes", type=int, default=8 * 2**20)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny grid to check the pipeline (not a result)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.mults, args.max_bytes, args.eval_batches = 20, 2, [1.0, 0.1], 2**20, 2
        args.out, args.page = args.out + "-quick", str(Path(args.out + "-quick") / "results.md")
    results = run_all(args)
    write_page(args, results, Path(args.page))
    for r in summarise(results):
        print(f"{r['size']:8s} {r['residual']:8s} x{r['mult']:<4g} {r['mean']:.4f} ± {r['std']:.4f}  {r['delta']:+.4f}")
    print(f"results page: {args.page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
