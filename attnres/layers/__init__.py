"""Aggregation points and residual streams; know nothing of a particular model."""

from attnres.layers.depth_attention import DepthAttention, RMSNorm
from attnres.layers.streams import (
    RESIDUAL_KINDS,
    BlockStream,
    FullStream,
    ResidualStream,
    StandardStream,
    make_stream,
)

__all__ = [
    "RESIDUAL_KINDS",
    "BlockStream",
    "DepthAttention",
    "FullStream",
    "RMSNorm",
    "ResidualStream",
    "StandardStream",
    "make_stream",
]
