"""What the C++ aggregation points (the CPU backend's `point` and `chained_point` ops) save in a training step, in one
process.

The model of `attnres bench --groups small` (d=96, 6 layers, vocabulary 256, every plain norm the fused kernel, which
is a point of one source): the standard model, Block and Full, each twice, with their points as the ops with a C++
autograd node (the default on CPU) and through the Python autograd Functions those ops replace (`_EagerPoint`,
`_ChainedPoint`: the same kernels, bit for bit the same values and gradients). Timed round-robin
(`attnres.bench.timing.median_times`) at the benchmark's batch (16 x 128 tokens) and at 4 tokens, where data costs
nothing and only the per-point overhead shows. `--rounds` repeats the whole measurement: on a shared machine the spread
between rounds is part of the result. Prints each step's time, the time the C++ points save per step, and the tokens/s
ratios to the standard model with the same points; writes the raw figures as JSON to `--out`.

    python -m benchmarks.cpp_points
    python -m benchmarks.cpp_points --rounds 3 --repeats 30 --out docs/cpp_points.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

import torch

from attnres.bench import models
from attnres.bench.timing import median_times
from attnres.ops import backends
from benchmarks.gloo_ranks import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="timed steps per model and size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="times the whole measurement runs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    p.add_argument("--out", type=Path, default=None, help="JSON record to write (default: print only)")
    return p.parse_args(argv)


PYTHON = "python points"


def with_points(variant: str, kind: str) -> str:
    """The step's name: `kind` with the C++ points (`cpp`) or the Python ones."""
    return kind if variant == "cpp" else f"{kind} {PYTHON}"


def python_points(step):
    """`step` with every point through its Python autograd Function: the backends it selects lack the point ops."""
    choose = backends._choose

    @functools.cache  # as `_choose` itself: the replaced backends are made once, not at every point
    def without_point_ops(*args):
        return dataclasses.replace(choose(*args), point=None, chained_point=None)

    def run():
        backends._choose = without_point_ops
        try:
            step()
        finally:
            backends._choose = choose

    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    built = models.build_small_models(kinds=("standard", "block", "full"))
    if backends.select_backend(next(built["full"].parameters())).point is None:
        raise SystemExit("the CPU backend's point ops are unavailable here (no CPU kernel): nothing to compare")
    rounds = []
    for r in range(args.rounds):
        results = {}
        for batch, tokens in ((16, 128), (1, 4)):
            ids = torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(0))
            steps = {kind: models.training_step(model, ids) for kind, model in built.items()}
            steps |= {f"{kind} {PYTHON}": python_points(step) for kind, step in steps.items()}
            ms = {kind: 1e3 * s for kind, s in median_times(steps, args.repeats, args.warmup).items()}
            ratios = {variant: {kind: ms[with_points(variant, "standard")] / ms[with_points(variant, kind)]
                                for kind in built} for variant in ("cpp", PYTHON)}
            saved = {kind: ms[with_points(PYTHON, kind)] - ms[kind] for kind in built}
            results[f"{batch}x{tokens}"] = {"ms": ms, "saved_ms": saved, "tokens_per_s_vs_standard": ratios}
            print(f"round {r + 1}, {batch} x {tokens} tokens:")
            for kind in built:
                print(f"  {kind}: {ms[kind]:.2f} ms, {ms[with_points(PYTHON, kind)]:.2f} ms with {PYTHON}: saves "
                      f"{saved[kind]:.2f} ms; tokens/s vs standard {ratios['cpp'][kind]:.3f}x "
                      f"({ratios[PYTHON][kind]:.3f}x with {PYTHON})")
        rounds.append(results)
    if args.out is not None:
        write_record("benchmarks.cpp_points", args, argv, {"threads": torch.get_num_threads()}, rounds=rounds)


if __name__ == "__main__":
    main()
