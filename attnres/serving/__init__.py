"""Serving AttnRes models with vLLM: the plugin vLLM loads from the `vllm.general_plugins` entry point.

With attnres installed beside vLLM, `vllm serve FOLDER` and `vllm.LLM(model=FOLDER)` serve a saved or converted
AttnRes folder: `register` makes its config loadable, registers the architecture with vLLM's `ModelRegistry` (lazily:
`attnres.serving.vllm_model` is imported only when a folder names it) and a config check that refuses, with a clear
message, what vLLM cannot serve (`attnres.serving.checks`).
"""

from __future__ import annotations

ARCHITECTURE = "AttnResForCausalLM"


class _ConfigCheck:
    """vLLM's per-architecture config hook (`VerifyAndUpdateConfig`), which it calls when it builds a ModelConfig."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        from attnres.serving.checks import check_servable

        check_servable(model_config)

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        return None


def register() -> None:
    """Called by vLLM in each of its processes (the `vllm.general_plugins` entry point)."""
    import attnres.models  # noqa: F401  registers the "attnres" config with transformers' AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    ModelRegistry.register_model(ARCHITECTURE, "attnres.serving.vllm_model:AttnResForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = _ConfigCheck
