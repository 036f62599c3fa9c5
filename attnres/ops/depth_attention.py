"""The depth-attention operator: one aggregation point of AttnRes (docs/design.md section 2), with a hand-written
backward.

Forward, per token:  s_j = (x_j . c) * rsqrt(mean(x_j^2) + eps),  alpha = softmax_j(s),  m = sum_j alpha_j x_j,
with c = g * w the key gain folded into the pseudo-query, and optionally the sublayer PreNorm o * RMSNorm(m).

Backward (r_j = rsqrt(mean(x_j^2) + eps), dm the gradient reaching m):
    ds_j = alpha_j * (dm . x_j - dm . m)
    dx_j = alpha_j dm + ds_j r_j c - ds_j s_j r_j^2 / d * x_j
    dc   = sum_j sum_tokens ds_j r_j x_j
Sources are visited one at a time, so neither the stacked sources in fp32 nor the normalised keys ever exist; the
only saved tensors are the sources themselves (no copy) and two `[R, ...]` fp32 rows (weights and rstd).

The forward and the backward are `torch.library` custom ops with fake registrations, so `torch.compile(fullgraph=True)`
traces through them; the op's autograd is one Function, `_Point`, which calls them traced and the kernels themselves
eagerly. The public function validates and calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from attnres.ops.checks import check_depth_attention
from attnres.ops.registry import kernel, portable, register_portable


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every model dtype; fp64 stays fp64 so that gradcheck can run the real code path."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fold_query(query: torch.Tensor, key_norm_weight: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """c = g * w in the accumulator dtype (docs/design.md section 2, step 1): scoring against c equals scoring the
    RMS-normed key."""
    return fold_queries(query.reshape(-1), key_norm_weight, acc)


def fold_queries(queries: torch.Tensor, key_norm_weights: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """`fold_query` for S queries `[S, d]` with their gains `[S, d]` (or None): phase 1's folded queries cs."""
    cs = as_dtype(queries, acc)
    return cs if key_norm_weights is None else cs * as_dtype(key_norm_weights, acc)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, without a dispatch when it is already of that dtype (inference folds queries at every point)."""
    return t if t.dtype == dtype else t.to(dtype)


def rms_normalize(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * x * rstd, rstd) over the last dim, in x's (accumulator) dtype."""
    rstd = torch.rsqrt(x.square().mean(-1) + eps)
    y = x * rstd.unsqueeze(-1)
    return (y if weight is None else y * weight.to(x.dtype)), rstd


