"""The kernel registry (attnres/ops/registry.py): every op has a portable kernel, a device's backend serves what it
has and what fits, the switch and fp64 take the portable kernels, and a registered backend is the one that runs."""

import pytest
import torch

import attnres
from attnres.ops import cpu, registry
from attnres.ops.depth_attention import point_kernels_from

CACHES = (registry.device_backend, registry._backend, registry._kernel)


@pytest.fixture
def own_registrations():
    """Registrations made in the test are undone after it."""
    saved = dict(registry._REGISTERED)
    yield
    registry._REGISTERED.clear()
    registry._REGISTERED.update(saved)
    for cached in CACHES:
        cached.cache_clear()


def test_every_op_has_a_portable_kernel():
    assert set(registry.PORTABLE.kernels) == set(registry.OPS)
    assert registry.PORTABLE.two_phase_trains


@pytest.mark.skipif(not cpu.available(), reason="the CPU kernel is not available")
def test_the_cpu_backend_serves_what_it_has(monkeypatch):
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    x = torch.empty(2, 8)
    assert registry.kernel("depth_attention_fwd", x) is cpu.cpu_depth_attention_fwd
    assert registry.kernel("point", x) is cpu.cpu_point
    # phase 2 has no CPU kernel: the portable one, and so two-phase does not train here
    assert registry.kernel("merge_prefix_fwd", x) is registry.PORTABLE.kernels["merge_prefix_fwd"]
    assert not cpu.KERNELS.two_phase_trains
    assert registry.backend_name(x) == "cpu"
    # fp64 (gradcheck) and the switch take the portable kernels
    assert registry.kernel("depth_attention_fwd", x.double()) is registry.PORTABLE.kernels["depth_attention_fwd"]
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    assert registry.kernel("depth_attention_fwd", x) is registry.PORTABLE.kernels["depth_attention_fwd"]
    assert registry.backend_name(x) == "torch"


def test_a_backend_serves_only_the_sizes_it_takes():
    backend = registry.Backend("sized", {"depth_stats_fwd": print, "depth_attention_fwd": print}, max_d=64, max_rows=8)
    assert backend.serves("depth_attention_fwd", 64) and not backend.serves("depth_attention_fwd", 65)
    assert backend.serves("depth_stats_fwd", 64, rows=8) and not backend.serves("depth_stats_fwd", 64, rows=9)
    assert backend.serves("depth_attention_fwd", 64, rows=9)  # the row limit is phase 1's
    assert not backend.serves("bank_merge", 8)


def test_a_registered_backend_runs_and_the_rest_falls_back(monkeypatch, own_registrations):
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    calls = []

    def forward(sources, c, out_norm_weight, eps, out_eps):
        calls.append(len(sources))
        return registry.PORTABLE.kernels["depth_attention_fwd"](sources, c, out_norm_weight, eps, out_eps)

    one_shot = {"depth_attention_fwd": forward,
                "depth_attention_bwd": registry.PORTABLE.kernels["depth_attention_bwd"],
                "depth_attention_bwd_into": registry.PORTABLE.kernels["depth_attention_bwd_into"]}
    kernels = one_shot | point_kernels_from(*one_shot.values())  # as the Triton backend composes its point kernels
    registry.register_backend("cpu", registry.Backend("counting", kernels, max_d=16))
    sources = [torch.randn(3, 16, requires_grad=True) for _ in range(4)]
    query = torch.randn(16, requires_grad=True)
    out = attnres.depth_attention(sources, query)  # the portable eager point, over this backend's point kernels
    assert calls == [4]
    expected = attnres.naive_depth_attention(sources, query)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(3, 16)
    leaves = [*sources, query]
    for a, e in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(a, e)
    assert registry.backend_name(torch.empty(1, 17)) == "torch"  # wider than the backend takes


def test_bad_registrations_and_switch_name_what_was_expected(monkeypatch):
    with pytest.raises(ValueError, match=r"^kernels: unknown ops \['fwd'\]"):
        registry.Backend("old", {"fwd": print})
    with pytest.raises(TypeError, match="^backend: expected an attnres.ops.registry.Backend, got dict"):
        registry.register_backend("cpu", {"depth_attention_fwd": print})
    with pytest.raises(ValueError, match="^kernels: unknown ops"):
        registry.register_portable({"depth_attention": print})
    monkeypatch.setenv(registry.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=rf"^{registry.BACKEND_ENV}: expected one of \('auto', 'torch'\)"):
        registry.kernel("depth_attention_fwd", torch.empty(1, 4))
