"""One dispatch for the depth-attention kernels: a registry keyed by op and device.

Every op (`OPS`) has a portable kernel in torch ops, registered by the module that defines the op (`portable`). A
device may have a backend: the Triton kernels on CUDA (`attnres.ops.triton.KERNELS`), the compiled kernel on CPU
(`attnres.ops.cpu.KERNELS`), each a mapping from op to kernel with the sizes it takes, loaded on first use.
`kernel(op, x)` gives the kernel that serves tensors like `x`: the device backend's where it has one for that op and the
tensor fits, the portable one otherwise. Each kernel keeps the contract written on its op
(`attnres::depth_attention_fwd/bwd`, `attnres::depth_stats_fwd/bwd`, `attnres::merge_prefix_fwd/bwd`,
`attnres::merge_sources_fwd/bwd`, `attnres.ops.bank.bank_aggregate/bank_merge`,
`attnres.ops.depth_attention.point_fwd_from`'s and `attnres.ops.chain`'s); the fused bank ops are stored behind those
ops' checks.

`ATTNRES_BACKEND` chooses: `auto` (default: each device's backend where it is available), or `torch` to force the
portable kernels everywhere. fp64 (gradcheck) always takes the portable kernels.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

BACKEND_ENV = "ATTNRES_BACKEND"
BACKEND_CHOICES = ("auto", "torch")

OPS = (
    "depth_attention_fwd", "depth_attention_bwd",
    "depth_attention_bwd_into",  # the backward writing (or adding) the source gradients in place (ops/chain.py)
    # a point from its parameters: the query folded and its gradients formed in the same call (point_fwd_from)
    "point_fwd", "point_bwd", "point_bwd_into",
    # a point as one op with its own autograd node on plain tensors: depth_attention's and depth_attention_chained's
    "point", "chained_point",
    "depth_stats_fwd", "depth_stats_bwd",  # phase 1 (ops/two_phase.py)
    # its backward with each query's gradient as a tensor of its own, the source gradients written or added into a
    # buffer (depth_stats_per_query)
    "depth_stats_bwd_into",
    "merge_prefix_fwd", "merge_prefix_bwd",  # phase 2 (ops/merge.py)
    "merge_sources_fwd", "merge_sources_bwd",  # phase 2 of a group of Full points (ops/merge.py)
    "merge_sources",  # one such point with its own autograd node, on plain tensors (merge.py's merge_sources)
    "bank_aggregate", "bank_merge",  # the fused inference ops (ops/bank.py)
)
# the ops whose rows (sources, queries) are limited
STATS_OPS = frozenset({"depth_stats_fwd", "depth_stats_bwd", "depth_stats_bwd_into"})


@dataclass(frozen=True)
class Backend:
    """The kernels of one device's backend by op, and the sizes they take: d <= max_d, and at most max_rows sources or
    queries in the phase-1 kernels (None: no limit)."""

    name: str
    kernels: Mapping[str, Callable]
    max_d: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if unknown := set(self.kernels) - set(OPS):
            raise ValueError(f"kernels: unknown ops {sorted(unknown)}, expected some of {OPS}")
        object.__setattr__(self, "kernels", MappingProxyType(self.kernels))  # read-only, over the given dict

    def serves(self, op: str, d: int, rows: int | None = None) -> bool:
        """Whether this backend has a kernel for `op` that takes hidden size d (and `rows` sources or queries)."""
        if op not in self.kernels or (self.max_d is not None and d > self.max_d):
            return False
        return op not in STATS_OPS or rows is None or self.max_rows is None or rows <= self.max_rows

    @property
    def two_phase_trains(self) -> bool:
        """Whether two-phase training can pay here: phase 2's backward has a kernel of this backend (the portable
        backend's included). Where it has none (the CPU's) its torch ops cost more than the reads two-phase saves
        (2.6-2.8x one-shot's time in fp32, 32 layers, block size 4, T=1024, d=512)."""
        return "merge_prefix_bwd" in self.kernels


_PORTABLE: dict[str, Callable] = {}
PORTABLE = Backend("torch", _PORTABLE)  # every op's portable kernel, as the op modules register them
# the module of each device's backend, imported on first use: `KERNELS` (a Backend), and `available()`
_DEVICE_MODULES = {"cpu": "attnres.ops.cpu", "cuda": "attnres.ops.triton"}


def portable(op: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the portable kernel of `op` (the one every device falls back to)."""

    def register(fn: Callable) -> Callable:
        register_portable({op: fn})
        return fn

    return register


def register_portable(kernels: Mapping[str, Callable]) -> None:
    """Register portable kernels by op."""
    if unknown := set(kernels) - set(OPS):
        raise ValueError(f"kernels: unknown ops {sorted(unknown)}, expected some of {OPS}")
    _PORTABLE.update(kernels)


_REGISTERED: dict[str, Backend] = {}


def register_backend(device_type: str, backend: Backend) -> None:
    """Serve `device_type` tensors with `backend`'s kernels from now on, in place of attnres's own for that device."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: expected an attnres.ops.registry.Backend, got {type(backend).__name__}")
    _REGISTERED[device_type] = backend
    for cached in (device_backend, _backend, _kernel):
        cached.cache_clear()


@functools.cache  # a device's backend is loaded once
def device_backend(device_type: str) -> Backend | None:
    """The backend of a device type, or None where it has none or it cannot load (no Triton, no compiler)."""
    if device_type in _REGISTERED:
        return _REGISTERED[device_type]
    name = _DEVICE_MODULES.get(device_type)
    if name is None:
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return module.KERNELS if module.available() else None


def _choice() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKEND_CHOICES}, got {choice!r}")
    return choice


def backend_for(device_type: str, dtype: torch.dtype, d: int, op: str = "depth_attention_fwd",
                rows: int | None = None) -> Backend:
    """The backend that runs `op` on `device_type` tensors of `dtype` and hidden size d (and `rows` sources or
    queries): the device's, or `PORTABLE`."""
    return _backend(_choice(), device_type, dtype, d, op, rows)


@functools.cache  # a function of its arguments: a decode step asks at every point
def _backend(choice: str, device_type: str, dtype: torch.dtype, d: int, op: str, rows: int | None) -> Backend:
    found = None if choice != "auto" or dtype == torch.float64 else device_backend(device_type)
    return found if found is not None and found.serves(op, d, rows) else PORTABLE


def kernel(op: str, x: torch.Tensor, rows: int | None = None) -> Callable:
    """The kernel of `op` for tensors like `x` (and `rows` sources or queries, for phase 1)."""
    return _kernel(_choice(), op, x.device.type, x.dtype, x.shape[-1], rows)


@functools.cache
def _kernel(choice: str, op: str, device_type: str, dtype: torch.dtype, d: int, rows: int | None) -> Callable:
    return _backend(choice, device_type, dtype, d, op, rows).kernels[op]


def backend_name(x: torch.Tensor) -> str:
    """The name of the backend whose one-shot kernel serves tensors like `x` (for benchmark labels)."""
    return backend_for(x.device.type, x.dtype, x.shape[-1]).name
