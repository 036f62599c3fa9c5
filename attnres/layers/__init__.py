"""Aggregation points and residual streams; know nothing of a particular model."""

from attnres.layers.depth_attention import DepthAttention, KeyNorm, NamedPoint, PseudoQuery, RMSNorm
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
    "KeyNorm",
    "NamedPoint",
    "PseudoQuery",
    "FullStream",
    "RMSNorm",
    "ResidualStream",
    "StandardStream",
    "make_stream",
]
