"""Inference latency of a Block AttnRes model against the standard (PreNorm) model of the same size.

In one process, the two models share every standard weight (the AttnRes model adds its pseudo-queries and key
gains, set to random values so the depth softmax is not uniform) and run without autograd, so Block AttnRes takes
the fused bank path (docs/design.md section 5). Measured, alternating the two models, median over repeats after warm-up:
- prefill: one forward over T tokens (batch 1), logits of the last position only (as `generate` asks);
- decode: one step of `batch` new tokens after a KV cache of `context` tokens (T = batch for the stream), the
  cache trimmed back after each step so every step sees the same context.
The ratio block / standard is the inference overhead; the paper reports under 2% (Kimi K3 scale, on GPUs).

    python -m benchmarks.bench_inference                      # d=512, 8 layers, T=2048, decode batch 1 and 8
    python -m benchmarks.bench_inference --block-size 4 --dtype bf16 --device cuda
"""

from __future__ import annotations

import argparse

import torch

from attnres.bench.models import add_model_args, build_models, decode_step, prefill
from attnres.bench.timing import median_times

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--block-size", type=int, default=2,
                   help="Block AttnRes block size in decoder layers (default: %(default)s, i.e. 4 blocks of 8 layers)")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prefill length T (default: %(default)s)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default: 1 8)")
    p.add_argument("--context", type=int, default=512, help="cached tokens before a decode step (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per model; the median is kept (default: 5)")
    p.add_argument("--decode-repeats", type=int, default=50, help="timed decode steps per model (default: 50)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before timing (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="(default: bf16 on cuda, else fp32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: cuda if present)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("dim", "layers", "heads", "vocab", "block_size", "prefill_tokens", "context", "repeats", "decode_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.decode_batches) < 1:
        p.error(f"--decode-batches must be at least 1, got {args.decode_batches}")
    return args


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    fields = dict(dim=args.dim, layers=args.layers, heads=args.heads, vocab=args.vocab, block_size=args.block_size)
    built = build_models(**fields, max_tokens=max(args.prefill_tokens, args.context + 1), seed=args.seed,
                         kinds=("standard", "block"))
    models = {name: m.to(device, dtype) for name, m in built.items()}
    blocks = -(-args.layers // args.block_size)
    print(
        f"d={args.dim}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, {dtype}, {device}"
        f"{f' ({torch.get_num_threads()} threads)' if device.type == 'cpu' else ''}; Block AttnRes: block size "
        f"{args.block_size} layers ({blocks} blocks); medians, block / standard"
    )
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    ids = torch.randint(0, args.vocab, (1, args.prefill_tokens), generator=gen).to(device)
    fns = {name: prefill(m, ids) for name, m in models.items()}
    rows.append((f"prefill T={args.prefill_tokens}", median_times(fns, args.repeats, args.warmup, device)))
    for batch in args.decode_batches:
        context = torch.randint(0, args.vocab, (batch, args.context), generator=gen).to(device)
        tokens = torch.randint(0, args.vocab, (batch, 1), generator=gen).to(device)
        fns = {name: decode_step(m, context, tokens) for name, m in models.items()}
        rows.append((f"decode batch={batch}, context {args.context}", median_times(fns, args.decode_repeats, args.warmup, device)))
    print(f"{'case':34s} {'standard ms':>12s} {'block ms':>10s} {'ratio':>7s}")
    for case, t in rows:
        print(f"{case:34s} {t['standard'] * 1e3:12.2f} {t['block'] * 1e3:10.2f} {t['block'] / t['standard']:7.3f}")


if __name__ == "__main__":
    main()
