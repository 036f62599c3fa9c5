"""PEFT on AttnRes models: LoRA on the family's projections, the AttnRes parameters trained in full.

The AttnRes parameters (`*_res_proj`: a `[1, d]` `PseudoQuery`, `*_res_norm`: a `KeyNorm`) are no `nn.Linear`, so
LoRA never wraps them; PEFT trains them through `modules_to_save`, which swaps a `ModulesToSaveWrapper` in on the
owner. The aggregation points look their modules up by name at every use (`NamedPoint`), so the wrapper's trainable
copy is the one that computes, on the grad path and on Block's no-grad bank path alike. `RECIPE` below is the README
recipe, and `test_the_readme_recipe` runs exactly its text.

Layer 0's attention-side point has a single source (the embedding), whose weight is exactly 1: its two parameters
never change the function and never receive a gradient (`AttnResConfig`'s docstring). PEFT's `modules_to_save`
matches them by name like the others; the tests below leave them out of "changes the logits" and "receives a
gradient", and check that they indeed do neither.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from safetensors import safe_open

from attnres.layers import KeyNorm, PseudoQuery
from attnres.models import AttnResForCausalLM
from tests.models import off_init_

# The README recipe, run as is by `test_the_readme_recipe`: the caller provides `base_folder` (an AttnRes checkpoint),
# `adapter_folder` and `batches` (LongTensors [batch, seq]).
RECIPE = '''\
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from attnres.models import AttnResForCausalLM

model = AttnResForCausalLM.from_pretrained(base_folder)  # an AttnRes checkpoint, e.g. from `attnres convert`
model.activation_checkpointing_enable()  # transformers' older name: gradient_checkpointing_enable()
lora = LoraConfig(
    r=16,
    lora_alpha=32,
    target_modules="all-linear",  # the attention and MLP projections of any family (the AttnRes queries are no Linear)
    modules_to_save=[  # the AttnRes pseudo-queries and key gains: trained in full, saved with the adapter
        "self_attention_res_proj", "self_attention_res_norm",
        "mlp_res_proj", "mlp_res_norm",
        "output_attn_res_proj", "output_attn_res_norm",
    ],
    task_type="CAUSAL_LM",
)
model = get_peft_model(model, lora)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model.train()
for input_ids in batches:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(adapter_folder)  # the LoRA weights and the AttnRes parameters

# later: the adapter on a fresh copy of the base model ...
loaded = PeftModel.from_pretrained(AttnResForCausalLM.from_pretrained(base_folder), adapter_folder)
# ... or merged into one (in place): a plain AttnResForCausalLM holding the trained AttnRes parameters
merged = PeftModel.from_pretrained(AttnResForCausalLM.from_pretrained(base_folder), adapter_folder).merge_and_unload()
'''

ATTNRES_MODULES = [
    "self_attention_res_proj",
    "self_attention_res_norm",
    "mlp_res_proj",
    "mlp_res_norm",
    "output_attn_res_proj",
    "output_attn_res_norm",
]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = 3
RESIDUALS = {"full": dict(residual="full"), "block": dict(residual="block", attn_res_block_size=2)}
SINGLE_SOURCE = "model.layers.0.self_attention_res"  # its only source, the embedding, has weight exactly 1
# the grad and no-grad paths, and a merged LoRA, differ from each other only by fp32 rounding
TOL = dict(rtol=1e-5, atol=1e-5)


def attnres_prefixes() -> list[str]:
    """Every aggregation point's K3 prefix, under the causal LM, in schedule order."""
    sides = ["self_attention_res", "mlp_res"]
    return [f"model.layers.{i}.{side}" for i in range(LAYERS) for side in sides] + ["model.output_attn_res"]


def base_model(tiny_config, residual: str) -> AttnResForCausalLM:
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=LAYERS, **RESIDUALS[residual]))
    off_init_(model)
    return model


def wrapper(peft_model, prefix: str, kind: str) -> ModulesToSaveWrapper:
    """The ModulesToSaveWrapper PEFT put in place of `{prefix}_{kind}` (kind: "proj" or "norm")."""
    module = peft_model.base_model.model.get_submodule(f"{prefix}_{kind}")
    assert isinstance(module, ModulesToSaveWrapper)
    return module


def trainable_copy(peft_model, prefix: str, kind: str) -> torch.nn.Parameter:
    return wrapper(peft_model, prefix, kind).modules_to_save["default"].weight


