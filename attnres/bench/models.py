"""Model-level cases: a training step, a prefill and a decode step of Block and Full AttnRes against the standard
model of the same size, all three built with the same standard weights."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from attnres.bench.config import SuiteConfig
from attnres.layers.depth_attention import RMSNorm
from attnres.layers.kinds import BLOCK, FULL, RESIDUAL_KINDS, STANDARD
from attnres.models import AttnResConfig, AttnResForCausalLM
from attnres.ops import depth_attention
from attnres.training.optim import fused_adamw

KINDS = (STANDARD, BLOCK, FULL)  # the order the benchmarks report them in


def add_model_args(parser) -> None:
    """The model-shape flags the benchmark scripts share (d=512, 8 layers, 8 heads, vocabulary 32000 by default)."""
    parser.add_argument("--dim", type=int, default=512, help="hidden size d (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: %(default)s)")


def build_models(
    *, dim: int, layers: int, heads: int, vocab: int, block_size: int, max_tokens: int, seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, AttnResForCausalLM]:
    """The standard model and the AttnRes `kinds` (in that order), sharing every standard weight; the AttnRes
    pseudo-queries are random (not the zero init) so the depth softmax is not uniform."""
    if kinds[:1] != (STANDARD,) or set(kinds) - set(RESIDUAL_KINDS):
        raise ValueError(f"kinds: expected {STANDARD!r} first, then some of {KINDS[1:]}, got {kinds}")
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
        models[kind].load_state_dict(models[STANDARD].state_dict(), strict=False)
        with torch.no_grad():
            for name, p in models[kind].named_parameters():
                if name.endswith("_res_proj.weight"):
                    p.normal_(0.0, 0.3)
    return models


def build_small_models(
    *, dim: int = SuiteConfig.small_dim, layers: int = SuiteConfig.small_layers,
    tokens: int = SuiteConfig.small_tokens, seed: int = 0, kinds: tuple[str, ...] = KINDS, family_norms: bool = False,
) -> dict[str, AttnResForCausalLM]:
    """`attnres compare`'s model (vocabulary 256, 4 heads, block size 2; by default d = 96, 6 layers, 128 tokens) as
    `build_models` makes it, every plain norm the fastest there is (`fast_norms`) unless `family_norms`."""
    built = build_models(dim=dim, layers=layers, heads=4, vocab=256, block_size=2, max_tokens=tokens, seed=seed,
                         kinds=kinds)
    if not family_norms:
        for model in built.values():
            fast_norms(model)
    return built


def _fast_rms_norm(module: nn.Module, eps: float, x: torch.Tensor) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps)`: with autograd the fused depth-attention kernel over x alone (its weight is
    exactly 1, so it is the fused PreNorm of a plain norm, with the hand-written backward), else torch's `rms_norm`."""
    weight = module.weight
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.rms_norm(x, weight.shape, weight, eps)
    zeros = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
    return depth_attention([x], zeros, None, eps=eps, out_norm_weight=weight, out_eps=eps)


class FastRMSNorm(RMSNorm):
    """attnres's plain RMSNorm computed as `fast_norms` computes the family's (for the stream benchmark)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fast_rms_norm(self, self.eps, x)


def fast_norms(model: nn.Module, classes: set[type] | None = None) -> int:
    """Give every plain RMSNorm of `model` (the family class the AttnRes wiring fuses into its aggregation) the fastest
    plain norm there is: the fused kernel when training (torch's own rms_norm backward is decomposed into elementwise
    ops on CPU, about 4x slower at d=512), torch's fused `rms_norm` without autograd. Set as each module's forward on
    the instance, so its class, and with it the fusion of the AttnRes PreNorms, stays. The standard baseline then has
    fused norms as AttnRes does (with the unfused Python norm, ratios below 1 would be partly the baseline's).
    `classes`: the norm classes to replace (default: those the AttnRes model's layer plan fuses; for a model of the
    family itself, its RMSNorm class). Returns the number of norms replaced.

    A model that transformers loaded with its hub kernels on (`use_kernels`, the default of `from_pretrained`) would
    set its layers' forwards anew at its next `train()` or `eval()`, dropping these; its hub kernels are turned off
    first (on a machine without them each falls back to the family's own forward)."""
    if getattr(model, "use_kernels", False):
        model.use_kernels = False
    if classes is None:
        model.plan_layers()
        classes = {
            type(getattr(layer, side.norm)) for layer in model.model.layers for side in layer.sides
            if side.fused_eps is not None
        }
    count = 0
    for module in model.modules():
        if type(module) in classes:
            eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps")
            module.forward = partial(_fast_rms_norm, module, eps)
            count += 1
    return count


def training_step(model: AttnResForCausalLM, ids: torch.Tensor) -> Callable[[], None]:
    """One optimiser step (forward with loss, backward, AdamW) on the batch `ids` `[batch, T]`, with the optimizer
    `attnres train` and transformers' Trainer use (torch's fused AdamW)."""
    model.train()
    opt = fused_adamw(model.parameters(), lr=1e-4)

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
