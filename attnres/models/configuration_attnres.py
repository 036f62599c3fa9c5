"""AttnResConfig: a decoder family's own configuration plus the residual kind (docs/design.md sections 3, 6 and 9)."""

from __future__ import annotations

from dataclasses import fields

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

try:  # transformers >= 5.20 describes sub-configs with specs; 5.17-5.19 one config class per key
    from transformers.configuration_utils import SubConfigSpec
except ImportError:
    SubConfigSpec = None

from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE, RESIDUAL_KINDS

# The from-scratch default: a small Llama (what `attnres train` builds); any field can be overridden.
LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    bos_token_id=None,  # a model trained from scratch has no special tokens unless given
    eos_token_id=None,
    pad_token_id=None,
)
# The AttnRes settings of a model that starts from a PreNorm one (conversion, or `from_pretrained` of a family's
# folder): with its zero pseudo-queries, the rescaled mixture is the residual sum, so it computes the same function.
PRENORM_START = {"attn_res_rescale_mixture": True}
# keys that belong to the composite config itself, never to the family's: its fields, and the settings transformers
# passes every config as keywords (`from_pretrained(..., attn_implementation="eager")`), which it hands on to the
# family's config itself
_OWN_KEYS = {f.name for f in fields(PreTrainedConfig)} | {
    "model_type", "torch_dtype", "num_labels", "attn_implementation", "experts_implementation", "output_attentions",
    "name_or_path",
}


