"""Triton kernels of phase 1 of the two-phase computation (`attnres::depth_stats_fwd/bwd`).

Forward: program (token block, query q) streams the R sources once with the operator's online softmax and writes the
statistics m, z `[S, N]` and u `[S, N, d]` of query q. The S programs of one token block are adjacent in the launch,
so they share the sources' tile in L2 and the sources are read from memory about once.

Backward, per token (s_qj = c_q . x_j r_j, p_qj = exp(s_qj - m_q), m held fixed):
    coef_qj = p_qj (gz_q + gu_q . x_j) r_j
    dx_j    = sum_q p_qj gu_q + sum_q coef_qj c_q - (sum_q coef_qj s_qj) r_j / d * x_j
    dc_q    = sum_tokens sum_j coef_qj x_j
The small `[S, R]` products of a token are matrix products over d, taken in chunks of BLOCK_D: a first sweep forms
the scores and gu . x_j, a second writes dx_j; coef goes to a `[R, S, N]` buffer from which a second kernel sums dcs
over tokens (one more read of the sources, no atomics). All products in fp32 (`tl.dot` with ieee precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres.ops.triton.depth_attention import (
    INTERPRETING,
    TORCH_TO_TRITON,
    flat_sources,
    load_source,
    num_programs,
    online_softmax_start,
    online_softmax_update,
    padded_width,
    pointer_table,
    row_tiles,
    score_source,
    token_tile,
)

# The backward holds `[S, R]` tiles padded to powers of two of at least 16 (the smallest `tl.dot`); at 64 rows an
# sm_90 build starts to spill, past it the tiles no longer fit. A block's queries and summaries are far fewer.
MAX_STATS_ROWS = 64
# Tokens per step of the dcs reduction (the interpreter's cost grows with tile size, a GPU's with steps).
DCS_BLOCK_N = 16 if INTERPRETING else 64


@row_tiles(key=["D", "DTYPE"])
@triton.jit
def depth_stats_fwd_kernel(
    table, cs, m_out, z_out, u_out, rstd, N, R, S, eps,
    D: tl.constexpr, D_PAD: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    q = pid % S
    rows, cols, row_ok, col_ok, mask, _ = token_tile(pid // S, N, D, D_PAD, BLOCK_T)
    cv = tl.load(cs + q * D + cols, mask=col_ok, other=0.0).to(tl.float32)

    stores_rstd = tl.where(q == 0, row_ok, False)  # every query sees the same key rstd: query 0 stores it
    n64 = tl.cast(N, tl.int64)  # N == 1 arrives as a constant (no .to)
    m, z, acc = online_softmax_start(BLOCK_T, D_PAD)
    for j in range(R):
        x = load_source(table, j, rows, cols, mask, DTYPE, ALIGNED)
        r, s = score_source(x, cv, eps, D)
        tl.store(rstd + j * n64 + rows, r, mask=stores_rstd)
        m, z, acc = online_softmax_update(m, z, acc, s, x)

    stat_rows = q * n64 + rows
    tl.store(m_out + stat_rows, m, mask=row_ok)
    tl.store(z_out + stat_rows, z, mask=row_ok)
    tl.store(u_out + stat_rows[:, None] * D + cols[None, :], acc, mask=mask)


@triton.jit
def depth_stats_bwd_kernel(
    table, cs, m, rstd, grad_z, grad_u, coef_out, N, R, S, programs,
    D: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, R_PAD: tl.constexpr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Persistent over tokens; the table holds R sources, then R grads. Writes dx and coef `[R, S, N]`."""
    pid = tl.program_id(0)
    n64 = tl.cast(N, tl.int64)  # N == 1 arrives as a constant (no .to)
    qs = tl.arange(0, S_PAD)
    js = tl.arange(0, R_PAD)
    q_ok = qs < S
    j_ok = js < R
    qj_ok = q_ok[:, None] & j_ok[None, :]
    # the table's (data pointer, row stride) pairs: R sources, then R grads
    src = tl.load(table + 2 * js, mask=j_ok, other=0).to(tl.pointer_type(DTYPE))
    src_stride = tl.load(table + 2 * js + 1, mask=j_ok, other=0)
    dst = tl.load(table + 2 * (R + js), mask=j_ok, other=0).to(tl.pointer_type(DTYPE))
    dst_stride = tl.load(table + 2 * (R + js) + 1, mask=j_ok, other=0)
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        src_stride = tl.multiple_of(src_stride, 8)
        dst_stride = tl.multiple_of(dst_stride, 8)
    chunk = tl.arange(0, BLOCK_D)

    for n in range(pid, N, programs):
        tok = (n + tl.arange(0, 1)).to(tl.int64)  # [1]: keeps the token's offsets 64-bit
        q_rows = qs * n64 + tok  # row of (q, token) in the [S, N] statistics
        src_row = src + tok * src_stride  # [R_PAD]: the token's row in each source
        dst_row = dst + tok * dst_stride

        # sweep 1: scores c_q . x_j and gu_q . x_j over d
        cx = tl.zeros([S_PAD, R_PAD], tl.float32)
        gx = tl.zeros([S_PAD, R_PAD], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + chunk
            col_ok = cols < D
            x = tl.load(src_row[:, None] + cols[None, :], mask=j_ok[:, None] & col_ok[None, :], other=0.0)
            x = x.to(tl.float32)
            gu = tl.load(grad_u + q_rows[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            cq = tl.load(cs + qs[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            cx += tl.dot(cq, tl.trans(x), input_precision="ieee")
            gx += tl.dot(gu, tl.trans(x), input_precision="ieee")

        r = tl.load(rstd + js * n64 + tok, mask=j_ok, other=0.0)
        s = cx * r[None, :]
        shift = tl.load(m + q_rows, mask=q_ok, other=0.0)
        gz = tl.load(grad_z + q_rows, mask=q_ok, other=0.0)
        p = tl.where(qj_ok, tl.exp(s - shift[:, None]), 0.0)
        coef = p * (gz[:, None] + gx) * r[None, :]
        x_scale = tl.sum(coef * s, 0) * r / D  # [R_PAD]
        tl.store(coef_out + (js[None, :] * S + qs[:, None]) * n64 + tok, coef, mask=qj_ok)

        # sweep 2: dx_j = p^T gu + coef^T c - x_scale_j x_j
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + chunk
            col_ok = cols < D
            x_mask = j_ok[:, None] & col_ok[None, :]
            x = tl.load(src_row[:, None] + cols[None, :], mask=x_mask, other=0.0).to(tl.float32)
            gu = tl.load(grad_u + q_rows[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            cq = tl.load(cs + qs[:, None] * D + cols[None, :], mask=q_ok[:, None] & col_ok[None, :], other=0.0)
            dx = tl.dot(tl.trans(p), gu, input_precision="ieee") + tl.dot(tl.trans(coef), cq, input_precision="ieee")
            dx -= x_scale[:, None] * x
            tl.store(dst_row[:, None] + cols[None, :], dx.to(DTYPE), mask=x_mask)


@triton.jit
def depth_stats_dcs_kernel(
    table, coef, dcs_part, N, R, S,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, S_PAD: tl.constexpr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Program (channel block, token split): dcs_part[split, q, cols] = sum over its tokens and j of coef_qj x_j."""
    splits = tl.num_programs(1)
    split = tl.program_id(1)
    n64 = tl.cast(N, tl.int64)  # N == 1 arrives as a constant (no .to)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    qs = tl.arange(0, S_PAD)
    acc = tl.zeros([S_PAD, BLOCK_D], tl.float32)
    for blk in range(split, tl.cdiv(N, BLOCK_N), splits):
        toks = (blk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        tok_ok = toks < N
        x_mask = tok_ok[:, None] & col_ok[None, :]
        c_mask = (qs < S)[:, None] & tok_ok[None, :]
        for j in range(R):
            x = load_source(table, j, toks, cols, x_mask, DTYPE, ALIGNED)
            cf = tl.load(coef + (j * S + qs[:, None]) * n64 + toks[None, :], mask=c_mask, other=0.0)
            acc += tl.dot(cf, x, input_precision="ieee")
    tl.store(dcs_part + (split * S + qs[:, None]) * D + cols[None, :], acc, mask=(qs < S)[:, None] & col_ok[None, :])


def check_stats_rows(name: str, count: int, remedy: str) -> None:
    if count > MAX_STATS_ROWS:
        raise ValueError(f"{name}: the Triton phase-1 kernels take at most {MAX_STATS_ROWS}, got {count}; {remedy}")


QUERIES_REMEDY = "score the queries in groups"
SOURCES_REMEDY = "score the sources in groups and combine their statistics with merge_stats"


def triton_depth_stats_fwd(sources, cs, eps):
    """Kernel of `attnres::depth_stats_fwd`: one program per (token block, query)."""
    xs = flat_sources(sources)
    n, d = xs[0].shape
    S, R, device = cs.shape[0], len(xs), xs[0].device
    check_stats_rows("cs (queries)", S, QUERIES_REMEDY)
    m = torch.empty((S, n), dtype=torch.float32, device=device)
    z = torch.empty_like(m)
    u = torch.empty((S, n, d), dtype=torch.float32, device=device)
    rstd = torch.empty((R, n), dtype=torch.float32, device=device)
    if n > 0:
        table, aligned = pointer_table(xs)
        depth_stats_fwd_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_T"]) * S,)](
            table, cs.float().contiguous(), m, z, u, rstd, n, R, S, eps,
            D=d, D_PAD=padded_width(d), DTYPE=TORCH_TO_TRITON[xs[0].dtype], ALIGNED=aligned,
        )
    return m, z, u, rstd


def triton_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, eps):
    """Kernel of `attnres::depth_stats_bwd` (the saved rstd carries eps)."""
    xs = flat_sources(sources)
    n, d = xs[0].shape
    S, R, device = cs.shape[0], len(xs), xs[0].device
    check_stats_rows("cs (queries)", S, QUERIES_REMEDY)
    check_stats_rows("sources", R, SOURCES_REMEDY)
    s_pad, r_pad = max(16, triton.next_power_of_2(S)), max(16, triton.next_power_of_2(R))
    # chunk width and warps chosen so that sm_90 builds hold the tiles in registers (ptxas reports no spills for pads
    # up to 32); one stage: software pipelining of these loops costs more registers than it hides latency
    block_d = max(16, min(padded_width(d), 2048 // max(s_pad, r_pad)))
    grads = [torch.empty((n, d), dtype=x.dtype, device=device) for x in xs]
    coef = torch.empty((R, S, n), dtype=torch.float32, device=device)
    cs32 = cs.float().contiguous()
    dtype = TORCH_TO_TRITON[xs[0].dtype]
    dcs_block_d = max(16, min(padded_width(d), 2048 // s_pad))
    d_blocks = triton.cdiv(d, dcs_block_d)
    # token splits of the dcs sum: about as many programs in all as a persistent grid, at least one split
    splits = max(1, num_programs(device, d_blocks * triton.cdiv(n, DCS_BLOCK_N)) // d_blocks)
    dcs_part = torch.zeros((splits, S, d), dtype=torch.float32, device=device)
    if n > 0:
        table, aligned = pointer_table(xs + grads)
        programs = num_programs(device, n)
        depth_stats_bwd_kernel[(programs,)](
            table, cs32, m.float().contiguous(), rstd.float().contiguous(), grad_z.float().contiguous(),
            grad_u.float().contiguous(), coef, n, R, S, programs,
            D=d, BLOCK_D=block_d, S_PAD=s_pad, R_PAD=r_pad, DTYPE=dtype, ALIGNED=aligned,
            num_warps=8 if max(s_pad, r_pad) >= 64 else 4, num_stages=1,
        )
        depth_stats_dcs_kernel[(d_blocks, splits)](
            table, coef, dcs_part, n, R, S,
            D=d, BLOCK_D=dcs_block_d, BLOCK_N=DCS_BLOCK_N, S_PAD=s_pad, DTYPE=dtype, ALIGNED=aligned,
            num_warps=4, num_stages=1,
        )
    return [g.reshape(x.shape) for g, x in zip(grads, sources)], dcs_part.sum(0)
