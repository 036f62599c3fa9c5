"""Atomic writes: a failure in the middle of writing leaves the previous file or checkpoint intact and loadable."""

import os

import pytest
import torch
from torch import nn

from attnres import atomic
from attnres.training import checkpoint as ckpt


class Failure(OSError):
    pass


def partial_then_fail(write):
    """A writer that gets halfway through the file, then fails (a full disk, a killed process)."""

    def failing(*args, **kwargs):
        write(*args, **kwargs)
        target = next(a for a in args if isinstance(a, (str, os.PathLike)))
        data = open(target, "rb").read()
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2])
        raise Failure("disk full")

    return failing


def state_of(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"sampler": {"generator": generator.get_state()}, "values": [step, 0.5, "x", (1, 2)]}


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "config.json"
    atomic.atomic_write_text(path, "old")
    with pytest.raises(Failure):
        atomic.atomic_write(path, partial_then_fail(lambda tmp: tmp.write_text("new content, long enough")))
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["config.json"]  # the temporary file is gone
    atomic.atomic_write_text(path, "new")
    assert path.read_text() == "new"


@pytest.mark.parametrize("failing", ["save_model", "torch_save"])
def test_checkpoint_write_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failing):
    model = nn.Linear(4, 3)
    ckpt.save_checkpoint(tmp_path, 1, model, state_of(1))
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    if failing == "save_model":
        monkeypatch.setattr(ckpt, "save_model", partial_then_fail(ckpt.save_model))
    else:
        monkeypatch.setattr(ckpt.torch, "save", partial_then_fail(torch.save))
    with pytest.raises(Failure):
        ckpt.save_checkpoint(tmp_path, 2, model, state_of(2))
    monkeypatch.undo()

    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000001"]
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]  # nothing half-written left behind
    fresh = nn.Linear(4, 3)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), fresh)
    assert all(torch.equal(fresh.state_dict()[k], good[k]) for k in good)
    assert state["step"] == 1 and torch.equal(state["sampler"]["generator"], state_of(1)["sampler"]["generator"])
    assert state["values"] == [1, 0.5, "x", (1, 2)]


def test_leftovers_of_a_killed_writer_are_ignored_and_cleared(tmp_path):
    model = nn.Linear(4, 3)
    ckpt.save_checkpoint(tmp_path, 1, model, state_of(1))
    leftover = tmp_path / ".tmp-step-000002.99999"  # the process died before the rename: no cleanup ran
    leftover.mkdir()
    (leftover / ckpt.MODEL_FILE).write_bytes(b"half a file")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001"
    ckpt.save_checkpoint(tmp_path, 3, model, state_of(3), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000003"]


def test_keep_removes_older_checkpoints_and_latest_is_the_highest_step(tmp_path):
    model = nn.Linear(4, 3)
    for step in (5, 10, 100):
        ckpt.save_checkpoint(tmp_path, step, model, state_of(step), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000010", "step-000100"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000100"
    assert ckpt.latest_checkpoint(tmp_path / "none") is None


def test_loading_into_a_different_model_is_refused(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, nn.Linear(4, 3), state_of(1))
    with pytest.raises(ValueError, match="does not match the model"):
        ckpt.load_checkpoint(path, nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(ValueError, match="is not a checkpoint folder"):
        ckpt.load_checkpoint(tmp_path, nn.Linear(4, 3))
