"""AttnRes on every PreNorm decoder family of transformers (docs/design.md section 6).

Each family is a tiny random-init model built by transformers itself, its norm gains and biases moved off their init
so that a weight in the wrong place shows. For Block (2 layers a block, 4 layers) and Full:

- zero-query conversion reproduces the original: logits (training and no-grad bank path), greedy generation with the
  KV cache (a left-padded batch, each row as if generated alone), a save/load round trip in a fresh process, bf16;
- with nonzero queries the model follows the schedule of docs/design.md section 3 written out here on the ORIGINAL
  family model's own modules (the attention arguments, masks and rotary embeddings captured from its own forward), its
  grad and no-grad paths agree, and another attention backend gives the same logits;
- MoE families keep their router loss; post-norm and parallel-residual families are refused; every family also
  trains from scratch; and the transformers interfaces `attnres.models.family` relies on are checked.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import attnres
from attnres import naive_depth_attention
from attnres.models import AttnResConfig, AttnResForCausalLM
from attnres.models.naive import naive_logits, schedule_sources
from tests.models import TINY

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
BASE = dict(
    TINY,
    vocab_size=VOCAB,
    num_hidden_layers=4,
    initializer_range=0.2,  # O(1) activations and decisive logits, so greedy tokens are no near-ties
    bos_token_id=None,
    eos_token_id=None,  # greedy generation runs its full length
    pad_token_id=None,
)
BLOCK_SIZE = 2
ROPE = dict(rope_theta=10000.0)
# test id: (model_type, config fields beyond BASE)
FAMILIES = {
    "llama": ("llama", {}),
    "llama-llama3": (
        "llama",
        dict(rope_parameters=dict(ROPE, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=16)),
    ),
    "llama-yarn": ("llama", dict(rope_parameters=dict(ROPE, rope_type="yarn", factor=4.0,
                                                      original_max_position_embeddings=16))),
    "llama-linear": ("llama", dict(rope_parameters=dict(ROPE, rope_type="linear", factor=2.0))),
    # dynamic NTK changes the frequencies only past max_position_embeddings: tests/models/test_generation.py runs it there
    "llama-dynamic": ("llama", dict(rope_parameters=dict(ROPE, rope_type="dynamic", factor=2.0))),
    "llama-tied": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=5)),  # shorter than the prompts
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", {}),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=5)),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=5, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "phi3": ("phi3", {}),
    "granite": ("granite", dict(residual_multiplier=0.3, embedding_multiplier=2.0, logits_scaling=4.0,
                                attention_multiplier=0.5)),
    "deepseek-v3": ("deepseek_v3", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, n_group=1, topk_group=1,
        num_key_value_heads=4)),
    "glm4": ("glm4", {}),
    # the MLA-only layout: Kimi Linear's KDA layers need CUDA
    "kimi-linear": ("kimi_linear", dict(
        layer_types=["full_attention"] * 4, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_key_value_heads=4)),
}
MOE = ["mixtral", "qwen2-moe", "qwen3-moe"]
RESIDUALS = ["block", "full"]
CASES = [pytest.param(f, r, id=f"{f}-{r}") for f in FAMILIES for r in RESIDUALS]
# one family of each model type, for the checks that do not depend on the rope variant
MODEL_TYPES = [name for name, (mt, _) in FAMILIES.items() if name == next(n for n in FAMILIES if FAMILIES[n][0] == mt)]

# What each sublayer is, written out per family: (PreNorm, body, modules after the body); the rest are Llama's.
LLAMA_PLAN = (("input_layernorm", "self_attn", ()), ("post_attention_layernorm", "mlp", ()))
PLANS = {
    "gemma2": (("input_layernorm", "self_attn", ("post_attention_layernorm",)),
               ("pre_feedforward_layernorm", "mlp", ("post_feedforward_layernorm",))),
    "glm4": (("input_layernorm", "self_attn", ("post_self_attn_layernorm",)),
             ("post_attention_layernorm", "mlp", ("post_mlp_layernorm",))),
    "phi3": (("input_layernorm", "self_attn", ("resid_attn_dropout",)),
             ("post_attention_layernorm", "mlp", ("resid_mlp_dropout",))),
}
PLANS["gemma3_text"] = PLANS["gemma2"]
ONE_PLUS_WEIGHT_NORMS = ("gemma", "gemma2", "gemma3_text")  # RMSNorm gain 1 + w: not fusable, centred on 0
SIDE_PREFIXES = ("self_attention_res", "mlp_res")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def family_config(family: str):
    model_type, fields = FAMILIES[family]
    return CONFIG_MAPPING[model_type](**{**BASE, **fields})


def plan(family: str):
    return PLANS.get(FAMILIES[family][0], LLAMA_PLAN)


def _seed(*names: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate("-".join(names))) % 10_000


IDS = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


@functools.cache
def original(family: str) -> nn.Module:
    """The family's own tiny model, norm gains and biases off their init (a misplaced weight then shows)."""
    torch.manual_seed(_seed(family))
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    gain = 0.0 if FAMILIES[family][0] in ONE_PLUS_WEIGHT_NORMS else 1.0
    gen = torch.Generator().manual_seed(_seed(family, "norms"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(gain + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


@functools.cache
def original_logits(family: str) -> torch.Tensor:
    with torch.no_grad():
        return original(family)(IDS).logits


@functools.cache
def converted(family: str, residual: str) -> AttnResForCausalLM:
    """Zero-query conversion (attn_res_rescale_mixture on): the original's function."""
    return attnres.convert_from_hf(original(family), residual=residual, attn_res_block_size=BLOCK_SIZE)


@functools.cache
def with_queries(family: str, residual: str) -> AttnResForCausalLM:
    """The converted model with random pseudo-queries (scores of a few units) and random key gains."""
    model = copy.deepcopy(converted(family, residual))
    gen = torch.Generator().manual_seed(_seed(family, residual, "queries"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("_res_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def reference_logits(family: str, model: AttnResForCausalLM, ids: torch.Tensor, residual: str) -> torch.Tensor:
    """docs/design.md section 3 one sublayer at a time on the ORIGINAL family model's modules, with `model`'s
    pseudo-queries and key gains: v_0 is what the family hands its first layer; each sublayer reads `norm(R * mixture)`
    (the rescale) and computes `scale * post(body(.))` with the arguments its body received in the family's own forward
    (masks, rotary embeddings); the final read feeds the family's final norm, and the family's head (logit scaling,
    soft-capping) turns it into logits. Shares no code with the model under test."""
    source = original(family)
    layers = source.model.layers
    scale = getattr(source.config, "residual_multiplier", 1.0)
    captured: dict = {}

    def keep(key):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[key] = (hidden, args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})

        return hook

    handles = [layers[0].register_forward_pre_hook(keep("v0"), with_kwargs=True)]
    for i, layer in enumerate(layers):
        for k, (_, body, _) in enumerate(plan(family)):
            handles.append(getattr(layer, body).register_forward_pre_hook(keep((i, k)), with_kwargs=True))
    try:
        with torch.no_grad():
            source(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    v = [captured["v0"][0]]

    def read(j: int, owner: nn.Module, prefix: str, prenorm: nn.Module) -> torch.Tensor:
        sources = schedule_sources(v, j, residual, BLOCK_SIZE)
        key_norm = getattr(owner, f"{prefix}_norm")
        mix = naive_depth_attention(sources, getattr(owner, f"{prefix}_proj").weight, key_norm.weight, eps=key_norm.eps)
        return prenorm(mix * len(sources))

    with torch.no_grad():
        for i, layer in enumerate(layers):
            for k, (norm, body, post) in enumerate(plan(family)):
                x = read(2 * i + k, model.model.layers[i], SIDE_PREFIXES[k], getattr(layer, norm))
                _, args, kwargs = captured[(i, k)]
                out = getattr(layer, body)(x, *args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                for name in post:
                    out = getattr(layer, name)(out)
                v.append(out * scale)
        final = read(2 * len(layers), model.model, "output_attn_res", source.model.norm)

        def swap(module, args, output):
            output.last_hidden_state = final
            return output

        handle = source.model.register_forward_hook(swap)
        try:
            return source(ids, use_cache=False).logits
        finally:
            handle.remove()


@functools.cache
def expected_with_queries(family: str, residual: str) -> torch.Tensor:
    return reference_logits(family, with_queries(family, residual), IDS, residual)


# ---------------------------------------------------------------------------------------------------------------------
# zero-query conversion


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_reads_each_sublayer_role(family):
    """The roles read from the family's decoder layer are the ones written out above (the reference relies on them)."""
    config = original(family).config
    fused = None if FAMILIES[family][0] in ONE_PLUS_WEIGHT_NORMS else config.rms_norm_eps
    for layer in converted(family, "block").model.layers:
        got = [(s.norm, s.body, tuple(name for name, _ in s.post), s.scale, s.fused_eps) for s in layer.sides]
        want = [(n, b, p, getattr(config, "residual_multiplier", 1.0), fused) for n, b, p in plan(family)]
        assert got == want


@pytest.mark.parametrize("family, residual", CASES)
def test_zero_query_conversion_gives_the_original_logits(family, residual):
    model = converted(family, residual)
    assert type(model) is AttnResForCausalLM and model.config.attn_res_rescale_mixture
    assert model.config.text_config.model_type == FAMILIES[family][0]
    for grad in (True, False):  # the training path, and (Block) the fused bank path taken without autograd
        with torch.set_grad_enabled(grad):
            logits = model(IDS).logits.detach()
        assert rel_err(logits, original_logits(family)) < 1e-5, grad


def padded_prompts():
    """Two prompts of 9 and 6 tokens, the second left-padded (pad id 0) into a batch."""
    gen = torch.Generator().manual_seed(2)
    long, short = torch.randint(1, VOCAB, (1, 9), generator=gen), torch.randint(1, VOCAB, (1, 6), generator=gen)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = (torch.arange(9) >= torch.tensor([[0], [3]])).long()
    return ids, mask, (long, short)


GENERATE = dict(do_sample=False, max_new_tokens=6, pad_token_id=0, use_cache=True)


@functools.cache
def original_generation(family: str) -> torch.Tensor:
    ids, mask, _ = padded_prompts()
    return original(family).generate(ids, attention_mask=mask, **GENERATE)


@pytest.mark.parametrize("family, residual", CASES)
def test_greedy_generation_with_the_cache_gives_the_original_tokens(family, residual):
    model = converted(family, residual)
    ids, mask, prompts = padded_prompts()
    batch = model.generate(ids, attention_mask=mask, **GENERATE)
    assert torch.equal(batch, original_generation(family))
    for row, prompt in enumerate(prompts):  # each row as that prompt generated alone
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), **GENERATE)
        assert torch.equal(alone[0, -6:], batch[row, -6:]), row
    assert not torch.equal(batch[0, 9:], batch[1, 9:])  # the two prompts lead to different tokens


@pytest.fixture(scope="module")
def reloaded_in_a_fresh_process(tmp_path_factory):
    """Every case, with nonzero queries, saved, then loaded by `AutoModelForCausalLM` in ONE fresh Python process."""
    root = tmp_path_factory.mktemp("families")
    names, unsaved = [], {}
    for param in CASES:
        family, residual = param.values
        try:
            with_queries(family, residual).save_pretrained(root / param.id)
            names.append(param.id)
        except Exception as error:  # reported by that case's test; the other cases still run
            unsaved[param.id] = f"not saved: {type(error).__name__}: {error}"
    torch.save(IDS, root / "ids.pt")
    script = textwrap.dedent(
        """
        import sys, torch
        import attnres
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        root, names = sys.argv[1], sys.argv[2:]
        ids, out = torch.load(f"{root}/ids.pt"), {}
        for name in names:
            try:
                model = AutoModelForCausalLM.from_pretrained(f"{root}/{name}").eval()
                with torch.no_grad():
                    out[name] = (type(model).__name__, model.config.residual, model(ids).logits)
            except Exception as error:  # reported by that case's test
                out[name] = f"{type(error).__name__}: {error}"
        torch.save(out, f"{root}/logits.pt")
        """
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(root), *names], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {**torch.load(root / "logits.pt"), **unsaved}


@pytest.mark.parametrize("family, residual", CASES)
def test_save_and_load_in_a_fresh_process_gives_the_same_logits(family, residual, reloaded_in_a_fresh_process):
    result = reloaded_in_a_fresh_process[f"{family}-{residual}"]
    assert not isinstance(result, str), result
    kind, saved_residual, logits = result
    assert (kind, saved_residual) == ("AttnResForCausalLM", residual)
    with torch.no_grad():
        expected = with_queries(family, residual)(IDS).logits
    assert rel_err(logits, expected) < 1e-6


BF16_IDS = torch.randint(1, VOCAB, (16, 9), generator=torch.Generator().manual_seed(3))


def token_errors(logits: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Each token's relative error over the vocabulary."""
    return (logits.float() - expected).norm(dim=-1) / expected.norm(dim=-1)


@functools.cache
def bf16_reference(family: str) -> tuple[torch.Tensor, float]:
    """The fp32 original's logits on BF16_IDS, and the original's own median token error in bf16."""
    with torch.no_grad():
        expected = original(family)(BF16_IDS).logits
        own = copy.deepcopy(original(family)).to(torch.bfloat16)(BF16_IDS).logits
    return expected, token_errors(own, expected).median().item()


@pytest.mark.parametrize("family, residual", CASES)
def test_bf16_error_is_the_original_models_own(family, residual):
    """Cast to bf16, the converted model is about as far from the fp32 original as the original itself in bf16. The
    median over tokens: a bf16 rounding that flips an MoE top-k choice moves a few tokens far, in either model."""
    model = copy.deepcopy(converted(family, residual)).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(BF16_IDS).logits
    assert logits.dtype == torch.bfloat16
    expected, own = bf16_reference(family)
    err = token_errors(logits, expected).median().item()
    assert err <= 2 * own + 1e-3, (err, own)


# ---------------------------------------------------------------------------------------------------------------------
# nonzero queries


@pytest.mark.parametrize("family, residual", CASES)
def test_nonzero_queries_follow_the_schedule_on_the_familys_own_modules(family, residual):
    model, expected = with_queries(family, residual), expected_with_queries(family, residual)
    assert rel_err(expected, original_logits(family)) > 1e-2  # the queries do change the function
    with torch.no_grad():
        bank = model(IDS).logits  # Block: the fused bank path taken without autograd
    trained = model(IDS).logits.detach()  # the training path
    assert rel_err(trained, expected) < 1e-5 and rel_err(bank, expected) < 1e-5
    assert rel_err(bank, trained) < 1e-6


@pytest.mark.parametrize("family, residual", CASES)
def test_the_naive_model_follows_the_schedule_and_the_model_follows_it_with_its_gradients(family, residual):
    """`attnres.models.naive` (the whole forward in plain torch, read from the model's own plan) gives the logits of
    the reference written out above, and the model's forward gives the naive model's logits and parameter gradients."""
    model = copy.deepcopy(with_queries(family, residual)).train()
    expected = expected_with_queries(family, residual)
    naive = naive_logits(model, IDS)
    assert rel_err(naive.detach(), expected) < 1e-5
    got = model(IDS).logits
    assert rel_err(got.detach(), naive.detach()) < 1e-5
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((got * weights).sum(), [p for _, p in named], allow_unused=True)
    naive_grads = torch.autograd.grad((naive * weights).sum(), [p for _, p in named], allow_unused=True)
    for (name, _), a, b in zip(named, grads, naive_grads):
        assert (a is None) == (b is None), name
        if a is not None and b.norm() > 0:
            assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))


def test_the_naive_model_of_the_standard_residual_is_the_original():
    model = attnres.convert_from_hf(original("llama"), residual="standard")
    with torch.no_grad():
        assert rel_err(naive_logits(model, IDS), original_logits("llama")) < 1e-6


@pytest.mark.parametrize("family, residual", CASES)
def test_another_attention_backend_gives_the_same_logits(family, residual):
    model = copy.deepcopy(with_queries(family, residual))
    if FAMILIES[family][0] == "gemma2":  # eager only (flex_attention compiles ~8 s on CPU); sdpa refused as by Gemma2
        assert model.config.text_config._attn_implementation == "eager"
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            model.set_attn_implementation("sdpa")
        return
    assert model.config.text_config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    assert model.config.text_config._attn_implementation == "eager"
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    with torch.no_grad():
        assert rel_err(model(IDS).logits, expected_with_queries(family, residual)) < 1e-5


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("family", MOE)
def test_moe_router_loss_is_the_originals_and_in_the_loss(family, residual):
    source, model = original(family), converted(family, residual)
    with torch.no_grad():
        want = source(IDS, labels=IDS, output_router_logits=True)
        got = model(IDS, labels=IDS, output_router_logits=True)
        plain = model(IDS, labels=IDS).loss  # router loss not asked for
    assert got.aux_loss is not None and got.aux_loss > 0
    assert torch.allclose(got.aux_loss, want.aux_loss, rtol=1e-5)
    assert len(got.router_logits) == len(want.router_logits) == 4
    assert torch.allclose(got.loss, want.loss, rtol=1e-5)
    coef = source.config.router_aux_loss_coef
    assert coef > 0 and torch.allclose(got.loss, plain + coef * got.aux_loss, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# families that are not PreNorm, from-scratch models, transformers interfaces

REFUSED = {"olmo2": "not PreNorm", "gpt_neox": "parallel residual", "cohere": "parallel residual",
           "phi": "parallel residual"}


@pytest.mark.parametrize("family, reason", REFUSED.items(), ids=list(REFUSED))
def test_families_that_are_not_prenorm_are_refused(family, reason):
    fields = {**BASE, "num_hidden_layers": 2}
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(CONFIG_MAPPING[family](**fields))
    message = rf"the '{family}' decoder layer .*{reason}"
    with pytest.raises(ValueError, match=message):
        attnres.convert_from_hf(source)
    with pytest.raises(ValueError, match=message):
        AttnResForCausalLM(AttnResConfig(base_model_type=family, residual="block", **fields))


@pytest.mark.parametrize("family", MODEL_TYPES)
def test_a_from_scratch_model_of_the_family_trains(family):
    model_type, fields = FAMILIES[family]
    model = AttnResForCausalLM(AttnResConfig(base_model_type=model_type, residual="block", **{**BASE, **fields}))
    assert type(model.model).__name__ == type(original(family).model).__name__
    model.train()
    ours = {name: p for name, p in model.named_parameters() if name.endswith(("_res_proj.weight", "_res_norm.weight"))}
    assert len(ours) == 2 * (2 * 4 + 1)
    with torch.no_grad():
        for name, p in ours.items():
            if name.endswith("_proj.weight"):
                p.normal_(0.0, 0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(IDS, labels=IDS).loss
    assert torch.isfinite(loss)
    loss.backward()
    single_source = {f"model.layers.0.{SIDE_PREFIXES[0]}_proj.weight", f"model.layers.0.{SIDE_PREFIXES[0]}_norm.weight"}
    for name, p in ours.items():
        if name in single_source:  # its only source, the embedding, has weight exactly 1
            assert p.grad is None or p.grad.count_nonzero() == 0, name
        else:
            assert p.grad is not None and p.grad.count_nonzero() > 0, name
    optimizer.step()
    with torch.no_grad():
        assert torch.isfinite(model(IDS, labels=IDS).loss)


def test_the_transformers_interfaces_attnres_relies_on():
    """What `attnres.models.family` assumes of transformers (its docstring). A failure here means transformers
    changed an interface the family adapter reads: adapt `attnres/models/family.py` and `wiring.py`."""
    changed = "transformers changed an interface attnres.models.family relies on: "
    lookup = MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig]
    assert lookup is LlamaForCausalLM, changed + "MODEL_FOR_CAUSAL_LM_MAPPING[config class] is the causal LM"
    for family in MODEL_TYPES:
        lm = original(family)
        config = lm.config
        lm_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        assert type(lm) is lm_cls, changed + f"{family}: the causal LM of its config class"
        assert lm_cls.base_model_prefix == "model" and lm.base_model is lm.model, changed + f"{family}: `.model`"
        assert isinstance(lm.lm_head, nn.Linear), changed + f"{family}: `.lm_head`"
        base = lm.base_model
        assert isinstance(base.layers, nn.ModuleList), changed + f"{family}: `base_model.layers` is a ModuleList"
        assert isinstance(base.norm, nn.Module) and base.get_input_embeddings() is base.embed_tokens, changed + family
        layer = base.layers[1]
        params = inspect.signature(type(layer).__init__).parameters
        assert list(params)[1:3] == ["config", "layer_idx"], changed + f"{family}: decoder layers are cls(config, i)"
        rebuilt = type(layer)(config, 1)
        assert {n for n, _ in rebuilt.named_children()} == {n for n, _ in layer.named_children()}, changed + family
        for fn in (lm_cls.forward, type(base).forward, type(layer).forward):
            kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
            assert inspect.Parameter.VAR_KEYWORD in kinds, changed + f"{family}: {fn.__qualname__} takes **kwargs"
        seen = {}

        def layer_kwargs(module, args, kwargs, i):
            seen[i] = kwargs.get("attn_res_interface_probe")

        def layer_output(module, args, kwargs, output, i):
            seen[f"out{i}"] = output

        def attention_output(module, args, kwargs, output):
            seen["attention"] = output

        handles = [lay.register_forward_pre_hook(functools.partial(layer_kwargs, i=i), with_kwargs=True)
                   for i, lay in enumerate(base.layers)]
        handles += [base.layers[-1].register_forward_hook(functools.partial(layer_output, i=-1), with_kwargs=True)]
        handles += [layer.self_attn.register_forward_hook(attention_output, with_kwargs=True)]
        final = {}
        handles += [base.norm.register_forward_pre_hook(lambda m, args: final.setdefault("in", args[0]))]
        try:
            with torch.no_grad():
                lm(IDS, attn_res_interface_probe="here")
        finally:
            for handle in handles:
                handle.remove()
        assert all(seen[i] == "here" for i in range(len(base.layers))), (
            changed + f"{family}: the causal LM's forward passes its **kwargs through the base model to every layer"
        )
        assert isinstance(seen["out-1"], torch.Tensor), changed + f"{family}: a decoder layer returns a tensor"
        assert final["in"] is seen["out-1"], changed + f"{family}: the last layer's output feeds the final norm"
        assert isinstance(seen["attention"], tuple) and isinstance(seen["attention"][0], torch.Tensor), (
            changed + f"{family}: the attention returns a tuple whose first element is its output"
        )
