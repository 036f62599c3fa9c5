"""`attnres.convert_from_hf`: what conversion itself keeps and sets (docs/design.md sections 2 and 6).

Whether each family converts to the original's function (logits, generation, save/load, bf16, nonzero queries) is
`test_families.py`; the `attnres convert` command is `tests/inference/test_commands.py`. Here: block sizes and the
standard residual, dtype, device and train mode, copied weights, the AttnRes parameters' init, the config, backends,
features older versions refused (partial sliding windows, attention dropout), fine-tuning, and the argument errors.
"""

import math

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import attnres
from attnres.models import AttnResForCausalLM
from tests.models import TINY

COMMON = {**TINY, "num_hidden_layers": 4, "initializer_range": 0.2}
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
ATTNRES_SUFFIXES = ("_res_proj.weight", "_res_norm.weight")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_model(arch: str = "llama", **overrides):
    """A tiny random transformers model whose norm gains and biases are off their init (ones, zeros), so a weight
    that does not reach its place shows up."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def padded_prompts():
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    return ids, mask


@pytest.mark.parametrize(
    "residual, block_size",
    [("block", 1), ("block", 3), ("block", 7), ("standard", None)],  # Block 2 and Full: test_families.py
    ids=["block1", "block3", "block7-one-block", "standard"],
)
def test_converted_logits_equal_the_original_at_any_block_size(residual, block_size):
    source = hf_model("llama", attention_bias=True)
    model = attnres.convert_from_hf(source, residual=residual, attn_res_block_size=block_size)
    ids, mask = padded_prompts()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()  # padding positions are garbage in both models
    for grad in (True, False):  # the training path, and (Block) the fused bank path
        with torch.set_grad_enabled(grad):
            logits = model(ids, attention_mask=mask, position_ids=positions).logits.detach()
        if residual == "standard":  # the family's own computation, operation for operation
            assert torch.equal(logits[real], expected[real]), grad
        else:
            assert rel_err(logits[real], expected[real]) < 1e-5, grad


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_conversion_keeps_dtype_device_and_train_mode(train):
    source = hf_model("llama").double().train(train)
    model = attnres.convert_from_hf(source, residual="block", attn_res_block_size=2)
    assert type(model) is AttnResForCausalLM
    assert model.training == train and all(m.training == train for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.float64} and model.dtype == torch.float64
    assert {p.device for p in model.parameters()} == {source.device}
    assert model.model.rotary_emb.inv_freq.dtype == source.model.rotary_emb.inv_freq.dtype
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():  # the depth mixtures reduce in fp32 (docs/design.md section 2), hence fp32 rounding
        assert rel_err(model.eval()(ids).logits, source.eval()(ids).logits) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_model_converts(dtype):
    """Pretrained checkpoints are usually bf16 (`attnres convert` loads them with dtype="auto"): the converted model
    keeps the dtype and is as close to the fp32 original as the half-precision original is."""
    exact = hf_model("llama")
    source = hf_model("llama").to(dtype)
    model = attnres.convert_from_hf(source, residual="block", attn_res_block_size=2)
    assert {p.dtype for p in model.parameters()} == {dtype}
    ids = torch.randint(0, 64, (8, 9))
    with torch.no_grad():
        expected = exact(ids).logits
        own = rel_err(source(ids).logits, expected)
        assert rel_err(model(ids).logits, expected) <= 2 * own + 1e-3


def test_conversion_copies_the_weights():
    source = hf_model("llama")
    model = attnres.convert_from_hf(source)
    theirs = {t.untyped_storage().data_ptr() for t in [*source.parameters(), *source.buffers()]}
    assert not any(t.untyped_storage().data_ptr() in theirs for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.zero_()
    assert source.model.layers[0].self_attn.q_proj.weight.count_nonzero() > 0


@pytest.mark.parametrize("residual", ["block", "full", "standard"])
def test_the_attnres_parameters_start_at_their_init(residual):
    model = attnres.convert_from_hf(hf_model("llama"), residual=residual, attn_res_block_size=2)
    ours = {name: p for name, p in model.named_parameters() if name.endswith(ATTNRES_SUFFIXES)}
    if residual == "standard":
        assert not ours
        return
    points = [f"model.layers.{i}.{side}" for i in range(4) for side in ("self_attention_res", "mlp_res")]
    points.append("model.output_attn_res")  # Kimi K3 names
    assert set(ours) == {f"{point}{suffix}" for point in points for suffix in ("_proj.weight", "_norm.weight")}
    for name, p in ours.items():
        assert p.shape[-1] == 32 and p.requires_grad
        assert torch.equal(p, torch.zeros_like(p) if name.endswith("_proj.weight") else torch.ones_like(p)), name


def test_the_config_is_the_familys_own_plus_attnres_fields():
    source = hf_model("qwen3", head_dim=16, attention_bias=True, num_hidden_layers=16)
    model = attnres.convert_from_hf(source)
    config = model.config
    assert config.text_config is not source.config and type(config.text_config) is type(source.config)
    assert config.text_config.to_dict() == source.config.to_dict()
    assert (config.head_dim, config.attention_bias, config.base_model_type) == (16, True, "qwen3")
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    # about 8 blocks by default (block size in decoder layers); the rescale makes zero queries the original function
    assert config.residual == "block" and config.attn_res_block_size == math.ceil(16 / 8)
    assert config.attn_res_rescale_mixture
    # overrides: AttnRes fields, and family fields set on the copy of the family config only
    other = attnres.convert_from_hf(
        source, residual="full", attn_res_rescale_mixture=False, max_position_embeddings=128
    )
    assert other.config.residual == "full" and not other.config.attn_res_rescale_mixture
    assert other.config.text_config.max_position_embeddings == 128 and source.config.max_position_embeddings == 64


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_embeddings_stay_tied(tied):
    model = attnres.convert_from_hf(hf_model("llama", tie_word_embeddings=tied), residual="full")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_conversion_keeps_the_attention_and_experts_backends():
    eager = attnres.convert_from_hf(hf_model("llama", attn_implementation="eager"))
    assert eager.config.text_config._attn_implementation == "eager"
    assert eager.model.layers[0].self_attn.config._attn_implementation == "eager"
    source = hf_model("mixtral", num_local_experts=4, num_experts_per_tok=2)
    moe = attnres.convert_from_hf(source)
    kind = source.config._experts_implementation
    assert moe.config.text_config._experts_implementation == kind
    assert moe.model.layers[0].mlp.experts.config._experts_implementation == kind


def test_a_sliding_window_on_some_layers_only_converts():
    """Qwen2 with `max_window_layers`: the upper layers slide (older versions refused that)."""
    source = hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert source.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = attnres.convert_from_hf(source, attn_res_block_size=2)
    assert model.config.layer_types == source.config.layer_types and model.config.sliding_window == 4
    ids = torch.randint(0, 64, (2, 12))  # longer than the window
    with torch.no_grad():
        expected = source(ids).logits
        assert rel_err(model(ids).logits, expected) < 1e-5
        windowless = hf_model("qwen2")  # the same weights (same seed) without the window
        assert rel_err(windowless(ids).logits, expected) > 1e-2  # so the window mattered
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), source.generate(ids, **kwargs))


def test_attention_dropout_converts_and_draws_the_same_masks():
    """Attention dropout (older versions refused it) is the family's own: in train mode, from the same seed, the
    converted model drops what the original drops."""
    source = hf_model("mistral", attention_dropout=0.3)
    model = attnres.convert_from_hf(source, attn_res_block_size=2)
    assert model.config.attention_dropout == 0.3
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert rel_err(model(ids).logits, source(ids).logits) < 1e-5
        source.train(), model.train()
        torch.manual_seed(1)
        expected = source(ids).logits
        torch.manual_seed(1)
        assert rel_err(model(ids).logits, expected) < 1e-5
        torch.manual_seed(2)
        assert rel_err(model(ids).logits, expected) > 1e-2  # dropout is on


def test_converted_model_fine_tunes_and_its_queries_move():
    source = hf_model("qwen3", head_dim=16)
    model = attnres.convert_from_hf(source, attn_res_block_size=2).train()
    queries = [p for name, p in model.named_parameters() if name.endswith("_res_proj.weight")]
    assert len(queries) == 2 * 4 + 1 and all(q.count_nonzero() == 0 for q in queries)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    moved = [q for q in queries[1:] if q.abs().max() > 1e-3]  # layer 0's attention side has one source: no gradient
    assert len(moved) == len(queries) - 1
    assert source.model.layers[0].self_attn.q_proj.weight.grad is None  # the original is untouched


def test_what_is_not_a_decoder_causal_lm_is_refused():
    with pytest.raises(TypeError, match="model: expected a transformers"):
        attnres.convert_from_hf(torch.nn.Linear(2, 2))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    with pytest.raises(ValueError, match=r"the 'gpt2' model keeps no decoder `layers` list"):
        attnres.convert_from_hf(gpt2)
    with pytest.raises(TypeError, match=r"model: expected a transformers \*ForCausalLM decoder model, got LlamaModel"):
        attnres.convert_from_hf(LlamaModel(LlamaConfig(**COMMON)))  # a base model without its head


@pytest.mark.parametrize("block_size", [0, -2])
def test_a_block_size_below_one_is_refused_not_replaced_by_the_default(block_size):
    with pytest.raises(ValueError, match=f"attn_res_block_size: expected a positive number of decoder layers per block, "
                                         f"got {block_size}"):
        attnres.convert_from_hf(hf_model(), "block", attn_res_block_size=block_size)


def test_an_attnres_model_is_refused_as_a_source():
    converted = attnres.convert_from_hf(hf_model(), "block", attn_res_block_size=2)
    with pytest.raises(ValueError, match="model: it is already an AttnRes model \\(residual='block'\\)"):
        attnres.convert_from_hf(converted, "full")
