"""Aggregation points and residual streams; know nothing of a particular model."""

from attnres.layers.depth_attention import DepthAttention, KeyNorm, NamedPoint, PseudoQuery, RMSNorm
from attnres.layers.factory import make_stream, resume_stream
from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE, FULL, RESIDUAL_KINDS, STANDARD
from attnres.layers.streams import BlockStream, FullStream, ResidualStream, StandardStream

__all__ = [
    "BLOCK",
    "DEFAULT_BLOCK_SIZE",
    "FULL",
    "RESIDUAL_KINDS",
    "STANDARD",
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
    "resume_stream",
]
