"""AttnResForCausalLM: a transformers decoder family's own model whose residual path is a residual stream
(DESIGN sections 3, 4, 6, 8 and 13).

`model` is the family's own base model (a `LlamaModel`, `Qwen3MoeModel`, ...: its embedding, rotary embeddings,
masks, attention backends, caches and final norm), its decoder layers replaced by `AttnResDecoderLayer`s holding the
family layer's own children; `lm_head` and the head's forward (logit scaling, soft-capping, the MoE router loss) are
the family's too. So every weight keeps its transformers name and a checkpoint of the family converts key for key. The
AttnRes parameters carry the Kimi K3 names: per decoder layer `self_attention_res_{proj,norm}` and
`mlp_res_{proj,norm}`, and `model.output_attn_res_{proj,norm}` for the read before the final norm. The standard
residual has none of them.

One forward makes one `ForwardState` and one residual stream; the stream, and with it the Block bank, lives for that
forward only (a prefill chunk or a decode step, DESIGN section 6); what generation keeps across steps is the
attention's KV cache, exactly as in the family's model.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.loading import check_bank_layout, check_loaded_weights, saved_config
from attnres.layers import KeyNorm, NamedPoint, PseudoQuery
from attnres.models.family import probe_input
from attnres.models.wiring import OUTPUT_POINT, AttnResDecoderLayer, ForwardState, add_points


@dataclass
class AttnResModelOutput(BaseModelOutputWithPast):
    """The family's base-model output (`last_hidden_state` after the final norm, `cache`, ...) and:

    depth_weights, depth_mixtures (`output_depth_weights=True`): what each of the 2L + 1 aggregation points saw, in
        schedule order (attention and MLP side of each layer, then the final read; detached): the softmax weights
        `[R_k, batch, seq]` over the R_k sources of point k (empty for "standard") and the pre-norm input
        `[batch, seq, hidden]` the point hands its norm (for "standard": the residual sum).
    captured_hidden_states (`capture_layers=[i, ...]`): for each listed decoder layer, in that order, the hidden state
        an EAGLE-style drafter should see after it (DESIGN section 6): the pre-norm input `[batch, seq, hidden]` that
        the next aggregation point (layer i + 1's attention side, or the final read after the last layer) hands its
        norm, i.e. the mixture m of DESIGN section 3 (times the number of sources with `attn_res_rescale_mixture`), not
        the block prefix. For "standard" it is the residual sum after layer i, the usual capture. Not detached.
    router_logits: MoE families, as theirs.
    """

    router_logits: tuple[torch.Tensor, ...] | None = None
    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttnResCausalLMOutput(CausalLMOutputWithPast):
    """The family's causal-LM output (`loss`, `logits`, `cache`, and for MoE families `aux_loss`, `router_logits`)
    plus the extra fields of [`AttnResModelOutput`]."""

    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None


# transformers' Mixtral-style renaming `.block_sparse_moe.` <-> `.mlp.` is a regex whose dots match any character, so
# saving turns `mlp_res_proj` into `block_sparse_moe.res_proj` and loading into `mlp.res_proj`: map those back
_MLP_RES_REPAIR = {r"\.(?:block_sparse_moe|mlp)\.res_(proj|norm)\.weight$": r".mlp_res_\1.weight"}


def _family_lm_class(config: AttnResConfig) -> type[PreTrainedModel]:
    text_config = config.text_config
    if type(text_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"base_model_type: transformers has no causal LM for {text_config.model_type!r}")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]


def _key_norm_eps(text_config) -> float:
    """The AttnRes key norms use the family's RMSNorm eps."""
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        value = getattr(text_config, name, None)
        if isinstance(value, float):
            return value
    return 1e-6


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig  # explicit: with postponed annotations transformers cannot read `config`'s
    config: AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnResDecoderLayer"]
    supports_gradient_checkpointing = True  # per sublayer, see AttnResDecoderLayer._sublayer
    # attention is the family's own module: whatever backend its family supports
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def _build_family(self, config: AttnResConfig) -> PreTrainedModel:
        """The family's own causal LM, its decoder layers swapped for AttnRes layers (same children, same names), and
        for Full and Block the final read's parameters on its base model."""
        lm = _family_lm_class(config)(config.text_config)
        base = lm.base_model
        if not isinstance(getattr(base, "layers", None), nn.ModuleList):
            raise ValueError(f"base_model_type: the {config.base_model_type!r} model keeps no decoder `layers` list")
        dim, eps = config.hidden_size, _key_norm_eps(config.text_config)
        base.layers = nn.ModuleList(
            AttnResDecoderLayer(layer, i, config.residual, dim, eps) for i, layer in enumerate(base.layers)
        )
        self.final_point = () if config.residual == "standard" else add_points(base, (OUTPUT_POINT,), dim, eps)
        return lm

    def aggregation_points(self) -> list[NamedPoint] | None:
        """The 2L + 1 points in schedule order (each layer's attention and MLP side, then the final read); None for
        the standard residual."""
        if self.config.residual == "standard":
            return None
        return [point for layer in self.model.layers for point in layer.points] + list(self.final_point)

    def forward_state(
        self, *, output_depth_weights: bool = False, capture_layers: Sequence[int] | None = None, **options
    ) -> ForwardState:
        """The state of one forward (Block takes the fused bank path when no gradient is recorded); `options`: the
        other fields of `ForwardState` (probe, start, stop, resume_from)."""
        return ForwardState(
            self.config,
            self.aggregation_points(),
            record_weights=output_depth_weights,
            capture=_check_capture_layers(capture_layers, self.config.num_hidden_layers),
            inference=not torch.is_grad_enabled(),
            **options,
        )

    def is_planned(self) -> bool:
        return all(layer.sides is not None for layer in self.model.layers)

    @torch.compiler.disable
    def plan_layers(self) -> None:
        """Read every decoder layer's two sublayers from the family's own layer (`attnres.models.family`) and check
        them numerically; an unsupported family raises a ValueError here. Runs once, at the first forward."""
        if self.is_planned():
            return
        if any(p.is_meta for p in self.parameters()):
            raise RuntimeError("plan_layers: the model's weights are still on the meta device; load them first")
        modes = {module: module.training for module in self.modules()}
        self.eval()  # dropout would draw two masks for the two forwards the check compares
        try:
            with torch.no_grad():
                self.model(input_ids=probe_input(self), use_cache=False, attn_res=self.forward_state(probe=True))
        finally:
            for module, training in modes.items():
                module.training = training
        if any(layer.sides is None for layer in self.model.layers):
            raise ValueError(
                f"base_model_type: the {self.config.base_model_type!r} model does not pass its keyword arguments on to "
                f"its decoder layers, so AttnRes cannot hand them the residual state"
            )
        prefix = _family_lm_class(self.config).base_model_prefix
        if prefix != "model":
            raise ValueError(
                f"base_model_type: the {self.config.base_model_type!r} causal LM keeps its base model as {prefix!r}; "
                f"AttnRes models keep it as 'model' (the Llama layout) and support those families only"
            )

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
        """transformers' switch, with `every_n_layers` counted over the AttnRes decoder layers too (transformers counts
        only its `GradientCheckpointingLayer`s, whose whole-layer recompute would replay the stream's writes)."""
        kwargs = {} if gradient_checkpointing_func is None else {"gradient_checkpointing_func": gradient_checkpointing_func}
        super()._set_gradient_checkpointing(enable, every_n_layers=every_n_layers, **kwargs)
        for i, layer in enumerate(self.model.layers):
            layer.gradient_checkpointing = enable and i % every_n_layers == 0

    def initialize_weights(self):
        """The family's init for its modules; zero pseudo-queries and unit key gains for ours (transformers' guarded
        `init` functions leave loaded weights alone)."""
        super().initialize_weights()
        for module in self.modules():
            if isinstance(module, PseudoQuery):
                init.zeros_(module.weight)
            elif isinstance(module, KeyNorm):
                init.ones_(module.weight)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`, made strict about the AttnRes weights and the bank layout
        (`attnres.models.loading`): a mismatch raises a ValueError naming the tensors or the setting."""
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched_sizes = kwargs.pop("ignore_mismatched_sizes", False)
        kwargs["key_mapping"] = {**_MLP_RES_REPAIR, **(kwargs.get("key_mapping") or {})}
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        saved = saved_config(pretrained_model_name_or_path, kwargs)
        check_bank_layout(pretrained_model_name_or_path, saved, model.config)
        check_loaded_weights(pretrained_model_name_or_path, saved, info, model.state_dict(), ignore_mismatched_sizes)
        model.plan_layers()
        return (model, info) if want_info else model

    def _begin(self, input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers,
               kwargs: dict):
        """Checks and the state of one forward: (cache, use_cache, ForwardState). A caller that wants the stream
        afterwards (to read its bank or sources) passes its own state as `attn_res` in `kwargs`."""
        cache = _cache_argument(cache, kwargs)
        if kwargs.get("output_hidden_states"):
            raise ValueError(
                "output_hidden_states: an AttnRes layer's state is the residual stream, not one hidden state; pass "
                "capture_layers=[...] for what each layer hands on (the mixture the next point forms), or "
                "output_depth_weights=True for every point's mixture"
            )
        if use_cache is None and self.training:
            use_cache = False  # a training step starts no KV cache
        _check_inputs(input_ids, inputs_embeds, attention_mask, cache)
        if not self.is_planned():  # checked here, so that a compiled forward of a planned model never calls out
            self.plan_layers()
        state = kwargs.pop("attn_res", None)
        if state is None:
            state = self.forward_state(output_depth_weights=output_depth_weights, capture_layers=capture_layers)
        self._refuse_row_routing(state.points or ())
        return cache, use_cache, state

    def _refuse_row_routing(self, points) -> None:
        """PEFT's mixed-adapter batches (`adapter_names=[...]`) route each row through its adapter by a hook on each
        module's forward; an aggregation point never calls its modules (it reads their weights), so every row would get
        one adapter's AttnRes parameters. Refused; PEFT does not remove its hooks when a forward raises, so they go."""
        for point in points:
            for name in (point.proj_name, point.norm_name):
                if _routes_rows(getattr(point.owner, name)):
                    for module in self.modules():
                        for key in [k for k, hook in module._forward_pre_hooks.items() if _routes_rows_hook(hook)]:
                            del module._forward_pre_hooks[key]
                    raise ValueError(
                        "adapter_names: PEFT mixed-adapter batches cannot route the AttnRes parameters per row; run "
                        "one adapter per batch"
                    )

    def _plan_unless_meta(self) -> None:
        if not any(p.is_meta for p in self.parameters()):
            self.plan_layers()


def _routes_rows_hook(hook) -> bool:
    return getattr(hook, "keywords", {}).get("adapter_names") is not None


def _routes_rows(module: nn.Module) -> bool:
    return any(_routes_rows_hook(hook) for hook in module._forward_pre_hooks.values())


def _check_capture_layers(capture_layers: Sequence[int] | None, num_layers: int) -> list[int]:
    layers = [] if capture_layers is None else list(capture_layers)
    valid = all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)
    if not valid or len(set(layers)) != len(layers):
        raise ValueError(
            f"capture_layers: expected distinct decoder layer indices in [0, {num_layers - 1}], got {capture_layers!r}"
        )
    return layers


def _check_inputs(input_ids, inputs_embeds, attention_mask, cache) -> None:
    """One of input_ids and inputs_embeds, and a [batch, seq] padding mask that covers the cached and new tokens.
    Longer contexts than `max_position_embeddings` run as in the family (dynamic rope scales exactly there)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
    batch, seq = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    past = 0 if cache is None else cache.get_seq_length()
    if attention_mask is not None and not isinstance(attention_mask, dict) and attention_mask.dim() == 2:
        if attention_mask.shape != (batch, past + seq):
            cached = f" (seq counts the {past} cached tokens)" if past else ""
            raise ValueError(
                f"attention_mask: expected a [batch, seq] = [{batch}, {past + seq}] padding mask{cached}, "
                f"got {list(attention_mask.shape)}"
            )


def _cache_argument(cache, kwargs: dict):
    """The KV cache, passed as `cache` (transformers 5) or under its older name `past_key_values`."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None:
        if cache is not None:
            raise ValueError("cache, past_key_values: pass the KV cache once (past_key_values is its older name)")
        cache = legacy
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"cache: expected a transformers Cache such as DynamicCache, got {type(cache).__name__}")
    return cache


def _with_depth_outputs(output, state: ForwardState, output_cls):
    """The family's output with the AttnRes fields of `state` added."""
    if not isinstance(output, dict):  # return_dict=False: the family's tuple
        return output
    stream = state.stream
    return output_cls(
        **output,
        depth_weights=stream.weights if state.record_weights else None,
        depth_mixtures=stream.mixtures if state.record_weights else None,
        captured_hidden_states=tuple(state.captured[i] for i in state.capture) if state.capture else None,
    )


class AttnResModel(AttnResPreTrainedModel):
    """The family's base model with AttnRes decoder layers, without a head (what `AutoModel` gives)."""

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = self._build_family(config).base_model
        self.post_init()
        self._plan_unless_meta()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_depth_weights: bool = False,
        capture_layers: Sequence[int] | None = None,
        **kwargs,
    ) -> AttnResModelOutput:
        """The family base model's forward (its arguments), through the AttnRes residual; see [`AttnResModelOutput`]."""
        cache, use_cache, state = self._begin(
            input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers, kwargs
        )
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            attn_res=state,
            **kwargs,
        )
        return _with_depth_outputs(out, state, AttnResModelOutput)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """The family's causal LM with AttnRes decoder layers; `generate`, `pipeline("text-generation")`, `Trainer` and
    PEFT work as with the family's own model, with the KV cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        lm = self._build_family(config)
        self._family_lm_forward = type(lm).forward
        for name, value in vars(lm).items():  # plain attributes the family head reads (router_aux_loss_coef, ...)
            if not name.startswith("_") and name not in ("training", "config"):
                setattr(self, name, value)
        self.model, self.lm_head = lm.base_model, lm.lm_head
        self.post_init()
        self._plan_unless_meta()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_depth_weights: bool = False,
        capture_layers: Sequence[int] | None = None,
        **kwargs,
    ) -> AttnResCausalLMOutput:
        """The family causal LM's forward (its arguments: logits `[batch, seq, vocab]`, or the last `logits_to_keep`
        positions; with labels `[batch, seq]`, -100 ignored, the mean next-token loss), through the AttnRes residual;
        `output_depth_weights` and `capture_layers` as in [`AttnResModelOutput`]."""
        cache, use_cache, state = self._begin(
            input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers, kwargs
        )
        out = self._family_lm_forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            attn_res=state,
            **kwargs,
        )
        return _with_depth_outputs(out, state, AttnResCausalLMOutput)
