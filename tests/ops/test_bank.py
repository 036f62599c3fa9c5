"""The fused inference aggregation against its twin: bank writes and prefixes bit-exact, outputs to rounding."""

import pytest
import torch

from attnres.ops import depth_attention, depth_stats
from attnres.ops.bank import bank_aggregate, bank_merge, bank_rows
from attnres.ops.naive import naive_bank_aggregate, naive_bank_merge

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(dtype, N=5, NB=4, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(N, NB, d, generator=g).to(dtype)
    prefix = torch.randn(N, d, generator=g).to(dtype)
    output = torch.randn(N, d, generator=g).to(dtype)
    point = torch.randn(1, d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)  # query [1, d], key gain [d]
    ow = torch.randn(d, generator=g)
    return bank, prefix, output, point, ow


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("with_output", [False, True], ids=["no-pending", "pending-add"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["mix", "normed"])
def test_bank_aggregate_matches_twin(dtype, write, with_output, with_norm):
    bank, prefix, output, point, ow = _case(dtype)
    output = output if with_output else None
    ow = ow if with_norm else None
    b1, b2, p1, p2 = bank.clone(), bank.clone(), prefix.clone(), prefix.clone()
    y1 = bank_aggregate(b1, 2, p1, output, *point, ow, 1e-6, 1e-5, write)
    y2 = naive_bank_aggregate(b2, 2, p2, output, *point, ow, 1e-6, 1e-5, write)
    assert torch.equal(b1, b2) and torch.equal(p1, p2)  # bank write and prefix: bit-exact
    if write:
        assert torch.equal(b1[:, 2], p1) and torch.equal(b1[:, 3], bank[:, 3])  # only row nvb is written
    assert torch.allclose(y1.float(), y2.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_bank_aggregate_is_the_operator_over_rows_and_prefix(dtype):
    bank, prefix, output, point, ow = _case(dtype, seed=1)
    p = prefix.clone()
    y = bank_aggregate(bank.clone(), 3, p, output, *point, ow, 1e-6, 1e-6, False)
    ref = depth_attention([*bank_rows(bank, 3), prefix + output], *point, out_norm_weight=ow)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_bank_merge_equals_one_shot(dtype):
    bank, prefix, output, point, ow = _case(dtype, seed=2)
    stats = depth_stats(bank_rows(bank, 3), point[0], point[1][None], eps=1e-6)
    m, z, u = (s[0] for s in stats)
    p1, p2, p3 = prefix.clone(), prefix.clone(), prefix.clone()
    y1 = bank_merge(m, z, u, p1, output, *point, ow, 1e-6, 1e-5)
    y2 = naive_bank_merge(m, z, u, p2, output, *point, ow, 1e-6, 1e-5)
    y3 = bank_aggregate(bank.clone(), 3, p3, output, *point, ow, 1e-6, 1e-5, False)
    assert torch.equal(p1, p2) and torch.equal(p1, p3)
    assert torch.allclose(y1.float(), y2.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.allclose(y1.float(), y3.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_bank_ops_pass_opcheck():
    bank, prefix, output, point, ow = _case(torch.float32)
    torch.library.opcheck(torch.ops.attnres.bank_aggregate, (bank, 2, prefix, output, *point, ow, 1e-6, 1e-6, True))
    stats = depth_stats(bank_rows(bank, 2), point[0], point[1][None], eps=1e-6)
    args = (stats.m[0], stats.z[0], stats.u[0], prefix, output, *point, ow, 1e-6, 1e-6)
    torch.library.opcheck(torch.ops.attnres.bank_merge, args)
