"""benchmarks/chain_floor.py: the floor kernels do the work they claim, and the record covers every point."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import chain_floor


@pytest.fixture(scope="module")
def floor(tmp_path_factory):
    from attnres.ops import cpu

    assert cpu.available()  # the comparison needs the project's kernel too
    return chain_floor.load_floor(tmp_path_factory.mktemp("floor"))


@pytest.mark.parametrize("name", ["tokens", "dim", "layers", "threads", "repeats"])
def test_sizes_must_be_positive(name):
    with pytest.raises(SystemExit):
        chain_floor.parse_args([f"--{name}", "0"])


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_floor_reads_every_source_and_adds_into_every_sum(floor, accumulate):
    """into[j] (+)= alpha_j g + (g . x_j) x_j: every byte the chain's backward moves, with the least arithmetic."""
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 5, 24, generator=gen) for _ in range(3)]
    grad, weights = torch.randn(2, 5, 24, generator=gen), torch.rand(3, 2, 5, generator=gen)
    into = torch.randn(3, 2, 5, 24, generator=gen)
    expected = torch.stack([
        weights[j, ..., None] * grad + (grad * x).sum(-1, keepdim=True) * x for j, x in enumerate(sources)
    ]) + (into if accumulate else 0)
    floor.bwd_into(grad, sources, weights, into, accumulate)
    torch.testing.assert_close(into, expected)


def test_the_floor_refuses_what_it_cannot_read(floor):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="chain_floor"):
        floor.bwd_into(x, [x.double()], torch.rand(1, 4), torch.zeros(1, 4, 8), False)
    with pytest.raises(RuntimeError, match="into"):
        floor.bwd_into(x, [x], torch.rand(1, 4), torch.zeros(2, 4, 8), False)
    with pytest.raises(RuntimeError, match="lazy_point"):
        floor.lazy_point(x, x[:2].contiguous(), torch.empty_like(x))
    with pytest.raises(RuntimeError, match="weights"):
        floor.lazy_source(x, [x, x], torch.rand(1, 4), torch.empty_like(x))


def test_the_lazy_floor_keeps_each_point_row_and_forms_each_source_gradient_once(floor):
    """lazy_point: g = dy + (dy . o) o; lazy_source: grad = sum_l w_l g_l + (sum_l w_l (g_l . x)) x."""
    gen = torch.Generator().manual_seed(1)
    dy, o, x = (torch.randn(2, 5, 24, generator=gen) for _ in range(3))
    g = torch.empty_like(dy)
    floor.lazy_point(dy, o, g)
    torch.testing.assert_close(g, dy + (dy * o).sum(-1, keepdim=True) * o)
    kept, weights = [torch.randn(2, 5, 24, generator=gen) for _ in range(3)], torch.rand(3, 2, 5, generator=gen)
    grad = torch.empty_like(x)
    floor.lazy_source(x, kept, weights, grad)
    expected = sum(w[..., None] * (gl + (gl * x).sum(-1, keepdim=True) * x) for w, gl in zip(weights, kept))
    torch.testing.assert_close(grad, expected)


def test_the_lazy_backward_gives_depth_attentions_gradients(floor):
    """A chain of points run lazily (each point's row kept, each source's gradient and its share of every later
    query's gradient formed once, newest source first) against autograd through `depth_attention` point by point."""
    from attnres.ops import depth_attention

    eps, count = 1e-6, 4
    gen = torch.Generator().manual_seed(2)
    sources = [torch.randn(6, 16, generator=gen) for _ in range(count)]
    queries, weight = 0.3 * torch.randn(count, 16, generator=gen), 1 + 0.1 * torch.randn(16, generator=gen)
    grad_outs = [torch.randn(6, 16, generator=gen) for _ in range(count)]
    leaves = [x.clone().requires_grad_() for x in [*sources, queries, weight]]
    *xs, qs, w = leaves
    sum((depth_attention(xs[: p + 1], qs[p], None, eps=eps, out_norm_weight=w, out_eps=eps) * grad_outs[p]).sum()
        for p in range(count)).backward()

    alphas = [torch.ops.attnres_cpu.depth_attention_fwd(sources[: p + 1], queries[p], weight, eps, eps)[1]
              for p in range(count)]
    kept, grads = torch.empty(count, 6, 16), torch.empty(count, 6, 16)
    dm_dot_o, d_queries, d_weight = torch.empty(count, 6), torch.zeros_like(queries), torch.zeros_like(weight)
    for p in reversed(range(count)):  # point p, then its newest source p
        mixture = sum(a[:, None] * x for a, x in zip(alphas[p], sources))
        rstd = torch.rsqrt(mixture.square().mean(-1) + eps)
        d_weight += floor.lazy_point_backward(grad_outs[p], mixture, weight, rstd, kept[p], dm_dot_o[p])
        later = torch.stack([alphas[q][p] for q in range(p, count)])
        d_queries[p:] += floor.lazy_source_backward(sources[p], list(kept[p:]), dm_dot_o[p:], later,
                                                    queries[p:].contiguous(), eps, grads[p])
    for j, x in enumerate(xs):
        torch.testing.assert_close(grads[j], x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d_queries, qs.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d_weight, w.grad, rtol=1e-4, atol=1e-5)


def test_the_record_has_the_schedule_and_every_point(tmp_path):
    out = tmp_path / "chain_floor.json"
    chain_floor.main(["--tokens", "16", "--dim", "32", "--layers", "1", "--repeats", "2", "--cold", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.chain_floor")
    assert set(record["results"]["points"]) == {"1", "2", "3"}  # 2L + 1 points for L = 1
    for summary in [record["results"]["schedule"], *record["results"]["points"].values()]:
        assert summary["kernel_ms"]["min"] > 0 and summary["floor_ms"]["min"] > 0
        assert summary["floor_over_kernel"]["median"] == pytest.approx(
            summary["floor_ms"]["median"] / summary["kernel_ms"]["median"])
    results = record["results"]  # the lazy sides over the whole schedule: its floor against the floor, it against the kernel
    assert results["lazy_floor"]["lazy_floor_ms"]["min"] > 0 and results["lazy"]["lazy_ms"]["min"] > 0
    assert results["lazy_floor"]["floor_ms"] == results["schedule"]["floor_ms"]
    assert results["lazy"]["kernel_ms"] == results["schedule"]["kernel_ms"]
