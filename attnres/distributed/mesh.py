"""One device mesh for every parallelism, as torchtitan composes them.

`ParallelDims` says how many ranks each dimension takes: pipeline stages (`pp`), data-parallel replicas
(`dp_replicate`, DDP-like), data-parallel shards (`dp_shard`, FSDP2) and tensor + sequence parallel ranks (`tp`).
Their product is the world size; `dp_shard=-1` takes whatever the others leave. `build_mesh` makes one
`init_device_mesh` with the dimensions named in that order, tensor parallel innermost (the ranks that talk most sit
next to each other), and every parallelism takes its own sub-mesh by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first
# `--parallel`: none, or a shorthand for one dimension over every rank (ddp: dp_replicate, fsdp: dp_shard, pipeline:
# pp, tp: tp)
PARALLEL = ("none", "ddp", "fsdp", "pipeline", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Ranks per mesh dimension; `world_size` is their product (checked by `resolve`)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def resolve(cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1
                ) -> ParallelDims:
        """The dimensions for `world_size` ranks; `dp_shard=-1` fills the rest. A ValueError names the flag that
        does not fit."""
        for name, value in (("pp", pp), ("dp_replicate", dp_replicate), ("tp", tp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or (dp_shard < 1 and dp_shard != -1):
            raise ValueError(f"dp_shard: expected a positive integer or -1 (the ranks left), got {dp_shard!r}")
        others = pp * dp_replicate * tp
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"dp_shard: -1 fills the ranks left, but pp={pp} x dp_replicate={dp_replicate} x tp={tp} = {others} "
                    f"does not divide the world size {world_size}"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ValueError(
                f"pp={pp} x dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} = {others * dp_shard}: "
                f"expected the world size {world_size} (the number of ranks torchrun started)"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        used = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return " x ".join(used) or "one process"


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """One `DeviceMesh` over the world with the dimensions of `MESH_DIMS` (size-1 ones included, so every
    parallelism finds its sub-mesh by name); the process group must be initialized.

    The dimensions a parameter can be sharded over together are also flattened into one (as torchtitan does), so that
    a reduction over all of them (the gradient norm of a parameter sharded by FSDP2 and tensor parallel) is one
    collective instead of one per dimension."""
    mesh = init_device_mesh(device_type, tuple(getattr(dims, name) for name in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    for group in (("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp")):
        if sum(getattr(dims, name) > 1 for name in group) > 1:
            mesh[group]._flatten()
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh FSDP2 shards over: ("dp_replicate", "dp_shard") for HSDP when replicas exist,
    else ("dp_shard",)."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks: which rows of the global batch it takes."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def held_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds: the local shard of a DTensor, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def memory_line(rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What this rank holds after a step: parameter, gradient and optimizer-state bytes of its local tensors."""
    params = [p for p in model.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {"rank": rank, "param_bytes": held_bytes(params), "grad_bytes": held_bytes(p.grad for p in params),
            "optim_bytes": held_bytes(states)}
