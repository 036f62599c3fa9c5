"""Phase 2 of a group of Full points (`attnres.ops.merge_sources`): against the one-shot operator over the same
sources, outputs and every gradient (through phase 1 too); fp64 gradcheck of the hand-written backward; the CPU
kernel against the torch twin (strided sources, d off the vector width, bf16), and its op with its own autograd node
against the Python Function bit for bit; the fake kernels' shapes; bad input."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnres.ops import SoftmaxStats, depth_attention, depth_stats, merge_sources
from attnres.ops import registry
from attnres.ops.cpu import available as cpu_kernel_available
from attnres.ops.two_phase import depth_stats_per_query, split_stats
from tests import TOL, assert_all_close, assert_close, error_ratios, leaves

EPS, OUT_EPS = 1e-6, 1e-5


def problem(d=16, n=7, before=4, after=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [(3 * torch.randn(n, d, generator=g)).to(dtype) for _ in range(before + after)]
    query, gain = torch.randn(1, d, generator=g, dtype=torch.float64), torch.rand(d, generator=g, dtype=torch.float64)
    out_w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    return xs, query.to(torch.float32 if dtype != torch.float64 else dtype), (gain + 0.5).to(query.dtype), out_w


@pytest.mark.parametrize("out_norm", [False, True])
@pytest.mark.parametrize("after", [0, 1, 3])
def test_phase_1_then_merge_sources_equals_the_one_shot_operator(after, out_norm):
    xs, query, gain, out_w = problem(after=after)
    weight = out_w if out_norm else None
    a = leaves(*xs, query, gain, weight)
    b = leaves(*xs, query, gain, weight)
    stats = depth_stats(a[:4], a[-3], a[-2].unsqueeze(0), eps=EPS)
    stats = SoftmaxStats(*(t[0] for t in stats))
    out = merge_sources(stats, a[4:-3], a[-3], a[-2], eps=EPS, out_norm_weight=a[-1], out_eps=OUT_EPS)
    ref = depth_attention(b[:-3], b[-3], b[-2], eps=EPS, out_norm_weight=b[-1], out_eps=OUT_EPS)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    wrt_a = [t for t in a if t is not None]
    wrt_b = [t for t in b if t is not None]
    for ga, gb in zip(torch.autograd.grad(out, wrt_a, grad), torch.autograd.grad(ref, wrt_b, grad)):
        torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-10)


def test_the_backward_passes_gradcheck():
    xs, query, gain, out_w = problem(d=8, n=3, before=2, after=2)
    stats = depth_stats(xs[:2], query, gain.unsqueeze(0), eps=EPS)
    m, z, u = (t[0].detach() for t in stats)

    def f(z, u, x2, x3, query, gain, out_w):
        return merge_sources(SoftmaxStats(m, z, u), [x2, x3], query, gain, eps=EPS, out_norm_weight=out_w)

    assert torch.autograd.gradcheck(f, tuple(leaves(z, u, xs[2], xs[3], query, gain, out_w)))


def test_split_stats_gives_the_gradients_of_indexing():
    xs, query, gain, _ = problem()
    queries = torch.cat([query, 2 * query, -query])
    a, b = leaves(*xs[:4]), leaves(*xs[:4])
    grads = [torch.randn(7, 16, dtype=torch.float64) for _ in range(3)]
    split = split_stats(depth_stats(a, queries, eps=EPS))
    indexed = depth_stats(b, queries, eps=EPS)
    loss_a = sum((s.u * g).sum() + s.z.sum() for s, g in zip(split[:2], grads))  # the last query unused
    loss_b = sum((indexed.u[q] * g).sum() + indexed.z[q].sum() for q, g in zip(range(2), grads))
    for ga, gb in zip(torch.autograd.grad(loss_a, a), torch.autograd.grad(loss_b, b)):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_chained_phase_1_is_split_stats(monkeypatch, cpu_kernel_calls, backend, dtype):
    """Two groups' phase 1 as a chain (`depth_stats_per_query`: the second over two more sources, taking the first's
    carrier; each query's gradient read where it lies) against `split_stats(depth_stats(...))` for each: values bit for
    bit, and gradients too where the sums round alike. In bf16 the CPU kernel rounds each source's running sum once,
    where autograd rounds each group's gradient and then their sum: there each gradient is checked against float64, at
    least as close as autograd's. One query unused, one query's z unused; sources `[2, 3, d]`, queries with gains."""
    monkeypatch.setenv(registry.BACKEND_ENV, backend)
    g = torch.Generator().manual_seed(3)
    d = 40
    xs = [(3 * torch.randn(2, 3, d, generator=g)).to(dtype) for _ in range(5)]
    queries, gains = 0.3 * torch.randn(6, d, generator=g), torch.rand(6, d, generator=g) + 0.5
    cotangents = [torch.randn(2, 3, d, generator=g) for _ in range(6)]

    def run(chained: bool, sources=xs, weights=(queries, gains)):
        ins = leaves(*sources, *weights)
        q, w = ins[5:]
        if chained:
            first, carrier = depth_stats_per_query(ins[:3], q[:3], w[:3], eps=EPS)
            second, _ = depth_stats_per_query(ins[:5], q[3:], w[3:], eps=EPS, carrier=carrier)
        else:
            first = split_stats(depth_stats(ins[:3], q[:3], w[:3], eps=EPS))
            second = split_stats(depth_stats(ins[:5], q[3:], w[3:], eps=EPS))
        stats = [*first[:2], *second]  # the third query unused
        loss = sum((s.u * t.to(s.u.dtype)).sum() for s, t in zip(stats, cotangents))
        loss = loss + stats[0].z.sum() + stats[3].z.sum()
        return [*(t for s in stats for t in s), *torch.autograd.grad(loss, ins)]

    chained = run(True)
    kernels = list(cpu_kernel_calls)
    stacked = run(False)
    cpu = backend == "auto" and dtype != torch.float64 and cpu_kernel_available()
    assert kernels == (["depth_stats_fwd"] * 2 + ["depth_stats_bwd_into"] * 2 if cpu else [])
    values = 5 * 3
    rounds_once = dtype == torch.bfloat16 and cpu
    exact = run(False, [x.double() for x in xs], (queries.double(), gains.double())) if rounds_once else None
    for k, (a, b) in enumerate(zip(chained, stacked)):
        assert a.shape == b.shape and a.dtype == b.dtype, k
        if k < values or not rounds_once:
            assert torch.equal(a, b), k
        else:
            assert_close(f"grad {k - values}", exact[k].to(a.dtype), a, TOL[dtype])
            assert error_ratios(exact[k], a)[0] <= error_ratios(exact[k], b)[0], k


def test_a_phase_1_carrier_must_come_from_fewer_sources():
    xs, query, gain, _ = problem()
    _, carrier = depth_stats_per_query(xs[:3], query, gain[None], eps=EPS)
    with pytest.raises(ValueError, match=r"^carrier: expected an earlier phase 1's carrier"):
        depth_stats_per_query(xs[:3], query, gain[None], eps=EPS, carrier=carrier)
    with pytest.raises(ValueError, match="^carrier: expected the sources' dtype"):
        depth_stats_per_query([x.float() for x in xs[:4]], query, gain[None], eps=EPS, carrier=carrier)


@pytest.mark.skipif(not cpu_kernel_available(), reason="the CPU kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,after,out_norm", [(576, 3, True), (100, 1, False), (7, 2, True), (64, 0, True)])
def test_the_cpu_kernel_matches_the_torch_twin(monkeypatch, dtype, d, after, out_norm):
    bank = (3 * torch.randn(9, 5, d)).to(dtype)  # sources read in place as bank rows [:, j]
    xs = [bank[:, j] for j in range(5)]
    g = torch.Generator().manual_seed(1)
    query, gain = 0.3 * torch.randn(1, d, generator=g), torch.rand(d, generator=g) + 0.5
    out_w = torch.rand(d, generator=g) + 0.5 if out_norm else None

    def run():  # through phase 1: with the output norm, z's own gradient is a near-cancellation (h . dh ~ 0)
        ins = leaves(*xs[:2 + after], query, gain, out_w)
        stats = split_stats(depth_stats(ins[:2], ins[2 + after], ins[3 + after].unsqueeze(0), eps=EPS))[0]
        out = merge_sources(stats, ins[2:2 + after], ins[2 + after], ins[3 + after], eps=EPS,
                            out_norm_weight=ins[-1], out_eps=OUT_EPS, dtype=dtype)
        wrt = [t for t in ins if t is not None]
        return [out, *torch.autograd.grad(out, wrt, torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype))]

    assert registry.kernel("merge_sources_bwd", xs[0]).__name__ == "cpu_merge_sources_bwd"
    fast = run()
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    assert registry.kernel("merge_sources_bwd", xs[0]).__name__ == "torch_merge_sources_bwd"
    twin = run()
    names = ["out", *[f"x{k}" for k in range(2 + after)], "query", "gain"] + (["out_w"] if out_norm else [])
    assert_all_close(names, twin, fast, TOL[dtype])


@pytest.mark.skipif(not cpu_kernel_available(), reason="the CPU kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("after,with_gain,with_norm", [(3, True, True), (0, True, True), (2, False, False),
                                                       (1, True, False)])
def test_the_cpu_op_equals_the_python_function_bit_for_bit(dtype, after, with_gain, with_norm):
    """The CPU `merge_sources` op (its own C++ autograd node, the query folded inside) against `_MergeSources` over the
    same CPU kernels with the fold in torch ops: the output and every gradient, bit for bit."""
    from attnres.ops.cpu import cpu_merge_sources
    from attnres.ops.merge import merge_sources_point

    def inputs():
        g = torch.Generator().manual_seed(3)
        n, d = 9, 100
        m, z = torch.randn(n, generator=g), (torch.rand(n, generator=g) + 1).requires_grad_()
        u = torch.randn(n, d, generator=g).requires_grad_()
        xs = [(3 * torch.randn(n, d, generator=g)).to(dtype).requires_grad_() for _ in range(after)]
        query = (0.3 * torch.randn(1, d, generator=g)).to(dtype).requires_grad_()  # a point's weights, model dtype
        gain = (torch.rand(d, generator=g) + 0.5).to(dtype).requires_grad_() if with_gain else None
        out_w = (torch.rand(d, generator=g) + 0.5).requires_grad_() if with_norm else None
        return m, z, u, xs, query, gain, out_w

    results = []
    for op in (cpu_merge_sources, merge_sources_point):
        m, z, u, xs, query, gain, out_w = inputs()
        out = op(m, z, u, xs, query, gain, out_w, EPS, OUT_EPS, dtype)
        wrt = [t for t in (z, u, *xs, query, gain, out_w) if t is not None]
        grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
        results.append([out, *torch.autograd.grad(out, wrt, grad_out, allow_unused=True)])
    assert (results[0][3 + after] is None) == (after == 0)  # the query's gradient: only where sources are scored
    for got, want in zip(*results, strict=True):
        assert (got is None) == (want is None)
        assert got is None or (got.dtype == want.dtype and torch.equal(got, want))


@pytest.mark.parametrize("with_sources,with_norm", [(False, False), (False, True), (True, False), (True, True)])
def test_fake_gradients_match_the_real_ones(with_sources, with_norm):
    g = torch.Generator().manual_seed(0)
    m, z, u = torch.randn(5, generator=g), torch.rand(5, generator=g) + 1, torch.randn(5, 8, generator=g)
    sources = [torch.randn(5, 8, generator=g).bfloat16() for _ in range(2)] if with_sources else []
    c = torch.randn(8, generator=g) if with_sources else None
    weight = torch.rand(8, generator=g) + 0.5 if with_norm else None
    args = (torch.randn(5, 8, generator=g).bfloat16(), m, z, u, sources, c, weight, 1e-6, 1e-6)
    real = torch.ops.attnres.merge_sources_bwd(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                     [mode.from_tensor(t) for t in a] if isinstance(a, list) else a for a in args]
        fake = torch.ops.attnres.merge_sources_bwd(*fake_args)
    flat = lambda r: [r[0], r[1], *r[2], r[3], r[4]]  # noqa: E731
    for r, f in zip(flat(real), flat(fake), strict=True):
        assert (tuple(f.shape), f.dtype) == (tuple(r.shape), r.dtype)


def test_bad_input_is_named():
    xs, query, gain, _ = problem(dtype=torch.float32)
    stats = SoftmaxStats(*(t[0] for t in depth_stats(xs[:4], query, gain.unsqueeze(0))))
    with pytest.raises(ValueError, match="sources"):
        merge_sources(stats, [torch.randn(7, 15)], query, gain)
    with pytest.raises(ValueError, match="query"):
        merge_sources(stats, xs[4:], torch.randn(1, 15), gain)
    with pytest.raises(TypeError, match="stats"):
        merge_sources((stats.m, stats.z), xs[4:], query, gain)
