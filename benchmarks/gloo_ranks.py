"""The distributed benchmarks' launcher: a function on N gloo ranks of this machine, one process each; and their
JSON record (command, settings, environment, results), written atomically."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnres.atomic import atomic_write_text


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


def write_record(module: str, args, argv: list[str] | None, settings: dict, **results) -> None:
    """Write `results` to `args.out` with the command that reproduces them (`python -m module` and its arguments),
    the settings (`args` and `settings`) and the environment; print where."""
    payload = {
        "command": " ".join(["python -m " + module, *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args) | {"out": str(args.out)} | settings,
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
        **results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
