"""Two-phase depth attention (docs/design.md section 4, the paper's Algorithm 1): an online softmax along depth.

Phase 1 scores S queries against a set of sources in one pass (each source read once, not S times) and keeps, per
query and token, the softmax statistics of that set:

    m = max_j s_j (a stop-gradient shift),  z = sum_j exp(s_j - m),  u = sum_j exp(s_j - m) x_j.

`merge_stats` combines two such sets exactly (never add normalised partial outputs: their denominators differ) and
`finish_stats` turns them into the mixture u / z, optionally with the sublayer PreNorm. Any split of the sources
into groups, merged in any order, equals the one-shot `depth_attention`.

Why m may be a stop-gradient: u / z does not depend on the shift, so the gradient through it is exactly zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from attnres.ops.chain import carried_sums, check_carrier_like, placeholder
from attnres.ops.checks import check_depth_stats, check_eps, check_vector
from attnres.ops.depth_attention import (
    accumulator_dtype,
    flat_tokens,
    fold_queries,
    rms_normalize,
    takes_kernels_directly,
)
from attnres.ops.registry import kernel, portable


class SoftmaxStats(NamedTuple):
    """Softmax statistics of S queries over one set of sources: m, z `[S, ...]` and u `[S, ..., d]`, fp32."""

    m: torch.Tensor
    z: torch.Tensor
    u: torch.Tensor


def _scores(x: torch.Tensor, cs: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s `[S, N]`, rstd `[N]`) of one source `[N, d]` (accumulator dtype) against the folded queries `[S, d]`."""
    rstd = torch.rsqrt(x.square().mean(-1) + eps)
    return (cs @ x.T) * rstd, rstd


@portable("depth_stats_fwd")
def torch_depth_stats_fwd(sources, cs, eps):
    """Portable kernel of `depth_stats_fwd` in torch ops, one fp32 source at a time."""
    acc = cs.dtype
    xs = [flat_tokens(x) for x in sources]
    s, rstd = zip(*(_scores(x.to(acc), cs, eps) for x in xs))
    s = torch.stack(s)  # [R, S, N]
    m = s.amax(dim=0)
    p = torch.exp(s - m)
    u = torch.zeros((cs.shape[0], *xs[0].shape), dtype=acc, device=cs.device)
    for x, pj in zip(xs, p):
        u.addcmul_(pj.unsqueeze(-1), x.to(acc).unsqueeze(0))
    return m, p.sum(0), u, torch.stack(rstd)


@portable("depth_stats_bwd")
def torch_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, eps):
    """Portable kernel of `depth_stats_bwd` in torch ops, one fp32 source at a time."""
    acc = cs.dtype
    d = cs.shape[1]
    dcs = torch.zeros_like(cs)
    grads = []
    for j, x in enumerate(sources):
        xf = flat_tokens(x).to(acc)
        s = (cs @ xf.T) * rstd[j]  # [S, N]
        p = torch.exp(s - m)
        ds = p * (grad_z + torch.einsum("snd,nd->sn", grad_u, xf))
        coef = ds * rstd[j]
        dx = torch.einsum("sn,snd->nd", p, grad_u) + coef.T @ cs
        dx -= ((coef * s).sum(0) * rstd[j] / d).unsqueeze(-1) * xf
        dcs += coef @ xf
        grads.append(dx.to(x.dtype).reshape(x.shape))
    return grads, dcs


# The two ops below are the contract every backend's kernels keep (registry keys "depth_stats_fwd" and
# "depth_stats_bwd", the torch kernels above where a backend has none); a backend's phase-1 kernels may take only so
# many queries and sources.


def _phase1_kernel(op: str, sources: list[torch.Tensor], cs: torch.Tensor):
    return kernel(op, sources[0], rows=max(len(sources), cs.shape[0]))


