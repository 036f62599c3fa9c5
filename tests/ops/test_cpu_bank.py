"""The fused CPU inference ops (`cpu_bank_aggregate`, `cpu_bank_merge`) against the unfused CPU path and the twins.

`bank_aggregate` must give bit for bit what the unfused CPU path gives (`prefix.add_(output)`, the bank write, then
the one-shot CPU forward over the same rows in the same order): tests/layers/test_bank_stream.py holds the inference
stream bit-exact against the training stream, which that one-shot kernel serves. The prefix and the bank are
compared bit for bit everywhere; the mixture against the twins to fp32 rounding plus one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch

from attnres.ops import cpu, registry
from attnres.ops import bank as bank_ops
from attnres.ops.naive import naive_bank_aggregate, naive_bank_merge, naive_depth_stats

pytestmark = pytest.mark.skipif(cpu.disabled(), reason=f"{cpu.DISABLE_ENV} is set")

EPS, OUT_EPS = 1e-6, 1e-5
ULP = {torch.float64: 0.0, torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
NB = 5


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu.available(), "the CPU kernel failed to build or load; the reason is in the log"


def assert_mixture(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 rounding of two orders of summation, plus one unit in the last place of the dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max().item()
    rtol = ULP[actual.dtype] + (1e-12 if actual.dtype == torch.float64 else 2e-5)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=rtol * scale)


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view with padded token rows (and, for a bank, padded rows), unit stride along d."""
    pad = torch.full((*t.shape[:-1], t.shape[-1] + 3), float("nan"), dtype=t.dtype)
    if t.dim() == 3:
        pad = torch.cat([pad, pad[:, :1]], 1)
    view = pad[..., 1 : t.shape[-1] + 1] if t.dim() == 2 else pad[:, : t.shape[1], 1 : t.shape[-1] + 1]
    view.copy_(t)
    return view


