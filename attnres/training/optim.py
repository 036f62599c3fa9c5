"""AdamW with three parameter groups and the learning-rate schedule (warm-up, then cosine or WSD decay).

Groups:
- `attn_res`: the pseudo-queries and key gains (Kimi K3 names `*_res_proj.*`, `*_res_norm.*`). Their own
  learning-rate multiplier and weight decay: at the matrices' rate the depth softmax saturates within a few
  hundred steps and AttnRes loses; at a tenth of it AttnRes wins (docs/design.md section 10).
- `no_decay`: norms, biases (every parameter with fewer than 2 dims) and embedding tables.
- `decay`: everything else (the weight matrices, and an untied output head).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

ATTN_RES_NAME_PARTS = ("_res_proj.", "_res_norm.")
SCHEDULES = ("cosine", "wsd")


def is_attn_res_param(name: str) -> bool:
    """True for an AttnRes pseudo-query or key gain, by its Kimi K3 parameter name."""
    return any(part in name for part in ATTN_RES_NAME_PARTS)


def param_groups(
    model: nn.Module, *, lr: float, weight_decay: float, attn_res_lr_mult: float, attn_res_weight_decay: float
) -> list[dict]:
    """AdamW groups `decay`, `no_decay`, `attn_res` (empty ones dropped); each carries `name` and `base_lr`."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    groups = {
        "decay": {"params": [], "weight_decay": weight_decay, "base_lr": lr},
        "no_decay": {"params": [], "weight_decay": 0.0, "base_lr": lr},
        "attn_res": {"params": [], "weight_decay": attn_res_weight_decay, "base_lr": lr * attn_res_lr_mult},
    }
    for name, p in model.named_parameters():  # tied parameters appear once
        if not p.requires_grad:
            continue
        if is_attn_res_param(name):
            kind = "attn_res"
        elif p.dim() < 2 or id(p) in embedding_params:
            kind = "no_decay"
        else:
            kind = "decay"
        groups[kind]["params"].append(p)
    return [{"name": kind, "lr": g["base_lr"], **g} for kind, g in groups.items() if g["params"]]


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, attn_res_lr_mult: float,
                    attn_res_weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over `param_groups`, torch's fused kernel wherever it runs (`fused_adamw`)."""
    groups = param_groups(
        model, lr=lr, weight_decay=weight_decay, attn_res_lr_mult=attn_res_lr_mult,
        attn_res_weight_decay=attn_res_weight_decay,
    )
    return fused_adamw(groups, lr=lr, betas=betas)


def fused_adamw(params, **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, **kwargs)` with its fused kernel when every parameter is a floating-point tensor on a
    device that has it (CPU included), as transformers' Trainer defaults to (`adamw_torch_fused`); else the default
    implementation, which on CPU loops over the parameters in Python (docs/benchmarks.md measures the difference)."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    supported = _get_fused_kernels_supported_devices()
    fused = all(p.is_floating_point() and p.device.type in supported for p in tensors)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def lr_factor(step: int, *, steps: int, warmup: int, schedule: str, min_lr_ratio: float, decay_fraction: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based) of a run of `steps` steps.

    Linear warm-up over the first `warmup` steps, then
    - `cosine`: half a cosine from 1 down to `min_lr_ratio` at the last step;
    - `wsd` (warm-up, stable, decay): 1 until the last `decay_fraction` of the steps, then linear to `min_lr_ratio`.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, steps - 1 - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if schedule == "wsd":
        decay_start = wsd_decay_start(steps=steps, warmup=warmup, decay_fraction=decay_fraction)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, steps - 1 - decay_start)
        return 1.0 - (1 - min_lr_ratio) * min(progress, 1.0)
    raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")


def wsd_decay_start(*, steps: int, warmup: int, decay_fraction: float) -> int:
    """The first step of a WSD run's decay: every step before it (after the warm-up) runs at the peak lr."""
    return max(warmup, steps - max(1, round(decay_fraction * steps)))


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Set every group's lr to its `base_lr * factor`; return the lr of the first group (for the logs)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    return optimizer.param_groups[0]["lr"]
