"""Phase 2 of the two-phase computation as one op: a point's phase-1 statistics merged with its own prefix, finished.

`merge_prefix` equals `finish_stats(merge_stats(stats, depth_stats([prefix], w, g)), o)` without ever storing the
prefix's own `[N, d]` statistics. Per token, with (m_a, z_a, u_a) the point's phase-1 statistics, x the prefix and
c = g * w the folded query:

    r = rsqrt(mean(x^2) + eps),  s = (c . x) r,  M = max(m_a, s),  e_a = exp(m_a - M),  e_b = exp(s - M)
    h = (e_a u_a + e_b x) / z  with  z = e_a z_a + e_b,   out = h, or o * h * rsqrt(mean(h^2) + out_eps)

The shifts m_a, s (the prefix's own max, as in `depth_stats`) and M are stop-gradients, so e_a and e_b are constants
for the backward and only the prefix's weight exp(s - stop(s)) = 1 carries ds. With dh the gradient reaching h
(after the output norm's backward):

    du = dh / z,  dz = -(du . h),  du_a = e_a du,  dz_a = e_a dz
    coef = e_b (dz + du . x) r = e_a e_b (du . (z_a x - u_a)) r / z
    dx = e_b du + coef c - coef s r / d * x,  dc = sum_tokens coef x
The second form of coef is the one computed: in the first, du . x and du . h nearly cancel where the prefix
dominates the mixture (h ~ x).

Without a prefix it is just the finish: h = u_a / z_a. The backward recomputes h from the op's inputs (a token's
row is all it needs), so nothing beyond the inputs is saved.

Memory in training: u_a is `[N, d]` fp32, and phase 1's u for all S points of a block is one tensor, so saving u_a
(a view) would keep every block's whole `[S, N, d]` statistics alive until the backward, more than the residual history
itself. Given the `sources` phase 1 scored (the bank rows, which autograd holds anyway), the op saves no u: its
backward recomputes u_a from them with the point's query and the saved shift m_a (one more read of the rows, the
phase-1 kernel with one query), so a point holds only m and z `[N]` beyond what one-shot reads hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from attnres.ops.checks import FLOAT_DTYPES, check_eps, check_sources, check_vector
from attnres.ops.depth_attention import fold_query, rms_normalize, rms_normalize_backward, takes_kernels_directly
from attnres.ops.registry import kernel, portable
from attnres.ops.two_phase import SoftmaxStats, depth_stats_fwd


def _merge(m, z, u, prefix, c, eps):
    """(h `[N, d]`, merged z, e_a, e_b, the prefix x `[N, d]`, its score s and key rstd r), all `[N]` but h and x,
    in u's (accumulator) dtype."""
    x = prefix.to(u.dtype)
    r = torch.rsqrt(x.square().mean(-1) + eps)
    s = (x @ c) * r
    top = torch.maximum(m, s)
    ea, eb = torch.exp(m - top), torch.exp(s - top)
    z = ea * z + eb
    h = (ea.unsqueeze(-1) * u + eb.unsqueeze(-1) * x) / z.unsqueeze(-1)
    return h, z, ea, eb, x, s, r


@portable("merge_prefix_fwd")
def torch_merge_prefix_fwd(m, z, u, prefix, c, out_norm_weight, eps, out_eps, dtype):
    """Portable kernel of `merge_prefix_fwd` in torch ops (it takes every argument of the op but `rows`)."""
    h = u / z.unsqueeze(-1) if prefix is None else _merge(m, z, u, prefix, c, eps)[0]
    if out_norm_weight is not None:
        h = rms_normalize(h, out_norm_weight, out_eps)[0]
    return h.to(dtype)


