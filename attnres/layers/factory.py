"""`make_residual`: the residual object of a kind, with the backend of its reads and writes chosen explicitly.

Above the residual classes (`attnres.layers.residuals`) and the inference backends (`attnres.layers.bank`,
`attnres.layers.full_inference`), which know nothing of each other's choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attnres.layers.bank import BlockBank
from attnres.layers.depth_attention import DepthAttention
from attnres.layers.full_inference import FullInference
from attnres.layers.kinds import FULL, RESIDUAL_KINDS, STANDARD
from attnres.layers.residuals import BlockResidual, FullResidual, Recorder, Residual, StandardResidual


def make_residual(
    residual: str,
    num_layers: int,
    points: Sequence[DepthAttention] | Mapping[int, DepthAttention] | None = None,
    *,
    block_size: int | None = None,
    rescale_mixture: bool = False,
    two_phase: bool | None = None,
    record: Recorder | None = None,
    inference: bool = False,
    layerwise: bool = False,
    chain: bool = False,
    full_group: int | None = 0,
) -> Residual:
    """The residual object of kind `residual` ("standard", "full" or "block").

    `points`: the aggregation points it reads: all 2L + 1 in schedule order, or a mapping from point index to point
    (a decoder layer's own two; not needed for "standard"); `block_size` counts decoder layers (Kimi K3
    `attn_res_block_size`); `record`: what the reads keep (`Recorder`); `inference` selects the backends without
    autograd: for "block" the fused bank (`attnres.layers.bank`), for "full" direct kernel calls
    (`attnres.layers.full_inference`), unless depth is recorded; `layerwise`: Block's bank scores only a decoder
    layer's own points in phase 1 (FSDP2 gathers each layer's weights for its own forward); `chain` makes the points
    of "full" and the one-shot points of "block" a chain for the backward (`attnres.ops.chain`: the same gradients,
    summed in place; for eager training);
    `full_group`: the points of "full" that phase 1 scores together (`FullResidual`; 0: none; None: chosen by
    the backend where the chain would run).
    """
    if residual not in RESIDUAL_KINDS:
        raise ValueError(f"residual: expected one of {RESIDUAL_KINDS}, got {residual!r}")
    inference = inference and not (record is not None and record.depth)
    common = dict(rescale_mixture=rescale_mixture, record=record)
    if residual == STANDARD:
        return StandardResidual(num_layers, **common)
    if residual == FULL:
        return FullInference(num_layers, points, **common) if inference else FullResidual(
            num_layers, points, chain=chain, group=full_group, **common
        )
    if block_size is None:
        raise ValueError("block_size: the block residual needs a block size (in decoder layers)")
    if inference:
        return BlockBank(num_layers, points, block_size, two_phase=two_phase, layerwise=layerwise, **common)
    return BlockResidual(num_layers, points, block_size, two_phase=two_phase, chain=chain, **common)
