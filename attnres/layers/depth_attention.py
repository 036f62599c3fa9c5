"""One AttnRes aggregation point as a module, and the RMSNorm whose weight an aggregation point can fuse."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attnres.ops import depth_attention
from attnres.ops.chain import depth_attention_chained

_PLAIN = (torch.Tensor, nn.Parameter)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as the plain tensor our ops take. Under tensor parallel it is a Replicate DTensor, and an aggregation
    point applies it to this rank's tokens only: its local copy then gets this rank's share of the gradient, which
    DTensor sums over the ranks (Partial) when the optimizer or the gradient clipping reads it."""
    if type(weight) in _PLAIN:
        return weight
    from torch.distributed.tensor import DTensor, Partial  # only a tensor-parallel model gets here: imported then

    if isinstance(weight, DTensor):
        return weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
    return weight


def weight_of(module: nn.Module) -> torch.Tensor:
    """`local_weight(module.weight)`, read from the module's own parameters where it is one of them: `nn.Module`'s
    attribute lookup costs about 1.5 us, and an inference forward folds the queries of all 2L + 1 points from 4L + 2
    weights. Anything else (a parametrized weight, PEFT's `ModulesToSaveWrapper`, a `PreNorm`) is asked for its
    `weight`."""
    own = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    return local_weight(module.weight if own is None else own)


class RMSNorm(nn.Module):
    """y = weight * x * rsqrt(mean(x^2) + eps), computed in fp32 and cast back (the Llama convention)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class PseudoQuery(nn.Module):
    """An aggregation point's query `w`, stored as a `[1, d]` weight (the Kimi K3 `*_res_proj.weight` layout).
    Zero-initialised, so training starts from the uniform mean of the sources. Not an `nn.Linear`: it is never applied
    as one, and PEFT's `target_modules="all-linear"` must not wrap it with adapters that could not act."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        return f"1, {self.weight.shape[1]}"


class KeyNorm(nn.Module):
    """The RMSNorm gain `g` of an aggregation point's keys (`[d]`, ones; the K3 `*_res_norm.weight`). Only its weight
    and eps are used: the depth attention folds the gain into the query and never forms the normed keys. Its class name
    holds no "RMSNorm", so a transformers family's weight init (Gemma's zeros for `1 + weight` norms) passes it by."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class DepthAttention(nn.Module):
    """One aggregation point: a zero-initialised pseudo-query and a key RMSNorm gain (docs/design.md sections 2 and 9).

    `proj.weight` (`[1, d]`) and `norm.weight` (`[d]`) are the Kimi K3 `*_res_proj.weight` and `*_res_norm.weight`
    of the point's place in a model (`self_attention_res`, `mlp_res` or `output_attn_res`). Models register those
    modules under the K3 names and read them through `NamedPoint`, which computes as this class does.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim: expected a positive hidden size, got {dim}")
        self.proj = PseudoQuery(dim)
        self.norm = KeyNorm(dim, eps)

    @property
    def eps(self) -> float:
        return self.norm.eps

    def forward(
        self,
        sources: Sequence[torch.Tensor] | torch.Tensor,
        out_norm: RMSNorm | None = None,
        *,
        out_eps: float | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Mix the sources; with `out_norm`, fuse that sublayer PreNorm (its eps, unless `out_eps` overrides)."""
        return depth_attention(sources, **self._op_arguments(out_norm, out_eps), return_weights=return_weights)

    def chained(
        self,
        sources: Sequence[torch.Tensor],
        carrier: torch.Tensor | None,
        out_norm: RMSNorm | None = None,
        *,
        out_eps: float | None = None,
        carry_newest: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` as a point of a chain (`attnres.ops.chain`): takes the previous point's carrier (None starts a
        chain) and returns (mixture, this point's carrier), which covers all `sources` or, without `carry_newest`, all
        but the last."""
        return depth_attention_chained(sources, carrier, **self._op_arguments(out_norm, out_eps),
                                       carry_newest=carry_newest)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(query w `[1, d]`, key gain g `[d]`, key eps) as they are now: what an inference kernel folds itself."""
        norm = self.norm
        return weight_of(self.proj), weight_of(norm), norm.eps

    def _op_arguments(self, out_norm: RMSNorm | None, out_eps: float | None) -> dict:
        """The depth-attention op's arguments besides the sources, read from the weights now."""
        return dict(
            query=weight_of(self.proj),
            key_norm_weight=weight_of(self.norm),
            eps=self.eps,
            out_norm_weight=None if out_norm is None else weight_of(out_norm),
            out_eps=out_norm.eps if out_norm is not None and out_eps is None else out_eps,
        )

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        self.norm.reset_parameters()


class NamedPoint:
    """An aggregation point over a query and a key norm registered on `owner` as `{prefix}_proj` and `{prefix}_norm`,
    looked up by name at every use: a module swapped in on the owner (PEFT's `modules_to_save`, user code) is the one
    that computes, and nothing read from the weights outlives the call."""

    __slots__ = ("owner", "proj_name", "norm_name")
    forward = __call__ = DepthAttention.forward
    chained = DepthAttention.chained
    weights = DepthAttention.weights
    _op_arguments = DepthAttention._op_arguments
    eps = DepthAttention.eps

    def __init__(self, owner: nn.Module, prefix: str):
        self.owner, self.proj_name, self.norm_name = owner, f"{prefix}_proj", f"{prefix}_norm"

    # the owner's registry itself, not nn.Module.__getattr__'s search of it: the same module, a fraction of the cost
    @property
    def proj(self) -> nn.Module:
        return self.owner._modules[self.proj_name]

    @property
    def norm(self) -> nn.Module:
        return self.owner._modules[self.norm_name]


def stacked_weights(points: Sequence[DepthAttention]) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, key norm gains) of `points`, each `[S, d]`, as phase 1 takes them. One cat each: a stack would first
    make a view of every gain."""
    queries = torch.cat([weight_of(p.proj) for p in points])
    return queries, torch.cat([weight_of(p.norm) for p in points]).view(len(points), -1)
