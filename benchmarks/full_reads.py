"""Full AttnRes's reads at inference: its sources in one bank against the sources in place, by token count.

What `attnres.layers.full_inference.BANK_BYTES` rests on. One inference forward's 2L + 1 reads, the sublayers left
out (their outputs drawn beforehand), in two ways, each through the backend's kernel as `FullInference` binds it:
- list: point l passes its l + 1 sources to `depth_attention_fwd` as a list, read in place;
- bank: the forward allocates one `[N, 2L + 1, d]` bank, and point l writes its newest source into row l and mixes
  rows 0..l in one `bank_aggregate` call.
The two alternate round by round (a change in the machine's load reaches both alike); medians over the rounds.

    python -m benchmarks.full_reads                  # SmolLM2-135M's shape: 30 layers, d = 576, fp32 and bf16
    python -m benchmarks.full_reads --json docs/full_reads.json
"""

from __future__ import annotations

import argparse

import torch

from attnres.bench.shape import DTYPES, add_shape_args, check_positive, write_record
from attnres.bench.timing import median_times
from attnres.ops.registry import kernel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024],
                   help="token counts N of a forward (default: 1 4 16 64 256 1024)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per token count (default: enough for about 400 tokens, at least 5)")
    args = p.parse_args(argv)
    check_positive(p, args, ("layers", "dim"))
    if min(args.tokens) < 1 or (args.rounds is not None and args.rounds < 1):
        p.error("--tokens and --rounds must be at least 1")
    return args


def reads(points: int, tokens: int, dim: int, dtype: torch.dtype) -> dict:
    """The list and bank forms of one forward's reads, on the same sources and folded query; each returns every
    point's mixture."""
    gen = torch.Generator().manual_seed(0)
    outputs = [torch.randn(tokens, dim, generator=gen).to(dtype) for _ in range(points)]
    c, ones = 0.1 * torch.randn(dim, generator=gen), torch.ones(dim)  # key and output-norm gains: the query is c
    forward, aggregate = kernel("depth_attention_fwd", outputs[0]), kernel("bank_aggregate", outputs[0])
    aggregate = getattr(aggregate, "kernel", aggregate)  # unchecked, as `FullInference` calls it past its first read

    def in_place() -> list[torch.Tensor]:
        return [forward(outputs[: point + 1], c, ones, 1e-6, 1e-6)[0] for point in range(points)]

    def bank() -> list[torch.Tensor]:
        rows = outputs[0].new_empty(tokens, points, dim)
        return [aggregate(rows, k, outputs[k], None, c, ones, ones, 1e-6, 1e-6, True) for k in range(points)]

    return {"list": in_place, "bank": bank}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    points = 2 * args.layers + 1
    results = []
    for name in args.dtypes:
        for tokens in args.tokens:
            fns = reads(points, tokens, args.dim, DTYPES[name])
            seconds = median_times(fns, args.rounds or max(5, 400 // tokens))
            ms = {form: 1e3 * s for form, s in seconds.items()}
            results.append({"dtype": name, "tokens": tokens, "ms": ms, "bank_over_list": ms["bank"] / ms["list"]})
            print(f"{name} N={tokens:5d}: list {ms['list']:8.3f} ms, bank {ms['bank']:8.3f} ms, "
                  f"bank / list {ms['bank'] / ms['list']:.2f}")
    if args.json is not None:
        write_record(args.json, "benchmarks.full_reads", argv, {"layers": args.layers, "dim": args.dim}, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
