"""Triton kernels of the fused inference aggregation, for the ops `attnres.ops.bank.bank_aggregate` and `bank_merge`
(docs/design.md section 5), whose contracts and checks live there.

One program owns BLOCK_T tokens and their whole rows of d channels (padded to D_PAD, masked at the tail), as the
depth-attention forward does, and does everything a point needs in one pass:

    bank_aggregate: read output and prefix, write prefix + output (and bank row nvb at a write point), score the nvb
                    bank rows and the prefix with an online softmax, mix, apply the output norm, write the result.
                    Bytes per token: (nvb + 4) d e, one more row at a write point; nothing is read twice.
    bank_merge:     the same pending add, then the prefix's score merged with the phase-1 statistics (m, z, u).

The pending add is rounded to the prefix's dtype before it is stored and scored, exactly like `prefix.add_(output)`;
bf16 is rounded to nearest even on the bits (what a GPU's conversion does, and what the interpreter's truncating
conversion does not), so the prefix and the bank row are bit-exact with the torch path on every machine. The bank and
the prefix are written in place through their strides; offsets that scale with tokens are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres.ops.triton.depth_attention import (
    MAX_D,
    TORCH_TO_TRITON,
    contiguous_or_none,
    online_softmax_update,
    output_norm,
    padded_width,
    row_tiles,
    score_source,
    token_tile,
)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x in DTYPE, rounded to nearest even (torch's rounding); bf16 on the bits, NaN kept."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)  # exact in bf16: the cast below only drops zeros
        x = tl.where(x != x, x, rounded)
    return x.to(DTYPE)


@triton.jit
def pending_add(prefix_ptrs, output, offsets, mask, HAS_OUTPUT: tl.constexpr, DTYPE: tl.constexpr):
    """The prefix tile after `prefix += output` (stored back when there is an output), in DTYPE."""
    p = tl.load(prefix_ptrs, mask=mask, other=0.0)
    if HAS_OUTPUT:
        p = round_to(p.to(tl.float32) + tl.load(output + offsets, mask=mask, other=0.0).to(tl.float32), DTYPE)
        tl.store(prefix_ptrs, p, mask=mask)
    return p


@triton.jit
def fold(query, gain, cols, col_ok):
    """c = g * w in fp32, from the point's own vectors (any float dtype)."""
    w = tl.load(query + cols, mask=col_ok, other=0.0).to(tl.float32)
    return w * tl.load(gain + cols, mask=col_ok, other=0.0).to(tl.float32)


