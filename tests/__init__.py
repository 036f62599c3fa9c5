"""Helpers shared by the test suite: fla-style comparison of a result, and of every gradient, with a reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Tol(NamedTuple):
    """Bounds on the relative RMS error and on the max error relative to max |reference|."""

    rms: float
    max: float


# Fast op and twin both reduce in fp32, in different orders, and round once to the model dtype at the end.
# fp32: the gap is fp32 rounding (6e-8) grown by d-long dot products and the cancellation in the softmax backward
#   (sum_j ds_j = 0); measured worst 5e-6 relative RMS (query gradient at d=7168).
# bf16 / fp16: the fp32 gap flips the final rounding of a few elements by one ulp, at most 2^-7 (bf16, 8
#   significant bits) or 2^-10 (fp16, 11 bits) relative to the largest element: the max bounds. A flip touches
#   few elements, so the RMS error stays below ~0.4 of that even for T=1 (measured 2.8e-4 bf16, 2.2e-4 fp16).
TOL = {  # parity of a fast path with its twin, per model dtype
    torch.float32: Tol(rms=1e-5, max=5e-5),
    torch.bfloat16: Tol(rms=3e-3, max=8e-3),
    torch.float16: Tol(rms=4e-4, max=1e-3),
}


def error_ratios(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(RMS(out - ref) / RMS(ref), max|out - ref| / max|ref|), in fp64; absolute errors when ref is all zero."""
    ref, out = ref.detach().double(), out.detach().double()
    diff = out - ref
    rms_ref, max_ref = ref.square().mean().sqrt().item(), ref.abs().max().item()
    rms_err, max_err = diff.square().mean().sqrt().item(), diff.abs().max().item()
    return (rms_err / rms_ref if rms_ref > 0 else rms_err), (max_err / max_ref if max_ref > 0 else max_err)


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: Tol) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != reference {ref.dtype}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    rms, mx = error_ratios(ref, out)
    assert rms <= tol.rms and mx <= tol.max, (
        f"{name}: relative RMS error {rms:.2e} (bound {tol.rms:.0e}), relative max error {mx:.2e} (bound {tol.max:.0e})"
    )


def assert_all_close(names: Sequence[str], refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], tol: Tol) -> None:
    assert len(refs) == len(outs) == len(names)
    for name, ref, out in zip(names, refs, outs):
        assert_close(name, ref, out, tol)


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Fresh leaf copies that require grad (None stays None), so two paths can be differentiated independently."""
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