@strict(accept_kwargs=True)
class AttnResConfig(PreTrainedConfig):
    r"""Configuration of [`AttnResForCausalLM`]: the base family's configuration (`text_config`) and the AttnRes fields.

    The decoder is a transformers family's own (its attention with every rope type and attention backend, its MLP or
    MoE block, its norms, masks and caches); AttnRes changes only the residual path. Name the family with
    `base_model_type` (default `"llama"`) and pass its config fields flat, or pass `text_config` (a family config or
    its dict):

        AttnResConfig(hidden_size=256, num_hidden_layers=8, residual="block", attn_res_block_size=2)   # a small Llama
        AttnResConfig(base_model_type="qwen3_moe", num_experts=8, hidden_size=128, ...)
        AttnResConfig(text_config=LlamaConfig(...), residual="full")

    Any family field reads through this config (`config.hidden_size` is `config.text_config.hidden_size`). A family
    qualifies when its decoder layer is PreNorm with two sublayers added to one residual; others are refused when the
    model is built (`attnres.models.family`).

    AttnRes fields:
        residual (`str`, defaults to `"block"`):
            `"standard"` (the family's own PreNorm residual, no AttnRes parameters at all), `"full"` (every aggregation
            point attends over the embedding and every earlier sublayer output) or `"block"` (Block AttnRes with Kimi
            K3 timing).
        attn_res_block_size (`int`, defaults to `attnres.layers.DEFAULT_BLOCK_SIZE`, 2):
            Block size **in decoder layers** (each holds two sublayers), as Kimi K3's `attn_res_block_size`; the
            paper and some peers count sublayers instead. Used only by `residual="block"`; 1 makes each decoder layer
            a block (a bank row sums its two sublayer outputs; Full AttnRes is `residual="full"`), a value >=
            `num_hidden_layers` leaves a single block.
        attn_res_rescale_mixture (`bool`, defaults to False):
            Multiply each mixture by its number of sources before the sublayer PreNorm. With every pseudo-query zero
            the model then computes exactly the function of the standard model with the same other weights
            (docs/design.md section 2). Off is the Kimi K3 form. On by default for a model started from a PreNorm
            family's own config (`from_pretrained` of its folder), as conversion does.
        attn_res_two_phase (`bool` or None, defaults to None):
            Block AttnRes only: score a block's completed summaries once for all its aggregation points (docs/design.md
            section 4). None chooses it whenever it saves reads.
        attn_res_full_group (`int` or None, defaults to None):
            Full AttnRes only, in eager training: how many aggregation points phase 1 scores together (docs/design.md
            section 4); 0 runs every point over all its sources, as a chain. None chooses 8 where the backend has
            compiled kernels for both phases' backward (the CPU's), and 0 elsewhere or under activation
            checkpointing (a group keeps each point's `[tokens, d]` fp32 statistics). Never under FSDP2 or in a
            pipeline stage, where a layer reads only its own points' weights.
        attn_res_layer_plan (`list` or None, defaults to None):
            What each decoder layer's two sublayers are in the family's own layer (PreNorm child, body, modules after
            the body, residual scale; `attnres.models.family.Sublayer`). Read and checked once, in float64, when a
            model is first built from this config or converted, then kept here, so that loading a saved model never
            runs a probe and never depends on its weights. Not meant to be written by hand.

    Layer 0's attention-side aggregation point has a single source (the embedding): its weight is exactly 1, so its
    two parameters (`model.layers.0.self_attention_res_{proj,norm}.weight`) never receive a gradient. That is the
    paper's schedule and the Kimi K3 checkpoint layout, kept as is.
    """

    model_type = "attnres"
    if SubConfigSpec is None:
        sub_configs = {"text_config": AutoConfig}
    else:
        sub_configs_defaults = {
            "text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama", init_kwargs=LLAMA_DEFAULTS)
        }
    keys_to_ignore_at_inference = ["cache", "depth_weights", "depth_mixtures", "captured_hidden_states"]

    text_config: dict | PreTrainedConfig | None = None
    base_model_type: str | None = None
    residual: str = "block"
    attn_res_block_size: int = DEFAULT_BLOCK_SIZE
    attn_res_rescale_mixture: bool = False
    attn_res_two_phase: bool | None = None
    attn_res_full_group: int | None = None
    attn_res_layer_plan: list | None = None

    def __post_init__(self, **kwargs):
        # flat family fields (`hidden_size=...`) build the family's config
        family = {k: kwargs.pop(k) for k in list(kwargs) if k not in _OWN_KEYS and not k.startswith("_")}
        if isinstance(self.text_config, PreTrainedConfig):
            if family:
                raise ValueError(f"text_config: pass the family's fields inside it, not beside it (got {sorted(family)})")
        else:
            saved_type = kwargs.get("model_type")  # a family's own config.json loaded as an AttnRes config
            family_type = saved_type if saved_type != self.model_type else None
            if family_type is not None:
                self.__dict__.update(PRENORM_START)
            base = self.base_model_type or (self.text_config or {}).get("model_type") or family_type or "llama"
            if base not in CONFIG_MAPPING:
                raise ValueError(
                    f"base_model_type: expected a transformers decoder family's model_type such as 'llama', 'qwen3' or "
                    f"'qwen3_moe', got {base!r}"
                )
            defaults = LLAMA_DEFAULTS if base == "llama" else {}
            self.text_config = {**defaults, **(self.text_config or {}), **family, "model_type": base}
        try:  # builds the family's config, which validates its own fields; reads nothing through `__getattr__` yet
            if isinstance(self.text_config, dict):  # built here: transformers 5.17 leaves a sub-config's dict as is
                self.text_config = CONFIG_MAPPING[self.text_config["model_type"]](**self.text_config)
            super().__post_init__(**kwargs)
        except StrictDataclassClassValidationError as error:  # a ValueError with the family's own message
            raise ValueError(f"{base_name(self.text_config)}: {error.__cause__ or error}") from error
        self.base_model_type = self.text_config.model_type
        self.__dict__["_reads_through"] = True
        self._check()

    def __getattr__(self, name: str):
        """Family fields read through: `config.hidden_size` is `config.text_config.hidden_size`."""
        text_config = self.__dict__.get("text_config")
        if name.startswith("__") or not self.__dict__.get("_reads_through"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(text_config, name)

    def __setattr__(self, name: str, value) -> None:
        """Family fields write through too: `config.eos_token_id = 0` sets the family config's."""
        text_config = self.__dict__.get("text_config")
        through = not name.startswith("_")  # private settings (attention backend, ...) propagate themselves
        if through and self.__dict__.get("_reads_through") and name not in _OWN_FIELDS and hasattr(text_config, name):
            setattr(text_config, name, value)
        else:
            super().__setattr__(name, value)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("_reads_through", None)
        return out

    def _check(self) -> None:
        """Refuse, at construction, every AttnRes setting the model could not run with; each message names it."""
        if self.residual not in RESIDUAL_KINDS:
            raise ValueError(f"residual: expected one of {RESIDUAL_KINDS}, got {self.residual!r}")
        size = self.attn_res_block_size
        bad_size = isinstance(size, bool) or not isinstance(size, int) or size < 1
        if self.residual == BLOCK and bad_size:
            raise ValueError(f"attn_res_block_size: expected a positive number of decoder layers per block, got {size!r}")
        for name in ("hidden_size", "num_hidden_layers"):
            value = getattr(self.text_config, name, None)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer in the {self.base_model_type} config, got {value!r}")
        group = self.attn_res_full_group
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
            raise ValueError(f"attn_res_full_group: expected a number of points >= 0 or None (chosen), got {group!r}")
        plan = self.attn_res_layer_plan
        if plan is not None and (not isinstance(plan, list) or len(plan) != 2):
            raise ValueError(f"attn_res_layer_plan: expected the two sides of a decoder layer (a list of 2), got {plan!r}")
        _check_attention_fields(self.text_config)


def _check_attention_fields(config) -> None:
    """Settings of the usual family fields that would otherwise fail deep inside a forward (each checked where the
    family has the field)."""
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(heads, int) and head_dim is None and config.hidden_size % heads:
        raise ValueError(
            f"hidden_size: {config.hidden_size} is not divisible by num_attention_heads={heads}, so the heads cannot "
            f"split it evenly (or set head_dim)"
        )
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ValueError(
            f"num_attention_heads: {heads} is not divisible by num_key_value_heads={kv_heads}, so query heads cannot "
            f"share key/value heads in equal groups"
        )
    rope = getattr(config, "rope_parameters", None)
    if isinstance(heads, int) and isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) == 1.0:
        size = head_dim or config.hidden_size // heads
        if isinstance(size, int) and size % 2:
            raise ValueError(f"head_dim: the head size = {size} must be even for rotary positions")
    eps = getattr(config, "rms_norm_eps", None)
    if eps is not None and not eps > 0:
        raise ValueError(f"rms_norm_eps: expected a positive number, got {eps}")
    act = getattr(config, "hidden_act", None)
    from transformers.activations import ACT2FN  # here: it imports transformers' kernel hub (a second)

    if isinstance(act, str) and act not in ACT2FN:
        raise ValueError(f"hidden_act: expected an activation transformers knows (ACT2FN), got {act!r}")


# the fields AttnResConfig adds to PreTrainedConfig's, and every field of its own (never the family's)
ATTNRES_FIELDS = {f.name for f in fields(AttnResConfig)} - {f.name for f in fields(PreTrainedConfig)}
_OWN_FIELDS = {f.name for f in fields(AttnResConfig)} | {"model_type"}


def base_name(text_config) -> str:
    return f"text_config ({text_config.get('model_type') if isinstance(text_config, dict) else text_config.model_type})"
