"""One AttnRes aggregation point as a module, and the RMSNorm whose weight an aggregation point can fuse."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attnres.ops import depth_attention
from attnres.ops.depth_attention import fold_query


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


class DepthAttention(nn.Module):
    """One aggregation point: a zero-initialised pseudo-query and a key RMSNorm gain (DESIGN sections 3 and 8).

    `proj.weight` (`[1, d]`) and `norm.weight` (`[d]`) are the Kimi K3 `*_res_proj.weight` and `*_res_norm.weight`
    of the point's place in the model (`self_attention_res`, `mlp_res` or `output_attn_res`).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim: expected a positive hidden size, got {dim}")
        self.proj = nn.Linear(dim, 1, bias=False)
        self.norm = RMSNorm(dim, eps)
        nn.init.zeros_(self.proj.weight)  # zero query: training starts from the uniform average of the sources
        self._fold_cache: tuple | None = None

    @classmethod
    def wrap(cls, proj: nn.Linear, norm: RMSNorm) -> DepthAttention:
        """An aggregation point over a query `proj` (`[1, d]` weight) and key `norm` (`[d]`) owned by a model.

        Lets a model register the parameters under its own (Kimi K3) names. Keep the wrapper in a plain list, not
        as a submodule, so the parameters are saved once, under the owner's names.
        """
        if proj.weight.shape != (1, norm.weight.shape[0]):
            raise ValueError(
                f"proj: expected a [1, {norm.weight.shape[0]}] query weight to match norm, got {list(proj.weight.shape)}"
            )
        point = cls.__new__(cls)
        nn.Module.__init__(point)
        point.proj, point.norm = proj, norm
        point._fold_cache = None
        return point

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
        if out_norm is not None and out_eps is None:
            out_eps = out_norm.eps
        return depth_attention(
            sources,
            self.proj.weight,
            self.norm.weight,
            eps=self.eps,
            out_norm_weight=None if out_norm is None else out_norm.weight,
            out_eps=out_eps,
            return_weights=return_weights,
        )

    @torch.no_grad()
    def folded_query(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """c = g * w (`[d]`) in `dtype`, from the weights as they are now: computed at every call, never cached.

        One `[d]` multiply. A cache would have to know when a weight changed, and nothing reliable tells it: fused
        optimizers and `.data` writes change a weight in place without bumping its version counter (DESIGN 11).
        """
        return fold_query(self.proj.weight, self.norm.weight, dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.norm.weight)
