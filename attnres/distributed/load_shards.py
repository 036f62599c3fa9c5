"""A pretrained folder's weights loaded into a model built on the meta device and already parallelized: each rank reads
only what it holds.

The loading is transformers' own (`convert_and_load_state_dict_in_model`, what `from_pretrained` runs): the family's
key conversions apply as there (legacy renames such as Mixtral's `block_sparse_moe`, per-expert MoE weights fused into
3-D experts), and a parameter that is a DTensor (tensor parallel, FSDP2) is read as this rank's shard only: the folder's
safetensors are memory-mapped as lazy slices, each rank reads the rows and columns its placements give it (copied
into memory of its own), and skips the experts another rank holds. A pipeline stage reads only the weights of the
layers it kept. What the folder does not hold (AttnRes parameters, non-persistent buffers) stays on the meta device
for `materialize`.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch
from torch import nn

from attnres.progress import transformers_progress

# the weight files of a transformers folder, in the order `from_pretrained` prefers them: (index, single file)
_WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                 ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def weight_files(source: str | os.PathLike, local_files_only: bool) -> list[str]:
    """The paths of the weight files of the transformers folder or Hub name `source` (downloaded when allowed)."""
    from transformers.utils.hub import cached_file, get_checkpoint_shard_files

    found = lambda name: cached_file(source, name, local_files_only=local_files_only,  # noqa: E731
                                     _raise_exceptions_for_missing_entries=False)
    for index_name, file_name in _WEIGHT_FILES:
        index = found(index_name)
        if index is not None:
            return get_checkpoint_shard_files(source, index, local_files_only=local_files_only)[0]
        single = found(file_name)
        if single is not None:
            return [single]
    names = ", ".join(name for pair in _WEIGHT_FILES for name in pair)
    raise ValueError(f"init_from: {source} holds no weights transformers can read (expected one of {names})")


def load_local_shards(model: nn.Module, files: list[str], device: torch.device | str,
                      key_mapping: dict[str, str] | None = None, progress: bool = True) -> dict[str, set]:
    """Load into `model` (meta, whole or parallelized) what this rank holds of the weights in `files` (see the module
    docstring); `key_mapping`: extra regex renames of checkpoint keys, as `from_pretrained(key_mapping=...)`.

    Each loaded parameter keeps its slot's `requires_grad`, and tied slots (an embedding and head stored once) share
    the loaded parameter. Returns transformers' loading report: "missing_keys" (names of the model the files did
    not fill, the meta ones), "unexpected_keys" (keys of the files the model does not hold: a pipeline stage's others),
    "mismatched_keys" ((name, file shape, model shape)) and "conversion_errors" ({name: message}). `progress`:
    transformers' "Loading weights" bar (off on all ranks but the main one)."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig, load_state_dict

    from attnres.distributed.materialize import tie, tied_groups

    tied = tied_groups(model)
    trains = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    config = LoadStateDictConfig(device_map={"": device},  # the model's dtype: no cast beyond its own
                                 weight_mapping=get_model_conversion_mapping(model, key_mapping=key_mapping))
    with ExitStack() as opened:
        tensors = {}
        for path in files:
            if path.endswith(".safetensors"):  # lazy slices of the memory-mapped file: a rank reads its part
                f = opened.enter_context(safe_open(path, framework="pt"))
                tensors.update({key: f.get_slice(key) for key in f.keys()})
            else:  # a .bin: `torch.load(weights_only=True)`, memory-mapped
                tensors.update(load_state_dict(path))
        with transformers_progress(progress):
            info, _ = convert_and_load_state_dict_in_model(model, tensors, config)
        _own_memory(model)
    for names in tied:  # a tied weight is stored under one of its names: every slot takes the loaded parameter
        loaded = next((model.get_parameter(n) for n in names if not model.get_parameter(n).is_meta), None)
        if loaded is None:
            continue
        tie(model, names, loaded)
        info.missing_keys.difference_update(names)
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(trains[name])
    return {"missing_keys": set(info.missing_keys), "unexpected_keys": set(info.unexpected_keys),
            "mismatched_keys": set(info.mismatched_keys), "conversion_errors": dict(info.conversion_errors)}


def _own_memory(model: nn.Module) -> None:
    """Copy each real parameter and buffer of `model` (what the loading filled) into memory of its own: read from a
    memory-mapped file, a tensor is a view of the file's pages, which a file rewritten while the run trains would
    change. (safetensors' `pread` reads each whole tensor to slice it: a rank would hold whole tensors.)"""
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and not param.is_meta:  # a DTensor's clone copies its local part
                    module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = buffer.clone()
