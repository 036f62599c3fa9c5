"""What a training step does under each `--parallel`: the forward and backward of one global batch, the gradient
norm, and the whole weights and optimizer state when the loop evaluates or saves.

Data parallel ("none", "ddp", "fsdp"; `attnres.distributed.data_parallel`): each rank runs its rows of the batch.
Pipeline ("pipeline"; `attnres.distributed.pipeline`): every rank takes the whole batch, in microbatches, and runs its
chunks of decoder layers; it holds the gradients and the optimizer state of its chunks' parameters only, and
receives the others' weights before each evaluation and checkpoint.
Tensor + sequence parallel ("tp"; `attnres.distributed.tensor_parallel`): every rank takes the whole batch and runs
its heads and MLP columns, with the residual state sharded along the sequence.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from attnres.distributed.data_parallel import (
    Ranks, checkpoint_state, load_optimizer_state, local_rows, mean_over_ranks, parallelize,
)
from attnres.distributed.pipeline import PipelineTrainer, check_pipeline
from attnres.distributed.tensor_parallel import parallelize_tensor
from attnres.training.config import TrainConfig


class DataParallelSteps:
    """"none", "ddp", "fsdp": `model` wrapped (DDP) or sharded in place (FSDP) once, at construction."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks):
        self.model, self.parallel, self.ranks = model, config.parallel, ranks
        self.trained = parallelize(model, config.parallel)  # what the training forward runs

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        """Forward and backward of the global `batch`, then clipping: (mean loss, gradient norm), on every rank."""
        rows = local_rows(batch, self.ranks)  # every rank draws the same global batch
        with autocast:
            loss = self.trained(input_ids=rows, labels=rows).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        return mean_over_ranks(loss, self.ranks), norm.item()

    def sync_weights(self) -> None:
        """Every rank already holds the weights it evaluates with (FSDP gathers them in its forward)."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[object, dict]:
        return checkpoint_state(self.model, optimizer, self.parallel)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state, self.parallel)


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


class TensorParallelSteps:
    """"tp": `parallelize_tensor` over all ranks. Parameters are DTensors; checkpoints gather them whole through the
    same full-state-dict path as FSDP's."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks):
        self.model = model
        parallelize_tensor(model)

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        with autocast:
            loss = self.model(input_ids=batch, labels=batch).loss  # whole on every rank
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        return loss.item(), norm.full_tensor().item()

    def sync_weights(self) -> None:
        """Every rank holds its shards; a forward gathers what it needs."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[object, dict]:
        return checkpoint_state(self.model, optimizer, "fsdp")  # DCP gathers DTensor parameters whole, as FSDP's

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state, "fsdp")


def microbatches(config: TrainConfig, ranks: Ranks) -> int:
    """`config.microbatches`, by default one per pipeline stage (ranks x virtual stages)."""
    return config.microbatches or ranks.world_size * config.virtual_stages


def check_settings(config: TrainConfig, ranks: Ranks) -> None:
    """A ValueError for pipeline settings that cannot run on these ranks, before anything is written."""
    if config.parallel != "pipeline":
        return
    count = microbatches(config, ranks)
    check_pipeline(config.pp_schedule, count, config.virtual_stages, config.layers, ranks.world_size)
    if config.batch_size % count:
        raise ValueError(f"batch_size: expected a multiple of the {count} microbatches, got {config.batch_size}")


def training_steps(model: nn.Module, config: TrainConfig, ranks: Ranks
                   ) -> DataParallelSteps | PipelineSteps | TensorParallelSteps:
    kind = {"pipeline": PipelineSteps, "tp": TensorParallelSteps}.get(config.parallel, DataParallelSteps)
    return kind(model, config, ranks)
