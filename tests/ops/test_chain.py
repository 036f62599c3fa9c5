"""A chain of points (`attnres.ops.chain`): the gradients of `depth_attention` point by point, summed in place.

Every backend's `bwd_into` against its own `bwd` (the Triton one in tests/ops/test_triton.py), then chains of points
against the functional op on small Full-like and Block-like graphs: the torch twin bit for bit in fp32 (it sums in
autograd's order), the CPU kernel to fp32 rounding, bf16 against an fp64 oracle. Then the chain's shapes: broken,
forked, ended early, and the errors.
"""

from __future__ import annotations


import pytest
import torch

from attnres.ops import cpu, depth_attention, registry
from attnres.ops.chain import depth_attention_chained
from attnres.ops.depth_attention import (
    torch_depth_attention_bwd,
    torch_depth_attention_bwd_into,
    torch_depth_attention_fwd,
)

EPS, OUT_EPS = 1e-6, 1e-5
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(cpu.disabled(), reason="CPU kernel disabled"))]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    monkeypatch.setenv(registry.BACKEND_ENV, "torch" if request.param == "torch" else "auto")
    return request.param


def kernels(name: str):
    if name == "torch":
        return torch_depth_attention_bwd, torch_depth_attention_bwd_into
    return cpu.cpu_depth_attention_bwd, cpu.cpu_depth_attention_bwd_into


def backward_case(R: int, dtype: torch.dtype, out_norm: bool, d: int = 37, lead=(3, 5)):
    sources = [(torch.randn(*lead, d) * (0.5 + j / 3)).to(dtype) for j in range(R)]
    c = torch.randn(d) * 2 / d**0.5
    out_w = 1 + 0.3 * torch.randn(d) if out_norm else None
    _, weights, rstd = torch_depth_attention_fwd(sources, c, out_w, EPS, OUT_EPS)
    grad_out = torch.randn(*lead, d).to(dtype)
    return grad_out, sources, c, out_w, weights, rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_norm", [False, True], ids=["plain", "onorm"])
@pytest.mark.parametrize("added", [0, 2, 4], ids=["written", "two-added", "all-added"])
def test_bwd_into_writes_what_bwd_returns_and_adds_it_in_place(backend, dtype, out_norm, added):
    """The first `added` of `into` (one tensor per source) get the gradient added onto what they hold, the others get
    it written (they start as NaN: every element must be written)."""
    bwd, bwd_into = kernels(backend)
    grad_out, sources, c, out_w, weights, rstd = backward_case(4, dtype, out_norm)
    grads, dc, d_out_w = bwd(grad_out, None, sources, c, out_w, weights, rstd, EPS, OUT_EPS)

    base = [torch.randn(x.shape).to(dtype) if j < added else torch.full_like(x, float("nan"))
            for j, x in enumerate(sources)]
    into = [t.clone() for t in base]
    dc_into, d_out_w_into = bwd_into(grad_out, None, sources, c, out_w, weights, rstd, EPS, OUT_EPS, into, added)
    assert torch.equal(dc_into, dc) and torch.equal(d_out_w_into, d_out_w)
    for j, (got, grad) in enumerate(zip(into, grads)):
        if j >= added:
            assert torch.equal(got, grad), j
            continue
        expected = base[j].float() + grad.float()
        if dtype == torch.float32 and backend == "torch":
            assert torch.equal(got, expected), j  # autograd's own fp32 add
        else:
            # the kernel adds its fp32 gradient before rounding (the CPU kernel may fuse the add): the sum is rounded
            # once, where `expected` rounded the gradient: together at most one ulp of the operands' magnitudes
            ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
            bound = ulp * (base[j].float().abs() + grad.float().abs())
            assert ((got.float() - expected).abs() <= bound).all(), j


BLOCK_SIZE = 3  # points per block of the Block-like graph