@portable("merge_prefix_bwd")
def torch_merge_prefix_bwd(grad_out, m, z, u, prefix, c, out_norm_weight, eps, out_eps):
    """Portable kernel of `merge_prefix_bwd` in torch ops."""
    if prefix is None:
        h, z_merged = u / z.unsqueeze(-1), z
    else:
        h, z_merged, ea, eb, x, s, r = _merge(m, z, u, prefix, c, eps)
    dh = grad_out.to(u.dtype)
    d_out_w = u.new_empty(0)
    if out_norm_weight is not None:
        dh, d_out_w = rms_normalize_backward(dh, h, rms_normalize(h, None, out_eps)[1], out_norm_weight)
    du = dh / z_merged.unsqueeze(-1)
    dz = -(du * h).sum(-1)
    if prefix is None:
        return du, dz, u.new_empty(0), u.new_empty(0), d_out_w
    coef = ea * eb * (du * (z.unsqueeze(-1) * x - u)).sum(-1) / z_merged * r
    dx = eb.unsqueeze(-1) * du + coef.unsqueeze(-1) * c - (coef * s * r / u.shape[-1]).unsqueeze(-1) * x
    return ea.unsqueeze(-1) * du, ea * dz, dx.to(prefix.dtype), coef @ x, d_out_w


# The two ops below are the contract every backend's kernels keep (registry keys "merge_prefix_fwd" and
# "merge_prefix_bwd", the torch kernels above where a backend has none); each dispatches to the kernel that serves the
# statistics.


@torch.library.custom_op("attnres::merge_prefix_fwd", mutates_args=())
def merge_prefix_fwd(
    m: torch.Tensor, z: torch.Tensor, u: torch.Tensor, prefix: torch.Tensor | None, c: torch.Tensor | None,
    out_norm_weight: torch.Tensor | None, eps: float, out_eps: float, dtype: torch.dtype, rows: list[torch.Tensor],
) -> torch.Tensor:
    """m, z `[N]`, u `[N, d]` (accumulator dtype), prefix `[N, d]` (any token stride) and c `[d]` (both or neither,
    but c is needed with rows) -> out `[N, d]` in `dtype`, fresh and contiguous. `rows`: the sources u was scored
    from (`[N, d]` each), for the backward to recompute u instead of saving it (the kernels never read them); empty:
    u is saved."""
    fwd = kernel("merge_prefix_fwd", u)
    return fwd(m, z, u, prefix, c, out_norm_weight, eps, out_eps, dtype)


@merge_prefix_fwd.register_fake
def _(m, z, u, prefix, c, out_norm_weight, eps, out_eps, dtype, rows):
    return u.new_empty(u.shape, dtype=dtype)  # every backend returns a contiguous result


