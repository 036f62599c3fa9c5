"""Full AttnRes at inference, as vLLM serves it: each point one call of the backend's one-shot forward kernel.

`FullStream` reads through `attnres.ops.depth_attention`, the differentiable operator: argument checks, the query
fold, a custom-op dispatch and the autograd wiring at every point, which at decode (a few tokens per step) cost more
than the kernel. Here the backend's forward is bound and every point's query folded once per forward, and each point
calls the kernel directly on the same sources: the mixture is the operator's bit for bit, and the tokens are those
of `FullStream`.

The sources stay the sublayer outputs themselves, as in `FullStream`: copying them into one preallocated
`[tokens, 2L + 1, d]` buffer (with `attnres.ops.bank.bank_aggregate`, the copy fused into each point's call) measured
no faster at decode and up to twice as slow at prefill (2048 tokens, d = 512, 8 layers, fp32), where the fresh
buffer's pages cost more than its contiguous reads save.
"""

from __future__ import annotations

import torch

from attnres.layers.streams import FullStream
from attnres.ops.backends import select_backend
from attnres.ops.depth_attention import accumulator_dtype, torch_depth_attention_fwd


class FullInferenceStream(FullStream):
    """`FullStream` without autograd: the same schedule and sources, each read one direct kernel call."""

    def __init__(self, embedding: torch.Tensor, num_layers: int, points, rescale_mixture: bool = False):
        super().__init__(embedding, num_layers, points, rescale_mixture)
        # bound once: at decode the backend lookup costs about as much as the kernel itself
        self._forward = select_backend(embedding).fwd or torch_depth_attention_fwd
        # every point's folded query c = g * w, for this forward, in one multiply (`fold_query` row by row)
        acc = accumulator_dtype(embedding.dtype)
        with torch.no_grad():
            queries = torch.cat([p.proj.weight for p in points]).to(acc)
            gains = torch.stack([p.norm.weight for p in points]).to(acc)
            self._folded = (queries * gains).unbind()

    def _read(self, norm):
        point, num_sources = self.points[self.point], len(self.sources)
        with torch.no_grad():
            out_w = None if norm is None else norm.weight
            out_eps = point.eps if norm is None else self._out_eps(norm, num_sources)
            mix = self._forward(self.sources, self._folded[self.point], out_w, point.eps, out_eps)[0]
        return mix if norm is not None else self._finish_unfused(mix, num_sources)
