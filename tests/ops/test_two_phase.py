"""Two-phase depth attention (docs/design.md section 4): statistics against their twin, exact merges in any split and
order, and the finish with and without the fused output norm, outputs and gradients."""

from __future__ import annotations

import itertools
import random
from typing import NamedTuple

import pytest
import torch

from attnres import depth_attention, depth_stats, finish_stats, merge_stats, naive_depth_stats
from attnres.ops import SoftmaxStats
from tests import TOL, assert_all_close, leaves

EPS = 1e-6


class Case(NamedTuple):
    S: int  # queries
    R: int  # sources
    lead: tuple[int, ...]
    d: int
    scale: float = 1.0
    gains: bool = True
    stacked: bool = False

    def __str__(self) -> str:
        flags = [f"x{self.scale:g}" if self.scale != 1 else "", "" if self.gains else "nogain",
                 "stacked" if self.stacked else ""]
        return "-".join([f"S{self.S}", f"R{self.R}", "T" + "x".join(map(str, self.lead)), f"D{self.d}",
                         *filter(None, flags)])


CASES = [
    # single-axis stress
    Case(3, 5, (2, 3), 16),
    Case(1, 1, (4,), 8),
    Case(4, 9, (16,), 64, gains=False),
    Case(2, 3, (1,), 16),  # one token
    Case(2, 3, (32,), 1),  # one channel
    Case(2, 3, (1,), 7168),
    Case(3, 4, (5,), 24, stacked=True),
    Case(3, 4, (5,), 24, scale=1e4),
    Case(3, 4, (5,), 24, scale=1e-4),
    # multi-axis stress
    Case(5, 7, (2, 3), 33, scale=1e4, gains=False, stacked=True),
]


def make_inputs(S: int, R: int, lead: tuple[int, ...], d: int, scale: float = 1.0, gains: bool = True):
    sources = [torch.randn(*lead, d) * scale * (0.5 + torch.rand(())) for _ in range(R)]
    queries = torch.randn(S, d) * 2 / d**0.5
    return sources, queries, (torch.rand(S, d) + 0.5) if gains else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_depth_stats_matches_twin(case: Case, dtype):
    """m, z, u, and the gradients through z and u (both hold the shift m fixed, so they are comparable)."""
    sources, queries, gains = make_inputs(case.S, case.R, case.lead, case.d, case.scale, case.gains)
    sources = [x.to(dtype) for x in sources]
    lead = (case.S, *case.lead)
    grad_z, grad_u = torch.randn(lead), torch.randn(*lead, case.d) / max(case.scale, 1.0)

    def run(op):
        xs = leaves(torch.stack(sources)) if case.stacked else leaves(*sources)
        q, g = leaves(queries, gains)
        stats = op(xs[0] if case.stacked else xs, q, g, eps=EPS)
        loss = (stats.z * grad_z).sum() + (stats.u * grad_u).sum()
        return [*stats, *torch.autograd.grad(loss, [*xs, q] + ([g] if g is not None else []))]

    ref, out = run(naive_depth_stats), run(depth_stats)
    names = ["m", "z", "u", *[f"grad source {j}" for j in range(len(ref) - 5)], "grad queries", "grad gains"]
    assert_all_close(names, ref, out, TOL[dtype])


def one_shot(sources, queries, gains, out_norm_weight, out_eps: float) -> torch.Tensor:
    """The S mixtures `[S, ..., d]`, one depth_attention call per query."""
    per_query = []
    for s in range(queries.shape[0]):
        o = None if out_norm_weight is None else out_norm_weight if out_norm_weight.dim() == 1 else out_norm_weight[s]
        g = None if gains is None else gains[s]
        per_query.append(depth_attention(sources, queries[s], g, eps=EPS, out_norm_weight=o, out_eps=out_eps))
    return torch.stack(per_query)


