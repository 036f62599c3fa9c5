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
from either kind on any mesh, or in one process: each rank reads the weights and optimizer state it then holds
(`torch.distributed.checkpoint` reshards; `model.safetensors` through its Hugging Face reader).
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_model
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

    from attnres.distributed.ranks import barrier, collective

    folder = Path(folder)
    final = folder / checkpoint_name(step)
    if final.exists():  # a complete checkpoint of this step already exists (a resumed run reached it again)
        return final
    tmp = folder / f"{TMP_PREFIX}{checkpoint_name(step)}.sharded"  # one name for every rank
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(ranks, "starting a checkpoint")
    shards = _in_plain_chunks({"model": get_model_state_dict(model),
                               "optim": get_optimizer_state_dict(model, optimizer, options=_options())})
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


def load_checkpoint(path: str | os.PathLike, model: nn.Module, stage_only: bool = False) -> dict:
    """Load the weights of checkpoint folder `path` (either kind) into `model`, whole or parallelized (each rank
    reads what it holds: `torch.distributed.checkpoint` reshards), and return its state dict, on the CPU (generator
    states must stay there; `Optimizer.load_state_dict` moves its own). Every weight of the model must be in the
    checkpoint, and, unless the model is a pipeline rank's stages (`stage_only`), every weight of the checkpoint in
    the model. A sharded checkpoint's optimizer state loads after: `load_sharded_optimizer`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    sharded = (path / SHARDED_DIR).is_dir()
    if not ((path / MODEL_FILE).is_file() or sharded) or not (path / STATE_FILE).is_file():
        raise ValueError(f"checkpoint: {path} is not a checkpoint folder (expected {MODEL_FILE} or {SHARDED_DIR}/, "
                         f"and {STATE_FILE})")
    # a sharded checkpoint keys the weights "model.<name>" (beside the optimizer's); model.safetensors by name
    reader = dcp.FileSystemReader(path / SHARDED_DIR) if sharded else dcp.HuggingFaceStorageReader(str(path))
    prefix = "model." if sharded else ""
    stored = {key[len(prefix):] for key in reader.read_metadata().state_dict_metadata if key.startswith(prefix)}
    weights = get_model_state_dict(model)
    tied = _tied_names(model)  # a tied weight is stored once, under one of its names
    wanted = {key: t for key, t in weights.items() if key in stored or not tied.get(key, set()) & stored}
    unexpected = set() if stage_only else stored - set(weights)
    missing = set(wanted) - stored
    if missing or unexpected:
        raise ValueError(f"checkpoint: {path} does not match the model: missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}")
    loaded = _in_plain_chunks(wanted)
    try:
        with _one_process_intended():
            dcp.load({"model": loaded} if sharded else loaded, storage_reader=reader,
                     no_dist=not torch.distributed.is_initialized())
    except dcp.api.CheckpointException as e:  # a mis-shaped tensor
        raise ValueError(f"checkpoint: {path} does not match the model: {e}") from e
    set_model_state_dict(model, {**weights, **_in_layouts_of(wanted, loaded)})
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def _tied_names(model: nn.Module) -> dict[str, set[str]]:
    """{name: the other names of the same parameter} for each parameter held under several names."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return {name: group - {name} for group in names.values() if len(group) > 1 for name in group}


def load_sharded_optimizer(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's optimizer state into what this rank's optimizer holds (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options())
    loaded = _in_plain_chunks(state)
    with _one_process_intended():
        dcp.load({"optim": loaded}, checkpoint_id=Path(path) / SHARDED_DIR,
                 no_dist=not torch.distributed.is_initialized())
    set_optimizer_state_dict(model, optimizer, _in_layouts_of(state, loaded), options=_options())


def _in_plain_chunks(state: dict) -> dict:
    """`state` with every DTensor laid out in chunks that `torch.distributed.checkpoint` can describe. A strided shard
    on the innermost (tensor-parallel) mesh dimension (transformers' packed gate/up columns of MoE experts: each rank
    holds two pieces of the dimension) becomes the plain shard of its dimension, through a gather of that tensor: at
    checkpoint time only. FSDP2's own strided shards (over the data-parallel dimension, beside a tensor-parallel
    shard of the same dimension) are left as they are: the checkpoint describes those."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._pytree import tree_map_only

    def plain(t: DTensor) -> DTensor:
        if not isinstance(t.placements[-1], _StridedShard):
            return t
        return _relaid(t, [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements])

    return tree_map_only(DTensor, plain, state)


def _in_layouts_of(state: dict, loaded: dict) -> dict:
    """`loaded` (laid out by `_in_plain_chunks(state)`) back in the layouts of `state`."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    def back(want, got):
        if not isinstance(want, DTensor) or got.placements == want.placements:
            return got
        return _relaid(got, want.placements)

    return tree_map(back, state, loaded)


def _relaid(t, placements):
    """DTensor `t` laid out as `placements` on its mesh, through the whole tensor (a strided shard cannot be
    redistributed to a plain one directly)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    whole = t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local()
    return distribute_tensor(whole, t.device_mesh, placements, src_data_rank=None)
