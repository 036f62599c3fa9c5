"""The training loop on tiny real models: bit-exact resume, divergence, run folder, bad input, the CLI."""

import json
import math

import pytest
import torch

from attnres.cli import main
from attnres.training import (
    TrainConfig,
    TrainingDiverged,
    latest_checkpoint,
    load_checkpoint,
    load_trained_model,
    read_log,
    train,
)
from attnres.training.loop import build_model


def tiny(tmp_path, name="run", **overrides) -> TrainConfig:
    settings = dict(
        data="stdlib", max_bytes=30_000, residual="block", block_size=1, layers=2, dim=16, heads=2, ffn=32,
        seq_len=16, batch_size=2, steps=6, warmup=2, eval_interval=3, eval_batches=2, log_interval=1,
        checkpoint_interval=100, out=str(tmp_path / name), progress=False, threads=1,  # tiny: overhead-bound
    )
    return TrainConfig(**{**settings, **overrides})


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    """`threads` sets torch's process-wide thread count: give the next test modules theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def training_curve(run_dir) -> list[tuple]:
    """Every log line but the timings and the memory lines (each invocation writes its own after its first step)."""
    return [(r["kind"], r["step"], r.get("loss"), r.get("lr"), r.get("grad_norm"), r.get("val_loss"))
            for r in read_log(run_dir) if r["kind"] != "memory"]


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


class FailAtTrainingStep:
    """A forward hook that spoils the loss of the n-th training forward: NaN, or an exception (a crash)."""

    def __init__(self, model, n: int, crash: bool = False):
        self.n, self.crash, self.calls = n, crash, 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if not module.training:
            return output
        self.calls += 1
        if self.calls == self.n:
            if self.crash:
                raise KeyboardInterrupt("simulated crash")
            output.loss = output.loss * float("nan")
        return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 6-step run that is never stopped: the reference for the resume tests."""
    tmp = tmp_path_factory.mktemp("reference")
    result = train(tiny(tmp))
    return result, params(result.model)


def test_stopped_and_resumed_run_ends_bit_identical(tmp_path, uninterrupted):
    reference, reference_params = uninterrupted
    first = train(tiny(tmp_path, stop_after=3))
    assert first.steps == 3 and latest_checkpoint(first.run_dir / "checkpoints").name == "step-000003"
    resumed = train(tiny(tmp_path, resume=True))
    assert resumed.steps == 6
    assert_same_params(params(resumed.model), reference_params)
    assert resumed.final_val_loss == reference.final_val_loss
    assert training_curve(resumed.run_dir) == training_curve(reference.run_dir)


def test_trained_model_loads_back_from_its_run_folder(uninterrupted):
    reference, reference_params = uninterrupted
    model = load_trained_model(reference.run_dir)
    assert type(model) is type(reference.model) and model.config.residual == "block" and not model.training
    assert_same_params(params(model), reference_params)
    with pytest.raises(ValueError, match="step: .* has no checkpoint of step 3"):
        load_trained_model(reference.run_dir, step=3)


@pytest.mark.parametrize(
    "checkpoint_interval, crash_at, logged_before_crash",
    [(2, 4, [1, 2, 3]), (100, 2, [1])],  # step 3 lies past the last checkpoint; no checkpoint at all
    ids=["after-checkpoint", "before-any-checkpoint"],
)
def test_crashed_run_resumes_bit_identical(tmp_path, uninterrupted, checkpoint_interval, crash_at, logged_before_crash):
    reference, reference_params = uninterrupted
    config = tiny(tmp_path, checkpoint_interval=checkpoint_interval)
    model = build_model(config, vocab_size=256)
    FailAtTrainingStep(model, n=crash_at, crash=True)
    with pytest.raises(KeyboardInterrupt):
        train(config, model=model)
    assert [r["step"] for r in read_log(config.out, "train")] == logged_before_crash
    resumed = train(tiny(tmp_path, checkpoint_interval=checkpoint_interval, resume=True))
    assert_same_params(params(resumed.model), reference_params)
    assert training_curve(config.out) == training_curve(reference.run_dir)  # the redone steps are logged once


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    config = tiny(tmp_path, checkpoint_interval=2)
    model = build_model(config, vocab_size=256)
    FailAtTrainingStep(model, n=5)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 5: the loss is nan.*step-000004") as failure:
        train(config, model=model)
    assert failure.value.step == 5
    last = failure.value.checkpoint
    assert last.name == "step-000004"
    restored = build_model(config, vocab_size=256)
    assert load_checkpoint(last, restored)["step"] == 4
    assert_same_params(params(restored), params(model))  # step 5 never touched the weights
    assert all(torch.isfinite(p).all() for p in model.parameters())
    last_line = read_log(config.out)[-1]
    assert last_line["kind"] == "diverged" and last_line["step"] == 5 and math.isnan(last_line["loss"])


