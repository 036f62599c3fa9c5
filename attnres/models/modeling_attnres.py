"""AttnResForCausalLM: a Llama-style decoder whose residual path is a residual stream (DESIGN sections 3, 4 and 8).

The standard parts keep the transformers Llama module names (`model.embed_tokens`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `.mlp.{gate,up,down}_proj`, `.input_layernorm`,
`.post_attention_layernorm`, `model.norm`, `lm_head`), so a Llama checkpoint converts key for key. The AttnRes
parameters carry the Kimi K3 names: per decoder layer `self_attention_res_{proj,norm}` and `mlp_res_{proj,norm}`,
and `model.output_attn_res_{proj,norm}` for the read before the final norm. The standard residual has none of them.

One forward makes one stream (`attnres.layers.make_stream`). Each decoder layer reads its normed sublayer input from
the stream (the sublayer's PreNorm fused into the depth aggregation) and writes the sublayer's output back; the
final read, with `model.norm`, gives the last hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnres.layers import DepthAttention, ResidualStream, RMSNorm, make_stream
from attnres.models.configuration_attnres import AttnResConfig


@dataclass
class AttnResModelOutput(BaseModelOutputWithPast):
    """`last_hidden_state` `[batch, seq, hidden]` after the final norm and, with `output_depth_weights=True`, what
    each of the 2L + 1 aggregation points saw, in schedule order (attention and MLP side of each layer, then the
    final read; detached):

    depth_weights: `[R_k, batch, seq]` softmax weights over the R_k sources of point k (empty for "standard").
    depth_mixtures: `[batch, seq, hidden]` pre-norm input the point hands its norm (for "standard": the residual sum).
    """

    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None


@dataclass
class AttnResCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus `depth_weights` and `depth_mixtures`, as in [`AttnResModelOutput`]."""

    depth_weights: list[torch.Tensor] | None = None
    depth_mixtures: list[torch.Tensor] | None = None


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[batch or 1, seq, head_dim]` in fp32 of the plain rotary embedding at `position_ids` `[batch or 1,
    seq]`, computed as transformers Llama computes them (same rounding)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, heads, seq, head_dim]` by position (Llama's half-split pairing); cos, sin in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def padding_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Boolean `[batch, 1, seq, seq]` (True: may attend) from a `[batch, seq]` padding mask (1: token, 0: padding).

    Each position may also attend to itself, so a padding row never sees an empty key set (no NaN to leak)."""
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    visible = attention_mask.bool()[:, None, None, :] | torch.eye(seq, dtype=torch.bool, device=attention_mask.device)
    return causal & visible


class PseudoQuery(nn.Linear):
    """An aggregation point's query `w`, stored as a `[1, d]` linear weight (the K3 layout). Zero-initialised, so
    training starts from the uniform mean of the sources; its own class so weight init can tell it apart."""

    def __init__(self, dim: int):
        super().__init__(dim, 1, bias=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class AttnResAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, through `scaled_dot_product_attention`."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x `[batch, seq, hidden]` -> `[batch, seq, hidden]`; mask: None (causal) or from `padding_causal_mask`."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class AttnResMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), `[..., hidden]` -> `[..., hidden]`."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AttnResDecoderLayer(nn.Module):
    """Attention then MLP, each fed by one read of the residual stream and written back into it."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = AttnResAttention(config)
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

    def forward(self, stream: ResidualStream, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> None:
        # outputs join the stream in its dtype: under autocast the sublayers compute in bf16, the residual does not
        x = stream.read(self.input_layernorm)
        stream.write(self.self_attn(x, cos, sin, mask).to(x.dtype))
        x = stream.read(self.post_attention_layernorm)
        stream.write(self.mlp(x).to(x.dtype))


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig  # explicit: with postponed annotations transformers cannot read `config`'s
    config: AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnResDecoderLayer"]
    # the stream is state shared across layers, which per-layer recomputation cannot replay
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """Linear and Embedding: normal(0, initializer_range); RMSNorm (PreNorms and key norms): ones; pseudo-queries:
        zero. The guarded `init` functions leave loaded weights alone."""
        if isinstance(module, PseudoQuery):
            init.zeros_(module.weight)
        else:
            super()._init_weights(module)


class AttnResModel(AttnResPreTrainedModel):
    """Embedding, decoder layers driving one residual stream, and the final (AttnRes) read with `norm`."""

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        dim = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, dim, config.pad_token_id)
        self.layers = nn.ModuleList(AttnResDecoderLayer(config) for _ in range(config.num_hidden_layers))
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

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_depth_weights: bool = False,
        **kwargs,
    ) -> AttnResModelOutput:
        """input_ids `[batch, seq]` (or inputs_embeds `[batch, seq, hidden]`); attention_mask `[batch, seq]` (1: token,
        0: padding); position_ids `[batch or 1, seq]` (default 0 .. seq-1)."""
        config = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = hidden.shape[:2]
        if seq > config.max_position_embeddings:
            raise ValueError(
                f"input_ids: sequence length {seq} exceeds max_position_embeddings={config.max_position_embeddings}"
            )
        if attention_mask is not None and attention_mask.shape != (batch, seq):
            raise ValueError(
                f"attention_mask: expected a [batch, seq] = [{batch}, {seq}] padding mask, "
                f"got {list(attention_mask.shape)}"
            )
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device)[None]
        cos, sin = (t.to(hidden.dtype) for t in rotary_cos_sin(position_ids, config.head_dim, config.rope_theta))
        mask = None if attention_mask is None else padding_causal_mask(attention_mask)

        stream = make_stream(
            config.residual,
            hidden,
            config.num_hidden_layers,
            self.aggregation_points(),
            block_size=config.attn_res_block_size,
            rescale_mixture=config.attn_res_rescale_mixture,
            two_phase=config.attn_res_two_phase,
            record_weights=output_depth_weights,
            inference=not torch.is_grad_enabled(),  # Block: the fused bank path
        )
        for layer in self.layers:
            layer(stream, cos, sin, mask)
        hidden = stream.read(self.norm)
        if not output_depth_weights:
            return AttnResModelOutput(last_hidden_state=hidden)
        return AttnResModelOutput(hidden, depth_weights=stream.weights, depth_mixtures=stream.mixtures)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """AttnResModel with a language-model head. No KV cache yet: `generate(..., use_cache=False)` re-reads the whole
    sequence each step."""

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
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_depth_weights: bool = False,
        cache=None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> AttnResCausalLMOutput:
        """logits `[batch, seq, vocab]`; with labels `[batch, seq]` (-100: ignored) also the mean next-token loss
        (labels are shifted inside, the transformers convention)."""
        if cache is not None or use_cache:
            raise ValueError("use_cache: AttnResForCausalLM has no KV cache yet; generate with use_cache=False")
        out = self.model(input_ids, attention_mask, position_ids, inputs_embeds, output_depth_weights)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return AttnResCausalLMOutput(
            loss=loss, logits=logits, depth_weights=out.depth_weights, depth_mixtures=out.depth_mixtures
        )
