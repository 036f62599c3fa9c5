"""Distributed training and inference on `torch.distributed`: data parallel and FSDP2 (per decoder layer) training
(`data_parallel`), pipeline parallel training with cross-stage caching (`pipeline`), and the token-sharded Block bank
for long prefills (`token_shard`). Training's collectives place their tensors on `collective_device(group)`."""

from attnres.distributed.data_parallel import (
    PARALLEL,
    RankFailed,
    Ranks,
    apply_ddp,
    apply_fsdp,
    collective_device,
    init_ranks,
    local_rows,
    parallelize,
)
from attnres.distributed.pipeline import PipelinePlan, PipelineTrainer, hop_bytes, paper_rows

__all__ = [
    "PARALLEL",
    "PipelinePlan",
    "PipelineTrainer",
    "RankFailed",
    "Ranks",
    "apply_ddp",
    "apply_fsdp",
    "collective_device",
    "hop_bytes",
    "init_ranks",
    "local_rows",
    "paper_rows",
    "parallelize",
]