def test_huge_learning_rate_diverges_with_a_clear_message(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d+: the (loss|gradient norm) is (nan|inf)"):
        train(tiny(tmp_path, lr=1e9, warmup=0, grad_clip=0.0, steps=20, eval_interval=100))


def test_weights_that_overflow_are_never_checkpointed(tmp_path, monkeypatch):
    adamw_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):  # an update that leaves one weight infinite, the loss still finite
        adamw_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 1: the parameter \S+ is not finite.*no checkpoint"):
        train(tiny(tmp_path, checkpoint_interval=1))
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None


def test_run_folder_holds_config_log_and_checkpoint(tmp_path):
    config = tiny(tmp_path, residual="full", steps=4, eval_interval=2, log_interval=2)
    result = train(config)
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["train"]["residual"] == "full" and saved["train"]["attn_res_lr_mult"] == 0.1
    assert saved["model"]["residual"] == "full" and saved["model"]["text_config"]["hidden_size"] == 16
    assert saved["data"]["vocab_size"] == 256 and saved["data"]["train_tokens"] + saved["data"]["val_tokens"] > 30_000
    assert saved["num_params"] == result.num_params == sum(p.numel() for p in result.model.parameters())
    assert "git" in saved["environment"] and saved["environment"]["device"] == "cpu"
    train_lines, eval_lines = read_log(result.run_dir, "train"), read_log(result.run_dir, "eval")
    assert [r["step"] for r in train_lines] == [2, 4] and [r["step"] for r in eval_lines] == [0, 2, 4]
    assert set(train_lines[0]) == {"kind", "step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"}
    assert eval_lines[0]["val_loss"] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # untrained
    assert result.val_history == [(r["step"], r["val_loss"]) for r in eval_lines]
    assert result.final_val_loss == eval_lines[-1]["val_loss"] < eval_lines[0]["val_loss"]
    assert result.tokens_per_s > 0
    assert latest_checkpoint(result.run_dir / "checkpoints").name == "step-000004"


def test_existing_run_is_neither_overwritten_nor_resumed_as_a_different_run(tmp_path):
    train(tiny(tmp_path, steps=2, eval_interval=2))
    with pytest.raises(ValueError, match=r"out: .* already holds a run; pass resume=True"):
        train(tiny(tmp_path, steps=2, eval_interval=2))
    with pytest.raises(ValueError, match=r"resume: .* holds a different run.*train.lr"):
        train(tiny(tmp_path, steps=2, eval_interval=2, lr=1e-4, resume=True))
    with pytest.raises(ValueError, match=r"train.steps \(the learning-rate schedule .*\(--stop-after\)"):
        train(tiny(tmp_path, steps=4, eval_interval=2, resume=True))  # a longer run is another schedule
    again = train(tiny(tmp_path, steps=2, eval_interval=2, overwrite=True))
    assert [r["step"] for r in read_log(again.run_dir, "eval")] == [0, 2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(seq_len=64, max_bytes=1000), r"seq_len=64 is longer than the validation split"),
        (dict(seq_len=2000, max_bytes=1000, val_fraction=0.01), r"seq_len=2000 is longer than the training split"),
        (dict(data="/no/such/corpus"), r"data: no such file or directory: /no/such/corpus"),
        (dict(residual="dense"), r"residual: expected one of standard, full, block, got 'dense'"),
        (dict(block_size=0), r"block_size: expected an integer >= 1, got 0"),
        (dict(dim=18, heads=4), r"hidden size \(18\) is not a multiple of the number of attention heads \(4\)"),
        (dict(lr=float("nan")), r"lr: expected a number > 0, got nan"),
    ],
    ids=["seq-longer-than-val", "seq-longer-than-train", "missing-data", "residual", "block-size", "heads", "lr"],
)
def test_bad_settings_fail_at_once_naming_the_setting(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny(tmp_path, **overrides))
    assert not (tmp_path / "run").exists()  # nothing was written before the check


