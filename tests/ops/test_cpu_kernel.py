"""The compiled CPU kernel (`attnres.ops.cpu`): the one-shot forward and backward and phase 1 of the two-phase
computation (forward and backward) against the torch path of the same custom-op contract run in fp64 (the oracle),
strided sources read in place, and end to end through `attnres.depth_attention` and `attnres.depth_stats` against
the twins.

The kernel is built once per machine (cached); its build failing is a test failure, not a skip, unless the kernel
is switched off with ATTNRES_DISABLE_CPU_KERNEL=1.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import attnres
from attnres.layers import DepthAttention, make_stream
from attnres.layers.residuals import two_phase_pays
from attnres.ops import cpu, registry
from attnres.ops.cpu import build
from attnres.ops.depth_attention import torch_depth_attention_bwd, torch_depth_attention_fwd
from attnres.ops.two_phase import torch_depth_stats_bwd, torch_depth_stats_fwd

pytestmark = pytest.mark.skipif(cpu.disabled(), reason=f"{cpu.DISABLE_ENV} is set")

EPS, OUT_EPS = 1e-6, 1e-5
# error bound against the fp64 oracle, relative to the tensor's largest entry: fp32 math, and low-precision results
# rounded once (half an ulp, plus the rounding of the inputs' own gradient for the backward); fp64 leaves room for
# the cancellation in the softmax backward over rows of 40000 elements, and is still far from any fp32 error
TOL = {torch.float64: 1e-10, torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu.available(), "the CPU kernel failed to build or load; the reason is in the log"


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max abs error at most tol times the largest magnitude of `expected` (per tensor, so tiny entries don't rule)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    err = (a - e).abs().max().item() if e.numel() else 0.0
    scale = e.abs().max().item() if e.numel() else 0.0
    assert err <= tol * max(scale, 1e-30), f"{what}: max error {err:.3g} vs scale {scale:.3g} (tol {tol:g})"


def make_case(n_src, lead, d, dtype, out_norm, with_grad_weights, score_scale=1.0):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sources = [(torch.randn(*lead, d, dtype=acc) * (0.5 + j)).to(dtype) for j in range(n_src)]
    c = torch.randn(d, dtype=acc) * score_scale / d**0.5
    out_w = torch.randn(d, dtype=acc) if out_norm else None
    grad_out = torch.randn(*lead, d, dtype=acc).to(dtype)
    grad_weights = torch.randn(n_src, *lead, dtype=acc) if with_grad_weights else None
    return sources, c, out_w, grad_out, grad_weights


def check_against_oracle(sources, c, out_w, grad_out, grad_weights):
    """The kernel's forward and backward against the torch path run in fp64 on the same (rounded) inputs."""
    dtype, acc = sources[0].dtype, c.dtype
    up = [None if t is None else t.double() for t in (c, out_w, grad_out, grad_weights)]
    c64, out_w64, grad_out64, grad_weights64 = up
    sources64 = [x.double() for x in sources]

    fast = cpu.cpu_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    ref = torch_depth_attention_fwd(sources64, c64, out_w64, EPS, OUT_EPS)
    assert [t.dtype for t in fast] == [dtype, acc, acc]
    for name, a, e in zip(("out", "weights", "rstd"), fast, ref):
        assert_close_rel(a, e, TOL[dtype] if name == "out" else TOL[acc], name)

    _, weights, rstd = fast
    grads, dc, d_out_w = cpu.cpu_depth_attention_bwd(
        grad_out, grad_weights, sources, c, out_w, weights, rstd, EPS, OUT_EPS
    )
    _, weights64, rstd64 = ref
    ref_grads, ref_dc, ref_d_out_w = torch_depth_attention_bwd(
        grad_out64, grad_weights64, sources64, c64, out_w64, weights64, rstd64, EPS, OUT_EPS
    )
    assert len(grads) == len(sources) and all(g.dtype == dtype for g in grads)
    assert dc.dtype == d_out_w.dtype == acc
    # one scale for all sources: a source with a tiny weight has a tiny gradient, whose own scale says nothing
    assert_close_rel(torch.stack(grads), torch.stack(ref_grads), TOL[dtype], "grads of the sources")
    assert_close_rel(dc, ref_dc, TOL[acc], "grad of c")
    assert_close_rel(d_out_w, ref_d_out_w, TOL[acc], "grad of out_norm_weight")


