"""Full AttnRes at inference: each point one direct kernel call, on the sources in place or, for a few tokens, in a
bank.

`FullResidual` reads through `attnres.ops.depth_attention`, the differentiable operator: argument checks, a custom-op
dispatch and the autograd wiring at every point, which at decode (a few tokens per step) cost more than the kernel.
Here the backend's kernels are bound at the first read and each point calls one directly on its weights as they are
now (the kernel folds the query): the mixture is the operator's bit for bit.

Where the sources live depends on the bytes of the bank the forward would take, N (2L + 1) d elements:
- up to `BANK_BYTES` (a decode step), in one `[N, 2L + 1, d]` bank that lives for the forward: each read writes its
  newest source (the last sublayer output) into the next row and mixes the rows so far, in one
  `attnres.ops.bank.bank_aggregate` call. Passing a kernel its sources as a list costs about 0.4 us per source in
  the binding and its checks, 1,891 sources per token at 30 layers: on the CPU kernels the bank's reads take 0.5x the
  list's time at 1 token and 0.83-0.94x at 64 tokens, a bank of 4.5-9 MB (`python -m benchmarks.full_reads`:
  d = 576, 30 layers, fp32 and bf16);
- past it (prefill), the sublayer outputs themselves, as a list: a fresh bank's page faults grow with its bytes and
  then cost as much as its contiguous reads save, or more (1.0x the list's time for an 18 MB bank, 1.25x for 36 MB).
  The state is then `FullResidual`'s.
Traced (`torch.compile`), always the list: a branch on the bank's bytes (the token count) would specialise the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from attnres.layers.depth_attention import weight_of
from attnres.layers.residuals import FullResidual, ReadsWithoutAutograd, ResidualState
from attnres.ops.registry import kernel

# the most bytes of a forward's bank (see the module docstring): SmolLM2-135M's up to 59 tokens in fp32, 119 in bf16
BANK_BYTES = 8 * 2**20


class FullBankState(NamedTuple):
    """Full's residual state in a bank.

    bank: `[N, 2L + 1, d]` for the N tokens, its first `count` rows the sources so far; pending: the newest source in
    the tokens' shape (the embedding, then the last sublayer output), which the next read writes into row `count` (as
    `BankState`'s prefix: the bank op takes it as it is and returns the mixture in its shape); shape: the tokens'
    shape `[..., d]`.
    """

    bank: torch.Tensor
    count: int
    pending: torch.Tensor | None
    shape: torch.Size

    @property
    def rows(self) -> tuple[torch.Tensor, ...]:
        """Every source so far, each `[..., d]` (views of the bank)."""
        rows = tuple(self.bank[:, j].view(self.shape) for j in range(self.count))
        return rows if self.pending is None else (*rows, self.pending)

    head = carrier = None  # as `ResidualState`'s for Full at inference


class FullInference(ReadsWithoutAutograd, FullResidual):
    """`FullResidual` without autograd: the same schedule and mixtures, each read one direct kernel call (on a bank up
    to `BANK_BYTES`)."""

    State = (ResidualState, FullBankState)

    def __init__(self, num_layers, points, *, rescale_mixture=False, record=None):
        super().__init__(num_layers, points, rescale_mixture=rescale_mixture, record=record)
        self._forward = self._aggregate = None

    def start(self, embedding):
        rows = len(self.points) if isinstance(self.points, Sequence) else None  # a resumed stream's: only its own
        n, size = embedding.numel(), embedding.element_size()
        if rows is None or torch.compiler.is_compiling() or n * rows * size > BANK_BYTES:
            return super().start(embedding)
        d = embedding.shape[-1]
        return FullBankState(embedding.new_empty(n // d, rows, d), 0, embedding.contiguous(), embedding.shape)

    def write(self, state, output):
        if isinstance(state, FullBankState):
            return FullBankState(state.bank, state.count, output, state.shape)
        return super().write(state, output)

    def _read_no_grad(self, state, point, norm):
        banked = isinstance(state, FullBankState)
        sources = None if banked else state.rows
        num_sources = state.count + (state.pending is not None) if banked else len(sources)
        if self._forward is None:
            x = state.bank if banked else sources[0]
            self._forward, self._aggregate = kernel("point_fwd", x), kernel("bank_aggregate", x)
        query, gain, eps = self.points[point].weights()
        out_w, out_eps = (None, eps) if norm is None else (weight_of(norm), self._out_eps(norm, num_sources))
        if banked:
            mix, state = self._read_bank(state, query, gain, out_w, eps, out_eps)
        else:
            mix = self._forward(sources, query, gain, out_w, eps, out_eps)[0]
        return (mix if norm is not None else self._finish_unfused(mix, num_sources)), state

    def _read_bank(self, state: FullBankState, query, gain, out_w, eps, out_eps) -> tuple[torch.Tensor, FullBankState]:
        """One call: the pending source written as the next bank row, then every row mixed. A second read with no
        write between takes the newest row as the prefix."""
        bank, count, pending, shape = state
        if pending is None:
            row = bank[:, count - 1]
            mix = self._aggregate(bank, count - 1, row, None, query, gain, out_w, eps, out_eps, False).view(shape)
        else:  # the mixture in the pending source's shape, the tokens'
            mix = self._aggregate(bank, count, pending, None, query, gain, out_w, eps, out_eps, True)
            count += 1
        # checked at the first call: every later call passes the same bank and rows like the first
        self._aggregate = getattr(self._aggregate, "kernel", self._aggregate)
        return mix, FullBankState(bank, count, None, shape)