def merged(groups, sources, queries, gains, out_norm_weight, out_eps: float, dtype=None, pairing=None):
    """Statistics of each group, merged left to right (or in the order `pairing` picks), then finished."""
    pool = [depth_stats([sources[j] for j in group], queries, gains, eps=EPS) for group in groups]
    while len(pool) > 1:
        i, k = (0, 1) if pairing is None else pairing(len(pool))
        a, b = pool[i], pool[k]
        pool = [s for n, s in enumerate(pool) if n not in (i, k)] + [merge_stats(a, b)]
    return finish_stats(pool[0], out_norm_weight, out_eps=out_eps, dtype=dtype)


def set_partitions(items: list[int]):
    """Every partition of `items` into non-empty groups."""
    if len(items) == 1:
        yield [items]
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def forward_backward(fn, sources, queries, gains, out_norm_weight, grad_out):
    xs, (q, g, o) = leaves(*sources), leaves(queries, gains, out_norm_weight)
    out = fn(xs, q, g, o)
    wrt = [t for t in (*xs, q, g, o) if t is not None]
    return [out, *torch.autograd.grad((out.double() * grad_out).sum(), wrt)]


def test_every_split_of_four_sources_in_every_order_equals_one_shot():
    sources, queries, gains = make_inputs(3, 4, (2, 3), 16)
    out_norm_weight = torch.rand(3, 16) + 0.5
    grad_out = torch.randn(3, 2, 3, 16, dtype=torch.float64)
    args = (sources, queries, gains, out_norm_weight, grad_out)
    ref = forward_backward(lambda *a: one_shot(*a, out_eps=1e-5), *args)
    names = ["output", *[f"grad source {j}" for j in range(4)], "grad queries", "grad gains", "grad out norm"]
    splits = [p for p in set_partitions(list(range(4))) if len(p) in (2, 3)]
    assert len(splits) == 7 + 6  # Stirling numbers S(4, 2) + S(4, 3)
    for split in splits:
        for order in itertools.permutations(split):
            out = forward_backward(lambda *a: merged(order, *a, out_eps=1e-5), *args)
            assert_all_close([f"{order}: {n}" for n in names], ref, out, TOL[torch.float32])


