"""The whole suite in one process: copy bandwidth first, then the operator cases per dtype, then the model cases."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from attnres.bench import models
from attnres.bench.cases import CaseResult, CompiledPeer, bank_case, operator_cases, stream_cases
from attnres.bench.config import SuiteConfig
from attnres.bench.timing import copy_bandwidth, flush_subnormals, round_times


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
            if case.rounds is not None:
                row["round_ratio"] = case.round_ratios()
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
        results.append(CaseResult.from_rounds(f"train step {size} T={cfg.model_tokens} batch={cfg.batch}", "standard",
                                              round_times(steps, cfg.repeats, cfg.warmup)))
    if "prefill" in cfg.groups:
        ids = torch.randint(0, cfg.vocab, (1, cfg.model_tokens), generator=gen)
        fns = {kind: models.prefill(m, ids) for kind, m in built.items()}
        results.append(CaseResult.from_rounds(f"prefill {size} T={cfg.model_tokens}", "standard",
                                              round_times(fns, cfg.repeats, cfg.warmup)))
    if "decode" in cfg.groups:
        context = torch.randint(0, cfg.vocab, (1, cfg.context), generator=gen)
        tokens = torch.randint(0, cfg.vocab, (1, 1), generator=gen)
        fns = {kind: models.decode_step(m, context, tokens) for kind, m in built.items()}
        results.append(CaseResult.from_rounds(f"decode {size} context={cfg.context}", "standard",
                                              round_times(fns, cfg.decode_repeats, max(cfg.warmup, 2))))
    return results


def small_model_case(cfg: SuiteConfig) -> CaseResult:
    """Training steps of `attnres compare`'s model (vocabulary 256, 4 heads, block size 2) where per-point overheads
    weigh most: Block and Full against standard, round-robin; tokens/s is batch * tokens over the step time."""
    built = models.build_small_models(dim=cfg.small_dim, layers=cfg.small_layers, tokens=cfg.small_tokens,
                                      seed=cfg.seed, family_norms=cfg.family_norms)
    ids = torch.randint(0, 256, (cfg.small_batch, cfg.small_tokens), generator=torch.Generator().manual_seed(cfg.seed))
    steps = {kind: models.training_step(m, ids) for kind, m in built.items()}
    name = f"small train step d={cfg.small_dim} L={cfg.small_layers} {cfg.small_batch}x{cfg.small_tokens}"
    return CaseResult.from_rounds(name, "standard", round_times(steps, cfg.small_repeats, max(cfg.warmup, 2)))


def run_suite(cfg: SuiteConfig, log=print) -> SuiteResult:
    """Measure the copy bandwidth, then every case of `cfg.groups`; `log` gets one line per case as it finishes.
    Subnormal floats are flushed to zero for the rest of the process unless `cfg.keep_subnormals`."""
    subnormals = flush_subnormals(cfg.keep_subnormals)
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
            spread = case.round_ratios()
            if spread is not None:
                log("    per round, time / reference's: " + ", ".join(
                    f"{k} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" for k, r in spread.items()
                    if k != case.reference))

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
    notes.append(f"subnormal floats: {subnormals}")
    machine = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": platform.processor() or platform.machine()}
    return SuiteResult(cfg, bandwidth, cases, notes, machine)


__all__ = ["SuiteResult", "run_suite"]
