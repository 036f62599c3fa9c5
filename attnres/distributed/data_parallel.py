"""Data parallel training on `torch.distributed`: one function per parallelism, applied to an unchanged model.

`attnres train --parallel ddp` (or `fsdp`) under `torchrun --nproc-per-node N` runs N ranks. Every rank draws the
same global batch from the same seeded sampler and keeps its own rows (`local_rows`), so the ranks see disjoint
shards of one global batch and the run equals a 1-process run with that batch (the per-rank mean losses are over
equal token counts, so their average is the global mean). Rank 0 alone logs, shows progress and writes checkpoints.

A rank that fails makes the collectives of the others raise (its sockets close) or time out after
`timeout_s`; `RankFailed` turns either into one clear error instead of a hang.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

PARALLEL = ("none", "ddp", "fsdp", "pipeline", "tp")
DEFAULT_TIMEOUT_S = 300.0

T = TypeVar("T")


class RankFailed(RuntimeError):
    """A collective failed or timed out: another rank died, raised, or stopped answering."""


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: `rank` of `world_size`; `owns_group`: it started the process group (so ends it)."""

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def init_ranks(parallel: bool, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
    """Join the process group that `torchrun` (or a caller) describes: an initialized one, or one started from
    torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on CPU, nccl on CUDA) whose collectives
    time out after `timeout_s` seconds. Without either, a single process, unless `parallel` (a parallelism was asked
    for) makes that an error."""
    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing and not parallel:
        return Ranks()
    if missing:
        raise ValueError(
            "parallel: expected a launch by torchrun (e.g. `torchrun --nproc-per-node 4 -m attnres.cli train "
            f"--dp-shard 2 --tp 2`); the environment lacks {', '.join(missing)}"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size(), owns_group=True)


def local_device(device: torch.device) -> torch.device:
    """This rank's CUDA device (LOCAL_RANK) when `device` is CUDA; `device` otherwise."""
    if device.type != "cuda":
        return device
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(local)
    return local


def apply_ddp(model: nn.Module) -> nn.Module:
    """`DistributedDataParallel` around `model`: gradients averaged over the ranks in backward."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2 (`fully_shard`) composed onto an unchanged `AttnResForCausalLM`, as torchtitan does: one group per
    decoder layer, one for the embedding, one for the head, then the root. Parameters, gradients and optimizer
    state are sharded over the ranks of `mesh` (default: the world; a 2-D ("dp_replicate", "dp_shard") mesh shards
    over the second and replicates over the first: HSDP); each group is gathered just before it runs, forward and
    backward, and freed after (`reshard_after_forward`), so a layer's full parameters exist only while it runs. On a
    tensor-parallel model (`parallelize_tensor` first), FSDP2 shards each DTensor's local part. Changes `model` in
    place and returns it.

    A decoder layer's group is the whole layer: it takes the residual state and returns the new one, and hands on the
    rows it does not change as views of its own (`attnres.models.wiring`), so FSDP2's hooks on its outputs gather it
    again for backward just before its own backward runs. The head's group stays gathered
    after forward (its backward comes first); tied embeddings stay in the root (one parameter, two places).
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"model: expected an AttnResForCausalLM (decoder layers in .model.layers), got "
                        f"{type(model).__name__}")
    _quiet_view_warnings()
    for layer in layers:
        if any(True for _ in layer.parameters()):  # a pipeline stage's placeholders for others' layers: none
            fully_shard(layer, mesh=mesh)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if not model.config.tie_word_embeddings:
        for part, reshard in ((embed, True), (head, False)):
            if part is not None:
                fully_shard(part, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh)


def shard_chunk(chunk: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 on a pipeline chunk, as `apply_fsdp` on a model: a group per decoder layer, then the chunk (its
    embedding, final read, final norm and head, as the stage has them)."""
    from torch.distributed.fsdp import fully_shard

    _quiet_view_warnings()
    for layer in chunk.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(chunk, mesh=mesh)


def _quiet_view_warnings() -> None:
    """FSDP2 warns about every view a group returns, since an in-place op on it would skip its hook. A layer's views
    (the rows it hands on) are never written in place while gradients are recorded; nor are the root's logits, which
    under tensor parallel are the gathered head output's local view (`to_local`), read by the family's loss."""
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDPAttnRes(DecoderLayer|ForCausalLM)\) returned a view tensor",
        category=UserWarning,
    )


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict keyed by parameter name (`torch.distributed.checkpoint.state_dict`, full tensors on
    the CPU), so that a run resumes on another mesh whatever held which parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return collective(lambda: get_optimizer_state_dict(model, optimizer, options=options), "gathering the optimizer")


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of a model whose parameters are DTensors (FSDP2, tensor parallel), gathered into CPU
    tensors on rank 0 (a collective: every rank calls it; the others get an empty dict). A tied parameter is kept
    once, by the name `named_parameters` gives it; each tensor has its own storage."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = collective(lambda: get_model_state_dict(model, options=options), "gathering the weights")
    kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - kept
    return {k: v.clone() for k, v in weights.items() if k not in aliases}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load what `optimizer_state` saved (every rank reads the same full state and keeps the part of its own
    parameters: its shards, or a pipeline stage's parameters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {name for name, _ in model.named_parameters()}
    own = {"state": {k: v for k, v in state["state"].items() if k in names},
           "param_groups": [{**group, "params": [k for k in group["params"] if k in names]}
                            for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, own, options=StateDictOptions(full_state_dict=True))


def local_rows(batch: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows `[B / count, T]` number `index` of the global batch `[B, T]` (B must divide evenly): what data-parallel
    rank `index` of `count` takes."""
    if batch.shape[0] % count:
        raise ValueError(f"batch_size: expected a multiple of the {count} data-parallel ranks, got {batch.shape[0]}")
    return batch.chunk(count)[index]


def mean_over_ranks(value: torch.Tensor, ranks: Ranks) -> float:
    """The mean of a scalar over the ranks (every rank gets it)."""
    if ranks.world_size == 1:
        return value.item()
    value = value.detach().float().to(collective_device(), copy=True)
    collective(lambda: dist.all_reduce(value), "averaging the loss")  # gloo has no AVG: sum, then divide
    return value.item() / ranks.world_size


def on_main(fn: Callable[[], T], ranks: Ranks) -> T | None:
    """Run `fn` on rank 0 only; a ValueError it raises is raised on every rank (so none waits for rank 0)."""
    result, error = None, None
    if ranks.is_main:
        try:
            result = fn()
        except ValueError as e:
            error = e
    if ranks.world_size > 1:
        message = [None if error is None else str(error)]
        collective(lambda: dist.broadcast_object_list(message, src=0, device=collective_device()), "waiting for rank 0")
        if message[0] is not None and error is None:
            error = ValueError(message[0])
    if error is not None:
        raise error
    return result


def gather_on_main(value: T, ranks: Ranks) -> list[T]:
    """Every rank's `value` (a small picklable one), in rank order, on rank 0; an empty list elsewhere."""
    if ranks.world_size == 1:
        return [value]
    values = [None] * ranks.world_size if ranks.is_main else None
    collective(lambda: dist.gather_object(value, values, dst=0), "gathering a log line")
    return values or []


def barrier(ranks: Ranks, what: str) -> None:
    if ranks.world_size > 1:
        collective(dist.barrier, what)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of the tensors that the collectives of `group` (default: the whole world) take: the CPU where its
    backend takes CPU tensors (gloo), else this rank's current device of the backend's kind (NCCL: CUDA). The
    training collectives (data parallel, pipeline) place their tensors here; NCCL rejects CPU tensors."""
    kinds = dist.Backend.backend_capability.get(str(dist.get_backend(group)))
    if kinds and "cpu" in kinds:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    kind = kinds[0] if kinds else accelerator.type  # a mixed backend ("cpu:gloo,cuda:nccl"): the accelerator's
    if accelerator is not None and kind == accelerator.type:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device(kind)


def is_collective_error(error: BaseException | None) -> bool:
    """A failed collective, from an error raised by a call that runs collectives (a DDP backward, a pipeline
    schedule): torch's `DistError` family, or a plain `RuntimeError`, the type the backend's errors have once the
    autograd engine or the pipeline re-raises them, unless it was raised from an error of another type (the
    pipeline wraps a stage's own error in a `RuntimeError`): this rank's own errors have types of their own."""
    while error is not None:
        if isinstance(error, dist.DistError):
            return True
        if type(error) is not RuntimeError:
            return False
        error = error.__cause__
    return True


def collective(fn: Callable[[], T], what: str) -> T:
    """Call `fn`; a failure of the collective (a lost or silent rank) becomes `RankFailed`."""
    try:
        return fn()
    except (dist.DistError, RuntimeError) as e:
        raise RankFailed(lost_rank_message(what, e)) from e


def lost_rank_message(what: str, error: BaseException) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"rank {rank}: a collective failed while {what}: another rank died, raised or stopped answering "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). See that rank's error."
    )


def end_ranks(ranks: Ranks) -> None:
    """Leave the process group if this process started it."""
    if ranks.owns_group and dist.is_initialized():
        dist.destroy_process_group()
