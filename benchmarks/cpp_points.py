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
    python -m benchmarks.cpp_points --rounds 4 --repeats 30 --out docs/cpp_points.json
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from attnres.bench import models
from attnres.ops import backends
from benchmarks.full_chain import parse_args, timed_steps
from benchmarks.gloo_ranks import write_record


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


def with_python_points(steps: dict) -> dict:
    """Each model's step again, with its points through the Python Functions."""
    return {with_points(PYTHON, kind): python_points(step) for kind, step in steps.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__)
    built = models.build_small_models(kinds=("standard", "block", "full"))
    if backends.select_backend(next(built["full"].parameters())).point is None:
        raise SystemExit("the CPU backend's point ops are unavailable here (no CPU kernel): nothing to compare")
    rounds = [{} for _ in range(args.rounds)]
    for r, size, ms in timed_steps(args, built, with_python_points):
        ratios = {variant: {kind: ms[with_points(variant, "standard")] / ms[with_points(variant, kind)]
                            for kind in built} for variant in ("cpp", PYTHON)}
        saved = {kind: ms[with_points(PYTHON, kind)] - ms[kind] for kind in built}
        rounds[r][size] = {"ms": ms, "saved_ms": saved, "tokens_per_s_vs_standard": ratios}
        print(f"round {r + 1}, {size} tokens:")
        for kind in built:
            print(f"  {kind}: {ms[kind]:.2f} ms, {ms[with_points(PYTHON, kind)]:.2f} ms with {PYTHON}: saves "
                  f"{saved[kind]:.2f} ms; tokens/s vs standard {ratios['cpp'][kind]:.3f}x "
                  f"({ratios[PYTHON][kind]:.3f}x with {PYTHON})")
    if args.out is not None:
        write_record("benchmarks.cpp_points", args, argv, {"threads": torch.get_num_threads()}, rounds=rounds)


if __name__ == "__main__":
    main()
