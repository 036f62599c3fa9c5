"""The fused inference kernels (attnres.ops.triton.bank) against the twins `naive_bank_aggregate/merge`.

Run like tests/ops/test_triton.py: on the GPU where there is one, else in a subprocess under `TRITON_INTERPRET=1`.
The prefix and the bank are compared bit for bit (the kernels round the pending add to nearest even, as torch does,
also in the interpreter, whose own fp32 -> bf16 conversion truncates). The mixture is computed in fp32 by both the
kernel (online softmax) and the twin (stacked softmax), so the two differ by fp32 rounding, which after the final
rounding to bf16/fp16 can still flip one unit in the last place: that is the tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


from attnres.ops import bank as bank_ops  # noqa: E402
from attnres.ops.registry import PORTABLE  # noqa: E402
from attnres.ops.triton import KERNELS as TRITON  # noqa: E402
from attnres.ops.naive import naive_bank_aggregate, naive_bank_merge, naive_depth_stats  # noqa: E402
# the NaN-filled torch.empty fixture (autouse) comes along: an element a kernel forgets to write fails the comparison
from tests.ops.test_triton import (  # noqa: E402,F401
    DEVICE,
    INTERPRETING,
    KERNELS_RUN_HERE,
    kernel_test,
    nan_filled_empty,
)

EPS, OUT_EPS = 1e-6, 1e-5
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


test_kernels_under_the_interpreter.__test__ = not KERNELS_RUN_HERE


def assert_mixture(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding of the two orders of summation, plus one unit in the last place of actual's dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=ULP[actual.dtype] + 2e-5, atol=2e-5 * scale)


def make_point(N: int, NB: int, d: int, dtype: torch.dtype, seed: int) -> dict:
    """A point's tensors: rows of distinct scales and a query and key gain giving order-one scores (a far from uniform
    softmax), and their fold c."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *size: torch.randn(*size, generator=g)  # noqa: E731
    t = {
        "bank": (randn(N, NB, d) * (0.5 + torch.arange(NB) / 4)[:, None]).to(dtype).to(DEVICE),
        "prefix": randn(N, d).to(dtype).to(DEVICE),
        "output": randn(N, d).to(dtype).to(DEVICE),
        "query": (randn(1, d) * 2 / d**0.5).to(dtype).to(DEVICE),  # a point's weights, in the model's dtype
        "gain": (1 + 0.25 * randn(d)).to(dtype).to(DEVICE),
        "ow": (1 + 0.5 * randn(d)).to(DEVICE),
    }
    t["c"] = t["query"][0].float() * t["gain"].float()  # the fold, for phase 1's statistics
    return t


# (dtype, d, nvb, write, pending output, output norm): single-axis and multi-axis stress
AGGREGATE_CASES = [
    (torch.float32, 130, 5, True, True, True),
    (torch.float32, 7, 0, True, True, False),  # layer 0: the embedding alone, written to row 0
    (torch.float32, 1, 2, False, False, True),
    (torch.float16, 64, 3, False, True, True),
    (torch.float16, 7, 5, True, False, True),
    (torch.bfloat16, 130, 3, True, True, True),
    (torch.bfloat16, 64, 0, False, True, False),  # the prefix alone
    (torch.bfloat16, 7, 5, False, True, True),
]


def case_id(case) -> str:
    dtype, d, nvb, write, with_output, onorm = case
    return f"{str(dtype)[6:]}-d{d}-nvb{nvb}" + "-write" * write + "-add" * with_output + "-onorm" * onorm


@kernel_test
@pytest.mark.parametrize("case", AGGREGATE_CASES, ids=case_id)
def test_bank_aggregate_matches_twin(case):
    from attnres.ops.triton import triton_bank_aggregate

    dtype, d, nvb, write, with_output, onorm = case
    t = make_point(N=3, NB=6, d=d, dtype=dtype, seed=d + 7 * nvb)
    output, ow = t["output"] if with_output else None, t["ow"] if onorm else None
    bank, prefix = t["bank"].clone(), t["prefix"].clone()
    mix = triton_bank_aggregate(bank, nvb, prefix, output, t["query"], t["gain"], ow, EPS, OUT_EPS, write)
    ref = naive_bank_aggregate(t["bank"], nvb, t["prefix"], output, t["query"], t["gain"], ow, EPS, OUT_EPS, write)
    assert torch.equal(prefix, t["prefix"]), "the prefix after the pending add"
    assert torch.equal(bank, t["bank"]), "the bank: row nvb written at a write point, nothing else"
    assert_mixture(mix, ref)


def merge_case_id(case) -> str:
    dtype, d, with_output, onorm = case
    return f"{str(dtype)[6:]}-d{d}" + "-add" * with_output + "-onorm" * onorm


# (dtype, d, pending output, output norm)
MERGE_CASES = [
    (torch.float32, 130, True, True),
    (torch.bfloat16, 64, True, True),
    (torch.float16, 7, False, False),
    (torch.bfloat16, 1, True, False),
]