def rms_normalize_backward(
    grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of `rms_normalize` w.r.t. x and weight, given its input x and saved rstd."""
    d = x.shape[-1]
    r = rstd.unsqueeze(-1)
    dweight = None if weight is None else (grad * x * r).reshape(-1, d).sum(0)
    a = grad if weight is None else grad * weight.to(x.dtype)
    dx = r * a - x * (r**3) * (a * x).sum(-1, keepdim=True) / d
    return dx, dweight


def flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> `[N, d]`: the op never mixes tokens, so every leading dim is just more tokens."""
    return x.reshape(-1, x.shape[-1])


def _scores(x: torch.Tensor, c: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rstd) of one source `[N, d]` (already in the accumulator dtype) against the folded query c."""
    rstd = torch.rsqrt(x.square().mean(-1) + eps)
    return (x @ c) * rstd, rstd


def _mix(xs: list[torch.Tensor], weights: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    mix = torch.zeros(xs[0].shape, dtype=acc, device=xs[0].device)
    for x, a in zip(xs, weights):
        mix.addcmul_(a.unsqueeze(-1), x.to(acc))
    return mix


@portable("depth_attention_fwd")
def torch_depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps):
    """Portable kernel of `depth_attention_fwd` in torch ops, one fp32 source at a time."""
    acc = c.dtype
    shape = sources[0].shape
    xs = [flat_tokens(x) for x in sources]
    s, rstd = zip(*(_scores(x.to(acc), c, eps) for x in xs))
    weights = torch.stack(s).softmax(dim=0)
    mix = _mix(xs, weights, acc)
    if out_norm_weight is not None:
        mix = rms_normalize(mix, out_norm_weight, out_eps)[0]
    lead = (len(xs), *shape[:-1])
    return mix.to(sources[0].dtype).reshape(shape), weights.reshape(lead), torch.stack(rstd).reshape(lead)


@portable("depth_attention_bwd")
def torch_depth_attention_bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps):
    """Portable kernel of `depth_attention_bwd` in torch ops, one fp32 source at a time."""
    grads = []
    dc, d_out_w = _torch_bwd(
        grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps,
        lambda j, dx: grads.append(dx.to(sources[j].dtype).reshape(sources[j].shape)),
    )
    return grads, dc, d_out_w


@portable("depth_attention_bwd_into")
def torch_depth_attention_bwd_into(
    grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps, into, accumulate
):
    """Portable kernel of `depth_attention_bwd_into`: the backward with the source gradients in place in `into`, one
    contiguous tensor per source in its dtype: added onto what the first `accumulate` of them hold (in the accumulator
    dtype, rounded once), written into the others. Returns (grad of c, grad of out_norm_weight) as
    `depth_attention_bwd` does."""
    rows = [t.view(-1, c.shape[0]) for t in into]

    def put(j, dx):
        rows[j].copy_(rows[j].to(dx.dtype) + dx if j < accumulate else dx)

    return _torch_bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps, put)


def _torch_bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps, put):
    """The backward in torch ops; hands each source's gradient `[N, d]` (accumulator dtype) to `put(j, dx)`."""
    acc = c.dtype
    d = c.shape[0]
    xs = [flat_tokens(x) for x in sources]
    weights = weights.reshape(len(xs), -1)
    rstd = rstd.reshape(len(xs), -1)
    mix = _mix(xs, weights, acc)
    dm = flat_tokens(grad_out).to(acc)
    d_out_w = torch.zeros_like(c)
    if out_norm_weight is not None:
        _, mix_rstd = rms_normalize(mix, None, out_eps)
        dm, d_out_w = rms_normalize_backward(dm, mix, mix_rstd, out_norm_weight)
    # softmax backward: ds_j = alpha_j * (g_j - sum_k alpha_k g_k) with g_j = dm . x_j (+ the weights' own grad)
    delta = (dm * mix).sum(-1)
    if grad_weights is not None:
        gw = grad_weights.reshape(len(xs), -1).to(acc)
        delta = delta + (weights * gw).sum(0)
    dc = torch.zeros_like(c)
    for j, x in enumerate(xs):
        xf = x.to(acc)
        g = (xf * dm).sum(-1)
        if grad_weights is not None:
            g = g + gw[j]
        ds = weights[j] * (g - delta)
        coef = ds * rstd[j]
        s = (xf @ c) * rstd[j]
        dx = weights[j].unsqueeze(-1) * dm + coef.unsqueeze(-1) * c - (coef * s * rstd[j] / d).unsqueeze(-1) * xf
        dc += coef @ xf
        put(j, dx)
    return dc, d_out_w.to(acc)


def point_fwd_from(fwd: Callable) -> Callable:
    """The `point_fwd` kernel from a one-shot forward kernel (or the custom op): the query folded in torch ops.

    The point kernels take a point's parameters (the query w `[d]` or `[1, d]`, its key gain g or None, the
    output-norm gain or None), fold c = g * w before the forward and return the gradients of w, g and the output-norm
    gain (None where a parameter is None), in their dtypes and shapes, as autograd forms them through the fold:

        point_fwd(sources, w, g, o, eps, out_eps) -> (out, weights, rstd, c)
        point_bwd(grad_out, grad_weights, sources, c, w, g, o, weights, rstd, eps, out_eps) -> (grads, dw, dg, do)
        point_bwd_into(..., into, accumulate) -> (dw, dg, do)

    A backend's own point kernels do all of it in one call (the CPU's): between two points a model runs a sublayer,
    and a separate op on these `[d]` vectors would then cost a cold cache's Python and dispatcher work, far more than
    the products themselves. Elsewhere they are composed from the one-shot kernels (`point_kernels_from`)."""

    def point_fwd(sources, query, gain, out_norm_weight, eps, out_eps):
        c = fold_query(query, gain, accumulator_dtype(sources[0].dtype))
        return (*fwd(sources, c, out_norm_weight, eps, out_eps), c)

    return point_fwd


def point_bwd_from(bwd: Callable) -> Callable:
    """The `point_bwd` kernel from a one-shot backward kernel (or the custom op): the parameters' gradients in torch
    ops (`point_fwd_from`)."""

    def point_bwd(grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, eps, out_eps):
        grads, dc, d_out_w = bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps)
        return grads, *parameter_grads(dc, d_out_w, query, gain, out_norm_weight)

    return point_bwd


