"""Continued training: a run that starts from a pretrained causal LM instead of a random init.

`config.init_from` names a local transformers folder (any PreNorm family `attnres.models.convert` supports, or an
attnres run's `final/`) or, with `allow_download`, a Hub name. Its weights become the run's model, converted exactly to
the run's residual (`convert_from_hf`: zero pseudo-queries, unit key gains, the rescaled mixture), so the run's first
evaluation is the folder's own validation loss. The tokenizer is the folder's; a run's byte-level tokenizer is used as
`ByteTokenizer`, so a byte-level run continues on the token stream it was trained on.

A folder that already holds Full or Block AttnRes continues with its own residual and block size only: its
pseudo-queries were trained for that schedule (`attnres.models.loading.check_bank_layout` refuses others).
"""

from __future__ import annotations

import torch
from torch import nn

from attnres.layers.kinds import STANDARD
from attnres.models.loading import saved_config, saved_residual
from attnres.tokenization import is_byte_tokenizer
from attnres.training.config import TrainConfig
from attnres.training.data import ByteTokenizer, HFTokenizer
from attnres.training.optim import is_attn_res_param


def load_init_from(config: TrainConfig) -> tuple[nn.Module, ByteTokenizer | HFTokenizer]:
    """The run's model (fp32, on the CPU, the base frozen if `config.freeze_base`) and the folder's tokenizer."""
    source, local = str(config.init_from), not config.allow_download
    saved = saved_config(source, {"local_files_only": local})
    if saved is None:
        hint = "" if not local else " (only local files are searched; pass allow_download / --allow-download)"
        raise ValueError(f"init_from: {source!r} is not a transformers model folder with a config.json{hint}")
    tokenizer = _folder_tokenizer(source, local)
    model = _converted_model(source, saved, config, local)
    rows = model.get_input_embeddings().num_embeddings
    if rows < tokenizer.vocab_size:
        raise ValueError(
            f"init_from: {source} embeds {rows} token ids but its tokenizer has {tokenizer.vocab_size}; the model and "
            f"the tokenizer of the folder do not belong together"
        )
    if config.activation_checkpointing:
        model.activation_checkpointing_enable()
    if config.freeze_base:
        freeze_base(model)
    return model, tokenizer


def freeze_base(model: nn.Module) -> None:
    """Train the AttnRes parameters only: every other parameter stops requiring a gradient (the optimizer skips it)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_attn_res_param(name))


def _folder_tokenizer(source: str, local: bool) -> ByteTokenizer | HFTokenizer:
    try:
        tokenizer = HFTokenizer(source, local_files_only=local)
    except ValueError as e:
        raise ValueError(f"init_from: {source} holds no tokenizer the run could use: {e}") from e
    return ByteTokenizer() if is_byte_tokenizer(tokenizer.tokenizer) else tokenizer


def _converted_model(source: str, saved: dict, config: TrainConfig, local: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from attnres.models import AttnResForCausalLM, convert_from_hf

    load = dict(local_files_only=local, dtype=torch.float32)
    if saved.get("model_type") != "attnres":  # a family's own folder: converted as `attnres convert` does
        original = AutoModelForCausalLM.from_pretrained(source, **load)
        return convert_from_hf(original, residual=config.residual, attn_res_block_size=config.block_size).train()
    # an AttnRes folder: its layers are the family's, rewired; a standard one starts any residual from zero queries
    # with the rescaled mixture (the conversion's start), an AttnRes one keeps its schedule (refused otherwise)
    start = {"attn_res_rescale_mixture": True} if saved_residual(saved) == STANDARD else {}
    model = AttnResForCausalLM.from_pretrained(
        source, residual=config.residual, attn_res_block_size=config.block_size, **start, **load
    )
    return model.train()
