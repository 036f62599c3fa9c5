"""Timing shared by the benchmarks: medians of repeated calls, timed round-robin, and the machine's copy bandwidth.

Round-robin (one call of each function per round) rather than one function after another: on a shared machine a
change of load then hits every function of a comparison alike, so their ratio stays meaningful.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


SUBNORMALS_HELP = (
    "keep subnormal floats (default: flush them to zero in every model alike, torch.set_flush_denormal: on x86 each "
    "operation on one takes a microcode assist, and which model meets them depends on its weights; a depth softmax "
    "that gives a source a tiny weight gives it a tiny gradient, whose products underflow in the matmuls)"
)


def flush_subnormals(keep: bool) -> str:
    """Unless `keep`, flush subnormal floats to zero in this thread and in the CPU threads started after it (call it
    before the first parallel op); returns what the record should say."""
    if keep or not torch.set_flush_denormal(True):
        return "kept"
    return "flushed (torch.set_flush_denormal)"


def _sync(device: torch.device | str) -> Callable[[], None]:
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def round_times(
    fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1, device: torch.device | str = "cpu"
) -> dict[str, list[float]]:
    """Seconds of each function in each of `repeats` rounds, after `warmup` untimed calls of each. A round calls each
    function once, in an order that rotates by one from round to round (round r starts with the r-th function): on a
    CPU a function's time depends on what ran just before it (the caches it left, the allocator's free lists), so
    none always follows the same one."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sync = _sync(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def median_times(
    fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Median seconds of each function over `repeats` rounds, after `warmup` untimed calls of each."""
    return {name: statistics.median(t) for name, t in round_times(fns, repeats, warmup, device).items()}


def median_seconds(
    fn: Callable[[], object], repeats: int, warmup: int = 1, device: torch.device | str = "cpu"
) -> float:
    """Median seconds of one function, as `median_times`."""
    return median_times({"fn": fn}, repeats, warmup, device)["fn"]


def copy_bandwidth(nbytes: int, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second of a `copy_` of `nbytes` into memory already touched, counting the read and the write."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_times({"copy": lambda: dst.copy_(src)}, repeats, warmup=1, device=device)["copy"]
    return 2 * src.nbytes / seconds
