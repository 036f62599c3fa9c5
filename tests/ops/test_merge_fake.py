"""The fake (meta) kernel of `attnres::merge_prefix_bwd` gives every gradient the shape and dtype the real backends
return, in each combination of optional inputs: inductor plans its buffers from the fake."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnres.ops  # noqa: F401  (registers the attnres:: ops)

N, D = 5, 8


def inputs(with_prefix: bool, with_c: bool, with_norm: bool) -> tuple:
    g = torch.Generator().manual_seed(0)
    m, z = torch.randn(N, generator=g), torch.rand(N, generator=g) + 1
    u = torch.randn(N, D, generator=g)
    prefix = torch.randn(N, D, generator=g).bfloat16() if with_prefix else None
    c = torch.randn(D, generator=g) if with_c else None
    weight = torch.rand(D, generator=g) + 0.5 if with_norm else None
    return torch.randn(N, D, generator=g), m, z, u, prefix, c, weight, 1e-6, 1e-6


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("with_prefix,with_c", [(False, False), (False, True), (True, True)])
def test_fake_gradients_match_the_real_ones(with_prefix, with_c, with_norm):
    args = inputs(with_prefix, with_c, with_norm)
    real = torch.ops.attnres.merge_prefix_bwd(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.attnres.merge_prefix_bwd(*fake_args)
    for name, r, f in zip(("du", "dz", "dx", "dc", "d_out_w"), real, fake):
        assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype), name
