"""AttnResForCausalLM: a Llama-style decoder whose residual path is a residual stream (DESIGN sections 3, 4, 6 and 8).

The standard parts keep the transformers Llama module names (`model.embed_tokens`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `.mlp.{gate,up,down}_proj`, `.input_layernorm`,
`.post_attention_layernorm`, `model.norm`, `lm_head`), so a Llama checkpoint converts key for key. The AttnRes
parameters carry the Kimi K3 names: per decoder layer `self_attention_res_{proj,norm}` and `mlp_res_{proj,norm}`,
and `model.output_attn_res_{proj,norm}` for the read before the final norm. The standard residual has none of them.

One forward makes one stream (`attnres.layers.make_stream`). Each decoder layer reads its normed sublayer input from
the stream (the sublayer's PreNorm fused into the depth aggregation) and writes the sublayer's output back; the
final read, with `model.norm`, gives the last hidden state. The stream, and with it the Block bank, lives for that
one forward only (a prefill chunk or a decode step, DESIGN section 6); what generation keeps across steps is the
attention's KV cache (a transformers `Cache`), exactly as in a standard model.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from attnres.layers import DepthAttention, ResidualStream, RMSNorm, make_stream
from attnres.models.configuration_attnres import AttnResConfig
from attnres.models.loading import check_bank_layout, check_loaded_weights, saved_config
from attnres.models.sublayers import AttnResAttention, AttnResMLP, causal_attention_mask, rotary_cos_sin


@dataclass
class AttnResModelOutput(BaseModelOutputWithPast):
    """`last_hidden_state` `[batch, seq, hidden]` after the final norm, `cache` (the KV cache, with `use_cache`) and:

    depth_weights, depth_mixtures (`output_depth_weights=True`): what each of the 2L + 1 aggregation points saw, in
        schedule order (attention and MLP side of each layer, then the final read; detached): the softmax weights
        `[R_k, batch, seq]` over the R_k sources of point k (empty for "standard") and the pre-norm input
        `[batch, seq, hidden]` the point hands its norm (for "standard": the residual sum).
    captured_hidden_states (`capture_layers=[i, ...]`): for each listed decoder layer, in that order, the hidden state
        an EAGLE-style drafter should see after it (DESIGN section 6): the pre-norm input `[batch, seq, hidden]` that
        the next aggregation point (layer i + 1's attention side, or the final read after the last layer) hands its
        norm, i.e. the mixture m of DESIGN section 3 (times the number of sources with `attn_res_rescale_mixture`), not
        the block prefix. For "standard" it is the residual sum after layer i, the usual capture. Not detached.
    """

    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttnResCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the extra fields of [`AttnResModelOutput`]."""

    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None
    captured_hidden_states: tuple[torch.Tensor, ...] | None = None


class PseudoQuery(nn.Linear):
    """An aggregation point's query `w`, stored as a `[1, d]` linear weight (the K3 layout). Zero-initialised, so
    training starts from the uniform mean of the sources; its own class so weight init can tell it apart."""

    def __init__(self, dim: int):
        super().__init__(dim, 1, bias=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def read_normed(stream: ResidualStream, norm: RMSNorm, keep_mixture: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(pre-norm mixture if `keep_mixture` else None, the sublayer's normed input) from the stream's next point.

    Keeping the mixture reads it unfused and applies the norm apart; otherwise the norm is fused into the read."""
    if not keep_mixture:
        return None, stream.read(norm)
    mixture = stream.read()
    return mixture, norm(mixture)


class AttnResDecoderLayer(nn.Module):
    """Attention then MLP, each fed by one read of the residual stream and written back into it."""

    def __init__(self, config: AttnResConfig, layer_idx: int = 0):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = AttnResAttention(config, layer_idx)
        self.mlp = AttnResMLP(config)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.points: tuple[DepthAttention, ...] = ()  # the attention-side and MLP-side aggregation points
        if config.residual != "standard":
            self.self_attention_res_proj = PseudoQuery(dim)
            self.self_attention_res_norm = RMSNorm(dim, eps)
            self.mlp_res_proj = PseudoQuery(dim)
            self.mlp_res_norm = RMSNorm(dim, eps)
            # wrappers over the K3-named parameters; a plain tuple, so nothing is registered twice
            self.points = (
                DepthAttention.wrap(self.self_attention_res_proj, self.self_attention_res_norm),
                DepthAttention.wrap(self.mlp_res_proj, self.mlp_res_norm),
            )

    def forward(
        self,
        stream: ResidualStream,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Cache | None = None,
        keep_input_mixture: bool = False,
    ) -> torch.Tensor | None:
        """Returns, with `keep_input_mixture`, the pre-norm mixture the attention side read (else None)."""
        # outputs join the stream in its dtype: under autocast the sublayers compute in bf16, the residual does not
        mixture, x = read_normed(stream, self.input_layernorm, keep_input_mixture)
        stream.write(self.self_attn(x, cos, sin, mask, cache).to(x.dtype))
        x = stream.read(self.post_attention_layernorm)
        stream.write(self.mlp(x).to(x.dtype))
        return mixture


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig  # explicit: with postponed annotations transformers cannot read `config`'s
    config: AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnResDecoderLayer"]
    # the stream is state shared across layers, which per-layer recomputation cannot replay
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """Linear and Embedding: normal(0, initializer_range), biases zero; RMSNorm (PreNorms, key norms, q/k norms):
        ones; pseudo-queries: zero. The guarded `init` functions leave loaded weights alone."""
        if isinstance(module, PseudoQuery):
            init.zeros_(module.weight)
        else:
            super()._init_weights(module)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`, made strict about the AttnRes weights and the bank layout
        (`attnres.models.loading`): a mismatch raises a ValueError naming the tensors or the setting."""
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched_sizes = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        saved = saved_config(pretrained_model_name_or_path, kwargs)
        check_bank_layout(pretrained_model_name_or_path, saved, model.config)
        check_loaded_weights(pretrained_model_name_or_path, saved, info, model.state_dict(), ignore_mismatched_sizes)
        return (model, info) if want_info else model


def _cache_argument(cache: Cache | None, kwargs: dict) -> Cache | None:
    """The KV cache, passed as `cache` (transformers 5) or under its older name `past_key_values`."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None:
        if cache is not None:
            raise ValueError("cache, past_key_values: pass the KV cache once (past_key_values is its older name)")
        cache = legacy
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"cache: expected a transformers Cache such as DynamicCache, got {type(cache).__name__}")
    return cache


def _check_capture_layers(capture_layers: Sequence[int] | None, num_layers: int) -> list[int]:
    layers = [] if capture_layers is None else list(capture_layers)
    valid = all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)
    if not valid or len(set(layers)) != len(layers):
        raise ValueError(
            f"capture_layers: expected distinct decoder layer indices in [0, {num_layers - 1}], got {capture_layers!r}"
        )
    return layers


def _check_lengths(config: AttnResConfig, batch: int, past: int, seq: int, attention_mask: torch.Tensor | None) -> None:
    """The cached plus new tokens must fit the context, and a padding mask must cover them all."""
    if past + seq > config.max_position_embeddings:
        cached = f" ({past} cached + {seq} new)" if past else ""
        raise ValueError(
            f"input_ids: sequence length {past + seq}{cached} exceeds max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    if attention_mask is not None and attention_mask.shape != (batch, past + seq):
        cached = f" (seq counts the {past} cached tokens)" if past else ""
        raise ValueError(
            f"attention_mask: expected a [batch, seq] = [{batch}, {past + seq}] padding mask{cached}, "
            f"got {list(attention_mask.shape)}"
        )


class AttnResModel(AttnResPreTrainedModel):
    """Embedding, decoder layers driving one residual stream, and the final (AttnRes) read with `norm`."""

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        dim = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, dim, config.pad_token_id)
        self.layers = nn.ModuleList(AttnResDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.points: tuple[DepthAttention, ...] = ()  # the final read's aggregation point (a tuple: not registered)
        if config.residual != "standard":
            self.output_attn_res_proj = PseudoQuery(dim)
            self.output_attn_res_norm = RMSNorm(dim, config.rms_norm_eps)
            self.points = (DepthAttention.wrap(self.output_attn_res_proj, self.output_attn_res_norm),)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def aggregation_points(self) -> list[DepthAttention] | None:
        """The 2L + 1 points in schedule order (each layer's attention and MLP side, then the final read); None for
        the standard residual."""
        if self.config.residual == "standard":
            return None
        return [point for layer in self.layers for point in layer.points] + list(self.points)

    def positions(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, past: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rotary (cos, sin) in `hidden`'s dtype and the attention mask for the tokens of `hidden` `[batch, seq, d]`
        at `position_ids` `[batch or 1, seq]`, after `past` cached tokens."""
        config = self.config
        cos, sin = (t.to(hidden.dtype) for t in rotary_cos_sin(position_ids, config.head_dim, config.rope_theta))
        mask = causal_attention_mask(attention_mask, past, hidden.shape[1], config.sliding_window, hidden.device)
        return cos, sin, mask

    def new_stream(self, hidden: torch.Tensor, *, record_weights: bool = False, inference: bool = False):
        """The residual stream of one forward (the config's kind), starting from the embedding `hidden`."""
        config = self.config
        return make_stream(
            config.residual,
            hidden,
            config.num_hidden_layers,
            self.aggregation_points(),
            block_size=config.attn_res_block_size,
            rescale_mixture=config.attn_res_rescale_mixture,
            two_phase=config.attn_res_two_phase,
            record_weights=record_weights,
            inference=inference,  # Block: the fused bank path
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_depth_weights: bool = False,
        capture_layers: Sequence[int] | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> AttnResModelOutput:
        """input_ids `[batch, seq]` (or inputs_embeds `[batch, seq, hidden]`): the new tokens, after those in `cache`.
        attention_mask `[batch, cached + seq]` (1: token, 0: padding); position_ids `[batch or 1, seq]` (default:
        `cache_position`, else cached .. cached+seq-1). use_cache (default: `config.use_cache`, off in training mode):
        start a DynamicCache when none is given. `past_key_values` is accepted as the older name of `cache`."""
        config = self.config
        cache = _cache_argument(cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
        capture = _check_capture_layers(capture_layers, config.num_hidden_layers)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[:2]
        if use_cache is None:
            use_cache = config.use_cache and not self.training
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        past = 0 if cache is None else cache.get_seq_length()
        _check_lengths(config, batch, past, seq, attention_mask)
        if position_ids is None:
            position_ids = cache_position if cache_position is not None else torch.arange(past, past + seq)
            position_ids = position_ids.to(hidden.device)[None]
        cos, sin, mask = self.positions(hidden, position_ids, attention_mask, past)
        stream = self.new_stream(hidden, record_weights=output_depth_weights, inference=not torch.is_grad_enabled())
        # layer i's capture is what the next point forms: layer i + 1's attention side, or the final read
        captured = {}
        for i, layer in enumerate(self.layers):
            mixture = layer(stream, cos, sin, mask, cache, keep_input_mixture=i - 1 in capture)
            if mixture is not None:
                captured[i - 1] = mixture
        mixture, hidden = read_normed(stream, self.norm, config.num_hidden_layers - 1 in capture)
        if mixture is not None:
            captured[config.num_hidden_layers - 1] = mixture
        return AttnResModelOutput(
            last_hidden_state=hidden,
            cache=cache,
            depth_weights=stream.weights if output_depth_weights else None,
            depth_mixtures=stream.mixtures if output_depth_weights else None,
            captured_hidden_states=tuple(captured[i] for i in capture) if capture else None,
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """AttnResModel with a language-model head; `generate` and `pipeline("text-generation")` work as for Llama, with
    the KV cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_depth_weights: bool = False,
        capture_layers: Sequence[int] | None = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs,
    ) -> AttnResCausalLMOutput:
        """logits `[batch, seq, vocab]` (only the last `logits_to_keep` positions when it is positive); with labels
        `[batch, seq]` (-100: ignored) also the mean next-token loss (labels are shifted inside, the transformers
        convention). The other arguments are [`AttnResModel.forward`]'s."""
        cache = _cache_argument(cache, kwargs)
        out = self.model(
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            use_cache=use_cache,
            output_depth_weights=output_depth_weights,
            capture_layers=capture_layers,
            cache_position=cache_position,
        )
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return AttnResCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=out.cache,
            depth_weights=out.depth_weights,
            depth_mixtures=out.depth_mixtures,
            captured_hidden_states=out.captured_hidden_states,
        )
