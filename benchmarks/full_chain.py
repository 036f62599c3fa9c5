"""What the chain of Full points (attnres/ops/chain.py) saves in a training step, in one process.

The model of `attnres bench --groups small` (d=96, 6 layers, vocabulary 256, every plain norm the fused kernel), three
ways, timed round-robin (`attnres.bench.timing.median_times`): the standard model, Full with its points chained (the
default) and Full with ATTNRES_FULL_CHAIN=0 (one point at a time, autograd summing the sources' gradients). Run at the
benchmark's batch (16 x 128 tokens) and at 4 tokens, where data costs nothing and only the per-point overhead shows.
`--rounds` repeats the whole measurement: on a shared machine the spread between rounds is part of the result.
Prints the tokens/s ratios to the standard model and writes the raw figures as JSON to `--out`.

    python -m benchmarks.full_chain
    python -m benchmarks.full_chain --rounds 3 --repeats 30 --out docs/full_chain.json
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

from attnres.bench import models
from attnres.bench.timing import median_times
from attnres.models.wiring import FULL_CHAIN_ENV
from benchmarks.gloo_ranks import write_record


def parse_args(argv: list[str] | None = None, description: str = __doc__) -> argparse.Namespace:
    """The options of this benchmark and of those that time the small model's steps the same way (`timed_steps`)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="timed steps per model and size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="times the whole measurement runs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    p.add_argument("--out", type=Path, default=None, help="JSON record to write (default: print only)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


def timed_steps(args: argparse.Namespace, built: dict, variants: Callable[[dict], dict]):
    """Yield (round, size, ms) for each of `args.rounds` rounds and each size (the benchmark's 16 x 128 tokens, then
    4 tokens, where data costs nothing and only the per-step overhead shows): the median ms of the training step of
    each model in `built` and of each step `variants(steps)` adds (a model's step run another way), round-robin."""
    for r in range(args.rounds):
        for batch, tokens in ((16, 128), (1, 4)):
            ids = torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(0))
            steps = {kind: models.training_step(model, ids) for kind, model in built.items()}
            steps |= variants(steps)
            seconds = median_times(steps, args.repeats, args.warmup)
            yield r, f"{batch}x{tokens}", {kind: 1e3 * s for kind, s in seconds.items()}


def unchained(step):
    """`step` with Full's points one at a time."""

    def run():
        os.environ[FULL_CHAIN_ENV] = "0"
        try:
            step()
        finally:
            del os.environ[FULL_CHAIN_ENV]

    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if FULL_CHAIN_ENV in os.environ:
        raise SystemExit(f"{FULL_CHAIN_ENV} is set: this benchmark sets it itself, per step")
    built = models.build_small_models(kinds=("standard", "full"))
    rounds = [{} for _ in range(args.rounds)]
    for r, size, ms in timed_steps(args, built, lambda steps: {"full unchained": unchained(steps["full"])}):
        ratios = {kind: ms["standard"] / m for kind, m in ms.items()}
        rounds[r][size] = {"ms": ms, "tokens_per_s_vs_standard": ratios}
        print(f"round {r + 1}, {size} tokens: " + ", ".join(
            f"{k} {m:.2f} ms ({ratios[k]:.3f}x tokens/s)" for k, m in ms.items()))
    if args.out is not None:
        write_record("benchmarks.full_chain", args, argv, {"threads": torch.get_num_threads()}, rounds=rounds)


if __name__ == "__main__":
    main()
