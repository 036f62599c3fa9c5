"""What autograd holds for the backward of one Block training step (two-phase against one-shot reads), counted as the
unique storages of the saved tensors, and the phase-2 op that keeps no `[N, d]` fp32 statistics per point."""

from __future__ import annotations

import pytest
import torch

from attnres.layers import residuals
from attnres.layers.residuals import HELD_SLACK_PER_POINT, held_bytes_per_token, two_phase_pays
from attnres.models import AttnResConfig, AttnResForCausalLM
from attnres.ops import SoftmaxStats, depth_stats, merge_prefix
from tests import TOL, assert_all_close, leaves
from tests.models import TINY, off_init_

LAYERS, BLOCK, D, BATCH, TOKENS = 4, 2, 64, 2, 24


def held_bytes(fn) -> int:
    """Bytes of the distinct storages that autograd saves while `fn()` runs its forward, then its backward."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    return sum(storages.values())


def training_step_bytes(**config) -> int:
    torch.manual_seed(0)
    overrides = dict(num_hidden_layers=LAYERS, hidden_size=D, intermediate_size=2 * D, attn_res_block_size=BLOCK)
    model = AttnResForCausalLM(AttnResConfig(**{**TINY, **overrides, **config}))
    off_init_(model)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, TOKENS))
    return held_bytes(lambda: model(ids, labels=ids).loss)


def test_two_phase_holds_no_more_than_one_shot_plus_a_constant_per_point():
    """Bound: per point, two fp32 numbers per token (its shift m and sum z; `HELD_SLACK_PER_POINT`) and three fp32
    rows of d (phase 1's stacked queries, gains and their product, kept for the gradients of both). Phase 2 saving
    its u (a view of phase 1's `[S, N, d]` output) would add 4 d bytes per token per point: every block's whole
    statistics, alive until the backward."""
    standard = training_step_bytes(residual="standard")
    one_shot = training_step_bytes(residual="block", attn_res_two_phase=False)
    two_phase = training_step_bytes(residual="block", attn_res_two_phase=True)
    points, tokens = 2 * LAYERS + 1, BATCH * TOKENS
    bound = one_shot + points * (HELD_SLACK_PER_POINT * tokens + 3 * 4 * D)
    figures = f"standard {standard}, one-shot {one_shot}, two-phase {two_phase} bytes"
    assert two_phase <= bound, f"{figures}: two-phase above the bound {bound}"
    assert bound - one_shot < points * tokens * D * 4 / 4, "the bound must stay well below one u per point"


@pytest.mark.parametrize("rows, points", [(1, 2), (2, 5), (8, 24), (64, 3)])
def test_the_decision_holds_two_phase_to_the_bound(rows, points, monkeypatch):
    """`two_phase_pays` in training compares the model of held bytes; two-phase is within the bound the test above
    measures, and a two-phase that held a u per point (4 d bytes a token) would be refused."""
    two = held_bytes_per_token(rows, points, two_phase=True)
    assert two <= held_bytes_per_token(rows, points, two_phase=False) + HELD_SLACK_PER_POINT * points
    assert two_phase_pays(8, 24, 2, training=True)
    real = held_bytes_per_token
    monkeypatch.setattr(residuals, "held_bytes_per_token", lambda r, p, two_phase: real(r, p, two_phase) + two_phase * 4 * D * p)
    assert not two_phase_pays(8, 24, 2, training=True) and two_phase_pays(8, 24, 2)


def test_training_decision_counts_the_backward():
    """Training adds the backward: each point's recompute of u reads the rows once more, while one-shot's backward
    reads every point's sources twice more. With bf16 rows, 10 rows and 2 points or 5 rows and 12 points pay at
    inference only; 8 rows and 24 points pay in both."""
    for rows, points in ((10, 2), (5, 12)):
        assert two_phase_pays(rows, points, 2) and not two_phase_pays(rows, points, 2, training=True)
    assert two_phase_pays(8, 24, 2) and two_phase_pays(8, 24, 2, training=True)


def merge_inputs(d: int = 16, lead=(3, 5)):
    sources = [torch.randn(*lead, d) * (1 + j) for j in range(3)]
    queries, gains = torch.randn(2, d) / d**0.5, torch.rand(2, d) + 0.5
    prefix, o = torch.randn(*lead, d), torch.rand(d) + 0.5
    return sources, queries, gains, prefix, o


@pytest.mark.parametrize("with_prefix", [True, False], ids=["prefix", "noprefix"])
def test_merge_with_sources_saves_no_u_and_matches(with_prefix):
    """Given the sources, phase 2 keeps no storage of phase 1's statistics u and gives the same output and
    gradients (phase 1's included) as when it keeps u."""
    torch.manual_seed(0)
    sources, queries, gains, prefix, o = merge_inputs()
    results, saved_u = [], []
    for keep_u in (True, False):
        *xs, w, g, x, o_ = leaves(*sources, queries, gains, prefix, o)
        stats = depth_stats(xs, w, g)
        u_storage = stats.u.untyped_storage().data_ptr()
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t.untyped_storage().data_ptr()) or t,
                                                      lambda t: t):
            out = merge_prefix(SoftmaxStats(*(s[1] for s in stats)), x if with_prefix else None, w[1:2], g[1],
                               out_norm_weight=o_, sources=None if keep_u else xs)
        saved_u.append(u_storage in held)
        grad_out = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        inputs = [*xs, w, g, o_] + [x] * with_prefix
        results.append([out, *torch.autograd.grad(out, inputs, grad_out)])
    assert saved_u == [True, False]
    names = ["out", "source 0", "source 1", "source 2", "queries", "gains", "o"] + ["prefix"] * with_prefix
    assert_all_close(names, results[0], results[1], TOL[torch.float32])


def test_gradcheck_through_phase_one_and_a_recomputing_phase_two():
    """fp64 (torch path): d(phase 2 of phase 1's statistics) w.r.t. sources, prefix, query, gains, output gain."""
    torch.manual_seed(0)
    sources, queries, gains, prefix, o = (t.double() if isinstance(t, torch.Tensor) else [s.double() for s in t]
                                          for t in merge_inputs(d=5, lead=(3,)))
    inputs = [t.requires_grad_() for t in (*sources, queries, gains, prefix, o)]

    def fn(*tensors):
        *xs, w, g, x, o_ = tensors
        stats = depth_stats(xs, w, g, eps=0.1)
        point = SoftmaxStats(*(s[0] for s in stats))
        return merge_prefix(point, x, w[0], g[0], eps=0.1, out_norm_weight=o_, out_eps=0.05, sources=xs)

    assert torch.autograd.gradcheck(fn, inputs)


def test_sources_of_another_shape_are_refused():
    sources, queries, gains, prefix, _ = merge_inputs()
    stats = SoftmaxStats(*(s[0] for s in depth_stats(sources, queries, gains)))
    with pytest.raises(ValueError, match="sources: expected shape"):
        merge_prefix(stats, prefix, queries[0], gains[0], sources=[s[:2] for s in sources])
