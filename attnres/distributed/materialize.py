"""A model built on the meta device, made real on each rank: only what the rank holds is allocated, and it is
initialized with the family's own init, module by module.

Parallelizing first (tensor parallel, FSDP2, pipeline stages that delete the others' layers) and allocating after
is torchtitan's order: no rank ever holds the whole model. Each module is initialized whole, on its own (one module's
parameters at a time, the largest transient), by the `_init_weights` of the transformers model it belongs to (what
`initialize_weights` would dispatch to it), from a seed of the module's name; each rank then keeps its part of every
parameter. So every mesh, and one process, start from the same weights.

What is already real is kept: a model whose family weights were loaded from a folder (`load_local_shards`) gets only
the rest made (its AttnRes parameters at their init, its non-persistent buffers such as rotary frequencies).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from attnres.layers.depth_attention import KeyNorm, PseudoQuery


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> nn.Module:
    """Allocate on `device` what of `model` is on the meta device (what this rank holds of it) and initialize it; see
    the module docstring. A parameter that no init writes raises a ValueError naming it. Returns `model`."""
    tied = tied_groups(model)
    made, modules_with_buffers = _allocate(model, device)  # gives each slot of a tied parameter its own tensor
    for names in tied:
        tie(model, names, model.get_parameter(names[0]))
    done: set[int] = set()  # a tied parameter is initialized once, by the first module that holds it
    with torch.no_grad(), init.guard_torch_init_functions():
        for name, module, owner in _modules_and_owners(model):
            params = {n: p for n, p in module._parameters.items() if p is not None}
            todo = {n: p for n, p in params.items() if id(p) in made and id(p) not in done}
            if not todo and module not in modules_with_buffers:
                continue
            # every slot gets a stand-in, so that the init of a slot whose parameter is done (tied, or loaded) writes
            # nowhere
            whole = {n: nn.Parameter(torch.full(p.shape, torch.nan, dtype=p.dtype, device=device),
                                     requires_grad=False) for n, p in params.items()}
            held = dict(module._parameters)
            module._parameters.update(whole)
            try:
                torch.manual_seed(_seed_of(seed, name))
                owner._init_weights(module)  # buffers too (rotary frequencies), in place
                if isinstance(module, PseudoQuery):
                    module.weight.zero_()
                elif isinstance(module, KeyNorm):
                    module.weight.fill_(1.0)
            finally:
                module._parameters.update(held)
            for n, p in todo.items():
                if whole[n].isnan().any():
                    raise ValueError(f"model: no init writes {name}.{n} ({type(module).__name__}); it cannot be "
                                     f"built on the meta device")
                _copy_into(p, whole[n])
                done.add(id(p))
    return model


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one (a tied embedding and head), in module order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie(model: nn.Module, names: list[str], param: nn.Parameter) -> None:
    """Make every slot in `names` (one of `tied_groups`) hold `param`."""
    for name in names:
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = param


def _allocate(model: nn.Module, device: torch.device | str) -> tuple[dict[int, nn.Parameter], set[nn.Module]]:
    """Give each meta parameter and buffer of `model` an uninitialized tensor on `device` (a DTensor keeps its layout:
    its local part is allocated), as `to_empty` does, keeping what is real. Returns the new parameters by id (held, so
    that no id is reused while they are looked up) and the modules that got new buffers."""
    made, modules_with_buffers = {}, set()
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                module._parameters[name] = new
                made[id(new)] = new
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
                modules_with_buffers.add(module)
    return made, modules_with_buffers


def _copy_into(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Write `whole` (the full tensor) into `param`: all of it, or this rank's part of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        part = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(whole)


def _modules_and_owners(model: nn.Module):
    """(name, module, the transformers model whose `_init_weights` initializes it): the nearest `PreTrainedModel`
    among the module and its parents, as `initialize_weights` dispatches."""

    def walk(prefix: str, module: nn.Module, owner: nn.Module):
        owner = module if isinstance(module, PreTrainedModel) else owner
        yield prefix, module, owner
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child, owner)

    yield from walk("", model, model)


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62
