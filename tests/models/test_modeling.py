"""AttnResForCausalLM as a transformers model: names, init, save/load, loss, masks, generation, depth weights."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnres.layers import PseudoQuery
from attnres.models import AttnResConfig, AttnResForCausalLM

RESIDUALS = ["standard", "full", "block"]
K3_LAYER_KEYS = [
    "self_attention_res_proj.weight",
    "self_attention_res_norm.weight",
    "mlp_res_proj.weight",
    "mlp_res_norm.weight",
]
LLAMA_LAYER_KEYS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


# config fields with the same name and meaning in transformers Llama (rope_theta lives in Llama's rope_parameters)
SHARED_WITH_LLAMA = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
]


def expected_keys(layers: int, residual: str) -> set[str]:
    """Llama's parameter names, plus the Kimi K3 AttnRes names (docs/design.md section 9) unless the residual is
    standard."""
    layer_keys = LLAMA_LAYER_KEYS + ([] if residual == "standard" else K3_LAYER_KEYS)
    keys = {f"model.layers.{i}.{key}" for i in range(layers) for key in layer_keys}
    keys |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    if residual != "standard":
        keys |= {"model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"}
    return keys


def randomize_attnres_(model) -> None:
    """Move every pseudo-query and key gain off its init, so a test can tell loaded values from fresh ones."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith("_res_norm.weight"):
                p.normal_(1.0, 0.3)


def depth_sources(config: AttnResConfig) -> list[int]:
    """R_k, the number of sources of each aggregation point in schedule order, from docs/design.md section 3's
    counts."""
    L, S = config.num_hidden_layers, config.attn_res_block_size
    if config.residual == "full":
        return list(range(1, 2 * L + 2))
    counts = [nvb + 1 for i in range(L) for nvb in (math.ceil(i / S), i // S + 1)]  # bank rows + the prefix
    return counts + [math.ceil(L / S) + 1]


@pytest.mark.parametrize("residual", RESIDUALS)
def test_parameters_carry_llama_and_kimi_k3_names_and_shapes(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual))
    state = model.state_dict()
    assert set(state) == expected_keys(3, residual)
    for key, tensor in state.items():
        if key.endswith("_res_proj.weight"):
            assert tensor.shape == (1, 32)
        elif key.endswith("_res_norm.weight"):
            assert tensor.shape == (32,)


@pytest.mark.parametrize("residual", ["full", "block"])
def test_init_keeps_zero_queries_and_unit_gains(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual, initializer_range=0.05))
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            assert p.count_nonzero() == 0, name
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # the transformers init: normal(0, initializer_range)
            assert abs(p.std().item() - 0.05) < 0.01, name


def test_aggregation_points_read_the_registered_parameters(tiny_config):
    model = AttnResForCausalLM(tiny_config(residual="block"))
    points = model.aggregation_points()
    assert len(points) == 2 * 3 + 1
    layer = model.model.layers[1]
    assert points[2].proj.weight is layer.self_attention_res_proj.weight
    assert points[3].norm.weight is layer.mlp_res_norm.weight
    assert points[-1].proj.weight is model.model.output_attn_res_proj.weight
    # the points are not submodules: each parameter is registered (and saved) once
    assert len(list(model.named_parameters(remove_duplicate=False))) == len(model.state_dict())
    assert AttnResForCausalLM(tiny_config(residual="standard")).aggregation_points() is None
    clone = copy.deepcopy(model)  # e.g. an EMA copy: its points must read its own parameters
    assert clone.aggregation_points()[2].proj.weight is clone.model.layers[1].self_attention_res_proj.weight


def test_a_module_swapped_in_on_its_owner_is_the_one_that_computes(tiny_config):
    """Points look their modules up by name at every use (PEFT's modules_to_save, user code)."""
    model = AttnResForCausalLM(tiny_config(residual="block", attn_res_block_size=1)).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
        swapped = PseudoQuery(32)
        swapped.weight.normal_(0.0, 1.0)
        model.model.layers[1].mlp_res_proj = swapped
        assert model.aggregation_points()[3].proj is swapped
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                assert (model(ids).logits - before).abs().max() > 1e-3


