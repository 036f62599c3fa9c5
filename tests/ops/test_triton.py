"""The Triton kernels (attnres.ops.triton) against the readable twins, evaluated in fp64 on the same inputs.

On a CUDA machine the kernel tests run on the GPU. Elsewhere they run on CPU tensors under `TRITON_INTERPRET=1`, which
Triton reads when a kernel is defined: another test module (or torch itself) may already have imported the kernels
in compiled mode, so `test_kernels_under_the_interpreter` re-runs this module in a process of its own with the
variable set, and the parent process does not collect the kernel tests.

Tolerances: fp32 rounding, plus one unit in the last place of a bf16/fp16 result (the interpreter truncates fp32 to
bf16 where a GPU rounds).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from attnres.ops.depth_attention import fold_query  # noqa: E402
from attnres.ops.naive import naive_depth_attention, naive_depth_stats  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRETING
DEVICE = "cuda" if ON_CUDA else "cpu"
EPS, OUT_EPS = 1e-6, 1e-5

KERNELS_RUN_HERE = INTERPRETING or ON_CUDA


def kernel_test(fn):
    """Collect a kernel test only where the kernels run: on CUDA or in the interpreter process."""
    fn.__test__ = KERNELS_RUN_HERE
    return fn


def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


test_kernels_under_the_interpreter.__test__ = not KERNELS_RUN_HERE


def sm90_cases():
    """(kernel, argument types, constexprs, compile options) of a bf16 d=7168 launch, the GPU benchmark's shape."""
    import triton.language as tl

    from attnres.ops.triton import depth_attention as op
    from attnres.ops.triton import two_phase

    f32, i32 = "*fp32", "i32"
    rows = dict(D=7168, D_PAD=8192, DTYPE=tl.bfloat16, ALIGNED=True, TILE=8192, BLOCK_T=1)
    fwd = {"table": "*i64", "c": f32, "out_weight": f32, "out": "*bf16", "weights": f32, "rstd": f32,
           "N": i32, "R": i32, "eps": "fp32", "out_eps": "fp32"}
    bwd = {"table": "*i64", "c": f32, "out_weight": f32, "grad_out": "*bf16", "grad_weights": f32, "weights": f32,
           "rstd": f32, "dc_part": f32, "dow_part": f32, "N": i32, "R": i32, "programs": i32, "out_eps": "fp32"}
    stats = {"table": "*i64", "cs": f32, "m_out": f32, "z_out": f32, "u_out": f32, "rstd": f32,
             "N": i32, "R": i32, "S": i32, "eps": "fp32"}
    stats_bwd = {"table": "*i64", "cs": f32, "m": f32, "rstd": f32, "grad_z": f32, "grad_u": f32, "coef_out": f32,
                 "N": i32, "R": i32, "S": i32, "programs": i32}
    dcs = {"table": "*i64", "coef": f32, "dcs_part": f32, "N": i32, "R": i32, "S": i32}
    chunks = dict(D=7168, S_PAD=32, DTYPE=tl.bfloat16, ALIGNED=True)

    # as the launchers configure them; fp fusion named because triton 3.9 warns when it is left to its default
    wide = {"num_warps": 16, "enable_fp_fusion": True}
    narrow = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": True}
    return {
        "fwd-onorm": (op.depth_attention_fwd_kernel, fwd, {**rows, "OUT_NORM": True}, wide),
        "bwd-onorm-gw": (op.depth_attention_bwd_kernel, bwd, {**rows, "OUT_NORM": True, "HAS_GRAD_WEIGHTS": True},
                         wide),
        "stats-fwd": (two_phase.depth_stats_fwd_kernel, stats, rows, wide),
        "stats-bwd": (two_phase.depth_stats_bwd_kernel, stats_bwd, {**chunks, "BLOCK_D": 64, "R_PAD": 16}, narrow),
        "stats-dcs": (two_phase.depth_stats_dcs_kernel, dcs, {**chunks, "BLOCK_D": 64, "BLOCK_N": 64}, narrow),
    }


