"""The inference bank follows the Block schedule and reproduces the autograd Block residual."""

import pytest
import torch

from attnres.layers import DepthAttention, RMSNorm, make_stream
from attnres.layers.bank import BlockBank
from attnres.layers.residuals import PreNorm


def _stack(L, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    points = [DepthAttention(d) for _ in range(2 * L + 1)]
    norms = [RMSNorm(d) for _ in range(2 * L + 1)]
    with torch.no_grad():
        for p, n in zip(points, norms):
            p.proj.weight.normal_(generator=g)
            p.norm.weight.normal_(generator=g)
            n.weight.normal_(generator=g)
    mats = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(2 * L)]
    return points, norms, mats


def _run(stream, norms, mats, fuse_norm=True):
    L = len(mats) // 2
    for k in range(2 * L):
        x = stream.read(norms[k] if fuse_norm else None)
        x = x if fuse_norm else norms[k](x)
        stream.write(torch.tanh(x.float() @ mats[k]).to(x.dtype))
    return stream.read(norms[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (4, 1), (5, 2), (6, 3), (7, 7), (3, 5)], ids=lambda v: str(v))
def test_bank_stream_bit_exact_with_training_stream(dtype, L, S):
    d = 16
    points, norms, mats = _stack(L, d)
    emb = torch.randn(2, 3, d).to(dtype)
    with torch.no_grad():
        train = make_stream("block", emb, L, points, block_size=S, two_phase=False)
        infer = make_stream("block", emb, L, points, block_size=S, two_phase=False, inference=True)
        assert isinstance(infer.residual, BlockBank)
        a, b = _run(train, norms, mats), _run(infer, norms, mats)
    assert torch.equal(a, b)
    rows, bank = train.state().rows, infer.state().bank
    assert infer.residual.filled(2 * L) == len(rows) == bank.shape[1] == -(-L // S)
    for j, row in enumerate(rows):
        assert torch.equal(bank[:, j], row.reshape(-1, d))


@pytest.mark.parametrize("L,S", [(6, 2), (8, 3), (9, 9)], ids=lambda v: str(v))
@pytest.mark.parametrize("rescale", [False, True])
def test_bank_stream_two_phase_matches_one_shot(L, S, rescale):
    d = 16
    points, norms, mats = _stack(L, d, seed=1)
    emb = torch.randn(4, d)
    with torch.no_grad():
        ref = _run(make_stream("block", emb, L, points, block_size=S, rescale_mixture=rescale), norms, mats)
        two = make_stream("block", emb, L, points, block_size=S, rescale_mixture=rescale, two_phase=True, inference=True)
        out = _run(two, norms, mats)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,S,dtype", [(9, 9, torch.float32), (12, 4, torch.float32), (8, 4, torch.bfloat16)],
                         ids=lambda v: str(v))
def test_phase_one_statistics_stay_within_the_bank_bytes(L, S, dtype, monkeypatch):
    """Phase 1 scores a block's points in groups whose fp32 statistics u take no more than the bank (at least two
    points), and the groups together serve every point of the block that two-phase serves."""
    import attnres.layers.bank as bank_module

    d, tokens = 16, 6
    points, norms, mats = _stack(L, d, seed=4)
    emb = torch.randn(tokens, d).to(dtype)
    groups = []
    real = bank_module.depth_stats_fwd
    monkeypatch.setattr(bank_module, "depth_stats_fwd", lambda rows, cs, eps: groups.append(len(cs)) or real(rows, cs, eps))
    with torch.no_grad():
        ref = _run(make_stream("block", emb, L, points, block_size=S, two_phase=False), norms, mats)
        stream = make_stream("block", emb, L, points, block_size=S, two_phase=True, inference=True)
        out = _run(stream, norms, mats)
    bank = stream.state().bank
    limit = max(2, bank.numel() * bank.element_size() // (4 * tokens * d))
    assert groups and max(groups) <= limit < 2 * L - 1, (groups, limit)
    blocks = -(-L // S)
    points_after_writes = 2 * L + 1 - blocks
    assert points_after_writes - blocks <= sum(groups) <= points_after_writes, groups  # a last single point: one-shot
    torch.testing.assert_close(out, ref, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}))


def test_bank_stream_unfused_reads_return_the_mixture():
    L, S, d = 4, 2, 8
    points, norms, mats = _stack(L, d, seed=2)
    emb = torch.randn(5, d)
    with torch.no_grad():
        ref = _run(make_stream("block", emb, L, points, block_size=S), norms, mats)
        out = _run(make_stream("block", emb, L, points, block_size=S, inference=True), norms, mats, fuse_norm=False)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_reads_take_the_weights_as_they_are_at_every_forward():
    L, S, d = 3, 1, 8
    points, norms, mats = _stack(L, d, seed=3)
    emb = torch.randn(5, d)
    with torch.no_grad():
        _run(make_stream("block", emb, L, points, block_size=S, inference=True), norms, mats)
        # changes that bump no version counter (as fused optimizers do), and a replaced parameter
        points[4].proj.weight.data.mul_(-3.0)
        points[2].norm.weight.data.copy_(torch.rand(d))
        points[5].norm.weight = torch.nn.Parameter(torch.rand(d))
        ref = _run(make_stream("block", emb, L, points, block_size=S), norms, mats)
        out = _run(make_stream("block", emb, L, points, block_size=S, inference=True), norms, mats)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    for point in points:  # a read takes its point's own weights as they are: nothing folded ahead, nothing kept
        query, gain, eps = point.weights()
        assert query is point.proj.weight and gain is point.norm.weight and eps == point.eps


def test_the_first_point_checks_what_the_kernel_takes():
    """The bank checks the arguments of its first fused call (later calls pass the forward's own buffers and the same
    weights): a PreNorm gain of the wrong width is refused by name before anything is written."""
    L, S, d = 2, 1, 8
    points, norms, mats = _stack(L, d, seed=4)
    norms[0] = RMSNorm(d + 1)
    emb = torch.randn(5, d)
    stream = make_stream("block", emb, L, points, block_size=S, inference=True)
    with torch.no_grad(), pytest.raises(ValueError, match="^out_norm_weight:"):
        stream.read(norms[0])


@pytest.mark.parametrize("S", [1, 3])
def test_reads_with_autograd_on_or_an_unfusable_norm_equal_the_direct_reads(S):
    """A read without records, autograd or an unfusable norm goes straight to the kernel; with autograd on, or a norm
    that runs as its own module, it goes through the generic read: the same mixtures, bit for bit."""
    L, d = 4, 8
    points, norms, mats = _stack(L, d, seed=5)
    emb = torch.randn(5, d)
    with torch.no_grad():
        direct = _run(make_stream("block", emb, L, points, block_size=S, inference=True), norms, mats)
    generic = _run(make_stream("block", emb, L, points, block_size=S, inference=True), norms, mats)
    assert not generic.requires_grad and torch.equal(generic, direct)
    # a norm that runs as its own module, read by the generic read: the mixture normed by that module
    with torch.no_grad():
        got = make_stream("block", emb, L, points, block_size=S, inference=True)
        ref = make_stream("block", emb, L, points, block_size=S, inference=True)
        for k in range(2 * L + 1):
            x = got.read(PreNorm(norms[k], None))
            assert torch.equal(x, norms[k](ref.read()))
            if k < 2 * L:
                out = torch.tanh(x @ mats[k])
                got.write(out), ref.write(out)