def point_kernels_from(fwd: Callable, bwd: Callable, bwd_into: Callable) -> dict[str, Callable]:
    """The three point kernels (`point_fwd_from`) of a backend that has the one-shot kernels only."""

    def point_bwd_into(grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, eps, out_eps,
                       into, accumulate):
        dc, d_out_w = bwd_into(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps, into,
                               accumulate)
        return parameter_grads(dc, d_out_w, query, gain, out_norm_weight)

    return {"point_fwd": point_fwd_from(fwd), "point_bwd": point_bwd_from(bwd), "point_bwd_into": point_bwd_into}


def parameter_grads(dc, d_out_w, query, gain, out_norm_weight):
    """(dw, dg, do) from dc and the output-norm gain's gradient (accumulator dtype), as autograd forms them through
    `fold_query`: the same products, then the casts and the view back; None for a parameter that is None."""
    d_query = (dc if gain is None else dc * gain.to(dc.dtype)).to(query.dtype).view(query.shape)
    d_gain = None if gain is None else (dc * query.reshape(-1).to(dc.dtype)).to(gain.dtype)
    return d_query, d_gain, None if out_norm_weight is None else d_out_w.to(out_norm_weight.dtype)


register_portable(point_kernels_from(torch_depth_attention_fwd, torch_depth_attention_bwd,
                                     torch_depth_attention_bwd_into))


# The two ops below are the contract every backend's kernels keep (registry keys "depth_attention_fwd" and
# "depth_attention_bwd", the torch kernels above where a backend has none); each dispatches to the kernel that serves
# the sources.


