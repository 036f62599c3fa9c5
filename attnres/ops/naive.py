"""Readable PyTorch twins of the depth-attention ops (docs/design.md sections 2 and 4), written straight from the math.

They stack the sources in fp32 and let autograd differentiate them, so they are the reference the fast paths are
tested against, not something to train with.
"""

from __future__ import annotations

import torch

from attnres.ops.checks import check_depth_attention, check_depth_stats
from attnres.ops.depth_attention import accumulator_dtype
from attnres.ops.two_phase import SoftmaxStats, finish_stats, merge_stats


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def naive_depth_attention(
    sources, query, key_norm_weight=None, *, eps=1e-6, out_norm_weight=None, out_eps=None, return_weights=False
):
    """Twin of `attnres.depth_attention` (same signature, types and checks there), computed the obvious way."""
    xs, eps, out_eps = check_depth_attention(sources, query, key_norm_weight, eps, out_norm_weight, out_eps)
    d = xs[0].shape[-1]
    acc = accumulator_dtype(xs[0].dtype)  # fp32, or fp64 for fp64 inputs
    v = torch.stack(xs).to(acc)  # [R, ..., d]
    gain = None if key_norm_weight is None else key_norm_weight.to(acc)
    keys = _rms_norm(v, gain, eps)
    scores = keys @ query.reshape(d).to(acc)  # [R, ...]
    weights = scores.softmax(dim=0)
    mix = (weights.unsqueeze(-1) * v).sum(0)
    if out_norm_weight is not None:
        mix = _rms_norm(mix, out_norm_weight.to(acc), out_eps)
    out = mix.to(xs[0].dtype)
    return (out, weights) if return_weights else out


def naive_depth_stats(sources, queries, key_norm_weights=None, *, eps=1e-6):
    """Twin of `attnres.depth_stats` (same signature, types and checks there): the softmax statistics of S queries over
    the sources, from the stacked scores."""
    xs, eps = check_depth_stats(sources, queries, key_norm_weights, eps)
    acc = accumulator_dtype(xs[0].dtype)
    v = torch.stack(xs).to(acc)  # [R, ..., d]
    keys = _rms_norm(v, None, eps)
    c = queries.to(acc) if key_norm_weights is None else queries.to(acc) * key_norm_weights.to(acc)  # [S, d]
    scores = torch.einsum("r...d,sd->sr...", keys, c)  # [S, R, ...]
    m = scores.amax(dim=1).detach()
    p = torch.exp(scores - m.unsqueeze(1))
    return SoftmaxStats(m=m, z=p.sum(1), u=torch.einsum("sr...,r...d->s...d", p, v))


def naive_bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write):
    """Twin of `attnres.ops.bank.bank_aggregate` (same signature and in-place effects), built on the twin above."""
    if output is not None:
        prefix.copy_(prefix + output)
    rows = prefix.view(-1, prefix.shape[-1])
    if write:
        bank[:, nvb] = rows
    sources = [bank[:, j] for j in range(nvb + 1 if write else nvb)] + ([] if write else [rows])
    mix = naive_depth_attention(sources, query, gain, eps=eps, out_norm_weight=out_norm_weight, out_eps=out_eps)
    return mix.view(prefix.shape)


def naive_bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps):
    """Twin of `attnres.ops.bank.bank_merge`: the phase-1 statistics merged with the prefix's own statistics."""
    if output is not None:
        prefix.copy_(prefix + output)
    own = naive_depth_stats([prefix.view(-1, prefix.shape[-1])], query.reshape(1, -1), gain[None], eps=eps)
    stats = merge_stats(SoftmaxStats(m[None], z[None], u[None]), own)
    return finish_stats(stats, out_norm_weight, out_eps=out_eps, dtype=prefix.dtype)[0].view(prefix.shape)
