"""Argument checks shared by the depth-attention ops.

Every public op validates here, before any kernel runs, so that bad input fails with a message that names the
argument and what was expected instead of a stack trace from deep inside a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_sources(sources: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """Return the sources as a list of `[..., d]` tensors (a stacked `[R, ..., d]` tensor is unbound, not copied)."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            raise ValueError(
                f"sources: a stacked tensor must have shape [R, ..., d] with at least 2 dims, got {tuple(sources.shape)}"
            )
        sources = list(sources.unbind(0))
    else:
        try:
            sources = list(sources)
        except TypeError:
            raise TypeError(
                f"sources: expected a sequence of tensors or one stacked tensor, got {type(sources).__name__}"
            ) from None
    if len(sources) == 0:
        raise ValueError("sources: expected at least one source tensor, got an empty sequence")
    first = sources[0]
    for j, x in enumerate(sources):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"sources[{j}]: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"sources[{j}]: expected a floating dtype (float32, bfloat16, float16, float64), got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] == 0:
            raise ValueError(f"sources[{j}]: expected shape [..., d] with d >= 1, got {tuple(x.shape)}")
        if x.shape != first.shape:
            raise ValueError(
                f"sources[{j}]: every source must have the shape of sources[0] {tuple(first.shape)}, got {tuple(x.shape)}"
            )
        if x.dtype != first.dtype:
            raise TypeError(f"sources[{j}]: every source must have the dtype of sources[0] ({first.dtype}), got {x.dtype}")
        if x.device != first.device:
            raise ValueError(
                f"sources[{j}]: every source must be on the device of sources[0] ({first.device}), got {x.device}"
            )
    return sources


def check_vector(name: str, t: torch.Tensor | None, d: int, device: torch.device, allow_rows: bool = False) -> None:
    """A per-channel parameter: `[d]` (or `[1, d]` when `allow_rows`), floating, on the sources' device."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape [{d}], got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    ok = tuple(t.shape) == (d,) or (allow_rows and tuple(t.shape) == (1, d))
    if not ok:
        want = f"[{d}] or [1, {d}]" if allow_rows else f"[{d}]"
        raise ValueError(f"{name}: expected shape {want} to match the sources' last dim d={d}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on the sources' device {device}, got {t.device}")


def check_matrix(name: str, t: torch.Tensor | None, d: int, device: torch.device) -> None:
    """A stack of per-query vectors: `[S, d]`."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape [S, {d}], got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if t.dim() != 2 or t.shape[1] != d or t.shape[0] == 0:
        raise ValueError(f"{name}: expected shape [S, {d}] with S >= 1, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on the sources' device {device}, got {t.device}")


def check_eps(name: str, eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(eps).__name__}")
    if not eps > 0:  # also catches NaN
        raise ValueError(f"{name}: expected a positive float, got {eps}")
    return float(eps)
