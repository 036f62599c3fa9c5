"""Full's inference backend (direct kernel calls: what transformers' eval forward and vLLM run) reads exactly what
`FullResidual` reads through the operator, at every point, fused PreNorm or not, on the compiled CPU kernel and on the
torch path."""

from __future__ import annotations

import pytest
import torch

from attnres.layers import make_stream
from attnres.layers.depth_attention import DepthAttention, RMSNorm
from attnres.ops.registry import BACKEND_ENV
from attnres.layers.full_inference import FullInference

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


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rescale", [False, True])
def test_reads_equal_full_stream_bit_for_bit(monkeypatch, cpu_kernel_calls, backend, dtype, rescale):
    monkeypatch.setenv(BACKEND_ENV, backend)
    gen = torch.Generator().manual_seed(1)
    tokens = 37  # a flattened batch of several sequences
    embedding = torch.randn(tokens, D, generator=gen).to(dtype)
    outputs = [torch.randn(tokens, D, generator=gen).to(dtype) for _ in range(2 * LAYERS)]
    norms = [RMSNorm(D, eps=1e-6) for _ in range(2 * LAYERS)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    pts = points()
    want = reads(make_stream("full", embedding, LAYERS, pts, rescale_mixture=rescale), norms, outputs)
    got_stream = make_stream("full", embedding, LAYERS, pts, rescale_mixture=rescale, inference=True)
    assert isinstance(got_stream.residual, FullInference)
    cpu_kernel_calls.clear()
    got = reads(got_stream, norms, outputs)
    assert cpu_kernel_calls == (["depth_attention_fwd"] * (2 * LAYERS + 1) if backend == "auto" else [])
    assert len(got) == len(want) == 2 * LAYERS + 1
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), (k, (a.float() - b.float()).abs().max().item())
