"""CPU fast path of the depth-attention operator, of phase 1 of the two-phase computation and of the fused inference
ops: a compiled kernel that streams each source once (for all queries of phase 1) and reads strided sources, such as
the bank rows `bank[:, j]`, in place.

The functions have exactly the contracts of the `attnres::depth_attention_fwd/bwd` and `attnres::depth_stats_fwd/bwd`
custom ops and of `attnres.ops.bank.bank_aggregate/bank_merge`, so the dispatch can route CPU tensors here.
`available()` says whether the kernel could be built and loaded (it compiles on first call, see `build.py`; the
reason for a failure is logged once) and is False when `ATTNRES_DISABLE_CPU_KERNEL=1`.

Environment: ATTNRES_DISABLE_CPU_KERNEL=1 (use the torch path), ATTNRES_CACHE_DIR (where the compiled library is
kept, default ~/.cache/attnres), CXX (the compiler, default c++).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from attnres.ops.checks import check_bank, check_bank_point, check_stats
from attnres.ops.cpu.build import build_library

DISABLE_ENV = "ATTNRES_DISABLE_CPU_KERNEL"

log = logging.getLogger(__name__)


@functools.cache
def _load() -> bool:
    try:
        torch.ops.load_library(str(build_library()))
    except (OSError, RuntimeError) as e:
        log.warning("attnres CPU kernel unavailable, using the torch path: %s", e)
        return False
    return True


def disabled() -> bool:
    """True when the environment switches the kernel off (ATTNRES_DISABLE_CPU_KERNEL set to anything but 0)."""
    return os.environ.get(DISABLE_ENV, "0") not in ("", "0")


def available() -> bool:
    """True when the compiled kernel is loaded (building it on first call) and not disabled by the environment."""
    return not disabled() and _load()


def _ops():
    if not _load():
        raise RuntimeError("attnres CPU kernel: the compiled library is not available (see the logged reason)")
    return torch.ops.attnres_cpu


def cpu_depth_attention_fwd(
    sources: list[torch.Tensor],
    c: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    eps: float,
    out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of `attnres::depth_attention_fwd` on CPU.

    Args: R sources `[..., d]` (fp32, bf16, fp16 or fp64, any strides), the folded query c `[d]`, the optional
    output-norm gain `[d]`, the key and output-norm epsilons.
    Returns: (mixture `[..., d]` in the sources' dtype, weights `[R, ...]`, key rstd `[R, ...]`), the two rows in
    the accumulator dtype (fp32; fp64 for fp64 sources).
    """
    return _ops().depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps)


def cpu_depth_attention_bwd(
    grad_out: torch.Tensor,
    grad_weights: torch.Tensor | None,
    sources: list[torch.Tensor],
    c: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    weights: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    out_eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of `attnres::depth_attention_fwd` on CPU, the contract of `attnres::depth_attention_bwd`.

    Args: grad_out `[..., d]`, the optional gradient of the weights `[R, ...]`, the forward's inputs, and its saved
    weights and key rstd `[R, ...]` (`eps` is not needed again: the rstd carries it).
    Returns: (gradient of each source `[..., d]` in its dtype, gradient of c `[d]`, gradient of the output-norm
    gain `[d]`, zeros when there is none), the last two in the accumulator dtype.
    """
    grads, dc, d_out_w = _ops().depth_attention_bwd(
        grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps
    )
    return list(grads), dc, d_out_w


def cpu_depth_stats_fwd(
    sources: list[torch.Tensor], cs: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1 of the two-phase computation on CPU, the contract of `attnres::depth_stats_fwd`.

    Args: R sources `[..., d]` (fp32, bf16, fp16 or fp64, any strides), the folded queries cs `[S, d]`, the key eps.
    Returns: (m `[S, N]`, z `[S, N]`, u `[S, N, d]`, key rstd `[R, N]`) over the N flattened tokens, in the
    accumulator dtype (fp32; fp64 for fp64 sources).
    """
    return _ops().depth_stats_fwd(sources, cs, eps)


def cpu_depth_stats_bwd(
    grad_z: torch.Tensor,
    grad_u: torch.Tensor,
    sources: list[torch.Tensor],
    cs: torch.Tensor,
    m: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Backward of phase 1 on CPU with the shift m held fixed, the contract of `attnres::depth_stats_bwd`.

    Args: grad_z `[S, N]`, grad_u `[S, N, d]`, the forward's sources and cs, its m `[S, N]` and key rstd `[R, N]`
    (`eps` is not needed again: the rstd carries it).
    Returns: (gradient of each source in its shape and dtype, gradient of cs `[S, d]` in the accumulator dtype).
    """
    grads, dcs = _ops().depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd)
    return list(grads), dcs


def cpu_bank_aggregate(
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
    """Contract of `attnres.ops.bank.bank_aggregate` in one call: bank `[N, NB, d]` and prefix `[N, d]` (any token
    strides, unit stride along d; fp32, bf16, fp16 or fp64), output `[N, d]` or None, c `[d]`, the optional
    output-norm gain `[d]`; mutates prefix (and bank row nvb when `write`) and returns the (normed) mixture `[N, d]`
    in the prefix's dtype, bit for bit the one-shot forward's over the same rows."""
    check_bank_point(prefix, output, c, out_norm_weight, eps, out_eps)
    check_bank(bank, nvb, prefix, write)
    return _ops().bank_aggregate(bank, nvb, prefix, output, c, out_norm_weight, eps, out_eps, bool(write))


def cpu_bank_merge(
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
    """Contract of `attnres.ops.bank.bank_merge` in one call: the bank's phase-1 statistics m, z `[N]` and u `[N, d]`,
    prefix `[N, d]` (unit stride along d), output `[N, d]` or None, c `[d]`, the optional output-norm gain `[d]`;
    mutates prefix and returns the (normed) mixture `[N, d]` in the prefix's dtype."""
    check_bank_point(prefix, output, c, out_norm_weight, eps, out_eps)
    check_stats(m, z, u, prefix)
    return _ops().bank_merge(m, z, u, prefix, output, c, out_norm_weight, eps, out_eps)
