"""The run folder: `config.json` (what the run is), `log.jsonl` (what it did), `checkpoints/` (where it is).

`config.json` records every setting, the model config, the data (tokenizer, split sizes, a fingerprint of the
tokens), and the environment (device, autocast, torch, Python, git commit), so a result can be traced to the
code and data that produced it. A resumed run must match it in everything that changes the parameters.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import nn

from attnres.training.checkpoint import atomic_write_text, checkpoint_name, latest_checkpoint, load_checkpoint
from attnres.training.config import RESUMABLE_CHANGES, TrainConfig
from attnres.training.logs import LOG_FILE

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"


def describe_run(config: TrainConfig, model: nn.Module, data: dict, device: torch.device,
                 autocast_dtype: torch.dtype | None) -> dict:
    """The content of `config.json`; `data` describes the tokens (see `loop.train`)."""
    model_config = getattr(model, "config", None)
    return _jsonable({
        "train": config.to_dict(),
        "model": model_config.to_dict() if hasattr(model_config, "to_dict") else {"class": type(model).__name__},
        "num_params": sum(p.numel() for p in model.parameters()),
        "data": data,
        "environment": {
            "device": str(device),
            "autocast": None if autocast_dtype is None else str(autocast_dtype),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git": git_commit(),
        },
    })


def prepare_run_dir(run_dir: Path, config: TrainConfig, run_info: dict) -> None:
    """Check that `run_dir` may hold this run, then write its `config.json`.

    A new run refuses a folder that holds one (unless `overwrite`, which deletes it); a resumed run must match
    the saved `config.json` in every setting but those of `RESUMABLE_CHANGES`. `resume` with no run there yet
    starts one, so a preemptible job can always pass it.
    """
    saved_path = run_dir / CONFIG_FILE
    holds_run = any((run_dir / name).exists() for name in (CONFIG_FILE, LOG_FILE, CHECKPOINTS))
    if config.resume and saved_path.exists():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        changed = [
            f"train.{key}" for key, value in run_info["train"].items()
            if key not in RESUMABLE_CHANGES and saved["train"].get(key) != value
        ]
        changed += [section for section in ("model", "data") if saved.get(section) != run_info[section]]
        if changed:
            raise ValueError(
                f"resume: {run_dir} holds a different run; these settings differ from its {CONFIG_FILE}: "
                f"{', '.join(changed)}"
            )
    elif holds_run and not config.resume:
        if not config.overwrite:
            raise ValueError(
                f"out: {run_dir} already holds a run; pass resume=True (--resume) to continue it, "
                "overwrite=True (--overwrite) to start afresh, or choose another out"
            )
        for name in (CONFIG_FILE, LOG_FILE):
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(saved_path, json.dumps(run_info, indent=2) + "\n")


def load_trained_model(run_dir: str | Path, step: int | None = None) -> nn.Module:
    """The `AttnResForCausalLM` of a run folder with the weights of checkpoint `step` (default: the latest), in
    eval mode on the CPU: for analysis and plots after the run."""
    from attnres.models import AttnResConfig, AttnResForCausalLM

    run_dir = Path(run_dir)
    saved = json.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    if "model_type" not in saved["model"]:
        raise ValueError(f"run_dir: {run_dir} was trained with a model of its own ({saved['model']}); load it yourself")
    path = latest_checkpoint(run_dir / CHECKPOINTS) if step is None else run_dir / CHECKPOINTS / checkpoint_name(step)
    if path is None or not path.is_dir():
        raise ValueError(f"step: {run_dir / CHECKPOINTS} has no checkpoint{'' if step is None else f' of step {step}'}")
    model = AttnResForCausalLM(AttnResConfig.from_dict(saved["model"]))
    load_checkpoint(path, model)
    return model.eval()


def git_commit() -> dict | None:
    """The commit of the attnres checkout and whether it had uncommitted changes; None outside a checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _jsonable(obj):
    """What `json` makes of `obj` (paths and dtypes as strings, tuples as lists), so saved and new compare equal."""
    return json.loads(json.dumps(obj, default=str))
