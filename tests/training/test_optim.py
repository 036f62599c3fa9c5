"""Parameter groups (AttnRes parameters apart, no decay for norms and embeddings) and the learning-rate schedules."""

import math

import pytest
import torch

from attnres.models import AttnResConfig, AttnResForCausalLM
from attnres.training.optim import (
    build_optimizer,
    fused_adamw,
    is_attn_res_param,
    lr_factor,
    param_groups,
    set_lr,
)


def tiny_model(residual: str, tie: bool = False) -> AttnResForCausalLM:
    config = AttnResConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, residual=residual, attn_res_block_size=1, tie_word_embeddings=tie,
    )
    return AttnResForCausalLM(config)


def names_by_group(model, groups) -> dict[str, set[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {name_of[id(p)] for p in g["params"]} for g in groups}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_groups_put_attn_res_params_apart_and_spare_norms_and_embeddings_from_decay(tie):
    model = tiny_model("block", tie)
    groups = param_groups(model, lr=1e-3, weight_decay=0.1, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0)
    by_name = names_by_group(model, groups)
    all_names = {n for n, _ in model.named_parameters()}
    assert set().union(*by_name.values()) == all_names and sum(map(len, by_name.values())) == len(all_names)
    L = model.config.num_hidden_layers
    assert len(by_name["attn_res"]) == 4 * L + 2  # per layer 2 queries + 2 key gains, plus the output read's pair
    assert "model.output_attn_res_proj.weight" in by_name["attn_res"]
    assert "model.layers.1.mlp_res_norm.weight" in by_name["attn_res"]
    assert "model.embed_tokens.weight" in by_name["no_decay"]
    assert "model.layers.0.input_layernorm.weight" in by_name["no_decay"] and "model.norm.weight" in by_name["no_decay"]
    assert "model.layers.0.self_attn.q_proj.weight" in by_name["decay"]
    assert ("lm_head.weight" in by_name["decay"]) == (not tie)  # an untied head is a matrix like the others
    settings = {g["name"]: (g["lr"], g["weight_decay"]) for g in groups}
    assert settings == {"decay": (1e-3, 0.1), "no_decay": (1e-3, 0.0), "attn_res": (pytest.approx(1e-4), 0.0)}


def test_standard_model_has_no_attn_res_group():
    model = tiny_model("standard")
    assert not any(is_attn_res_param(n) for n, _ in model.named_parameters())
    groups = param_groups(model, lr=1e-3, weight_decay=0.1, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]


def test_attn_res_multiplier_scales_the_actual_update():
    """Adam's first step moves every coordinate by about lr: the queries must move 10x less than a matrix."""
    model = tiny_model("full")
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0)
    set_lr(optimizer, 1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    step = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert step["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(1e-2, rel=1e-3)
    assert step["model.layers.1.self_attention_res_proj.weight"] == pytest.approx(1e-3, rel=1e-3)


def test_optimizer_is_fused_on_cpu_and_steps_as_the_default_does():
    """The fused kernel runs where torch has it (CPU here) and moves the weights as the Python loop does, to round-off;
    a parameter on a device without it (meta) gets the default implementation."""
    models = {name: tiny_model("full") for name in ("fused", "loop")}
    models["loop"].load_state_dict(models["fused"].state_dict())
    optimizers = {
        "fused": build_optimizer(models["fused"], lr=1e-2, weight_decay=0.1, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0),
        "loop": torch.optim.AdamW(param_groups(models["loop"], lr=1e-2, weight_decay=0.1, attn_res_lr_mult=0.1,
                                               attn_res_weight_decay=0.0), lr=1e-2, betas=(0.9, 0.95)),
    }
    assert optimizers["fused"].defaults["fused"] is True and not optimizers["loop"].defaults["fused"]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for name, model in models.items():
            optimizers[name].zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizers[name].step()
    fused, loop = (dict(models[name].named_parameters()) for name in ("fused", "loop"))
    for name, p in fused.items():
        torch.testing.assert_close(p, loop[name], rtol=1e-5, atol=1e-6, msg=name)
    assert fused_adamw([torch.zeros(3, device="meta", requires_grad=True)], lr=1e-3).defaults["fused"] is None


def schedule(schedule, steps=100, warmup=10, min_lr_ratio=0.1, decay_fraction=0.2):
    return [
        lr_factor(s, steps=steps, warmup=warmup, schedule=schedule, min_lr_ratio=min_lr_ratio, decay_fraction=decay_fraction)
        for s in range(steps)
    ]


def test_cosine_warms_up_linearly_then_decays_to_the_floor():
    f = schedule("cosine")
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[10 + 45] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))


def test_wsd_holds_then_decays_linearly_over_the_last_fraction():
    f = schedule("wsd")
    assert f[10:80] == [1.0] * 70
    assert f[-1] == pytest.approx(0.1)
    decay = f[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[1] - decay[2] == pytest.approx(decay[-2] - decay[-1])  # linear


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule: expected one of"):
        lr_factor(0, steps=10, warmup=0, schedule="step", min_lr_ratio=0.1, decay_fraction=0.2)
