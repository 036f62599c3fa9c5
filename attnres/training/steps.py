"""What a training step does on the device mesh: the forward and backward of one global batch, the gradient norm,
and the whole weights and optimizer state when the loop evaluates or saves.

Without pipeline stages (`MeshSteps`): tensor + sequence parallel over "tp" (`attnres.distributed.tensor_parallel`),
then FSDP2 over the data-parallel dimensions (`attnres.distributed.data_parallel`); each data-parallel rank runs its
rows of the batch. Pipeline (`attnres.distributed.pipeline`): every rank takes the whole batch, in microbatches, and
runs its chunks of decoder layers; it holds the gradients and the optimizer state of its chunks' parameters only, and
receives the others' weights before each evaluation and checkpoint.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from attnres.distributed.data_parallel import (
    RankFailed, Ranks, apply_ddp, apply_fsdp, checkpoint_state, is_collective_error, load_optimizer_state, local_rows,
    lost_rank_message, mean_over_ranks,
)
from attnres.distributed.mesh import ParallelDims, dp_mesh, dp_rank
from attnres.distributed.pipeline import PipelineTrainer, check_pipeline
from attnres.distributed.tensor_parallel import parallelize_tensor
from attnres.training.config import TrainConfig


class MeshSteps:
    """A mesh without pipeline stages: tensor parallel over "tp" (`parallelize_tensor`), then FSDP2 over the
    data-parallel dimensions (per decoder layer; the root only under tensor parallel), or DDP for replicas alone.
    Each data-parallel rank takes its rows of the global batch; the tensor-parallel ranks of one row share them."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks, dims: ParallelDims, mesh):
        self.model, self.ranks, self.dims = model, ranks, dims
        self.trained = model  # what the training forward runs
        if dims.tp > 1:
            parallelize_tensor(model, mesh["tp"])
        if dims.dp_replicate > 1 and dims.dp_shard == 1 and dims.tp == 1:
            self.trained = apply_ddp(model)
        elif dims.dp > 1:
            apply_fsdp(model, dp_mesh(mesh), per_layer=dims.tp == 1)
        self.rows = (dp_rank(mesh), dims.dp) if mesh is not None else (0, 1)
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        """Forward and backward of the global `batch`, then clipping: (mean loss, gradient norm), on every rank."""
        rows = local_rows(batch, *self.rows)  # every rank draws the same global batch
        with autocast:
            loss = self.trained(input_ids=rows, labels=rows).loss
        try:
            loss.backward()  # DDP and FSDP2 reduce the gradients over the data-parallel ranks in it
        except RuntimeError as e:
            if self.ranks.distributed and is_collective_error(e):
                raise RankFailed(lost_rank_message("reducing the gradients", e)) from e
            raise
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        return mean_over_ranks(loss, self.ranks), norm.item()

    def sync_weights(self) -> None:
        """Every rank already holds the weights it evaluates with (FSDP and TP gather them in their forward)."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[object, dict]:
        return checkpoint_state(self.model, optimizer, self.sharded)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state, self.sharded)


class PipelineSteps:
    """"pipeline": a `PipelineTrainer` over all ranks, with `microbatches(config, ranks)` microbatches a step."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks):
        self.model = model
        self.trainer = PipelineTrainer(model, schedule=config.pp_schedule, microbatches=microbatches(config, ranks),
                                       virtual_stages=config.virtual_stages)
        self._synced = True  # every rank starts from the same weights

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        with autocast:
            loss = self.trainer.step(batch, batch)
        self._synced = False
        return loss, self.trainer.clip_grad_norm_(max_norm)

    def sync_weights(self) -> None:
        if not self._synced:
            self.trainer.sync_weights()
            self._synced = True

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[object, dict]:
        self.sync_weights()
        return self.model, self.trainer.optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self.trainer.load_optimizer_state(optimizer, state)


def microbatches(config: TrainConfig, ranks: Ranks) -> int:
    """`config.microbatches`, by default one per pipeline stage (ranks x virtual stages)."""
    return config.microbatches or ranks.world_size * config.virtual_stages


def check_settings(config: TrainConfig, ranks: Ranks, dims: ParallelDims) -> None:
    """A ValueError for pipeline settings that cannot run on these ranks, before anything is written."""
    if dims.pp == 1:
        return
    if dims.pp != dims.world_size:
        raise ValueError(f"pp: a pipeline over {dims.pp} of {dims.world_size} ranks composed with other dimensions "
                         f"({dims.describe()}) is not supported yet; use --pp {dims.world_size} alone")
    count = microbatches(config, ranks)
    check_pipeline(config.pp_schedule, count, config.virtual_stages, config.layers, ranks.world_size)
    if config.batch_size % count:
        raise ValueError(f"batch_size: expected a multiple of the {count} microbatches, got {config.batch_size}")


def training_steps(model: nn.Module, config: TrainConfig, ranks: Ranks, dims: ParallelDims, mesh
                   ) -> MeshSteps | PipelineSteps:
    if dims.pp > 1:
        return PipelineSteps(model, config, ranks)
    return MeshSteps(model, config, ranks, dims, mesh)
