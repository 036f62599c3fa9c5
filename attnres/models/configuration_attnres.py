"""AttnResConfig: a Llama-style decoder configuration plus the residual kind (DESIGN sections 4 and 8)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from attnres.layers import RESIDUAL_KINDS


@strict(accept_kwargs=True)
class AttnResConfig(PreTrainedConfig):
    r"""Configuration of [`AttnResForCausalLM`].

    Every field Llama has keeps its transformers Llama name and meaning: `vocab_size`, `hidden_size`,
    `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (None: as many as
    attention heads, i.e. no grouping), `hidden_act`, `max_position_embeddings`, `initializer_range`,
    `rms_norm_eps` (every RMSNorm: the PreNorms, the final norm, the AttnRes key norms and the q/k norms),
    `rope_theta` (plain rotary positions, no scaling), `tie_word_embeddings`, `head_dim` (None: `hidden_size //
    num_attention_heads`), `attention_bias` (biases on q, k, v and o), `mlp_bias`, `use_cache`.

    Fields for the Llama family that `attnres.convert_from_hf` turns into AttnRes models:
        attention_output_bias (`bool` or None, defaults to None):
            Bias on `o_proj`; None follows `attention_bias`. Qwen2 has q, k and v biases but none on `o_proj`.
        qk_norm (`bool`, defaults to False):
            Qwen3's per-head RMSNorm of queries and keys (`self_attn.q_norm`, `self_attn.k_norm`, size `head_dim`),
            applied before the rotary embedding.
        sliding_window (`int` or None, defaults to None):
            Every layer attends to the last `sliding_window` positions only (itself included), as Mistral does.

    AttnRes fields:
        residual (`str`, defaults to `"block"`):
            `"standard"` (the PreNorm baseline, no AttnRes parameters at all), `"full"` (every aggregation point
            attends over the embedding and every earlier sublayer output) or `"block"` (Block AttnRes with Kimi K3
            timing).
        attn_res_block_size (`int`, defaults to 2):
            Block size **in decoder layers** (each holds two sublayers), as Kimi K3's `attn_res_block_size`; the
            paper and some peers count sublayers instead. Used only by `residual="block"`; 1 makes each decoder layer a
            block (a bank row sums its two sublayer outputs; Full AttnRes is `residual="full"`), a value >=
            `num_hidden_layers` leaves a single block.
        attn_res_rescale_mixture (`bool`, defaults to False):
            Multiply each mixture by its number of sources before the sublayer PreNorm. With every pseudo-query zero
            the model then computes exactly the function of the standard model with the same other weights (DESIGN
            section 3). Off is the Kimi K3 form.
        attn_res_two_phase (`bool` or None, defaults to None):
            Block AttnRes only: score a block's completed summaries once for all its aggregation points (DESIGN
            section 5). None chooses it whenever it saves reads.
    """

    model_type = "attnres"
    keys_to_ignore_at_inference = ["cache", "depth_weights", "depth_mixtures", "captured_hidden_states"]

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    residual: str = "block"
    attn_res_block_size: int = 2
    attn_res_rescale_mixture: bool = False
    attn_res_two_phase: bool | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        self._check()
        super().__post_init__(**kwargs)

    def _check(self) -> None:
        """Refuse, at construction, every setting the model could not run with; each message names the setting."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.residual not in RESIDUAL_KINDS:
            raise ValueError(f"residual: expected one of {RESIDUAL_KINDS}, got {self.residual!r}")
        if self.residual == "block" and self.attn_res_block_size < 1:
            raise ValueError(
                f"attn_res_block_size: expected a positive number of decoder layers per block, got "
                f"{self.attn_res_block_size}"
            )
        head_dim_name = "head_dim: the head size"
        if self.head_dim is None:  # the Llama default, resolved here so that config.json records it
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}, so the heads cannot split it evenly (or set head_dim)"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
            head_dim_name = "hidden_size: the head size hidden_size / num_attention_heads"
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_attention_heads} is not divisible by num_key_value_heads="
                f"{self.num_key_value_heads}, so query heads cannot share key/value heads in equal groups"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"{head_dim_name} = {self.head_dim} must be even (and positive) for rotary positions")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act: expected an activation transformers knows (ACT2FN), got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: expected None or a positive number of positions, got {self.sliding_window}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: expected a positive number, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: expected a positive number, got {self.rope_theta}")
