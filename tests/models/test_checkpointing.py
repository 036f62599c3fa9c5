"""Activation checkpointing of whole decoder layers (`AttnResDecoderLayer` is transformers' `GradientCheckpointingLayer`).

`model.activation_checkpointing_enable()` (transformers' older name: `gradient_checkpointing_enable()`), or
`TrainingArguments(activation_checkpointing=True)`, makes each decoder layer recompute itself in backward from the
residual state it took. The recompute runs the very same ops on the same inputs (and, with dropout, the same random
state), so the loss and every gradient are bit for bit those without checkpointing, on one thread and on CPU: the tests
assert exact equality. `benchmarks/activation_memory.py` measures the memory and time at a realistic size.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from attnres.models import AttnResConfig, AttnResForCausalLM
from tests.models import TINY, off_init_

BASE = TINY
GEMMA = dict(head_dim=16, sliding_window=5)  # a window shorter than the sequence
# llama: fused plain RMSNorm PreNorms; gemma2 and gemma3_text: 1 + w norms applied to the mixture, and post-sublayer
# norms inside the checkpointed sublayer
FAMILIES = {
    "llama": dict(base_model_type="llama"),
    "gemma2": dict(base_model_type="gemma2", **GEMMA),
    "gemma3": dict(base_model_type="gemma3_text", **GEMMA),
}
RESIDUALS = {
    "standard": dict(residual="standard"),
    # Full pinned to the chain or to groups: by itself it takes groups only when not checkpointed
    "full": dict(residual="full", attn_res_full_group=0),
    "full-groups": dict(residual="full", attn_res_full_group=3),
    "block": dict(residual="block", attn_res_block_size=2),
    "block-two-phase": dict(residual="block", attn_res_block_size=2, attn_res_two_phase=True),
}
REENTRANT = [pytest.param(False, id="non-reentrant"), pytest.param(True, id="reentrant")]
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def make_model(family: str = "llama", residual: str = "block", **fields) -> AttnResForCausalLM:
    """A tiny model in training mode, its queries and key gains off their init (a zero query hides its key gain)."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**{**BASE, **FAMILIES[family], **RESIDUALS[residual], **fields}))
    off_init_(model, seed=2)
    return model.train()


