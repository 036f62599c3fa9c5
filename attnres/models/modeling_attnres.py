"""AttnResForCausalLM: a transformers decoder family's own model whose residual path is a residual stream
(docs/design.md sections 2, 3, 5, 6 and 9).

`model` is the family's own base model (a `LlamaModel`, `Qwen3MoeModel`, ...: its embedding, rotary embeddings,
masks, attention backends, caches and final norm), its decoder layers replaced by `AttnResDecoderLayer`s holding the
family layer's own children; `lm_head` and the head's forward (logit scaling, soft-capping, the MoE router loss) are
the family's too. So every weight keeps its transformers name and a checkpoint of the family converts key for key. The
AttnRes parameters carry the Kimi K3 names: per decoder layer `self_attention_res_{proj,norm}` and
`mlp_res_{proj,norm}`, and `model.output_attn_res_{proj,norm}` for the read before the final norm. The standard
residual has none of them.

Each decoder layer takes the residual state and returns the new one (`attnres.models.wiring`, docs/design.md section 7);
the state, and with it the Block bank, lives for one forward only (a prefill chunk or a decode step, docs/design.md
section 5); what generation keeps across steps is the attention's KV cache, exactly as in the family's model.

`hidden_states` (`output_hidden_states=True`): entry l is what decoder layer l reads as its residual, the pre-norm
mixture of its attention side (times the number of sources with `attn_res_rescale_mixture`, so that a zero-query
converted model reports exactly the original's hidden states); the last entry is the final norm's output, as in
transformers.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from attnres.layers import KeyNorm, NamedPoint, PseudoQuery
from attnres.layers.kinds import STANDARD
from attnres.layers.residuals import ResidualState
from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.family import Sublayer, plan_decoder_layers
from attnres.models.loading import check_bank_layout, check_loaded_weights, saved_config
from attnres.models.wiring import (
    ACTIVE_RESIDUAL,
    OUTPUT_POINT,
    AttnResDecoderLayer,
    FinalRead,
    LayerInputs,
    Records,
    add_points,
    flat_tensor_checkpoint,
    residual_for,
)


@dataclass
class AttnResModelOutput(BaseModelOutputWithPast):
    """The family's base-model output (`last_hidden_state` after the final norm, `cache`, ...) and:

    depth_weights, depth_mixtures (`output_depth_weights=True`): what each of the 2L + 1 aggregation points saw, in
        schedule order (attention and MLP side of each layer, then the final read; detached): the softmax weights
        `[R_k, batch, seq]` over the R_k sources of point k (empty for "standard") and the pre-norm input
        `[batch, seq, hidden]` the point hands its norm (for "standard": the residual sum).
    captured_hidden_states (`capture_layers=[i, ...]`): for each listed decoder layer, in that order, the hidden state
        an EAGLE-style drafter should see after it (docs/design.md section 5): the pre-norm input `[batch, seq, hidden]`
        that the next aggregation point (layer i + 1's attention side, or the final read after the last layer) hands its
        norm, i.e. the mixture m of docs/design.md section 2 (times the number of sources with
        `attn_res_rescale_mixture`), not the block prefix. For "standard" it is the residual sum after layer i, the
        usual capture. Not detached.
    residual_state (`output_residual_state=True`): the `ResidualState` the final read consumed (the bank and partial
        sum, every source, or the residual sum).
    router_logits: MoE families, as theirs.
    """

    router_logits: tuple[torch.Tensor, ...] | None = None
    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None
    residual_state: ResidualState | None = None


@dataclass
class AttnResCausalLMOutput(CausalLMOutputWithPast):
    """The family's causal-LM output (`loss`, `logits`, `cache`, and for MoE families `aux_loss`, `router_logits`)
    plus the extra fields of [`AttnResModelOutput`]."""

    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None
    residual_state: ResidualState | None = None


# transformers' Mixtral-style renaming `.block_sparse_moe.` <-> `.mlp.` is a regex whose dots match any character, so
# saving turns `mlp_res_proj` into `block_sparse_moe.res_proj` and loading into `mlp.res_proj`: map those back
MLP_RES_REPAIR = {r"\.(?:block_sparse_moe|mlp)\.res_(proj|norm)\.weight$": r".mlp_res_\1.weight"}


def _family_lm_class(config: AttnResConfig) -> type[PreTrainedModel]:
    text_config = config.text_config
    if type(text_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"base_model_type: transformers has no causal LM for {text_config.model_type!r}")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]


def key_norm_eps(text_config) -> float:
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
    supports_gradient_checkpointing = True  # whole decoder layers: AttnResDecoderLayer is a GradientCheckpointingLayer
    # attention is the family's own module: whatever backend its family supports
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def _build_family(self, config: AttnResConfig) -> PreTrainedModel:
        """The family's own causal LM, its decoder layers swapped for AttnRes layers (same children, same names), and
        for Full and Block the final read's parameters on its base model. A config without a layer plan gets one here,
        read from the family's layers (unless they are on the meta device: then `plan_layers` once they are real)."""
        lm = _family_lm_class(config)(config.text_config)
        base = lm.base_model
        if not isinstance(getattr(base, "layers", None), nn.ModuleList):
            raise ValueError(f"base_model_type: the {config.base_model_type!r} model keeps no decoder `layers` list")
        if config.attn_res_layer_plan is None and not any(p.is_meta for p in lm.parameters()):
            _keep_plan(config, plan_decoder_layers(lm, config.base_model_type))  # refuses a family not PreNorm
        if type(lm).base_model_prefix != "model":
            raise ValueError(
                f"base_model_type: the {config.base_model_type!r} causal LM keeps its base model as "
                f"{type(lm).base_model_prefix!r}; AttnRes models keep it as 'model' (the Llama layout) and support "
                f"those families only"
            )
        dim, eps = config.hidden_size, key_norm_eps(config.text_config)
        layers = (AttnResDecoderLayer(layer, i, config, dim, eps) for i, layer in enumerate(base.layers))
        base.layers = nn.ModuleList(layers)
        if config.attn_res_layer_plan is not None:
            _install_plan(base, tuple(Sublayer.from_config(entry) for entry in config.attn_res_layer_plan))
        self.final_point = () if config.residual == STANDARD else add_points(base, (OUTPUT_POINT,), dim, eps)
        final_read = FinalRead(config, self.final_point)
        base.norm.register_forward_pre_hook(final_read)
        base.norm.register_forward_hook(final_read.after)
        return lm

    def aggregation_points(self) -> list[NamedPoint] | None:
        """The 2L + 1 points in schedule order (each layer's attention and MLP side, then the final read); None for
        the standard residual."""
        if self.config.residual == STANDARD:
            return None
        return [point for layer in self.model.layers for point in layer.points] + list(self.final_point)

    def layer_inputs(self, input_ids=None, inputs_embeds=None) -> list[tuple[torch.Tensor, dict]]:
        """(hidden states, keyword arguments) the family's base model hands each decoder layer for these inputs (its
        embedding for layer 0, masks and rotary embeddings for every layer), from its own forward with no layer run:
        what a caller that runs a range of layers itself (a pipeline stage) passes them."""
        base, inputs = self.model, []
        layers = base.layers
        base.layers = nn.ModuleList(LayerInputs(i, inputs) for i in range(len(layers)))
        try:
            base(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False)
        finally:
            base.layers = layers
        return inputs

    def final_read(self, state: ResidualState) -> torch.Tensor:
        """The mixture the family's final norm normalises, from the state the last decoder layer returned."""
        return FinalRead(self.config, self.final_point).read(state)

    def is_planned(self) -> bool:
        return all(layer.sides is not None for layer in self.model.layers)

    @torch.compiler.disable
    def plan_layers(self) -> None:
        """Read and check the layer plan from the family's own decoder layers (`attnres.models.family`), keep it in the
        config and install it; an unsupported family raises a ValueError. Needed only by a model built on the meta
        device from a config without a plan (or loaded from a folder written before plans were kept). On the meta
        device the plan is read from a real twin of the family with two decoder layers and a small vocabulary."""
        if self.is_planned():
            return
        if any(p.is_meta for p in self.parameters()):  # read from a small real twin: the plan depends on the code
            sides = plan_decoder_layers(_planning_twin(self.config), self.config.base_model_type)
        else:
            sides = plan_decoder_layers(self, self.config.base_model_type,
                                        layer_class=lambda layer: layer.family_layer_cls)
        _keep_plan(self.config, sides)
        _install_plan(self.model, sides)

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func=checkpoint, every_n_layers: int = 1
    ):
        """transformers' switch (whole decoder layers), with a checkpointing function that takes the layers' state
        (a structure of tensors) as flat tensors: so reentrant checkpointing gives every state tensor its gradient."""
        super()._set_gradient_checkpointing(enable, flat_tensor_checkpoint(gradient_checkpointing_func), every_n_layers)

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
        kwargs["key_mapping"] = {**MLP_RES_REPAIR, **(kwargs.get("key_mapping") or {})}
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        saved = saved_config(pretrained_model_name_or_path, kwargs)
        check_bank_layout(pretrained_model_name_or_path, saved, model.config)
        check_loaded_weights(pretrained_model_name_or_path, saved, info, model.state_dict(), ignore_mismatched_sizes)
        model.plan_layers()  # a no-op for a folder whose config keeps its plan: loading runs no probe
        return (model, info) if want_info else model

    def _begin(self, input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers,
               kwargs: dict):
        """Checks and the records of one forward: (cache, use_cache, Records or None)."""
        cache = _cache_argument(cache, kwargs)
        if use_cache is None and self.training:
            use_cache = False  # a training step starts no KV cache
        _check_inputs(input_ids, inputs_embeds, attention_mask, cache)
        L = self.config.num_hidden_layers
        hidden = _hidden_state_indices(kwargs.pop("output_hidden_states", self.config.output_hidden_states), L)
        capture = _check_capture_layers(capture_layers, L)
        want_state = kwargs.pop("output_residual_state", False)
        if not (hidden or capture or output_depth_weights or want_state):
            return cache, use_cache, None
        reads = frozenset(i for i in hidden if i < L) | frozenset(i + 1 for i in capture)
        return cache, use_cache, Records(reads=reads, depth=output_depth_weights, hidden=hidden, capture=tuple(capture))

    def _run(self, forward, records: Records | None, output_cls, **kwargs):
        """`forward(**kwargs)` (the family's) with one residual object for its layers and its final read, and its
        output with the AttnRes fields added."""
        # (the checkpointing switch is a walk over every module: asked only in training)
        checkpointing = self.training and self.is_activation_checkpointing
        backward = torch.is_grad_enabled() or checkpointing
        points = self.aggregation_points()
        if getattr(self, "peft_config", None):  # PEFT's adapters are set (PEFT's tuners set it, unloading removes it)
            self._refuse_row_routing(points or ())
        residual = residual_for(self.config, points, backward=backward, records=records,
                                layerwise=isinstance(self.model.layers[0], FSDPModule), checkpointing=checkpointing)
        token = ACTIVE_RESIDUAL.set(residual)
        try:
            output = forward(attn_res_residual=residual, **kwargs)
        finally:
            ACTIVE_RESIDUAL.reset(token)
        return _with_records(output, records, output_cls, self.config.num_hidden_layers)

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


