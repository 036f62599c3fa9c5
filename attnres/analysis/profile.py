"""Run a batch through an AttnRes (or standard) model and measure what happens along depth.

Aggregation points are indexed in schedule order: 2*i is the read before the attention of decoder layer i,
2*i + 1 the read before its MLP, 2L the final read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class DepthProfile:
    """What one batch shows of a model along depth (tensors on the CPU, fp32).

    weights: per aggregation point, the depth weights averaged over tokens, `[R_k]` (empty for "standard").
    mixture_rms: `[2L + 1]` RMS of the pre-norm input each point hands its sublayer (the residual stream's
        magnitude for "standard", the mixture's for AttnRes).
    output_rms: `[2L]` RMS of each sublayer's output.
    grad_norms: `[2L]` gradient norm of each sublayer's parameters for the language-model loss of the batch.
    """

    residual: str
    weights: list[torch.Tensor]
    mixture_rms: torch.Tensor
    output_rms: torch.Tensor
    grad_norms: torch.Tensor


def _rms(x: torch.Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


def _sublayers(model: nn.Module) -> list[nn.Module]:
    """The 2L sublayers in schedule order (attention then MLP of each decoder layer), each as the module whose output
    the family adds to its residual: the body, or its last post-sublayer norm."""
    model.plan_layers()
    return [
        getattr(layer, side.post[-1][0] if side.post else side.body) for layer in model.model.layers for side in layer.sides
    ]


@torch.no_grad()
def _forward_record(model: nn.Module, input_ids: torch.Tensor):
    outputs: list[float] = []

    def hook(_module, _inputs, out):
        outputs.append(_rms(out[0] if isinstance(out, tuple) else out))

    handles = [m.register_forward_hook(hook) for m in _sublayers(model)]
    try:
        out = model(input_ids=input_ids, output_depth_weights=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out, torch.tensor(outputs)


def layer_grad_norms(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`[2L]` gradient norms of each sublayer's parameters for the LM loss on `input_ids` (leaves `.grad` alone)."""
    params = [[p for p in m.parameters() if p.requires_grad] for m in _sublayers(model)]
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    flat = [p for group in params for p in group]
    grads = iter(torch.autograd.grad(loss, flat, allow_unused=True))
    norms = []
    for group in params:
        g = [next(grads) for _ in group]
        norms.append(torch.sqrt(sum((x.float().pow(2).sum() for x in g if x is not None), torch.tensor(0.0))).item())
    return torch.tensor(norms)


def depth_profile(model: nn.Module, input_ids: torch.Tensor) -> DepthProfile:
    """Depth weights, magnitudes and gradient norms of `model` on one batch `input_ids` `[B, T]`."""
    was_training = model.training
    model.eval()
    try:
        out, output_rms = _forward_record(model, input_ids)
        grad_norms = layer_grad_norms(model, input_ids)
    finally:
        model.train(was_training)
    weights = [w.float().reshape(w.shape[0], -1).mean(-1).cpu() for w in out.depth_weights or []]
    mixture_rms = torch.tensor([_rms(m) for m in out.depth_mixtures])
    return DepthProfile(model.config.residual, weights, mixture_rms, output_rms, grad_norms)


def depth_weight_matrix(weights: list[torch.Tensor]) -> torch.Tensor:
    """`[points, max R]` matrix of mean depth weights, NaN where a point has fewer sources (for heatmaps)."""
    width = max(w.numel() for w in weights)
    mat = torch.full((len(weights), width), float("nan"))
    for k, w in enumerate(weights):
        mat[k, : w.numel()] = w
    return mat