@pytest.mark.parametrize("name", ["fwd-onorm", "bwd-onorm-gw", "stats-fwd", "stats-bwd", "stats-dcs"])
def test_kernels_compile_for_hopper(name):
    """The interpreter never runs the GPU compiler: build each kernel for sm_90 (ptxas ships with triton), so
    a kernel that only a GPU would reject fails here too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, types, constexprs, options = sm90_cases()[name]
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # under @autotune / @heuristics
        kernel = kernel.fn
    signature = {arg: types.get(arg, "constexpr") for arg in kernel.arg_names}
    aligned = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in types.items() if t.startswith("*")}
    source = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "ld.global.v4" in compiled.asm["ptx"], "the source loads should be 16-byte vector loads"


test_kernels_compile_for_hopper.__test__ = not INTERPRETING  # the interpreter process compiles nothing


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    """Fresh float buffers start as NaN, so an output element a kernel forgets to write fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """`actual` (any dtype) against the fp64 oracle: fp32 rounding plus one ulp of actual's dtype."""
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[actual.dtype]
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double().cpu(), expected.detach().double().cpu(), rtol=ulp + 2e-5, atol=2e-5 * scale + 1e-30,
        msg=lambda m: f"{what}: {m}",
    )


def random_sources(R: int, lead: tuple[int, ...], d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Sources with distinct scales, so the RMS norm of the keys matters."""
    return [(torch.randn(*lead, d) * (0.5 + j / 4)).to(dtype).to(DEVICE) for j in range(R)]


# (dtype, d, R, key gain, out norm, grad of the weights): single-axis and multi-axis stress
OP_CASES = [
    (torch.float32, 100, 3, True, True, True),
    (torch.float32, 7, 9, False, False, False),
    (torch.float32, 1, 3, True, True, True),
    (torch.float32, 64, 1, True, False, True),
    (torch.bfloat16, 64, 9, True, True, False),
    (torch.bfloat16, 100, 3, False, False, True),
    (torch.float16, 7, 3, True, True, True),
    (torch.float16, 64, 1, False, True, False),
]


def op_case_id(case) -> str:
    dtype, d, R, gain, onorm, gw = case
    return f"{str(dtype)[6:]}-d{d}-R{R}" + "-gain" * gain + "-onorm" * onorm + "-gw" * gw


def check_op(sources, w, g, o, go, gw, around_kernels=contextlib.nullcontext):
    """Run the kernels' forward and backward (inside `around_kernels()`) and compare everything with the fp64 twin
    under autograd."""
    from attnres.ops.triton import triton_depth_attention_bwd, triton_depth_attention_fwd

    c = fold_query(w, g, torch.float32)
    with around_kernels():
        out, weights, rstd = triton_depth_attention_fwd(sources, c, o, EPS, OUT_EPS)
        grads, dc, d_out_w = triton_depth_attention_bwd(go, gw, sources, c, o, weights, rstd, EPS, OUT_EPS)

    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    xs64, w64, g64, o64 = [leaf(x) for x in sources], leaf(w), leaf(g), leaf(o)
    ref, ref_weights = naive_depth_attention(
        xs64, w64, g64, eps=EPS, out_norm_weight=o64, out_eps=OUT_EPS, return_weights=True
    )
    loss = (ref * go.double()).sum() + (0 if gw is None else (ref_weights * gw.double()).sum())
    loss.backward()

    assert out.dtype == sources[0].dtype and weights.dtype == rstd.dtype == torch.float32
    assert_matches(out, ref, "output")
    assert_matches(weights, ref_weights, "weights")
    assert_matches(rstd, torch.stack([torch.rsqrt(x.pow(2).mean(-1) + EPS) for x in xs64]), "rstd")
    for j, (dx, x64) in enumerate(zip(grads, xs64)):
        assert dx.dtype == sources[j].dtype
        assert_matches(dx, x64.grad, f"grad of source {j}")
    # c = g * w, so the twin's grads of w and g are dc * g and dc * w
    assert_matches(dc * (1 if g is None else g.float()), w64.grad, "grad of the query")
    if g is not None:
        assert_matches(dc * w.float(), g64.grad, "grad of the key gain")
    if o is None:
        assert torch.equal(d_out_w, torch.zeros_like(d_out_w))
    else:
        assert_matches(d_out_w, o64.grad, "grad of the output gain")


@kernel_test
@pytest.mark.parametrize("case", OP_CASES, ids=op_case_id)
def test_depth_attention_matches_twin(case):
    dtype, d, R, gain, onorm, with_gw = case
    torch.manual_seed(d * 31 + R)
    lead = (2, 13)
    sources = random_sources(R, lead, d, dtype)
    w = (torch.randn(d) * 2 / d**0.5).to(DEVICE)  # scores of order one: the softmax is far from uniform
    g = (1 + 0.5 * torch.randn(d)).to(DEVICE) if gain else None
    o = (1 + 0.5 * torch.randn(d)).to(DEVICE) if onorm else None
    go = torch.randn(*lead, d).to(dtype).to(DEVICE)
    gw = torch.randn(R, *lead).to(DEVICE) if with_gw else None
    check_op(sources, w, g, o, go, gw)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bwd_into_writes_and_adds_what_bwd_returns(dtype):
    """`Backend.bwd_into` (a chained point's backward, attnres/ops/chain.py): into the gradients it is given (one tensor
    per source) it writes those `bwd` returns, or for the first `accumulate` adds them on before rounding once."""
    from attnres.ops.triton import (
        triton_depth_attention_bwd,
        triton_depth_attention_bwd_into,
        triton_depth_attention_fwd,
    )

    R, lead, d = 3, (2, 7), 40
    sources = random_sources(R, lead, d, dtype)
    c = fold_query((torch.randn(d) * 2 / d**0.5).to(DEVICE), None, torch.float32)
    o = (1 + 0.5 * torch.randn(d)).to(DEVICE)
    go = torch.randn(*lead, d).to(dtype).to(DEVICE)
    _, weights, rstd = triton_depth_attention_fwd(sources, c, o, EPS, OUT_EPS)
    args = (go, None, sources, c, o, weights, rstd, EPS, OUT_EPS)
    grads, dc, d_out_w = triton_depth_attention_bwd(*args)

    into = list(torch.empty((R, *lead, d), dtype=dtype, device=DEVICE))  # NaN-filled: every element must be written
    dc_into, d_out_w_into = triton_depth_attention_bwd_into(*args, into, 0)
    assert torch.equal(torch.stack(into), torch.stack(grads))
    assert torch.equal(dc_into, dc) and torch.equal(d_out_w_into, d_out_w)

    added = 2  # the first two added onto, the last written
    base = torch.randn(R, *lead, d).to(dtype).to(DEVICE)
    summed = [t.clone() for t in base[:added]] + [torch.full_like(base[0], float("nan"))]
    triton_depth_attention_bwd_into(*args, summed, added)
    fresh = torch.stack(grads).float()
    assert torch.equal(summed[added], grads[added])
    # the sum is rounded once where `fresh` was rounded too: one ulp of each (the interpreter truncates, a GPU rounds)
    ulp = 2.0**-22 if dtype == torch.float32 else 2.0**-7
    bound = ulp * (base[:added].float().abs() + 2 * fresh[:added].abs())
    assert ((torch.stack(summed[:added]).float() - (base[:added].float() + fresh[:added])).abs() <= bound).all()


@kernel_test
def test_depth_attention_views_of_one_stacked_tensor():
    """Sources at offsets that are not 16-byte aligned (N * d * 4 = 140 bytes apart): the unaligned load path."""
    torch.manual_seed(1)
    stacked = torch.randn(4, 5, 7).to(DEVICE)
    w, o = (torch.randn(7) / 2).to(DEVICE), (1 + torch.randn(7) / 4).to(DEVICE)
    check_op(list(stacked.unbind(0)), w, None, o, torch.randn(5, 7).to(DEVICE), torch.randn(4, 5).to(DEVICE))


@kernel_test
def test_non_contiguous_inputs_give_the_contiguous_result():
    """Strided sources and an expanded grad_out (what `.sum()` hands back) are read as the values they hold."""
    from attnres.ops.triton import (
        triton_depth_attention_bwd,
        triton_depth_attention_fwd,
        triton_depth_stats_bwd,
        triton_depth_stats_fwd,
    )

    torch.manual_seed(2)
    d, R = 7, 3
    wide = [torch.randn(6, 2 * d).to(DEVICE) for _ in range(R)]
    strided = [x[:, ::2] for x in wide]
    dense = [x.contiguous() for x in strided]
    assert not strided[0].is_contiguous()
    c, o = torch.randn(d).to(DEVICE), (1 + torch.randn(d) / 4).to(DEVICE)
    go = torch.ones((), device=DEVICE).expand(6, d)
    gw = torch.randn(6, R).to(DEVICE).t()

    fwd = triton_depth_attention_fwd(strided, c, o, EPS, OUT_EPS)
    assert all(torch.equal(a, b) for a, b in zip(fwd, triton_depth_attention_fwd(dense, c, o, EPS, OUT_EPS)))
    _, weights, rstd = fwd
    grads, dc, dow = triton_depth_attention_bwd(go, gw, strided, c, o, weights.t().contiguous().t(), rstd, EPS, OUT_EPS)
    ref_grads, ref_dc, ref_dow = triton_depth_attention_bwd(
        go.contiguous(), gw.contiguous(), dense, c, o, weights, rstd, EPS, OUT_EPS
    )
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert torch.equal(dc, ref_dc) and torch.equal(dow, ref_dow)

    cs = torch.randn(2, d).to(DEVICE)
    m, z, u, rstd = triton_depth_stats_fwd(strided, cs, EPS)
    assert all(torch.equal(a, b) for a, b in zip((m, z, u, rstd), triton_depth_stats_fwd(dense, cs, EPS)))
    grad_z, grad_u = torch.randn(6, 2).to(DEVICE).t(), torch.randn(d).to(DEVICE).expand(2, 6, d)
    grads, dcs = triton_depth_stats_bwd(grad_z, grad_u, strided, cs, m, rstd, EPS)
    ref_grads, ref_dcs = triton_depth_stats_bwd(grad_z.contiguous(), grad_u.contiguous(), dense, cs, m, rstd, EPS)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)) and torch.equal(dcs, ref_dcs)


def check_last_rows(tokens: int, d: int, last: int = 64) -> None:
    """The last rows of a long launch equal a launch over those rows alone (every op is per token but dc and dcs)."""
    from attnres.ops.triton import (
        triton_depth_attention_bwd,
        triton_depth_attention_fwd,
        triton_depth_stats_bwd,
        triton_depth_stats_fwd,
    )

    def tail(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, t.shape[dim] - last, last).contiguous()

    xs = [torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    short = [tail(x) for x in xs]
    c = torch.randn(d, device=DEVICE) / d**0.5
    go = torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16)
    out, weights, rstd = triton_depth_attention_fwd(xs, c, None, EPS, EPS)
    ref = triton_depth_attention_fwd(short, c, None, EPS, EPS)
    for name, a, b in zip(("output", "weights", "rstd"), (tail(out), tail(weights, 1), tail(rstd, 1)), ref):
        assert_matches(a, b.double(), name)
    grads, _, _ = triton_depth_attention_bwd(go, None, xs, c, None, weights, rstd, EPS, EPS)
    ref_grads, _, _ = triton_depth_attention_bwd(tail(go), None, short, c, None, ref[1], ref[2], EPS, EPS)
    for j, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_matches(tail(a), b.double(), f"grad of source {j}")
    del out, grads, go

    m, z, u, rstd = triton_depth_stats_fwd(xs, c[None], EPS)
    ref = triton_depth_stats_fwd(short, c[None], EPS)
    for name, a, b in zip(("m", "z", "u", "rstd"), (tail(m, 1), tail(z, 1), tail(u, 1), tail(rstd, 1)), ref):
        assert_matches(a, b.double(), name)
    grads, _ = triton_depth_stats_bwd(z, u, xs, c[None], m, rstd, EPS)
    ref_grads, _ = triton_depth_stats_bwd(ref[1], ref[2], short, c[None], ref[0], ref[3], EPS)
    for j, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_matches(tail(a), b.double(), f"stats grad of source {j}")


@kernel_test
def test_last_rows_equal_a_launch_over_them_alone():
    check_last_rows(tokens=40, d=7, last=5)


def test_offsets_past_2_to_the_31():
    """Rows whose element offset token * d passes 2^31: 32-bit offsets would wrap. Takes about 30 GB."""
    check_last_rows(tokens=2**31 // 4096 + 64, d=4096)


test_offsets_past_2_to_the_31.__test__ = ON_CUDA


# (dtype, d, R sources, S queries, key gains)
STATS_CASES = [
    (torch.float32, 100, 3, 2, True),
    (torch.float32, 7, 1, 3, False),
    (torch.float32, 7, 17, 17, True),  # pads of 32 in both directions
    (torch.bfloat16, 64, 9, 5, True),
    (torch.float16, 1, 3, 1, False),
]


def stats_case_id(case) -> str:
    dtype, d, R, S, gain = case
    return f"{str(dtype)[6:]}-d{d}-R{R}-S{S}" + "-gain" * gain


def check_stats(sources, cs, n: int, around_kernels=contextlib.nullcontext):
    """Phase 1's kernels, forward and backward (inside `around_kernels()`), against the fp64 twin under autograd, for
    sources of n tokens."""
    from attnres.ops.triton import triton_depth_stats_bwd, triton_depth_stats_fwd

    (S, d), R = cs.shape, len(sources)
    grad_z, grad_u = torch.randn(S, n).to(DEVICE), torch.randn(S, n, d).to(DEVICE)
    with around_kernels():
        m, z, u, rstd = triton_depth_stats_fwd(sources, cs, EPS)
        grads, dcs = triton_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, EPS)

    xs64 = [x.detach().double().requires_grad_() for x in sources]
    cs64 = cs.detach().double().requires_grad_()
    ref = naive_depth_stats(xs64, cs64, eps=EPS)
    ((ref.z.reshape(S, n) * grad_z.double()).sum() + (ref.u.reshape(S, n, d) * grad_u.double()).sum()).backward()

    assert_matches(m, ref.m.reshape(S, n), "m")
    assert_matches(z, ref.z.reshape(S, n), "z")
    assert_matches(u, ref.u.reshape(S, n, d), "u")
    assert_matches(rstd, torch.stack([torch.rsqrt(x.pow(2).mean(-1) + EPS) for x in xs64]).reshape(R, n), "rstd")
    for j, (dx, x64) in enumerate(zip(grads, xs64)):
        assert dx.dtype == sources[j].dtype and dx.shape == sources[j].shape
        assert_matches(dx, x64.grad, f"grad of source {j}")
    assert_matches(dcs, cs64.grad, "grad of the folded queries")


@kernel_test
@pytest.mark.parametrize("case", STATS_CASES, ids=stats_case_id)
def test_depth_stats_match_twin(case):
    dtype, d, R, S, gain = case
    torch.manual_seed(d * 7 + R * 3 + S)
    sources = random_sources(R, (3, 4), d, dtype)
    queries = (torch.randn(S, d) * 2 / d**0.5).to(DEVICE)
    gains = (1 + 0.5 * torch.randn(S, d)).to(DEVICE) if gain else None
    check_stats(sources, queries if gains is None else queries * gains, n=12)


class OnlyViewsOf(TorchDispatchMode):
    """Records every torch op that takes a tensor of `base`'s storage and is not a view: a copy of its rows would be
    one (`.contiguous()`, `.clone()`, `.to()`, `copy_`)."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        self.storage = base.untyped_storage().data_ptr()
        self.non_views: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        reads_base = any(t.untyped_storage().data_ptr() == self.storage for t in tensors)
        if reads_base and not func.is_view:
            self.non_views.append(str(func))
        return func(*args, **kwargs)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bank_rows_are_read_in_place(dtype):
    """Sources that are rows `bank[:, j]` of an `[N, NB, d]` bank (token stride NB * d), beside a contiguous prefix and
    an expanded one: the one-shot and phase-1 kernels read them through their strides (no op copies the bank, only
    views of it are taken) and equal the fp64 twin, outputs and gradients."""
    torch.manual_seed(5)
    d, nvb = 24, 3
    bank = (torch.randn(2, 5, nvb + 1, d) * torch.linspace(0.5, 1.5, nvb + 1)[:, None]).to(dtype).to(DEVICE)
    rows = [bank[:, :, j] for j in range(nvb)]
    assert not rows[0].is_contiguous() and rows[0].data_ptr() == bank.data_ptr()
    sources = [*rows, torch.randn(2, 5, d).to(dtype).to(DEVICE), torch.randn(d).to(dtype).to(DEVICE).expand(2, 5, d)]
    watch = OnlyViewsOf(bank)
    w, g, o = (torch.randn(d) * 2 / d**0.5).to(DEVICE), (1 + torch.randn(d) / 2).to(DEVICE), torch.rand(d).to(DEVICE)
    go, gw = torch.randn(2, 5, d).to(dtype).to(DEVICE), torch.randn(len(sources), 2, 5).to(DEVICE)
    check_op(sources, w, g, o, go, gw, around_kernels=lambda: watch)
    check_stats(sources, (torch.randn(3, d) * 2 / d**0.5).to(DEVICE), n=10, around_kernels=lambda: watch)
    assert watch.non_views == [], f"ops that read the bank's storage other than as a view: {watch.non_views}"


@kernel_test
def test_no_tokens():
    from attnres.ops.triton import (
        triton_depth_attention_bwd,
        triton_depth_attention_fwd,
        triton_depth_stats_bwd,
        triton_depth_stats_fwd,
    )

    sources = [torch.randn(0, 5, device=DEVICE) for _ in range(2)]
    c = torch.randn(5, device=DEVICE)
    out, weights, rstd = triton_depth_attention_fwd(sources, c, None, EPS, EPS)
    assert out.shape == (0, 5) and weights.shape == rstd.shape == (2, 0)
    grads, dc, dow = triton_depth_attention_bwd(out, None, sources, c, None, weights, rstd, EPS, EPS)
    assert [g.shape for g in grads] == [(0, 5)] * 2 and torch.equal(dc, torch.zeros(5, device=DEVICE))
    m, z, u, rstd = triton_depth_stats_fwd(sources, c[None], EPS)
    assert u.shape == (1, 0, 5) and rstd.shape == (2, 0)
    grads, dcs = triton_depth_stats_bwd(z, u, sources, c[None], m, rstd, EPS)
    assert torch.equal(dcs, torch.zeros(1, 5, device=DEVICE))


@kernel_test
def test_rejects_what_the_kernels_do_not_take():
    from attnres.ops.triton import MAX_D, MAX_STATS_ROWS, triton_depth_attention_fwd, triton_depth_stats_fwd

    fp64 = [torch.randn(2, 4, dtype=torch.float64, device=DEVICE)]
    with pytest.raises(TypeError, match="sources: .*float64"):
        triton_depth_attention_fwd(fp64, torch.randn(4), None, EPS, EPS)
    with pytest.raises(ValueError, match=f"sources: .*d={MAX_D}"):
        triton_depth_attention_fwd([torch.randn(1, MAX_D + 1, device=DEVICE)], torch.randn(MAX_D + 1), None, EPS, EPS)
    with pytest.raises(ValueError, match=f"cs .*at most {MAX_STATS_ROWS}"):
        triton_depth_stats_fwd([torch.randn(2, 4, device=DEVICE)], torch.randn(MAX_STATS_ROWS + 1, 4), EPS)
