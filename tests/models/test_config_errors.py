"""Settings the model cannot run with fail at once, with a message naming the setting and why."""

import pytest
import torch

from attnres.models import AttnResConfig, AttnResForCausalLM


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attn_res_block_size=0), "attn_res_block_size: expected a positive number of decoder layers"),
        (dict(attn_res_block_size=-2), "attn_res_block_size"),
        (dict(hidden_size=30, num_attention_heads=4), r"hidden size \(30\) is not a multiple of the number of attention heads \(4\)"),
        (dict(num_key_value_heads=3), "num_attention_heads: 4 is not divisible by num_key_value_heads=3"),
        (dict(residual="dense"), r"residual: expected one of \('standard', 'full', 'block'\), got 'dense'"),
        (dict(hidden_size=12, num_attention_heads=4), "head_dim: the head size = 3 must be even"),
        (dict(num_hidden_layers=0), "num_hidden_layers: expected a positive integer"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps: expected a positive number"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_setting(overrides, message):
    with pytest.raises(ValueError, match=message):
        AttnResConfig(**{"hidden_size": 32, "num_attention_heads": 4, **overrides})


def test_an_unknown_family_is_named():
    with pytest.raises(ValueError, match="base_model_type: expected a transformers decoder family's model_type .* 'nope'"):
        AttnResConfig(base_model_type="nope")


def test_block_size_is_only_checked_where_it_is_used():
    assert AttnResConfig(residual="full", attn_res_block_size=0).residual == "full"


def test_defaults_are_a_valid_block_model():
    config = AttnResConfig()
    assert config.residual == "block" and config.num_key_value_heads == config.num_attention_heads


@pytest.fixture
def model(tiny_config):
    return AttnResForCausalLM(tiny_config(max_position_embeddings=8))


def test_input_longer_than_max_position_embeddings_runs_as_in_the_family(model):
    """Llama itself runs past max_position_embeddings (rotary positions extrapolate; dynamic rope scales there)."""
    assert model(torch.zeros(1, 9, dtype=torch.long)).logits.shape == (1, 9, 64)


def test_attention_mask_of_the_wrong_shape(model):
    """A [batch, seq] padding mask must cover every token (4D masks are the family's business, as in transformers)."""
    with pytest.raises(ValueError, match=r"attention_mask: expected a \[batch, seq\] = \[2, 4\] padding mask"):
        model(torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3))


def test_input_ids_and_inputs_embeds_together(model):
    with pytest.raises(ValueError, match="input_ids, inputs_embeds: pass exactly one"):
        model(torch.zeros(1, 4, dtype=torch.long), inputs_embeds=torch.zeros(1, 4, 32))


@pytest.mark.parametrize("shape", [(1, 0), (0, 4), (4,)], ids=["no-tokens", "no-rows", "one-dim"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
def test_empty_or_flat_input_ids_are_named(model, shape, grad):
    """Not a reshape error from inside the family."""
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=rf"input_ids: expected .*got shape \[{shape[0]}"):
        model(torch.zeros(shape, dtype=torch.long))
    if len(shape) == 2:
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"inputs_embeds: expected .*got shape"):
            model(inputs_embeds=torch.zeros(*shape, 32))
