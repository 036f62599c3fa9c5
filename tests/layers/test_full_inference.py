"""Full's inference backend (direct kernel calls: what transformers' eval forward and vLLM run) reads exactly what
`FullResidual` reads through the operator, at every point, fused PreNorm or not, on the compiled CPU kernel and on the
torch path, with its sources in a bank (a few tokens) or in place."""

from __future__ import annotations

import pytest
import torch

from attnres.layers import make_residual, make_stream
from attnres.layers.depth_attention import DepthAttention, RMSNorm
from attnres.ops.registry import BACKEND_ENV
from attnres.layers import full_inference
from attnres.layers.full_inference import FullBankState, FullInference
from attnres.layers.residuals import ResidualState

LAYERS, D = 3, 64


def points() -> list[DepthAttention]:
    gen = torch.Generator().manual_seed(0)
    made = [DepthAttention(D, eps=1e-5) for _ in range(2 * LAYERS + 1)]
    with torch.no_grad():
        for p in made:
            p.proj.weight.copy_(torch.randn(p.proj.weight.shape, generator=gen))
            p.norm.weight.copy_(1 + 0.3 * torch.randn(p.norm.weight.shape, generator=gen))
    return made


def reads(stream, norms, outputs) -> list[torch.Tensor]:
    """Every point's read: the sublayers' PreNorms fused, the final read without one."""
    got = []
    with torch.no_grad():
        for norm, output in zip(norms, outputs):
            got.append(stream.read(norm))
            stream.write(output)
        got.append(stream.read())
    return got


def inputs(tokens: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    embedding = torch.randn(tokens, D, generator=gen).to(dtype)
    outputs = [torch.randn(tokens, D, generator=gen).to(dtype) for _ in range(2 * LAYERS)]
    norms = [RMSNorm(D, eps=1e-6) for _ in range(2 * LAYERS)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    return embedding, outputs, norms


BANKED = 37  # the most tokens a bank takes below: its bytes, N (2L + 1) d elements, the limit


@pytest.mark.parametrize("tokens", [1, BANKED, BANKED + 1])  # a flattened batch of several sequences
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rescale", [False, True])
def test_reads_equal_full_stream_bit_for_bit(monkeypatch, cpu_kernel_calls, tokens, backend, dtype, rescale):
    monkeypatch.setenv(BACKEND_ENV, backend)
    monkeypatch.setattr(full_inference, "BANK_BYTES", BANKED * (2 * LAYERS + 1) * D * dtype.itemsize)
    embedding, outputs, norms = inputs(tokens, dtype)
    pts = points()
    want_stream = make_stream("full", embedding, LAYERS, pts, rescale_mixture=rescale)
    want = reads(want_stream, norms, outputs)
    got_stream = make_stream("full", embedding, LAYERS, pts, rescale_mixture=rescale, inference=True)
    assert isinstance(got_stream.residual, FullInference)
    banked = tokens <= BANKED
    assert isinstance(got_stream.state(), FullBankState if banked else ResidualState)
    cpu_kernel_calls.clear()
    got = reads(got_stream, norms, outputs)
    op = "bank_aggregate" if banked else "point_fwd"
    assert cpu_kernel_calls == ([op] * (2 * LAYERS + 1) if backend == "auto" else [])
    assert len(got) == len(want) == 2 * LAYERS + 1
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), (k, (a.float() - b.float()).abs().max().item())
    # the state the final read left holds every source
    rows, want_rows = got_stream.state().rows, want_stream.state().rows
    assert len(rows) == len(want_rows) == 2 * LAYERS + 1
    assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


def test_bank_reads_of_a_state_read_before_equal_the_lists():
    """A state is a value: reading it again (a replayed layer), or reading the state a read returned with no write
    between, reads the same sources as `FullResidual`."""
    embedding, outputs, norms = inputs(3, torch.float32)
    pts = points()
    want = make_residual("full", LAYERS, pts)
    got = make_residual("full", LAYERS, pts, inference=True)
    with torch.no_grad():
        states = {}
        for name, residual in (("want", want), ("got", got)):
            start = residual.start(embedding)
            _, state = residual.read(start, 0, norms[0])
            state = residual.write(state, outputs[0])
            again = residual.read(state, 1, norms[1])
            states[name] = (start, state, residual.read(again[1], 2, norms[2])[0], again[0])
        assert isinstance(states["got"][0], FullBankState)
        assert torch.equal(states["got"][2], states["want"][2])  # no new source: the newest row as the prefix
        assert torch.equal(states["got"][3], states["want"][3])
        for k in range(2):  # each state read once more
            a = got.read(states["got"][k], k, norms[k])[0]
            assert torch.equal(a, want.read(states["want"][k], k, norms[k])[0])


def test_a_layer_takes_the_bank_state_of_the_layer_before():
    residual = make_stream("full", torch.randn(2, D), LAYERS, points(), inference=True).residual
    state = residual.start(torch.randn(2, D))
    assert residual.enter(1, state) is state
    with pytest.raises(TypeError, match="takes the ResidualState or FullBankState that layer 0 returns"):
        residual.enter(1, torch.randn(2, D))


@pytest.mark.parametrize("tokens", [2, BANKED + 1])
def test_reads_with_autograd_on_equal_the_direct_reads(monkeypatch, tokens):
    """With autograd on, a read goes through the generic read instead of straight to the kernel: the same mixtures."""
    monkeypatch.setattr(full_inference, "BANK_BYTES", BANKED * (2 * LAYERS + 1) * D * 4)
    embedding, outputs, norms = inputs(tokens, torch.float32)
    pts = points()
    direct = reads(make_stream("full", embedding, LAYERS, pts, inference=True), norms, outputs)
    stream = make_stream("full", embedding, LAYERS, pts, inference=True)
    generic = []
    for norm, output in zip(norms, outputs):
        generic.append(stream.read(norm))
        stream.write(output)
    generic.append(stream.read())
    assert all(not g.requires_grad and torch.equal(g, want) for g, want in zip(generic, direct))