def logits(model, ids: torch.Tensor, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(input_ids=ids).logits.detach()


IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------------------------------
# modules_to_save: the trainable copies compute


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_the_trainable_copies_are_what_computes(tiny_config, residual, grad):
    """Each point's trainable copy (query and key gain alike) changes the logits, on the grad path and on Block's
    no-grad bank path; the originals compute again with the adapter disabled."""
    model = base_model(tiny_config, residual).eval()
    before = logits(model, IDS, grad)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=ATTNRES_MODULES))
    peft_model.eval()
    torch.testing.assert_close(logits(peft_model, IDS, grad), before, rtol=0, atol=0)  # the copies start equal
    for prefix in attnres_prefixes():
        for kind in ("proj", "norm"):
            copy_weight = trainable_copy(peft_model, prefix, kind)
            saved = copy_weight.detach().clone()
            with torch.no_grad():
                copy_weight.add_(0.5 * torch.randn(copy_weight.shape))
            change = (logits(peft_model, IDS, grad) - before).abs().max().item()
            if prefix == SINGLE_SOURCE:
                assert change == 0.0, (prefix, kind)
            else:
                assert change > 1e-4, (prefix, kind, change)
            with peft_model.disable_adapter():  # the original module computes
                torch.testing.assert_close(logits(peft_model, IDS, grad), before, rtol=0, atol=0)
            with torch.no_grad():
                copy_weight.copy_(saved)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_training_moves_the_copies_and_lowers_the_loss(tiny_config, residual):
    model = base_model(tiny_config, residual).train()
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=ATTNRES_MODULES))
    trainable = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone() for name, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for prefix in attnres_prefixes():
        for kind in ("proj", "norm"):
            name = next(n for n in trainable if f"{prefix}_{kind}.modules_to_save" in n)
            moved = not torch.equal(trainable[name], start[name])
            assert moved == (prefix != SINGLE_SOURCE), name
    lora_b = [name for name in trainable if "lora_B" in name]
    assert len(lora_b) == 2 * LAYERS and all(not torch.equal(trainable[n], start[n]) for n in lora_b)
    for name, p in peft_model.base_model.model.named_parameters():  # everything else, originals included, is frozen
        original = name.replace(".original_module", "").replace(".base_layer", "")
        if original in originals and not p.requires_grad:
            assert torch.equal(p, originals[original]), name


# ---------------------------------------------------------------------------------------------------------------------
# target_modules="all-linear"


def lora_modules(peft_model) -> set[str]:
    return {name for name, m in peft_model.base_model.model.named_modules() if isinstance(m, LoraLayer)}


@pytest.mark.parametrize("residual", RESIDUALS)
def test_all_linear_adapts_the_projections_only(tiny_config, residual):
    peft_model = get_peft_model(base_model(tiny_config, residual), LoraConfig(target_modules="all-linear"))
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    want = {
        f"model.layers.{i}.{'self_attn' if p in attention else 'mlp'}.{p}" for i in range(LAYERS) for p in PROJECTIONS
    }
    assert lora_modules(peft_model) == want  # no adapter on a query, a key gain or the head
    inner = peft_model.base_model.model
    for prefix in attnres_prefixes():
        assert type(inner.get_submodule(f"{prefix}_proj")) is PseudoQuery
        assert type(inner.get_submodule(f"{prefix}_norm")) is KeyNorm


def dead_trainable_parameters(peft_model) -> list[str]:
    return [n for n, p in peft_model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]


@pytest.mark.parametrize("residual", RESIDUALS)
def test_every_lora_parameter_receives_a_gradient(tiny_config, residual):
    """With a nonzero B init after one backward; with PEFT's default init (B = 0, so A has no gradient yet) after one
    optimizer step."""
    peft_model = get_peft_model(
        base_model(tiny_config, residual), LoraConfig(target_modules="all-linear", init_lora_weights=False)
    ).train()
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    assert dead_trainable_parameters(peft_model) == []

    peft_model = get_peft_model(base_model(tiny_config, residual), LoraConfig(target_modules="all-linear")).train()
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    assert all("lora_A" in n for n in dead_trainable_parameters(peft_model))
    optimizer.step()
    optimizer.zero_grad()
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    assert dead_trainable_parameters(peft_model) == []


@pytest.mark.parametrize("residual", RESIDUALS)
def test_no_dead_trainable_parameter_in_the_recipe_but_the_single_source_point(tiny_config, residual):
    """LoRA on all linears plus the AttnRes parameters: one backward reaches every trainable parameter except the two
    of layer 0's attention-side point, whose single source has weight exactly 1."""
    lora = LoraConfig(target_modules="all-linear", modules_to_save=ATTNRES_MODULES, init_lora_weights=False)
    peft_model = get_peft_model(base_model(tiny_config, residual), lora).train()
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    dead = dead_trainable_parameters(peft_model)
    assert sorted(dead) == sorted(
        f"base_model.model.{SINGLE_SOURCE}_{kind}.modules_to_save.default.weight" for kind in ("norm", "proj")
    )


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_gradients_are_the_same_with_activation_checkpointing(tiny_config, use_reentrant):
    """Checkpointing enabled before or after wrapping; reentrant checkpointing needs the embedding output to require
    grad (transformers and PEFT both arrange it), else layer 0's adapters would get none. The same ops run, so the
    gradients are bit for bit those without checkpointing."""
    lora = LoraConfig(target_modules="all-linear", modules_to_save=ATTNRES_MODULES, init_lora_weights=False)

    def gradients(when: str | None) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)  # the same base model
        model = base_model(tiny_config, "block").train()
        if when == "before":
            model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        torch.manual_seed(1)  # the same LoRA init
        peft_model = get_peft_model(model, lora).train()
        if when == "after":
            peft_model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        assert all(layer.gradient_checkpointing == (when is not None) for layer in model.model.layers)
        loss = peft_model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}

    want_loss, want = gradients(None)
    for when in ("before", "after"):
        loss, got = gradients(when)
        assert torch.equal(loss, want_loss)
        assert got.keys() == want.keys()
        for name, grad in want.items():
            if grad is None:
                assert got[name] is None, name
            else:
                assert torch.equal(got[name], grad), (when, name)