@kernel_test
@pytest.mark.parametrize("case", MERGE_CASES, ids=merge_case_id)
def test_bank_merge_matches_twin(case):
    from attnres.ops.triton import triton_bank_merge

    dtype, d, with_output, onorm = case
    t = make_point(N=3, NB=4, d=d, dtype=dtype, seed=d)
    output, ow = t["output"] if with_output else None, t["ow"] if onorm else None
    stats = naive_depth_stats(bank_ops.bank_rows(t["bank"], 4), t["c"][None], eps=EPS)
    m, z, u = (s[0] for s in stats)
    prefix = t["prefix"].clone()
    mix = triton_bank_merge(m, z, u, prefix, output, t["query"], t["gain"], ow, EPS, OUT_EPS)
    ref = naive_bank_merge(m, z, u, t["prefix"], output, t["query"], t["gain"], ow, EPS, OUT_EPS)
    assert torch.equal(prefix, t["prefix"]), "the prefix after the pending add"
    assert_mixture(mix, ref)


@kernel_test
def test_bank_ops_take_the_tokens_shape():
    """A prefix and output `[batch, seq, d]`, as an inference stream passes them: the rows they view, the mixture in
    their shape."""
    from attnres.ops.triton import triton_bank_aggregate, triton_bank_merge

    t = make_point(N=3, NB=4, d=64, dtype=torch.float32, seed=5)
    prefix, output = t["prefix"].view(1, 3, 64), t["output"].view(1, 3, 64)
    args = (t["query"], t["gain"], t["ow"], EPS, OUT_EPS)
    bank, got_prefix = t["bank"].clone(), prefix.clone()
    mix = triton_bank_aggregate(bank, 2, got_prefix, output, *args, True)
    ref = naive_bank_aggregate(t["bank"], 2, prefix, output, *args, True)
    assert mix.shape == (1, 3, 64) and torch.equal(got_prefix, prefix) and torch.equal(bank, t["bank"])
    assert_mixture(mix, ref)

    m, z, u = (s[0] for s in naive_depth_stats(bank_ops.bank_rows(t["bank"], 3), t["c"][None], eps=EPS))
    got_prefix = prefix.clone()
    mix = triton_bank_merge(m, z, u, got_prefix, output, *args)
    ref = naive_bank_merge(m, z, u, prefix, output, *args)
    assert mix.shape == (1, 3, 64) and torch.equal(got_prefix, prefix)
    assert_mixture(mix, ref)


