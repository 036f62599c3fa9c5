"""Checkpoints of a run folder.

A checkpoint is a folder `checkpoints/step-000200/` holding `model.safetensors` (the weights) and `state.pt` (the
optimizer, the step, the data sampler's generator and the RNG states: tensors and plain containers only, loaded
with `torch.load(weights_only=True)`, so loading never runs code). It is written into a hidden temporary folder
beside it, every file fsynced, then renamed into place in one `os.replace` (`attnres.atomic`): a crash at any point
leaves either the complete new checkpoint or none, and the previous one intact. Only completed folders carry the
`step-NNNNNN` name (`attnres.run_layout`), so the latest checkpoint is simply the highest step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from attnres.atomic import TMP_PREFIX, atomic_write_dir
from attnres.run_layout import MODEL_FILE, STATE_FILE, checkpoint_name, list_checkpoints
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


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> dict:
    """Load the weights of checkpoint folder `path` into `model` (strict, onto its device) and return its state
    dict, on the CPU (generator states must stay there; `Optimizer.load_state_dict` moves its own)."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file() or not (path / STATE_FILE).is_file():
        raise ValueError(f"checkpoint: {path} is not a checkpoint folder (expected {MODEL_FILE} and {STATE_FILE})")
    device = next(model.parameters()).device
    missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False, device=str(device))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: {path} does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
