"""`SuiteConfig`: the sizes of every case of the benchmark suite, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GROUPS = ("operator", "two-phase", "bank", "train", "prefill", "decode", "small")


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of every case. Defaults: the operator at R = 9, T = 4096, d = 2048, a model with
    d = 512, 8 decoder layers, T = 1024, the residual streams of 32 layers at the model's T and d, and the
    small model of `attnres compare`. `family_norms` keeps the family's Python RMSNorm in the
    models instead of the fastest plain norm (`models.fast_norms`); `keep_subnormals` keeps subnormal floats
    instead of flushing them to zero (`timing.flush_subnormals`)."""

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
    keep_subnormals: bool = False
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
