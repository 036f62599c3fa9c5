"""What a training step does on the device mesh: the forward and backward of one global batch, the gradient norm,
and the whole weights and optimizer state when the loop evaluates or saves.

Without pipeline stages (`MeshSteps`): tensor + sequence parallel over "tp" (`attnres.distributed.tensor_parallel`),
then FSDP2 over the data-parallel dimensions (`attnres.distributed.data_parallel`); each data-parallel rank runs its
rows of the batch. Pipeline (`attnres.distributed.pipeline`): each rank keeps only its stages of the model and runs
its data-parallel rows in microbatches; evaluation goes through the pipeline too, and only `final/` gathers the
whole weights (checkpoints are sharded: `attnres.training.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from attnres.distributed.data_parallel import (
    apply_ddp, apply_fsdp, full_weights, load_optimizer_state, local_rows, optimizer_state,
)
from attnres.distributed.mesh import ParallelDims, dp_mesh, dp_rank
from attnres.distributed.pipeline import PipelineTrainer, check_pipeline
from attnres.distributed.ranks import (
    RankFailed, Ranks, collective, gather_on_main, is_collective_error, lost_rank_message, mean_over_ranks,
)
from attnres.distributed.tensor_parallel import parallelize_tensor
from attnres.training.config import TrainConfig

Allocate = Callable[[nn.Module], None]


class MeshSteps:
    """A mesh without pipeline stages: tensor parallel over "tp" (`parallelize_tensor`), then FSDP2 over the
    data-parallel dimensions (per decoder layer, then the root), or DDP for replicas alone.
    Each data-parallel rank takes its rows of the global batch; the tensor-parallel ranks of one row share them."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks, dims: ParallelDims, mesh,
                 allocate: Allocate):
        self.model, self.ranks = model, ranks
        self.trained = model  # what the training forward runs
        ddp = dims.dp_replicate > 1 and dims.dp_shard == 1 and dims.tp == 1
        if dims.tp > 1:
            parallelize_tensor(model, mesh["tp"])
        if dims.dp > 1 and not ddp:
            apply_fsdp(model, dp_mesh(mesh))
        allocate(model)
        if ddp:  # DDP broadcasts rank 0's weights: they must exist
            self.trained = apply_ddp(model)
        self.rows = (dp_rank(mesh), dims.dp) if mesh is not None else (0, 1)
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        """Forward and backward of the global `batch`, then clipping: (mean loss, gradient norm), on every rank."""
        rows = local_rows(batch, *self.rows)  # every rank draws the same global batch
        try:  # TP and FSDP2 gather in forward and backward, DDP and FSDP2 reduce gradients in backward
            with autocast:
                loss = self.trained(input_ids=rows, labels=rows).loss
            loss.backward()
        except RuntimeError as e:
            if self.ranks.distributed and is_collective_error(e):
                raise RankFailed(lost_rank_message("running the forward and backward", e)) from e
            raise
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        return mean_over_ranks(loss, self.ranks), norm.item()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """A one-process checkpoint's optimizer state, keyed by parameter name."""
        return optimizer_state(self.model, optimizer)

    def final_weights(self) -> nn.Module | dict[str, torch.Tensor]:
        """What `final/` saves: the model itself, or its sharded weights gathered whole on rank 0."""
        return full_weights(self.model) if self.sharded else self.model

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state)

    def evaluate(self, batches: list[torch.Tensor], autocast: AbstractContextManager) -> float:
        """Mean loss over the fixed validation batches (equal sizes, so the mean of the batch means), every rank
        running each whole batch."""
        return evaluate(self.model, batches, autocast)


class PipelineSteps:
    """A mesh with pipeline stages: a `PipelineTrainer` over "pp" that keeps only this rank's stages of the model,
    FSDP2 over the data-parallel dimensions within each stage, `microbatches(config, dims)` microbatches a step of
    each data-parallel rank's rows."""

    def __init__(self, model: nn.Module, config: TrainConfig, ranks: Ranks, dims: ParallelDims, mesh,
                 allocate: Allocate):
        self.model, self.ranks = model, ranks
        self.trainer = PipelineTrainer(
            model, schedule=config.pp_schedule, microbatches=microbatches(config, dims),
            virtual_stages=config.virtual_stages, group=mesh["pp"].get_group(),
            dp_mesh=dp_mesh(mesh) if dims.dp > 1 else None, tp_mesh=mesh["tp"] if dims.tp > 1 else None,
        )
        allocate(model)  # this rank's stages only
        self.rows = (dp_rank(mesh), dims.dp)
        self.sharded = dims.dp > 1

    def run(self, batch: torch.Tensor, autocast: AbstractContextManager, max_norm: float) -> tuple[float, float]:
        rows = local_rows(batch, *self.rows)
        with autocast:
            loss = self.trainer.step(rows, rows)
        return mean_over_ranks(torch.tensor(loss), self.ranks), self.trainer.clip_grad_norm_(max_norm)

    def evaluate(self, batches: list[torch.Tensor], autocast: AbstractContextManager) -> float:
        self.model.eval()
        with autocast:
            losses = [self.trainer.evaluate(local_rows(b, *self.rows)) for b in batches]
        self.model.train()
        return mean_over_ranks(torch.tensor(sum(losses) / len(losses)), self.ranks)

    def final_weights(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0 (an empty dict elsewhere): each stage's, gathered over its data-parallel and
        tensor-parallel ranks, then from every stage."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)  # whole on every rank of the stage, not only global rank 0
        weights = collective(lambda: get_model_state_dict(self.model, options=options), "gathering the weights")
        stages = gather_on_main(_to_cpu(weights), self.ranks)
        return {k: v for stage in stages for k, v in stage.items()}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(self.model, optimizer, state)


def _to_cpu(tensors: dict) -> dict:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in tensors.items()}


def evaluate(model: nn.Module, batches: list[torch.Tensor], autocast: AbstractContextManager) -> float:
    """Mean loss of `model` over the validation batches, in eval mode, without a KV cache."""
    model.eval()
    # a transformers model in eval mode builds a KV cache by default; validation never reuses it
    no_cache = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with torch.no_grad(), autocast:
        losses = [model(input_ids=b, labels=b, **no_cache).loss.float().item() for b in batches]
    model.train()
    return sum(losses) / len(losses)


def microbatches(config: TrainConfig, dims: ParallelDims) -> int:
    """`config.microbatches`, by default one per pipeline stage (pp x virtual stages)."""
    return config.microbatches or dims.pp * config.virtual_stages


def check_settings(config: TrainConfig, dims: ParallelDims) -> None:
    """A ValueError for pipeline settings that cannot run on these ranks, before anything is written."""
    if dims.pp == 1:
        return
    count = microbatches(config, dims)
    check_pipeline(config.pp_schedule, count, config.virtual_stages, config.layers, dims.pp)
    if config.batch_size % (count * dims.dp):
        raise ValueError(f"batch_size: expected a multiple of the {count} microbatches x {dims.dp} data-parallel ranks, "
                         f"got {config.batch_size}")


def training_steps(model: nn.Module, config: TrainConfig, ranks: Ranks, dims: ParallelDims, mesh,
                   allocate: Allocate = lambda model: None) -> MeshSteps | PipelineSteps:
    """The steps of `model` on the mesh. `allocate(model)` is called once the model is parallelized (each rank holds
    its part: TP and FSDP2 shards, pipeline stages) and before anything reads its weights: a model built on the meta
    device is made real there."""
    if dims.pp > 1:
        return PipelineSteps(model, config, ranks, dims, mesh, allocate)
    return MeshSteps(model, config, ranks, dims, mesh, allocate)