# ---------------------------------------------------------------------------------------------------------------------
# the README recipe: train, save the adapter, load it onto a fresh base, merge


@pytest.mark.parametrize("residual", RESIDUALS)
def test_the_readme_recipe(tiny_config, residual, tmp_path):
    base_folder, adapter_folder = tmp_path / "base", tmp_path / "adapter"
    base = base_model(tiny_config, residual)  # an AttnRes checkpoint: its queries already trained
    base.save_pretrained(base_folder)
    base.eval()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    namespace = dict(base_folder=str(base_folder), adapter_folder=str(adapter_folder), batches=[ids] * 8)
    exec(compile(RECIPE, "RECIPE", "exec"), namespace)
    model, loaded, merged = namespace["model"], namespace["loaded"], namespace["merged"]

    # it trained with activation checkpointing, and the loss went down
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)
    with torch.no_grad():
        assert merged.eval()(input_ids=ids, labels=ids).loss < base(input_ids=ids, labels=ids).loss - 0.05

    # the adapter file holds the LoRA weights and every AttnRes parameter, nothing of the base model
    with safe_open(adapter_folder / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    attnres_keys = {f"base_model.model.{p}_{kind}.weight" for p in attnres_prefixes() for kind in ("proj", "norm")}
    lora_keys = {
        f"base_model.model.model.layers.{i}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}.lora_{ab}.weight"
        for i in range(LAYERS)
        for p in PROJECTIONS
        for ab in "AB"
    }
    assert keys == attnres_keys | lora_keys
    trained = {f"{p}_{kind}": trainable_copy(model, p, kind) for p in attnres_prefixes() for kind in ("proj", "norm")}
    with safe_open(adapter_folder / "adapter_model.safetensors", "pt") as f:
        for name, weight in trained.items():
            assert torch.equal(f.get_tensor(f"base_model.model.{name}.weight"), weight.detach()), name
    for name, weight in trained.items():  # (AdamW's weight decay also moves the single-source point's, harmlessly)
        assert name.startswith(SINGLE_SOURCE) or not torch.equal(weight, base.get_parameter(f"{name}.weight")), name

    # on a fresh base, the same logits (grad and no-grad paths); merged, the same logits, as a plain AttnRes model
    model.eval()
    loaded.eval()
    for grad in (True, False):
        want = logits(model, ids, grad)
        torch.testing.assert_close(logits(loaded, ids, grad), want, rtol=0, atol=0)
        torch.testing.assert_close(logits(merged, ids, grad), want, **TOL)
    assert type(merged) is AttnResForCausalLM
    assert not any(isinstance(m, (LoraLayer, ModulesToSaveWrapper)) for m in merged.modules())
    for name, weight in trained.items():
        assert torch.equal(merged.get_parameter(f"{name}.weight"), weight.detach()), name

    # the merged model saves and loads as an AttnRes checkpoint (strict about its AttnRes weights)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AttnResForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(reloaded, ids, False), logits(merged, ids, False), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# what PEFT mode is refused


def test_mixed_adapter_batches_are_refused_not_silently_wrong(tiny_config):
    """PEFT's mixed-adapter batches route each row through its adapter only in modules whose forward PEFT calls; an
    aggregation point reads its parameters' weights, which would give every row the active adapter's: refused."""
    model = base_model(tiny_config, "block").eval()
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=ATTNRES_MODULES)
    peft_model = get_peft_model(model, lora, adapter_name="a")
    peft_model.add_adapter("b", copy.deepcopy(lora))
    peft_model.eval()
    for grad in (True, False):  # the training path and Block's bank path read the weights alike
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="adapter_names: PEFT mixed-adapter batches"):
            peft_model(input_ids=IDS, adapter_names=["a", "b"])
    with torch.no_grad():  # the hooks are gone afterwards: one adapter per batch still runs
        assert torch.isfinite(peft_model(input_ids=IDS).logits).all()


def test_the_row_routing_check_runs_only_while_adapters_are_set(tiny_config, monkeypatch):
    """The check reads every aggregation point's modules' hooks: a model without PEFT adapters is spared it."""
    model = base_model(tiny_config, "block").eval()
    checked = []
    monkeypatch.setattr(type(model), "_refuse_row_routing", lambda self, points: checked.append(len(points)))
    with torch.no_grad():
        model(IDS)
        assert checked == []
        peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
        peft_model(input_ids=IDS)
        assert checked == [len(model.aggregation_points())]
        peft_model.unload()(IDS)
    assert len(checked) == 1


def test_the_readme_shows_the_recipe_that_runs():
    """README and test cannot drift: the README's fine-tuning example is `RECIPE`, character for character."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"```python\n{RECIPE}```" in readme
