"""Process launching for the multi-process tests: gloo ranks on one machine, each a fresh `spawn` process."""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, timeout_s: float, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which decides
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 30.0, join_s: float = 60.0) -> dict[int, tuple]:
    """Run `fn(rank, *args)` on `world_size` gloo ranks; {rank: ("ok", result) or ("error", message)}.

    Every rank is joined within `join_s` seconds; one still alive then is killed and reported as ("hung", ...), one
    that exited without reporting as ("died", ...).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, timeout_s, args, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + join_s
    # stop waiting once every rank has reported, or the silent ones have all exited (died without a word)
    while len(out) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            out[rank] = (status, value)
        except queue.Empty:
            if all(not procs[r].is_alive() for r in range(world_size) if r not in out) and results.empty():
                break
    for rank, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
            out.setdefault(rank, ("hung", f"rank {rank} did not finish within {join_s} s"))
        out.setdefault(rank, ("died", f"rank {rank} exited with code {p.exitcode} without a result"))
    return out
