"""Argument checks shared by the depth-attention ops.

Every public op validates here, before any kernel runs, so that bad input fails with a message that names the
argument and what was expected instead of a stack trace from deep inside a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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


def check_vector(
    name: str, t: torch.Tensor | None, d: int, device: torch.device, allow_rows: bool = False, stacked: bool = False
) -> None:
    """A per-channel parameter, floating, on the sources' device: `[d]` (or `[1, d]` when `allow_rows`), or with
    `stacked` one per query, `[S, d]` with S >= 1. Every aggregation point checks a few: nothing is formatted unless
    it fails."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {_shape(d, allow_rows, stacked)}, got "
                        f"{type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if stacked:
        if t.dim() != 2 or t.shape[1] != d or t.shape[0] == 0:
            raise ValueError(f"{name}: expected shape [S, {d}] with S >= 1, got {tuple(t.shape)}")
    elif not (tuple(t.shape) == (d,) or (allow_rows and tuple(t.shape) == (1, d))):
        raise ValueError(f"{name}: expected shape {_shape(d, allow_rows, stacked)} to match the sources' last dim "
                         f"d={d}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on the sources' device {device}, got {t.device}")


def _shape(d: int, allow_rows: bool, stacked: bool) -> str:
    return f"[S, {d}]" if stacked else f"[{d}] or [1, {d}]" if allow_rows else f"[{d}]"


def check_eps(name: str, eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(eps).__name__}")
    if not eps > 0:  # also catches NaN
        raise ValueError(f"{name}: expected a positive float, got {eps}")
    return float(eps)


def _check_bank_point(prefix, output, query, gain, out_norm_weight, eps, out_eps) -> tuple[int, int]:
    """A point's prefix `[..., d]` (unit stride along d and its tokens one stride apart, as it is written in place as
    `[N, d]` rows), with an output of its shape and dtype or None, a query `[d]` or `[1, d]`, a key gain and the
    output-norm gain `[d]` (or None) and positive epsilons; returns (N, d), raises ValueError/TypeError."""
    if not isinstance(prefix, torch.Tensor) or prefix.dtype not in FLOAT_DTYPES:
        got = getattr(prefix, "dtype", type(prefix).__name__)
        raise TypeError(f"prefix: expected a floating tensor [..., d], got {got}")
    if prefix.dim() < 1 or prefix.shape[-1] == 0 or not _token_rows(prefix):
        raise ValueError(f"prefix: expected [..., d] with d >= 1, unit stride along d and its tokens one stride apart, "
                         f"got shape {tuple(prefix.shape)} and strides {prefix.stride()}")
    d = prefix.shape[-1]
    if output is not None and not (isinstance(output, torch.Tensor) and output.shape == prefix.shape
                                   and output.dtype == prefix.dtype and output.device == prefix.device):
        raise ValueError(f"output: expected None or a tensor of the prefix's shape {tuple(prefix.shape)}, dtype "
                         f"{prefix.dtype} and device, got {output!r:.120}")
    check_vector("query", query, d, prefix.device, allow_rows=True)
    if gain is None:
        raise TypeError("gain: expected the point's key norm gain, a tensor [d], got None")
    check_vector("gain", gain, d, prefix.device)
    check_vector("out_norm_weight", out_norm_weight, d, prefix.device)
    check_eps("eps", eps)
    check_eps("out_eps", out_eps)
    return prefix.numel() // d, d


def _token_rows(t: torch.Tensor) -> bool:
    """Whether `t` `[..., d]` is, without a copy, N token rows of unit stride along d, one stride apart."""
    d = t.shape[-1]
    try:
        rows = t.view(-1, d)
    except RuntimeError:
        return False
    return rows.stride(1) == 1 or d == 1


