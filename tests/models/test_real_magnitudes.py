"""Real checkpoints: bf16 weights and "massive activations" (a few residual channels in the hundreds to thousands).

The plan of a decoder layer is read and checked once, in float64, at conversion (or when a model is first built from a
config), and kept in the config: conversion at these magnitudes is exact to the original's own rounding, and loading
a saved model runs no probe, so any weights load (NaN and inf included).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import attnres.models.modeling_attnres as modeling
from attnres import convert_from_hf
from attnres.models import AttnResConfig, AttnResForCausalLM
from tests.models import TINY

FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", dict(head_dim=8)),
    "gemma2": ("gemma2", dict(head_dim=8, sliding_window=4)),  # its own (1 + w) norms and post-sublayer norms
}
MAGNITUDES = [(torch.bfloat16, 256.0), (torch.bfloat16, 4096.0), (torch.float32, 30000.0)]
MASSIVE_CHANNEL = 7
IDS = torch.randint(1, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))


def massive_model(family: str, dtype: torch.dtype, magnitude: float) -> torch.nn.Module:
    """A tiny random model of `family` whose embedding carries one channel at `magnitude` (as real LLMs' residuals do),
    in float64 (the oracle; cast it to `dtype` for the model under test)."""
    model_type, fields = FAMILIES[family]
    config = CONFIG_MAPPING[model_type](**{**TINY, **fields, "initializer_range": 0.2})
    torch.manual_seed(0)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, MASSIVE_CHANNEL] = magnitude
    return model.double()


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def assert_as_close_as_the_original(ours: torch.Tensor, theirs: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """The converted model's logits `ours` are as close to the float64 oracle's `want` as the original's `theirs` at
    the same `dtype`: the conversion adds no error of its own beyond the original's rounding."""
    their_error = (theirs - want).abs().max().item()
    our_error = (ours - want).abs().max().item()
    if dtype == torch.bfloat16:
        # the conversion's own rounding is the original's: within 1.5x its bf16 error against float64
        assert our_error <= 1.5 * their_error, (our_error, their_error)
    else:
        assert our_error <= 2 * their_error + 1e-6 * want.abs().max().item(), (our_error, their_error)


MAGNITUDE_IDS = [f"{d}-{m:g}".replace("torch.", "") for d, m in MAGNITUDES]


@pytest.mark.parametrize("residual", ["block", "full"])
@pytest.mark.parametrize("dtype, magnitude", MAGNITUDES, ids=MAGNITUDE_IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_massive_activations_convert_exactly_and_load_without_a_probe(family, dtype, magnitude, residual, tmp_path,
                                                                    monkeypatch):
    oracle = massive_model(family, dtype, magnitude)
    oracle.save_pretrained(tmp_path / "original")
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "original", dtype=dtype).eval()  # as checkpoints load
    converted = convert_from_hf(original, residual, attn_res_block_size=2)
    want, theirs, ours = logits(oracle), logits(original), logits(converted)
    assert_as_close_as_the_original(ours, theirs, want, dtype)
    assert converted.config.attn_res_layer_plan is not None

    converted.save_pretrained(tmp_path / "converted")
    monkeypatch.setattr(modeling, "plan_decoder_layers", _refuse_probe)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=dtype)
    assert type(loaded) is AttnResForCausalLM
    assert torch.equal(logits(loaded), ours)


def _refuse_probe(*args, **kwargs):
    raise AssertionError("loading a saved model read its layer plan from its weights")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_any_weights_load(bad, tmp_path, monkeypatch):
    """A diverged run (NaN or inf in its weights) still loads, for inspection; its plan comes from its config."""
    model = AttnResForCausalLM(AttnResConfig(**TINY, residual="block", attn_res_block_size=1)).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = bad
        model.model.layers[2].mlp_res_proj.weight.fill_(bad)
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(modeling, "plan_decoder_layers", _refuse_probe)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    got = loaded.model.layers[1].mlp.down_proj.weight[0, 0].item()
    assert got != got if bad != bad else got == bad
    assert not torch.isfinite(logits(loaded)).all()


def test_the_plan_is_read_once_and_kept_in_the_config(monkeypatch):
    config = AttnResConfig(**TINY, residual="full")
    assert config.attn_res_layer_plan is None
    model = AttnResForCausalLM(config)
    plan = model.config.attn_res_layer_plan
    assert [side["body"] for side in plan] == ["self_attn", "mlp"]
    monkeypatch.setattr(modeling, "plan_decoder_layers", _refuse_probe)
    again = AttnResForCausalLM(AttnResConfig.from_dict(model.config.to_dict()))  # from a kept plan: no probe
    assert again.config.attn_res_layer_plan == plan


def test_a_plan_naming_a_missing_module_is_refused():
    model = AttnResForCausalLM(AttnResConfig(**TINY, residual="block"))
    plan = copy.deepcopy(model.config.attn_res_layer_plan)
    plan[1]["body"] = "feed_forward"
    with pytest.raises(ValueError, match="attn_res_layer_plan: names 'feed_forward'"):
        AttnResForCausalLM(AttnResConfig(**TINY, residual="block", attn_res_layer_plan=plan))
    with pytest.raises(ValueError, match="attn_res_layer_plan: expected the two sides"):
        AttnResConfig(**TINY, attn_res_layer_plan=plan[:1])


@pytest.mark.parametrize("magnitude", [1e6, 1e9])
def test_the_plan_check_bounds_follow_the_residual_at_any_magnitude(magnitude):
    """The plan's checks run in float64 with bounds that include the residual's own rounding: a residual channel far
    beyond any real checkpoint's still converts (in fp32, where the original model itself still runs)."""
    original = massive_model("llama", torch.float32, magnitude).float()
    converted = convert_from_hf(original, "block", attn_res_block_size=2)
    assert [side["body"] for side in converted.config.attn_res_layer_plan] == ["self_attn", "mlp"]