@pytest.mark.parametrize("residual", RESIDUALS)
def test_save_and_load_round_trip_through_safetensors(tiny_config, residual, tmp_path):
    model = AttnResForCausalLM(tiny_config(residual=residual, attn_res_block_size=2)).eval()
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (2, 7))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == expected_keys(3, residual)

    for loader in (AttnResForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert type(loaded) is AttnResForCausalLM
        saved, reloaded = model.config.to_dict(), {**loaded.config.to_dict(), "_name_or_path": ""}
        for key in ("dtype", "_name_or_path"):  # loading records the weights' dtype and path in the family config
            reloaded["text_config"][key] = saved["text_config"][key]
        assert reloaded == saved
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert type(AutoConfig.from_pretrained(tmp_path)) is AttnResConfig


def test_standard_checkpoint_loads_into_an_attnres_model_computing_the_same_function(tiny_config, tmp_path):
    """The AttnRes parameters a PreNorm checkpoint lacks start at their init (zero queries, unit gains), so with the
    mixture rescale the loaded model reproduces the checkpoint's logits."""
    standard = AttnResForCausalLM(tiny_config(residual="standard")).eval()
    standard.save_pretrained(tmp_path)
    model = AttnResForCausalLM.from_pretrained(tmp_path, residual="block", attn_res_rescale_mixture=True).eval()
    assert model.config.residual == "block"
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            assert p.count_nonzero() == 0, name
        elif name.endswith("_res_norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = standard(ids).logits
        assert (model(ids).logits - expected).norm() <= 1e-5 * expected.norm()


def test_a_family_checkpoint_loads_into_an_attnres_model_of_that_family(tmp_path):
    """`AttnResForCausalLM.from_pretrained` on a Qwen3 folder: the family comes from its config.json."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    qwen = Qwen3ForCausalLM(Qwen3Config(**fields, num_key_value_heads=2, head_dim=8)).eval()
    qwen.save_pretrained(tmp_path)
    model = AttnResForCausalLM.from_pretrained(tmp_path, residual="block", attn_res_rescale_mixture=True).eval()
    assert type(model.config.text_config) is Qwen3Config and type(model.model).__name__ == "Qwen3Model"
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = qwen(ids).logits
        assert (model(ids).logits - expected).norm() <= 1e-5 * expected.norm()


def test_tied_embeddings_share_one_matrix_and_survive_reload(tiny_config, tmp_path):
    model = AttnResForCausalLM(tiny_config(tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_standard_residual_is_transformers_llama(tiny_config):
    """Same weights, same logits: attention (rotary, grouped queries), SwiGLU and RMSNorm follow Llama's conventions,
    and the standard model's state dict loads into LlamaForCausalLM key for key."""
    config = tiny_config(residual="standard", rope_theta=500.0)
    model = AttnResForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    llama = LlamaForCausalLM(
        LlamaConfig(
            **{key: getattr(config, key) for key in SHARED_WITH_LLAMA},
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        )
    ).eval()
    llama.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        expected = llama(ids).logits
        assert (model(ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("residual", RESIDUALS)
def test_loss_is_mean_next_token_cross_entropy(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual))
    ids = torch.randint(0, 64, (2, 8))
    labels = ids.clone()
    labels[0, 5:] = -100  # ignored positions
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected, rtol=1e-6)
    assert isinstance(out, CausalLMOutputWithPast)


@pytest.mark.parametrize("residual", ["full", "block"])
def test_gradients_reach_the_attnres_parameters(tiny_config, residual):
    """At zero init only the queries learn (a key gain's gradient is proportional to its query); once the queries
    move, the gains learn too. Layer 0's attention reads one source, whose weight is 1 whatever its parameters."""
    model = AttnResForCausalLM(tiny_config(residual=residual))
    ids = torch.randint(0, 64, (2, 8))
    for zero_queries in (True, False):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "_res_norm.weight")):
                learns = not name.startswith("model.layers.0.self_attention_res_") and (
                    name.endswith("_res_proj.weight") or not zero_queries
                )
                assert (p.grad.count_nonzero() > 0) == learns, (name, zero_queries)
        randomize_attnres_(model)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_a_token_never_sees_later_tokens(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual)).eval()
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (1, 9))
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 64
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("residual", RESIDUALS)
def test_left_padding_leaves_the_real_tokens_unchanged(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual)).eval()
    randomize_attnres_(model)
    ids = torch.randint(1, 64, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = model(ids).logits
        out = model(padded, attention_mask=mask, position_ids=positions).logits
    assert out.isfinite().all()
    assert torch.allclose(out[:, 3:], alone, rtol=1e-5, atol=1e-6)


def test_two_phase_and_one_shot_block_agree(tiny_config):
    one_shot = AttnResForCausalLM(tiny_config(num_hidden_layers=6, attn_res_two_phase=False)).eval()
    randomize_attnres_(one_shot)
    two_phase = AttnResForCausalLM(tiny_config(num_hidden_layers=6, attn_res_two_phase=True)).eval()
    two_phase.load_state_dict(one_shot.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        a, b = one_shot(ids).logits, two_phase(ids).logits
    assert (a - b).norm() <= 1e-5 * b.norm()


@pytest.mark.parametrize(
    "residual, block_size, layers", [("full", 2, 3), ("block", 1, 3), ("block", 2, 5), ("block", 4, 3)]
)
def test_depth_weights_follow_the_schedule(tiny_config, residual, block_size, layers):
    config = tiny_config(residual=residual, attn_res_block_size=block_size, num_hidden_layers=layers)
    model = AttnResForCausalLM(config).eval()
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        out = model(ids, output_depth_weights=True)
        plain = model(ids)
    assert [w.shape for w in out.depth_weights] == [(r, 2, 7) for r in depth_sources(config)]
    for w in out.depth_weights:
        assert (w > 0).all() and torch.allclose(w.sum(0), torch.ones(2, 7))
    # the final read's mixture, normed by the final norm, is the last hidden state
    assert len(out.depth_mixtures) == len(out.depth_weights)
    assert torch.allclose(model.lm_head(model.model.norm(out.depth_mixtures[-1])), out.logits, rtol=1e-5, atol=1e-6)
    assert plain.depth_weights is None and plain.depth_mixtures is None
    assert torch.allclose(out.logits, plain.logits, rtol=1e-5, atol=1e-6)


def test_standard_model_records_its_residual_sums_but_no_weights(tiny_config):
    model = AttnResForCausalLM(tiny_config(residual="standard"))
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        out = model(ids, output_depth_weights=True)
    assert out.depth_weights == [] and len(out.depth_mixtures) == 2 * 3 + 1
    assert torch.equal(out.depth_mixtures[0], model.model.embed_tokens(ids))


@pytest.mark.parametrize("residual", ["standard", "block"])
def test_greedy_generation_without_cache_extends_by_argmax(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual)).eval()
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (2, 5))
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert generated.shape == (2, 9) and torch.equal(generated[:, :5], ids)
    with torch.no_grad():
        logits = model(generated[:, :-1]).logits
    assert torch.equal(generated[:, 5:], logits[:, 4:].argmax(-1))


@pytest.mark.parametrize("residual", RESIDUALS)
def test_bf16_forward_tracks_fp32(tiny_config, residual):
    model = AttnResForCausalLM(tiny_config(residual=residual)).eval()
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        logits = model.to(torch.bfloat16)(ids).logits
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - expected).norm() <= 3e-2 * expected.norm()


@pytest.mark.parametrize("residual", RESIDUALS)
def test_bf16_autocast_training_step_tracks_fp32(tiny_config, residual):
    """Under autocast the sublayers run in bf16 while the residual sources stay fp32 (one dtype per aggregation)."""
    model = AttnResForCausalLM(tiny_config(residual=residual))
    randomize_attnres_(model)
    ids = torch.randint(0, 64, (2, 7))
    expected = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - expected.item()) < 2e-2 * expected.item()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_top_level_exports():
    import attnres

    assert attnres.AttnResForCausalLM is AttnResForCausalLM and attnres.AttnResConfig is AttnResConfig