def make_point(N: int, d: int, dtype: torch.dtype, seed: int, *, layout: str = "contiguous") -> dict:
    """A point's tensors: bank rows of distinct scales, a query and key gain giving order-one scores (a far from
    uniform softmax), and their fold c."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *size: torch.randn(*size, generator=g, dtype=torch.float64)  # noqa: E731
    t = {
        "bank": (randn(N, NB, d) * (0.5 + torch.arange(NB) / 4)[:, None]).to(dtype),
        "prefix": randn(N, d).to(dtype),
        "output": randn(N, d).to(dtype),
        "query": (randn(1, d) * 2 / d**0.5).to(dtype),  # a point's weights, in the model's dtype
        "gain": (1 + 0.25 * randn(d)).to(dtype),
        "ow": (1 + 0.5 * randn(d)).float(),
    }
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    t["c"] = t["query"][0].to(acc) * t["gain"].to(acc)  # the fold, for the unfused path
    if layout == "strided":
        t["bank"], t["prefix"] = strided(t["bank"]), strided(t["prefix"])
        t["output"] = t["output"].t().contiguous().t()  # column-major: copied by the host code, not read in place
    if layout == "tokens":  # in the tokens' own shape [2, N / 2, d], as an inference stream passes them
        t["prefix"], t["output"] = t["prefix"].view(2, -1, d), t["output"].view(2, -1, d)
    return t


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy with t's strides (so the copy is read through the same layout)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t) if t.dim() else t.clone()


def unfused(bank, nvb, prefix, output, c, ow, write):
    """The CPU path before the fused op: torch add_ and write, then the one-shot CPU forward over the rows."""
    if output is not None:
        prefix.add_(output)
    prefix_rows = prefix.view(-1, prefix.shape[-1])
    if write:
        bank[:, nvb] = prefix_rows
    rows = [bank[:, j] for j in range(nvb + 1 if write else nvb)] + ([] if write else [prefix_rows])
    return cpu.cpu_depth_attention_fwd(rows, c, ow, EPS, OUT_EPS)[0].view(prefix.shape)


# (N, d, layout): tokens for one thread and for several (N=300), d=1, odd d, a tail after whole registers, d=512, the
# prefix and output in the tokens' shape
SHAPES = [(1, 512, "contiguous"), (5, 7, "strided"), (300, 130, "contiguous"), (5, 1, "contiguous"),
          (5, 512, "strided"), (6, 7, "tokens"), (300, 130, "tokens")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-d{s[1]}-{s[2]}")
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("with_output,onorm", [(True, True), (False, True), (True, False)],
                         ids=["add-onorm", "onorm", "add"])
def test_bank_aggregate(cpu_kernel_calls, monkeypatch, dtype, shape, write, with_output, onorm):
    N, d, layout = shape
    nvb = 3
    t = make_point(N, d, dtype, seed=N + d + write, layout=layout)
    output, ow = t["output"] if with_output else None, t["ow"] if onorm else None
    bank, prefix = clone(t["bank"]), clone(t["prefix"])
    torch_bank, torch_prefix = clone(t["bank"]), clone(t["prefix"])  # for the portable path, below
    mix = bank_ops.bank_aggregate(bank, nvb, prefix, output, t["query"], t["gain"], ow, EPS, OUT_EPS, write)
    assert cpu_kernel_calls == ["bank_aggregate"]

    ref_bank, ref_prefix = clone(t["bank"]), clone(t["prefix"])
    ref = unfused(ref_bank, nvb, ref_prefix, output, t["c"], ow, write)
    assert torch.equal(prefix, ref_prefix), "the prefix after the pending add"
    assert torch.equal(bank, ref_bank), "the bank: row nvb written at a write point, nothing else"
    assert torch.equal(mix, ref), "the mixture: bit for bit the unfused CPU path's"

    twin = naive_bank_aggregate(t["bank"], nvb, t["prefix"], output, t["query"], t["gain"], ow, EPS, OUT_EPS, write)
    assert torch.equal(prefix, t["prefix"]) and torch.equal(bank, t["bank"])
    assert_mixture(mix, twin)

    monkeypatch.setenv(registry.BACKEND_ENV, "torch")  # the portable path of the same contract
    calls = list(cpu_kernel_calls)
    ported = bank_ops.bank_aggregate(torch_bank, nvb, torch_prefix, output, t["query"], t["gain"], ow, EPS, OUT_EPS,
                                     write)
    assert torch.equal(torch_prefix, prefix) and torch.equal(torch_bank, bank) and cpu_kernel_calls == calls
    assert_mixture(ported, mix)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("write", [False, True], ids=["prefix-alone", "write-row-0"])
def test_bank_aggregate_without_bank_rows(dtype, write):
    """nvb = 0: layer 0's point (the embedding written to row 0), or the prefix alone."""
    t = make_point(3, 7, dtype, seed=11)
    bank, prefix = t["bank"].clone(), t["prefix"].clone()
    mix = cpu.cpu_bank_aggregate(bank, 0, prefix, t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, write)
    ref_bank, ref_prefix = t["bank"].clone(), t["prefix"].clone()
    assert torch.equal(mix, unfused(ref_bank, 0, ref_prefix, t["output"], t["c"], t["ow"], write))
    twin = naive_bank_aggregate(t["bank"], 0, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, write)
    assert torch.equal(prefix, t["prefix"]) and torch.equal(bank, t["bank"]) and torch.equal(bank, ref_bank)
    assert_mixture(mix, twin)


