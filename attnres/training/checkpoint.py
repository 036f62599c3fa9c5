"""Checkpoints of a run folder.

A checkpoint is a folder `checkpoints/step-000200/` holding `model.safetensors` (the weights) and `state.pt` (the
optimizer, the step, the data sampler's generator and the RNG states: tensors and plain containers only, loaded
with `torch.load(weights_only=True)`, so loading never runs code). It is written into a hidden temporary folder
beside it, every file fsynced, then renamed into place in one `os.replace` (`attnres.atomic`): a crash at any point
leaves either the complete new checkpoint or none, and the previous one intact. Only completed folders carry the
`step-NNNNNN` name (`attnres.run_layout`), so the latest checkpoint is simply the highest step.

A distributed run writes `sharded/` instead of `model.safetensors` and the optimizer: every rank saves the weights
and optimizer state it holds (its FSDP2 or tensor-parallel shards, its pipeline stages) through
`torch.distributed.checkpoint`, which keys them by parameter name, so nothing is gathered on one rank. A run resumes
from either kind on any mesh, or in one process: the weights load whole into the model before it is parallelized,
the optimizer state into whatever the rank then holds (`torch.distributed.checkpoint` reshards).
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from attnres.atomic import TMP_PREFIX, atomic_write_dir, fsync_tree, replace_durably
from attnres.run_layout import MODEL_FILE, SHARDED_DIR, STATE_FILE, checkpoint_name, list_checkpoints
from attnres.run_layout import latest_checkpoint  # noqa: F401 - where the training loop finds it


def save_checkpoint(folder: str | os.PathLike, step: int, model: nn.Module, state: dict, keep: int = 1) -> Path:
    """Write checkpoint `step` under `folder` atomically; keep the newest `keep` checkpoints. Returns its path.

    One writer a folder: leftovers of killed writes are removed once a new checkpoint is complete. `state` holds tensors and plain containers only (it must load with `weights_only=True`).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    if final.exists():  # a complete checkpoint of this step already exists (a resumed run reached it again)
        return final

    def write(tmp: Path) -> None:
        save_model(model, str(tmp / MODEL_FILE), metadata={"step": str(step)})
        torch.save({"step": step, **state}, tmp / STATE_FILE)

    atomic_write_dir(final, write)
    stale = [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]  # left by writers that were killed
    for old in stale + list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old)
    return final


def save_sharded_checkpoint(folder: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict, keep: int, ranks) -> Path:
    """Every rank calls it: checkpoint `step` of a distributed run (see the module docstring), written into one
    temporary folder by all ranks, then renamed into place by rank 0; keeps the newest `keep`. Returns its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from attnres.distributed.data_parallel import barrier, collective

    folder = Path(folder)
    final = folder / checkpoint_name(step)
    if final.exists():  # a complete checkpoint of this step already exists (a resumed run reached it again)
        return final
    tmp = folder / f"{TMP_PREFIX}{checkpoint_name(step)}.sharded"  # one name for every rank
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(ranks, "starting a checkpoint")
    shards = {"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optimizer, options=_options())}
    collective(lambda: dcp.save(shards, checkpoint_id=tmp / SHARDED_DIR), "saving a checkpoint")
    if ranks.is_main:
        torch.save({"step": step, **state}, tmp / STATE_FILE)
        fsync_tree(tmp)
        replace_durably(tmp, final)
        stale = [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]  # left by writers that were killed
        for old in stale + list_checkpoints(folder)[:-keep]:
            shutil.rmtree(old)
    barrier(ranks, "finishing a checkpoint")
    return final


@contextmanager
def _one_process_intended():
    """DCP warns that it assumes one process whenever no process group exists, even when told so (`no_dist`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # each parameter's group settings (lr, weight decay, ...) saved under its own name: the ranks hold different
    # parameters (pipeline stages), and a rank that resumes on another mesh finds the settings of its own
    return StateDictOptions(flatten_optimizer_state_dict=True)


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> dict:
    """Load the weights of checkpoint folder `path` (either kind) into the whole `model` (strict, onto its device)
    and return its state dict, on the CPU (generator states must stay there; `Optimizer.load_state_dict` moves its
    own). A sharded checkpoint's optimizer state loads after the model is parallelized: `load_sharded_optimizer`."""
    path = Path(path)
    sharded = (path / SHARDED_DIR).is_dir()
    if not ((path / MODEL_FILE).is_file() or sharded) or not (path / STATE_FILE).is_file():
        raise ValueError(f"checkpoint: {path} is not a checkpoint folder (expected {MODEL_FILE} or {SHARDED_DIR}/, "
                         f"and {STATE_FILE})")
    if sharded:
        _load_sharded_weights(path, model)
    else:
        device = next(model.parameters()).device
        missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False, device=str(device))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint: {path} does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def _load_sharded_weights(path: Path, model: nn.Module) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    weights = get_model_state_dict(model)
    try:
        with _one_process_intended():
            dcp.load({"model": weights}, checkpoint_id=path / SHARDED_DIR, no_dist=True)  # whole, on each rank
    except dcp.api.CheckpointException as e:  # a missing or mis-shaped tensor
        raise ValueError(f"checkpoint: {path} does not match the model: {e}") from e
    set_model_state_dict(model, weights)


def load_sharded_optimizer(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's optimizer state into what this rank's optimizer holds (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options())
    with _one_process_intended():
        dcp.load({"optim": state}, checkpoint_id=Path(path) / SHARDED_DIR,
                 no_dist=not torch.distributed.is_initialized())
    set_optimizer_state_dict(model, optimizer, state, options=_options())


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()
