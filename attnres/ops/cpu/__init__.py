"""CPU fast path of the depth-attention operator, of phase 1 of the two-phase computation and of the fused inference
ops: a compiled kernel that streams each source once (for all queries of phase 1) and reads strided sources, such as
the bank rows `bank[:, j]`, in place.

The functions are the CPU kernels of the `attnres::depth_attention_fwd/bwd` and `attnres::depth_stats_fwd/bwd` custom
ops and `attnres::merge_sources_fwd/bwd`, of an aggregation point from its parameters
(`attnres.ops.depth_attention.point_fwd_from`, and as whole ops with their own autograd: `point` and `chained_point`)
and of `attnres.ops.bank.bank_aggregate/bank_merge`, registered by op in `KERNELS` (`attnres.ops.registry`); the
contracts and the argument checks live with those ops.
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

from attnres.ops.checks import check_bank_aggregate, check_bank_merge, validated
from attnres.ops.cpu.build import build_library
from attnres.ops.registry import Backend

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


def cpu_depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps):
    """Kernel of `attnres::depth_attention_fwd`; reads the sources in place whatever their strides."""
    return _ops().depth_attention_fwd(sources, c, out_norm_weight, eps, out_eps)


def cpu_depth_attention_bwd(grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps):
    """Kernel of `attnres::depth_attention_bwd` (the saved rstd carries eps)."""
    grads, dc, d_out_w = _ops().depth_attention_bwd(
        grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps
    )
    return list(grads), dc, d_out_w


def cpu_depth_attention_bwd_into(
    grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, eps, out_eps, into, accumulate
):
    """Kernel of `depth_attention_bwd_into`: the source gradients added onto the first `accumulate` tensors of `into`
    (one per source), written into the others, in place."""
    return _ops().depth_attention_bwd_into(
        grad_out, grad_weights, sources, c, out_norm_weight, weights, rstd, out_eps, into, accumulate
    )


def cpu_point_fwd(sources, query, gain, out_norm_weight, eps, out_eps):
    """Kernel of `point_fwd`: the query folded and the forward in one call."""
    return _ops().point_fwd(sources, query, gain, out_norm_weight, eps, out_eps)


def cpu_point_bwd(grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, eps, out_eps):
    """Kernel of `point_bwd`: the backward and the parameters' gradients in one call."""
    grads, d_query, d_gain, d_out_w = _ops().point_bwd(
        grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, out_eps
    )
    return list(grads), d_query, d_gain, d_out_w


def cpu_point_bwd_into(
    grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, eps, out_eps, into, accumulate
):
    """Kernel of `point_bwd_into`: `bwd_into` and the parameters' gradients in one call."""
    return _ops().point_bwd_into(
        grad_out, grad_weights, sources, c, query, gain, out_norm_weight, weights, rstd, out_eps, into, accumulate
    )


def cpu_point(sources, query, gain, out_norm_weight, eps, out_eps):
    """Kernel of `point`: (out, weights, rstd) of `depth_attention`'s eager point, its backward a C++ autograd node."""
    return _ops().point(sources, query, gain, out_norm_weight, eps, out_eps)


def cpu_chained_point(tracked, older, carrier, query, gain, out_norm_weight, eps, out_eps, carry_newest):
    """Kernel of `chained_point`: (out, carrier) of a point of `depth_attention_chained`, its backward a C++ autograd
    node; only `tracked` are autograd inputs."""
    return _ops().chained_point(tracked, older, carrier, query, gain, out_norm_weight, eps, out_eps, carry_newest)


def cpu_depth_stats_fwd(sources, cs, eps):
    """Kernel of `attnres::depth_stats_fwd`: each source is streamed once for all queries."""
    return _ops().depth_stats_fwd(sources, cs, eps)


def cpu_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, eps):
    """Kernel of `attnres::depth_stats_bwd` (the saved rstd carries eps)."""
    grads, dcs = _ops().depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd)
    return list(grads), dcs


def cpu_depth_stats_bwd_into(grad_z, grad_u, sources, cs, m, rstd, eps, into, accumulate):
    """Kernel of `depth_stats_bwd_into`: each query's grad_u read where it lies, the source gradients written, or
    added, into `into` in place."""
    return _ops().depth_stats_bwd_into(grad_z, grad_u, sources, cs, m, rstd, into, accumulate)


def cpu_bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write):
    """Kernel of `attnres.ops.bank.bank_aggregate`, the whole point (the query's fold too) in one call."""
    return _ops().bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, bool(write))


def cpu_bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps):
    """Kernel of `attnres.ops.bank.bank_merge`, the whole point (the query's fold too) in one call."""
    return _ops().bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps)


def cpu_merge_sources(m, z, u, sources, query, gain, out_norm_weight, eps, out_eps, dtype):
    """Kernel of `merge_sources`: a point of a Full group's phase 2, the query folded, its backward a C++ autograd
    node."""
    return _ops().merge_sources(m, z, u, sources, query, gain, out_norm_weight, eps, out_eps, dtype)


def cpu_merge_sources_fwd(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype):
    """Kernel of `attnres::merge_sources_fwd`: one pass per token over u and the sources."""
    return _ops().merge_sources_fwd(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype)


def cpu_merge_sources_bwd(grad_out, m, z, u, sources, c, out_norm_weight, eps, out_eps):
    """Kernel of `attnres::merge_sources_bwd`: h recomputed per token, every gradient from the same pass."""
    du, dz, grads, dc, d_out_w = _ops().merge_sources_bwd(grad_out, m, z, u, sources, c, out_norm_weight, eps, out_eps)
    return du, dz, list(grads), dc, d_out_w


# Phase 2's backward (merge_prefix_bwd) has no CPU kernel, so two-phase training is not taken here: its torch ops cost
# more than the reads it saves. Inference runs the fused bank_merge and pays where two_phase_pays says (0.61-0.72x
# fp32, level bf16).
KERNELS = Backend("cpu", {
    "depth_attention_fwd": cpu_depth_attention_fwd,
    "depth_attention_bwd": cpu_depth_attention_bwd,
    "depth_attention_bwd_into": cpu_depth_attention_bwd_into,
    "point_fwd": cpu_point_fwd,
    "point_bwd": cpu_point_bwd,
    "point_bwd_into": cpu_point_bwd_into,
    "point": cpu_point,
    "chained_point": cpu_chained_point,
    "depth_stats_fwd": cpu_depth_stats_fwd,
    "depth_stats_bwd": cpu_depth_stats_bwd,
    "depth_stats_bwd_into": cpu_depth_stats_bwd_into,
    "merge_sources": cpu_merge_sources,
    "merge_sources_fwd": cpu_merge_sources_fwd,
    "merge_sources_bwd": cpu_merge_sources_bwd,
    "bank_aggregate": validated(check_bank_aggregate, cpu_bank_aggregate),
    "bank_merge": validated(check_bank_merge, cpu_bank_merge),
})
