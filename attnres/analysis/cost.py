"""Memory and traffic of the residual path (docs/design.md section 9), to choose the number of blocks before training.

Symbols: T tokens of one forward, L sublayers (2 per decoder layer), N blocks, S = L / N sublayers per block,
d hidden size, e bytes per element, P ranks sharing the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class ResidualCost:
    """Bytes of the Block AttnRes bank and residual-path traffic per token per sublayer, in units of d elements."""

    bank_bytes: int  # T * N * d * e, one forward
    bank_bytes_per_rank: int  # tokens sharded over P ranks: N * ceil(T / P) * d * e
    bank_bytes_per_chunk: int  # chunked prefill: N * chunk * d * e
    traffic_standard: float  # 3d: read h and v, write h
    traffic_block_two_phase: float  # (N / S + 5) d
    traffic_full_two_phase: float  # (S + N) d


def residual_cost(
    tokens: int, num_layers: int, block_size: int, hidden_size: int, dtype: str = "bf16", ranks: int = 1, chunk: int | None = None
) -> ResidualCost:
    """Cost of a model of `num_layers` decoder layers with Block AttnRes of `block_size` decoder layers."""
    for name, value in (("tokens", tokens), ("num_layers", num_layers), ("block_size", block_size),
                        ("hidden_size", hidden_size), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    chunk = tokens if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive number of tokens, got {chunk!r}")
    e = DTYPE_BYTES[dtype]
    n_blocks = -(-num_layers // block_size)
    per_block = 2 * block_size
    row = hidden_size * e
    return ResidualCost(
        bank_bytes=tokens * n_blocks * row,
        bank_bytes_per_rank=-(-tokens // ranks) * n_blocks * row,
        bank_bytes_per_chunk=min(chunk, tokens) * n_blocks * row,
        traffic_standard=3.0,
        traffic_block_two_phase=n_blocks / per_block + 5.0,
        traffic_full_two_phase=float(per_block + n_blocks),
    )


def tp_layer_bytes(rows: int, tokens: int, hidden_size: int, element_size: int, tp: int) -> float:
    """Bytes one rank hands to the tensor + sequence parallel collectives of one decoder layer in a training step
    (forward and backward), for `rows` sequences of `tokens` over `tp` ranks: per sublayer, forward, an all-gather of
    its normed input (this rank's tokens, rows * T / P * d) and a reduce-scatter of its output (the whole sequence,
    rows * T * d); backward, the same two in reverse. So 4 * rows * T * d * e * (1 + 1 / P) a layer."""
    return 4 * rows * tokens * hidden_size * element_size * (1 + 1 / tp)


def hop_bytes_per_microbatch(residual: str, num_layers: int, pp: int, virtual_stages: int, block_size: int,
                             micro_batch: int, tokens: int, hidden_size: int, element_size: int) -> list[int]:
    """Bytes each pipeline hop sends per microbatch (`attnres.distributed.pipeline.hop_bytes`): the residual state
    after the stage, less the rows the receiver kept (cross-stage caching)."""
    from attnres.distributed.pipeline import PipelinePlan, hop_bytes

    plan = PipelinePlan(residual, num_layers, pp, virtual_stages, block_size)
    return hop_bytes(plan, micro_batch, tokens, hidden_size, element_size)
