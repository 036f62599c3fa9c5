"""Triton kernels of the depth-attention ops for CUDA tensors (and for CPU tensors under `TRITON_INTERPRET=1`).

Each launcher is a kernel of an op whose contract (arguments, results, checks) is written on the op, so a dispatcher
can route CUDA tensors here: `triton_depth_attention_fwd/bwd` for `attnres::depth_attention_fwd/bwd` (and
`triton_depth_attention_bwd_into` for `depth_attention_bwd_into`, the backward of a chain of points),
`triton_depth_stats_fwd/bwd` for `attnres::depth_stats_fwd/bwd`, `triton_merge_prefix_fwd/bwd` for
`attnres::merge_prefix_fwd/bwd` (phase 2), and `triton_bank_aggregate/merge` for the fused inference ops
`attnres.ops.bank.bank_aggregate/merge`. They take float32, bfloat16 and float16 sources with
d <= MAX_D, and at most MAX_STATS_ROWS queries or sources in the phase-1 kernels; anything else (fp64 for gradcheck,
say) belongs to the torch path. `KERNELS` registers them by op (`attnres.ops.registry`), with the point kernels
composed from the one-shot ones.
"""

from attnres.ops.checks import check_bank_aggregate, check_bank_merge, validated
from attnres.ops.depth_attention import point_kernels_from
from attnres.ops.registry import Backend
from attnres.ops.triton.bank import triton_bank_aggregate, triton_bank_merge
from attnres.ops.triton.depth_attention import (
    MAX_D,
    triton_depth_attention_bwd,
    triton_depth_attention_bwd_into,
    triton_depth_attention_fwd,
)
from attnres.ops.triton.merge import triton_merge_prefix_bwd, triton_merge_prefix_fwd
from attnres.ops.triton.two_phase import MAX_STATS_ROWS, triton_depth_stats_bwd, triton_depth_stats_fwd


def available() -> bool:
    """Triton imported: its kernels serve CUDA tensors."""
    return True


KERNELS = Backend("triton", {
    "depth_attention_fwd": triton_depth_attention_fwd,
    "depth_attention_bwd": triton_depth_attention_bwd,
    "depth_attention_bwd_into": triton_depth_attention_bwd_into,
    **point_kernels_from(triton_depth_attention_fwd, triton_depth_attention_bwd, triton_depth_attention_bwd_into),
    "depth_stats_fwd": triton_depth_stats_fwd,
    "depth_stats_bwd": triton_depth_stats_bwd,
    "merge_prefix_fwd": triton_merge_prefix_fwd,
    "merge_prefix_bwd": triton_merge_prefix_bwd,
    "bank_aggregate": validated(check_bank_aggregate, triton_bank_aggregate),
    "bank_merge": validated(check_bank_merge, triton_bank_merge),
}, max_d=MAX_D, max_rows=MAX_STATS_ROWS)

__all__ = [
    "KERNELS",
    "MAX_D",
    "MAX_STATS_ROWS",
    "triton_bank_aggregate",
    "triton_bank_merge",
    "triton_depth_attention_bwd",
    "triton_depth_attention_bwd_into",
    "triton_depth_attention_fwd",
    "triton_depth_stats_bwd",
    "triton_depth_stats_fwd",
    "triton_merge_prefix_bwd",
    "triton_merge_prefix_fwd",
    "available",
]