# autotuning runs the kernel many times: each run starts from the saved prefix, and then writes the same bank row (no
# row the kernel reads), so the prefix is the only state to restore (a bank copy would swamp the timings)
@row_tiles(key=["D", "OUT_NORM", "DTYPE"], restore_value=["prefix"])
@triton.jit
def bank_aggregate_kernel(
    bank, prefix, output, query, gain, out_weight, out, N, nvb, bank_stride_t, bank_stride_r, prefix_stride, eps,
    out_eps,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_OUTPUT: tl.constexpr, WRITE: tl.constexpr, OUT_NORM: tl.constexpr,
    DTYPE: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, cols, _, col_ok, mask, offsets = token_tile(tl.program_id(0), N, D, D_PAD, BLOCK_T)  # output, out: [N, d]
    bank_tile = bank + (rows * bank_stride_t)[:, None] + cols[None, :]  # row 0 of each token's bank

    p = pending_add(prefix + (rows * prefix_stride)[:, None] + cols[None, :], output, offsets, mask, HAS_OUTPUT, DTYPE)
    if WRITE:
        tl.store(bank_tile + nvb * bank_stride_r, p, mask=mask)

    # the prefix (the last source, bank row nvb at a write point) starts the online softmax, so its tile is dead
    # before the loop over the bank rows; the order of the sources changes nothing but fp32 rounding
    cv = fold(query, gain, cols, col_ok)
    acc = p.to(tl.float32)
    _, m = score_source(acc, cv, eps, D)
    z = tl.full([BLOCK_T], 1.0, tl.float32)
    for j in range(nvb):
        x = tl.load(bank_tile + j * bank_stride_r, mask=mask, other=0.0).to(tl.float32)
        _, s = score_source(x, cv, eps, D)
        m, z, acc = online_softmax_update(m, z, acc, s, x)

    mix = output_norm(acc / z[:, None], out_weight, cols, col_ok, out_eps, D, OUT_NORM)
    tl.store(out + offsets, round_to(mix, DTYPE), mask=mask)


@row_tiles(key=["D", "OUT_NORM", "DTYPE"], restore_value=["prefix"])
@triton.jit
def bank_merge_kernel(
    m_in, z_in, u_in, prefix, output, query, gain, out_weight, out, N, prefix_stride, eps, out_eps,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_OUTPUT: tl.constexpr, OUT_NORM: tl.constexpr, DTYPE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, cols, row_ok, col_ok, mask, offsets = token_tile(tl.program_id(0), N, D, D_PAD, BLOCK_T)  # output, u, out

    p = pending_add(prefix + (rows * prefix_stride)[:, None] + cols[None, :], output, offsets, mask, HAS_OUTPUT, DTYPE)
    x = p.to(tl.float32)
    _, s = score_source(x, fold(query, gain, cols, col_ok), eps, D)
    # merge (m, z, u) of the bank rows with (s, 1, x) of the prefix; masked tokens get m = 0, harmless
    m = tl.load(m_in + rows, mask=row_ok, other=0.0)
    top = tl.maximum(m, s)
    a, b = tl.exp(m - top), tl.exp(s - top)
    z = a * tl.load(z_in + rows, mask=row_ok, other=1.0) + b
    u = a[:, None] * tl.load(u_in + offsets, mask=mask, other=0.0) + b[:, None] * x

    mix = output_norm(u / z[:, None], out_weight, cols, col_ok, out_eps, D, OUT_NORM)
    tl.store(out + offsets, round_to(mix, DTYPE), mask=mask)


def _check_limits(prefix: torch.Tensor) -> tuple[int, int]:
    """(N, d) of a point within what the kernels take (the op's own checks have run: see `attnres.ops.bank`)."""
    if prefix.dtype not in TORCH_TO_TRITON:
        raise TypeError(f"prefix: the Triton kernels take float32, bfloat16 or float16, got {prefix.dtype}")
    d = prefix.shape[-1]
    n = prefix.numel() // d
    if d > MAX_D:
        raise ValueError(f"prefix: the Triton kernels hold rows of at most d={MAX_D} channels, got d={d}")
    return n, d


def triton_bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write):
    """Kernel of `bank_aggregate`: the whole point in one launch."""
    n, d = _check_limits(prefix)
    out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
    rows, output = prefix.view(n, d), None if output is None else output.reshape(n, d)
    if n > 0:
        bank_aggregate_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_T"]),)](
            bank, rows, contiguous_or_none(output), query.contiguous(), gain.contiguous(),
            contiguous_or_none(out_norm_weight), out,
            n, nvb, bank.stride(0), bank.stride(1), rows.stride(0), eps, out_eps,
            D=d, D_PAD=padded_width(d), HAS_OUTPUT=output is not None, WRITE=write,
            OUT_NORM=out_norm_weight is not None, DTYPE=TORCH_TO_TRITON[prefix.dtype],
        )
    return out


def triton_bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps):
    """Kernel of `bank_merge`: the whole point in one launch."""
    n, d = _check_limits(prefix)
    out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
    rows, output = prefix.view(n, d), None if output is None else output.reshape(n, d)
    if n > 0:
        stats = (s.float().contiguous() for s in (m, z, u))
        bank_merge_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_T"]),)](
            *stats, rows, contiguous_or_none(output), query.contiguous(), gain.contiguous(),
            contiguous_or_none(out_norm_weight), out, n, rows.stride(0), eps, out_eps,
            D=d, D_PAD=padded_width(d), HAS_OUTPUT=output is not None, OUT_NORM=out_norm_weight is not None,
            DTYPE=TORCH_TO_TRITON[prefix.dtype],
        )
    return out
