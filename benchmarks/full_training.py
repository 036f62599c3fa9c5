"""Full AttnRes's reads in training: the chain against phase-1 groups, forward and backward.

What `FullResidual`'s default (the chain, no groups) rests on. One training step's 2L + 1 reads with each point's
sublayer PreNorm fused, the sublayers replaced by a scale (so only the residual path is timed), then the backward of
the last read's sum, in several ways:
- chain: each point reads all its sources, and their gradients are summed in place (`attnres.ops.chain`);
- group G: phase 1 scores the sources so far for G points in one pass, and each point merges in the sources
  written since (`FullResidual(group=G)`, `merge_sources`).
The ways alternate round by round (a change in the machine's load reaches all alike); medians over the rounds.

    python -m benchmarks.full_training                      # SmolLM2-135M's shape: 30 layers, d = 576, 512 tokens
    python -m benchmarks.full_training --json docs/full_training.json
"""

from __future__ import annotations

import argparse
import functools

import torch

from attnres.bench.shape import DTYPES, add_shape_args, check_positive, write_record
from attnres.bench.timing import median_times
from attnres.layers.depth_attention import DepthAttention, RMSNorm
from attnres.layers.residuals import FullResidual


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--tokens", type=int, default=512, help="tokens N of a step (default: %(default)s)")
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 12, 16],
                   help="points per phase-1 group to time beside the chain (default: 4 8 12 16)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default: %(default)s)")
    args = p.parse_args(argv)
    check_positive(p, args, ("layers", "dim", "tokens", "rounds"))
    if min(args.groups) < 2:
        p.error(f"--groups must be at least 2 points each, got {args.groups}")
    return args


def step(layers: int, tokens: int, dim: int, dtype: torch.dtype):
    """A function running one step's reads and backward through a given `FullResidual`, on fixed weights."""
    gen = torch.Generator().manual_seed(0)
    points = [DepthAttention(dim).to(dtype) for _ in range(2 * layers + 1)]
    for point in points:
        with torch.no_grad():
            point.proj.weight.copy_(0.05 * torch.randn(1, dim, generator=gen))
    norms = [RMSNorm(dim).to(dtype) for _ in points]
    embedding = torch.randn(tokens, dim, generator=gen).to(dtype).requires_grad_()

    def run(**options) -> None:
        residual = FullResidual(layers, points, **options)
        state = residual.start(embedding)
        for point in range(2 * layers):
            x, state = residual.read(state, point, norms[point])
            state = residual.write(state, 0.5 * x)
        residual.read(state, 2 * layers, norms[-1])[0].float().sum().backward()

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ways = {"chain": dict(chain=True), **{f"group {g}": dict(chain=True, group=g) for g in args.groups}}
    results = []
    for name in args.dtypes:
        run = step(args.layers, args.tokens, args.dim, DTYPES[name])
        seconds = median_times({way: functools.partial(run, **options) for way, options in ways.items()}, args.rounds)
        ms = {way: 1e3 * s for way, s in seconds.items()}
        over_chain = {way: ms[way] / ms["chain"] for way in ways}
        results.append({"dtype": name, "ms": ms, "over_chain": over_chain})
        print(f"{name}: chain {ms['chain']:.1f} ms; "
              + "; ".join(f"{way} {over_chain[way]:.2f}x" for way in ways if way != "chain"))
    if args.json is not None:
        shape = {"layers": args.layers, "dim": args.dim, "tokens": args.tokens}
        write_record(args.json, "benchmarks.full_training", argv, shape, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
