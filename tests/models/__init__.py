"""Shared by the model tests."""

import torch

# A tiny decoder of any family: grouped-query attention (4 query heads share 2 key/value heads)
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def off_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """Queries away from zero and key gains away from one (a zero query hides its key gain, and a wrong copy)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("_res_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