def _planning_twin(config: AttnResConfig) -> PreTrainedModel:
    """The family's causal LM at the config's widths, with at most two decoder layers (per-layer lists cut to
    match: alternating attention kinds stay represented) and a 32-token vocabulary, built for real on the CPU: what a
    model built on the meta device reads its layer plan from."""
    text = copy.deepcopy(config.text_config)
    layers = min(text.num_hidden_layers, 2)
    for key, value in vars(text).items():
        if isinstance(value, list) and len(value) == text.num_hidden_layers:
            setattr(text, key, value[:layers])
    text.num_hidden_layers, text.vocab_size, text.pad_token_id = layers, 32, None
    with torch.device("cpu"):
        return _family_lm_class(config)(text)


def _keep_plan(config: AttnResConfig, sides: tuple[Sublayer, Sublayer]) -> None:
    config.attn_res_layer_plan = [side.to_config() for side in sides]


def _install_plan(base: nn.Module, sides: tuple[Sublayer, Sublayer]) -> None:
    for layer in base.layers:
        layer.install_plan(sides)


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
    """One of input_ids and inputs_embeds, not empty, and a [batch, seq] padding mask that covers the cached and new tokens.
    Longer contexts than `max_position_embeddings` run as in the family (dynamic rope scales exactly there)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
    name, tokens = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
    if tokens.dim() < 2 or 0 in tokens.shape[:2]:
        raise ValueError(
            f"{name}: expected [batch, seq] with at least one row and one token, got shape {list(tokens.shape)}"
        )
    batch, seq = tokens.shape[:2]
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


def _hidden_state_indices(output_hidden_states, num_layers: int) -> tuple[int, ...]:
    """The hidden-state entries asked for (True: all L + 1; an index or a list of them, negative ones from the end, as
    transformers takes them), in [0, L]."""
    if output_hidden_states is None or output_hidden_states is False:
        return ()
    if output_hidden_states is True:
        return tuple(range(num_layers + 1))
    wanted = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
    n = num_layers + 1
    return tuple(sorted({i % n for i in wanted if -n <= i < n}))


def _with_records(output, records: Records | None, output_cls, num_layers: int):
    """The family's output as `output_cls`, with what `records` kept added."""
    if not isinstance(output, dict):  # return_dict=False: the family's tuple
        return output
    if records is None:
        return output_cls(**output)
    fields = dict(output)
    if records.hidden:
        def entry(i: int) -> torch.Tensor | None:
            if i not in records.hidden:
                return None
            return records.final_normed if i == num_layers else records.mixtures_read[i]

        fields["hidden_states"] = tuple(entry(i) for i in range(num_layers + 1))
    return output_cls(
        **fields,
        depth_weights=[records.weights[k] for k in sorted(records.weights)] if records.depth else None,
        depth_mixtures=[records.mixtures[k] for k in sorted(records.mixtures)] if records.depth else None,
        captured_hidden_states=tuple(records.mixtures_read[i + 1] for i in records.capture) or None,
        residual_state=records.final_state,
    )


