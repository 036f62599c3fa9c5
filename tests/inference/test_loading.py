"""Loading checkpoints: Kimi K3 names load; missing, extra or mis-shaped AttnRes weights and a block size other
than the checkpoint's bank layout are errors that name the tensors or the setting."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from attnres.layers import DEFAULT_BLOCK_SIZE
from attnres.models import AttnResConfig, AttnResForCausalLM, convert_from_hf
from attnres.models.configuration_attnres import ATTNRES_FIELDS

D, LAYERS = 32, 3


def config(**overrides) -> AttnResConfig:
    fields = dict(vocab_size=64, hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4)
    return AttnResConfig(**{**fields, "residual": "block", "attn_res_block_size": 2, **overrides})


def k3_tensors() -> dict[str, torch.Tensor]:
    """A checkpoint written by hand under the Llama and Kimi K3 names (docs/design.md section 9), random values."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, mean=0.0):
        return torch.randn(*shape, generator=g) * 0.3 + mean

    tensors = {"model.embed_tokens.weight": rand(64, D), "model.norm.weight": rand(D, mean=1), "lm_head.weight": rand(64, D)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            tensors[f"{prefix}self_attn.{proj}_proj.weight"] = rand(D, D)
        tensors[f"{prefix}mlp.gate_proj.weight"] = rand(64, D)
        tensors[f"{prefix}mlp.up_proj.weight"] = rand(64, D)
        tensors[f"{prefix}mlp.down_proj.weight"] = rand(D, 64)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = rand(D, mean=1)
        for side in ("self_attention", "mlp"):
            tensors[f"{prefix}{side}_res_proj.weight"] = rand(1, D)
            tensors[f"{prefix}{side}_res_norm.weight"] = rand(D, mean=1)
    tensors["model.output_attn_res_proj.weight"] = rand(1, D)
    tensors["model.output_attn_res_norm.weight"] = rand(D, mean=1)
    return tensors


def write_checkpoint(folder, tensors, **overrides):
    config(**overrides).save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_checkpoint_with_kimi_k3_names_loads(tmp_path):
    tensors = k3_tensors()
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, tensors)).eval()
    assert type(model) is AttnResForCausalLM
    state = model.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    reference = AttnResForCausalLM(config()).eval()
    reference.load_state_dict(tensors)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp_res_norm.weight"), r"missing \['model.layers.1.mlp_res_norm.weight'\]"),
        (
            lambda t: t.update({"model.layers.3.mlp_res_proj.weight": torch.zeros(1, D)}),
            r"unexpected \['model.layers.3.mlp_res_proj.weight'\]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attention_res_proj.weight": torch.zeros(D)}),
            r"mis-shaped \['model.layers.0.self_attention_res_proj.weight \(checkpoint \[32\], model \[1, 32\]\)'\]",
        ),
    ],
    ids=["missing", "extra", "mis-shaped"],
)
def test_bad_attnres_weights_are_named(tmp_path, edit, message):
    tensors = k3_tensors()
    edit(tensors)
    with pytest.raises(ValueError, match="checkpoint: .* does not match the model: " + message):
        AttnResForCausalLM.from_pretrained(write_checkpoint(tmp_path, tensors))


def test_other_mis_shaped_weights_are_named_unless_ignored(tmp_path):
    tensors = k3_tensors()
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(63, D)
    folder = write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"mis-shaped \['model.layers.2.mlp.up_proj.weight \(checkpoint \[63, 32\]"):
        AttnResForCausalLM.from_pretrained(folder)
    model, info = AttnResForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True, output_loading_info=True)
    assert [key for key, *_ in info["mismatched_keys"]] == ["model.layers.2.mlp.up_proj.weight"]


