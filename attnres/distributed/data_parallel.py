"""Data parallel training on `torch.distributed`: DDP and FSDP2, each one function applied to an unchanged model.

`attnres train --parallel ddp` (or `fsdp`) under `torchrun --nproc-per-node N` runs N ranks. Every rank draws the
same global batch from the same seeded sampler and keeps its own rows (`local_rows`), so the ranks see disjoint
shards of one global batch and the run equals a 1-process run with that batch (the per-rank mean losses are over
equal token counts, so their average is the global mean). The whole weights and optimizer state of a sharded model
(FSDP2, tensor parallel) are gathered for a checkpoint by `full_weights` and `optimizer_state`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from attnres.distributed.ranks import collective


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
