"""Where this process sits among the ranks, and the collectives of training, each failing with one clear error.

`init_ranks` joins the process group that `torchrun` describes (or none: one process), `Ranks` says where this process
sits, and `end_ranks` leaves the group. Rank 0 alone logs, shows progress and writes checkpoints (`on_main`,
`gather_on_main`).

A rank that fails makes the collectives of the others raise (its sockets close) or time out after `timeout_s`;
`collective` turns either into `RankFailed`, one clear error instead of a hang. The collectives place their tensors
on `collective_device(group)`: NCCL rejects CPU tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

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
