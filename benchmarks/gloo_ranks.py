"""The distributed benchmarks' launcher: a function on N gloo ranks of this machine, one process each."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_gloo_ranks(fn: Callable, nprocs: int, *args, timeout_s: float = 1800.0) -> list:
    """`fn(rank, *args)` on `nprocs` ranks (a process group each, 1 torch thread each); their results, by rank.
    `fn` must be importable by name (a module-level function): the ranks are spawned."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_entry, args=(fn, nprocs, _free_port(), timeout_s, args, results), nprocs=nprocs)
        return [results[rank] for rank in range(nprocs)]


def _entry(rank: int, fn: Callable, world: int, port: int, timeout_s: float, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        results[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
