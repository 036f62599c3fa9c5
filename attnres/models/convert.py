"""Turn a pretrained PreNorm causal LM of any transformers family into an AttnRes model computing the same function.

The AttnRes model is the family's own model with its decoder layers rewired (`attnres.models.family`), so every
weight keeps its name and is copied key for key; the AttnRes parameters start at their init (zero pseudo-queries, unit
key gains) and `attn_res_rescale_mixture` is on, which makes a zero-query AttnRes model compute exactly the PreNorm
model's function (docs/design.md section 2). The converted model gives the original's logits to fp32 rounding and its
greedy generations; training then moves the queries. A family whose decoder layer is not a PreNorm residual of two
sublayers (post-norm, parallel attention and MLP, ...) is refused with a ValueError naming it and the reason.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE
from attnres.models.configuration_attnres import ATTNRES_FIELDS, AttnResConfig, PRENORM_START
from attnres.models.family import plan_decoder_layers
from attnres.models.loading import is_attnres_key
from attnres.models.modeling_attnres import AttnResForCausalLM



def attnres_config_from_hf(
    config, residual: str = BLOCK, attn_res_block_size: int = DEFAULT_BLOCK_SIZE, **config_overrides
) -> AttnResConfig:
    """The `AttnResConfig` over a copy of the family config `config`; `config_overrides` win (AttnRes fields, or family
    fields, which are set on the copy)."""
    text_config = copy.deepcopy(config)
    family = {k: v for k, v in config_overrides.items() if k not in ATTNRES_FIELDS}
    for name, value in family.items():
        setattr(text_config, name, value)
    ours = {k: v for k, v in config_overrides.items() if k in ATTNRES_FIELDS}
    converted = AttnResConfig(
        text_config=text_config,
        residual=residual,
        attn_res_block_size=attn_res_block_size,
        **{**PRENORM_START, **ours},
    )
    converted._attn_implementation = getattr(config, "_attn_implementation", None)
    return converted


def convert_from_hf(
    model: PreTrainedModel, residual: str = BLOCK, attn_res_block_size: int = DEFAULT_BLOCK_SIZE, **config_overrides
) -> AttnResForCausalLM:
    """An `AttnResForCausalLM` holding a copy of `model`'s weights (same dtype, device and train/eval mode).

    residual: "block", "full" or "standard"; attn_res_block_size: decoder layers per block; config_overrides: any other `AttnResConfig` field (e.g.
    `attn_res_rescale_mixture=False` for the Kimi K3 form, which then differs from the original by the RMSNorm eps).
    """
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise TypeError(f"model: expected a transformers *ForCausalLM decoder model, got {type(model).__name__}")
    if isinstance(model, AttnResForCausalLM):
        raise ValueError(
            f"model: it is already an AttnRes model (residual={model.config.residual!r}); convert the PreNorm original "
            f"instead, or load this one with from_pretrained"
        )
    # the plan of its decoder layers, read from the family's own layers and checked in float64 (a clear refusal
    # before any weight moves); the converted model keeps it in its config and never probes again
    sides = plan_decoder_layers(model, model.config.model_type)
    config = attnres_config_from_hf(
        model.config, residual, attn_res_block_size, attn_res_layer_plan=[side.to_config() for side in sides],
        **config_overrides,
    )
    with torch.device("meta"):  # no second random init of weights about to be replaced
        converted = AttnResForCausalLM(config)
    state = {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}
    missing, unexpected = converted.load_state_dict(state, strict=False, assign=True)
    not_attnres = sorted(key for key in missing if not is_attnres_key(key))
    if not_attnres or unexpected:
        raise ValueError(
            f"model: its weights do not map onto an AttnRes model of its family: missing {not_attnres}, unexpected "
            f"{sorted(unexpected)}"
        )
    for key in missing:  # the AttnRes parameters, at their init
        module = converted.get_submodule(key.rsplit(".", 1)[0])
        fill = torch.zeros if key.endswith("_res_proj.weight") else torch.ones
        module.weight = nn.Parameter(fill(module.weight.shape, dtype=model.dtype, device=model.device))
    for name, buffer in model.named_buffers():  # rotary frequencies and other buffers not in the state dict
        owner, _, attr = name.rpartition(".")
        converted.get_submodule(owner).register_buffer(attr, buffer.clone(), persistent=name in state)
    if config.tie_word_embeddings:
        converted.tie_weights()
    converted.generation_config = copy.deepcopy(model.generation_config)
    converted.train(model.training)
    return converted
