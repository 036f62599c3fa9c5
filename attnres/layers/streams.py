"""Residual streams: the state of one forward's residual path, driven by a model layer by layer.

A model makes one stream per forward and, for each decoder layer, calls

    x = stream.read(layer.input_layernorm);          stream.write(layer.self_attn(x))
    x = stream.read(layer.post_attention_layernorm); stream.write(layer.mlp(x))

and at the end `h = stream.read(model.norm)`. Each read is the next aggregation point in schedule order (attention
side of layer 0, MLP side of layer 0, ..., then the final read); the stream returns the sublayer's normed input
(or, with no norm, the pre-norm mixture `h`). Switching residual kind is the one argument of `make_stream`
(`attnres.layers.factory`).

A stream can also run part of a forward: `stream.state()` between two decoder layers is a `ResidualState` of tensors,
and `resume_stream` continues from one at any layer with only that layer's points. That is how a decoder layer takes
its state and returns the new one (docs/design.md section 7).

Schedules (docs/design.md section 3; `points` holds the 2L + 1 aggregation points in schedule order):
- standard: h = v_0 + ... + v_{l-1}.
- full: point l attends over [v_0 .. v_{l-1}].
- block (Kimi K3 timing, `block_size` S in decoder layers): layer i is a write layer when i % S == 0; its attention
  point attends over the bank plus the prefix (the block that just ended; for layer 0 the embedding), then the
  prefix becomes a bank row and a new prefix starts. Every other point attends over the bank plus the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from attnres.layers.depth_attention import DepthAttention, RMSNorm, local_weight
from attnres.ops import depth_stats, merge_prefix
from attnres.ops.backends import TORCH, backend_for
from attnres.ops.two_phase import SoftmaxStats

class ResidualState(NamedTuple):
    """The residual state between two decoder layers (docs/design.md section 7): what layer i hands layer i + 1.

    rows: Block: the completed block summaries (the bank: a tuple of `[..., d]` rows; at inference one `[tokens, NB,
        d]` tensor, filled in place); Full: every source so far; standard: none.
    head: standard: the residual sum; Block: the current block's partial sum (the prefix); Full: None.
    pending: Block at inference (the fused bank path, and only there): the last sublayer output, which the next
        point's fused kernel adds into the prefix.
    carrier: Full in training: the last point's carrier (`attnres.ops.chain`), through which the next points hand the
        gradients of the earlier sources back. Optional: a state rebuilt without it (a pipeline stage's input) starts
        a new chain, with the same gradients.
    """

    rows: tuple[torch.Tensor, ...] = ()
    head: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    carrier: torch.Tensor | None = None


class ResidualStream:
    """What every stream shares: the schedule position, the fused PreNorm and the mixture rescale."""

    def __init__(self, num_layers: int, rescale_mixture: bool = False):
        if num_layers < 1:
            raise ValueError(f"num_layers: expected at least one decoder layer, got {num_layers}")
        self.num_layers = num_layers
        self.rescale_mixture = rescale_mixture
        self.point = 0  # index of the next aggregation point: 2 * layer + (0 attention | 1 MLP), 2L the final read
        self.end_point = 2 * num_layers + 1  # the points this stream may read (one layer's, for a resumed stream)
        self._pending_write = False
        # when recording, each read keeps its depth weights `[R, ...]` and its pre-norm mixture `[..., d]` (analysis)
        self.record = False
        self.weights: list[torch.Tensor] = []
        self.mixtures: list[torch.Tensor] = []

    @property
    def layer(self) -> int:
        return self.point // 2

    @property
    def is_final(self) -> bool:
        return self.point == 2 * self.num_layers

    def read(self, norm: RMSNorm | None = None) -> torch.Tensor:
        if self._pending_write:
            raise RuntimeError(f"read: aggregation point {self.point - 1} still waits for its sublayer's write")
        if self.point > 2 * self.num_layers:
            raise RuntimeError("read: the final read has already been made; a stream serves one forward")
        out = self._read(norm)
        self._pending_write = not self.is_final
        self.point += 1
        return out

    def write(self, output: torch.Tensor) -> None:
        if not self._pending_write:
            raise RuntimeError("write: each write must follow the read of its own sublayer")
        self._pending_write = False
        self._write(output)

    def state(self) -> ResidualState:
        """The `ResidualState` between two decoder layers: what the next layers read (and pipeline stages send)."""
        if self._pending_write or self.point % 2:
            raise RuntimeError("state: a stream has a state only between decoder layers")
        return self._state()

    def resume(self, layer: int, state: ResidualState, end_point: int | None = None) -> None:
        """Continue at decoder `layer` (`num_layers`: the final read) from the `state()` of a stream that ran layers
        0 .. layer-1, reading points up to `end_point` (exclusive; default: to the end of the forward)."""
        if self.point != 0 or not 0 < layer <= self.num_layers:
            raise ValueError(f"layer: expected a fresh stream and 0 < layer <= {self.num_layers}, got {layer}")
        self.point = 2 * layer
        if end_point is not None:
            self.end_point = end_point
        self._resume(state)

    def _state(self) -> ResidualState:
        raise NotImplementedError

    def _resume(self, state: ResidualState) -> None:
        raise NotImplementedError

    def _out_eps(self, norm: RMSNorm | None, num_sources: int) -> float | None:
        """The fused PreNorm's eps; with `rescale_mixture` the mixture is scaled by R, i.e. eps divided by R^2."""
        if norm is None:
            return None
        return norm.eps / num_sources**2 if self.rescale_mixture else norm.eps

    def _finish_unfused(self, mix: torch.Tensor, num_sources: int) -> torch.Tensor:
        return mix * num_sources if self.rescale_mixture else mix

    def _mix(self, point: DepthAttention, sources: list[torch.Tensor], norm: RMSNorm | None) -> torch.Tensor:
        """One-shot aggregation of `sources` at `point`, with the PreNorm fused when given."""
        R = len(sources)
        if self.record:
            mix, w = point(sources, return_weights=True)
            self.weights.append(w.detach())
            self.mixtures.append(self._finish_unfused(mix, R).detach())
        out = point(sources, norm, out_eps=self._out_eps(norm, R))
        return out if norm is not None else self._finish_unfused(out, R)

    def _read(self, norm: RMSNorm | None) -> torch.Tensor:
        raise NotImplementedError

    def _write(self, output: torch.Tensor) -> None:
        raise NotImplementedError


class StandardStream(ResidualStream):
    """The PreNorm baseline: the running sum of the embedding and every sublayer output."""

    def __init__(self, embedding: torch.Tensor | None, num_layers: int):
        super().__init__(num_layers)
        self.hidden = embedding

    def _read(self, norm):
        if self.record:
            self.mixtures.append(self.hidden.detach())
        return self.hidden if norm is None else norm(self.hidden)

    def _write(self, output):
        self.hidden = self.hidden + output

    def _state(self):
        return ResidualState(head=self.hidden)

    def _resume(self, state):
        self.hidden = state.head


class FullStream(ResidualStream):
    """Full AttnRes: every point attends over the embedding and every earlier sublayer output.

    With `chain` (training, eager) the points form a chain (`attnres.ops.chain`): each source's gradient is summed in
    place, once, instead of written by every later point and added up by autograd. Recording reads break the chain.
    """

    def __init__(self, embedding, num_layers, points: Sequence[DepthAttention], rescale_mixture=False, chain=False):
        super().__init__(num_layers, rescale_mixture)
        _check_points(points, num_layers)
        self.points = points
        self.sources = [embedding]
        self.chain = chain
        self.carrier: torch.Tensor | None = None

    def _read(self, norm):
        point = self.points[self.point]
        if not self.chain or self.record:
            self.carrier = None
            return self._mix(point, self.sources, norm)
        R = len(self.sources)
        out, self.carrier = point.chained(self.sources, self.carrier, norm, out_eps=self._out_eps(norm, R))
        return out if norm is not None else self._finish_unfused(out, R)

    def _write(self, output):
        self.sources.append(output)

    def _state(self):
        return ResidualState(rows=tuple(self.sources), carrier=self.carrier)

    def _resume(self, state):
        self.sources = list(state.rows)
        self.carrier = state.carrier if self.chain else None


class BlockStream(ResidualStream):
    """Block AttnRes with Kimi K3 timing: a bank of block summaries plus the running prefix of the current block.

    With `two_phase` (default: whenever it saves reads, i.e. a block has several points and the bank several
    rows) the completed rows are scored once for all points of the block (phase 1) and each point then merges
    in only its own prefix (phase 2). `record_weights` forces the one-shot path, whose weights it keeps.
    """

    def __init__(
        self,
        embedding,
        num_layers,
        points: Sequence[DepthAttention],
        block_size: int,
        rescale_mixture=False,
        two_phase: bool | None = None,
    ):
        super().__init__(num_layers, rescale_mixture)
        _check_points(points, num_layers)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive number of decoder layers, got {block_size!r}")
        self.points = points
        self.block_size = block_size
        self.two_phase = two_phase
        self.bank: list[torch.Tensor] = []
        self.prefix: torch.Tensor | None = embedding  # layer 0 writes the embedding as bank row 0
        self._phase1: SoftmaxStats | None = None  # statistics of the current block's points over the bank
        self._phase1_start = 0

    @property
    def num_bank_rows(self) -> int:
        """Rows the bank needs for the whole forward: ceil(num_layers / block_size)."""
        return -(-self.num_layers // self.block_size)

    def _block_points(self) -> range:
        """This and the later aggregation points of the current block that this stream reads: they share the bank as
        it stands."""
        end = (self.layer // self.block_size + 1) * self.block_size
        end_point = 2 * end if end < self.num_layers else 2 * self.num_layers + 1
        return range(self.point, min(end_point, self.end_point))

    def _is_write_point(self) -> bool:
        """The attention-side read of a write layer (layer % block_size == 0)."""
        return not self.is_final and self.point % 2 == 0 and self.layer % self.block_size == 0

    def _read(self, norm):
        point = self.points[self.point]
        if self._is_write_point():
            # write layer: the prefix is the block that just ended; it becomes a bank row, sources unchanged
            self.bank.append(self.prefix)
            self.prefix = None
            two_phase = self._use_two_phase(self.bank[0], len(self.bank), len(self._block_points()))
            self._phase1 = self._score_block() if two_phase else None
            sources = self.bank
        else:
            sources = [*self.bank, self.prefix]
        if self._phase1 is None:
            return self._mix(point, sources, norm)
        return self._merge_prefix(point, norm, len(sources))

    def _write(self, output):
        self.prefix = output if self.prefix is None else self.prefix + output

    def _state(self):
        return ResidualState(rows=tuple(self.bank), head=self.prefix)

    def _resume(self, state):
        self.bank, self.prefix = list(state.rows), state.head
        # resumed inside a block: phase 1 for the block's remaining points (at a write point the read scores it)
        if self.bank and not self._is_write_point() and not self.is_final:
            if self._use_two_phase(self.bank[0], len(self.bank), len(self._block_points())):
                self._phase1 = self._score_block()

    def _use_two_phase(self, row: torch.Tensor, rows: int, points: int) -> bool:
        """Phase 1 over `rows` bank rows like `row` for `points` points, or one-shot reads?"""
        if self.record or points < 2:
            return False
        if self.two_phase is not None:
            return self.two_phase
        training = torch.is_grad_enabled() and row.requires_grad
        if not backend_takes_two_phase(row.device.type, row.dtype, row.shape[-1], max(rows, points), training):
            return False
        return two_phase_pays(rows, points, row.element_size(), training=training)

    def _score_block(self) -> SoftmaxStats:
        """Phase 1: every point of the block against the completed rows, each row read once."""
        points = [self.points[k] for k in self._block_points()]
        queries = torch.cat([local_weight(p.proj.weight) for p in points])
        gains = torch.stack([local_weight(p.norm.weight) for p in points])
        self._phase1_start = self.point
        return depth_stats(self.bank, queries, gains, eps=points[0].eps)

    def _merge_prefix(self, point: DepthAttention, norm: RMSNorm | None, num_sources: int) -> torch.Tensor:
        """Phase 2: this point's phase-1 statistics, merged with its own prefix (none at the write point)."""
        t = self.point - self._phase1_start
        out = merge_prefix(
            SoftmaxStats(*(s[t] for s in self._phase1)),
            self.prefix,
            local_weight(point.proj.weight),
            local_weight(point.norm.weight),
            eps=point.eps,
            out_norm_weight=None if norm is None else local_weight(norm.weight),
            out_eps=point.eps if norm is None else self._out_eps(norm, num_sources),
            dtype=self.bank[0].dtype,
            sources=self.bank,  # the backward recomputes u from the rows: no [N, d] fp32 kept per point
        )
        return out if norm is not None else self._finish_unfused(out, num_sources)


def backend_takes_two_phase(device_type: str, dtype: torch.dtype, d: int, stats_rows: int, training: bool) -> bool:
    """False where the backend says two-phase never pays there (in `training`), or where it has a one-shot kernel but
    no phase-1 kernel for `stats_rows` rows or queries (its kernel beats torch ops)."""
    one_shot = backend_for(device_type, dtype, d)
    phase1 = backend_for(device_type, dtype, d, stats_rows)
    return (one_shot.two_phase_trains or not training) and not phase1.name == TORCH.name != one_shot.name


# Traced, the first selection would probe (and build) the CPU kernel: a constant to torch.compile. This is what
# `torch.compiler.assume_constant_result` does; calling it would import torch._dynamo (seconds) with `import attnres`.
backend_takes_two_phase._dynamo_marked_constant = True


# The bound two-phase keeps against one-shot, per token and point: two fp32 numbers (a test measures it)
HELD_SLACK_PER_POINT = 8


def two_phase_pays(rows: int, points: int, elem_size: int, training: bool = False) -> bool:
    """Whether phase 1 + phase 2 over `rows` shared rows and `points` points moves fewer bytes than one-shot reads,
    and holds no more for the backward. A model of what the kernels read and write, per token (and channel for moved
    bytes, `elem_size` the rows' bytes per element; statistics are fp32); what both paths do alike is left out.

    Moved, forward: one-shot reads at each point the rows and its prefix, P (R + 1) e; two-phase reads the rows once,
    then each point writes and reads back its statistics u and reads its prefix, R e + P (8 + e).
    Moved, backward (`training`): one-shot reads each point's sources twice more and writes their gradients,
    3 P (R + 1) e; two-phase recomputes each point's u from the rows, writes it and moves it to the saved shift
    (R e + 12), its phase 2 reads u and the prefix and writes du and dx (8 + 2 e), and phase 1 reads the du (4 P),
    the rows twice and writes their gradients (3 R e).
    Held (`held_bytes_per_token`): what autograd keeps beyond the rows and prefixes (activations either way).
    """
    e, R, P = elem_size, rows, points
    one_shot = P * (R + 1) * e
    two_phase = R * e + P * (8 + e)
    if training:
        one_shot += 3 * P * (R + 1) * e
        two_phase += P * (R * e + 12 + 8 + 2 * e + 4) + 3 * R * e
        if held_bytes_per_token(R, P, True) > held_bytes_per_token(R, P, False) + HELD_SLACK_PER_POINT * P:
            return False
    return two_phase < one_shot


def held_bytes_per_token(rows: int, points: int, two_phase: bool) -> int:
    """Bytes per token that the aggregation keeps for the backward of a block's `points` points over `rows` shared
    rows (one more source, the prefix, at each point), beyond the sources themselves, which the residual path holds
    anyway: one-shot, the weights and key rstd of every source at every point (fp32); two-phase, phase 1's shift m,
    sum z and the rows' key rstd; phase 2 keeps no u (`merge_prefix(sources=...)` recomputes it)."""
    if two_phase:
        return 4 * (2 * points + rows)
    return 8 * points * (rows + 1)


def _check_points(points: Sequence[DepthAttention] | Mapping[int, DepthAttention] | None, num_layers: int) -> None:
    if isinstance(points, Mapping):  # a resumed stream: only the points it reads
        return
    count = None if points is None else len(points)
    if count != 2 * num_layers + 1:
        raise ValueError(
            f"points: expected 2 * num_layers + 1 = {2 * num_layers + 1} aggregation points "
            f"(attention and MLP side of each layer, then the final read), got {count}"
        )
