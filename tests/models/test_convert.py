"""Conversion of transformers Llama, Mistral, Qwen2 and Qwen3 causal LMs (tiny random configs, no downloads) into
AttnRes models that reproduce them (DESIGN section 3: zero queries with the mixture rescale), then train."""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import attnres
from attnres.models import AttnResForCausalLM

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
)
# each architecture with the features its conversion has to carry
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=5, head_dim=16)),  # window < prompt length
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, attention_bias=True)),
}
RESIDUALS = [("block", 1), ("block", 2), ("block", 3), ("full", None), ("standard", None)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def hf_model(arch: str, **overrides):
    """A tiny random transformers model whose norm gains and biases are off their init (ones, zeros), so a weight
    that does not reach its place shows up."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval()
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


@pytest.mark.parametrize("residual, block_size", RESIDUALS, ids=lambda v: str(v))
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_logits_equal_the_original(arch, residual, block_size):
    source = hf_model(arch)
    model = attnres.convert_from_hf(source, residual=residual, attn_res_block_size=block_size)
    assert type(model) is AttnResForCausalLM and model.config.attn_res_rescale_mixture
    ids, mask = padded_prompts()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()  # padding positions are garbage in both models
    for grad in (True, False):  # the training path, and (Block) the fused bank path
        with torch.set_grad_enabled(grad):
            logits = model(ids, attention_mask=mask, position_ids=positions).logits.detach()
        assert rel_err(logits[real], expected[real]) < 1e-5, grad


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_greedy_generation_is_the_same_tokens(arch):
    source = hf_model(arch)
    model = attnres.convert_from_hf(source, attn_res_block_size=2)
    ids, mask = padded_prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = source.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert len(expected[:, 12:].unique()) > 3


def test_converted_model_keeps_the_architecture_features():
    config = attnres.convert_from_hf(hf_model("qwen2")).config
    assert (config.attention_bias, config.attention_output_bias, config.qk_norm, config.rope_theta) == (
        True,
        False,
        False,
        500.0,
    )
    qwen3 = attnres.convert_from_hf(hf_model("qwen3"))
    assert qwen3.config.head_dim == 16 and qwen3.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    llama = attnres.convert_from_hf(hf_model("llama"), residual="full")
    assert llama.lm_head.weight is llama.model.embed_tokens.weight  # tied, like the original
    assert llama.model.layers[0].mlp.up_proj.bias is not None
    assert attnres.convert_from_hf(hf_model("mistral")).config.sliding_window == 5
    assert attnres.convert_from_hf(hf_model("mistral", sliding_window=64)).config.sliding_window is None  # >= context
    # the default block size is about 8 blocks; any config field can be overridden
    eight = attnres.convert_from_hf(hf_model("llama", num_hidden_layers=16), attn_res_rescale_mixture=False)
    assert eight.config.attn_res_block_size == 2 and not eight.config.attn_res_rescale_mixture


def test_conversion_copies_the_weights():
    source = hf_model("llama")
    model = attnres.convert_from_hf(source)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.zero_()
    assert source.model.layers[0].self_attn.q_proj.weight.count_nonzero() > 0


def test_converted_model_fine_tunes_and_its_queries_move():
    source = hf_model("qwen3")
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


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'linear'"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), r"sliding_window: layers \[2, 3\]"),
        ("mistral", dict(attention_dropout=0.1), "attention_dropout: AttnRes models have no attention dropout"),
    ],
)
def test_unsupported_features_are_refused(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        attnres.convert_from_hf(hf_model(arch, **overrides))


def test_other_architectures_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    with pytest.raises(ValueError, match=r"model: expected a transformers causal LM of model_type \('llama'"):
        attnres.convert_from_hf(gpt2)
    with pytest.raises(TypeError, match="model: expected a transformers"):
        attnres.convert_from_hf(torch.nn.Linear(2, 2))
    # a window over some layers only cannot be mapped, unless it is too long to cut anything
    qwen = hf_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert attnres.convert_from_hf(qwen).config.sliding_window is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(head_dim=7), "head_dim: the head size = 7 must be even"),
        (dict(sliding_window=0), "sliding_window: expected None or a positive number of positions, got 0"),
        (dict(hidden_act="swish2"), "hidden_act: expected an activation transformers knows"),
    ],
)
def test_the_family_features_of_the_config_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        attnres.AttnResConfig(hidden_size=32, num_attention_heads=4, **overrides)


def test_an_explicit_head_dim_need_not_divide_the_hidden_size():
    config = attnres.AttnResConfig(vocab_size=64, hidden_size=30, num_attention_heads=4, head_dim=16, attention_bias=True)
    assert config.head_dim == 16 and config.attention_output_bias  # the o bias follows attention_bias by default
    model = AttnResForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 30)
    assert model(torch.zeros(1, 3, dtype=torch.long)).logits.shape == (1, 3, 64)