def training_step(model, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same_step(got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    assert torch.equal(loss, want_loss), (loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        if grad is None:
            assert grads[name] is None, name
        else:
            assert grads[name] is not None and torch.equal(grads[name], grad), name


# ---------------------------------------------------------------------------------------------------------------------
# the same loss and gradients


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_gives_the_same_loss_and_every_gradient(family, residual, use_reentrant):
    model = make_model(family, residual)
    want = training_step(model)
    assert want[0].isfinite()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert_same_step(training_step(model), want)
    model.activation_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    assert_same_step(training_step(model), want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("residual", ["standard", "block"])
def test_the_recompute_draws_the_same_dropout_masks(residual, use_reentrant):
    """Attention dropout inside the checkpointed sublayer: torch's checkpoint restores the random state for the
    recompute. """
    model = make_model("llama", residual)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    want = training_step(model)
    model.eval()
    assert not torch.equal(training_step(model)[0], want[0])  # dropout acts
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert_same_step(training_step(model), want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_attention_dropout_set_in_the_config_acts_and_checkpoints_exactly(use_reentrant):
    """`attention_dropout` in the config reaches the family's attention, drops out in training only, and the
    checkpointed step is the same step."""
    model = make_model("llama", "block", attention_dropout=0.3)
    assert [layer.self_attn.attention_dropout for layer in model.model.layers] == [0.3] * BASE["num_hidden_layers"]
    want = training_step(model)
    model.eval()
    assert not torch.equal(training_step(model)[0], want[0])
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert_same_step(training_step(model), want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_the_older_name_gradient_checkpointing_enable_works_too(use_reentrant):
    model = make_model("llama", "full")
    want = training_step(model)
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):  # deprecated by transformers 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_activation_checkpointing and all(layer.gradient_checkpointing for layer in model.model.layers)
    assert_same_step(training_step(model), want)


# ---------------------------------------------------------------------------------------------------------------------
# the sublayers are recomputed


def count_calls(model) -> tuple[dict[str, int], list]:
    """Forward calls of every attention and MLP body, counted by a forward pre-hook (a forward hook would miss the
    recompute: non-reentrant checkpointing stops it as soon as the last saved tensor is rebuilt, before the body
    returns)."""
    counts: dict[str, int] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for side in layer.sides:
            key = f"{i}.{side.body}"
            counts[key] = 0

            def hook(module, args, key=key):
                counts[key] += 1

            handles.append(getattr(layer, side.body).register_forward_pre_hook(hook))
    return counts, handles


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_each_attention_and_mlp_runs_twice_a_step_with_checkpointing(residual, use_reentrant):
    """Once in forward, once more in backward; without checkpointing, and with it where no gradient is recorded (eval
    mode, no_grad), once."""
    model = make_model("llama", residual)
    counts, handles = count_calls(model)
    assert sorted(counts) == sorted(f"{i}.{b}" for i in range(3) for b in ("self_attn", "mlp"))

    def calls(step) -> set[int]:
        for key in counts:
            counts[key] = 0
        step()
        return set(counts.values())

    assert calls(lambda: training_step(model)) == {1}
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert calls(lambda: training_step(model)) == {2}
    with torch.no_grad():
        assert calls(lambda: model(input_ids=IDS)) == {1}
    model.eval()
    assert calls(lambda: model(input_ids=IDS, labels=IDS).loss.backward()) == {1}
    for handle in handles:
        handle.remove()


def test_use_cache_in_a_checkpointed_training_step_keeps_no_cache():
    """A recompute must not append its keys and values to a cache a second time: the cache is dropped (transformers
    logs that it sets use_cache=False), and the gradients are those of a step without checkpointing."""
    model = make_model("llama", "block")

    def step() -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS, use_cache=True)
        out.loss.backward()
        return out.past_key_values, (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})

    cache, want = step()
    assert cache is not None and cache.get_seq_length() == IDS.shape[1]
    model.activation_checkpointing_enable()
    cache, got = step()
    assert cache is None
    assert_same_step(got, want)


def test_every_n_layers_checkpoints_every_nth_layer_as_transformers_llama_does():
    llama = LlamaForCausalLM(LlamaConfig(**{**BASE, "num_hidden_layers": 4}))
    llama.activation_checkpointing_enable(every_n_layers=2)
    want = [layer.gradient_checkpointing for layer in llama.model.layers]
    assert want == [True, False, True, False]
    model = make_model("llama", "block", num_hidden_layers=4)
    model.activation_checkpointing_enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == want


# ---------------------------------------------------------------------------------------------------------------------
# transformers' Trainer


def train_with_trainer(tmp_path, residual: str, checkpointing: dict) -> tuple[list[float], AttnResForCausalLM, dict]:
    from datasets import Dataset

    model = make_model("llama", residual)
    counts, handles = count_calls(model)
    ids = torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(4)).tolist()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **checkpointing,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
    trainer.train()
    for handle in handles:
        handle.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, model, counts


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing:FutureWarning")  # the older argument name
@pytest.mark.parametrize("argument", ["gradient_checkpointing", "activation_checkpointing"])
@pytest.mark.parametrize("residual", ["full", "block"])
def test_trainer_with_checkpointing_trains_as_without(tmp_path, residual, argument):
    """Three steps on an in-memory `datasets.Dataset`: the same losses and final weights as without checkpointing,
    and every attention and MLP ran twice a step."""
    want_losses, want_model, want_counts = train_with_trainer(tmp_path / "plain", residual, {})
    losses, model, counts = train_with_trainer(tmp_path / "ckpt", residual, {argument: True})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert set(want_counts.values()) == {3} and set(counts.values()) == {6}
    assert len(losses) == 3 and losses == want_losses
    want_state = want_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want_state[name]), name
    query = "model.output_attn_res_proj.weight"
    assert not torch.equal(model.state_dict()[query], make_model("llama", residual).state_dict()[query])  # it trained


# ---------------------------------------------------------------------------------------------------------------------
# memory


def saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes autograd holds for one training step: the unique storages of every tensor saved for backward, parameters
    left out (they are held anyway). torch's non-reentrant checkpoint also saves its inputs through these hooks, the
    reentrant one through `save_for_backward`; either way the inputs of a recompute are counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_checkpointing_holds_at_least_half_fewer_bytes(residual, use_reentrant):
    """At d = 64, 4 layers, 2 x 64 tokens the measured ratio is 3.7 (standard) to 4.5 (Block); assert 2."""
    model = make_model("llama", residual, hidden_size=64, intermediate_size=256, num_hidden_layers=4)
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(5))
    plain = saved_bytes(model, ids)
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    checkpointed = saved_bytes(model, ids)
    assert plain >= 2 * checkpointed, (plain, checkpointed)
