"""Triton kernels of phase 2 of the two-phase computation (`attnres::merge_prefix_fwd/bwd`).

Forward, one pass per block of tokens: score the prefix (fp32, key rstd), merge it with the point's phase-1
statistics (m, z, u), divide, apply the fused output norm and store in the result's dtype (math in
attnres.ops.merge). The prefix is read through its row stride (a view is not copied). Backward, persistent over token blocks: recompute the token's mixture from the same inputs (its
row is all it needs), then write du, dz and dx; the `[d]` gradients of c and the output gain are summed per program
into `[programs, d]` buffers and reduced with torch afterwards: no atomics, deterministic, interpreter-safe.

Offsets that scale with tokens * d are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres.ops.triton.depth_attention import (
    TORCH_TO_TRITON,
    contiguous_or_none,
    flat_sources,
    num_programs,
    output_norm,
    output_norm_backward,
    padded_width,
    row_tiles,
    score_source,
    tiles_within,
    token_tile,
)


@triton.jit
def merge_tile(m, z, u, x, cv, eps, D: tl.constexpr):
    """The statistics (m, z `[BLOCK_T]`, u `[BLOCK_T, D_PAD]`) merged with a prefix tile x (fp32): (merged z, merged u,
    and for the backward the key rstd r, score s, weight e_a of the statistics and e_b of the prefix, `[BLOCK_T]`)."""
    r, s = score_source(x, cv, eps, D)
    top = tl.maximum(m, s)
    ea = tl.exp(m - top)
    eb = tl.exp(s - top)
    return ea * z + eb, ea[:, None] * u + eb[:, None] * x, r, s, ea, eb


@row_tiles(key=["D", "HAS_PREFIX", "OUT_NORM", "OUT_DTYPE"])
@triton.jit
def merge_prefix_fwd_kernel(
    m, z, u, prefix, c, out_weight, out, N, prefix_stride, eps, out_eps,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_PREFIX: tl.constexpr, OUT_NORM: tl.constexpr,
    OUT_DTYPE: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, cols, row_ok, col_ok, mask, offsets = token_tile(tl.program_id(0), N, D, D_PAD, BLOCK_T)
    zs = tl.load(z + rows, mask=row_ok, other=1.0)
    us = tl.load(u + offsets, mask=mask, other=0.0)
    if HAS_PREFIX:
        x = tl.load(prefix + (rows * prefix_stride)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        cv = tl.load(c + cols, mask=col_ok, other=0.0)
        zs, us, _, _, _, _ = merge_tile(tl.load(m + rows, mask=row_ok, other=0.0), zs, us, x, cv, eps, D)
    h = output_norm(us / zs[:, None], out_weight, cols, col_ok, out_eps, D, OUT_NORM)
    tl.store(out + offsets, h.to(OUT_DTYPE), mask=mask)


# tiles_within(16): more rows live than in the one-shot backward
@row_tiles(key=["D", "HAS_PREFIX", "OUT_NORM", "X_DTYPE"], tiles=(1024, 4096), prune=tiles_within(16))
@triton.jit
def merge_prefix_bwd_kernel(
    grad_out, m, z, u, prefix, c, out_weight, du_out, dz_out, dx_out, dc_part, dow_part, N, prefix_stride, programs,
    eps, out_eps,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_PREFIX: tl.constexpr, OUT_NORM: tl.constexpr,
    X_DTYPE: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Persistent: program p takes token blocks p, p + programs, ... and writes its sums of dc and dow in row p."""
    pid = tl.program_id(0)
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    dc = tl.zeros([D_PAD], tl.float32)
    dow = tl.zeros([D_PAD], tl.float32)

    # rows past N load as z = 1 and zeros elsewhere, so they add nothing (and no NaN) to the per-program sums
    for blk in range(pid, tl.cdiv(N, BLOCK_T), programs):
        rows, _, row_ok, _, mask, offsets = token_tile(blk, N, D, D_PAD, BLOCK_T)
        dh = tl.load(grad_out + offsets, mask=mask, other=0.0).to(tl.float32)

        za = tl.load(z + rows, mask=row_ok, other=1.0)
        ua = tl.load(u + offsets, mask=mask, other=0.0)
        zs, us = za, ua
        if HAS_PREFIX:
            x = tl.load(prefix + (rows * prefix_stride)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            cv = tl.load(c + cols, mask=col_ok, other=0.0)
            zs, us, r, s, ea, eb = merge_tile(tl.load(m + rows, mask=row_ok, other=0.0), za, ua, x, cv, eps, D)
        h = us / zs[:, None]
        if OUT_NORM:  # the fused PreNorm's backward turns grad_out into the gradient reaching h
            dh, dow = output_norm_backward(dh, h, dow, out_weight, cols, col_ok, out_eps, D)

        du = dh / zs[:, None]
        dz = -tl.sum(du * h, 1)
        if HAS_PREFIX:
            coef = ea * eb * tl.sum(du * (za[:, None] * x - ua), 1) / zs * r  # the cancellation-free form
            dx = eb[:, None] * du + coef[:, None] * cv[None, :] - (coef * s * r / D)[:, None] * x
            tl.store(dx_out + offsets, dx.to(X_DTYPE), mask=mask)
            dc += tl.sum(coef[:, None] * x, 0)
            du = ea[:, None] * du
            dz = ea * dz
        tl.store(du_out + offsets, du, mask=mask)
        tl.store(dz_out + rows, dz, mask=row_ok)

    if HAS_PREFIX:
        tl.store(dc_part + pid * D + cols, dc, mask=col_ok)
    if OUT_NORM:
        tl.store(dow_part + pid * D + cols, dow, mask=col_ok)


def row_stride(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.stride(0)


def _check_stats(u: torch.Tensor) -> None:
    if u.dtype != torch.float32:
        raise TypeError(f"u: the Triton merge kernels take float32 statistics, got {u.dtype}")


def triton_merge_prefix_fwd(m, z, u, prefix, c, out_norm_weight, eps, out_eps, dtype):
    """Kernel of `attnres::merge_prefix_fwd` (it takes every argument of the op but `rows`)."""
    _check_stats(u)
    n, d = u.shape
    if dtype not in TORCH_TO_TRITON:
        raise TypeError(f"dtype: the Triton merge kernels write float32, bfloat16 or float16, got {dtype}")
    x = None if prefix is None else flat_sources([prefix])[0]
    out = torch.empty((n, d), dtype=dtype, device=u.device)
    if n > 0:
        merge_prefix_fwd_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_T"]),)](
            m.contiguous(), z.contiguous(), u.contiguous(), x, contiguous_or_none(c),
            contiguous_or_none(out_norm_weight), out, n, row_stride(x), eps, out_eps,
            D=d, D_PAD=padded_width(d), HAS_PREFIX=x is not None, OUT_NORM=out_norm_weight is not None,
            OUT_DTYPE=TORCH_TO_TRITON[dtype],
        )
    return out


def triton_merge_prefix_bwd(grad_out, m, z, u, prefix, c, out_norm_weight, eps, out_eps):
    """Kernel of `attnres::merge_prefix_bwd`."""
    _check_stats(u)
    n, d = u.shape
    x = None if prefix is None else flat_sources([prefix])[0]
    device = u.device
    du = torch.empty((n, d), dtype=torch.float32, device=device)
    dz = torch.empty(n, dtype=torch.float32, device=device)
    dx = u.new_empty(0) if x is None else torch.empty((n, d), dtype=x.dtype, device=device)
    programs = num_programs(device, n)
    dc_part = u.new_zeros((programs, d) if x is not None else (1, 0))
    dow_part = u.new_zeros((programs, d) if out_norm_weight is not None else (1, 0))
    if n > 0:
        merge_prefix_bwd_kernel[(programs,)](
            grad_out.reshape(n, d).contiguous(), m.contiguous(), z.contiguous(), u.contiguous(), x,
            contiguous_or_none(c), contiguous_or_none(out_norm_weight), du, dz, dx, dc_part, dow_part,
            n, row_stride(x), programs, eps, out_eps,
            D=d, D_PAD=padded_width(d), HAS_PREFIX=x is not None, OUT_NORM=out_norm_weight is not None,
            X_DTYPE=TORCH_TO_TRITON[torch.float32 if x is None else x.dtype],
        )
    return du, dz, dx, dc_part.sum(0), dow_part.sum(0)
