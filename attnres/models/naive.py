"""The whole AttnRes forward in plain torch: the reference a model's own forward is tested against.

docs/design.md sections 1-3, one sublayer at a time, with nothing fused, streamed or chained: `v[0]` is the embedding
the family hands its first decoder layer and `v[j + 1]` the output of sublayer j (attention and MLP/MoE of layer j // 2
in turn). Before each sublayer, its aggregation point mixes the sources its schedule gives with
`naive_depth_attention` (the op's readable twin), the mixture is multiplied by the number of sources where the config
rescales it, and the sublayer's own PreNorm module normalises it; the final read feeds the family's final norm and
head. The family's modules (attention, MLP, norms, rotary embeddings, masks) run as the model holds them, through the
layer plan, so the same function serves every family. Slow and memory-hungry by design: every source is kept and every
point re-reads all of them.
"""

from __future__ import annotations

import torch

from attnres.layers.kinds import FULL, STANDARD
from attnres.models.family import run_sublayer
from attnres.ops.naive import naive_depth_attention


def schedule_sources(v: list[torch.Tensor], j: int, residual: str, block_size: int) -> list[torch.Tensor]:
    """The sources of the aggregation point before sublayer j (j = 2L: the final read), from `v[:j + 1]`.

    standard: their sum (one source); full: each of them; block: the embedding, the sum of each completed block of
    `block_size` decoder layers (2 * block_size sublayers) and, once begun, the sum of the current block so far."""
    if residual == STANDARD:
        return [sum(v[: j + 1])]
    if residual == FULL:
        return v[: j + 1]
    per_block = 2 * block_size
    completed = j // per_block
    summaries = [v[0]] + [sum(v[1 + b * per_block : 1 + (b + 1) * per_block]) for b in range(completed)]
    current = v[1 + completed * per_block : j + 1]
    return summaries + ([sum(current)] if current else [])


def naive_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits `[batch, seq, vocab]` of the `AttnResForCausalLM` `model` for `input_ids`, computed as above (no KV
    cache; differentiable, so gradients can be compared too)."""
    config = model.config
    residual, block_size = config.residual, config.attn_res_block_size
    L = config.num_hidden_layers
    inputs = model.layer_inputs(input_ids=input_ids)  # what the family hands each layer: embedding, masks, rotary
    v = [inputs[0][0]]
    points = model.aggregation_points()

    def read(j: int) -> torch.Tensor:
        sources = schedule_sources(v, j, residual, block_size)
        if residual == STANDARD:
            return sources[0]
        point = points[j]
        mix = naive_depth_attention(sources, point.proj.weight, point.norm.weight, eps=point.eps)
        return mix * len(sources) if config.attn_res_rescale_mixture else mix

    for i, layer in enumerate(model.model.layers):
        kwargs = inputs[i][1]
        for k, side in enumerate(layer.sides):
            x = getattr(layer, side.norm)(read(2 * i + k))
            v.append(run_sublayer(layer, side, x, kwargs, side.held_arguments(layer.family_args)).to(x.dtype))
    return model.head_logits(model.model.norm(read(2 * L)))
