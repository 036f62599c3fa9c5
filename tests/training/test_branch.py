"""WSD branches: a run decayed from a longer run's checkpoint ends as the same run trained from scratch."""

import pytest
import torch

from attnres.cli import main
from attnres.training import TrainConfig, read_log, train
from attnres.training.optim import wsd_decay_start

from .test_loop import params, restore_threads, tiny  # noqa: F401  (restore_threads: autouse fixture)


def wsd(tmp_path, name, **overrides) -> TrainConfig:
    settings = dict(schedule="wsd", warmup=2, decay_fraction=0.25, checkpoint_interval=1, keep_checkpoints=20)
    return tiny(tmp_path, name, **{**settings, **overrides})


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """12 steps, WSD (decay over the last 3), a checkpoint at every step."""
    return train(wsd(tmp_path_factory.mktemp("long"), "long", steps=12))


@pytest.mark.parametrize("steps", [6, 8])
def test_branch_ends_with_the_weights_of_a_run_from_scratch(tmp_path, long_run, steps):
    start = wsd_decay_start(steps=steps, warmup=2, decay_fraction=0.25)
    branch = train(wsd(tmp_path, "branch", steps=steps,
                       branch_from=str(long_run.run_dir / "checkpoints" / f"step-{start:06d}")))
    scratch = train(wsd(tmp_path, "scratch", steps=steps))
    got, want = params(branch.model), params(scratch.model)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert branch.final_val_loss == scratch.final_val_loss
    assert [r["step"] for r in read_log(branch.run_dir, "train")] == list(range(start + 1, steps + 1))  # decay only
    assert (branch.run_dir / "final" / "model.safetensors").is_file()


def test_branch_resumes_from_its_own_checkpoint(tmp_path, long_run):
    source = str(long_run.run_dir / "checkpoints" / "step-000006")
    first = train(wsd(tmp_path, "branch", steps=8, branch_from=source, stop_after=7))
    assert first.steps == 7
    resumed = train(wsd(tmp_path, "branch", steps=8, branch_from=source, resume=True))
    scratch = train(wsd(tmp_path, "scratch", steps=8))
    got, want = params(resumed.model), params(scratch.model)
    assert resumed.steps == 8 and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("overrides, message", [
    ({"lr": 1e-3}, "train.lr"),
    ({"residual": "full"}, "model"),
    ({"warmup": 1}, "train.warmup"),
    ({"steps": 5}, "past the decay start of this run"),
])
def test_branch_refuses_a_checkpoint_off_its_path(tmp_path, long_run, overrides, message):
    source = str(long_run.run_dir / "checkpoints" / "step-000005")
    with pytest.raises(ValueError, match=message):
        train(wsd(tmp_path, "branch", **{"steps": 8, "branch_from": source, **overrides}))
    assert not (tmp_path / "branch").exists()  # refused before anything was written


def test_branch_refuses_a_checkpoint_past_the_source_decay(tmp_path, long_run):
    with pytest.raises(ValueError, match="past the decay start of the source run"):
        train(wsd(tmp_path, "branch", steps=16,  # decays from step 12: after the source's start, 9
                  branch_from=str(long_run.run_dir / "checkpoints" / "step-000010")))


def test_branch_needs_wsd_and_a_checkpoint_folder(tmp_path, long_run):
    with pytest.raises(ValueError, match="schedule='wsd'"):
        tiny(tmp_path, schedule="cosine", branch_from=str(long_run.run_dir / "checkpoints" / "step-000005"))
    with pytest.raises(ValueError, match="expected a checkpoint folder"):
        train(wsd(tmp_path, "branch", steps=8, branch_from=str(long_run.run_dir)))


def test_cli_branches(tmp_path, long_run, capsys):
    out = tmp_path / "cli"
    code = main(["train", "--data", "stdlib", "--max-bytes", "30000", "--block-size", "1", "--layers", "2",
                 "--dim", "16", "--heads", "2", "--ffn", "32", "--seq-len", "16", "--batch-size", "2", "--steps", "8",
                 "--warmup", "2", "--schedule", "wsd", "--decay-fraction", "0.25", "--eval-interval", "3",
                 "--eval-batches", "2", "--log-interval", "1", "--threads", "1", "--no-progress", "--out", str(out),
                 "--branch-from", str(long_run.run_dir / "checkpoints" / "step-000006")])
    assert code == 0, capsys.readouterr().err
    assert [r["step"] for r in read_log(out, "train")] == [7, 8]
