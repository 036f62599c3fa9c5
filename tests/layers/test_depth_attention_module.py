"""DepthAttention, one aggregation point as a module: Kimi K3 parameter layout, zero init, and the functional op."""

from __future__ import annotations

import copy

import pytest
import torch

from attnres import DepthAttention, RMSNorm, depth_attention
from tests import TOL, assert_all_close, assert_close, leaves


def randomized(point: DepthAttention) -> DepthAttention:
    with torch.no_grad():
        point.proj.weight.normal_(std=0.3)
        point.norm.weight.uniform_(0.5, 1.5)
    return point


def test_parameters_layout_and_zero_init():
    point = DepthAttention(12, eps=1e-5)
    assert point.proj.weight.shape == (1, 12) and torch.equal(point.proj.weight, torch.zeros(1, 12))
    assert point.norm.weight.shape == (12,) and torch.equal(point.norm.weight, torch.ones(12))
    assert not isinstance(point.proj, torch.nn.Linear)  # PEFT's all-linear must not wrap it
    assert list(point.state_dict()) == ["proj.weight", "norm.weight"]  # Kimi K3 *_res_proj / *_res_norm
    assert point.eps == point.norm.eps == 1e-5
    randomized(point).reset_parameters()
    assert torch.equal(point.proj.weight, torch.zeros(1, 12)) and torch.equal(point.norm.weight, torch.ones(12))


def test_zero_initialised_point_averages_its_sources():
    sources = [torch.randn(4, 12) * (j + 1) for j in range(3)]
    assert_close("mean", torch.stack(sources).mean(0), DepthAttention(12)(sources), TOL[torch.float32])


def test_rejects_a_non_positive_dim():
    with pytest.raises(ValueError, match=r"^dim: expected a positive hidden size"):
        DepthAttention(0)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_forward_equals_the_functional_op(stacked):
    point = randomized(DepthAttention(16, eps=1e-5))
    sources = torch.randn(5, 2, 3, 16)
    out, weights = point(sources if stacked else list(sources), return_weights=True)
    ref, ref_weights = depth_attention(sources, point.proj.weight, point.norm.weight, eps=1e-5, return_weights=True)
    assert torch.equal(out, ref) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_eps", [None, 1e-3], ids=["norm_eps", "out_eps_override"])
def test_fused_out_norm_equals_the_norm_applied_after(out_eps, dtype):
    """point(sources, norm) == norm(point(sources)) (with norm.eps, or out_eps when given), gradients too; the
    reference runs in fp32 on the same inputs and is rounded once, as the fused path rounds once."""
    point, norm = randomized(DepthAttention(16)).to(dtype), RMSNorm(16, eps=1e-4).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    sources = [(torch.randn(6, 16) * (j + 1)).to(dtype) for j in range(4)]
    grad = torch.randn(6, 16).to(dtype)

    def run(point: DepthAttention, norm: RMSNorm, fused: bool) -> list[torch.Tensor]:
        xs = leaves(*(x.to(point.proj.weight.dtype) for x in sources))
        if fused:
            out = point(xs, norm, out_eps=out_eps)
        else:
            norm.eps = norm.eps if out_eps is None else out_eps
            out = norm(point(xs))
        params = [*xs, point.proj.weight, point.norm.weight, norm.weight]
        return [out, *torch.autograd.grad(out, params, grad.to(out.dtype))]

    ref = [t.to(dtype) for t in run(copy.deepcopy(point).float(), copy.deepcopy(norm).float(), fused=False)]
    names = ["output", *[f"grad source {j}" for j in range(4)], "grad proj", "grad key norm", "grad out norm"]
    assert_all_close(names, ref, run(point, norm, fused=True), TOL[dtype])


def test_a_point_computes_with_the_weight_its_modules_give():
    """Reads take a weight from the module's parameters where it is one, and otherwise ask the module for it: a
    parametrized query and a PreNorm's gain are what the point computes with."""
    from torch.nn.utils import parametrize

    from attnres.layers.depth_attention import weight_of
    from attnres.layers.residuals import PreNorm

    point, norm = randomized(DepthAttention(8)), RMSNorm(8)
    assert weight_of(point.proj) is point.proj.weight and weight_of(PreNorm(norm, 1e-6)) is norm.weight
    sources = [torch.randn(3, 8) for _ in range(4)]
    want = depth_attention(sources, 2 * point.proj.weight, point.norm.weight)

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    parametrize.register_parametrization(point.proj, "weight", Doubled())
    assert torch.equal(weight_of(point.proj), 2 * point.proj.parametrizations.weight.original)
    assert torch.equal(point(sources), want)
