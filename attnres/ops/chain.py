"""A schedule's points as one chain for the backward: each source's gradient is summed in place, once.

In Full AttnRes, point l reads every source v_0 .. v_{l-1}, so in the backward each source gets a gradient from every
later point; in Block AttnRes every bank row gets one from each later point. Through `depth_attention` each point
writes R fresh gradients and autograd adds them up: a tensor written and added per point and source. A chain keeps one
gradient buffer instead. Each point reads the sources the previous point's carrier covers plus one more, takes that
carrier and returns its own:

    out, carrier = depth_attention_chained(sources, carrier, query, key_norm_weight, ...)

A carrier's value is nothing (a zero-stride placeholder, shaped `[R, ..., d]` like the sources it covers); its
gradient is the running sum, over every later point, of their gradients w.r.t. those sources. It covers every source
of the point that made it (Full; a Block write point, whose newest source is the bank row it writes), or with
`carry_newest=False` all but the newest (a Block point's prefix, which no later point reads as such). So in the
backward, a point adds its own contribution into that buffer in place (the `point_bwd_into` kernel), writes a fresh
gradient for a newest source it does not carry, returns the gradient of its newest source (complete: every later
reader has added to it) and hands the rest back as the previous carrier's gradient. A point that starts a chain (no
carrier in) returns every source's; one whose carrier no later point takes ends it (its carrier gets no gradient, and
it writes a fresh buffer). Nothing outside autograd is shared: the chain orders the backward by itself, and since the
buffer is a gradient, autograd sums the buffers of two points that took the same carrier as for any tensor.

Values and gradients are those of `depth_attention` point by point: in fp32 the sums run in the order autograd runs
them, so they agree bit for bit; in bf16 and fp16 each partial sum is rounded once (autograd rounds each point's
gradient, then the sum). The chain runs eagerly: `torch.compile` traces the functional op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from attnres.ops.checks import check_depth_attention
from attnres.ops.depth_attention import grad_or_zeros, takes_kernels_directly, traced_point_fwd
from attnres.ops.registry import kernel, portable


def check_carrier(carrier: torch.Tensor | None, sources: list[torch.Tensor]) -> None:
    """A carrier continues a chain: the previous point's, covering all but the newest of these sources."""
    if carrier is None:
        return
    x = sources[0]
    expected = (len(sources) - 1, *x.shape)
    if not isinstance(carrier, torch.Tensor) or tuple(carrier.shape) != expected:
        got = tuple(carrier.shape) if isinstance(carrier, torch.Tensor) else type(carrier).__name__
        raise ValueError(
            f"carrier: expected the carrier of the previous point, shaped [R - 1, ..., d] = {expected} for R = "
            f"{len(sources)} sources, got {got}"
        )
    check_carrier_like(carrier, x)


def check_carrier_like(carrier: torch.Tensor, x: torch.Tensor) -> None:
    """A carrier of a chain over sources like `x`: of their dtype and device."""
    if carrier.dtype != x.dtype or carrier.device != x.device:
        raise ValueError(
            f"carrier: expected the sources' dtype and device ({x.dtype}, {x.device}), got {carrier.dtype}, "
            f"{carrier.device}"
        )


def placeholder(rows: int, x: torch.Tensor) -> torch.Tensor:
    """A carrier's value: nothing, shaped `[rows, *x.shape]` (one element, zero strides; one op)."""
    return torch.empty_strided((rows, *x.shape), (0,) * (x.dim() + 1), dtype=x.dtype, device=x.device)


def carried_sums(grad_carrier: torch.Tensor | None, rows: int, x: torch.Tensor) -> torch.Tensor:
    """The buffer a link of a chain adds its gradients onto: the later links' sums (its carrier's gradient; anything
    but a contiguous buffer is copied first), or a new one of `rows` rows like `x` where no later link took the
    carrier."""
    if grad_carrier is None:
        return torch.empty((rows, *x.shape), dtype=x.dtype, device=x.device)
    return grad_carrier if grad_carrier.is_contiguous() else grad_carrier.contiguous()


