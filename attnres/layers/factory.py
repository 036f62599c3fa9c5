"""`make_stream` and `resume_stream`: the stream class of a residual kind, built for one forward or one layer.

Above the stream classes (`attnres.layers.streams`) and the inference bank (`attnres.layers.bank_stream`), which
know nothing of each other's choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attnres.layers.bank_stream import BankStream
from attnres.layers.depth_attention import DepthAttention
from attnres.layers.full_inference_stream import FullInferenceStream
from attnres.layers.kinds import BLOCK, RESIDUAL_KINDS, STANDARD
from attnres.layers.streams import BlockStream, FullStream, ResidualState, ResidualStream, StandardStream


def make_stream(
    residual: str,
    embedding: torch.Tensor | None,
    num_layers: int,
    points: Sequence[DepthAttention] | None = None,
    *,
    block_size: int | None = None,
    rescale_mixture: bool = False,
    two_phase: bool | None = None,
    record_weights: bool = False,
    inference: bool = False,
    chain: bool = False,
) -> ResidualStream:
    """The residual stream of kind `residual` ("standard", "full" or "block") for one forward.

    `points`: the 2L + 1 aggregation points in schedule order (not needed for "standard"); `block_size` counts
    decoder layers (Kimi K3 `attn_res_block_size`); `record_weights` keeps, for every read, the depth weights
    in `stream.weights` (none for "standard") and the pre-norm mixture the sublayer's norm sees in `stream.mixtures`;
    `inference` selects the streams without autograd: for "block" the fused bank path (`attnres.layers.bank_stream`),
    for "full" direct kernel calls (`attnres.layers.full_inference_stream`); `chain` makes
    the points of "full" a chain for the backward (`attnres.ops.chain`: the same gradients, summed in place; for eager
    training). A stream made without an embedding waits for `resume` (`resume_stream`).
    """
    cls = _stream_class(residual, block_size, inference and not record_weights)
    stream = _build(cls, embedding, num_layers, points, block_size, rescale_mixture, two_phase, chain)
    stream.record = record_weights
    return stream


def resume_stream(
    residual: str,
    state: ResidualState,
    layer: int,
    num_layers: int,
    points: Mapping[int, DepthAttention] | None = None,
    **options,
) -> ResidualStream:
    """The stream of decoder `layer` alone (`num_layers`: the final read), continuing from the `state` that layers
    0 .. layer-1 left. `points` maps the point indices it reads (2 layer and 2 layer + 1, or 2L) to their points: a
    layer needs only its own parameters. Its `state()` after the layer's two writes is the next layer's input.
    `options`: the keyword arguments of `make_stream`; `inference` must be the same for every layer of one forward."""
    stream = make_stream(residual, None, num_layers, points, **options)
    stream.resume(layer, state, end_point=min(2 * layer + 2, 2 * num_layers + 1))
    return stream


def _stream_class(residual: str, block_size: int | None, inference: bool) -> type[ResidualStream]:
    if residual == BLOCK:
        if block_size is None:
            raise ValueError("block_size: the block residual needs a block size (in decoder layers)")
        return BankStream if inference else BlockStream
    if residual not in RESIDUAL_KINDS:
        raise ValueError(f"residual: expected one of {RESIDUAL_KINDS}, got {residual!r}")
    if residual == STANDARD:
        return StandardStream
    return FullInferenceStream if inference else FullStream


def _build(cls, embedding, num_layers, points, block_size, rescale_mixture, two_phase, chain) -> ResidualStream:
    if cls is StandardStream:
        return StandardStream(embedding, num_layers)
    if cls is FullStream:
        return FullStream(embedding, num_layers, points, rescale_mixture, chain)
    if cls is FullInferenceStream:
        return FullInferenceStream(embedding, num_layers, points, rescale_mixture)
    return cls(embedding, num_layers, points, block_size, rescale_mixture, two_phase)