def check_depth_attention(
    sources: Sequence[torch.Tensor] | torch.Tensor, query, key_norm_weight, eps, out_norm_weight, out_eps
) -> tuple[list[torch.Tensor], float, float]:
    """The arguments of `depth_attention` (and of its twin): (the sources as a list, eps, out_eps defaulted to eps)."""
    xs = check_sources(sources)
    d, device = xs[0].shape[-1], xs[0].device
    check_vector("query", query, d, device, allow_rows=True)
    check_vector("key_norm_weight", key_norm_weight, d, device)
    check_vector("out_norm_weight", out_norm_weight, d, device)
    eps = check_eps("eps", eps)
    return xs, eps, eps if out_eps is None else check_eps("out_eps", out_eps)


def check_depth_stats(
    sources: Sequence[torch.Tensor] | torch.Tensor, queries, key_norm_weights, eps
) -> tuple[list[torch.Tensor], float]:
    """The arguments of `depth_stats` (and of its twin): (the sources as a list, eps)."""
    xs = check_sources(sources)
    d, device = xs[0].shape[-1], xs[0].device
    check_vector("queries", queries, d, device, stacked=True)
    check_vector("key_norm_weights", key_norm_weights, d, device, stacked=True)
    if key_norm_weights is not None and key_norm_weights.shape != queries.shape:
        raise ValueError(
            f"key_norm_weights: expected one gain per query, shape {tuple(queries.shape)}, "
            f"got {tuple(key_norm_weights.shape)}"
        )
    return xs, check_eps("eps", eps)


def check_bank_aggregate(bank, nvb, prefix, output, query, gain, out_norm_weight, eps, out_eps, write) -> None:
    """The arguments of `attnres.ops.bank.bank_aggregate`: a point, and a bank `[N, NB, d]` over its prefix's N tokens
    (unit stride along d) with nvb valid rows (and row nvb free at a write)."""
    n, d = _check_bank_point(prefix, output, query, gain, out_norm_weight, eps, out_eps)
    if not (isinstance(bank, torch.Tensor) and bank.dim() == 3 and bank.shape[0] == n and bank.shape[2] == d
            and (bank.stride(2) == 1 or d == 1) and bank.dtype == prefix.dtype and bank.device == prefix.device):
        raise ValueError(f"bank: expected [{n}, NB, {d}] {prefix.dtype} tensor on {prefix.device} with unit stride "
                         f"along d, got {tuple(getattr(bank, 'shape', ()))} {getattr(bank, 'dtype', type(bank))}")
    if isinstance(nvb, bool) or not isinstance(nvb, int):
        raise TypeError(f"nvb: expected an int, got {type(nvb).__name__}")
    most = bank.shape[1] - 1 if write else bank.shape[1]
    if not 0 <= nvb <= most:
        raise ValueError(f"nvb: expected 0 <= nvb <= {most} for a bank of {bank.shape[1]} rows "
                         f"({'a write point needs row nvb' if write else 'read point'}), got {nvb}")


def check_bank_merge(m, z, u, prefix, output, query, gain, out_norm_weight, eps, out_eps) -> None:
    """The arguments of `attnres.ops.bank.bank_merge`: a point, and the phase-1 statistics of its N tokens: m, z `[N]`
    and u `[N, d]`, floating, on the prefix's device."""
    n, d = _check_bank_point(prefix, output, query, gain, out_norm_weight, eps, out_eps)
    for name, t, shape in (("m", m, (n,)), ("z", z, (n,)), ("u", u, (n, d))):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a floating tensor of shape {list(shape)}, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.shape != shape or t.device != prefix.device:
            raise ValueError(f"{name}: expected shape {list(shape)} on {prefix.device}, got {tuple(t.shape)} on "
                             f"{t.device}")


def validated(check: Callable, kernel: Callable) -> Callable:
    """`kernel` behind `check` on the same (positional) arguments, before anything is written. The bank ops are wrapped
    once, when a backend is made: an inference stream binds a backend's op for good and calls it at every point, past
    any dispatcher that could check for it. `run.kernel` is the kernel alone."""

    @functools.wraps(kernel)
    def run(*args):
        check(*args)
        return kernel(*args)

    run.kernel = kernel  # for a caller that has checked the arguments it keeps passing (`attnres.layers.bank.BlockBank`)
    return run
