"""Full AttnRes at inference: each point one direct call of the backend's one-shot forward kernel.

`FullResidual` reads through `attnres.ops.depth_attention`, the differentiable operator: argument checks, a custom-op
dispatch and the autograd wiring at every point, which at decode (a few tokens per step) cost more than the kernel.
Here the backend's forward is bound and every point's query folded from the weights as they are now at the first
read (`FoldedQueries`), and each point calls the kernel directly on the same sources: the mixture is the operator's
bit for bit, and the state is `FullResidual`'s.

The sources stay the sublayer outputs themselves: copying them into one preallocated `[tokens, 2L + 1, d]` buffer
(with `attnres.ops.bank.bank_aggregate`, the copy fused into each point's call) measured no faster at decode and up
to twice as slow at prefill (2048 tokens, d = 512, 8 layers, fp32), where the fresh buffer's pages cost more than its
contiguous reads save.
"""

from __future__ import annotations

from attnres.layers.depth_attention import FoldedQueries, local_weight
from attnres.layers.residuals import FullResidual, without_autograd
from attnres.ops.depth_attention import accumulator_dtype
from attnres.ops.registry import kernel


class FullInference(FullResidual):
    """`FullResidual` without autograd: the same schedule and sources, each read one direct kernel call."""

    def __init__(self, num_layers, points, *, rescale_mixture=False, record=None, layerwise=False):
        super().__init__(num_layers, points, rescale_mixture=rescale_mixture, record=record)
        self.layerwise = layerwise
        self._forward = None

    def _read(self, state, point, norm):
        sources = state.rows
        num_sources = len(sources)
        if self._forward is None:
            self.folded = FoldedQueries(self.points, accumulator_dtype(sources[0].dtype), self.layerwise)
            self._forward = kernel("depth_attention_fwd", sources[0])
        c, eps = self.folded[point]
        out_w = None if norm is None else local_weight(norm.weight)
        out_eps = eps if norm is None else self._out_eps(norm, num_sources)
        mix = without_autograd(self._forward, sources, c, out_w, eps, out_eps)[0]
        return (mix if norm is not None else self._finish_unfused(mix, num_sources)), state
