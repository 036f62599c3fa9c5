"""The two sublayers of a decoder layer, computed as transformers Llama computes them (same module names, same
rounding): grouped-query self-attention with rotary positions and a KV cache, and the gated MLP.

Options cover the rest of the Llama family that `attnres.convert_from_hf` accepts: an explicit head size and Qwen3's
per-head q/k RMSNorm, biases on q/k/v (and o), MLP biases, and Mistral's sliding window (in the mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache

from attnres.layers import RMSNorm
from attnres.models.configuration_attnres import AttnResConfig


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


def causal_attention_mask(
    padding: torch.Tensor | None, past: int, seq: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Which keys the `seq` new positions may attend to, after `past` cached ones.

    Returns a boolean `[batch or 1, 1, seq, past + seq]` (True: may attend; queries at cache indices past ..
    past+seq-1, keys at 0 .. past+seq-1), or None where plain causal attention is exact: no padding, no window cut,
    and no cache or a single query. `padding`: `[batch, past + seq]` (1: token, 0: padding). `window`: attend to the
    last `window` positions only, the current one included (Mistral's rule, on cache indices).
    Each position may attend to itself, so a padding row never sees an empty key set (no NaN to leak).
    """
    total = past + seq
    window_cuts = window is not None and total > window
    if (padding is None or bool(padding.all())) and not window_cuts and (past == 0 or seq == 1):
        return None
    query = torch.arange(past, total, device=device)[:, None]
    key = torch.arange(total, device=device)
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :] | (key == query)
    return allowed if allowed.dim() == 4 else allowed[None, None]


class AttnResAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, through `scaled_dot_product_attention`."""

    def __init__(self, config: AttnResConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # this layer's slot in a transformers Cache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        dim, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=config.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """x `[batch, seq, hidden]` -> `[batch, seq, hidden]`. mask: None (causal) or from `causal_attention_mask`; cache:
        receives this layer's new keys and values and hands back all it keeps."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if mask is not None:
            mask = mask[..., -k.shape[-2] :]  # a sliding-window cache hands back only the latest keys
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class AttnResMLP(nn.Module):
    """Gated MLP (SwiGLU with silu): down(act(gate(x)) * up(x)), `[..., hidden]` -> `[..., hidden]`."""

    def __init__(self, config: AttnResConfig):
        super().__init__()
        dim, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