@torch.library.custom_op("attnres::depth_stats_fwd", mutates_args=())
def depth_stats_fwd(
    sources: list[torch.Tensor], cs: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """R sources `[..., d]` (fp32, bf16, fp16 or fp64, any strides), the folded queries cs `[S, d]` in the accumulator
    dtype (fp32; fp64 for fp64 sources), the key eps.

    Returns (m `[S, N]`, z `[S, N]`, u `[S, N, d]`, key rstd `[R, N]`) over the N flattened tokens, in the
    accumulator dtype.
    """
    return _phase1_kernel("depth_stats_fwd", sources, cs)(sources, cs, eps)


@depth_stats_fwd.register_fake
def _(sources, cs, eps):
    x = flat_tokens(sources[0])
    S, N = cs.shape[0], x.shape[0]
    return cs.new_empty(S, N), cs.new_empty(S, N), cs.new_empty(S, N, x.shape[1]), cs.new_empty(len(sources), N)


@torch.library.custom_op("attnres::depth_stats_bwd", mutates_args=())
def depth_stats_bwd(
    grad_z: torch.Tensor, grad_u: torch.Tensor, sources: list[torch.Tensor], cs: torch.Tensor, m: torch.Tensor,
    rstd: torch.Tensor, eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """grad_z `[S, N]`, grad_u `[S, N, d]`, the forward's sources and cs, its shift m `[S, N]`, held fixed, and key
    rstd `[R, N]` (which carries eps: a kernel may ignore `eps`).

    Returns (grad of each source in its shape and dtype, grad of cs `[S, d]` in the accumulator dtype).
    """
    bwd = _phase1_kernel("depth_stats_bwd", sources, cs)
    return bwd(grad_z, grad_u, sources, cs, m, rstd, eps)


@depth_stats_bwd.register_fake
def _(grad_z, grad_u, sources, cs, m, rstd, eps):
    return [x.new_empty(x.shape) for x in sources], cs.new_empty(cs.shape)  # contiguous, as every backend's


def _setup_context(ctx, inputs, output):
    sources, cs, eps = inputs
    m, _, _, rstd = output
    ctx.save_for_backward(cs, m, rstd, *sources)
    ctx.eps = eps


def _backward(ctx, grad_m, grad_z, grad_u, grad_rstd):
    cs, m, rstd, *sources = ctx.saved_tensors
    grad_z = torch.zeros_like(m) if grad_z is None else grad_z.contiguous()
    grad_u = torch.zeros((*m.shape, cs.shape[1]), dtype=cs.dtype, device=cs.device) if grad_u is None else grad_u
    grads, dcs = depth_stats_bwd(grad_z, grad_u.contiguous(), sources, cs, m, rstd, ctx.eps)
    return grads, dcs, None


depth_stats_fwd.register_autograd(_backward, setup_context=_setup_context)


def depth_stats(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    queries: torch.Tensor,
    key_norm_weights: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> SoftmaxStats:
    """Phase 1: the softmax statistics of S queries over the sources, each source read once.

    Args:
        sources: R >= 1 tensors `[..., d]` (or one stacked `[R, ..., d]`), as for `depth_attention`.
        queries: the pseudo-queries `[S, d]`.
        key_norm_weights: the key RMSNorm gains `[S, d]` (one per query), or None for no gain.
        eps: RMSNorm epsilon of the keys.

    Returns:
        `SoftmaxStats` with m, z `[S, ...]` and u `[S, ..., d]` in fp32 (fp64 for fp64 sources). Differentiable
        w.r.t. sources, queries and gains; m is a stop-gradient shift.
    """
    xs, eps = check_depth_stats(sources, queries, key_norm_weights, eps)
    acc = accumulator_dtype(xs[0].dtype)
    cs = fold_queries(queries, key_norm_weights, acc)
    m, z, u, _ = depth_stats_fwd(xs, cs, eps)
    lead = (queries.shape[0], *xs[0].shape[:-1])
    return SoftmaxStats(m.detach().reshape(lead), z.reshape(lead), u.reshape(*lead, xs[0].shape[-1]))


class _PerQuery(torch.autograd.Function):
    """The rows of phase 1's z `[S, ...]` and u `[S, ..., d]` as 2S outputs. Indexed one at a time, each query's
    gradient would be written into a zero `[S, ..., d]` tensor of its own and the S of them added up; here they are
    stacked once."""

    @staticmethod
    def forward(ctx, z, u):
        ctx.set_materialize_grads(False)
        ctx.rows = [(t.shape[1:], t.dtype, t.device) for t in (z, u)]  # what a missing gradient's zeros are like
        return (*z.unbind(0), *u.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        S = len(grads) // 2

        def stacked(part, row):
            if all(g is None for g in part):
                return None
            shape, dtype, device = row
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            return torch.stack([zeros if g is None else g for g in part])

        return stacked(grads[:S], ctx.rows[0]), stacked(grads[S:], ctx.rows[1])


def split_stats(stats: SoftmaxStats) -> list[SoftmaxStats]:
    """Phase 1's statistics of S queries as S `SoftmaxStats`, one per query, whose gradients reach the S-query ones
    in one stack (no zero-filled `[S, ..., d]` tensor per query)."""
    S = stats.u.shape[0]
    rows = _PerQuery.apply(stats.z, stats.u)
    return [SoftmaxStats(stats.m[q], rows[q], rows[S + q]) for q in range(S)]


class _ChainedStats(torch.autograd.Function):
    """Phase 1 of a group of Full points, eagerly on plain tensors, as a link of a chain over the groups (as
    `attnres.ops.chain` chains points): each query's z and u are outputs of their own, whose gradients reach the
    kernel where autograd left them (no `[S, ..., d]` stack), and the source gradients of every later group's phase 1
    are summed in place in one buffer. The carrier a link returns is a zero-stride placeholder shaped like its R
    sources; its gradient is that buffer, which the link adds its own gradients into (`depth_stats_bwd_into`), then
    returns the rows of the sources it tracks (those new since the previous link: complete, no later phase 1 adds to
    them) and hands the rest back as the previous carrier's gradient. A link that starts a chain tracks every source."""

    @staticmethod
    def forward(ctx, carrier, cs, eps, lead, older, *tracked):
        sources = [*older, *tracked]
        m, z, u, rstd = _phase1_kernel("depth_stats_fwd", sources, cs)(sources, cs, eps)
        ctx.save_for_backward(cs, m, rstd, *sources)
        ctx.eps, ctx.older = eps, len(older)
        ctx.set_materialize_grads(False)  # an unused carrier ends the chain: no zero buffer for it
        shift = m.reshape(lead)
        ctx.mark_non_differentiable(shift)  # a stop-gradient shift, as depth_stats' m
        return (shift, *z.reshape(lead).unbind(0), *u.reshape(*lead, cs.shape[1]).unbind(0),
                placeholder(len(sources), sources[0]))

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: a second derivative raises instead of missing terms
    def backward(ctx, grad_m, *grads):
        cs, m, rstd, *sources = ctx.saved_tensors
        S, x, grad_carrier = cs.shape[0], sources[0], grads[-1]
        grad_z = torch.stack([torch.zeros_like(m[q]) if g is None else g.reshape(m[q].shape)
                              for q, g in enumerate(grads[:S])])
        accumulate = grad_carrier is not None
        into = carried_sums(grad_carrier, len(sources), x)
        bwd = _phase1_kernel("depth_stats_bwd_into", sources, cs)
        dcs = bwd(grad_z, list(grads[S:2 * S]), sources, cs, m, rstd, ctx.eps, into, accumulate)
        back = into[: ctx.older] if ctx.older else None
        return back, dcs, None, None, None, *into[ctx.older:].unbind(0)


@portable("depth_stats_bwd_into")
def added_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, eps, into, accumulate):
    """Kernel of `depth_stats_bwd_into` where a backend has none: the S rows of grad_u (`[..., d]` each, None for
    zeros) stacked for the backend's `depth_stats_bwd`, then each source's gradient written, or added, into its row
    of `into`. Returns dcs."""
    N, d = m.shape[1], cs.shape[1]
    rows = [cs.new_zeros(N, d) if g is None else g.reshape(N, d).to(cs.dtype) for g in grad_u]
    bwd = _phase1_kernel("depth_stats_bwd", sources, cs)
    grads, dcs = bwd(grad_z, torch.stack(rows), sources, cs, m, rstd, eps)
    for row, grad in zip(into.unbind(0), grads):
        row.add_(grad.reshape(row.shape)) if accumulate else row.copy_(grad.reshape(row.shape))
    return dcs


def check_stats_carrier(carrier: torch.Tensor | None, sources: list[torch.Tensor]) -> None:
    """A phase-1 carrier continues a chain: made by an earlier group's phase 1 over fewer of these sources."""
    if carrier is None:
        return
    x = sources[0]
    if not isinstance(carrier, torch.Tensor) or carrier.dim() != x.dim() + 1 or carrier.shape[1:] != x.shape or not (
        0 < carrier.shape[0] < len(sources)
    ):
        got = tuple(carrier.shape) if isinstance(carrier, torch.Tensor) else type(carrier).__name__
        raise ValueError(f"carrier: expected an earlier phase 1's carrier, [R' < {len(sources)}, *{tuple(x.shape)}], "
                         f"got {got}")
    check_carrier_like(carrier, x)


def depth_stats_per_query(
    sources: Sequence[torch.Tensor], queries: torch.Tensor, key_norm_weights: torch.Tensor | None = None, *,
    eps: float = 1e-6, carrier: torch.Tensor | None = None,
) -> tuple[list[SoftmaxStats], torch.Tensor | None]:
    """`split_stats(depth_stats(...))`, the statistics of each of the S queries (m, z `[...]`, u `[..., d]`), with the
    same values and gradients, and a carrier for the next group's phase 1 (`carrier`: the previous group's, or None to
    start a chain). Eagerly on plain tensors the groups' phase 1 form a chain (`_ChainedStats`: each source's phase-1
    gradients summed in place, each query's gradient read where it lies); traced, the custom ops run and the carrier
    is None."""
    xs, eps = check_depth_stats(sources, queries, key_norm_weights, eps)
    if not takes_kernels_directly(xs[0]):
        return split_stats(depth_stats(xs, queries, key_norm_weights, eps=eps)), None
    check_stats_carrier(carrier, xs)
    acc = accumulator_dtype(xs[0].dtype)
    cs = fold_queries(queries, key_norm_weights, acc)
    S = queries.shape[0]
    older = 0 if carrier is None else carrier.shape[0]
    m, *rows, carrier = _ChainedStats.apply(carrier, cs, eps, (S, *xs[0].shape[:-1]), tuple(xs[:older]), *xs[older:])
    return [SoftmaxStats(m[q], rows[q], rows[S + q]) for q in range(S)], carrier


def merge_stats(a: SoftmaxStats, b: SoftmaxStats) -> SoftmaxStats:
    """Phase 2: the statistics of the union of two disjoint source sets, from theirs (exact, order-free)."""
    if a.u.shape != b.u.shape:
        raise ValueError(f"merge_stats: both sides must have the same shape, got {tuple(a.u.shape)} and {tuple(b.u.shape)}")
    m = torch.maximum(a.m, b.m)
    ea, eb = torch.exp(a.m - m), torch.exp(b.m - m)
    return SoftmaxStats(m, ea * a.z + eb * b.z, ea.unsqueeze(-1) * a.u + eb.unsqueeze(-1) * b.u)


def finish_stats(
    stats: SoftmaxStats,
    out_norm_weight: torch.Tensor | None = None,
    *,
    out_eps: float = 1e-6,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The mixture u / z (`[S, ..., d]`), optionally through the fused sublayer PreNorm, cast to `dtype`.

    `out_norm_weight` is `[d]` (shared) or `[S, d]` (one per query).
    """
    d = stats.u.shape[-1]
    if out_norm_weight is not None:
        if out_norm_weight.shape not in ((d,), (stats.u.shape[0], d)):
            raise ValueError(
                f"out_norm_weight: expected shape [{d}] or [{stats.u.shape[0]}, {d}], got {tuple(out_norm_weight.shape)}"
            )
        check_vector("out_norm_weight", out_norm_weight.reshape(-1, d)[0], d, stats.u.device)
    out_eps = check_eps("out_eps", out_eps)
    mix = stats.u / stats.z.unsqueeze(-1)
    if out_norm_weight is not None:
        w = out_norm_weight if out_norm_weight.dim() == 1 else out_norm_weight.reshape(-1, *[1] * (mix.dim() - 2), d)
        mix = rms_normalize(mix, None, out_eps)[0] * w.to(mix.dtype)
    return mix if dtype is None else mix.to(dtype)