def test_empty_corpus_fails_at_once(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="data: the corpus is empty"):
        train(tiny(tmp_path, data=str(tmp_path / "corpus")))


def test_cli_trains_and_reports_bad_input(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello attention residuals\n" * 100)
    out = tmp_path / "cli-run"
    args = ["train", "--data", str(tmp_path / "a.txt"), "--layers", "1", "--dim", "16", "--heads", "2", "--seq-len", "16",
            "--batch-size", "2", "--steps", "2", "--eval-batches", "1", "--residual", "standard", "--out", str(out),
            "--threads", "1", "--no-progress"]
    torch.set_num_threads(2)
    assert main(args) == 0
    assert torch.get_num_threads() == 1
    assert f"{out}: 2 steps, val loss" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["data"] == str(tmp_path / "a.txt")
    assert main(args[:-3] + ["--out", str(tmp_path / "other"), "--seq-len", "4096", "--no-progress"]) == 2
    assert "seq_len=4096 is longer than the" in capsys.readouterr().err


@pytest.mark.parametrize("residual", ["block", "full"])
def test_bf16_autocast_trains_attn_res_models_with_fp32_weights(tmp_path, residual):
    result = train(tiny(tmp_path, residual=residual, autocast="bf16", steps=2, eval_interval=2))
    assert json.loads((result.run_dir / "config.json").read_text())["environment"]["autocast"] == "torch.bfloat16"
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
    assert math.isfinite(result.final_val_loss) and result.final_val_loss < read_log(result.run_dir, "eval")[0]["val_loss"]


def test_base_family_builds_the_model_on_that_family(tmp_path):
    """`--base qwen3_moe`: the family's own MoE blocks, the sizes and `base_config` applied to its config."""
    config = tiny(tmp_path, base="qwen3_moe", base_config={"num_experts": 4, "num_experts_per_tok": 2}, steps=2)
    result = train(config)
    text_config = result.model.config.text_config
    assert text_config.model_type == "qwen3_moe" and text_config.num_experts == 4
    assert text_config.moe_intermediate_size == 32 and text_config.hidden_size == 16
    assert type(result.model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert math.isfinite(result.final_val_loss)
    with pytest.raises(ValueError, match="base: expected a transformers model_type"):
        tiny(tmp_path, base="not_a_family")


def test_activation_checkpointing_gives_the_same_run(tmp_path):
    plain = train(tiny(tmp_path, name="plain", steps=3))
    checkpointed = train(tiny(tmp_path, name="ckpt", steps=3, activation_checkpointing=True))
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.model.layers)
    assert checkpointed.final_val_loss == pytest.approx(plain.final_val_loss, rel=1e-5)


@pytest.mark.parametrize("field, value", [("head_dim", 16), ("moe_intermediate_size", 24), ("vocab_size", 300)])
def test_base_config_overrides_the_sizes_build_model_derives(tmp_path, field, value):
    """`--base-config` fields win over the sizes derived from `--dim`, `--ffn` and the tokenizer (they raised "got
    multiple values for keyword argument")."""
    config = tiny(tmp_path, base="qwen3_moe", base_config={"num_experts": 4, "num_experts_per_tok": 2, field: value})
    model = build_model(config, vocab_size=256)
    assert getattr(model.config, field) == value


@pytest.mark.parametrize("keep", [False, True], ids=["flushed", "kept"])
def test_a_cpu_run_flushes_subnormals_unless_told_to_keep_them(tmp_path, keep):
    """x86 takes an assist per operation on a subnormal float, and a depth softmax's tiny weights make them in the
    sublayers' backward: a CPU run flushes them to zero process-wide (torch.set_flush_denormal) unless kept."""
    subnormal = torch.tensor(torch.finfo(torch.float32).tiny) / 4
    assert subnormal > 0, "this test expects torch's default, subnormals kept"
    train(tiny(tmp_path, steps=2, eval_interval=2, keep_subnormals=keep))
    assert (torch.tensor(torch.finfo(torch.float32).tiny) / 4 > 0) == keep
