"""Triton kernels of the depth-attention operator (`attnres::depth_attention_fwd/bwd`).

Layout: a program owns BLOCK_T tokens and their whole row of d channels, padded to the power of two D_PAD and masked
at the tail, so any d works and every reduction (sum of squares, score, output norm) stays in registers in fp32. The
R sources are never stacked: the kernels read them through a table of (data pointer, row stride) pairs (an int64
tensor), the way fla's `fused_attnres` takes a tuple of tensors, without a compile per R. Through the row stride a
source is read in place whatever its token stride, such as a bank row `bank[:, j]` of an `[N, NB, d]` bank (as the
CPU kernel does): only a source without unit stride along d is copied.

Forward: one streaming pass over the sources with an online softmax (running max m, sum z and an fp32 accumulator), so
each source is read exactly once; the aggregation is memory-bound and that read is its floor.

Backward: two passes per token block, the first recomputes the mixture (needed for the output norm's backward and for
delta = dm . m), the second writes each source's gradient. dc and d_out_w are summed per program into `[programs, d]`
buffers and reduced with torch afterwards: no atomics, so the result is deterministic and the interpreter can run it.

Offsets that scale with tokens * d are 64-bit.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

# Triton reads the same variable when it is imported; under the interpreter the kernels run on CPU tensors.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")

# Largest d the register-resident rows are built for (the backward keeps about five fp32 rows of D_PAD live).
MAX_D = 65536

TORCH_TO_TRITON = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Set to 1, the kernels skip autotuning and run the first candidate (a test run that compiles dozens of kernel
# variants cannot afford to time every config of each); read when the kernels are defined.
SINGLE_CONFIG_ENV = "ATTNRES_TRITON_SINGLE_CONFIG"


def tile_configs(tiles: tuple[int, ...], warps: tuple[int, ...]) -> list[triton.Config]:
    """Autotuning candidates (TILE = tokens x padded channels per program); one small config under the interpreter,
    which can neither autotune several configs nor afford large tiles; only the first with SINGLE_CONFIG_ENV=1."""
    if INTERPRETING:
        return [triton.Config({"TILE": 256}, num_warps=4)]
    configs = [triton.Config({"TILE": t}, num_warps=w) for t in tiles for w in warps]
    return configs[:1] if os.environ.get(SINGLE_CONFIG_ENV) == "1" else configs


def block_tokens(args: dict) -> int:
    """BLOCK_T: as many tokens as fill TILE, never more than the (padded) token count."""
    return max(1, min(args["TILE"] // args["D_PAD"], triton.next_power_of_2(args["N"])))


def distinct_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs that give the same BLOCK_T and warps for this d (large d makes every TILE one token).

    Triton's autotuner passes the positional arguments as `named_args` and the keyword ones (D_PAD and the other
    constexprs) as `kwargs`."""
    seen, kept = set(), []
    for cfg in configs:
        key = (block_tokens({**named_args, **kwargs, **cfg.kwargs}), cfg.num_warps)
        if key not in seen:
            seen.add(key)
            kept.append(cfg)
    return kept


