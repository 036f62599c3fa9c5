"""Fused inference aggregation over a bank of block summaries (DESIGN section 6).

The bank is `[N, NB, d]` (tokens first, so one token's rows are contiguous) and lives for one forward; `nvb` rows are
valid. The prefix (the current block's partial sum) is carried between points as the ordinary residual, with the
latest sublayer output still pending. One call does, per token, in one pass over its rows:

    prefix += output                        (the pending residual add; skipped when output is None)
    bank[:, nvb] = prefix                   (write layers only; the prefix then becomes an ordinary row)
    normed = o * RMSNorm(mix(bank rows, prefix))

`bank_merge` is the phase-2 twin for a point whose bank rows were already scored (phase 1, `depth_stats`): it merges
the statistics of the bank with those of the prefix. Both mutate `prefix` (and `bank`) in place: the inference
state owns them, so no new `[N, d]` buffer is made per point.

Dispatch: a backend with fused kernels for these ops (Triton, on CUDA) does the whole point in one kernel; otherwise
the pending add and the write are torch ops and the mixing is the backend's one-shot forward.
"""

from __future__ import annotations

import os

import torch

from attnres.ops.backends import select_backend
from attnres.ops.depth_attention import rms_normalize, torch_depth_attention_fwd


# The Triton kernels serve CPU tensors only under the interpreter (where tests route them so); elsewhere the CPU merge
# skips the backend lookup, which would cost more than the rest of its dispatch.
_TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


def bank_rows(bank: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The first n bank rows as `[N, d]` views (no copy)."""
    return [bank[:, j] for j in range(n)]


def _pending_add(prefix: torch.Tensor, output: torch.Tensor | None) -> None:
    if output is not None:
        prefix.add_(output)  # same rounding as `prefix + output` in the training stream


def bank_aggregate(
    bank: torch.Tensor,
    nvb: int,
    prefix: torch.Tensor,
    output: torch.Tensor | None,
    c: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    eps: float,
    out_eps: float,
    write: bool,
) -> torch.Tensor:
    """One inference aggregation point over `nvb` bank rows and the prefix `[N, d]`; returns the (normed) mixture.

    With `write`, the prefix (after the pending add) becomes bank row `nvb` and the sources are rows `0..nvb`.
    """
    backend = select_backend(prefix)
    if backend.bank_aggregate is not None:
        return backend.bank_aggregate(bank, nvb, prefix, output, c, out_norm_weight, eps, out_eps, write)
    _pending_add(prefix, output)
    if write:
        bank[:, nvb] = prefix
        sources = bank_rows(bank, nvb + 1)
    else:
        sources = [*bank_rows(bank, nvb), prefix]
    fwd = backend.fwd or torch_depth_attention_fwd  # the training path's kernel: same rounding
    return fwd(sources, c, out_norm_weight, eps, out_eps)[0]


def bank_merge(
    m: torch.Tensor,
    z: torch.Tensor,
    u: torch.Tensor,
    prefix: torch.Tensor,
    output: torch.Tensor | None,
    c: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    eps: float,
    out_eps: float,
) -> torch.Tensor:
    """Phase 2 at inference: the bank's statistics (m, z `[N]`, u `[N, d]`) merged with the prefix after the
    pending add; returns the (normed) mixture `[N, d]` in the prefix's dtype."""
    if prefix.is_cuda or _TRITON_INTERPRETING:
        fused = select_backend(prefix).bank_merge
        if fused is not None:
            return fused(m, z, u, prefix, output, c, out_norm_weight, eps, out_eps)
    _pending_add(prefix, output)
    x = prefix.to(c.dtype)
    s = (x @ c) * torch.rsqrt(x.square().mean(-1) + eps)
    top = torch.maximum(m, s)
    a, b = torch.exp(m - top), torch.exp(s - top)
    mix = (a.unsqueeze(-1) * u + b.unsqueeze(-1) * x) / (a * z + b).unsqueeze(-1)
    if out_norm_weight is not None:
        mix = rms_normalize(mix, out_norm_weight, out_eps)[0]
    return mix.to(prefix.dtype)


# Registered as custom ops for torch.compile. Eager callers use the plain functions: the dispatch of a mutating
# custom op costs about 0.2 ms a call, which is most of a decode step's aggregation at a few tokens.
bank_aggregate_op = torch.library.custom_op("attnres::bank_aggregate", bank_aggregate, mutates_args=("bank", "prefix"))
bank_merge_op = torch.library.custom_op("attnres::bank_merge", bank_merge, mutates_args=("prefix",))


@bank_aggregate_op.register_fake
def _(bank, nvb, prefix, output, c, out_norm_weight, eps, out_eps, write):
    return torch.empty_like(prefix)


@bank_merge_op.register_fake
def _(m, z, u, prefix, output, c, out_norm_weight, eps, out_eps):
    return torch.empty_like(prefix)
