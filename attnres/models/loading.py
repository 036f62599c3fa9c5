"""Strict checks on loading an AttnRes checkpoint, where transformers' `from_pretrained` would only warn.

- Every weight of the family's own must be in the checkpoint; a missing one is an error that names it.
- The AttnRes weights (the pseudo-queries `*_res_proj.weight` and key gains `*_res_norm.weight`, Kimi K3 names) must
  match the model: any missing, unexpected or mis-shaped one is an error that names it. One exception: a checkpoint
  that holds none of them and whose config does not claim any (a PreNorm checkpoint) may start an AttnRes model;
  its AttnRes weights keep their init (zero queries, unit gains).
- The bank layout: an AttnRes checkpoint's queries were trained for one schedule, which its config.json records as
  `residual` and, for "block", `attn_res_block_size` (decoder layers per block: which sources each query saw). Loading
  with another residual kind or block size (an override such as `from_pretrained(path, attn_res_block_size=4)`, or a
  `config=`) would silently compute another function, so it is refused. The tensor shapes cannot tell: every point's
  query is `[1, d]` whatever the grouping.
"""

from __future__ import annotations

import os

from transformers import PreTrainedConfig

from attnres.layers.kinds import BLOCK, FULL, STANDARD

ATTNRES_SUFFIXES = ("_res_proj.weight", "_res_norm.weight")
# arguments of from_pretrained that say where the checkpoint's config.json is
_LOCATION_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def is_attnres_key(name: str) -> bool:
    return name.endswith(ATTNRES_SUFFIXES)


def saved_config(path: str | os.PathLike, from_pretrained_kwargs: dict) -> dict | None:
    """The checkpoint's config.json as a plain dict (None when it has none)."""
    location = {k: from_pretrained_kwargs[k] for k in _LOCATION_KWARGS if k in from_pretrained_kwargs}
    try:
        return PreTrainedConfig.get_config_dict(path, **location)[0]
    except OSError:
        return None


def saved_residual(saved: dict | None) -> str | None:
    """The residual kind a checkpoint's config records: "standard" for a non-AttnRes model, None if unknown."""
    if saved is None:
        return None
    return saved.get("residual", STANDARD) if saved.get("model_type") == "attnres" else STANDARD


def check_bank_layout(path, saved: dict | None, config) -> None:
    """Refuse a residual kind or block size other than the one the checkpoint's AttnRes weights were trained for."""
    residual = saved_residual(saved)
    if residual not in (FULL, BLOCK):
        return  # a PreNorm checkpoint (or no config.json): any schedule may start from it
    if config.residual != residual:
        raise ValueError(
            f"residual: the checkpoint {path} was trained with residual={residual!r}, whose pseudo-queries do not "
            f"fit residual={config.residual!r}; load it without overriding residual (or convert the PreNorm original)"
        )
    trained = saved.get("attn_res_block_size")
    if residual == BLOCK and trained != config.attn_res_block_size:
        raise ValueError(
            f"attn_res_block_size: the checkpoint {path} holds a Block AttnRes bank layout of {trained} decoder layers "
            f"per block; its pseudo-queries were trained for that grouping, so block size "
            f"{config.attn_res_block_size} is refused (load it without overriding attn_res_block_size)"
        )


def check_loaded_weights(path, saved: dict | None, info: dict, model_keys, ignore_mismatched_sizes: bool) -> None:
    """Raise a ValueError naming every weight that is missing, every AttnRes weight that is unexpected and every
    mis-shaped AttnRes weight (any mis-shaped weight unless `ignore_mismatched_sizes`). `info` is transformers'
    loading info (tied weights are not missing there), `model_keys` the model's names."""
    missing_ours = {k for k in info["missing_keys"] if is_attnres_key(k)}
    unexpected = sorted(k for k in info["unexpected_keys"] if is_attnres_key(k))
    ours = {k for k in model_keys if is_attnres_key(k)}
    holds_none = not unexpected and missing_ours == ours
    if holds_none and saved_residual(saved) in (STANDARD, None):
        # a PreNorm checkpoint starting an AttnRes model: the AttnRes weights keep their init
        missing_ours = set()
    # a family weight left out would start at a random init, which transformers only reports
    missing = sorted(missing_ours | {k for k in info["missing_keys"] if not is_attnres_key(k)})
    problems = [f"missing {missing}"] if missing else []
    problems += [f"unexpected {unexpected}"] if unexpected else []
    mismatched = [
        f"{key} (checkpoint {list(saved_shape)}, model {list(model_shape)})"
        for key, saved_shape, model_shape in sorted(info["mismatched_keys"])
        if is_attnres_key(key) or not ignore_mismatched_sizes
    ]
    problems += [f"mis-shaped {mismatched}"] if mismatched else []
    if problems:
        raise ValueError(f"checkpoint: {path} does not match the model: " + "; ".join(problems))
