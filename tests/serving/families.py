"""Tiny converted AttnRes folders of the families served through vLLM, and their transformers references."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import attnres
from tests.models import off_init_

VOCAB = 128
# head_dim 64: vLLM's CPU attention refuses smaller heads; 3 layers in blocks of 2: a bank row written mid-forward
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.2,  # decisive logits: greedy tokens are no near-ties
    bos_token_id=None,
    eos_token_id=None,  # greedy generation runs its full length
    pad_token_id=None,
)
BLOCK_SIZE = 2
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=64),  # shorter than the prompts
}
ONE_PLUS_WEIGHT_NORMS = ("gemma2",)
RESIDUALS = ("block", "full")


def original(family: str, **overrides) -> torch.nn.Module:
    """The family's own tiny model, its norm gains off their init (a misplaced weight then shows)."""
    torch.manual_seed(sum(map(ord, family)))
    config = CONFIG_MAPPING[family](**{**BASE, **FAMILIES.get(family, {}), **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    gain = 0.0 if family in ONE_PLUS_WEIGHT_NORMS else 1.0
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(gain + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def save_converted(family: str, residual: str, folder: Path, **overrides) -> torch.nn.Module:
    """Convert the family's tiny model, move its pseudo-queries and key gains off their init, save it to `folder`."""
    model = attnres.convert_from_hf(original(family, **overrides), residual=residual, attn_res_block_size=BLOCK_SIZE)
    off_init_(model, seed=len(family))
    model.save_pretrained(folder)
    return model


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generation of `prompt` alone, in fp32: the reference tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t127", split at spaces), so that a server speaks text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
