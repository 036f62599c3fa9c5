"""transformers classes for AttnRes decoders; importing this package registers them with the Auto classes.

The configuration is imported here; the modeling code (it imports transformers' `modeling_utils`, seconds) on first
use of a model class or of `convert_from_hf`, through the Auto classes or through this package's attributes.
"""

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.lazy_class import LazyModelClass

_MODULE_OF = {
    "AttnResCausalLMOutput": "modeling_attnres",
    "AttnResForCausalLM": "modeling_attnres",
    "AttnResModel": "modeling_attnres",
    "AttnResModelOutput": "modeling_attnres",
    "AttnResPreTrainedModel": "modeling_attnres",
    "attnres_config_from_hf": "convert",
    "convert_from_hf": "convert",
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, LazyModelClass("AttnResModel"), exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, LazyModelClass("AttnResForCausalLM"), exist_ok=True)

__all__ = ["AttnResConfig", *_MODULE_OF]
