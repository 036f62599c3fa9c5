"""Bytes each pipeline hop sends per microbatch: the formulas of `attnres.distributed.pipeline` against a real step.

    python -m benchmarks.pipeline_bytes            # from the repository root; prints a markdown table

Every configuration runs one `PipelineTrainer.step` on gloo ranks of this machine (P ranks, V virtual stages:
1F1B for V = 1, interleaved 1F1B for V = 2) and counts the tensors each chunk hands its PipelineStage to send.
Model: L = 16 decoder layers, d = 64, T = 32, batch 4 in 4 microbatches (b = 1), fp32, so one row is
b * T * d * 4 = 8 KiB. Block N counts blocks (N = L / S, S the block size in decoder layers). The last column sums
the rows over all hops against the paper's eq. 7 (no caching) or eq. 8 (caching), where blocks fill chunks evenly;
`attnres.distributed.pipeline` explains the difference (the embedding row, and eq. 8's rounding).
"""

from __future__ import annotations

import torch

from attnres.distributed.pipeline import PipelinePlan, PipelineTrainer, hop_bytes, paper_rows
from attnres.layers.kinds import BLOCK, FULL, STANDARD
from tests.distributed.workers import run_ranks

LAYERS, DIM, SEQ, BATCH, MICROBATCHES, VOCAB = 16, 64, 32, 4, 4, 64
RESIDUALS = [(BLOCK, 8), (BLOCK, 4), (BLOCK, 2), (FULL, None), (STANDARD, None)]  # (residual, N blocks)


def configs(ranks: int) -> list[tuple[str, int | None, int, bool]]:
    """(residual, N, virtual stages, cache_rows) for one world size; caching only matters with virtual stages."""
    return [(residual, blocks, v, cache) for residual, blocks in RESIDUALS for v in (1, 2)
            for cache in ((True,) if v == 1 or residual == STANDARD else (False, True))]


def measure(rank: int, ranks: int) -> dict:
    from attnres.models import AttnResConfig, AttnResForCausalLM

    out = {}
    for residual, blocks, v, cache in configs(ranks):
        torch.manual_seed(0)
        config = AttnResConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                               residual=residual, attn_res_block_size=LAYERS // blocks if blocks else 1)
        trainer = PipelineTrainer(AttnResForCausalLM(config), schedule="1f1b" if v == 1 else "interleaved",
                                  microbatches=MICROBATCHES, virtual_stages=v, cache_rows=cache)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        trainer.step(ids, ids)
        out[(residual, blocks, v, cache)] = trainer.traffic.per_hop()
    return out


def table() -> str:
    lines = [
        "| P | V | residual | cache | rows per hop (formula) | rows per hop (measured) | peak KiB (formula / measured) "
        "| KiB per microbatch, all hops (formula / measured) | rows, all hops (measured / paper eq. 7 or 8) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ranks in (2, 4):
        results = run_ranks(measure, ranks, ranks, timeout_s=120.0, join_s=600.0)
        failed = {r: v for r, (status, v) in results.items() if status != "ok"}
        if failed:
            raise RuntimeError(f"{ranks} ranks: {failed}")
        for key in configs(ranks):
            residual, blocks, v, cache = key
            plan = PipelinePlan(residual, LAYERS, ranks, v, LAYERS // blocks if blocks else 1, cache)
            hops = {}
            for r in range(ranks):
                hops.update(results[r][1][key])
            rows = [hops[c][0] for c in sorted(hops)]
            sent = [hops[c][1] for c in sorted(hops)]
            want = hop_bytes(plan, BATCH // MICROBATCHES, SEQ, DIM, 4)
            formula_rows = [plan.sent_rows(c) for c in range(plan.num_stages - 1)]
            name = f"block N={blocks}" if blocks else residual
            cached = cache and v > 1 and residual != STANDARD
            paper = "-"
            if blocks and blocks % (ranks * v) == 0:  # the paper's equations count whole blocks a chunk
                paper = paper_rows(ranks, v, blocks // (ranks * v))[cached]
            lines.append(
                f"| {ranks} | {v} | {name} | {'yes' if cached else 'no'} "
                f"| {' '.join(map(str, formula_rows))} | {' '.join(map(str, rows))} "
                f"| {max(want) / 1024:g} / {max(sent) / 1024:g} | {sum(want) / 1024:g} / {sum(sent) / 1024:g} "
                f"| {sum(rows)} / {paper} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