def graph(
    kind: str, chained: bool, dtype: torch.dtype, points: int = 8, d: int = 24, tokens: int = 40,
    cut: int | None = None, side_use: bool = False, compute: torch.dtype | None = None,
):
    """A small forward of `kind`; at each point a small layer turns the mixture into the next output. Full: point l
    mixes the embedding and the l earlier outputs. Block: point l mixes the bank rows and the prefix (the sum of its
    block's outputs so far); every BLOCK_SIZE points the prefix becomes a bank row (the embedding the first), and
    that point reads the rows only, as a Block write point does. Odd points fuse an output norm. `cut`: the carrier is
    dropped before that point (a new chain starts there); `side_use`: an output is also used outside the points;
    `compute`: run in this dtype on the inputs rounded to `dtype` (the fp64 oracle of a low-precision run). Returns
    the loss and the leaves whose gradients are compared."""
    g = torch.Generator().manual_seed(1)
    compute = compute or dtype
    emb = (torch.randn(tokens, d, generator=g) * 3).to(dtype).to(compute).requires_grad_()
    queries = [(torch.randn(d, generator=g) / d**0.5).requires_grad_() for _ in range(points)]
    gains = [(1 + 0.2 * torch.randn(d, generator=g)).requires_grad_() for _ in range(points)]
    out_w = (1 + 0.2 * torch.randn(d, generator=g)).requires_grad_()
    mats = [(torch.randn(d, d, generator=g) / d**0.5).to(dtype).to(compute) for _ in range(points)]
    outputs, rows, prefix, carrier = [], [], emb, None
    for p in range(points):
        if kind == "full":
            sources = [emb, *outputs]
        else:
            if p % BLOCK_SIZE == 0:
                rows, prefix = [*rows, prefix], None
            sources = rows if prefix is None else [*rows, prefix]
        norm = out_w if p % 2 else None
        if chained:
            carrier = None if p == cut else carrier
            h, carrier = depth_attention_chained(sources, carrier, queries[p], gains[p], eps=EPS, out_norm_weight=norm,
                                                 out_eps=OUT_EPS, carry_newest=kind == "full" or prefix is None)
        else:
            h = depth_attention(sources, queries[p], gains[p], eps=EPS, out_norm_weight=norm, out_eps=OUT_EPS)
        outputs.append(torch.tanh(h @ mats[p]) * (1 + p))
        prefix = outputs[-1] if prefix is None else prefix + outputs[-1]
    last = outputs[-1] if kind == "full" else prefix
    loss = (last.float() * torch.linspace(-1, 1, d)).sum()
    if side_use:
        loss = loss + outputs[3].float().square().mean()
    return loss, [emb, *queries, *gains, out_w]


def grads_of(chained: bool, dtype: torch.dtype, kind: str = "full", **kwargs) -> list[torch.Tensor]:
    loss, leaves = graph(kind, chained, dtype, **kwargs)
    loss.backward()
    return [t.grad for t in leaves]


