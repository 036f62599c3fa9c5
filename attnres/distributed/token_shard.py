"""Token-sharded Block AttnRes prefill: each rank holds the bank rows of its own tokens (DESIGN section 6).

The depth attention never mixes tokens, so the residual stream and its bank `[N, NB, d]` split along the tokens
with no communication: rank r of W keeps positions `[r*T/W, (r+1)*T/W)` of a `[B, T]` prefill, a bank of
`[B*T/W, NB, d]`. Only the token mixer needs every token: around each self-attention the normed input is
all-gathered along the sequence, attention runs with the full causal mask and rotary positions, and each rank
keeps the output rows of its tokens. The MLP, the aggregation points, the final norm and the head stay local.

The model runs unchanged: its forward gets the rank's embeddings and positions, and forward hooks on each
`self_attn` do the gather and the slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from attnres.distributed.data_parallel import collective
from attnres.models.sublayers import causal_attention_mask, rotary_cos_sin


@dataclass(frozen=True)
class TokenShard:
    """The sequence positions `[start, stop)` that `rank` of `world_size` holds, of `seq_len`."""

    rank: int
    world_size: int
    seq_len: int

    @property
    def start(self) -> int:
        return self.rank * self.seq_len // self.world_size

    @property
    def stop(self) -> int:
        return (self.rank + 1) * self.seq_len // self.world_size

    def owner(self, position: int) -> int:
        """The rank whose shard holds `position` (in `[0, seq_len)`)."""
        return next(r for r in range(self.world_size) if position < (r + 1) * self.seq_len // self.world_size)


@dataclass
class ShardedBank:
    """This rank's bank after a sharded prefill: `bank` `[B*(stop-start), NB, d]`, of which `written` rows are valid."""

    bank: torch.Tensor
    written: int
    shard: TokenShard
    batch: int

    def read(self, positions: range) -> torch.Tensor:
        """The written bank rows of sequence positions `positions`, `[B, len(positions), written, d]`.

        Refuses (ValueError) positions this rank does not hold: their rows were written by another rank, into its
        own bank, and are not here. A step other than 1 or an empty range is refused too.
        """
        shard = self.shard
        if not isinstance(positions, range) or positions.step != 1 or not positions:
            raise ValueError(f"positions: expected a non-empty range with step 1, got {positions!r}")
        foreign = [p for p in (positions.start, positions[-1]) if not shard.start <= p < shard.stop]
        if foreign:
            p = foreign[0]
            writer = f"rank {shard.owner(p)}" if 0 <= p < shard.seq_len else "no rank"
            raise ValueError(
                f"positions: rank {shard.rank} holds the bank rows of positions {shard.start}..{shard.stop - 1}; "
                f"position {p} was written by {writer}"
            )
        rows = self.bank[:, : self.written].unflatten(0, (self.batch, shard.stop - shard.start))
        return rows[:, positions.start - shard.start : positions.stop - shard.start]


@torch.no_grad()
def token_sharded_prefill(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, ShardedBank | None]:
    """Prefill `input_ids` `[B, T]` (the same on every rank) with the tokens sharded over the process group.

    Returns this rank's logits `[B, T_r, vocab]` (positions `shard.start..shard.stop-1`) and, for the Block
    residual, its `ShardedBank` (None otherwise). Every rank must call it. T must be at least the world size.
    """
    if not dist.is_initialized():
        raise ValueError("token_sharded_prefill: expected an initialized process group (torchrun, init_process_group)")
    config = model.config
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, seq = input_ids.shape
    if seq < world:
        raise ValueError(f"input_ids: expected at least {world} positions (one a rank), got {seq}")
    shard = TokenShard(rank, world, seq)
    inner = model.model
    device = input_ids.device
    position_ids = torch.arange(seq, device=device)[None]
    embeds = inner.embed_tokens(input_ids)
    cos, sin = (t.to(embeds.dtype) for t in rotary_cos_sin(position_ids, config.head_dim, config.rope_theta))
    mask = causal_attention_mask(None, 0, seq, config.sliding_window, device)
    bounds = [TokenShard(r, world, seq) for r in range(world)]

    widest = max(s.stop - s.start for s in bounds)

    def gather_tokens(module, args):
        x, _, _, _, cache = args
        padded = x.new_zeros(batch, widest, x.shape[-1])  # gloo gathers equal shapes only
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in bounds]
        collective(lambda: dist.all_gather(parts, padded), "gathering the attention input")
        return torch.cat([p[:, : s.stop - s.start] for p, s in zip(parts, bounds)], dim=1), cos, sin, mask, cache

    def keep_local(module, args, output):
        return output[:, shard.start : shard.stop]

    streams = []
    hooks = [inner.layers[-1].register_forward_pre_hook(lambda module, args: streams.append(args[0]))]
    for layer in inner.layers:
        hooks += [layer.self_attn.register_forward_pre_hook(gather_tokens),
                  layer.self_attn.register_forward_hook(keep_local)]
    try:
        mine = slice(shard.start, shard.stop)
        logits = model(inputs_embeds=embeds[:, mine], position_ids=position_ids[:, mine], use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    stream = streams[0]
    bank = ShardedBank(stream.bank, stream.nvb, shard, batch) if hasattr(stream, "bank") else None
    return logits, bank
