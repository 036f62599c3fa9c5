"""Full's points in phase-1 groups (`FullResidual(group=G)`): every read and every gradient equal to the one-shot
reads' (fp64 through the torch twins, fp32 and bf16 through the CPU kernels), groups cut where the key eps changes
and at the last point, and the argument checked."""

from __future__ import annotations

import copy

import pytest
import torch

from attnres.layers.depth_attention import DepthAttention, RMSNorm
from attnres.layers.residuals import FullResidual
from tests import TOL, error_ratios

L, D, N = 4, 24, 5


def model(dtype, eps=None):
    g = torch.Generator().manual_seed(0)
    points = [DepthAttention(D, eps=1e-6 if eps is None else eps(k)) for k in range(2 * L + 1)]
    for p in points:
        with torch.no_grad():
            p.proj.weight.copy_(0.3 * torch.randn(1, D, generator=g))
            p.norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    norms = [RMSNorm(D) for _ in points]
    sublayers = [torch.nn.Linear(D, D) for _ in range(2 * L)]
    for m in (*points, *norms, *sublayers):
        m.to(dtype)
    embedding = torch.randn(N, D, generator=g).to(dtype)
    return points, norms, sublayers, embedding


def step(residual, points, norms, sublayers, embedding):
    """Every read's output, then the gradients of their weighted sum w.r.t. the embedding and every weight."""
    x0 = embedding.detach().requires_grad_()
    state, reads = residual.start(x0), []
    for point in range(2 * L):
        x, state = residual.read(state, point, norms[point] if point % 3 else None)
        reads.append(x)
        state = residual.write(state, torch.tanh(sublayers[point](x)))
    reads.append(residual.read(state, 2 * L, norms[-1])[0])
    used_norms = [n for k, n in enumerate(norms) if k % 3 or k == 2 * L]
    params = [x0, *(w for m in (*points, *used_norms) for w in m.parameters())]
    loss = sum((k + 1) * r.float().square().mean() for k, r in enumerate(reads))
    return reads, list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("group", [2, 3, 8])
def test_groups_read_and_train_as_the_one_shot_reads(group):
    parts = model(torch.float64)
    reads, grads = step(FullResidual(L, parts[0], chain=True, group=group), *parts)
    ref_reads, ref_grads = step(FullResidual(L, parts[0]), *parts)
    for a, b in zip([*reads, *grads], [*ref_reads, *ref_grads], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_through_the_kernels_are_as_close_to_fp64_as_the_chain(dtype):
    """Another order of the same sums: each read and gradient within 4x the chain's own distance from the fp64
    computation of the same weights (plus a floor of a tenth of the dtype's parity bound). The queries' gradients are
    sums that cancel (the softmax's ds sum to zero): there the chain's own fp32 error is about 3e-3 and the groups'
    measured 2.4x that."""
    parts = model(dtype)
    wide = [[copy.deepcopy(m).double() for m in ms] for ms in parts[:3]]
    exact = step(FullResidual(L, wide[0]), *wide, parts[3].double())
    grouped = step(FullResidual(L, parts[0], chain=True, group=4), *parts)
    chained = step(FullResidual(L, parts[0], chain=True), *parts)
    floor = 0.1 * TOL[dtype].rms
    for k, (ref, a, b) in enumerate(zip([*exact[0], *exact[1]], [*grouped[0], *grouped[1]],
                                        [*chained[0], *chained[1]], strict=True)):
        err, chain_err = error_ratios(ref, a)[0], error_ratios(ref, b)[0]
        assert err <= 4 * chain_err + floor, f"output {k}: relative RMS error {err:.1e}, the chain's {chain_err:.1e}"


def test_a_group_ends_where_the_key_eps_changes_and_at_the_last_point():
    points = model(torch.float64, eps=lambda k: 1e-6 if k < 3 else 1e-5)[0]
    residual = FullResidual(L, points, group=4)
    sources = (torch.randn(N, D, dtype=torch.float64),)
    assert residual._score(sources, 0, None)[0][:2] == (0, 3)
    assert residual._score(sources, 3, None)[0][:2] == (3, 7)
    assert residual._score(sources, 7, None)[0][:2] == (7, 2 * L + 1)


@pytest.mark.parametrize("group", [-1, 2.5, True, "4"])
def test_a_bad_group_is_named(group):
    with pytest.raises(ValueError, match="group"):
        FullResidual(L, model(torch.float32)[0], group=group)


def test_a_stage_of_some_points_takes_no_groups():
    points = model(torch.float32)[0]
    assert FullResidual(L, {0: points[0], 1: points[1]}, group=4).group == 0