def tiles_within(row_elements: int):
    """An autotuner prune for a kernel that keeps several rows of a tile live: `distinct_tiles`, then only the configs
    whose threads each hold at most `row_elements` elements of a row (past that ptxas spills the rows: kilobytes per
    thread at d = 7168 with 4 warps); where none fits, those holding the fewest."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        kept = distinct_tiles(configs, named_args, **kwargs)
        per_thread = {id(cfg): block_tokens({**named_args, **kwargs, **cfg.kwargs}) * kwargs["D_PAD"]
                      // (32 * cfg.num_warps) for cfg in kept}
        fewest = min(per_thread.values())
        return [cfg for cfg in kept if per_thread[id(cfg)] <= max(row_elements, fewest)]

    return prune


def row_tiles(key: list[str], tiles: tuple[int, ...] = (1024, 4096, 8192), prune=distinct_tiles, **autotune_options):
    """The launch setup of a kernel whose programs own whole token rows: autotuned over `tile_configs(tiles)` with 4, 8
    or 16 warps, pruned by `prune`, keyed on the constexprs `key`, and BLOCK_T derived from the chosen TILE."""

    def setup(kernel):
        tuned = triton.autotune(configs=tile_configs(tiles, (4, 8, 16)), key=key,
                                prune_configs_by={"early_config_prune": prune}, **autotune_options)
        return tuned(triton.heuristics({"BLOCK_T": block_tokens})(kernel))

    return setup


def padded_width(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def num_programs(device: torch.device, work_items: int) -> int:
    """Programs of a persistent grid: a few per SM on a GPU, three under the interpreter (enough to test the loop)."""
    cap = 3 if INTERPRETING else 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work_items, cap))


def flat_sources(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each source as `[N, d]` rows with unit stride along d, read in place through their row stride (see
    `pointer_table`): a view where the strides allow one (leading dims that flatten into one token stride, as for a
    bank row or an expanded gradient), a copy otherwise (the interpreter would read other strides as garbage without
    a word)."""
    x0 = sources[0]
    if x0.dtype not in TORCH_TO_TRITON:
        raise TypeError(f"sources: the Triton kernels take float32, bfloat16 or float16, got {x0.dtype}")
    d = x0.shape[-1]
    if d > MAX_D:
        raise ValueError(f"sources: the Triton kernels hold rows of at most d={MAX_D} channels, got d={d}")
    return [as_rows(x, d) for x in sources]


def as_rows(x: torch.Tensor, d: int) -> torch.Tensor:
    rows = x.reshape(-1, d)  # a view where the strides allow one
    return rows if rows.stride(1) == 1 or d == 1 else rows.contiguous()


def contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


class TableCache:
    """Device pointer tables by content (device, pairs). A call whose tensors sit where an earlier call's did (each step
    of a decode loop, the capture of a CUDA graph after its warm-up) gets that table back and copies nothing. An entry
    used while a CUDA graph is captured is kept for good: the graph reads it (and the pinned buffer its copy came from)
    at every replay. Others go least recently used first."""

    def __init__(self, size: int):
        self.size, self.recent, self.kept = size, OrderedDict(), {}

    def get(self, key, make, capturing: bool):
        if key in self.kept:
            return self.kept[key]
        entry = self.recent.pop(key, None)
        if entry is None:
            entry = make()
        if capturing:
            self.kept[key] = entry
        else:
            self.recent[key] = entry
            if len(self.recent) > self.size:
                self.recent.popitem(last=False)
        return entry


TABLES = TableCache(1024)


def upload(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pinned host table, its device copy): a non-blocking copy from pinned memory (a pageable one would synchronise
    the stream and stall the host on every call)."""
    host = torch.tensor(pairs, dtype=torch.int64).reshape(-1).pin_memory()
    return host, host.to(device, non_blocking=True)


def pointer_table(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(int64 tensor `[2 K]` of the K `[N, d]` tensors' (data pointer, row stride in elements) pairs on their device,
    whether every pointer is 16-byte aligned and every row stride a multiple of 8 elements: then each row starts on a
    16-byte boundary and the kernels may issue 16-byte loads). On a GPU the table comes from TABLES."""
    pairs = [(t.data_ptr(), t.stride(0)) for t in tensors]
    aligned = all(ptr % 16 == 0 and stride % 8 == 0 for ptr, stride in pairs)
    device = tensors[0].device
    if device.type == "cpu":
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1), aligned
    capturing = torch.cuda.is_current_stream_capturing()
    return TABLES.get((device, tuple(pairs)), lambda: upload(pairs, device), capturing)[1], aligned


