"""The depth-attention operator and its two-phase form; knows nothing of models."""

from attnres.ops.depth_attention import depth_attention
from attnres.ops.merge import merge_prefix, merge_sources
from attnres.ops.naive import naive_depth_attention, naive_depth_stats
from attnres.ops.two_phase import SoftmaxStats, depth_stats, finish_stats, merge_stats

__all__ = [
    "SoftmaxStats",
    "depth_attention",
    "depth_stats",
    "finish_stats",
    "merge_prefix",
    "merge_sources",
    "merge_stats",
    "naive_depth_attention",
    "naive_depth_stats",
]