class AttnResModel(AttnResPreTrainedModel):
    """The family's base model with AttnRes decoder layers, without a head (what `AutoModel` gives)."""

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = self._build_family(config).base_model
        self.post_init()

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
        cache, use_cache, records = self._begin(
            input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers, kwargs
        )
        return self._run(
            self.model,
            records,
            AttnResModelOutput,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )


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

    def head_logits(self, hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The family causal LM's head on the final norm's output `[batch, seq, d]`: its logits, with whatever its
        forward does to them (Granite's logit scaling, Gemma 2's soft-capping). What a caller that runs the decoder
        layers itself (the last pipeline stage) ends with."""
        return self._family_lm_forward(_HeadOnly(self, hidden_states), logits_to_keep=logits_to_keep).logits

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
        cache, use_cache, records = self._begin(
            input_ids, inputs_embeds, attention_mask, cache, use_cache, output_depth_weights, capture_layers, kwargs
        )
        return self._run(
            partial(self._family_lm_forward, self),
            records,
            AttnResCausalLMOutput,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


class _HeadOnly:
    """The causal LM as its family's forward sees it, except that its base model returns `hidden_states` at once:
    the family's forward then runs only its head."""

    def __init__(self, lm: nn.Module, hidden_states: torch.Tensor):
        self._lm, self._hidden = lm, hidden_states

    def __getattr__(self, name: str):
        return getattr(self._lm, name)

    def model(self, **kwargs) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=self._hidden)  # MoE families read router_logits too
