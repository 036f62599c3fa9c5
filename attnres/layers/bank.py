"""Block AttnRes at inference (docs/design.md section 5): the bank as one `[N, NB, d]` tensor, one fused call per point.

Same schedule and same numbers as `BlockResidual`, without autograd: the bank lives for one forward (a prefill chunk
or a decode step, N = tokens of the chunk or number of sequences), the prefix is carried as the ordinary residual
with the last sublayer output pending, and each aggregation point is one `attnres::bank_aggregate` call (pending
add, scoring, softmax, mixing, PreNorm and, at write layers, the bank-row write). Where it saves traffic, the rows
completed at a write layer are scored once for the next points of the block (`depth_stats`) and each of those points
only merges its prefix (`attnres::bank_merge`).

The state's tensors are the forward's buffers: a read fills the bank row of its write point and adds the pending
output into the prefix in place, so a state is read once (no autograd runs here to need it again).

Memory: phase 1's statistics u are `[G, N, d]` fp32 for G points. Scored for the whole rest of a block at once they
would outweigh the bank many times (Kimi K3: 23 points in fp32 against 8 bf16 rows, about 6x), so phase 1 scores the
block's points in groups whose statistics take no more than the bank's own bytes (at least two points; each group
reads the rows once more), and each group's decision is the bytes model's for its size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from attnres.layers.depth_attention import stacked_weights, weight_of
from attnres.layers.residuals import BlockResidual, ReadsWithoutAutograd
from attnres.ops.bank import bank_aggregate_op, bank_merge_op, bank_rows
from attnres.ops.depth_attention import accumulator_dtype, fold_queries
from attnres.ops.registry import kernel
from attnres.ops.two_phase import depth_stats_fwd

# a few tokens (decode) pay more in extra calls than two-phase saves in reads
MIN_TWO_PHASE_TOKENS = 256


class BankState(NamedTuple):
    """Block's residual state at inference.

    bank: `[N, NB, d]` for the N tokens, its first rows complete (as many as write layers have been read); prefix: the
    current block's partial sum without the pending output, in the tokens' shape `[..., d]` (at layer 0 the embedding
    itself, later a buffer of the forward's own; None right after a write point: the pending output starts the next);
    pending: the last sublayer output, which the next read adds into the prefix; shape: the tokens' shape `[..., d]`
    (the bank's N rows unflattened); stats: phase 1 of points `range(start, stop)` as `(start, stop, (m, z, u))`, each
    `[N, ...]`.

    The bank ops take the prefix and the output in the tokens' shape and return the mixture in it: at decode a view
    per point costs about as much as the kernel's mixing.
    """

    bank: torch.Tensor
    prefix: torch.Tensor | None
    pending: torch.Tensor | None
    shape: torch.Size
    stats: tuple | None = None

    @property
    def rows(self) -> tuple[torch.Tensor]:
        return (self.bank,)


class BlockBank(ReadsWithoutAutograd, BlockResidual):
    """`BlockResidual`'s reads and writes on `BankState`, each read one fused kernel call on the point's weights as
    they are (the kernel folds the query). At the first read the backend's kernels are bound (their arguments checked
    there once, then called directly). `layerwise`: phase 1 scores the points of the read's own decoder layer only."""

    State = BankState

    def __init__(self, num_layers, points, block_size, *, rescale_mixture=False, record=None, two_phase=None,
                 layerwise=False):
        super().__init__(
            num_layers, points, block_size, rescale_mixture=rescale_mixture, record=record, two_phase=two_phase
        )
        self.layerwise = layerwise
        self._aggregate = self._merge = None
        self.end_point = max(points) + 1 if isinstance(points, Mapping) else len(points)

    def block_points(self, point: int) -> range:
        """`point` and the later points of its block that this object reads: the rest of the block, or with
        `layerwise` (weights gathered layer by layer) those of its own decoder layer."""
        if self.layerwise:
            return super().block_points(point)
        return range(point, min(self.block_end(point), self.end_point))

    def start(self, embedding):
        d = embedding.shape[-1]
        bank = embedding.new_empty(embedding.numel() // d, self.num_bank_rows, d)
        return BankState(bank, prefix=embedding.contiguous(), pending=None, shape=embedding.shape)

    def write(self, state, output):
        return BankState(state.bank, state.prefix, output, state.shape, state.stats)

    def filled(self, point: int) -> int:
        """Bank rows complete before `point` reads: one per write layer before it (and its own layer's, past its
        attention side)."""
        layer = point // 2
        return -(-layer // self.block_size) if point % 2 == 0 else layer // self.block_size + 1

    def _read_no_grad(self, state, point, norm):
        bank, prefix, pending, shape, stats = state
        if self._aggregate is None:
            self._bind(bank)
        query, gain, eps = self.points[point].weights()
        write, nvb = self.is_write_point(point), self.filled(point)
        if prefix is None:  # the first point after a write: the pending output starts the new prefix
            prefix, pending = pending.clone(), None
        out_w, out_eps = (None, eps) if norm is None else (weight_of(norm), self._out_eps(norm, nvb + 1))
        if self.scores_groups and not write and (stats is None or not stats[0] <= point < stats[1]):
            stats = self._score_group(bank, nvb, point)
        if stats is not None and not write:
            m, z, u = (s[point - stats[0]] for s in stats[2])
            mix = self._merge(m, z, u, prefix, pending, query, gain, out_w, eps, out_eps)
            self._merge = getattr(self._merge, "kernel", self._merge)
        else:
            mix = self._aggregate(bank, nvb, prefix, pending, query, gain, out_w, eps, out_eps, write)
            # checked once per forward: every later call passes the same bank, a prefix and a pending output of the
            # tokens' shape, and the same kind of [1, d] and [d] weights; at decode the checks cost as much as the
            # kernel
            self._aggregate = getattr(self._aggregate, "kernel", self._aggregate)
        if write or (stats is not None and point + 1 == stats[1]):
            stats = None
        state = BankState(bank, None if write else prefix, None, shape, stats)
        return (mix if norm is not None else self._finish_unfused(mix, nvb + 1)), state

    def _bind(self, x: torch.Tensor) -> None:
        self.acc = accumulator_dtype(x.dtype)
        self.scores_groups = self.two_phase is not None or x.shape[0] >= MIN_TWO_PHASE_TOKENS
        # one device and dtype per forward: bind the backend's fused ops once, not at every point (at decode the lookup
        # costs about as much as the fused op itself); traced, the registered custom ops, which dispatch inside (a
        # traced backend selection would probe, and build, the CPU kernel)
        if torch.compiler.is_compiling():
            self._aggregate, self._merge = bank_aggregate_op, bank_merge_op
        else:
            self._aggregate, self._merge = kernel("bank_aggregate", x), kernel("bank_merge", x)

    def _score_group(self, bank: torch.Tensor, nvb: int, point: int) -> tuple | None:
        """Phase 1 for the next group of the block's points from `point` against the `nvb` complete rows, each row read
        once, where it pays."""
        points = self.block_points(point)
        group = points[: max(2, bank.shape[1] * bank.element_size() // 4)]  # u within the bank's bytes
        if not self.use_two_phase(bank[:, 0], nvb, len(group)):
            return None
        queries, gains = stacked_weights([self.points[k] for k in group])
        cs = fold_queries(queries, gains, self.acc)
        m, z, u, _ = depth_stats_fwd(bank_rows(bank, nvb), cs, self.points[group.start].eps)
        return group.start, group.stop, (m, z, u)
