"""Distributed training and inference on `torch.distributed`: data parallel and FSDP2 training
(`data_parallel`), and the token-sharded Block bank for long prefills (`token_shard`)."""

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

__all__ = ["PARALLEL", "RankFailed", "Ranks", "apply_ddp", "apply_fsdp", "init_ranks", "local_rows", "parallelize"]
