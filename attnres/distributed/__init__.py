"""Distributed training and inference on `torch.distributed`: data parallel and FSDP2 (per decoder layer) training
(`data_parallel`), pipeline parallel training with cross-stage caching (`pipeline`), and tensor + sequence parallel
training, prefill and decode with the residual state sharded along the sequence (`tensor_parallel`), composed on one
device mesh (`mesh`). Where each process sits among the ranks, and the collectives of training, are `ranks`; the
collectives place their tensors on `collective_device(group)`."""

from attnres.distributed.data_parallel import apply_ddp, apply_fsdp, local_rows
from attnres.distributed.mesh import MESH_DIMS, PARALLEL, ParallelDims, build_mesh
from attnres.distributed.pipeline import PipelinePlan, PipelineTrainer, hop_bytes, paper_rows
from attnres.distributed.ranks import RankFailed, Ranks, collective_device, init_ranks
from attnres.distributed.tensor_parallel import TensorParallel, parallelize_tensor

__all__ = [
    "MESH_DIMS",
    "ParallelDims",
    "build_mesh",
    "PARALLEL",
    "PipelinePlan",
    "PipelineTrainer",
    "RankFailed",
    "Ranks",
    "TensorParallel",
    "apply_ddp",
    "apply_fsdp",
    "collective_device",
    "hop_bytes",
    "init_ranks",
    "local_rows",
    "paper_rows",
    "parallelize_tensor",
]