def test_random_splits_of_many_sources_merged_in_random_trees_equal_one_shot():
    rng = random.Random(0)
    R, S = 12, 2
    sources, queries, gains = make_inputs(S, R, (5,), 24, scale=3.0)
    grad_out = torch.randn(S, 5, 24, dtype=torch.float64)
    args = (sources, queries, gains, None, grad_out)
    ref = forward_backward(lambda *a: one_shot(*a, out_eps=EPS), *args)
    names = ["output", *[f"grad source {j}" for j in range(R)], "grad queries", "grad gains"]
    for _ in range(6):
        labels = [rng.randrange(rng.randint(2, 6)) for _ in range(R)]
        groups = [g for g in ([j for j in range(R) if labels[j] == k] for k in range(6)) if g]
        rng.shuffle(groups)
        pairing = lambda n: tuple(rng.sample(range(n), 2))  # noqa: E731 - any two partial sets, either side first
        out = forward_backward(lambda *a: merged(groups, *a, out_eps=EPS, pairing=pairing), *args)
        assert_all_close([f"{groups}: {n}" for n in names], ref, out, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_norm", ["shared", "per_query", "none"])
def test_finish_matches_depth_attention_with_out_norm(out_norm, dtype):
    """finish_stats(..., out_norm_weight, dtype) equals depth_attention(..., out_norm_weight=...) in that dtype."""
    sources, queries, gains = make_inputs(3, 5, (4,), 32)
    o = {"shared": torch.rand(32) + 0.5, "per_query": torch.rand(3, 32) + 0.5, "none": None}[out_norm]
    rounded = [t.to(dtype).float() for t in sources], queries.to(dtype).float(), gains.to(dtype).float()
    o = None if o is None else o.to(dtype).float()
    grad_out = torch.randn(3, 4, 32).to(dtype).double()  # exact in dtype: both paths see the same upstream gradient

    def finish(xs, q, g, o):
        return finish_stats(depth_stats(xs, q, g, eps=EPS), o, out_eps=1e-4, dtype=dtype)

    # reference in fp32 on the same rounded inputs, rounded once at the end: the one-shot calls in bf16 would
    # round each query's source gradient before autograd sums them, a worse reference than the fused sum
    ref = forward_backward(lambda *a: one_shot(*a, out_eps=1e-4), *rounded, o, grad_out)
    ref = [t.to(dtype) for t in ref]
    low = [x.to(dtype) for x in rounded[0]], *(t.to(dtype) for t in rounded[1:])
    out = forward_backward(finish, *low, None if o is None else o.to(dtype), grad_out)
    names = ["output", *[f"grad source {j}" for j in range(5)], "grad queries", "grad gains", "grad out norm"]
    assert out[0].dtype == dtype
    assert_all_close(names[: len(ref)], ref, out, TOL[dtype])


@pytest.mark.parametrize("out_norm", ["none", "shared", "per_query"])
def test_gradcheck_through_merge_and_finish(out_norm):
    """Raw z and u are not gradcheck-able (m is a stop-gradient shift that moves with the input); their finish is."""
    S, d = 2, 4
    xs = [(torch.randn(2, d) * (j + 1)).double().requires_grad_() for j in range(3)]
    q = torch.randn(S, d, dtype=torch.float64, requires_grad=True)
    g = (torch.rand(S, d, dtype=torch.float64) + 0.5).requires_grad_()
    o = {"none": None, "shared": torch.rand(d), "per_query": torch.rand(S, d)}[out_norm]
    extra = [] if o is None else [(o.double() + 0.5).requires_grad_()]

    def fn(x0, x1, x2, q, g, *o):
        stats = merge_stats(depth_stats([x2], q, g, eps=0.1), depth_stats([x0, x1], q, g, eps=0.1))
        return finish_stats(stats, *o, out_eps=0.05)

    assert torch.autograd.gradcheck(fn, (*xs, q, g, *extra))


def test_merge_is_exact_with_far_apart_scores():
    """Shifts far apart (one set dominates by ~80 nats): the merge rescales rather than overflowing exp."""
    d = 8
    strong = torch.ones(3, d)
    weak = -torch.ones(3, d)
    query = torch.full((1, d), 10.0)  # scores +80 and -80 (the keys are normalised to +-1)
    stats = merge_stats(depth_stats([weak], query), depth_stats([strong], query))
    assert torch.isfinite(stats.z).all() and torch.isfinite(stats.u).all()
    torch.testing.assert_close(finish_stats(stats)[0], strong, rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_opcheck_depth_stats(transposed):
    """Registrations as torch.compile needs them; dense transposed sources: the fake grads are contiguous too."""
    shape = (3, 2, 8) if transposed else (2, 3, 8)
    sources = [torch.randn(shape).transpose(0, int(transposed)).requires_grad_() for _ in range(3)]
    cs = torch.randn(4, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.attnres.depth_stats_fwd.default, (sources, cs, 1e-6))
    plain = [x.detach() for x in sources]
    m, z, u, rstd = torch.ops.attnres.depth_stats_fwd(plain, cs.detach(), 1e-6)
    args = (torch.randn_like(z), torch.randn_like(u), plain, cs.detach(), m, rstd, 1e-6)
    torch.library.opcheck(torch.ops.attnres.depth_stats_bwd.default, args)


def test_stats_shapes_and_stop_gradient_shift():
    sources, queries, gains = make_inputs(3, 4, (2, 5), 16)
    stats = depth_stats([x.requires_grad_() for x in sources], queries, gains)
    assert isinstance(stats, SoftmaxStats)
    assert stats.m.shape == stats.z.shape == (3, 2, 5) and stats.u.shape == (3, 2, 5, 16)
    assert not stats.m.requires_grad and stats.z.requires_grad and stats.u.requires_grad
