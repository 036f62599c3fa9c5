"""`attnres demo`: a short tour of the operator, its two-phase form and the three residual streams."""

from __future__ import annotations

import torch

from attnres.layers import DepthAttention, RMSNorm, make_stream
from attnres.ops import depth_attention, depth_stats, finish_stats, merge_stats, naive_depth_attention


def register(sub) -> None:
    p = sub.add_parser("demo", help="show the depth-attention operator and the residual streams at work")
    p.add_argument("--dim", type=int, default=64, help="hidden size d (default: 64)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per source (default: 8)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the toy stack (default: 6)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    torch.manual_seed(args.seed)
    d, T = args.dim, args.tokens
    sources = [torch.randn(T, d) * (j + 1) for j in range(5)]
    query = torch.randn(d) / d**0.5

    print("1. One aggregation point: 5 sources, one pseudo-query")
    mix, weights = depth_attention(sources, query, return_weights=True)
    print(f"   depth weights of token 0 over the 5 sources: {[round(w, 3) for w in weights[:, 0].tolist()]}")
    print(f"   weights sum to 1: {torch.allclose(weights.sum(0), torch.ones(T))}")
    ref = naive_depth_attention(sources, query)
    print(f"   max |fast - naive twin| = {(mix - ref).abs().max():.2e}")
    uniform = depth_attention(sources, torch.zeros(d))
    print(f"   zero query gives the plain mean: {torch.allclose(uniform, torch.stack(sources).mean(0), atol=1e-6)}")

    print("2. Two-phase: sources split in two groups, statistics merged")
    stats = merge_stats(depth_stats(sources[3:], query[None]), depth_stats(sources[:3], query[None]))
    print(f"   max |merged - one-shot| = {(finish_stats(stats)[0] - mix).abs().max():.2e}")

    L = args.layers
    print(f"3. A toy stack of {L} decoder layers (tanh sublayers), every residual kind, random pseudo-queries")
    points = [DepthAttention(d) for _ in range(2 * L + 1)]
    for p in points:
        torch.nn.init.normal_(p.proj.weight, std=0.5)
    norms = [RMSNorm(d) for _ in range(2 * L + 1)]
    sublayers = [torch.randn(d, d) / d**0.5 for _ in range(2 * L)]
    embedding = torch.randn(T, d)
    for kind, extra in (("standard", {}), ("full", {}), ("block", {"block_size": 2})):
        stream = make_stream(kind, embedding, L, points, record_weights=True, **extra)
        for k in range(2 * L):
            stream.write(torch.tanh(stream.read(norms[k]) @ sublayers[k]))
        out = stream.read(norms[-1])
        rows = "" if not stream.weights else f", sources at the final read: {stream.weights[-1].shape[0]}"
        print(f"   {kind:8s} {extra or ''} final hidden rms {out.pow(2).mean().sqrt():.3f}{rows}")
    return 0
