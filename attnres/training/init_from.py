"""Continued training: a run that starts from a pretrained causal LM instead of a random init.

`config.init_from` names a local transformers folder (any PreNorm family `attnres.models.convert` supports, or an
attnres run's `final/`) or, with `allow_download`, a Hub name. Its weights become the run's model, converted exactly to
the run's residual (what `convert_from_hf` gives: zero pseudo-queries, unit key gains, the rescaled mixture), so the
run's first evaluation is the folder's own validation loss. The tokenizer is the folder's; a run's byte-level tokenizer
is used as `ByteTokenizer`, so a byte-level run continues on the token stream it was trained on.

The model is built on the meta device from the folder's config, like a fresh run's; once the run has parallelized it
(tensor parallel, FSDP2, pipeline stages), `Pretrained.load` makes it real: each rank reads only what it holds of the
folder's weights, through transformers' own loading and key conversions (`attnres.distributed.load_shards`), and the
AttnRes parameters start at their init. No rank ever holds the whole model; one process loads it once.

A folder that already holds Full or Block AttnRes continues with its own residual and block size only: its
pseudo-queries were trained for that schedule (`attnres.models.loading.check_bank_layout` refuses others).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnres.layers.kinds import STANDARD
from attnres.models.loading import check_bank_layout, check_loaded_weights, saved_config, saved_residual
from attnres.tokenization import is_byte_tokenizer
from attnres.training.config import TrainConfig
from attnres.training.data import ByteTokenizer, HFTokenizer
from attnres.training.optim import is_attn_res_param


@dataclass(frozen=True)
class Pretrained:
    """The folder a run starts from: `load` fills a model built by `load_init_from` (whole or parallelized)."""

    source: str
    saved: dict  # its config.json
    files: tuple[str, ...]  # its weight files
    names: frozenset[str]  # the whole model's weight names (a pipeline stage holds some of them)

    def load(self, model: nn.Module, device: torch.device | str, seed: int, progress: bool = True) -> None:
        """Make `model` real on `device`: this rank's part of the folder's weights, the AttnRes parameters at their
        init. A weight the folder lacks, a mis-shaped one, or AttnRes weights that do not fit raise a ValueError.
        `progress`: transformers' loading bar."""
        from attnres.distributed.load_shards import load_local_shards
        from attnres.distributed.materialize import materialize
        from attnres.models.modeling_attnres import MLP_RES_REPAIR

        report = load_local_shards(model, list(self.files), device, key_mapping=MLP_RES_REPAIR, progress=progress)
        if report["conversion_errors"]:
            raise ValueError(f"init_from: {self.source}: transformers could not convert {report['conversion_errors']}")
        report["unexpected_keys"] -= self.names  # the weights of the layers other pipeline stages hold
        check_loaded_weights(self.source, self.saved, report, model.state_dict().keys(), ignore_mismatched_sizes=False)
        materialize(model, device, seed)


def load_init_from(config: TrainConfig) -> tuple[nn.Module, ByteTokenizer | HFTokenizer, Pretrained]:
    """The run's model on the meta device (the base frozen if `config.freeze_base`), the folder's tokenizer, and the
    folder, whose `load` makes the model real once it is parallelized."""
    from attnres.distributed.load_shards import weight_files

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
    pretrained = Pretrained(source, saved, tuple(weight_files(source, local)), frozenset(model.state_dict()))
    return model, tokenizer, pretrained


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
    """The AttnRes model of the folder's config on the meta device, as `convert_from_hf` (a family's folder) or
    `AttnResForCausalLM.from_pretrained` (an AttnRes folder) would build it, in fp32."""
    from transformers import AutoConfig, GenerationConfig

    from attnres.models import AttnResConfig, AttnResForCausalLM
    from attnres.models.convert import attnres_config_from_hf

    if saved.get("model_type") != "attnres":  # a family's own folder: converted as `attnres convert` does
        family = AutoConfig.from_pretrained(source, local_files_only=local, dtype=torch.float32)
        model_config = attnres_config_from_hf(family, config.residual, config.block_size)
    else:  # its layers are the family's, rewired; a standard one starts any residual from zero queries with the
        # rescaled mixture (the conversion's start), an AttnRes one keeps its schedule (refused otherwise)
        start = {"attn_res_rescale_mixture": True} if saved_residual(saved) == STANDARD else {}
        model_config = AttnResConfig.from_pretrained(
            source, residual=config.residual, attn_res_block_size=config.block_size, local_files_only=local,
            dtype=torch.float32, **start,
        )
        check_bank_layout(source, saved, model_config)
    with torch.device("meta"):
        model = AttnResForCausalLM(model_config)
    model.plan_layers()  # a no-op for a config that keeps its plan; else read from a small real twin
    try:  # the folder's generation settings, as `from_pretrained` keeps them
        model.generation_config = GenerationConfig.from_pretrained(source, local_files_only=local)
    except OSError:
        pass
    return model.train()