def test_bank_aggregate_fp64():
    """fp64 (which the dispatch gives the torch path) in fp64 arithmetic, when called directly."""
    t = make_point(5, 130, torch.float64, seed=3)
    bank, prefix = t["bank"].clone(), t["prefix"].clone()
    mix = cpu.cpu_bank_aggregate(bank, 3, prefix, t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    twin = naive_bank_aggregate(t["bank"], 3, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    assert torch.equal(prefix, t["prefix"]) and torch.equal(bank, t["bank"])
    assert_mixture(mix, twin)


MERGE_SHAPES = [(1, 512, "contiguous"), (5, 7, "strided"), (300, 130, "contiguous"), (5, 1, "contiguous")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=lambda s: f"N{s[0]}-d{s[1]}-{s[2]}")
@pytest.mark.parametrize("with_output,onorm", [(True, True), (False, False)], ids=["add-onorm", "plain"])
def test_bank_merge(cpu_kernel_calls, monkeypatch, dtype, shape, with_output, onorm):
    N, d, layout = shape
    t = make_point(N, d, dtype, seed=N + d, layout=layout)
    output, ow = t["output"] if with_output else None, t["ow"] if onorm else None
    m, z, u = (s[0] for s in naive_depth_stats(bank_ops.bank_rows(t["bank"], 3), t["c"][None], eps=EPS))
    args = (output, t["query"], t["gain"], ow, EPS, OUT_EPS)
    prefix, torch_prefix = clone(t["prefix"]), clone(t["prefix"])
    mix = bank_ops.bank_merge(m, z, u, prefix, *args)
    assert cpu_kernel_calls == ["bank_merge"]
    twin = naive_bank_merge(m, z, u, t["prefix"], *args)
    assert torch.equal(prefix, t["prefix"]), "the prefix after the pending add"
    assert_mixture(mix, twin)

    monkeypatch.setenv(registry.BACKEND_ENV, "torch")  # the portable path of the same contract
    assert_mixture(mix, bank_ops.bank_merge(m, z, u, torch_prefix, *args))
    assert torch.equal(torch_prefix, prefix) and cpu_kernel_calls == ["bank_merge"]


def test_bank_merge_fp64():
    t = make_point(5, 130, torch.float64, seed=4)
    m, z, u = (s[0] for s in naive_depth_stats(bank_ops.bank_rows(t["bank"], 3), t["c"][None], eps=EPS))
    prefix = t["prefix"].clone()
    mix = cpu.cpu_bank_merge(m, z, u, prefix, t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS)
    twin = naive_bank_merge(m, z, u, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS)
    assert torch.equal(prefix, t["prefix"])
    assert_mixture(mix, twin)


def test_no_tokens():
    t = make_point(0, 7, torch.float32, seed=0)
    mix = cpu.cpu_bank_aggregate(t["bank"], 2, t["prefix"], t["output"], t["query"], t["gain"], t["ow"], EPS, OUT_EPS, True)
    assert mix.shape == (0, 7)


def _bad_cases():
    t = make_point(2, 4, torch.float32, seed=0)
    bank, prefix, output, query, gain, ow = (t[k] for k in ("bank", "prefix", "output", "query", "gain", "ow"))
    agg = lambda **kw: {"op": "aggregate", **dict(bank=bank, nvb=2, prefix=prefix, output=output,  # noqa: E731
                                                 query=query, gain=gain, out_norm_weight=ow, eps=EPS, out_eps=OUT_EPS,
                                                 write=True), **kw}
    m, z, u = torch.zeros(2), torch.ones(2), torch.zeros(2, 4)
    merge = lambda **kw: {"op": "merge", **dict(m=m, z=z, u=u, prefix=prefix, output=output,  # noqa: E731
                                               query=query, gain=gain, out_norm_weight=ow, eps=EPS, out_eps=OUT_EPS),
                          **kw}
    return {
        "prefix-scalar": (agg(prefix=prefix[0, 0]), ValueError, "prefix"),
        "prefix-tokens-apart": (agg(prefix=torch.zeros(2, 4, 4)[:, :2]), ValueError, "prefix"),
        "prefix-int": (agg(prefix=prefix.int()), TypeError, "prefix"),
        "prefix-column-major": (agg(prefix=prefix.t().contiguous().t()), ValueError, "prefix"),
        "prefix-not-a-tensor": (agg(prefix=[[0.0] * 4] * 2), TypeError, "prefix"),
        "output-shape": (agg(output=output[:1]), ValueError, "output"),
        "output-dtype": (agg(output=output.half()), ValueError, "output"),
        "query-shape": (agg(query=query[:, :3]), ValueError, "query"),
        "key-gain-shape": (agg(gain=gain[None]), ValueError, "gain"),
        "key-gain-missing": (merge(gain=None), TypeError, "gain"),
        "gain-shape": (agg(out_norm_weight=ow[None]), ValueError, "out_norm_weight"),
        "bank-tokens": (agg(bank=bank[:1]), ValueError, "bank"),
        "bank-d": (agg(bank=bank[..., :3]), ValueError, "bank"),
        "bank-dtype": (agg(bank=bank.half()), ValueError, "bank"),
        "bank-full": (agg(nvb=NB), ValueError, "nvb"),
        "nvb-negative": (agg(nvb=-1), ValueError, "nvb"),
        "nvb-float": (agg(nvb=1.0), TypeError, "nvb"),
        "eps": (agg(eps=0.0), ValueError, "eps"),
        "out-eps": (agg(out_eps="1e-5"), TypeError, "out_eps"),
        "m-shape": (merge(m=m[None]), ValueError, "m"),
        "u-shape": (merge(u=u[:, :3]), ValueError, "u"),
        "z-int": (merge(z=z.int()), TypeError, "z"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_arguments_name_the_argument(case):
    kwargs, error, name = case
    kwargs = dict(kwargs)
    op = cpu.KERNELS.kernels[f"bank_{kwargs.pop('op')}"]  # the CPU backend's op, as an inference stream calls it
    with pytest.raises(error, match=rf"^{name}:"):
        op(*kwargs.values())  # in the order of the op's parameters, as the inference stream passes them


def test_dispatch_validates_before_mutating():
    t = make_point(2, 4, torch.float32, seed=0)
    prefix = t["prefix"].clone()
    with pytest.raises(ValueError, match="^nvb:"):
        bank_ops.bank_aggregate(t["bank"], NB, prefix, t["output"], t["query"], t["gain"], None, EPS, OUT_EPS, True)
    assert torch.equal(prefix, t["prefix"])


def test_cpu_takes_two_phase_at_inference_only():
    """Measured (docs/bench_streams*.json): with the fused bank_merge two-phase inference pays on CPU; two-phase
    training (phase 2's backward in torch ops) does not, so the CPU backend refuses it there."""
    from attnres.layers.residuals import backend_takes_two_phase

    assert backend_takes_two_phase("cpu", torch.float32, 512, 8, training=False)
    assert not backend_takes_two_phase("cpu", torch.float32, 512, 8, training=True)


def test_bf16_stores_round_to_nearest_even_as_torch():
    """The kernels' fp32 -> bf16 store (a vector instruction where the CPU has one, bit operations elsewhere) rounds as
    torch does: the pending add of the prefix against torch's `add_` on sums that fall halfway between two bf16 values,
    just beside halfway, overflow to infinity, infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 20, (4096,), generator=g).float())
    x = x.to(torch.bfloat16).float()
    half_unit = torch.sign(x) * torch.exp2(torch.floor(torch.log2(x.abs())) - 8)  # half of x's last bf16 unit
    big = torch.full((64,), 3.3e38)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1.0, -1.0, 2.0**-126])
    a = torch.cat([x, x, x, big, special, special]).to(torch.bfloat16)
    b = torch.cat([half_unit, half_unit * 1.0625, -half_unit * 0.9375, big, special, special.flip(0)])
    b = b.to(torch.bfloat16)  # exact: powers of two times a few bits
    sums = (a.float() + b.float()).view(torch.int32) & 0xFFFF
    assert int((sums == 0x8000).sum()) > 4000  # ties: x + half its unit, rounded to the even neighbour
    n = (a.numel() + 15) // 16 * 16
    prefix = torch.zeros(n, dtype=torch.bfloat16)
    output = torch.zeros(n, dtype=torch.bfloat16)
    prefix[: a.numel()], output[: b.numel()] = a, b
    prefix, output = prefix.view(-1, 16), output.view(-1, 16)
    bank = torch.zeros(prefix.shape[0], 1, 16, dtype=torch.bfloat16)
    want = prefix.clone().add_(output)
    cpu.cpu_bank_aggregate(bank, 0, prefix, output, torch.zeros(1, 16), torch.ones(16), None, EPS, OUT_EPS, False)
    same = (prefix.view(torch.int16) == want.view(torch.int16)) | (prefix.isnan() & want.isnan())
    assert bool(same.all()), prefix.flatten()[~same.flatten()][:8]