@kernel_test
def test_strided_bank_and_prefix_are_written_in_place():
    """A bank with a spare channel per row and a prefix that is a column slice: read and written through strides."""
    from attnres.ops.triton import triton_bank_aggregate

    t = make_point(N=4, NB=3, d=8, dtype=torch.float32, seed=3)
    wide_bank = torch.zeros(4, 3, 9, device=DEVICE)
    wide_bank[..., :8] = t["bank"]
    wide_prefix = torch.zeros(4, 16, device=DEVICE)
    wide_prefix[:, :8] = t["prefix"]
    bank, prefix = wide_bank[..., :8], wide_prefix[:, :8]
    mix = triton_bank_aggregate(bank, 1, prefix, t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    ref = naive_bank_aggregate(t["bank"], 1, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    assert torch.equal(bank, t["bank"]) and torch.equal(prefix, t["prefix"])
    assert not wide_bank[..., 8].any() and not wide_prefix[:, 8:].any(), "nothing outside the views is written"
    assert_mixture(mix, ref)


@kernel_test
def test_token_offsets_past_2_to_the_31_are_64_bit():
    """Bank tokens 2^30 + 64 elements apart, so token 2 starts past element 2^31, as in a bank with N * NB * d > 2^31:
    32-bit offsets would wrap and read or write elsewhere. The storage is reserved, not filled: only the rows used
    are ever touched."""
    from attnres.ops.triton import triton_bank_aggregate

    N, NB, d, stride = 3, 2, 4, 2**30 + 64
    storage = torch.UntypedStorage(2 * ((N - 1) * stride + NB * d), device=DEVICE)
    bank = torch.empty(0, dtype=torch.float16, device=DEVICE).set_(storage, 0, (N, NB, d), (stride, d, 1))
    t = make_point(N=N, NB=NB, d=d, dtype=torch.float16, seed=5)
    bank.copy_(t["bank"])
    prefix = t["prefix"].clone()
    mix = triton_bank_aggregate(bank, 1, prefix, t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    ref = naive_bank_aggregate(t["bank"], 1, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    assert torch.equal(bank, t["bank"]) and torch.equal(prefix, t["prefix"])
    assert_mixture(mix, ref)


@kernel_test
def test_dispatch_routes_to_the_fused_kernels(monkeypatch):
    """bank_aggregate and bank_merge run the fused kernels of a backend that has them, never the one-shot forward."""
    calls = []

    def spy(name, fn):
        def wrapped(*args):
            calls.append(name)
            return fn(*args)
        return wrapped

    routed = {op: spy(op.removeprefix("bank_"), TRITON.kernels[op]) for op in ("bank_aggregate", "bank_merge")}
    monkeypatch.setattr(bank_ops, "kernel", lambda op, x, rows=None: routed[op])  # any other lookup fails
    t = make_point(N=2, NB=3, d=7, dtype=torch.bfloat16, seed=9)
    args = (t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS)
    bank, prefix = t["bank"].clone(), t["prefix"].clone()
    mix = bank_ops.bank_aggregate(bank, 2, prefix, *args, True)
    ref = naive_bank_aggregate(t["bank"], 2, t["prefix"], *args, True)
    assert torch.equal(bank, t["bank"]) and torch.equal(prefix, t["prefix"])
    assert_mixture(mix, ref)

    stats = naive_depth_stats(bank_ops.bank_rows(t["bank"], 2), t["c"][None], eps=EPS)
    m, z, u = (s[0] for s in stats)
    mix = bank_ops.bank_merge(m, z, u, prefix, *args)
    ref = naive_bank_merge(m, z, u, t["prefix"], *args)
    assert torch.equal(prefix, t["prefix"])
    assert_mixture(mix, ref)
    assert calls == ["aggregate", "merge"]


@kernel_test
def test_rejects_what_the_kernels_do_not_take():
    aggregate, merge = TRITON.kernels["bank_aggregate"], TRITON.kernels["bank_merge"]  # behind the bank ops' checks
    t = make_point(N=2, NB=3, d=4, dtype=torch.float32, seed=0)
    bank, prefix, c, point = t["bank"], t["prefix"], t["c"], (t["query"], t["gain"])
    with pytest.raises(ValueError, match="nvb: expected 0 <= nvb <= 2"):
        aggregate(bank, 3, prefix, None, *point, None, EPS, EPS, True)
    with pytest.raises(ValueError, match=r"bank: expected \[2, NB, 4\]"):
        aggregate(bank[:1], 1, prefix, None, *point, None, EPS, EPS, False)
    with pytest.raises(TypeError, match="prefix: .*float64"):
        merge(c[:2], c[:2], prefix.double(), prefix.double(), None, *point, None, EPS, EPS)
    with pytest.raises(ValueError, match="output: expected"):
        merge(c[:2], c[:2], prefix, prefix, prefix[:1], *point, None, EPS, EPS)
    assert torch.equal(bank, make_point(N=2, NB=3, d=4, dtype=torch.float32, seed=0)["bank"]), "nothing written"


def test_the_triton_backend_registers_its_fused_kernels_behind_the_checks():
    from attnres.ops.triton import triton_bank_aggregate, triton_bank_merge

    assert TRITON.kernels["bank_aggregate"].__wrapped__ is triton_bank_aggregate
    assert TRITON.kernels["bank_merge"].__wrapped__ is triton_bank_merge
    assert PORTABLE.kernels["bank_aggregate"].__wrapped__ is bank_ops.torch_bank_aggregate


@pytest.mark.parametrize("kernel", ["aggregate", "merge"])
def test_kernels_compile_for_hopper(kernel):
    """The interpreter never runs the GPU compiler: build the bf16 d=7168 kernels for sm_90 (ptxas ships with
    triton), so a kernel that only a GPU would reject fails here too, and check the rows load 16 bytes at a time."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnres.ops.triton import bank as kernels

    bf16, f32, i32 = "*bf16", "*fp32", "i32"
    common = {"prefix": bf16, "output": bf16, "query": bf16, "gain": bf16, "out_weight": f32, "out": bf16, "N": i32,
              "prefix_stride": i32, "eps": "fp32", "out_eps": "fp32"}
    if kernel == "aggregate":
        fn = kernels.bank_aggregate_kernel
        types = {**common, "bank": bf16, "nvb": i32, "bank_stride_t": i32, "bank_stride_r": i32}
        constexprs = {"WRITE": True}
    else:
        fn = kernels.bank_merge_kernel
        types = {**common, "m_in": f32, "z_in": f32, "u_in": f32}
        constexprs = {}
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # under @autotune / @heuristics
        fn = fn.fn
    constexprs.update(D=7168, D_PAD=8192, HAS_OUTPUT=True, OUT_NORM=True, DTYPE=tl.bfloat16, TILE=8192, BLOCK_T=1)
    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
    # what a launch specialises: pointers and the row strides (multiples of d = 7168) divisible by 16
    divisible = [a for a, t in types.items() if t.startswith("*") or a.endswith("stride") or "_stride_" in a]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    source = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": 16, "enable_fp_fusion": True}  # fp fusion named: triton 3.9 warns on its default
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "ld.global.v4" in compiled.asm["ptx"], "the rows should be read with 16-byte vector loads"


test_kernels_compile_for_hopper.__test__ = not INTERPRETING
