"""What vLLM cannot serve, refused with a clear message when vLLM reads the folder's config (in the process that
parses the arguments, before any engine starts), instead of a stack from deep inside the engine."""

from __future__ import annotations

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from attnres.models.configuration_attnres import AttnResConfig


def family_architecture(config: AttnResConfig) -> str:
    """The family's causal-LM class name (`LlamaForCausalLM`, ...): vLLM's registry names its own model by it."""
    text_config = config.text_config
    if type(text_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"base_model_type: transformers has no causal LM for {text_config.model_type!r}")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)].__name__


def check_servable(model_config) -> None:
    """Refuse an AttnRes folder vLLM cannot serve: not an AttnRes config, no layer plan, a family vLLM has no model
    for, or a head size the platform's attention refuses. `model_config`: vLLM's `ModelConfig`."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    config = model_config.hf_config
    folder = model_config.model
    if not isinstance(config, AttnResConfig):
        raise ValueError(f"{folder}: architectures names AttnResForCausalLM but its config is {type(config).__name__}")
    if config.attn_res_layer_plan is None:
        raise ValueError(
            f"{folder}: attn_res_layer_plan is missing from its config; load it once with "
            f"AttnResForCausalLM.from_pretrained and save it again (the plan is then kept)"
        )
    family = family_architecture(config)
    if family not in ModelRegistry.get_supported_archs():
        raise ValueError(
            f"{folder}: base_model_type {config.base_model_type!r}: vLLM has no model class {family}, and an AttnRes "
            f"model runs on the family's own vLLM layers; serve it with transformers (AttnResForCausalLM.generate)"
        )
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_size, supported = model_config.get_head_size(), CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in supported:
            raise ValueError(
                f"{folder}: head_dim {head_size}: vLLM's CPU attention takes head sizes {supported} only"
            )
