"""Fused inference aggregation over a bank of block summaries (docs/design.md section 5).

The bank is `[N, NB, d]` (tokens first, so one token's rows are contiguous) and lives for one forward; `nvb` rows are
valid. The prefix (the current block's partial sum) is carried between points as the ordinary residual, with the
latest sublayer output still pending. One call does, per token, in one pass over its rows:

    prefix += output                        (the pending residual add; skipped when output is None)
    bank[:, nvb] = prefix                   (write layers only; the prefix then becomes an ordinary row)
    normed = o * RMSNorm(mix(bank rows, prefix))

`bank_merge` is the phase-2 twin for a point whose bank rows were already scored (phase 1, `depth_stats`): it merges
the statistics of the bank with those of the prefix. Both mutate `prefix` (and `bank`) in place: the inference
state owns them, so no new `[N, d]` buffer is made per point.

Dispatch: a backend with fused kernels for these ops (Triton on CUDA, the compiled kernel on CPU) does the whole point
in one call; otherwise (the torch backend, fp64) the pending add and the write are torch ops and the mixing is the
portable one-shot forward. Every implementation runs behind the same checks (`check_bank_aggregate`,
`check_bank_merge`), applied once where it is registered: here for the portable kernels, in each backend's `KERNELS`
for its fused ones (which an inference stream binds and calls directly).
"""

from __future__ import annotations

import torch

from attnres.ops.checks import check_bank_aggregate, check_bank_merge, validated
from attnres.ops.depth_attention import accumulator_dtype, fold_query, torch_depth_attention_fwd
from attnres.ops.merge import torch_merge_prefix_fwd
from attnres.ops.registry import kernel, register_portable


def bank_rows(bank: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The first n bank rows as `[N, d]` views (no copy)."""
    return [bank[:, j] for j in range(n)]


def _pending_add(prefix: torch.Tensor, output: torch.Tensor | None) -> None:
    if output is not None:
        prefix.add_(output)  # same rounding as `prefix + output` in the training stream


def torch_bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write):
    """Portable kernel of `bank_aggregate`: the pending add and the write in torch ops, then the portable one-shot
    forward of training (same rounding)."""
    c = fold_query(query, gain, accumulator_dtype(prefix.dtype))
    _pending_add(prefix, output)
    rows = prefix.view(-1, prefix.shape[-1])
    if write:
        bank[:, nvb] = rows
        sources = bank_rows(bank, nvb + 1)
    else:
        sources = [*bank_rows(bank, nvb), rows]
    return torch_depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps)[0].view(prefix.shape)


def torch_bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps):
    """Portable kernel of `bank_merge`: the pending add, then the portable phase 2 of training."""
    _pending_add(prefix, output)
    c = fold_query(query, gain, accumulator_dtype(prefix.dtype))
    rows = prefix.view(-1, prefix.shape[-1])
    return torch_merge_prefix_fwd(m, z, u, rows, c, out_norm_weight, eps, out_eps, prefix.dtype).view(prefix.shape)


# What a backend without fused kernels runs; a backend's own fused ops are validated the same way in its KERNELS.
register_portable({"bank_aggregate": validated(check_bank_aggregate, torch_bank_aggregate),
                   "bank_merge": validated(check_bank_merge, torch_bank_merge)})


def bank_aggregate(
    bank: torch.Tensor, nvb: int, prefix: torch.Tensor, output: torch.Tensor | None, query: torch.Tensor,
    gain: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float, out_eps: float, write: bool,
) -> torch.Tensor:
    """One inference aggregation point over `nvb` bank rows and the prefix; returns the (normed) mixture.

    bank `[N, NB, d]` and prefix `[..., d]` of N tokens (`[N, d]` as a view: any token stride, unit stride along d;
    fp32, bf16, fp16 or fp64), output of the prefix's shape or None, the point's query w (`[d]` or `[1, d]`) and key
    gain g `[d]`, which the kernel folds into c = g * w in the accumulator dtype (each point's own vectors as they
    are: a fold per forward of every point's would cost a decode step more than its kernels), the optional
    output-norm gain `[d]`. Mutates prefix (and, with
    `write`, bank row `nvb`: the prefix after the pending add becomes that row and the sources are rows `0..nvb`) and
    returns the mixture in the prefix's shape and dtype, bit for bit the one-shot forward's over the same rows. A
    prefix in the tokens' own shape spares a decode step a view per point, about as long as the kernel's mixing.
    """
    aggregate = kernel("bank_aggregate", prefix)
    return aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write)


def bank_merge(
    m: torch.Tensor, z: torch.Tensor, u: torch.Tensor, prefix: torch.Tensor, output: torch.Tensor | None,
    query: torch.Tensor, gain: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float, out_eps: float,
) -> torch.Tensor:
    """Phase 2 at inference: the bank's phase-1 statistics (m, z `[N]`, u `[N, d]`, accumulator dtype) merged with the
    prefix `[..., d]` of N tokens (as `bank_aggregate` takes it) after the pending add of an output of its shape or
    None, under the point's query and key gain (folded as `bank_aggregate` folds them) and the optional output-norm
    gain `[d]`. Mutates prefix and returns the (normed) mixture in the prefix's shape and dtype."""
    return kernel("bank_merge", prefix)(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps)


# Registered as custom ops for torch.compile. Eager callers use the plain functions: the dispatch of a mutating
# custom op costs about 0.2 ms a call, which is most of a decode step's aggregation at a few tokens.
bank_aggregate_op = torch.library.custom_op("attnres::bank_aggregate", bank_aggregate, mutates_args=("bank", "prefix"))
bank_merge_op = torch.library.custom_op("attnres::bank_merge", bank_merge, mutates_args=("prefix",))


@bank_aggregate_op.register_fake
def _(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write):
    return prefix.new_empty(prefix.shape)  # contiguous, as every backend's


@bank_merge_op.register_fake
def _(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps):
    return prefix.new_empty(prefix.shape)  # contiguous, as every backend's
