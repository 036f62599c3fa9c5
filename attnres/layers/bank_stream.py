"""Block AttnRes at inference (docs/design.md section 5): the bank as one `[N, NB, d]` tensor, one fused call per point.

Same schedule and same numbers as `BlockStream`, without autograd: the bank lives for one forward (a prefill chunk
or a decode step, N = tokens of the chunk or number of sequences), the prefix is carried as the ordinary residual
with the last sublayer output pending, and each aggregation point is one `attnres::bank_aggregate` call (pending
add, scoring, softmax, mixing, PreNorm and, at write layers, the bank-row write). Where it saves traffic, the rows
completed at a write layer are scored once for the next points of the block (`depth_stats`) and each of those points
only merges its prefix (`attnres::bank_merge`).

Memory: phase 1's statistics u are `[G, N, d]` fp32 for G points. Scored for the whole rest of a block at once they
would outweigh the bank many times (Kimi K3: 23 points in fp32 against 8 bf16 rows, about 6x), so phase 1 scores the
block's points in groups whose statistics take no more than the bank's own bytes (at least two points; each group
reads the rows once more), and each group's decision is the bytes model's for its size.
"""

from __future__ import annotations

import torch

from attnres.layers.depth_attention import local_weight
from attnres.layers.streams import BlockStream, ResidualState
from attnres.ops.backends import select_backend
from attnres.ops.bank import bank_aggregate, bank_aggregate_op, bank_merge, bank_merge_op, bank_rows
from attnres.ops.depth_attention import accumulator_dtype, flat_tokens
from attnres.ops.two_phase import depth_stats_fwd


MIN_TWO_PHASE_TOKENS = 256


class BankStream(BlockStream):
    def __init__(self, embedding, num_layers, points, block_size, rescale_mixture=False, two_phase=None):
        super().__init__(embedding, num_layers, points, block_size, rescale_mixture, two_phase)
        self.pending: torch.Tensor | None = None
        self._phase1_stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._phase1_end = -1  # the point after the scored group, where the next group of the block is scored
        if embedding is None:  # resumed: `_resume` takes the bank and prefix from the state
            return
        x = flat_tokens(embedding)
        self._bind(x, embedding.shape)
        self.bank = x.new_empty(x.shape[0], self.num_bank_rows, x.shape[1])
        self.nvb = 0
        self.prefix = x  # never written in place: layer 0's point only copies it into bank row 0
        # the prefix of every later block: the fused ops add into it in place, so it is the stream's own buffer, never
        # a sublayer's output (which hooks, drafters or a CUDA graph may still hold)
        self._prefix_buffer = torch.empty_like(x)

    def _bind(self, x: torch.Tensor, shape: torch.Size) -> None:
        self.shape = shape
        self.acc = accumulator_dtype(x.dtype)
        # a stream's device and dtype never change: bind the backend's fused ops once, not at every point (at decode
        # the lookup costs about as much as the fused op itself); traced, the registered custom ops, which dispatch
        # inside (a traced backend selection would probe, and build, the CPU kernel)
        if torch.compiler.is_compiling():
            self._aggregate, self._merge = bank_aggregate_op, bank_merge_op
        else:
            backend = select_backend(x)
            self._aggregate = backend.bank_aggregate or bank_aggregate
            self._merge = backend.bank_merge or bank_merge

    def _state(self):
        # between layers the prefix is the stream's own buffer (the first point after layer 0's write fills it)
        return ResidualState(rows=(self.bank,), head=self.prefix.view(self.shape), pending=self.pending)

    def _resume(self, state):
        (self.bank,), head, self.pending = state.rows, state.head, state.pending
        self.prefix = self._prefix_buffer = flat_tokens(head)
        self._bind(self.prefix, head.shape)
        self.nvb = -(-self.layer // self.block_size)  # one row per write layer before this one
        if self.nvb and not self._is_write_point() and not self.is_final:
            self._score_group(self._block_points())

    def _read(self, norm):
        # a with block, not the decorator: dynamo cannot trace the decorator's closure (a bound method)
        with torch.no_grad():
            return self._read_no_grad(norm)

    def _read_no_grad(self, norm):
        point = self.points[self.point]
        write = self._is_write_point()
        if self.prefix is None:  # first point after a write: the pending output starts the new prefix
            self.prefix, self.pending = self._prefix_buffer.copy_(self.pending), None
        if self.point == self._phase1_end and not write:
            self._score_group(self._block_points())
        num_sources = self.nvb + 1
        out_w = None if norm is None else local_weight(norm.weight)
        out_eps = point.eps if norm is None else self._out_eps(norm, num_sources)
        c = point.folded_query(self.acc)
        if self._phase1_stats is not None and not write:
            t = self.point - self._phase1_start
            m, z, u = (s[t] for s in self._phase1_stats)
            mix = self._merge(m, z, u, self.prefix, self.pending, c, out_w, point.eps, out_eps)
            self._merge = getattr(self._merge, "kernel", self._merge)
        else:
            mix = self._aggregate(self.bank, self.nvb, self.prefix, self.pending, c, out_w, point.eps, out_eps, write)
            # checked once per stream: every later call passes its own bank and prefix buffers again, the pending
            # output as reshaped by `_write`, and c and the gains from the same [1, d] and [d] weights; at decode the
            # checks cost as much as the kernel
            self._aggregate = getattr(self._aggregate, "kernel", self._aggregate)
        self.pending = None
        if write:
            self.nvb += 1
            self.prefix = None
            self._score_group(self._block_points()[1:])
        mix = mix.reshape(self.shape)
        return mix if norm is not None else self._finish_unfused(mix, num_sources)

    def _write(self, output):
        self.pending = flat_tokens(output)

    def _score_group(self, points: range) -> None:
        """Phase 1 for the next group of `points` against the rows now complete, each row read once."""
        group = points[: max(2, self.bank.shape[1] * self.bank.element_size() // 4)]  # u within the bank's bytes
        self._phase1_stats = None
        # a few tokens (decode) pay more in extra calls than two-phase saves in reads
        few_tokens = self.two_phase is None and self.bank.shape[0] < MIN_TWO_PHASE_TOKENS
        if not few_tokens and self._use_two_phase(self.bank[:, 0], self.nvb, len(group)):
            cs = torch.stack([self.points[k].folded_query(self.acc) for k in group])
            m, z, u, _ = depth_stats_fwd(bank_rows(self.bank, self.nvb), cs, self.points[group[0]].eps)
            self._phase1_stats = (m, z, u)
            self._phase1_start, self._phase1_end = group.start, group.stop
