"""Atomic files and checkpoints of a run folder.

A checkpoint is a folder `checkpoints/step-000200/` holding `model.safetensors` (the weights) and `state.pt` (the
optimizer, the step, the data sampler's generator and the RNG states: tensors and plain containers only, loaded
with `torch.load(weights_only=True)`, so loading never runs code). It is written into a hidden temporary folder
beside it, every file fsynced, then renamed into place in one `os.replace`: a crash at any point leaves either
the complete new checkpoint or none, and the previous one intact. Only completed folders carry the
`step-NNNNNN` name, so the latest checkpoint is simply the highest step.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)` on a temporary file beside `path`, fsync it, then rename it to `path`.

    Readers see the old file or the complete new one, never a partial one; the temporary file is removed if
    `write` fails.
    """
    path = Path(path)
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` on an empty temporary folder beside `path`, fsync its files, then rename it to `path`.

    A folder already at `path` is first renamed aside and removed once the new one is in place, so a reader sees
    the old complete folder, or (for the instant between the two renames) none, or the new complete one; never a
    partial one. The temporary folder is removed if `write` fails.
    """
    path = Path(path)
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    old = path.with_name(f"{_TMP_PREFIX}{path.name}.old.{os.getpid()}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync(file)
        _fsync_dir(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of checkpoint folder `path`, read from its name."""
    name = Path(path).name
    if not name.startswith(_PREFIX) or not name[len(_PREFIX):].isdigit():
        raise ValueError(f"checkpoint: expected a folder named {_PREFIX}NNNNNN, got {name!r}")
    return int(name[len(_PREFIX):])


def save_checkpoint(folder: str | os.PathLike, step: int, model: nn.Module, state: dict, keep: int = 1) -> Path:
    """Write checkpoint `step` under `folder` atomically; keep the newest `keep` checkpoints. Returns its path.

    One writer a folder: leftovers of killed writes are removed once a new checkpoint is complete. `state` holds tensors and plain containers only (it must load with `weights_only=True`).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    if final.exists():  # a complete checkpoint of this step already exists (a resumed run reached it again)
        return final
    tmp = folder / f"{_TMP_PREFIX}{checkpoint_name(step)}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / MODEL_FILE), metadata={"step": str(step)})
        torch.save({"step": step, **state}, tmp / STATE_FILE)
        for name in (MODEL_FILE, STATE_FILE):
            _fsync(tmp / name)
        _fsync_dir(tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(folder)
    stale = [p for p in folder.iterdir() if p.name.startswith(_TMP_PREFIX)]  # left by writers that were killed
    for old in stale + list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old)
    return final


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


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; directories cannot be opened for fsync on Windows, where this is skipped."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
