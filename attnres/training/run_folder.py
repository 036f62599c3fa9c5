"""The run folder: `config.json` (what the run is), `log.jsonl` (what it did), `checkpoints/` (where it is), and
once the run has reached its last step, `final/` (what it made: a standard transformers folder).

`config.json` records every setting, the model config, the data (tokenizer, split sizes, a fingerprint of the
tokens), and the environment (device, autocast, torch, Python, git commit), so a result can be traced to the
code and data that produced it. A resumed run must match it in everything that changes the parameters.

`final/` holds `config.json`, `model.safetensors`, `generation_config.json` and the tokenizer's files, written by
`save_pretrained` into a temporary folder and renamed into place. With `import attnres` (which registers the Auto
classes) `AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` and
`pipeline("text-generation", model=...)` load it; the byte-level tokenizer is saved as the transformers tokenizer of
`attnres.tokenization.byte_tokenizer()`, with the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import nn

from attnres.atomic import atomic_write_dir, atomic_write_text
from attnres.progress import transformers_progress
from attnres.run_layout import (
    CHECKPOINTS, CONFIG_FILE, FINAL, LOG_FILE, MODEL_FILE, SHARDED_DIR, STATE_FILE, checkpoint_name, checkpoint_step,
    latest_checkpoint,
)
from attnres.training.checkpoint import load_checkpoint
from attnres.training.config import RESUMABLE_CHANGES, TrainConfig
from attnres.training.optim import wsd_decay_start


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
    holds_run = any((run_dir / name).exists() for name in (CONFIG_FILE, LOG_FILE, CHECKPOINTS, FINAL))
    if config.resume and saved_path.exists():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        changed = [
            f"train.{key}" for key, value in run_info["train"].items()
            if key not in RESUMABLE_CHANGES and _saved(saved["train"], key) != value
        ]
        changed += [section for section in ("model", "data") if saved.get(section) != run_info[section]]
        if changed:
            hint = (" (the learning-rate schedule spans train.steps: to stop a run early and continue it, give both "
                    "runs the same steps and the first stop_after (--stop-after))" if "train.steps" in changed else "")
            raise ValueError(
                f"resume: {run_dir} holds a different run; these settings differ from its {CONFIG_FILE}: "
                f"{', '.join(changed)}{hint}"
            )
    elif holds_run and not config.resume:
        if not config.overwrite:
            raise ValueError(
                f"out: {run_dir} already holds a run; pass resume=True (--resume) to continue it, "
                "overwrite=True (--overwrite) to start afresh, or choose another out"
            )
        for name in (CONFIG_FILE, LOG_FILE):
            (run_dir / name).unlink(missing_ok=True)
        for name in (CHECKPOINTS, FINAL):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(saved_path, json.dumps(run_info, indent=2) + "\n")


# settings a WSD branch may differ in from the run it branches from
BRANCH_CHANGES = RESUMABLE_CHANGES | {"steps", "branch_from", "warmup"}


def branch_source(config: TrainConfig, run_info: dict) -> Path:
    """The checkpoint `config.branch_from`, checked to be a point on the path this run would take by itself.

    A WSD run holds its peak lr from the end of the warm-up to the start of its decay, so two WSD runs that differ
    only in their number of steps take the same steps until the earlier decay starts. A run of `config.steps` steps
    that starts from the longer run's checkpoint at step N <= its own decay start therefore ends with the weights a
    run started from scratch would: one long run can branch its decay at several budgets (see `loop.train`).
    """
    path = Path(config.branch_from)
    source_file = path.parent.parent / CONFIG_FILE
    weights = (path / MODEL_FILE).is_file() or (path / SHARDED_DIR).is_dir()  # one process's, or a mesh's
    if not (weights and (path / STATE_FILE).is_file() and source_file.is_file()):
        raise ValueError(f"branch_from: expected a checkpoint folder RUN/{CHECKPOINTS}/step-NNNNNN of a run, got {path}")
    source = json.loads(source_file.read_text(encoding="utf-8"))
    mine, theirs = run_info["train"], source["train"]
    warmups = (config.warmup_steps, theirs["warmup"] if theirs["warmup"] is not None else theirs["steps"] // 10)
    changed = [f"train.{k}" for k, v in mine.items() if k not in BRANCH_CHANGES and _saved(theirs, k) != v]
    changed += ["train.warmup"] if warmups[0] != warmups[1] else []
    changed += [section for section in ("model", "data") if source.get(section) != run_info[section]]
    if changed:
        raise ValueError(f"branch_from: {path} belongs to a different run; these settings differ: {', '.join(changed)}")
    step = checkpoint_step(path)
    starts = {
        "this run": wsd_decay_start(steps=config.steps, warmup=warmups[0], decay_fraction=config.decay_fraction),
        "the source run": wsd_decay_start(steps=theirs["steps"], warmup=warmups[1], decay_fraction=config.decay_fraction),
    }
    for who, start in starts.items():
        if step > start:
            raise ValueError(
                f"branch_from: {path} is step {step}, past the decay start of {who} (step {start}); branch from a "
                f"checkpoint at or before step {min(starts.values())}"
            )
    return path


def _saved(settings: dict, key: str):
    """A saved run's setting; its default where the run predates the setting."""
    if key in settings:
        return settings[key]
    field = TrainConfig.__dataclass_fields__[key]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def save_final(run_dir: str | Path, model: nn.Module, tokenizer, context: int,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `run_dir/final/` (see the module docstring) atomically and return its path.

    `model` is the trained `AttnResForCausalLM` (or another transformers causal LM); under FSDP, whose parameters are
    shards, `state_dict` holds the full weights (gathered on this rank), saved through a fresh CPU model of
    `model.config`. `tokenizer` is the run's
    (`ByteTokenizer` or `HFTokenizer`), `context` the `model_max_length` its saved form gets (the training length).
    Its BOS, EOS and padding ids are written into the model's config and generation config.
    """
    from attnres.tokenization import byte_tokenizer

    hf_tokenizer = byte_tokenizer(model_max_length=context) if tokenizer.name == "bytes" else tokenizer.tokenizer
    if state_dict is not None:
        model = _model_from_state(model.config, state_dict)
    eos = hf_tokenizer.eos_token_id
    pad = eos if hf_tokenizer.pad_token_id is None else hf_tokenizer.pad_token_id
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = hf_tokenizer.bos_token_id, eos, pad

    def write(folder: Path) -> None:
        with transformers_progress(False):  # no "Writing model shards" bar for one small file
            model.save_pretrained(folder)
        hf_tokenizer.save_pretrained(folder)

    return atomic_write_dir(Path(run_dir) / FINAL, write)


def _model_from_state(config, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU model of `config` holding the full weights `state_dict` (a tied parameter saved once, by name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise ValueError(f"final: the weights do not match the model: missing {missing}, unexpected {unexpected}")
    return model


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
