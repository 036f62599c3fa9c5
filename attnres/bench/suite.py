"""The whole suite in one process: copy bandwidth first, then the operator cases per dtype, then the model cases."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from attnres.bench import models
from attnres.bench.cases import DTYPES, CaseResult, CompiledPeer, bank_case, operator_cases, stream_cases
from attnres.bench.timing import copy_bandwidth, median_times

GROUPS = ("operator", "two-phase", "bank", "train", "prefill", "decode", "small")


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of every case. Defaults: the operator at R = 9, T = 4096, d = 2048, a model with
    d = 512, 8 decoder layers, T = 1024, the residual streams of 32 layers at the model's T and d, and the
    small model of `attnres compare`. `family_norms` keeps the family's Python RMSNorm in the
    models instead of the fastest plain norm (`models.fast_norms`)."""

    sources: int = 9  # R
    tokens: int = 4096  # T of the operator cases
    dim: int = 2048
    stream_layers: int = 32  # decoder layers of the two-phase (residual stream) case
    stream_block_size: int = 4  # its Block block size, in decoder layers
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    model_dim: int = 512
    model_layers: int = 8
    model_heads: int = 8
    model_tokens: int = 1024  # T of the training step and the prefill
    vocab: int = 32000
    block_size: int = 2  # decoder layers per block of the Block model
    batch: int = 1  # sequences of the training step
    context: int = 512  # cached tokens before a decode step
    repeats: int = 5
    decode_repeats: int = 30
    warmup: int = 1
    copy_mib: int = 256
    small_dim: int = 96  # the small model: `attnres compare`'s size
    small_layers: int = 6
    small_batch: int = 16
    small_tokens: int = 128
    small_repeats: int = 15
    family_norms: bool = False
    compile: bool = True
    compile_timeout: float = 120.0
    groups: tuple[str, ...] = GROUPS
    seed: int = 0

    def __post_init__(self):
        for name in ("sources", "tokens", "dim", "stream_layers", "stream_block_size", "model_dim", "model_layers",
                     "model_heads", "model_tokens", "vocab", "block_size", "batch", "context", "repeats",
                     "decode_repeats", "copy_mib", "small_dim", "small_layers", "small_batch", "small_tokens",
                     "small_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.sources < 2:
            raise ValueError(f"sources: expected at least 2 (summaries and a prefix), got {self.sources}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected a non-negative integer, got {self.warmup}")
        if self.model_dim % self.model_heads:
            raise ValueError(f"model_heads: must divide model_dim {self.model_dim}, got {self.model_heads}")
        if not self.dtypes or set(self.dtypes) - set(DTYPES):
            raise ValueError(f"dtypes: expected a non-empty subset of {sorted(DTYPES)}, got {self.dtypes}")
        if not self.groups or set(self.groups) - set(GROUPS):
            raise ValueError(f"groups: expected a non-empty subset of {GROUPS}, got {self.groups}")

    @classmethod
    def quick(cls, **overrides) -> SuiteConfig:
        """Tiny sizes: every case runs in seconds (a smoke run, not a measurement)."""
        tiny = dict(sources=4, tokens=64, dim=64, stream_layers=4, stream_block_size=2, model_dim=64, model_layers=2,
                    model_heads=2, model_tokens=32, vocab=128, context=16, repeats=2, decode_repeats=3, copy_mib=4,
                    small_dim=32, small_layers=2, small_batch=2, small_tokens=16, small_repeats=2)
        return cls(**{**tiny, **overrides})


@dataclass
class SuiteResult:
    config: SuiteConfig
    copy_bytes_per_s: float
    cases: list[CaseResult]
    notes: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain JSON-able dict: per case the median ms, ratios to the reference, GB/s and fraction of copy."""
        cases = []
        for case in self.cases:
            row = {"name": case.name, "reference": case.reference, "ms": {k: s * 1e3 for k, s in case.seconds.items()},
                   "ratio": case.ratios(), "bytes": case.nbytes}
            if case.nbytes is not None:
                gbps = {k: case.nbytes / s / 1e9 for k, s in case.seconds.items()}
                row["GB/s"] = gbps
                row["of_copy"] = {k: g * 1e9 / self.copy_bytes_per_s for k, g in gbps.items()}
            cases.append(row)
        return {"machine": self.machine, "config": asdict(self.config), "copy_GB/s": self.copy_bytes_per_s / 1e9,
                "notes": self.notes, "cases": cases}


def model_cases(cfg: SuiteConfig) -> list[CaseResult]:
    """Training step, prefill and decode step of Block and Full against the standard model, timed alternately."""
    built = models.build_models(dim=cfg.model_dim, layers=cfg.model_layers, heads=cfg.model_heads, vocab=cfg.vocab,
                                block_size=cfg.block_size, max_tokens=max(cfg.model_tokens, cfg.context + 1),
                                seed=cfg.seed)
    if not cfg.family_norms:
        for model in built.values():
            models.fast_norms(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    size = f"d={cfg.model_dim} L={cfg.model_layers}"
    results = []
    if "train" in cfg.groups:
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.model_tokens), generator=gen)
        steps = {kind: models.training_step(m, ids) for kind, m in built.items()}
        results.append(CaseResult(f"train step {size} T={cfg.model_tokens} batch={cfg.batch}", "standard",
                                  median_times(steps, cfg.repeats, cfg.warmup)))
    if "prefill" in cfg.groups:
        ids = torch.randint(0, cfg.vocab, (1, cfg.model_tokens), generator=gen)
        fns = {kind: models.prefill(m, ids) for kind, m in built.items()}
        results.append(CaseResult(f"prefill {size} T={cfg.model_tokens}", "standard",
                                  median_times(fns, cfg.repeats, cfg.warmup)))
    if "decode" in cfg.groups:
        context = torch.randint(0, cfg.vocab, (1, cfg.context), generator=gen)
        tokens = torch.randint(0, cfg.vocab, (1, 1), generator=gen)
        fns = {kind: models.decode_step(m, context, tokens) for kind, m in built.items()}
        results.append(CaseResult(f"decode {size} context={cfg.context}", "standard",
                                  median_times(fns, cfg.decode_repeats, max(cfg.warmup, 2))))
    return results


def small_model_case(cfg: SuiteConfig) -> CaseResult:
    """Training steps of `attnres compare`'s model (vocabulary 256, 4 heads, block size 2) where per-point overheads
    weigh most: Block and Full against standard, round-robin; tokens/s is batch * tokens over the step time."""
    built = models.build_models(dim=cfg.small_dim, layers=cfg.small_layers, heads=4, vocab=256, block_size=2,
                                max_tokens=cfg.small_tokens, seed=cfg.seed)
    if not cfg.family_norms:
        for model in built.values():
            models.fast_norms(model)
    ids = torch.randint(0, 256, (cfg.small_batch, cfg.small_tokens), generator=torch.Generator().manual_seed(cfg.seed))
    steps = {kind: models.training_step(m, ids) for kind, m in built.items()}
    name = f"small train step d={cfg.small_dim} L={cfg.small_layers} {cfg.small_batch}x{cfg.small_tokens}"
    return CaseResult(name, "standard", median_times(steps, cfg.small_repeats, max(cfg.warmup, 2)))


def run_suite(cfg: SuiteConfig, log=print) -> SuiteResult:
    """Measure the copy bandwidth, then every case of `cfg.groups`; `log` gets one line per case as it finishes."""
    torch.manual_seed(cfg.seed)
    notes: list[str] = []
    bandwidth = copy_bandwidth(cfg.copy_mib * 2**20, repeats=max(cfg.repeats, 3))
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write of {cfg.copy_mib} MiB)")
    peer = CompiledPeer(cfg.compile, cfg.compile_timeout, notes)
    cases: list[CaseResult] = []

    def add(new: list[CaseResult]) -> None:
        for case in new:
            cases.append(case)
            log(f"  {case.name}: " + ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in case.seconds.items()))

    for dtype in cfg.dtypes:
        if "operator" in cfg.groups:
            add(operator_cases(cfg, dtype, peer))
        if "two-phase" in cfg.groups:
            add(stream_cases(cfg, dtype))
        if "bank" in cfg.groups:
            add([bank_case(cfg, dtype, peer)])
    if set(cfg.groups) & {"train", "prefill", "decode"}:
        add(model_cases(cfg))
    if "small" in cfg.groups:
        add([small_model_case(cfg)])
    notes.append("models: the family's Python RMSNorm" if cfg.family_norms else
                 "models: every plain RMSNorm the fastest available (attnres.bench.models.fast_norms)")
    machine = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": platform.processor() or platform.machine()}
    return SuiteResult(cfg, bandwidth, cases, notes, machine)


__all__ = ["GROUPS", "SuiteConfig", "SuiteResult", "run_suite"]
