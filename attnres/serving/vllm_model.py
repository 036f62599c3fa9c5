"""AttnResForCausalLM inside vLLM: the family's own vLLM model, its decoder layers' residual path AttnRes.

The model is built as vLLM builds the family (`LlamaForCausalLM`, `Qwen3MoeForCausalLM`, ...: its paged attention
with the KV cache and prefix caching, its fused QKV and gate-up projections, MoE, rotary embeddings, norms and logits
processor) and adopts that model's children, so every weight keeps the name and the loader of the family's vLLM
model; the AttnRes pseudo-queries and key norms are added on its decoder layers and base model under their Kimi K3
names, which that loader then fills like any other parameter.

Only the forward is ours. vLLM hands the model one flattened batch of tokens (prefill chunks and decode tokens of
every scheduled sequence together) and the depth aggregation is per token, so one residual state serves the whole
batch: Block takes the fused bank (`attnres.layers.bank`, one `[tokens, NB, d]` bank, no stacked sources), Full
attends over its sources with one direct kernel call per point (`attnres.layers.full_inference`). Each
sublayer runs as the saved layer plan says (PreNorm, body, post-body norms, residual scale;
`attnres.models.family.Sublayer`), on the vLLM layer's children of the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from attnres.layers import STANDARD, PreNorm, make_residual
from attnres.models.family import Sublayer
from attnres.models.modeling_attnres import key_norm_eps
from attnres.models.wiring import OUTPUT_POINT, SIDE_NAMES, add_points
from attnres.serving.checks import family_architecture

# class attributes of a family's vLLM model that its weight loader and LoRA support read from the instance
_FAMILY_CLASS_ATTRIBUTES = ("hf_to_vllm_mapper", "packed_modules_mapping", "embedding_modules")


class AttnResForCausalLM(nn.Module):
    """vLLM's model for an AttnRes folder (architecture `AttnResForCausalLM`): the family's vLLM causal LM, its
    children adopted, its logits and weight loading as they are, the forward through the AttnRes residual."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        from vllm.model_executor.models.registry import ModelRegistry

        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        family = family_architecture(config)
        self._family_cls, _ = ModelRegistry.resolve_model_cls(family, vllm_config.model_config)
        # the family model reads its fields from the AttnRes config, which reads them through from text_config
        family_lm = self._family_cls(vllm_config=vllm_config, prefix=prefix)
        for name, child in family_lm.named_children():
            self.add_module(name, child)
        for name, value in vars(family_lm).items():  # plain attributes its methods read (make_empty_..., ...)
            if not name.startswith("_") and name not in ("training", "config"):
                setattr(self, name, value)
        for name in _FAMILY_CLASS_ATTRIBUTES:
            if hasattr(self._family_cls, name):
                setattr(self, name, getattr(self._family_cls, name))
        self.sides = tuple(Sublayer.from_config(entry) for entry in config.attn_res_layer_plan)
        _check_layer_names(self.model.layers[0], self.sides, family)
        dim, eps = config.hidden_size, key_norm_eps(config.text_config)
        self.points = None
        if config.residual != STANDARD:
            points = [point for layer in self.model.layers for point in add_points(layer, SIDE_NAMES, dim, eps)]
            self.points = points + list(add_points(self.model, (OUTPUT_POINT,), dim, eps))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids `[tokens]` (or inputs_embeds `[tokens, d]`) of the flattened batch; the final norm's output."""
        if intermediate_tensors is not None:
            raise NotImplementedError("pipeline parallelism: AttnRes models are served on a single pipeline stage")
        base, config = self.model, self.config
        hidden = base.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = self._residual()
        state = residual.start(hidden)
        for i, layer in enumerate(base.layers):
            attention, mlp = self.sides
            x, state = residual.read(state, 2 * i, _prenorm(layer, attention))
            state = residual.write(state, _run_sublayer(layer, attention, x, positions))
            x, state = residual.read(state, 2 * i + 1, _prenorm(layer, mlp))
            state = residual.write(state, _run_sublayer(layer, mlp, x, None))
        return base.norm(residual.read(state, 2 * config.num_hidden_layers)[0])

    def _residual(self):
        """The residual object of one forward: Block's fused bank, Full's direct kernel calls."""
        config = self.config
        return make_residual(
            config.residual,
            config.num_hidden_layers,
            self.points,
            block_size=config.attn_res_block_size,
            rescale_mixture=config.attn_res_rescale_mixture,
            two_phase=config.attn_res_two_phase,
            inference=True,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self._family_cls.compute_logits(self, hidden_states)

    def load_weights(self, weights) -> set[str]:
        return self._family_cls.load_weights(self, weights)


def _prenorm(layer: nn.Module, side: Sublayer) -> PreNorm:
    """The side's PreNorm: the family's plain RMSNorm fused into the aggregation, any other norm (Gemma's 1 + w) the
    vLLM layer's own module applied to the mixture."""
    return PreNorm(getattr(layer, side.norm), side.fused_eps)


def _run_sublayer(layer: nn.Module, side: Sublayer, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """v = scale * post(body(x)), with vLLM's calling convention: the attention takes the positions, the MLP x only."""
    body = getattr(layer, side.body)
    out = body(x) if positions is None else body(positions=positions, hidden_states=x)
    for name, _ in side.post:
        out = getattr(layer, name)(out)
    return out * side.scale if side.scale != 1.0 else out


def _check_layer_names(layer: nn.Module, sides: tuple[Sublayer, Sublayer], family: str) -> None:
    missing = [n for side in sides for n in (side.norm, side.body, *(p for p, _ in side.post)) if not hasattr(layer, n)]
    if missing:
        raise ValueError(
            f"attn_res_layer_plan: names {missing}, which vLLM's {family} decoder layer does not have; AttnRes models "
            f"are served for families whose vLLM layers keep transformers' module names"
        )