@torch.library.custom_op("attnres::merge_prefix_bwd", mutates_args=())
def merge_prefix_bwd(
    grad_out: torch.Tensor, m: torch.Tensor, z: torch.Tensor, u: torch.Tensor, prefix: torch.Tensor | None,
    c: torch.Tensor | None, out_norm_weight: torch.Tensor | None, eps: float, out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_out `[N, d]` and the forward's inputs. Returns grads (u `[N, d]`, z `[N]`, prefix `[N, d]` in its dtype,
    c `[d]`, out_norm_weight `[d]`) in the accumulator dtype but for the prefix's; m is a stop-gradient. A grad whose
    input is None is empty."""
    bwd = kernel("merge_prefix_bwd", u)
    return bwd(grad_out, m, z, u, prefix, c, out_norm_weight, eps, out_eps)


@merge_prefix_bwd.register_fake
def _(grad_out, m, z, u, prefix, c, out_norm_weight, eps, out_eps):
    def grad_of(t, dtype):  # contiguous, as every backend returns them
        return u.new_empty(0) if t is None else t.new_empty(t.shape, dtype=dtype)

    dx = grad_of(prefix, None if prefix is None else prefix.dtype)
    dc = grad_of(None if prefix is None else c, u.dtype)  # c is scored only with a prefix: empty without one
    return grad_of(u, u.dtype), grad_of(z, z.dtype), dx, dc, grad_of(out_norm_weight, u.dtype)


def recompute_stats_u(rows: list[torch.Tensor], c: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    """u `[N, d]` of the rows under the folded query c `[d]`, with the shift m `[N]` it had in phase 1: the phase-1
    op with this one query, its own shift m' moved to m (the same up to rounding: a factor exp(m' - m) ~ 1)."""
    m_own, _, u, _ = depth_stats_fwd(rows, c.unsqueeze(0), eps)
    return u[0] * torch.exp(m_own[0] - m).unsqueeze(-1)


def _setup_context(ctx, inputs, output):
    m, z, u, prefix, c, out_norm_weight, eps, out_eps, dtype, rows = inputs
    ctx.num_rows = len(rows)
    ctx.save_for_backward(m, z, prefix, c, out_norm_weight, *(rows if rows else [u]))
    ctx.eps, ctx.out_eps = eps, out_eps
    ctx.out_norm_dtype = None if out_norm_weight is None else out_norm_weight.dtype


def _backward(ctx, grad_out):
    m, z, prefix, c, out_norm_weight, *kept = ctx.saved_tensors
    u = recompute_stats_u(kept, c, m, ctx.eps) if ctx.num_rows else kept[0]
    du, dz, dx, dc, d_out_w = merge_prefix_bwd(
        grad_out.contiguous(), m, z, u, prefix, c, out_norm_weight, ctx.eps, ctx.out_eps
    )
    dx, dc = (None, None) if prefix is None else (dx, dc)
    d_out_w = None if out_norm_weight is None else d_out_w.to(ctx.out_norm_dtype)
    # the rows only stand in for u, whose gradient (du) carries theirs through phase 1
    return None, dz, du, dx, dc, d_out_w, None, None, None, [None] * ctx.num_rows


merge_prefix_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_stats(stats: SoftmaxStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m, z `[...]` and u `[..., d]`, one dtype (fp32, or fp64 for gradcheck), one device."""
    if not isinstance(stats, tuple) or len(stats) != 3 or not all(isinstance(t, torch.Tensor) for t in stats):
        raise TypeError(f"stats: expected a SoftmaxStats of three tensors (m, z, u), got {type(stats).__name__}")
    m, z, u = stats
    if u.dim() < 1 or u.shape[-1] == 0 or m.shape != u.shape[:-1] or z.shape != u.shape[:-1]:
        raise ValueError(
            f"stats: expected m, z of shape [...] and u of shape [..., d], got m {tuple(m.shape)}, "
            f"z {tuple(z.shape)}, u {tuple(u.shape)}"
        )
    if u.dtype not in (torch.float32, torch.float64) or m.dtype != u.dtype or z.dtype != u.dtype:
        raise TypeError(f"stats: expected m, z, u all float32 (or all float64), got {m.dtype}, {z.dtype}, {u.dtype}")
    if m.device != u.device or z.device != u.device:
        raise ValueError(f"stats: expected m, z, u on one device, got {m.device}, {z.device}, {u.device}")
    return m, z, u


def _check_prefix(prefix: torch.Tensor | None, u: torch.Tensor) -> None:
    if prefix is None:
        return
    if not isinstance(prefix, torch.Tensor) or prefix.dtype not in FLOAT_DTYPES:
        raise TypeError(f"prefix: expected a floating tensor or None, got {getattr(prefix, 'dtype', type(prefix))}")
    if prefix.shape != u.shape or prefix.device != u.device:
        raise ValueError(
            f"prefix: expected shape {tuple(u.shape)} on {u.device} (that of stats.u), "
            f"got {tuple(prefix.shape)} on {prefix.device}"
        )


def _check_rows(sources: Sequence[torch.Tensor], u: torch.Tensor) -> list[torch.Tensor]:
    """The sources as `[N, d]` rows (views where their strides allow), each of u's shape and on its device."""
    xs = check_sources(sources)
    if xs[0].shape != u.shape or xs[0].device != u.device:
        raise ValueError(
            f"sources: expected shape {tuple(u.shape)} on {u.device} (that of stats.u), "
            f"got {tuple(xs[0].shape)} on {xs[0].device}"
        )
    return [x.reshape(-1, u.shape[-1]) for x in xs]


def _check_point(query, key_norm_weight, out_norm_weight, eps, out_eps, dtype, d, device) -> tuple[float, float]:
    """A phase-2 point's own arguments; returns (eps, out_eps) as floats."""
    check_vector("query", query, d, device, allow_rows=True)
    check_vector("key_norm_weight", key_norm_weight, d, device)
    check_vector("out_norm_weight", out_norm_weight, d, device)
    eps, out_eps = check_eps("eps", eps), check_eps("out_eps", out_eps)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {FLOAT_DTYPES} or None, got {dtype}")
    return eps, out_eps


