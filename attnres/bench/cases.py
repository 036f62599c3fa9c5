"""Operator-level cases: each case times one piece of work by several implementations side by side.

Every case names a reference (the plain residual `torch.sum` over the same stacked sources, or for model cases the
standard model); ratios are times over the reference's. Bytes follow docs/design.md section 9: the aggregation is
memory-bound and its floor is one read of its sources, so a forward over R sources `[T, d]` of e bytes moves
(R + 1) * T * d * e bytes (R reads, one write) and a backward (2R + 1) * T * d * e (sources and output gradient
read, one gradient per source written).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnres.bench.config import DTYPES, SuiteConfig
from attnres.bench.models import FastRMSNorm
from attnres.bench.timing import median_times
from attnres.layers import DepthAttention, make_stream
from attnres.ops import depth_attention
from attnres.ops.registry import backend_name
from attnres.ops.bank import bank_aggregate
from attnres.ops.naive import naive_bank_aggregate, naive_depth_attention

EPS = 1e-6
SUM = "torch.sum"
TWIN = "twin"
PEER = "fla naive_attnres (compiled)"


@dataclass
class CaseResult:
    """Median seconds of each implementation of one case; `nbytes` is the bytes model (None: not memory-bound);
    `rounds`, when kept, each implementation's seconds round by round (`timing.round_times`)."""

    name: str
    reference: str
    seconds: dict[str, float]
    nbytes: int | None = None
    notes: list[str] = field(default_factory=list)
    rounds: dict[str, list[float]] | None = None

    @classmethod
    def from_rounds(cls, name: str, reference: str, rounds: dict[str, list[float]]) -> CaseResult:
        return cls(name, reference, {impl: statistics.median(t) for impl, t in rounds.items()}, rounds=rounds)

    def ratios(self) -> dict[str, float]:
        return {impl: s / self.seconds[self.reference] for impl, s in self.seconds.items()}

    def round_ratios(self) -> dict[str, dict[str, float]] | None:
        """Per implementation, the least, median and largest of its time over the reference's within a round: the
        calls of a round run back to back, so a change of the machine's load between rounds leaves these alone."""
        if self.rounds is None:
            return None
        ref = self.rounds[self.reference]
        spread = {}
        for impl, times in self.rounds.items():
            per_round = [t / r for t, r in zip(times, ref)]
            spread[impl] = {"min": min(per_round), "median": statistics.median(per_round), "max": max(per_round)}
        return spread


class CompiledPeer:
    """flash-linear-attention's `naive_attnres` under `torch.compile`, the strongest portable peer.

    Compilation happens at the first call of each new shape or grad mode; `ready` makes that call and returns None
    (with a note, and no further attempts) when it fails or takes longer than `timeout` seconds.
    """

    def __init__(self, enabled: bool, timeout: float, notes: list[str]):
        self.timeout, self.notes, self.fn = timeout, notes, None
        if not enabled:
            notes.append("compiled peer skipped: --no-compile")
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fla warns that Triton has no CPU target
                from fla.ops.attnres import naive_attnres
        except ImportError as err:
            notes.append(f"compiled peer skipped: flash-linear-attention not importable ({err})")
            return
        self.fn = torch.compile(naive_attnres, dynamic=False)

    def ready(self, call: Callable[[], object], case: str) -> Callable[[], object] | None:
        if self.fn is None:
            return None
        start = time.perf_counter()
        try:
            call()
        except Exception as err:  # noqa: BLE001 - any compiler failure means: no peer row, say why
            self.notes.append(f"compiled peer skipped from {case} on: compile failed ({type(err).__name__}: {err})")
            self.fn = None
            return None
        took = time.perf_counter() - start
        if took > self.timeout:
            self.notes.append(
                f"compiled peer skipped from {case} on: compiling took {took:.0f} s "
                f"(> --compile-timeout {self.timeout:g})"
            )
            self.fn = None
            return None
        return call


def _with_backend(name: str, x: torch.Tensor) -> str:
    """`name[backend]`, the backend that serves tensors like `x`."""
    return f"{name}[{backend_name(x)}]"


def _timed(
    case: str, impls: dict[str, Callable[[], object]], peer_call: Callable[[], object], peer: CompiledPeer,
    cfg: SuiteConfig,
) -> dict[str, float]:
    """Median seconds of `impls`, and of the compiled peer when it compiles in time."""
    call = peer.ready(peer_call, case)
    if call is not None:
        impls[PEER] = call
    return median_times(impls, cfg.repeats, cfg.warmup)


