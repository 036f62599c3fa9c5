"""The names inside a training run folder, for the code that writes it (`attnres.training`) and the code that reads
it (generation, analysis); the standard library only, so a reader imports none of the training code.

    RUN/config.json                              what the run is: {"train": ..., "model": ..., ...}
    RUN/log.jsonl                                what it did, one JSON record a line
    RUN/checkpoints/step-000200/model.safetensors, state.pt
    RUN/final/                                   a transformers folder, once the run reached its last step
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = "config.json"
LOG_FILE = "log.jsonl"
CHECKPOINTS = "checkpoints"
FINAL = "final"
MODEL_FILE = "model.safetensors"  # a checkpoint's weights
STATE_FILE = "state.pt"  # a checkpoint's optimizer, step, sampler and RNG states
SHARDED_DIR = "sharded"  # a distributed run's checkpoint: its weights and optimizer state as the ranks held them
_PREFIX = "step-"


def is_run_config(saved: dict) -> bool:
    """Whether a config.json's contents are a run folder's (not a transformers model's)."""
    return "train" in saved and "model" in saved


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of checkpoint folder `path`, read from its name."""
    name = Path(path).name
    if not name.startswith(_PREFIX) or not name[len(_PREFIX):].isdigit():
        raise ValueError(f"checkpoint: expected a folder named {_PREFIX}NNNNNN, got {name!r}")
    return int(name[len(_PREFIX):])


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Completed checkpoints under `folder`, oldest first (temporary folders of interrupted writes are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None
