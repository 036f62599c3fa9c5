"""transformers classes for AttnRes decoders; importing this module registers them with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.convert import attnres_config_from_hf, convert_from_hf
from attnres.models.modeling_attnres import (
    AttnResCausalLMOutput,
    AttnResForCausalLM,
    AttnResModel,
    AttnResModelOutput,
    AttnResPreTrainedModel,
)

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

__all__ = [
    "AttnResCausalLMOutput",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResModelOutput",
    "AttnResPreTrainedModel",
    "attnres_config_from_hf",
    "convert_from_hf",
]
