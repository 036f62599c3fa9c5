"""The Hugging Face training stack on a tiny Block AttnRes model: `transformers.Trainer` with its default optimizer
(fused AdamW), evaluation, checkpoints and resume; `accelerate.Accelerator`. Everything in memory, no downloads."""

import math

import pytest
import torch

from attnres import AttnResConfig, AttnResForCausalLM

import datasets
import accelerate  # noqa: F401 - a dev dependency: missing, the tests error
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

VOCAB, SEQ = 64, 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls run far faster on one thread than on threads fighting over two shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model() -> AttnResForCausalLM:
    torch.manual_seed(0)
    config = AttnResConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, residual="block", attn_res_block_size=1,
    )
    return AttnResForCausalLM(config)


def token_dataset(rows: int, seed: int) -> "datasets.Dataset":
    """Sequences that count up from a random start (mod VOCAB): a pattern a tiny model learns in a few steps."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, VOCAB, (rows, 1), generator=g) + torch.arange(SEQ)) % VOCAB
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def arguments(out, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-2, eval_strategy="steps", eval_steps=3, save_steps=3, logging_steps=1, use_cpu=True,
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    return TrainingArguments(**{**settings, **overrides})


def trainer(model, out, **overrides) -> Trainer:
    return Trainer(model=model, args=arguments(out, **overrides), train_dataset=token_dataset(32, 0),
                   eval_dataset=token_dataset(8, 1))


def training_losses(trainer: Trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}


def pseudo_queries(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "res_proj" in n])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 6-step Trainer run (evaluations at steps 3 and 6, checkpoints at steps 3 and 6)."""
    out = tmp_path_factory.mktemp("trainer")
    t = trainer(tiny_model(), out)
    t.train()
    return t, out


def test_trainer_fine_tunes_with_its_default_fused_adamw(trained):
    t, _ = trained
    assert t.args.optim == OptimizerNames.ADAMW_TORCH_FUSED  # the default optimizer, unchanged
    assert type(t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer).__name__ == "AdamW"
    losses = training_losses(t)
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1]
    evals = [r for r in t.state.log_history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert pseudo_queries(t.model).abs().max() > 0  # the AttnRes pseudo-queries moved from their zero init


def test_evaluate_after_training_equals_evaluate_of_a_reloaded_copy(trained, tmp_path):
    """The regression test of stale state after fused AdamW's in-place updates (no version-counter bump): the
    trained model in memory must compute what its saved weights compute."""
    t, _ = trained
    in_memory = t.evaluate()["eval_loss"]
    t.model.save_pretrained(tmp_path / "saved")
    reloaded = AttnResForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(pseudo_queries(reloaded), pseudo_queries(t.model))
    again = trainer(reloaded, tmp_path / "eval").evaluate()["eval_loss"]
    assert math.isclose(in_memory, again, rel_tol=1e-6), (in_memory, again)


def test_resume_from_checkpoint_continues_the_run(trained, tmp_path):
    t, out = trained
    checkpoint = out / "checkpoint-3"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    model = tiny_model()
    steps_run = []
    model.register_forward_hook(lambda module, args, output: steps_run.append(1) if module.training else None)
    resumed = trainer(model, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6 and len(steps_run) == 3  # steps 4 to 6, one batch each
    before, after = training_losses(t), training_losses(resumed)
    assert sorted(after) == list(range(1, 7))  # the checkpoint's log, then the steps run here
    for step in (4, 5, 6):  # the losses of the uninterrupted run
        assert math.isclose(after[step], before[step], rel_tol=1e-5), (step, after[step], before[step])
    for (name, p), q in zip(t.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


def test_an_accelerate_step_changes_the_weights():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(token_dataset(8, 2).with_format("torch"), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = next(iter(loader))
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert math.isfinite(loss.item())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    # every parameter took the step, pseudo-queries included, but the first point's: it reads the embedding alone,
    # so its softmax over one source is 1 whatever its query
    assert set(before) - set(changed) == {"model.layers.0.self_attention_res_proj.weight"}
