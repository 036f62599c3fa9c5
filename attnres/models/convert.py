"""Turn a pretrained PreNorm causal LM of the Llama family into an AttnRes model computing the same function.

Every weight is copied key for key (the AttnRes model keeps the transformers Llama names); the AttnRes parameters
start at their init, zero pseudo-queries and unit key gains, and `attn_res_rescale_mixture` is on, which makes a
zero-query AttnRes model compute exactly the PreNorm model's function (DESIGN section 3). The converted model
then gives the original's logits to fp32 rounding and its greedy generations, and training moves the queries.

Accepted: transformers `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` with plain
rotary positions, including explicit `head_dim`, attention and MLP biases, Qwen3's q/k norms, a sliding window
on all layers (Mistral) and any `hidden_act` transformers knows (the gated MLP applies it as Llama's does). Refused, with the setting named: rope scaling of any type but "default", attention
dropout, and a sliding window on some layers only (Qwen2/Qwen3 `use_sliding_window`, 0 < `max_window_layers` < layers)
where the window is shorter than the context; a window at least as long as `max_position_embeddings` cannot cut
anything and is dropped.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import PreTrainedModel

from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.loading import is_attnres_key
from attnres.models.modeling_attnres import AttnResForCausalLM

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# fields with the same name and meaning in every accepted config
_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


def _rope_theta(config) -> float:
    """The rotary base; refuses every rope scaling (transformers 5 keeps it in `rope_parameters`, 4 in `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters: rope_type {rope_type!r} is not supported, only plain rotary positions ('default'); "
            f"got {params or scaling}"
        )
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _sliding_window(config) -> int | None:
    """One window for every layer, or None; refuses a window on some layers only when it can cut the context."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return None  # cannot cut any sequence the model accepts
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    if set(layer_types) == {"sliding_attention"}:
        return window
    if "sliding_attention" not in layer_types:
        return None
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    raise ValueError(
        f"sliding_window: layers {sliding} attend to the last {window} positions and the others to all, but an AttnRes "
        f"model takes one window for every layer (max_position_embeddings={config.max_position_embeddings})"
    )


def attnres_config_from_hf(
    config, residual: str = "block", attn_res_block_size: int | None = None, **config_overrides
) -> AttnResConfig:
    """The `AttnResConfig` of a Llama-family config (see the module docstring); `config_overrides` win."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: expected a transformers causal LM of model_type {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout: AttnRes models have no attention dropout, got {config.attention_dropout}")
    fields = {name: getattr(config, name) for name in _SHARED_FIELDS}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qkv_bias = {"qwen2": True, "mistral": False}.get(model_type, getattr(config, "attention_bias", False))
    fields.update(
        head_dim=head_dim,
        rope_theta=_rope_theta(config),
        attention_bias=qkv_bias,
        attention_output_bias=qkv_bias and model_type != "qwen2",  # Qwen2: q, k and v biases, none on o_proj
        qk_norm=model_type == "qwen3",
        mlp_bias=getattr(config, "mlp_bias", False),
        sliding_window=_sliding_window(config),
        residual=residual,
        # about the paper's N = 8 blocks; block size counts decoder layers
        attn_res_block_size=attn_res_block_size or math.ceil(config.num_hidden_layers / 8),
        attn_res_rescale_mixture=True,
    )
    return AttnResConfig(**{**fields, **config_overrides})


def convert_from_hf(
    model: PreTrainedModel, residual: str = "block", attn_res_block_size: int | None = None, **config_overrides
) -> AttnResForCausalLM:
    """An `AttnResForCausalLM` holding a copy of `model`'s weights (same dtype, device and train/eval mode).

    residual: "block", "full" or "standard"; attn_res_block_size: decoder layers per block (default
    ceil(num_hidden_layers / 8)); config_overrides: any other `AttnResConfig` field (e.g.
    `attn_res_rescale_mixture=False` for the Kimi K3 form, which then differs from the original by the RMSNorm eps).
    """
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "lm_head"):
        raise TypeError(f"model: expected a transformers *ForCausalLM model, got {type(model).__name__}")
    config = attnres_config_from_hf(model.config, residual, attn_res_block_size, **config_overrides)
    with torch.device("meta"):  # no second random init of weights about to be replaced
        converted = AttnResForCausalLM(config)
    state = {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}
    missing, unexpected = converted.load_state_dict(state, strict=False, assign=True)
    not_attnres = sorted(key for key in missing if not is_attnres_key(key))
    if not_attnres or unexpected:
        raise ValueError(
            f"model: its weights do not map onto an AttnRes model (a feature this conversion does not support): "
            f"missing {not_attnres}, unexpected {sorted(unexpected)}"
        )
    for key in missing:  # the AttnRes parameters, at their init
        module = converted.get_submodule(key.rsplit(".", 1)[0])
        fill = torch.zeros if key.endswith("_res_proj.weight") else torch.ones
        module.weight = nn.Parameter(fill(module.weight.shape, dtype=model.dtype, device=model.device))
    if config.tie_word_embeddings:
        converted.tie_weights()
    converted.generation_config = copy.deepcopy(model.generation_config)
    return converted.train(model.training)
