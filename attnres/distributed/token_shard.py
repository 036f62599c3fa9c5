"""Token-sharded Block AttnRes prefill: each rank holds the bank rows of its own tokens (DESIGN section 6).

The depth attention never mixes tokens, so the residual stream and its bank `[N, NB, d]` split along the tokens
with no communication: rank r of W keeps positions `[r*T/W, (r+1)*T/W)` of a `[B, T]` prefill, a bank of
`[B*T/W, NB, d]`. Only the token mixer needs every token: around each self-attention the normed input is
all-gathered along the sequence (with its rotary embeddings), attention runs causally over every token, and each
rank keeps the output rows of its tokens. The MLP, the aggregation points, the final norm and the head stay local.

The model runs unchanged: its forward gets the rank's embeddings and positions, and forward hooks on each decoder
layer's attention (`self_attn`) do the gather and the slice. Families with sliding-window layers are refused (the
gathered attention is plainly causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from attnres.distributed.data_parallel import collective


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
    window = getattr(config, "sliding_window", None)
    if window is not None and window < seq and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(f"model: sliding-window layers (window {window} < {seq} tokens) are not supported here")
    position_ids = torch.arange(seq, device=input_ids.device)[None]
    embeds = inner.embed_tokens(input_ids)
    bounds = [TokenShard(r, world, seq) for r in range(world)]
    widest = max(s.stop - s.start for s in bounds)

    def gather(x: torch.Tensor) -> torch.Tensor:
        """`x` `[b, T_r, ...]` of every rank, concatenated along the sequence."""
        padded = x.new_zeros(x.shape[0], widest, *x.shape[2:])  # gloo gathers equal shapes only
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in bounds]
        collective(lambda: dist.all_gather(parts, padded), "gathering the attention input")
        return torch.cat([p[:, : s.stop - s.start] for p, s in zip(parts, bounds)], dim=1)

    def gather_tokens(module, args, kwargs):
        x = gather(kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0])
        rotary = kwargs.get("position_embeddings")
        if rotary is not None:
            kwargs["position_embeddings"] = tuple(gather(t.expand(x.shape[0], *t.shape[1:])) for t in rotary)
        kwargs.update(attention_mask=None, position_ids=position_ids)  # causal over every token
        return (), {**kwargs, "hidden_states": x}

    def keep_local(module, args, output):
        return (output[0][:, shard.start : shard.stop], *output[1:])

    hooks = []
    for layer in inner.layers:
        hooks += [layer.self_attn.register_forward_pre_hook(gather_tokens, with_kwargs=True),
                  layer.self_attn.register_forward_hook(keep_local)]
    state = model.forward_state()
    try:
        mine = slice(shard.start, shard.stop)
        out = model(inputs_embeds=embeds[:, mine], position_ids=position_ids[:, mine], use_cache=False, attn_res=state)
    finally:
        for hook in hooks:
            hook.remove()
    stream = state.stream
    bank = ShardedBank(stream.bank, stream.nvb, shard, batch) if hasattr(stream, "bank") else None
    return out.logits, bank
