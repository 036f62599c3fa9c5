"""Distributed training and inference on `torch.distributed`: data parallel and FSDP2 training
(`data_parallel`), pipeline parallel training with cross-stage caching (`pipeline`), and the token-sharded Block bank
for long prefills (`token_shard`)."""

from attnres.distributed.data_parallel import (
    PARALLEL,
    RankFailed,
    Ranks,
    apply_ddp,
    apply_fsdp,
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
    "hop_bytes",
    "init_ranks",
    "local_rows",
    "paper_rows",
    "parallelize",
]