@triton.jit
def row_pointers(table, j, rows, cols, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers `[BLOCK_T, D_PAD]` to channels `cols` of tokens `rows` (int64) of the table's tensor j."""
    base = tl.load(table + 2 * j).to(tl.pointer_type(DTYPE))
    stride = tl.load(table + 2 * j + 1)
    if ALIGNED:  # lets the compiler emit 16-byte loads
        base = tl.multiple_of(base, 16)
        stride = tl.multiple_of(stride, 8)
    return base + (rows * stride)[:, None] + cols[None, :]


@triton.jit
def load_source(table, j, rows, cols, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tile (tokens `rows`, channels `cols`) of the table's source j, in fp32."""
    return tl.load(row_pointers(table, j, rows, cols, DTYPE, ALIGNED), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def output_norm(mix, out_weight, cols, col_ok, out_eps, D: tl.constexpr, OUT_NORM: tl.constexpr):
    """o * RMSNorm(mix) over each token's row, or mix itself (fp32 `[BLOCK_T, D_PAD]`)."""
    if OUT_NORM:
        rstd = tl.rsqrt(tl.sum(mix * mix, 1) / D + out_eps)
        o = tl.load(out_weight + cols, mask=col_ok, other=0.0).to(tl.float32)
        mix = mix * rstd[:, None] * o[None, :]
    return mix


@triton.jit
def token_tile(block, N, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Token block `block`: its tokens `rows` (int64: offsets that scale with tokens * d pass 2^31) and channels `cols`,
    which of each are in range, the tile's mask, and the tile's offsets in a contiguous `[N, d]` tensor."""
    rows = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    row_ok = rows < N
    col_ok = cols < D
    return rows, cols, row_ok, col_ok, row_ok[:, None] & col_ok[None, :], rows[:, None] * D + cols[None, :]


@triton.jit
def output_norm_backward(grad, mix, d_weight, out_weight, cols, col_ok, out_eps, D: tl.constexpr):
    """The backward of `output_norm` over a tile (fp32 `[BLOCK_T, D_PAD]`): (the gradient reaching mix, the gain's
    gradient `[D_PAD]` with the tile's share added), from the gradient of o * RMSNorm(mix)."""
    rstd = tl.rsqrt(tl.sum(mix * mix, 1) / D + out_eps)
    normed = mix * rstd[:, None]
    d_weight += tl.sum(grad * normed, 0)
    # the gain is loaded where used (a cache hit): held across a kernel's token loop it would spill at large d
    grad = grad * tl.load(out_weight + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return (grad - normed * (tl.sum(grad * normed, 1) / D)[:, None]) * rstd[:, None], d_weight


@triton.jit
def score_source(x, cv, eps, D: tl.constexpr):
    """(key rstd, score) `[BLOCK_T]` of a source tile x `[BLOCK_T, D_PAD]` (fp32) against the folded query cv."""
    r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    return r, tl.sum(x * cv[None, :], 1) * r


@triton.jit
def online_softmax_start(BLOCK_T: tl.constexpr, D_PAD: tl.constexpr):
    """(m, z, acc) over no source yet, where `online_softmax_update` starts."""
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    return m, tl.zeros([BLOCK_T], tl.float32), tl.zeros([BLOCK_T, D_PAD], tl.float32)


@triton.jit
def online_softmax_update(m, z, acc, s, x):
    """(m, z, acc) after one more source x `[BLOCK_T, D_PAD]` with scores s `[BLOCK_T]`: the running max m,
    z = sum_j exp(s_j - m) and acc = sum_j exp(s_j - m) x_j, rescaled whenever the max grows."""
    m_new = tl.maximum(m, s)
    rescale = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    return m_new, z * rescale + p, acc * rescale[:, None] + p[:, None] * x


@row_tiles(key=["D", "OUT_NORM", "DTYPE"])
@triton.jit
def depth_attention_fwd_kernel(
    table, c, out_weight, out, weights, rstd, N, R, eps, out_eps,
    D: tl.constexpr, D_PAD: tl.constexpr, OUT_NORM: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, cols, row_ok, col_ok, mask, offsets = token_tile(tl.program_id(0), N, D, D_PAD, BLOCK_T)
    cv = tl.load(c + cols, mask=col_ok, other=0.0).to(tl.float32)

    n64 = tl.cast(N, tl.int64)  # N == 1 arrives as a constant (no .to)
    m, z, acc = online_softmax_start(BLOCK_T, D_PAD)
    for j in range(R):
        x = load_source(table, j, rows, cols, mask, DTYPE, ALIGNED)
        r, s = score_source(x, cv, eps, D)
        tl.store(rstd + j * n64 + rows, r, mask=row_ok)
        tl.store(weights + j * n64 + rows, s, mask=row_ok)  # parked until m and z are final
        m, z, acc = online_softmax_update(m, z, acc, s, x)

    tl.debug_barrier()  # make this program's own score stores visible to all of its threads
    inv_z = 1.0 / z
    for j in range(R):
        s = tl.load(weights + j * n64 + rows, mask=row_ok, other=0.0)
        tl.store(weights + j * n64 + rows, tl.exp(s - m) * inv_z, mask=row_ok)

    mix = output_norm(acc * inv_z[:, None], out_weight, cols, col_ok, out_eps, D, OUT_NORM)
    tl.store(out + offsets, mix.to(DTYPE), mask=mask)


# tiles_within(32): about five rows live (dm, mix, normed, x, dx)
@row_tiles(key=["D", "OUT_NORM", "HAS_GRAD_WEIGHTS", "DTYPE", "ACCUMULATE"], tiles=(1024, 4096), prune=tiles_within(32))
@triton.jit
def depth_attention_bwd_kernel(
    table, c, out_weight, grad_out, grad_weights, weights, rstd, dc_part, dow_part, N, R, programs, out_eps, n_acc,
    D: tl.constexpr, D_PAD: tl.constexpr, OUT_NORM: tl.constexpr, HAS_GRAD_WEIGHTS: tl.constexpr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr, ACCUMULATE: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Persistent: program p takes token blocks p, p + programs, ...; the table holds R sources, then R grads (the
    first n_acc of which the gradients are added onto, with ACCUMULATE; the others written)."""
    pid = tl.program_id(0)
    n64 = tl.cast(N, tl.int64)  # N == 1 arrives as a constant (no .to)
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    dc = tl.zeros([D_PAD], tl.float32)
    dow = tl.zeros([D_PAD], tl.float32)

    for blk in range(pid, tl.cdiv(N, BLOCK_T), programs):
        rows, _, row_ok, _, mask, offsets = token_tile(blk, N, D, D_PAD, BLOCK_T)
        dm = tl.load(grad_out + offsets, mask=mask, other=0.0).to(tl.float32)

        # pass 1: the mixture m = sum_j alpha_j x_j (and sum_j alpha_j gw_j, the weights' own share of delta)
        mix = tl.zeros([BLOCK_T, D_PAD], tl.float32)
        delta = tl.zeros([BLOCK_T], tl.float32)
        for j in range(R):
            a = tl.load(weights + j * n64 + rows, mask=row_ok, other=0.0)
            mix += a[:, None] * load_source(table, j, rows, cols, mask, DTYPE, ALIGNED)
            if HAS_GRAD_WEIGHTS:
                delta += a * tl.load(grad_weights + j * n64 + rows, mask=row_ok, other=0.0)
        if OUT_NORM:  # the fused PreNorm's backward turns grad_out into the gradient reaching m
            dm, dow = output_norm_backward(dm, mix, dow, out_weight, cols, col_ok, out_eps, D)
        delta += tl.sum(dm * mix, 1)
        cv = tl.load(c + cols, mask=col_ok, other=0.0).to(tl.float32)  # here, as the gain: held across the loop, spills

        # pass 2: ds_j = alpha_j (dm . x_j + gw_j - delta); dx_j = alpha_j dm + ds_j r_j (c - s_j r_j x_j / d)
        for j in range(R):
            a = tl.load(weights + j * n64 + rows, mask=row_ok, other=0.0)
            r = tl.load(rstd + j * n64 + rows, mask=row_ok, other=0.0)
            x = load_source(table, j, rows, cols, mask, DTYPE, ALIGNED)
            g = tl.sum(x * dm, 1)
            if HAS_GRAD_WEIGHTS:
                g += tl.load(grad_weights + j * n64 + rows, mask=row_ok, other=0.0)
            coef = a * (g - delta) * r
            s = tl.sum(x * cv[None, :], 1) * r
            dx = a[:, None] * dm + coef[:, None] * cv[None, :] - (coef * s * r / D)[:, None] * x
            dst = row_pointers(table, R + j, rows, cols, DTYPE, ALIGNED)
            if ACCUMULATE:
                if j < n_acc:
                    dx += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst, dx.to(DTYPE), mask=mask)
            dc += tl.sum(coef[:, None] * x, 0)

    tl.store(dc_part + pid * D + cols, dc, mask=col_ok)
    if OUT_NORM:
        tl.store(dow_part + pid * D + cols, dow, mask=col_ok)


def triton_depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps):
    """Kernel of `attnres::depth_attention_fwd`: one streaming pass over the sources."""
    shape = sources[0].shape
    xs = flat_sources(sources)
    n, d = xs[0].shape
    lead = (len(xs), *shape[:-1])
    out = torch.empty((n, d), dtype=xs[0].dtype, device=xs[0].device)
    weights = torch.empty((len(xs), n), dtype=torch.float32, device=xs[0].device)
    rstd = torch.empty_like(weights)
    if n > 0:
        table, aligned = pointer_table(xs)
        depth_attention_fwd_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_T"]),)](
            table, c.float().contiguous(), contiguous_or_none(out_norm_weight), out, weights, rstd, n, len(xs), eps,
            out_eps,
            D=d, D_PAD=padded_width(d), OUT_NORM=out_norm_weight is not None,
            DTYPE=TORCH_TO_TRITON[xs[0].dtype], ALIGNED=aligned,
        )
    return out.reshape(shape), weights.reshape(lead), rstd.reshape(lead)


def triton_depth_attention_bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps):
    """Kernel of `attnres::depth_attention_bwd` (the saved rstd carries eps)."""
    xs = flat_sources(sources)
    n, d = xs[0].shape
    grads = [torch.empty((n, d), dtype=x.dtype, device=x.device) for x in xs]
    dc, dow = _backward(grad_out, grad_weights, xs, c, out_norm_weight, weights, rstd, out_eps, grads, 0)
    return [g.reshape(x.shape) for g, x in zip(grads, sources)], dc, dow


def triton_depth_attention_bwd_into(
    grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps, into, accumulate
):
    """Kernel of `depth_attention_bwd_into`: the source gradients added onto the first `accumulate` tensors of `into`
    (one per source), written into the others, in place."""
    xs = flat_sources(sources)
    grads = [g.view(x.shape) for g, x in zip(into, xs)]
    return _backward(grad_out, grad_weights, xs, c, out_norm_weight, weights, rstd, out_eps, grads, accumulate)


def _backward(grad_out, grad_weights, xs, c, out_norm_weight, weights, rstd, out_eps, grads, accumulate):
    n, d = xs[0].shape
    R, device = len(xs), xs[0].device
    programs = num_programs(device, n)
    dc_part = torch.zeros((programs, d), dtype=torch.float32, device=device)
    dow_part = torch.zeros((programs, d), dtype=torch.float32, device=device)
    if n > 0:
        table, aligned = pointer_table(xs + grads)
        gw = None if grad_weights is None else grad_weights.reshape(R, n).float().contiguous()
        depth_attention_bwd_kernel[(programs,)](
            table, c.float().contiguous(), contiguous_or_none(out_norm_weight), grad_out.reshape(n, d).contiguous(), gw,
            weights.reshape(R, n).contiguous(), rstd.reshape(R, n).contiguous(), dc_part, dow_part,
            n, R, programs, out_eps, accumulate,
            D=d, D_PAD=padded_width(d), OUT_NORM=out_norm_weight is not None, HAS_GRAD_WEIGHTS=gw is not None,
            DTYPE=TORCH_TO_TRITON[xs[0].dtype], ALIGNED=aligned, ACCUMULATE=accumulate > 0,
        )
    return dc_part.sum(0), dow_part.sum(0)