@torch.library.custom_op("attnres::depth_attention_fwd", mutates_args=())
def depth_attention_fwd(
    sources: list[torch.Tensor], c: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float, out_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R sources `[..., d]` (fp32, bf16, fp16 or fp64, any strides), the folded query c `[d]` in the accumulator dtype
    (fp32; fp64 for fp64 sources), the optional output-norm gain `[d]`, the key and output-norm epsilons.

    Returns (output `[..., d]` in the sources' dtype, weights `[R, ...]`, key rstd `[R, ...]`), the two rows in the
    accumulator dtype; every output is fresh and contiguous.
    """
    return kernel("depth_attention_fwd", sources[0])(sources, c, out_norm_weight, eps, out_eps)


@depth_attention_fwd.register_fake
def _(sources, c, out_norm_weight, eps, out_eps):
    x = sources[0]
    lead = (len(sources), *x.shape[:-1])
    # contiguous, whatever the sources' strides: every backend returns a fresh contiguous output (inductor checks it)
    return x.new_empty(x.shape), x.new_empty(lead, dtype=c.dtype), x.new_empty(lead, dtype=c.dtype)


@torch.library.custom_op("attnres::depth_attention_bwd", mutates_args=())
def depth_attention_bwd(
    grad_out: torch.Tensor, grad_weights: torch.Tensor | None, sources: list[torch.Tensor], c: torch.Tensor,
    out_norm_weight: torch.Tensor | None, weights: torch.Tensor, rstd: torch.Tensor, eps: float, out_eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """grad_out `[..., d]`, the gradient of the weights `[R, ...]` or None, the forward's inputs and its saved weights
    and key rstd (which carries eps: a kernel may ignore `eps`).

    Returns (grad of each source in its shape and dtype, grad of c `[d]`, grad of out_norm_weight `[d]`, zeros when
    there is none), the last two in the accumulator dtype.
    """
    bwd = kernel("depth_attention_bwd", sources[0])
    return bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps)


@depth_attention_bwd.register_fake
def _(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps):
    return [x.new_empty(x.shape) for x in sources], c.new_empty(c.shape), c.new_empty(c.shape)  # contiguous


def grad_or_zeros(grad_out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The output's gradient as the kernels take it: contiguous, zeros where autograd passed none."""
    return torch.zeros_like(x) if grad_out is None else grad_out.contiguous()


def takes_kernels_directly(x: torch.Tensor) -> bool:
    """Whether an op over sources like `x` may call the kernels itself rather than through the custom ops: eagerly, on
    plain tensors. Traced, or on a tensor subclass (FakeTensor, DTensor), the custom ops' registrations serve them."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling()


# traced: the fold in torch ops around the custom ops, whose fake kernels tracing needs
traced_point_fwd, traced_point_bwd = point_fwd_from(depth_attention_fwd), point_bwd_from(depth_attention_bwd)


class _Point(torch.autograd.Function):
    """`depth_attention`'s autograd: one aggregation point from its parameters as they are (the point kernels fold the
    query and form its gradients, `point_fwd_from`), so a point has no fold of its own in the graph. Eagerly on plain
    tensors it calls the kernels that serve its sources, and keeps them for its backward: no custom op's Python layers
    (argument flattening, dispatch), a fixed cost at every point whatever the size. Traced, or on a tensor subclass,
    it calls the custom ops `attnres::depth_attention_fwd/bwd` instead. Where a backend has a `point` op of its own (the
    CPU's: this Function in C++), `depth_attention` takes that."""

    @staticmethod
    def forward(ctx, query, key_norm_weight, out_norm_weight, eps, out_eps, *sources):
        direct = takes_kernels_directly(sources[0])
        point_fwd = kernel("point_fwd", sources[0]) if direct else traced_point_fwd
        out, weights, rstd, c = point_fwd(list(sources), query, key_norm_weight, out_norm_weight, eps, out_eps)
        ctx.save_for_backward(c, query, key_norm_weight, out_norm_weight, weights, rstd, *sources)
        ctx.eps, ctx.out_eps, ctx.direct = eps, out_eps, direct
        if direct:
            ctx.point_bwd = kernel("point_bwd", sources[0])
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        return out, weights, rstd

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: a second derivative raises instead of missing terms
    def backward(ctx, grad_out, grad_weights, grad_rstd):
        c, query, gain, out_norm_weight, weights, rstd, *sources = ctx.saved_tensors
        point_bwd = ctx.point_bwd if ctx.direct else traced_point_bwd
        grads, d_query, d_gain, d_out_w = point_bwd(
            grad_or_zeros(grad_out, sources[0]), grad_weights, sources, c, query, gain, out_norm_weight, weights,
            rstd, ctx.eps, ctx.out_eps,
        )
        return d_query, d_gain, d_out_w, None, None, *grads


@portable("point")
def point(sources, query, gain, out_norm_weight, eps, out_eps):
    """The `point` op where a backend has none: (out, weights, rstd) through `_Point`."""
    return _Point.apply(query, gain, out_norm_weight, eps, out_eps, *sources)


def depth_attention(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,
    out_eps: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Mix R sources by a softmax over depth (one AttnRes aggregation point, docs/design.md section 2).

    Args:
        sources: R >= 1 tensors of equal shape `[..., d]`, dtype (fp32, bf16, fp16 or fp64) and device, or one
            stacked tensor `[R, ..., d]` (unbound, not copied).
        query: the pseudo-query w, `[d]` or `[1, d]`.
        key_norm_weight: the key RMSNorm gain g, `[d]`; None means no gain.
        eps: RMSNorm epsilon of the keys.
        out_norm_weight: when given, the sublayer PreNorm is fused: the result is `o * m * rsqrt(mean(m^2) + out_eps)`.
        out_eps: epsilon of that output norm; defaults to `eps`.
        return_weights: also return the depth weights.

    Returns:
        The mixture `[..., d]` in the sources' dtype, and with `return_weights` the weights `[R, ...]` in fp32
        (fp64 for fp64 sources). Differentiable w.r.t. every tensor argument.
    """
    xs, eps, out_eps = check_depth_attention(sources, query, key_norm_weight, eps, out_norm_weight, out_eps)
    run = kernel("point", xs[0]) if takes_kernels_directly(xs[0]) else point
    out, weights, _ = run(xs, query, key_norm_weight, out_norm_weight, eps, out_eps)
    return (out, weights) if return_weights else out