CASES = {
    # single-axis stress
    "R9-T37-d67-fp32": (9, (37,), 67, torch.float32, False, False),  # d not a multiple of the vector width
    "R1-T1-d5-fp32-outnorm-gw": (1, (1,), 5, torch.float32, True, True),  # one source gives itself back
    "R2-T0-d8-fp32": (2, (0,), 8, torch.float32, True, True),  # no tokens at all
    "R4-T16-d64-bf16": (4, (16,), 64, torch.bfloat16, False, False),
    "R3-T9-d33-fp16-gw": (3, (9,), 33, torch.float16, False, True),
    "R5-T7-d31-fp64-outnorm": (5, (7,), 31, torch.float64, True, False),
    # multi-axis stress
    "R9-B2xT50-d1000-bf16-outnorm-gw": (9, (2, 50), 1000, torch.bfloat16, True, True),
    "R17-B3xT5-d129-fp32-outnorm-gw": (17, (3, 5), 129, torch.float32, True, True),
    # backward tiles of more sources than a tile has tokens
    "R70-T80-d5-fp32-outnorm-gw": (70, (80,), 5, torch.float32, True, True),
    # rows too long to keep a token's sources in L2 together: groups of one row, merged by the online softmax
    "R3-T2-d40000-fp32-outnorm-gw": (3, (2,), 40000, torch.float32, True, True),
    "R4-T2-d70001-bf16": (4, (2,), 70001, torch.bfloat16, False, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_fp64_oracle(case):
    check_against_oracle(*make_case(*case))


def aligned_sources(dtype, score_scale, order, d=40):
    """Sources whose scores grow (or shrink) from one to the next, so the running max moves at every source."""
    sources, c, out_w, grad_out, grad_weights = make_case(6, (11,), d, dtype, False, True, score_scale)
    steps = range(6) if order == "ascending" else reversed(range(6))
    return [x + k * c.sign().to(dtype) for x, k in zip(sources, steps)], c, out_w, grad_out, grad_weights


@pytest.mark.parametrize("d", [40, 40000], ids=["one-group", "row-groups"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_peaked_scores_match_oracle(order, d):
    """Scores beyond exp's range (|s| ~ 100), in fp64 so that the rounding of the scores is no issue; with long
    rows every source is its own group, so the running max and the rescaling move from group to group."""
    check_against_oracle(*aligned_sources(torch.float64, 30.0 * (40 / d) ** 0.5, order, d))  # same |s| for any d


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_saturated_scores_pick_the_top_source(order):
    """At saturation the weights are exactly one-hot: the output is the top source, which alone gets grad_out."""
    sources, c, out_w, grad_out, grad_weights = aligned_sources(torch.float32, 1e5, order)
    out, weights, rstd = cpu.cpu_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    top, tokens = weights.argmax(0), torch.arange(11)
    one_hot = torch.zeros_like(weights)
    one_hot[top, tokens] = 1
    assert torch.equal(weights, one_hot)
    assert torch.equal(out, torch.stack(sources)[top, tokens])
    grads, dc, _ = cpu.cpu_depth_attention_bwd(grad_out, grad_weights, sources, c, out_w, weights, rstd, EPS, OUT_EPS)
    assert torch.equal(torch.stack(grads), one_hot.unsqueeze(-1) * grad_out)
    assert torch.equal(dc, torch.zeros_like(dc))


def exact_score_case(tokens, n_src=13, d=32, scale=1.0, seed=0):
    """Sources of entries +-2 and a query of multiples of 1/128, so that with eps = 0 every score is exact in fp32
    (rstd 1/2, dots of multiples of 1/64 below 2^8) and the scores' remainders modulo ln 2 cover exp's reduced range
    densely: then the kernel's weights differ from softmax in fp64 only by its exp, its sum and its division.
    Returns (sources, c, the fp64 softmax weights [R, tokens])."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n_src, tokens, d), generator=gen).float() * 2 - 1
    sources = list(2 * signs)
    c = torch.randint(-768, 769, (d,), generator=gen).float() / 128 * scale
    scores = (signs.double() @ c.double())  # = (x . c) * rstd, exactly
    return sources, c, scores.softmax(dim=0)


def test_fp32_weights_are_softmax_to_a_few_ulp():
    """The fp32 forward takes exp per lane (exp_lanes, a polynomial): on exact scores spread over e^0 .. e^-150 its
    weights are fp64's softmax to 5 units of 2^-24 where they are normal (torch's own fp32 softmax is off by up to
    3.3 on such cases), and exactly zero below FLT_MIN (the kernels flush subnormals: FlushSubnormals)."""
    sources, c, expected = exact_score_case(53, scale=2.0)
    _, weights, rstd = cpu.cpu_depth_attention_fwd(sources, c, None, 0.0, OUT_EPS)
    assert torch.equal(rstd, torch.full_like(rstd, 0.5)), "the case's scores are not exact"
    tiny = torch.finfo(torch.float32).tiny
    assert (expected < tiny).sum() > 10 and (expected > 1e-3).sum() > 50, "the case does not span exp's range"
    err = (weights.double() - expected).abs()
    normal = expected >= tiny
    assert (err[normal] / expected[normal]).max() <= 5 * 2.0**-24
    assert torch.equal(weights[~normal], torch.zeros_like(weights[~normal]))


def has_subnormals(t: torch.Tensor) -> bool:
    return bool(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_subnormal_inputs_read_as_zero_and_the_callers_mode_is_kept(dtype):
    """Sources a third subnormal (x86 takes an assist on each): the kernel reads those entries as zero, bit for bit
    the result of zeros there, within the fp64 oracle's tolerance, and without a subnormal in any result; the thread
    that called it still computes subnormals afterwards."""
    assert torch.set_flush_denormal(False), "no DAZ/FTZ on this CPU"
    sources, c, out_w, grad_out, grad_weights = make_case(6, (64,), 96, dtype, True, True)
    tiny = torch.finfo(dtype).tiny
    zeroed = []
    for j, x in enumerate(sources):
        where = torch.rand(x.shape, generator=torch.Generator().manual_seed(j)) < 1 / 3
        zeroed.append(x.masked_fill(where, 0))
        x[where] = tiny / 8
    assert all(has_subnormals(x) for x in sources)

    def run(xs):
        out, weights, rstd = cpu.cpu_depth_attention_fwd(xs, c, out_w, EPS, OUT_EPS)
        grads, dc, d_out_w = cpu.cpu_depth_attention_bwd(grad_out, grad_weights, xs, c, out_w, weights, rstd, EPS,
                                                         OUT_EPS)
        return out, weights, rstd, *grads, dc, d_out_w

    results = run(sources)
    assert all(torch.equal(a, b) for a, b in zip(results, run(zeroed)))
    assert not any(has_subnormals(t) for t in results)
    check_against_oracle(sources, c, out_w, grad_out, grad_weights)
    assert torch.tensor(tiny, dtype=torch.float32) / 4 > 0, "the kernel left flush-to-zero on in its caller"


def test_a_token_is_computed_alone_whatever_its_tile():
    """Tokens are taken in tiles (16 in the forward, up to 64 in the backward), their scalar steps as vectors across
    the tile: each token's output, weights, rstd and gradients are still bit for bit what it gets alone (one token,
    as the fused bank ops run it), and a NaN in one token stays in that token, also in the lanes that a later, partial
    tile leaves unused."""
    n_tok = 150  # backward tiles of 64, 64 and 22 tokens
    sources, c, out_w, grad_out, grad_weights = make_case(7, (n_tok,), 40, torch.float32, True, True, score_scale=3.0)
    sources[3][20, 5] = sources[3][64 + 25, 0] = float("nan")

    def same(a, b):  # bit for bit, NaN where the other has NaN
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())

    out, weights, rstd = cpu.cpu_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    grads, _, _ = cpu.cpu_depth_attention_bwd(grad_out, grad_weights, sources, c, out_w, weights, rstd, EPS, OUT_EPS)
    for t in range(n_tok):
        alone = [x[t : t + 1] for x in sources]
        o, w, r = cpu.cpu_depth_attention_fwd(alone, c, out_w, EPS, OUT_EPS)
        g, _, _ = cpu.cpu_depth_attention_bwd(
            grad_out[t : t + 1], grad_weights[:, t : t + 1], alone, c, out_w, w, r, EPS, OUT_EPS
        )
        assert same(out[t : t + 1], o) and same(weights[:, t : t + 1], w) and same(rstd[:, t : t + 1], r), t
        assert all(same(a[t : t + 1], b) for a, b in zip(grads, g)), t
    assert out[[20, 89]].isnan().all() and weights[:, [20, 89]].isnan().all()
    finite = (torch.arange(n_tok) != 20) & (torch.arange(n_tok) != 89)
    assert out[finite].isfinite().all() and weights[:, finite].isfinite().all()


def test_non_contiguous_inputs_give_the_contiguous_result():
    sources, c, out_w, grad_out, grad_weights = make_case(4, (6,), 24, torch.bfloat16, True, True)
    # every other row of an interleave, or column-major
    strided = [torch.stack([x, x], dim=1)[:, 1] if j % 2 else x.t().contiguous().t() for j, x in enumerate(sources)]
    assert not any(x.is_contiguous() for x in strided)
    expanded_grad = grad_out[:1].expand(6, 24)  # like the gradient of .sum(): stride 0
    weights_grad = grad_weights.t().contiguous().t()
    plain = cpu.cpu_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    odd = cpu.cpu_depth_attention_fwd(strided, c, out_w, EPS, OUT_EPS)
    for a, e in zip(odd, plain):
        assert torch.equal(a, e)
    _, weights, rstd = plain
    plain = cpu.cpu_depth_attention_bwd(
        expanded_grad.contiguous(), grad_weights, sources, c, out_w, weights, rstd, EPS, OUT_EPS
    )
    odd = cpu.cpu_depth_attention_bwd(expanded_grad, weights_grad, strided, c, out_w, weights, rstd, EPS, OUT_EPS)
    for a, e in zip(odd[0], plain[0]):
        assert torch.equal(a, e)
    assert torch.equal(odd[1], plain[1]) and torch.equal(odd[2], plain[2])


def test_leading_dims_that_flatten_are_read_in_place_and_the_rest_copied():
    """Sources [B, 1, T, d] in every layout: leading dims that flatten to one row stride (rows of a wider buffer, a
    unit dim of any stride) and ones that do not (a slice of T, B and T swapped): the contiguous result bit for bit,
    forward and backward."""
    sources, c, out_w, grad_out, grad_weights = make_case(5, (2, 1, 3), 16, torch.float32, True, True)
    wide = torch.zeros(2, 1, 3, 40)
    wide[..., 8:24] = sources[0]
    sliced = torch.zeros(2, 1, 5, 16)
    sliced[:, :, 1:4] = sources[2]
    unit = torch.empty_strided((2, 1, 3, 16), (48, 999, 16, 1))
    unit.copy_(sources[3])
    layouts = [
        wide[..., 8:24],  # rows of a wider buffer: row stride 40, read in place
        sources[1].transpose(0, 2).contiguous().transpose(0, 2),  # B and T swapped: copied
        sliced[:, :, 1:4],  # a slice of T: copied
        unit,  # the unit dim's stride does not matter: read in place
        sources[4],
    ]
    assert all(torch.equal(a, e) for a, e in zip(layouts, sources))
    plain = cpu.cpu_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    odd = cpu.cpu_depth_attention_fwd(layouts, c, out_w, EPS, OUT_EPS)
    assert all(torch.equal(a, e) for a, e in zip(odd, plain))
    _, weights, rstd = plain
    plain = cpu.cpu_depth_attention_bwd(grad_out, grad_weights, sources, c, out_w, weights, rstd, EPS, OUT_EPS)
    odd = cpu.cpu_depth_attention_bwd(grad_out, grad_weights, layouts, c, out_w, weights, rstd, EPS, OUT_EPS)
    assert all(torch.equal(a, e) for a, e in zip(odd[0], plain[0]))
    assert torch.equal(odd[1], plain[1]) and torch.equal(odd[2], plain[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_public_op_routes_to_kernel_and_matches_twin(dtype, monkeypatch, cpu_kernel_calls):
    """End to end through `attnres.depth_attention`: the kernel serves it, and output and every gradient match
    the autograd twin."""
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    d = 48
    leaves = [torch.randn(3, 7, d).to(dtype).requires_grad_() for _ in range(5)]
    query = (torch.randn(d) / d**0.5).requires_grad_()
    gain = (1 + 0.1 * torch.randn(d)).requires_grad_()
    out_w = (1 + 0.1 * torch.randn(d)).requires_grad_()
    grad = torch.randn(3, 7, d).to(dtype)
    results = []
    for fn in (attnres.depth_attention, attnres.naive_depth_attention):
        out, weights = fn(leaves, query, gain, eps=EPS, out_norm_weight=out_w, out_eps=OUT_EPS, return_weights=True)
        if fn is attnres.depth_attention:
            assert cpu_kernel_calls == ["point"]
        inputs = [*leaves, query, gain, out_w]
        results.append([out, weights, *torch.autograd.grad((out.float() * grad.float()).sum(), inputs)])
    names = ["out", "weights"] + [f"grad source {j}" for j in range(5)] + ["grad query", "grad gain", "grad out_w"]
    for name, a, e in zip(names, *results):
        assert a.dtype == e.dtype, name
        assert_close_rel(a, e, TOL[a.dtype], name)  # both compute in fp32 from the same inputs


def make_stats_case(n_src, n_q, lead, d, dtype, score_scale=2.0):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sources = [(torch.randn(*lead, d, dtype=acc) * (0.5 + j)).to(dtype) for j in range(n_src)]
    cs = torch.randn(n_q, d, dtype=acc) * score_scale / d**0.5
    grad_z = torch.randn(n_q, *lead, dtype=acc).reshape(n_q, -1)
    grad_u = torch.randn(n_q, *lead, d, dtype=acc).reshape(n_q, -1, d)
    return sources, cs, grad_z, grad_u


def check_stats_against_oracle(sources, cs, grad_z, grad_u):
    """Phase 1 forward and backward of the kernel against the torch path in fp64 on the same (rounded) inputs."""
    dtype, acc = sources[0].dtype, cs.dtype
    sources64 = [x.double() for x in sources]
    fast = cpu.cpu_depth_stats_fwd(sources, cs, EPS)
    ref = torch_depth_stats_fwd(sources64, cs.double(), EPS)
    assert [t.dtype for t in fast] == [acc] * 4
    for name, a, e in zip(("m", "z", "u", "rstd"), fast, ref):
        assert_close_rel(a, e, TOL[acc], name)

    m, _, _, rstd = fast
    grads, dcs = cpu.cpu_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, EPS)
    ref_grads, ref_dcs = torch_depth_stats_bwd(
        grad_z.double(), grad_u.double(), sources64, cs.double(), m.double(), rstd.double(), EPS
    )
    assert len(grads) == len(sources)
    assert all(g.dtype == dtype and g.shape == x.shape for g, x in zip(grads, sources))
    assert dcs.dtype == acc
    assert_close_rel(torch.stack(grads), torch.stack(ref_grads), TOL[dtype], "grads of the sources")
    assert_close_rel(dcs, ref_dcs, TOL[acc], "grad of cs")


STATS_CASES = {
    # single-axis stress
    "R5-S3-T7-d67-fp32": (5, 3, (7,), 67, torch.float32),  # d not a multiple of the vector width
    # one source, one query, one channel; fp64, because with one channel the score does not depend on |x| and the
    # two terms of the key norm's gradient cancel to rounding, amplified by 1/|x| (in fp32 too for the torch path)
    "R1-S1-T4-d1-fp64": (1, 1, (4,), 1, torch.float64),
    "R1-S1-T4-d5-fp32": (1, 1, (4,), 5, torch.float32),
    "R2-S2-T0-d8-fp32": (2, 2, (0,), 8, torch.float32),  # no tokens at all
    "R4-S2-T6-d31-fp16": (4, 2, (6,), 31, torch.float16),
    "R3-S4-T5-d13-fp64": (3, 4, (5,), 13, torch.float64),
    "R4-S15-T9-d40-bf16": (4, 15, (9,), 40, torch.bfloat16),  # queries taken 8, 4, 2 and 1 at a time
    # multi-axis stress
    "R9-S8-B2xT11-d1000-bf16": (9, 8, (2, 11), 1000, torch.bfloat16),
    "R17-S5-B3xT5-d129-fp32": (17, 5, (3, 5), 129, torch.float32),
    # rows too long to keep a token's sources in L2 together: groups of one row, merged by the online softmax
    "R3-S3-T2-d40000-fp32": (3, 3, (2,), 40000, torch.float32),
}


@pytest.mark.parametrize("case", STATS_CASES.values(), ids=STATS_CASES.keys())
def test_stats_match_fp64_oracle(case):
    check_stats_against_oracle(*make_stats_case(*case))


@pytest.mark.parametrize("d", [40, 40000], ids=["one-group", "row-groups"])
def test_stats_peaked_scores_match_oracle(d):
    """Scores beyond exp's range (|s| ~ 100) for queries c, -c and c/2, so that the running max of the online
    softmax climbs from source to source for one query and falls for another (fp64: rounding of the scores is no
    issue)."""
    sources, c, *_ = aligned_sources(torch.float64, 30.0 * (40 / d) ** 0.5, "ascending", d)
    cs = torch.stack([c, -c, c / 2])
    _, _, grad_z, grad_u = make_stats_case(len(sources), 3, (11,), d, torch.float64)
    check_stats_against_oracle(sources, cs, grad_z, grad_u)


def allocated_bytes(fn) -> tuple[int, object]:
    """(bytes that `fn` allocates through torch, its result), from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sum(b for b in sizes if b > 0), result


def output_bytes(result) -> int:
    flat = [t for r in result for t in (r if isinstance(r, (list, tuple)) else [r])]
    return sum(t.nbytes for t in flat)


def test_bank_rows_are_read_in_place():
    """Rows `bank[:, j]` of an `[N, NB, d]` bank (row stride NB * d) are read through their stride: the kernels
    allocate their outputs and nothing else, while sources whose channels are not contiguous are copied."""
    bank = torch.randn(2, 32, 5, 24)  # [B, T, NB, d]: two leading dims that flatten into one token stride
    rows = [bank[:, :, j] for j in range(4)]
    cs = torch.randn(3, 24) / 24**0.5
    grad_z, grad_u = torch.randn(3, 64), torch.randn(3, 64, 24)
    _, weights, rstd = cpu.cpu_depth_attention_fwd(rows, cs[0], None, EPS, OUT_EPS)
    m, _, _, stats_rstd = cpu.cpu_depth_stats_fwd(rows, cs, EPS)
    calls = {  # the gradient of the one-shot output is a bank row too
        "fwd": lambda xs: cpu.cpu_depth_attention_fwd(xs, cs[0], None, EPS, OUT_EPS),
        "bwd": lambda xs: cpu.cpu_depth_attention_bwd(bank[:, :, 4], None, xs, cs[0], None, weights, rstd, EPS, OUT_EPS),
        "stats fwd": lambda xs: cpu.cpu_depth_stats_fwd(xs, cs, EPS),
        "stats bwd": lambda xs: cpu.cpu_depth_stats_bwd(grad_z, grad_u, xs, cs, m, stats_rstd, EPS),
    }
    for name, call in calls.items():
        nbytes, result = allocated_bytes(lambda: call(rows))
        assert nbytes == output_bytes(result), f"{name}: {nbytes - output_bytes(result)} bytes beyond the outputs"
    columns = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in rows]  # unit stride on tokens, not channels
    nbytes, result = allocated_bytes(lambda: calls["stats fwd"](columns))
    assert nbytes >= output_bytes(result) + sum(x.nbytes for x in columns), "the copies must show up in the count"


def test_strided_stats_inputs_give_the_contiguous_result():
    """Bank rows, an interleave, column-major sources, an expanded grad_u and a transposed grad_z: bit-equal to
    the same values contiguous."""
    sources, cs, grad_z, grad_u = make_stats_case(4, 3, (6,), 24, torch.bfloat16)
    bank = torch.stack(sources, dim=1)  # [N, R, d]
    strided = [bank[:, 0], torch.stack([sources[1]] * 2, dim=1)[:, 1], sources[2].t().contiguous().t(), bank[:, 3]]
    assert not any(x.is_contiguous() for x in strided)
    expanded_gu = grad_u[:, :1].expand(3, 6, 24)
    odd_gz = grad_z.t().contiguous().t()
    plain = cpu.cpu_depth_stats_fwd(sources, cs, EPS)
    odd = cpu.cpu_depth_stats_fwd(strided, cs, EPS)
    for a, e in zip(odd, plain):
        assert torch.equal(a, e)
    m, _, _, rstd = plain
    plain_grads, plain_dcs = cpu.cpu_depth_stats_bwd(grad_z, expanded_gu.contiguous(), sources, cs, m, rstd, EPS)
    odd_grads, odd_dcs = cpu.cpu_depth_stats_bwd(odd_gz, expanded_gu, strided, cs, m, rstd, EPS)
    for a, e in zip(odd_grads, plain_grads):
        assert a.is_contiguous() and torch.equal(a, e)
    assert torch.equal(odd_dcs, plain_dcs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_public_stats_route_to_kernel_and_match_twin(dtype, monkeypatch, cpu_kernel_calls):
    """End to end through `attnres.depth_stats` + `finish_stats` (with the fused output norm): the kernel serves
    phase 1, and the mixtures and the gradients of the sources, queries and gains match the twin."""
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    S, d = 4, 40
    leaves = [torch.randn(3, 5, d).to(dtype).requires_grad_() for _ in range(3)]
    queries = (torch.randn(S, d) * 2 / d**0.5).requires_grad_()
    gains = (1 + 0.1 * torch.randn(S, d)).requires_grad_()
    out_w = 1 + 0.1 * torch.randn(S, d)
    grad = torch.randn(S, 3, 5, d)
    results = []
    for fn in (attnres.depth_stats, attnres.naive_depth_stats):
        stats = fn(leaves, queries, gains, eps=EPS)
        if fn is attnres.depth_stats:
            assert cpu_kernel_calls == ["depth_stats_fwd"]
        mix = attnres.finish_stats(stats, out_w, out_eps=OUT_EPS)
        inputs = [*leaves, queries, gains]
        results.append([mix, *torch.autograd.grad((mix * grad).sum(), inputs)])
    names = ["mixtures"] + [f"grad source {j}" for j in range(3)] + ["grad queries", "grad gains"]
    for name, a, e in zip(names, *results):
        assert a.dtype == e.dtype, name
        assert_close_rel(a, e, TOL[a.dtype], name)  # both compute in fp32 from the same inputs


def test_block_streams_train_one_shot_on_cpu(monkeypatch):
    """With the kernel, two-phase training costs more than it saves on CPU (its phase 2's backward runs as torch ops),
    so a block stream trains one-shot even where the bytes model says two-phase pays; at inference (the fused
    bank_merge) and on the torch path the bytes model decides."""
    L, d, rows, points = 8, 16, 8, 9
    stream = make_stream("block", torch.randn(3, d), L, [DepthAttention(d) for _ in range(2 * L + 1)], block_size=4)
    row, trained_row = torch.randn(3, d), torch.randn(3, d, requires_grad=True)
    assert two_phase_pays(rows, points, row.element_size())
    assert two_phase_pays(rows, points, row.element_size(), training=True)
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    assert not stream.residual.use_two_phase(trained_row, rows, points)
    assert stream.residual.use_two_phase(row, rows, points)
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    assert stream.residual.use_two_phase(trained_row, rows, points)


def test_disable_switch(monkeypatch):
    monkeypatch.setenv(cpu.DISABLE_ENV, "1")
    assert cpu.disabled() and not cpu.available()
    monkeypatch.setenv(cpu.DISABLE_ENV, "0")
    assert cpu.available()


def test_failed_build_raises_with_the_compiler_output(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="compiling depth_attention.cpp failed"):
        build.build_library()
    assert not list(tmp_path.glob("*.so")), "a failed build must leave no library behind"


def test_builds_unused_for_a_month_are_pruned_and_loading_marks_a_build_used(monkeypatch, tmp_path):
    now = 1e9
    day = 86400
    names = {"old": now - 40 * day, "recent": now - 2 * day, "kept": now - 90 * day}
    for name, mtime in names.items():
        for suffix in (".so", ".lock"):
            path = tmp_path / f"attnres_cpu_{name}{suffix}"
            path.write_bytes(b"")
            os.utime(path, (mtime, mtime))
    other = tmp_path / "unrelated.so"
    other.write_bytes(b"")
    os.utime(other, (0, 0))
    keep = tmp_path / "attnres_cpu_kept.so"
    assert build.prune_unused(tmp_path, keep=keep, now=now) == [tmp_path / "attnres_cpu_old.so"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["attnres_cpu_kept.lock", "attnres_cpu_kept.so", "attnres_cpu_recent.lock", "attnres_cpu_recent.so",
                    "unrelated.so"]

    # a process that finds its build in the cache marks it used now
    library = build.build_library()
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    cached = tmp_path / library.name
    shutil.copyfile(library, cached)
    os.utime(cached, (now, now))
    assert build.build_library() == cached and cached.stat().st_mtime > now + 365 * day


def _point_params(d, dtype, gain, out_norm, rows):
    gen = torch.Generator().manual_seed(3)
    query = (0.3 * torch.randn(d, generator=gen)).reshape((1, d) if rows else (d,)).to(dtype)
    key_gain = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if gain else None
    out_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if out_norm else None
    return query, key_gain, out_w


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gain, out_norm, rows", [(True, True, True), (False, True, False), (True, False, False)])
def test_point_kernels_fold_and_unfold_as_the_composed_twin_bit_for_bit(param_dtype, gain, out_norm, rows):
    """The CPU point ops (query folded and its gradients formed in the kernel call) against the same kernels
    composed with the fold and the parameter gradients in torch ops: every output bit for bit, each gradient in its
    parameter's dtype and shape (None for an absent parameter)."""
    from attnres.ops.depth_attention import point_kernels_from

    d, n_src = 24, 4
    sources, _, _, grad_out, grad_weights = make_case(n_src, (3, 5), d, torch.float32, False, True)
    query, key_gain, out_w = _point_params(d, param_dtype, gain, out_norm, rows)
    composed = point_kernels_from(cpu.cpu_depth_attention_fwd, cpu.cpu_depth_attention_bwd,
                                  cpu.cpu_depth_attention_bwd_into)
    composed = (composed["point_fwd"], composed["point_bwd"], composed["point_bwd_into"])
    results = []
    for fwd, bwd, bwd_into in ((cpu.cpu_point_fwd, cpu.cpu_point_bwd, cpu.cpu_point_bwd_into), composed):
        out, weights, rstd, c = fwd(sources, query, key_gain, out_w, EPS, OUT_EPS)
        grads, *params = bwd(grad_out, grad_weights, sources, c, query, key_gain, out_w, weights, rstd, EPS, OUT_EPS)
        into = list(torch.ones(n_src, 3, 5, d))
        into_params = bwd_into(grad_out, grad_weights, sources, c, query, key_gain, out_w, weights, rstd, EPS,
                               OUT_EPS, into, n_src - 1)
        results.append([out, weights, rstd, c, *grads, *into, *params, *into_params])
    for a, e in zip(*results):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)
    d_query, d_gain, d_out_w = results[0][-3:]
    assert d_query.dtype == param_dtype and d_query.shape == query.shape
    assert (d_gain is None) == (key_gain is None) and (d_out_w is None) == (out_w is None)


def test_the_torch_point_kernels_give_autograds_gradients_through_the_fold():
    """The twin (torch kernels, the fold and the parameter gradients in torch ops) against autograd through
    `fold_query` around the one-shot torch kernels, in fp64."""
    from attnres.ops.depth_attention import fold_query

    torch.manual_seed(4)
    sources = [torch.randn(6, 16, dtype=torch.float64) for _ in range(3)]
    query = torch.randn(1, 16, dtype=torch.float64, requires_grad=True)
    key_gain = (1 + 0.1 * torch.randn(16, dtype=torch.float64)).requires_grad_()
    out_w = (1 + 0.1 * torch.randn(16, dtype=torch.float64)).requires_grad_()
    grad_out = torch.randn(6, 16, dtype=torch.float64)
    c = fold_query(query, key_gain, torch.float64)
    out, weights, rstd = torch_depth_attention_fwd(sources, c.detach(), out_w.detach(), EPS, OUT_EPS)
    _, dc, d_out_w = torch_depth_attention_bwd(grad_out, None, sources, c.detach(), out_w.detach(), weights, rstd, EPS,
                                               OUT_EPS)
    expected = (*torch.autograd.grad(c, (query, key_gain), dc), d_out_w)
    point_fwd, point_bwd = (registry.kernel(op, sources[0]) for op in ("point_fwd", "point_bwd"))  # fp64: torch's
    assert point_fwd is registry.PORTABLE.kernels["point_fwd"]
    out2, weights, rstd, c = point_fwd(sources, query.detach(), key_gain.detach(), out_w.detach(), EPS, OUT_EPS)
    _, *params = point_bwd(grad_out, None, sources, c, query.detach(), key_gain.detach(), out_w.detach(), weights,
                           rstd, EPS, OUT_EPS)
    torch.testing.assert_close(out2, out.detach(), rtol=0, atol=0)
    for a, e in zip(params, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