class _ChainedPoint(torch.autograd.Function):
    """One point of a chain. Continuing a chain, only its newest source is an input that autograd tracks: the older
    ones (`older`, a tuple that autograd does not look into) get their gradients through the carrier, so an edge to
    each would only cost its bookkeeping, at every point forward and backward. A point that starts a chain tracks
    every source. A backend's own `chained_point` op (the CPU's: this Function in C++) takes its place."""

    @staticmethod
    def forward(ctx, carrier, query, key_norm_weight, out_norm_weight, eps, out_eps, carry_newest, older, *tracked):
        sources = [*older, *tracked]
        x = sources[0]
        ctx.point_bwd_into = kernel("point_bwd_into", x)
        point_fwd = kernel("point_fwd", x) if takes_kernels_directly(x) else traced_point_fwd
        out, weights, rstd, c = point_fwd(sources, query, key_norm_weight, out_norm_weight, eps, out_eps)
        ctx.save_for_backward(c, query, key_norm_weight, out_norm_weight, weights, rstd, *sources)
        ctx.eps, ctx.out_eps, ctx.older = eps, out_eps, len(older)
        ctx.carry = len(sources) - (not carry_newest)
        ctx.set_materialize_grads(False)  # an unused carrier ends the chain: no zero buffer for it
        return out, placeholder(ctx.carry, x)

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: a second derivative raises instead of missing terms
    def backward(ctx, grad_out, grad_carrier):
        c, query, gain, out_norm_weight, weights, rstd, *sources = ctx.saved_tensors
        x = sources[0]
        accumulate = grad_carrier is not None
        carried = carried_sums(grad_carrier, ctx.carry, x)
        # a newest source not carried on gets a fresh gradient
        into = [*carried.unbind(0), *(torch.empty_like(x) for _ in range(len(sources) - ctx.carry))]
        # no grad_out where only the carrier is used further on: nothing of this point's own to add (zeros)
        d_query, d_gain, d_out_w = ctx.point_bwd_into(
            grad_or_zeros(grad_out, x), None, sources, c, query, gain, out_norm_weight, weights, rstd, ctx.eps,
            ctx.out_eps, into, ctx.carry if accumulate else 0,
        )
        # the tracked sources' gradients are complete; the older ones go on summing in the previous point
        back = carried[:ctx.older] if ctx.older else None
        return back, d_query, d_gain, d_out_w, None, None, None, None, *into[ctx.older:]


@portable("chained_point")
def chained_point(tracked, older, carrier, query, gain, out_norm_weight, eps, out_eps, carry_newest):
    """The `chained_point` op where a backend has none: (out, carrier) through `_ChainedPoint`; only `tracked` are
    autograd inputs."""
    return _ChainedPoint.apply(carrier, query, gain, out_norm_weight, eps, out_eps, carry_newest, tuple(older),
                               *tracked)


def depth_attention_chained(
    sources: Sequence[torch.Tensor],
    carrier: torch.Tensor | None,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,
    out_eps: float | None = None,
    carry_newest: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`depth_attention` (same arguments, without `return_weights`) as a point of a chain: also takes the previous
    point's carrier (None starts a chain) and returns (mixture, this point's carrier) for the next point, which must
    read the sources the carrier covers plus one more: these sources, or without `carry_newest` all but the newest.
    The mixture and every gradient are `depth_attention`'s."""
    xs, eps, out_eps = check_depth_attention(sources, query, key_norm_weight, eps, out_norm_weight, out_eps)
    check_carrier(carrier, xs)
    older, tracked = (xs[:-1], xs[-1:]) if carrier is not None else ([], xs)
    point = kernel("chained_point", xs[0]) if takes_kernels_directly(xs[0]) else chained_point
    return point(tracked, older, carrier, query, key_norm_weight, out_norm_weight, eps, out_eps, carry_newest)