def test_an_attnres_config_without_attnres_weights_is_refused(tmp_path):
    tensors = {k: v for k, v in k3_tensors().items() if "_res_" not in k}
    with pytest.raises(ValueError, match=r"missing \[.*'model.output_attn_res_norm.weight'"):
        AttnResForCausalLM.from_pretrained(write_checkpoint(tmp_path, tensors))
    # the same weights under a PreNorm config start an AttnRes model (its AttnRes weights at their init)
    folder = write_checkpoint(tmp_path, tensors, residual="standard")
    model = AttnResForCausalLM.from_pretrained(folder, residual="block", attn_res_block_size=2)
    assert model.model.output_attn_res_proj.weight.count_nonzero() == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attn_res_block_size=1), "attn_res_block_size: the checkpoint .* bank layout of 2 decoder layers per block"),
        (dict(residual="full"), "residual: the checkpoint .* was trained with residual='block'"),
        (dict(residual="standard"), "residual: the checkpoint .* was trained with residual='block'"),
    ],
    ids=["block-size", "full", "standard"],
)
def test_a_block_size_other_than_the_checkpoints_bank_layout_is_refused(tmp_path, overrides, message):
    folder = write_checkpoint(tmp_path, k3_tensors())
    for loader in (AttnResForCausalLM, AutoModelForCausalLM):
        with pytest.raises(ValueError, match=message):
            loader.from_pretrained(folder, **overrides)
    with pytest.raises(ValueError, match=message):
        AttnResForCausalLM.from_pretrained(folder, config=config(**overrides))
    assert AttnResForCausalLM.from_pretrained(folder, attn_res_block_size=2).config.attn_res_block_size == 2


def test_from_pretrained_takes_the_attention_backend_asked_for(tmp_path):
    """`attn_implementation="eager"` reaches the family's attention (it was taken for a family field and lost), so
    `output_attentions=True` gives every layer's attention probabilities."""
    torch.manual_seed(0)
    AttnResForCausalLM(config()).save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert eager.config._attn_implementation == eager.config.text_config._attn_implementation == "eager"
    assert eager.model.layers[0].self_attn.config._attn_implementation == "eager"
    default = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert default.config._attn_implementation == "sdpa"
    with torch.no_grad():
        out = eager(ids, output_attentions=True)
        torch.testing.assert_close(out.logits, default(ids).logits)
    assert len(out.attentions) == LAYERS and out.attentions[0].shape == (1, 4, 5, 5)


def test_a_family_folder_loads_as_the_converted_model(tmp_path):
    """`from_pretrained` of a PreNorm family's folder starts the same AttnRes model as `convert_from_hf`: the same
    config (block size, mixture rescale), weights and logits, and the family's logits to fp32 rounding."""
    torch.manual_seed(0)
    family = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=D, intermediate_size=64, num_hidden_layers=LAYERS,
                                          num_attention_heads=4, initializer_range=0.2)).eval()
    family.save_pretrained(tmp_path)
    loaded = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    converted = convert_from_hf(LlamaForCausalLM.from_pretrained(tmp_path).eval())
    for name in ATTNRES_FIELDS - {"text_config"}:  # the family's config: the weights and logits below
        assert getattr(loaded.config, name) == getattr(converted.config, name), name
    assert loaded.config.attn_res_block_size == DEFAULT_BLOCK_SIZE and loaded.config.attn_res_rescale_mixture
    assert loaded.state_dict().keys() == converted.state_dict().keys()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.equal(logits, converted(ids).logits)
        expected = family(ids).logits
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-5
    # an explicit setting still wins over the PreNorm start
    assert not AttnResForCausalLM.from_pretrained(tmp_path, attn_res_rescale_mixture=False).config.attn_res_rescale_mixture


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_a_missing_family_weight_is_named(tmp_path, key):
    """A family weight absent from the checkpoint would start at a random init (transformers only reports it)."""
    tensors = k3_tensors()
    tensors.pop(key)
    with pytest.raises(ValueError, match=rf"checkpoint: .* does not match the model: missing \['{re.escape(key)}'\]"):
        AttnResForCausalLM.from_pretrained(write_checkpoint(tmp_path, tensors))
