"""Aggregation points and the residual path (residual objects, their inference backends, streams); know nothing of a
particular model."""

from attnres.layers.depth_attention import DepthAttention, KeyNorm, NamedPoint, PseudoQuery, RMSNorm
from attnres.layers.factory import make_residual
from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE, FULL, RESIDUAL_KINDS, STANDARD
from attnres.layers.residuals import (
    BlockResidual,
    FullResidual,
    PreNorm,
    Recorder,
    Residual,
    ResidualState,
    StandardResidual,
)
from attnres.layers.streams import ResidualStream, make_stream, resume_stream

__all__ = [
    "BLOCK",
    "DEFAULT_BLOCK_SIZE",
    "FULL",
    "RESIDUAL_KINDS",
    "STANDARD",
    "BlockResidual",
    "DepthAttention",
    "FullResidual",
    "KeyNorm",
    "NamedPoint",
    "PreNorm",
    "PseudoQuery",
    "RMSNorm",
    "Recorder",
    "Residual",
    "ResidualState",
    "ResidualStream",
    "StandardResidual",
    "make_residual",
    "make_stream",
    "resume_stream",
]