def merge_prefix(
    stats: SoftmaxStats,
    prefix: torch.Tensor | None,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    dtype: torch.dtype | None = None,
    sources: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Phase 2 of one point: its phase-1 statistics merged with its prefix, finished, in one pass per token.

    Args:
        stats: the point's phase-1 statistics of one query: m, z `[...]`, u `[..., d]` (fp32; fp64 for gradcheck).
        prefix: the block's partial sum `[..., d]`, scored against the query and merged; None: finish only.
        query: the point's pseudo-query w, `[d]` or `[1, d]`.
        key_norm_weight: its key RMSNorm gain g `[d]`, or None for no gain.
        eps: RMSNorm epsilon of the keys.
        out_norm_weight: when given, the sublayer PreNorm o `[d]` is fused into the finish.
        out_eps: epsilon of that output norm.
        dtype: dtype of the result; None keeps u's.
        sources: the sources phase 1 scored (each `[..., d]`), when stats are theirs under this query, key gain and
            eps: the backward then recomputes u from them instead of keeping it, so autograd holds no `[..., d]` fp32
            row for this point (the sources it holds anyway). None: u is kept for the backward.

    Returns:
        `finish_stats(merge_stats(stats, depth_stats([prefix], query, key_norm_weight)), out_norm_weight)` `[..., d]`.
        Differentiable w.r.t. z, u, prefix, query and both gains; m is a stop-gradient shift.
    """
    m, z, u = _check_stats(stats)
    d, device = u.shape[-1], u.device
    _check_prefix(prefix, u)
    eps, out_eps = _check_point(query, key_norm_weight, out_norm_weight, eps, out_eps, dtype, d, device)

    rows = [] if sources is None else _check_rows(sources, u)

    c = None if prefix is None and not rows else fold_query(query, key_norm_weight, u.dtype)
    x = None if prefix is None else prefix.reshape(-1, d)
    dtype = u.dtype if dtype is None else dtype
    flat = (m.reshape(-1), z.reshape(-1), u.reshape(-1, d))
    out = merge_prefix_fwd(*flat, x, c, out_norm_weight, eps, out_eps, dtype, rows)
    return out.reshape(u.shape)


# Phase 2 of a group of Full points (design.md section 4): phase 1 scored the sources a group starts with for all its
# points at once; each point then merges in the K sources written since (K = 0 at the group's first point). Per
# token, with (m_a, z_a, u_a) the point's phase-1 statistics and c its folded query:
#
#     r_k = rsqrt(mean(x_k^2) + eps),  s_k = (c . x_k) r_k,  M = max(m_a, s_1 .. s_K)
#     e_a = exp(m_a - M),  e_k = exp(s_k - M),  Z = e_a z_a + sum_k e_k,  h = (e_a u_a + sum_k e_k x_k) / Z
#
# and out = h or o * RMSNorm(h). The shifts are stop-gradients; with g the gradient reaching h and p_k = e_k / Z:
#
#     du_a = e_a g / Z,  dz_a = -e_a (g . h) / Z,  coef_k = p_k (g . x_k - g . h) r_k
#     dx_k = p_k g + coef_k c - coef_k s_k r_k / d x_k,  dc = sum_tokens sum_k coef_k x_k
#
# (the one-shot backward's softmax terms, with the phase-1 set as one more source of weight e_a z_a / Z).


def _merge_sources(m, z, u, sources, c, eps):
    """(h `[N, d]`, Z, e_a, per source (x, e_k, s_k, r_k)), in u's (accumulator) dtype."""
    xs = [x.to(u.dtype) for x in sources]
    r = [torch.rsqrt(x.square().mean(-1) + eps) for x in xs]
    s = [(x @ c) * rk for x, rk in zip(xs, r)]
    top = torch.stack([m, *s]).amax(0)
    ea, e = torch.exp(m - top), [torch.exp(sk - top) for sk in s]
    z_all = ea * z + sum(e, torch.zeros_like(z))
    acc = ea.unsqueeze(-1) * u
    for x, ek in zip(xs, e):
        acc = acc + ek.unsqueeze(-1) * x
    return acc / z_all.unsqueeze(-1), z_all, ea, list(zip(xs, e, s, r))


@portable("merge_sources_fwd")
def torch_merge_sources_fwd(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype):
    """Portable kernel of `merge_sources_fwd` in torch ops."""
    h = _merge_sources(m, z, u, sources, c, eps)[0]
    if out_norm_weight is not None:
        h = rms_normalize(h, out_norm_weight, out_eps)[0]
    return h.to(dtype)


@portable("merge_sources_bwd")
def torch_merge_sources_bwd(grad_out, m, z, u, sources, c, out_norm_weight, eps, out_eps):
    """Portable kernel of `merge_sources_bwd` in torch ops."""
    h, z_all, ea, terms = _merge_sources(m, z, u, sources, c, eps)
    g = grad_out.to(u.dtype)
    d_out_w = u.new_empty(0)
    if out_norm_weight is not None:
        g, d_out_w = rms_normalize_backward(g, h, rms_normalize(h, None, out_eps)[1], out_norm_weight)
    gh = (g * h).sum(-1)
    dxs, dc = [], None if c is None else torch.zeros_like(c)
    for x, ek, s, r in terms:
        p = ek / z_all
        coef = p * ((g * x).sum(-1) - gh) * r
        dxs.append((p.unsqueeze(-1) * g + coef.unsqueeze(-1) * c - (coef * s * r / x.shape[-1]).unsqueeze(-1) * x).to(
            sources[0].dtype))
        dc += coef @ x
    w = ea / z_all
    return w.unsqueeze(-1) * g, -w * gh, dxs, u.new_empty(0) if dc is None else dc, d_out_w


@torch.library.custom_op("attnres::merge_sources_fwd", mutates_args=())
def merge_sources_fwd(
    m: torch.Tensor, z: torch.Tensor, u: torch.Tensor, sources: list[torch.Tensor], c: torch.Tensor | None,
    out_norm_weight: torch.Tensor | None, eps: float, out_eps: float, dtype: torch.dtype,
) -> torch.Tensor:
    """m, z `[N]`, u `[N, d]` (accumulator dtype), K >= 0 sources `[N, d]` (any token stride, unit stride along d; c
    `[d]` needed when K > 0) -> out `[N, d]` in `dtype`, fresh and contiguous."""
    return kernel("merge_sources_fwd", u)(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype)


@merge_sources_fwd.register_fake
def _(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype):
    return u.new_empty(u.shape, dtype=dtype)


@torch.library.custom_op("attnres::merge_sources_bwd", mutates_args=())
def merge_sources_bwd(
    grad_out: torch.Tensor, m: torch.Tensor, z: torch.Tensor, u: torch.Tensor, sources: list[torch.Tensor],
    c: torch.Tensor | None, out_norm_weight: torch.Tensor | None, eps: float, out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """grad_out `[N, d]` and the forward's inputs. Returns grads (u `[N, d]`, z `[N]`, each source in its dtype, c
    `[d]`, out_norm_weight `[d]`), all but the sources' in the accumulator dtype; m is a stop-gradient. The grad of c
    (without sources) or of the gain (without one) is empty."""
    return kernel("merge_sources_bwd", u)(grad_out, m, z, u, sources, c, out_norm_weight, eps, out_eps)


@merge_sources_bwd.register_fake
def _(grad_out, m, z, u, sources, c, out_norm_weight, eps, out_eps):
    dc = u.new_empty(0) if c is None or not sources else c.new_empty(c.shape)
    d_out_w = u.new_empty(0) if out_norm_weight is None else u.new_empty(out_norm_weight.shape)
    return u.new_empty(u.shape), z.new_empty(z.shape), [x.new_empty(x.shape) for x in sources], dc, d_out_w


def _setup_sources_context(ctx, inputs, output):
    m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype = inputs
    ctx.save_for_backward(m, z, u, c, out_norm_weight, *sources)
    ctx.eps, ctx.out_eps = eps, out_eps


def _sources_grads(bwd, ctx, grad_out):
    """(du, dz, the sources' grads, dc, d_out_w) from `bwd` (a `merge_sources_bwd`) on what `ctx` saved; None where
    an input takes no gradient."""
    m, z, u, c, out_norm_weight, *sources = ctx.saved_tensors
    du, dz, dxs, dc, d_out_w = bwd(grad_out.contiguous(), m, z, u, sources, c, out_norm_weight, ctx.eps, ctx.out_eps)
    dc = dc if sources and c is not None else None
    d_out_w = None if out_norm_weight is None else d_out_w.to(out_norm_weight.dtype)
    return du, dz, list(dxs) if sources else [], dc, d_out_w


def _sources_backward(ctx, grad_out):
    du, dz, dxs, dc, d_out_w = _sources_grads(merge_sources_bwd, ctx, grad_out)
    return None, dz, du, dxs, dc, d_out_w, None, None, None


merge_sources_fwd.register_autograd(_sources_backward, setup_context=_setup_sources_context)


class _MergeSources(torch.autograd.Function):
    """`merge_sources_fwd` and its autograd, eagerly on plain tensors where the backend has no `merge_sources` op of its
    own (the CPU's is a C++ autograd node): the kernels called directly, without the custom op's Python layers
    (argument flattening, dispatch), a fixed cost at every point of a group."""

    @staticmethod
    def forward(ctx, m, z, u, c, out_norm_weight, eps, out_eps, dtype, *sources):
        sources = list(sources)
        out = kernel("merge_sources_fwd", u)(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype)
        _setup_sources_context(ctx, (m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype), out)
        ctx.bwd = kernel("merge_sources_bwd", u)
        return out

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: a second derivative raises instead of missing terms
    def backward(ctx, grad_out):
        du, dz, dxs, dc, d_out_w = _sources_grads(ctx.bwd, ctx, grad_out)
        return None, dz, du, dc, d_out_w, None, None, None, *dxs


@portable("merge_sources")
def merge_sources_point(m, z, u, sources, query, gain, out_norm_weight, eps, out_eps, dtype):
    """The `merge_sources` op where a backend has none: the query folded in torch ops, then `_MergeSources`."""
    c = fold_query(query, gain, u.dtype) if sources else None
    return _MergeSources.apply(m, z, u, c, out_norm_weight, eps, out_eps, dtype, *sources)


def merge_sources(
    stats: SoftmaxStats,
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Phase 2 of one point of a Full group: its phase-1 statistics merged with the sources written since, finished.

    Args:
        stats: the point's phase-1 statistics of one query: m, z `[...]`, u `[..., d]` (fp32; fp64 for gradcheck).
        sources: K >= 0 tensors `[..., d]` of u's shape (one dtype), scored against the query and merged.
        query, key_norm_weight, eps, out_norm_weight, out_eps, dtype: as for `merge_prefix`.

    Returns:
        `finish_stats(merge_stats(stats, depth_stats(sources, query, key_norm_weight)), out_norm_weight)` `[..., d]`
        (without sources, `finish_stats(stats, ...)`). Differentiable w.r.t. z, u, the sources, query and both gains;
        m is a stop-gradient shift.
    """
    m, z, u = _check_stats(stats)
    d, device = u.shape[-1], u.device
    xs = _check_rows(sources, u) if len(sources) else []
    eps, out_eps = _check_point(query, key_norm_weight, out_norm_weight, eps, out_eps, dtype, d, device)
    flat, dtype = (m.reshape(-1), z.reshape(-1), u.reshape(-1, d)), u.dtype if dtype is None else dtype
    if takes_kernels_directly(u):
        out = kernel("merge_sources", u)(*flat, xs, query, key_norm_weight, out_norm_weight, eps, out_eps, dtype)
    else:
        c = fold_query(query, key_norm_weight, u.dtype) if xs else None
        out = merge_sources_fwd(*flat, xs, c, out_norm_weight, eps, out_eps, dtype)
    return out.reshape(u.shape)