KINDS = ["full", "block"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cut", [None, 4], ids=["one-chain", "cut-at-4"])
@pytest.mark.parametrize("side_use", [False, True], ids=["", "side-use"])
def test_a_chain_gives_the_functional_gradients(backend, kind, cut, side_use):
    plain = grads_of(False, torch.float32, kind, side_use=side_use)
    chained = grads_of(True, torch.float32, kind, cut=cut, side_use=side_use)
    for j, (a, b) in enumerate(zip(chained, plain)):
        if backend == "torch" and not side_use and cut is None:
            # a gradient used elsewhere too (or from two chains) is added to the chain's sum last, where autograd
            # adds each point's in turn
            assert torch.equal(a, b), f"leaf {j}: the torch twin sums in autograd's order, bit for bit"
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * b.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_the_values_are_the_functional_ones(backend, kind):
    plain, _ = graph(kind, False, torch.float32)
    chained, _ = graph(kind, True, torch.float32)
    assert torch.equal(plain, chained)


def test_a_block_chain_carries_the_bank_rows_and_not_the_prefix():
    """A Block point's carrier covers its bank rows; its prefix gets a gradient of its own."""
    d = 8
    rows = [torch.randn(4, d, requires_grad=True) for _ in range(2)]
    prefix = torch.randn(4, d, requires_grad=True)
    q = torch.randn(d, requires_grad=True)
    _, at_write = depth_attention_chained(rows, None, q)  # a write point: rows only, all carried
    assert at_write.shape[0] == 2
    out, carrier = depth_attention_chained([*rows, prefix], at_write, q, carry_newest=False)
    assert carrier.shape == at_write.shape  # the next point reads the same rows and its own prefix
    out.sum().backward()
    expected = torch.autograd.grad(depth_attention([*rows, prefix], q).sum(), [*rows, prefix])
    for got, want in zip((*rows, prefix), expected):
        torch.testing.assert_close(got.grad, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_chains_are_as_close_to_fp64_as_autograds_sums(backend, kind, dtype):
    """Each partial sum is rounded once, where autograd rounds each point's gradient and then their sum. Against the
    fp64 gradients (on the same rounded inputs), every leaf's error is within twice the functional path's plus 1e-3 of
    the gradient's norm: the criterion of the GPU check's parity stage (benchmarks/gpu_model_check.py). Rounding
    differences feed through the later sublayers, so the two errors differ leaf by leaf either way."""
    oracle = grads_of(False, dtype, kind, compute=torch.float64)
    plain, chained = grads_of(False, dtype, kind), grads_of(True, dtype, kind)
    for j, (p, c, o) in enumerate(zip(plain, chained, oracle)):
        err_plain = (p.double() - o).norm().item()
        err_chain = (c.double() - o).norm().item()
        floor = 1e-3 * o.norm().item()
        assert err_chain <= 2 * err_plain + floor, f"leaf {j}: chained error {err_chain:.3g}, plain {err_plain:.3g}"


def test_two_points_on_one_carrier_get_their_gradients_summed(backend):
    """A carrier taken twice (two branches after one point): autograd adds the two gradient buffers, as for any
    tensor, and every gradient is still the functional one."""
    torch.manual_seed(3)
    d = 16
    emb = torch.randn(8, d, requires_grad=True)
    qs = [torch.randn(d, requires_grad=True) for _ in range(4)]

    def run(chained):
        for t in (emb, *qs):
            t.grad = None
        if chained:
            h0, k0 = depth_attention_chained([emb], None, qs[0])
            v1 = torch.sin(h0)
            a, _ = depth_attention_chained([emb, v1], k0, qs[1])
            b, _ = depth_attention_chained([emb, v1], k0, qs[2])
        else:
            v1 = torch.sin(depth_attention([emb], qs[0]))
            a, b = depth_attention([emb, v1], qs[1]), depth_attention([emb, v1], qs[2])
        (a.square().sum() + (b * 3).sum()).backward()
        return [t.grad.clone() for t in (emb, *qs[:3])]

    for x, y in zip(run(True), run(False)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_a_point_whose_output_is_unused_still_hands_the_chain_on(backend):
    d = 12
    emb = torch.randn(6, d, requires_grad=True)
    q = torch.randn(d, requires_grad=True)
    _, k0 = depth_attention_chained([emb], None, q)  # its mixture is never used
    v1 = emb * 2
    h, _ = depth_attention_chained([emb, v1], k0, q)
    h.sum().backward()
    ref_emb = emb.detach().clone().requires_grad_()
    expected = torch.autograd.grad(depth_attention([ref_emb, ref_emb * 2], q).sum(), ref_emb)[0]
    torch.testing.assert_close(emb.grad, expected, rtol=1e-6, atol=1e-6)


def test_a_carrier_that_does_not_continue_the_chain_is_refused():
    d = 8
    x = torch.randn(4, d)
    q = torch.zeros(d)
    _, carrier = depth_attention_chained([x, x], None, q)  # made by a point of two sources
    with pytest.raises(ValueError, match=r"carrier: expected the carrier of the previous point.*\(1, 4, 8\)"):
        depth_attention_chained([x, x], carrier, q)
    with pytest.raises(ValueError, match="carrier: expected the sources' dtype"):
        depth_attention_chained([x, x, x], carrier.to(torch.float64), q)


def test_a_continuing_point_tracks_only_its_newest_source(backend):
    """The older sources get their gradients through the carrier, so autograd keeps no edge to them (each would cost
    its bookkeeping at every point); a point that starts a chain tracks every source."""
    d = 8
    xs = [torch.randn(4, d, requires_grad=True) for _ in range(3)]
    q, gain = torch.randn(d, requires_grad=True), torch.ones(d, requires_grad=True)
    first, carrier = depth_attention_chained(xs[:2], None, q, gain)
    out, _ = depth_attention_chained(xs, carrier, q, gain)

    def leaves(t):  # in any order: the C++ point (the CPU's) takes its sources first
        return sorted(id(fn.variable) for fn, _ in t.grad_fn.next_functions if hasattr(fn, "variable"))

    assert leaves(first) == sorted(map(id, (q, gain, *xs[:2])))
    assert leaves(out) == sorted(map(id, (q, gain, xs[2])))
    assert carrier.grad_fn in [fn for fn, _ in out.grad_fn.next_functions]
    out.sum().backward()
    assert all(x.grad is not None for x in xs)


@pytest.mark.skipif(cpu.disabled() or not cpu.available(), reason="CPU kernel unavailable")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cut", [None, 4], ids=["one-chain", "cut-at-4"])
@pytest.mark.parametrize("side_use", [False, True], ids=["", "side-use"])
def test_the_cpu_chained_point_op_is_its_python_function_in_cpp(monkeypatch, kind, dtype, cut, side_use):
    """On CPU a chain's points are the `chained_point` op, whose autograd node is C++: its values and every gradient
    are those of `_ChainedPoint`, the Function it replaces, bit for bit, through cuts and gradients from outside."""
    from attnres.ops import chain

    def run():
        loss, leaves = graph(kind, True, dtype, cut=cut, side_use=side_use)
        return [loss, *torch.autograd.grad(loss, leaves)]

    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    with monkeypatch.context() as m:
        m.setattr(chain._ChainedPoint, "apply", None)  # the Python Function must not run
        cpp = run()
    portable_chain = {"chained_point": chain.chained_point}  # the Python Function, over the CPU's point kernels
    monkeypatch.setattr(chain, "kernel",
                        lambda op, x, rows=None: portable_chain.get(op) or registry.kernel(op, x, rows))
    python = run()
    for a, b in zip(cpp, python):
        assert torch.equal(a, b)
