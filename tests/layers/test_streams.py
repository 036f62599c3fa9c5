"""Residual streams (docs/design.md section 3): which sources each aggregation point sees, what the bank holds and when,
outputs of a toy stack against an independent hand-written schedule, two-phase against one-shot, the mixture
rescale, zero-query equivalence with the PreNorm baseline, and misuse errors."""

from __future__ import annotations

import functools

import pytest
import torch

import attnres.layers.residuals
from attnres import DepthAttention, RMSNorm, make_stream, naive_depth_attention
from tests import Tol, assert_all_close, error_ratios

D, T = 8, 3
# Two fp32 paths through a whole stack: each read's rounding (TOL) enters the next sublayers, and gradients cross
# every later point. Measured worst 1.1e-5 relative RMS, on a key gain's gradient (itself a cancelling sum over
# tokens); a wrong grouping or a stale statistic is off by percents.
STACK_TOL = Tol(rms=5e-5, max=1e-4)


class ToyStack:
    """L decoder layers of tanh sublayers, each aggregation point with its own query, key gain and PreNorm."""

    def __init__(self, num_layers: int, zero_queries: bool = False, output_scale: float = 1.0):
        self.num_layers = num_layers
        self.points = [DepthAttention(D, eps=1e-6) for _ in range(2 * num_layers + 1)]
        self.norms = [RMSNorm(D, eps=1e-5) for _ in range(2 * num_layers + 1)]
        with torch.no_grad():
            for point, norm in zip(self.points, self.norms):
                if not zero_queries:
                    point.proj.weight.normal_(std=0.6)  # scores of a few units: far from uniform weights
                point.norm.weight.uniform_(0.5, 1.5)
                norm.weight.uniform_(0.5, 1.5)
        self.mats = [torch.randn(D, D) / D**0.5 for _ in range(2 * num_layers)]
        self.output_scale = output_scale
        self.embedding = torch.randn(T, D) * output_scale

    def sublayer(self, k: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.mats[k]) * self.output_scale

    def parameters(self) -> list[torch.Tensor]:
        return [p for module in (*self.points, *self.norms) for p in module.parameters()]

    def drive(self, stream, use_norm: bool = True, after_read=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the stack through `stream`: (the 2L + 1 reads, the 2L sublayer outputs)."""
        reads, outputs = [], []
        for k in range(2 * self.num_layers + 1):
            reads.append(stream.read(self.norms[k] if use_norm else None))
            if after_read is not None:
                after_read(k, stream)
            if k < 2 * self.num_layers:
                outputs.append(self.sublayer(k, reads[-1]))
                stream.write(outputs[-1])
        return reads, outputs


def block_sum(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Left to right, the order in which a stream accumulates its prefix (so bank rows compare bit-exactly)."""
    return functools.reduce(torch.add, outputs)


def reference_sources(kind: str, v: list[torch.Tensor], k: int, block_size: int | None) -> list[torch.Tensor]:
    """Sources of point k written from block membership, not from the stream's write-layer logic: sublayers
    2bS .. 2(b+1)S - 1 form block b; a point sees the embedding, every complete block's sum, then the partial sum
    of the current block when it has begun."""
    if kind == "full":
        return v[: k + 1]
    outputs, per_block = v[1 : k + 1], 2 * block_size
    complete = k // per_block
    summaries = [block_sum(outputs[b * per_block : (b + 1) * per_block]) for b in range(complete)]
    partial = outputs[complete * per_block :]
    return [v[0], *summaries, *([block_sum(partial)] if partial else [])]


def reference_reads(toy: ToyStack, kind: str, block_size=None, rescale=False, use_norm=True) -> list[torch.Tensor]:
    """The 2L + 1 reads of the toy stack, one naive_depth_attention per point, norm applied after."""
    v, reads = [toy.embedding], []
    for k in range(2 * toy.num_layers + 1):
        if kind == "standard":
            h = block_sum(v)
        else:
            sources = reference_sources(kind, v, k, block_size)
            point = toy.points[k]
            h = naive_depth_attention(sources, point.proj.weight, point.norm.weight, eps=point.eps)
            h = h * len(sources) if rescale else h  # rescale_mixture: the mixture times R, before the norm
        reads.append(toy.norms[k](h) if use_norm else h)
        if k < 2 * toy.num_layers:
            v.append(toy.sublayer(k, reads[-1]))
    return reads


# Sources at each point in schedule order (attention, MLP side of layers 0 .. L-1, then the final read), written
# out from docs/design.md section 3: nvb + 1 with nvb = ceil(i/S) at the attention side of layer i, floor(i/S) + 1 at
# the MLP side, ceil(L/S) at the final read; layer 0's attention sees only the embedding. Full: point k sees k + 1.
SOURCES_PER_POINT = [
    ("full", 4, None, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("full", 5, None, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
    ("block", 4, 1, [1, 2, 2, 3, 3, 4, 4, 5, 5]),
    ("block", 5, 1, [1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]),
    ("block", 4, 2, [1, 2, 2, 2, 2, 3, 3, 3, 3]),
    ("block", 5, 2, [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]),
    ("block", 4, 3, [1, 2, 2, 2, 2, 2, 2, 3, 3]),
    ("block", 5, 3, [1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3]),
    ("block", 4, 4, [1, 2, 2, 2, 2, 2, 2, 2, 2]),
    ("block", 4, 9, [1, 2, 2, 2, 2, 2, 2, 2, 2]),
]


def schedule_id(kind, num_layers, block_size) -> str:
    return f"{kind}-L{num_layers}" + ("" if block_size is None else f"-S{block_size}")


@pytest.mark.parametrize(
    "kind, num_layers, block_size, expected",
    SOURCES_PER_POINT,
    ids=[schedule_id(*case[:3]) for case in SOURCES_PER_POINT],
)
def test_sources_seen_by_each_point(kind, num_layers, block_size, expected):
    toy = ToyStack(num_layers)
    stream = make_stream(kind, toy.embedding, num_layers, toy.points, block_size=block_size, record_weights=True)
    toy.drive(stream)
    assert [w.shape for w in stream.weights] == [(n, T) for n in expected]
    for w in stream.weights:
        torch.testing.assert_close(w.sum(0), torch.ones(T))


# Bank rows after each read (written at the attention side of layers 0, S, 2S, ...), and the sublayers summed into
# each row beyond the embedding (sublayer k is the k-th write).
BANK_SCHEDULES = [
    (5, 2, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3], [[0, 1, 2, 3], [4, 5, 6, 7]], [8, 9]),
    (4, 3, [1, 1, 1, 1, 1, 1, 2, 2, 2], [[0, 1, 2, 3, 4, 5]], [6, 7]),
    (3, 1, [1, 1, 2, 2, 3, 3, 3], [[0, 1], [2, 3]], [4, 5]),
    (3, 3, [1, 1, 1, 1, 1, 1, 1], [], [0, 1, 2, 3, 4, 5]),
]


@pytest.mark.parametrize(
    "num_layers, block_size, rows_after_read, summaries, last_prefix",
    BANK_SCHEDULES,
    ids=[schedule_id("block", *case[:2]) for case in BANK_SCHEDULES],
)
@pytest.mark.parametrize("two_phase", [False, True], ids=["one_shot", "two_phase"])
def test_bank_rows_hold_block_sums_written_at_write_layers(
    num_layers, block_size, rows_after_read, summaries, last_prefix, two_phase
):
    toy = ToyStack(num_layers)
    stream = make_stream("block", toy.embedding, num_layers, toy.points, block_size=block_size, two_phase=two_phase)
    rows = []
    _, outputs = toy.drive(stream, after_read=lambda k, s: rows.append(len(s.current.rows)))
    assert rows == rows_after_read
    bank = stream.state().rows
    assert stream.residual.num_bank_rows == len(bank) == 1 + len(summaries)
    assert bank[0] is toy.embedding
    for row, members in zip(bank[1:], summaries):
        assert torch.equal(row, block_sum([outputs[k] for k in members]))  # bit-exact
    assert torch.equal(stream.state().head, block_sum([outputs[k] for k in last_prefix]))


REFERENCE_CASES = [
    # kind, num_layers, block_size, rescale_mixture, use_norm
    ("standard", 4, None, False, True),
    ("full", 4, None, False, True),
    ("full", 3, None, True, False),
    ("block", 5, 1, False, True),
    ("block", 5, 2, False, True),
    ("block", 5, 2, True, True),
    ("block", 5, 2, True, False),
    ("block", 4, 3, False, True),
    ("block", 4, 4, True, True),
    ("block", 3, 7, False, False),
]


@pytest.mark.parametrize(
    "kind, num_layers, block_size, rescale, use_norm",
    REFERENCE_CASES,
    ids=[schedule_id(*c[:3]) + ("-rescale" if c[3] else "") + ("" if c[4] else "-no_norm") for c in REFERENCE_CASES],
)
def test_toy_stack_matches_hand_written_schedule(kind, num_layers, block_size, rescale, use_norm):
    """Random nonzero queries, so a wrong grouping of sources shows (a zero-query test cannot see it)."""
    toy = ToyStack(num_layers)
    stream = make_stream(
        kind, toy.embedding, num_layers, toy.points, block_size=block_size, rescale_mixture=rescale
    )
    reads, _ = toy.drive(stream, use_norm=use_norm)
    ref = reference_reads(toy, kind, block_size, rescale, use_norm)
    assert_all_close([f"read {k}" for k in range(len(ref))], ref, reads, STACK_TOL)


@pytest.mark.parametrize("num_layers, block_size", [(5, 2), (4, 3), (4, 1)], ids=["L5-S2", "L4-S3", "L4-S1"])
def test_two_phase_matches_one_shot_values_and_gradients(num_layers, block_size, monkeypatch):
    """two_phase True (phase 1 wherever a block has several points), False and None (the stream's choice) agree."""
    toy = ToyStack(num_layers)
    phase1_calls = []
    depth_stats = attnres.layers.residuals.depth_stats
    monkeypatch.setattr(
        attnres.layers.residuals, "depth_stats", lambda *a, **k: phase1_calls.append(1) or depth_stats(*a, **k)
    )
    grads_out = [torch.randn(T, D) for _ in range(2 * num_layers + 1)]

    def run(two_phase):
        embedding = toy.embedding.clone().requires_grad_()
        stream = make_stream("block", embedding, num_layers, toy.points, block_size=block_size, two_phase=two_phase)
        phase1_calls.clear()
        reads, _ = toy.drive(stream)
        loss = sum((read * grad).sum() for read, grad in zip(reads, grads_out))
        return bool(phase1_calls), [*reads, *torch.autograd.grad(loss, [embedding, *toy.parameters()])]

    ran_phase1, ref = run(False)
    assert not ran_phase1
    names = [f"read {k}" for k in range(2 * num_layers + 1)] + ["grad embedding"]
    names += [f"grad parameter {j}" for j in range(len(ref) - len(names))]
    for two_phase in (True, None):
        ran_phase1, out = run(two_phase)
        assert ran_phase1 or two_phase is None, "two_phase=True never ran phase 1"
        assert_all_close([f"two_phase={two_phase}: {n}" for n in names], ref, out, STACK_TOL)


@pytest.mark.parametrize("kind, block_size", [("full", None), ("block", 1), ("block", 2), ("block", 5)],
                         ids=["full", "block-S1", "block-S2", "block-S5"])
@pytest.mark.parametrize("two_phase", [False, True], ids=["one_shot", "two_phase"])
def test_zero_queries_with_rescale_equal_the_prenorm_baseline(kind, block_size, two_phase):
    """docs/design.md section 2: a zero-initialised AttnRes stack with rescale_mixture computes the PreNorm stack, eps
    included; small activations (as at common inits) make the eps visible without the rescale."""
    toy = ToyStack(5, zero_queries=True, output_scale=1e-2)
    standard, _ = toy.drive(make_stream("standard", toy.embedding, 5))
    extra = {} if kind == "full" else {"block_size": block_size, "two_phase": two_phase}
    rescaled, _ = toy.drive(make_stream(kind, toy.embedding, 5, toy.points, rescale_mixture=True, **extra))
    for k, (ref, out) in enumerate(zip(standard, rescaled)):
        rms, _ = error_ratios(ref, out)
        assert rms < 1e-5, f"read {k}: relative RMS error {rms:.2e}"
    plain, _ = toy.drive(make_stream(kind, toy.embedding, 5, toy.points, **extra))
    assert error_ratios(standard[-1], plain[-1])[0] > 1e-3, "without the rescale the eps must show"


# --- misuse ---


def test_write_without_read_is_refused():
    stream = make_stream("standard", torch.randn(T, D), 2)
    with pytest.raises(RuntimeError, match=r"^write: each write must follow the read"):
        stream.write(torch.randn(T, D))


@pytest.mark.parametrize("kind", ["standard", "full", "block"])
def test_read_twice_and_read_after_the_final_read_are_refused(kind):
    toy = ToyStack(2)
    stream = make_stream(kind, toy.embedding, 2, toy.points, block_size=1)
    stream.read(toy.norms[0])
    with pytest.raises(RuntimeError, match=r"^read: aggregation point 0 still waits for its sublayer's write"):
        stream.read(toy.norms[1])
    stream.write(torch.randn(T, D))
    for k in range(1, 4):
        stream.write(toy.sublayer(k, stream.read(toy.norms[k])))
    stream.read(toy.norms[4])
    assert stream.is_final is False and stream.point == 5
    with pytest.raises(RuntimeError, match=r"^read: the final read has already been made"):
        stream.read(toy.norms[4])
    with pytest.raises(RuntimeError, match=r"^write: each write must follow the read"):
        stream.write(torch.randn(T, D))


@pytest.mark.parametrize("kind", ["full", "block"])
@pytest.mark.parametrize("num_points", [0, 4, 6])
def test_wrong_number_of_points_is_refused(kind, num_points):
    points = [DepthAttention(D) for _ in range(num_points)]
    with pytest.raises(ValueError, match=r"^points: expected 2 \* num_layers \+ 1 = 5 aggregation points"):
        make_stream(kind, torch.randn(T, D), 2, points, block_size=1)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_missing_points_are_refused(kind):
    with pytest.raises(ValueError, match=r"^points: expected 2 \* num_layers \+ 1 = 5 aggregation points"):
        make_stream(kind, torch.randn(T, D), 2, block_size=1)


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True, None], ids=str)
def test_bad_block_size_is_refused(block_size):
    points = [DepthAttention(D) for _ in range(5)]
    with pytest.raises(ValueError, match=r"^block_size: "):
        make_stream("block", torch.randn(T, D), 2, points, block_size=block_size)


def test_unknown_kind_and_bad_num_layers_are_refused():
    with pytest.raises(ValueError, match=r"^residual: expected one of \('standard', 'full', 'block'\), got 'dense'"):
        make_stream("dense", torch.randn(T, D), 2)
    with pytest.raises(ValueError, match=r"^num_layers: expected at least one decoder layer, got 0"):
        make_stream("standard", torch.randn(T, D), 0)
