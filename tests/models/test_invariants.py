"""Whole-model invariants (docs/design.md sections 2 and 3).

1. Zero pseudo-queries: Full and Block models compute the standard PreNorm model's function, exactly with
   `attn_res_rescale_mixture`, up to the RMSNorm eps without it.
2. Zero queries cannot see a wrong block grouping, so with random nonzero queries the model is compared with the
   schedule of docs/design.md section 3 written out by sublayer index (`attnres.models.naive.schedule_sources`: no bank,
   no prefix), on the model's own submodules.
"""

import pytest
import torch

from attnres import naive_depth_attention
from attnres.models import AttnResForCausalLM
from attnres.models.naive import schedule_sources

ATTNRES_KEYS = ("_res_proj.weight", "_res_norm.weight")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def randomize_(params, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(mean, std)


def layer_norms(model):
    """The PreNorms and the final norm: the norms the standard model has too."""
    inner = model.model
    return [inner.norm.weight] + [
        n.weight for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]


def same_weights_as(standard, config):
    """A model of `config` holding `standard`'s weights; its AttnRes parameters keep their init (zero queries)."""
    model = AttnResForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and missing and all(key.endswith(ATTNRES_KEYS) for key in missing)
    return model


# (residual, attn_res_block_size): Full, and Block at 1 (Full's grouping), 2, 3 and more layers than the model has
VARIANTS = [("full", 2), ("block", 1), ("block", 2), ("block", 3), ("block", 7)]


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("layers", [1, 3, 6])
def test_zero_queries_with_rescale_equal_standard_exactly(tiny_config, layers, eps):
    torch.manual_seed(layers)
    config = dict(num_hidden_layers=layers, rms_norm_eps=eps, attn_res_rescale_mixture=True)
    standard = AttnResForCausalLM(tiny_config(residual="standard", **config)).eval()
    randomize_(layer_norms(standard), std=0.5, mean=1.0)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = standard(ids).logits
    for residual, size in VARIANTS:
        model = same_weights_as(standard, tiny_config(residual=residual, attn_res_block_size=size, **config))
        for grad in (True, False):  # the training path, and (Block) the fused bank path taken without autograd
            with torch.set_grad_enabled(grad):
                assert rel_err(model(ids).logits.detach(), expected) < 1e-5, (residual, size, grad)


@pytest.mark.parametrize("layers", [1, 3, 6])
def test_zero_queries_without_rescale_differ_from_standard_only_by_eps(tiny_config, layers):
    """Without the rescale each PreNorm sees eps * R^2: invisible at a tiny eps, visible at a large one."""
    torch.manual_seed(layers)
    ids = torch.randint(0, 64, (2, 9))
    for eps, agree in ((1e-12, True), (1e-2, False)):
        config = dict(num_hidden_layers=layers, rms_norm_eps=eps)
        standard = AttnResForCausalLM(tiny_config(residual="standard", **config)).eval()
        randomize_(layer_norms(standard), std=0.5, mean=1.0)
        with torch.no_grad():
            expected = standard(ids).logits
            for residual, size in VARIANTS:
                cfg = tiny_config(residual=residual, attn_res_block_size=size, **config)
                err = rel_err(same_weights_as(standard, cfg)(ids).logits, expected)
                assert err < 1e-5 if agree else err > 1e-3, (eps, residual, size, err)


def reference_logits(model, ids: torch.Tensor, residual: str, block_size: int) -> torch.Tensor:
    """docs/design.md section 3, one sublayer at a time, with the unfused naive op and the PreNorm modules applied after
    it."""
    inner, config = model.model, model.config
    L = config.num_hidden_layers
    v = [inner.embed_tokens(ids)]
    rotary = inner.rotary_emb(v[0], torch.arange(ids.shape[1])[None])  # the family's (cos, sin)

    def read(j, proj, key_norm, prenorm):
        sources = schedule_sources(v, j, residual, block_size)
        mix = naive_depth_attention(sources, proj.weight, key_norm.weight, eps=key_norm.eps)
        return prenorm(mix * len(sources) if config.attn_res_rescale_mixture else mix)

    for i, layer in enumerate(inner.layers):
        x = read(2 * i, layer.self_attention_res_proj, layer.self_attention_res_norm, layer.input_layernorm)
        v.append(layer.self_attn(hidden_states=x, position_embeddings=rotary, attention_mask=None)[0])
        x = read(2 * i + 1, layer.mlp_res_proj, layer.mlp_res_norm, layer.post_attention_layernorm)
        v.append(layer.mlp(x))
    return model.lm_head(read(2 * L, inner.output_attn_res_proj, inner.output_attn_res_norm, inner.norm))


def random_attnres_model(config, seed: int = 0):
    """Nonzero queries (scores of a few units: a peaked but not one-hot softmax), random key gains and PreNorms."""
    torch.manual_seed(seed)
    model = AttnResForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def schedules():
    """(layers, residual, block size, two_phase) with ids like L6-block2-auto; two-phase is a Block option only."""
    for layers in (1, 3, 6):
        for residual, size in VARIANTS:
            if residual == "full":
                yield pytest.param(layers, residual, size, None, id=f"L{layers}-full")
                continue
            for two_phase, name in ((None, "auto"), (False, "one-shot"), (True, "two-phase")):
                yield pytest.param(layers, residual, size, two_phase, id=f"L{layers}-block{size}-{name}")


@pytest.mark.parametrize("rescale", [False, True], ids=["plain", "rescale"])
@pytest.mark.parametrize("layers, residual, size, two_phase", schedules())
def test_nonzero_queries_follow_the_written_out_schedule(tiny_config, layers, residual, size, two_phase, rescale):
    config = tiny_config(
        num_hidden_layers=layers,
        residual=residual,
        attn_res_block_size=size,
        attn_res_rescale_mixture=rescale,
        attn_res_two_phase=two_phase,
    )
    model = random_attnres_model(config, seed=layers)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = reference_logits(model, ids, residual, size)
    for grad in (True, False):  # the training path, and (Block) the fused bank path taken without autograd
        with torch.set_grad_enabled(grad):
            assert rel_err(model(ids).logits.detach(), expected) < 1e-5, grad


def test_reference_sees_a_wrong_block_grouping_that_zero_queries_hide(tiny_config):
    """The schedule test can fail: a model grouped in blocks of 2 layers is not the reference grouped in 3, although
    with zero queries (and the rescale) the two groupings compute the same function."""
    config = tiny_config(num_hidden_layers=6, residual="block", attn_res_block_size=2, attn_res_rescale_mixture=True)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        model = random_attnres_model(config)
        assert rel_err(model(ids).logits, reference_logits(model, ids, "block", 3)) > 1e-3
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.zero_()
        assert rel_err(model(ids).logits, reference_logits(model, ids, "block", 3)) < 1e-5
