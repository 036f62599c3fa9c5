"""One dispatch for the depth-attention kernels: which implementation runs for a given tensor.

`ATTNRES_BACKEND` chooses: `auto` (default: the Triton kernels on CUDA, the compiled CPU kernel on CPU, each when
it is available), or `torch` to force the portable torch-op path everywhere (the fallback of every backend).
A backend supplies kernels only: each entry keeps the contract written on its op (`attnres::depth_attention_fwd/bwd`
and `bwd_into` beside it, `attnres::depth_stats_fwd/bwd`, `attnres::merge_prefix_fwd/bwd`,
`attnres.ops.bank.bank_aggregate/bank_merge`), and a None entry means "use the torch path" for that op. The fused
bank ops are stored behind those ops' checks.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from attnres.ops.checks import check_bank_aggregate, check_bank_merge, validated

BACKEND_ENV = "ATTNRES_BACKEND"
BACKEND_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class Backend:
    name: str
    fwd: Callable | None = None
    bwd: Callable | None = None
    bwd_into: Callable | None = None  # `bwd` writing (or adding) the source gradients into a given buffer (ops/chain.py)
    # fwd, bwd and bwd_into of a point from its parameters: the query folded and its gradients formed in the same
    # call (attnres.ops.depth_attention.PointKernels; None: composed from the three above in torch ops)
    point_fwd: Callable | None = None
    point_bwd: Callable | None = None
    point_bwd_into: Callable | None = None
    # a point as one op with its own autograd node, eagerly on plain tensors (no Python in its forward's wrapper or in
    # its backward): `depth_attention`'s and `depth_attention_chained`'s (None: their Python autograd Functions)
    point: Callable | None = None
    chained_point: Callable | None = None
    stats_fwd: Callable | None = None
    stats_bwd: Callable | None = None
    bank_aggregate: Callable | None = None  # the fused inference ops of attnres.ops.bank, checked (see validated)
    bank_merge: Callable | None = None
    merge_fwd: Callable | None = None  # phase 2 of attnres.ops.merge (`attnres::merge_prefix_fwd/bwd`)
    merge_bwd: Callable | None = None
    max_d: int | None = None  # widest hidden size the kernels take
    max_rows: int | None = None  # most sources or queries the phase-1 kernels take
    two_phase_trains: bool = True  # False where two-phase training measured slower than one-shot even when it saves bytes


TORCH = Backend("torch")


def _cpu_backend() -> Backend | None:
    try:
        from attnres.ops import cpu
    except ImportError:
        return None
    if not cpu.available():
        return None
    return Backend(
        "cpu", cpu.cpu_depth_attention_fwd, cpu.cpu_depth_attention_bwd, cpu.cpu_depth_attention_bwd_into,
        cpu.cpu_point_fwd, cpu.cpu_point_bwd, cpu.cpu_point_bwd_into, cpu.cpu_point, cpu.cpu_chained_point,
        stats_fwd=cpu.cpu_depth_stats_fwd, stats_bwd=cpu.cpu_depth_stats_bwd,
        bank_aggregate=validated(check_bank_aggregate, cpu.cpu_bank_aggregate),
        bank_merge=validated(check_bank_merge, cpu.cpu_bank_merge),
        # training: phase 2's backward has no CPU kernel, and its torch ops cost more than the reads two-phase saves
        # (2.6-2.8x one-shot's time in fp32, 32 layers, block size 4, T=1024, d=512: docs/bench_streams*.json).
        # Inference runs the fused CPU bank_merge and pays where two_phase_pays says (0.61-0.72x fp32, level bf16).
        two_phase_trains=False,
    )


def _triton_backend() -> Backend | None:
    try:
        from attnres.ops import triton as k
    except ImportError:  # no triton installed
        return None
    return Backend(
        "triton", k.triton_depth_attention_fwd, k.triton_depth_attention_bwd, k.triton_depth_attention_bwd_into,
        stats_fwd=k.triton_depth_stats_fwd, stats_bwd=k.triton_depth_stats_bwd,
        bank_aggregate=validated(check_bank_aggregate, k.triton_bank_aggregate),
        bank_merge=validated(check_bank_merge, k.triton_bank_merge),
        merge_fwd=k.triton_merge_prefix_fwd, merge_bwd=k.triton_merge_prefix_bwd,
        max_d=k.MAX_D, max_rows=k.MAX_STATS_ROWS,
    )


_cache: dict[str, Backend | None] = {}


def _probe(kind: str) -> Backend | None:
    if kind not in _cache:
        _cache[kind] = _cpu_backend() if kind == "cpu" else _triton_backend()
    return _cache[kind]


def select_backend(x: torch.Tensor, stats_rows: int | None = None) -> Backend:
    """The backend for the one-shot op on sources like `x`, or for phase 1 when `stats_rows` (the larger of the
    numbers of sources and queries) is given; a backend without that op yields the torch path."""
    return backend_for(x.device.type, x.dtype, x.shape[-1], stats_rows)


def backend_for(device_type: str, dtype: torch.dtype, d: int, stats_rows: int | None = None) -> Backend:
    """`select_backend` for sources on a `device_type` device, of `dtype` and hidden size d."""
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKEND_CHOICES}, got {choice!r}")
    return _choose(choice, device_type, dtype, d, stats_rows)


@functools.cache  # a function of its arguments (the probed backends are cached too): a decode step asks per layer
def _choose(choice: str, device_type: str, dtype: torch.dtype, d: int, stats_rows: int | None) -> Backend:
    if choice != "auto" or dtype == torch.float64:  # fp64 (gradcheck) always takes the reference-grade torch path
        return TORCH
    kind = "triton" if device_type == "cuda" else "cpu" if device_type == "cpu" else None
    found = _probe(kind) if kind else None
    has_op = found is not None and (found.fwd if stats_rows is None else found.stats_fwd) is not None
    fits = has_op and (found.max_d is None or d <= found.max_d)
    fits = fits and (stats_rows is None or found.max_rows is None or stats_rows <= found.max_rows)
    return found if fits else TORCH

