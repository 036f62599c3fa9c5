"""Model-level cases: a training step, a prefill and a decode step of Block and Full AttnRes against the standard
model of the same size, all three built with the same standard weights."""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnres.models import AttnResConfig, AttnResForCausalLM

KINDS = ("standard", "block", "full")


def build_models(
    *, dim: int, layers: int, heads: int, vocab: int, block_size: int, max_tokens: int, seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, AttnResForCausalLM]:
    """The standard model and the AttnRes `kinds` (in that order), sharing every standard weight; the AttnRes
    pseudo-queries are random (not the zero init) so the depth softmax is not uniform."""
    if kinds[:1] != ("standard",) or set(kinds) - set(KINDS):
        raise ValueError(f"kinds: expected 'standard' first, then some of {KINDS[1:]}, got {kinds}")
    fields = dict(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=-(-8 * dim // 3 // 32) * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_tokens,
    )
    torch.manual_seed(seed)
    configs = {kind: AttnResConfig(**fields, residual=kind, attn_res_block_size=block_size) for kind in kinds}
    models = {kind: AttnResForCausalLM(config) for kind, config in configs.items()}
    for kind in kinds[1:]:
        models[kind].load_state_dict(models["standard"].state_dict(), strict=False)
        with torch.no_grad():
            for name, p in models[kind].named_parameters():
                if name.endswith("_res_proj.weight"):
                    p.normal_(0.0, 0.3)
    return models


def training_step(model: AttnResForCausalLM, ids: torch.Tensor) -> Callable[[], None]:
    """One optimiser step (forward with loss, backward, AdamW) on the batch `ids` `[batch, T]`."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()

    return step


def prefill(model: AttnResForCausalLM, ids: torch.Tensor) -> Callable[[], None]:
    """One forward over the prompt `ids` `[1, T]` without autograd, logits of the last position only."""
    model.eval()
    return torch.no_grad()(lambda: model(ids, use_cache=False, logits_to_keep=1))


def decode_step(model: AttnResForCausalLM, context: torch.Tensor, tokens: torch.Tensor) -> Callable[[], None]:
    """One decode step of `tokens` `[batch, 1]` after a KV cache of `context` `[batch, C]`; the cache is cropped
    back after each step so every step sees the same context."""
    model.eval()
    with torch.no_grad():
        cache = model(context, use_cache=True).cache

    @torch.no_grad()
    def step() -> None:
        model(tokens, cache=cache, logits_to_keep=1)
        cache.crop(-tokens.shape[1])

    return step