def operator_cases(cfg: SuiteConfig, dtype_name: str, peer: CompiledPeer) -> list[CaseResult]:
    """`depth_attention` forward and forward+backward against its twin, `torch.sum` and the compiled peer."""
    R, T, d, dtype = cfg.sources, cfg.tokens, cfg.dim, DTYPES[dtype_name]
    e = torch.finfo(dtype).bits // 8
    stacked = torch.randn(R, T, d).to(dtype).requires_grad_()  # torch.sum's input
    sources = [x.detach().clone().requires_grad_() for x in stacked.unbind(0)]  # the operators': R tensors
    query = (torch.randn(d) / d**0.5).to(dtype).requires_grad_()
    gain = torch.ones(d, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(T, d).to(dtype)
    leaves = [stacked, *sources, query, gain]
    forwards = {
        SUM: lambda: stacked.sum(0),
        TWIN: lambda: naive_depth_attention(sources, query, gain, eps=EPS),
        "attnres": lambda: depth_attention(sources, query, gain, eps=EPS),
    }
    peer_forward = lambda: peer.fn(query, sources, gain, rms_eps=EPS)  # noqa: E731 - peer.fn is read at call time

    def backward(fwd: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            fwd().backward(grad_out)
            for t in leaves:
                t.grad = None

        return run

    fwd_bytes = (R + 1) * T * d * e
    shape = f"R={R} T={T} d={d} {dtype_name}"
    results = []
    with torch.no_grad():
        impls = dict(forwards)
        impls[_with_backend("attnres", sources[0])] = impls.pop("attnres")
        name = f"operator fwd {shape}"
        results.append(CaseResult(name, SUM, _timed(name, impls, peer_forward, peer, cfg), fwd_bytes))
    impls = {impl: backward(fwd) for impl, fwd in forwards.items()}
    impls[_with_backend("attnres", sources[0])] = impls.pop("attnres")
    name = f"operator fwd+bwd {shape}"
    both_bytes = fwd_bytes + (2 * R + 1) * T * d * e
    results.append(CaseResult(name, SUM, _timed(name, impls, backward(peer_forward), peer, cfg), both_bytes))
    return results


def stream_cases(cfg: SuiteConfig, dtype_name: str) -> list[CaseResult]:
    """The residual path exactly as the models run it, with trivial sublayers (`v = x / 2`) so that it dominates:
    `make_stream` over `stream_layers` decoder layers, the standard residual against Block one-shot and Block
    two-phase (forced on: phase 1 over the completed summaries, then `merge_prefix` per point), a training forward +
    backward and an inference forward (no autograd: the fused bank path, `bank_merge` in phase 2). Every read fuses a
    plain RMSNorm; the standard stream's norm is the fastest plain one (`models.fast_norms`' forward)."""
    L, S, T, d, dtype = cfg.stream_layers, cfg.stream_block_size, cfg.model_tokens, cfg.model_dim, DTYPES[dtype_name]
    embedding = torch.randn(T, d).to(dtype).requires_grad_()
    points = [DepthAttention(d).to(dtype) for _ in range(2 * L + 1)]
    with torch.no_grad():
        for point in points:
            point.proj.weight.normal_(0.0, 0.3)
    norm = FastRMSNorm(d, EPS).to(dtype)
    grad_out = torch.randn(T, d).to(dtype)
    leaves = [embedding, norm.weight, *(p for point in points for p in point.parameters())]

    def forward(kind: str, two_phase: bool | None, inference: bool) -> torch.Tensor:
        stream = make_stream(kind, embedding, L, points, block_size=S, two_phase=two_phase, inference=inference)
        for _ in range(2 * L):
            stream.write(stream.read(norm) * 0.5)
        return stream.read(norm)

    def train(kind: str, two_phase: bool | None) -> Callable[[], None]:
        def run() -> None:
            forward(kind, two_phase, inference=False).backward(grad_out)
            for t in leaves:
                t.grad = None

        return run

    def infer(kind: str, two_phase: bool | None) -> Callable[[], torch.Tensor]:
        return torch.no_grad()(lambda: forward(kind, two_phase, inference=True))

    variants = {"standard": ("standard", None), "block one-shot": ("block", False), "block two-phase": ("block", True)}
    shape = f"L={L} block={S} T={T} d={d} {dtype_name}"
    return [
        CaseResult(f"residual stream fwd+bwd {shape}", "standard",
                   median_times({k: train(*v) for k, v in variants.items()}, cfg.repeats, cfg.warmup)),
        CaseResult(f"residual stream inference {shape}", "standard",
                   median_times({k: infer(*v) for k, v in variants.items()}, cfg.repeats, cfg.warmup)),
    ]


def bank_case(cfg: SuiteConfig, dtype_name: str, peer: CompiledPeer) -> CaseResult:
    """The fused inference aggregation (docs/design.md section 5) over R - 1 bank rows and the prefix, with the pending
    add and the sublayer PreNorm: `bank_aggregate` against its twin, `torch.sum` over R stacked sources and the
    compiled peer (mix and norm, without the add). Bytes: bank rows, prefix and output read, prefix and the
    normed mixture written, (R + 3) * T * d * e."""
    R, T, d, dtype = cfg.sources, cfg.tokens, cfg.dim, DTYPES[dtype_name]
    e = torch.finfo(dtype).bits // 8
    bank = torch.randn(T, R, d).to(dtype)  # one spare row: bank_aggregate may write row nvb
    prefix, output = torch.randn(T, d).to(dtype), (0.01 * torch.randn(T, d)).to(dtype)
    stacked = torch.randn(R, T, d).to(dtype)
    query, key_gain = torch.randn(d) / d**0.5, torch.ones(d, dtype=dtype)
    norm = torch.ones(d, dtype=dtype)
    nvb = R - 1

    def aggregate(fn) -> Callable[[], torch.Tensor]:
        return lambda: fn(bank, nvb, prefix, output, query, key_gain, norm, EPS, EPS, False)

    impls = {
        SUM: lambda: stacked.sum(0),
        TWIN: aggregate(naive_bank_aggregate),
        _with_backend("bank_aggregate", bank): aggregate(bank_aggregate),
    }
    rows = [bank[:, j] for j in range(nvb)]
    peer_call = lambda: peer.fn(query, [*rows, prefix], key_gain, norm, rms_eps=EPS)  # noqa: E731
    name = f"fused inference aggregation nvb={nvb} T={T} d={d} {dtype_name}"
    with torch.no_grad():
        seconds = _timed(name, impls, peer_call, peer, cfg)
    return CaseResult(name, SUM, seconds, (R + 3) * T * d * e)
