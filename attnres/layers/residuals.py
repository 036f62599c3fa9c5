"""The residual path as a value: one residual object per kind reads and writes an immutable state.

A decoder layer computes, with `residual` the residual object of its forward (docs/design.md section 7):

    x, state = residual.read(state, 2 * i, prenorm_of_attention);  state = residual.write(state, attention(x))
    x, state = residual.read(state, 2 * i + 1, prenorm_of_mlp);    state = residual.write(state, mlp(x))

`start(embedding)` makes the state layer 0 reads, and the final read is `read(state, 2L, final_norm)`. A read is
aggregation point `point` of the schedule (2 * layer + 0 attention | 1 MLP; 2L the final read) and returns the
sublayer's normed input (or, with no norm, the pre-norm mixture) and the state the next call takes; nothing in the
residual object changes between calls, so a layer that activation checkpointing replays reads the same way.

Schedules (docs/design.md section 3; `points` maps each point index the object reads to its `DepthAttention`):
- standard: h = v_0 + ... + v_{l-1}.
- full: point l attends over [v_0 .. v_{l-1}].
- block (Kimi K3 timing, `block_size` S in decoder layers): layer i is a write layer when i % S == 0; its attention
  point attends over the bank plus the prefix (the block that just ended; for layer 0 the embedding), then the
  prefix becomes a bank row and a new prefix starts. Every other point attends over the bank plus the prefix.

These are the autograd residuals, for training and for any forward that records. Inference has its own backends of
the same reads and writes, chosen by `make_residual(inference=True)`: Block's fused bank (`attnres.layers.bank`) and
Full's direct kernel calls (`attnres.layers.full_inference`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from attnres.layers.depth_attention import DepthAttention, stacked_weights, weight_of
from attnres.ops import depth_stats, merge_prefix, merge_sources
from attnres.ops.registry import PORTABLE, backend_for
from attnres.ops.two_phase import SoftmaxStats, depth_stats_per_query


def without_autograd(fn, *args):
    """`fn(*args)` with autograd off, entering `no_grad` only where it is on: at decode, entering it costs as much as
    a point's kernel (a with block, not the decorator: dynamo cannot trace the decorator's closure)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    with torch.no_grad():
        return fn(*args)


class ReadsWithoutAutograd:
    """The reads of an inference backend (Block's bank, Full's direct kernel calls), which implements them, without
    autograd, as `_read_no_grad`. A read that records nothing, fuses its PreNorm and runs with autograd off goes
    straight there: at a decode step each Python step around the kernel costs about as much as the kernel. Any other
    read goes through `Residual.read` (records, unfused norms), under `no_grad`."""

    def read(self, state, point, norm=None):
        if self.record is None and not torch.is_grad_enabled() and (norm is None or norm.eps is not None):
            return self._read_no_grad(state, point, norm)
        return super().read(state, point, norm)

    def _read(self, state, point, norm):
        return without_autograd(self._read_no_grad, state, point, norm)


class ResidualState(NamedTuple):
    """The residual state a read or write takes and returns; between two decoder layers, what layer i hands layer
    i + 1 (docs/design.md section 7).

    rows: Block: the completed block summaries (the bank); Full: every source so far; standard: none.
    head: standard: the residual sum; Block: the current block's partial sum (the prefix; None right after a write
        point, until the next write starts it); Full: None.
    carrier: in training, Full's or Block's last point's carrier (`attnres.ops.chain`), or in Full's phase-1 groups
        the last group's phase-1 carrier (`depth_stats_per_query`), through which the later points or groups hand the
        gradients of the earlier sources back. Optional: a state rebuilt without it (a pipeline stage's input) starts a
        new chain, with the same gradients.
    stats: the phase-1 statistics of the points `range(start, stop)`, as `(start, stop, SoftmaxStats)`, from the first
        of them to the last (docs/design.md section 4). Block: over `rows`, never handed to the next layer; Full: over
        the sources before `start`'s, handed on until the group's last point.
    """

    rows: tuple[torch.Tensor, ...] = ()
    head: torch.Tensor | None = None
    carrier: torch.Tensor | None = None
    stats: tuple[int, int, SoftmaxStats] | None = None


class PreNorm(NamedTuple):
    """A sublayer's PreNorm as a read takes it: the module, and the eps at which a read may fuse its weight into the
    aggregation (None: the module itself runs on the mixture, e.g. one swapped in for the family's plain RMSNorm)."""

    module: nn.Module
    eps: float | None

    @property
    def weight(self) -> torch.Tensor:
        return weight_of(self.module)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@dataclass
class Recorder:
    """What the reads of one forward keep besides their outputs. `depth`: every read's depth weights `[R, ...]` and
    pre-norm mixture `[..., d]` (`weights[point]`, `mixtures[point]`), read one-shot and unfused for it; `keeps` and
    `keep`: the points whose pre-norm mixture is kept as such (read unfused, then normed apart)."""

    depth: bool = False
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    mixtures: dict[int, torch.Tensor] = field(default_factory=dict)

    def keeps(self, point: int) -> bool:
        return False

    def keep(self, point: int, mixture: torch.Tensor) -> None:
        raise NotImplementedError


class Residual:
    """What every residual kind shares: the schedule, the fused PreNorm, the mixture rescale and the records.

    `points`: the points this object reads, as a mapping from point index (a decoder layer's own two, or 2L) or as
    the sequence of all 2L + 1; `record`: what the reads keep (`Recorder`), or None.
    """

    State = ResidualState

    def __init__(
        self,
        num_layers: int,
        points: Sequence[DepthAttention] | Mapping[int, DepthAttention] | None = None,
        *,
        rescale_mixture: bool = False,
        record: Recorder | None = None,
    ):
        if num_layers < 1:
            raise ValueError(f"num_layers: expected at least one decoder layer, got {num_layers}")
        self.num_layers = num_layers
        self.points = points
        self.rescale_mixture = rescale_mixture
        self.record = record
        self.depth = record is not None and record.depth

    def start(self, embedding: torch.Tensor) -> ResidualState:
        """The state layer 0 reads: the embedding v_0."""
        raise NotImplementedError

    def read(self, state: ResidualState, point: int, norm: PreNorm | nn.Module | None = None):
        """Aggregation point `point` on `state`: (the sublayer's input, the state the write takes). `norm`: the
        sublayer's PreNorm, fused into the read where it can be (anything with a `weight` and an `eps`)."""
        keep = self.record is not None and self.record.keeps(point)
        fused = norm if norm is not None and norm.eps is not None and not keep else None
        out, state = self._read(state, point, fused)
        if keep:
            self.record.keep(point, out)
        if norm is not None and fused is None:
            out = norm(out)
        return out, state

    def write(self, state: ResidualState, output: torch.Tensor) -> ResidualState:
        """`state` with the sublayer output of the point last read added."""
        raise NotImplementedError

    def enter(self, layer: int, hidden_states) -> ResidualState:
        """What decoder `layer` takes as its state: layer 0 starts from the family's embedding, every later layer
        takes the state the layer before returned."""
        if layer == 0:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(
                    f"hidden_states: decoder layer 0 starts from the embedding tensor, got {type(hidden_states)}"
                )
            return self.start(hidden_states)
        if not isinstance(hidden_states, self.State):
            kinds = self.State if isinstance(self.State, tuple) else (self.State,)
            raise TypeError(
                f"hidden_states: decoder layer {layer} takes the {' or '.join(k.__name__ for k in kinds)} that layer "
                f"{layer - 1} returns, got {type(hidden_states).__name__} (an AttnRes layer runs inside an AttnRes "
                f"model's forward)"
            )
        return hidden_states

    def _read(self, state, point: int, norm) -> tuple[torch.Tensor, ResidualState]:
        raise NotImplementedError

    def _out_eps(self, norm, num_sources: int) -> float | None:
        """The fused PreNorm's eps; with `rescale_mixture` the mixture is scaled by R, i.e. eps divided by R^2."""
        if norm is None:
            return None
        return norm.eps / num_sources**2 if self.rescale_mixture else norm.eps

    def _finish_unfused(self, mix: torch.Tensor, num_sources: int) -> torch.Tensor:
        return mix * num_sources if self.rescale_mixture else mix

    def _merge_arguments(self, point: int, norm, num_sources: int) -> dict:
        """A phase-2 op's query, gains and eps at `point` (`merge_prefix`, `merge_sources`), read from the weights
        now; without a fused norm its out_eps is the key eps, which nothing then reads."""
        at = self.points[point]
        return at._op_arguments(norm, at.eps if norm is None else self._out_eps(norm, num_sources))

    def _mix(self, point: int, sources: Sequence[torch.Tensor], norm) -> torch.Tensor:
        """One-shot aggregation of `sources` at `point`, with the PreNorm fused when given."""
        R, at = len(sources), self.points[point]
        if self.depth:
            mix, w = at(sources, return_weights=True)
            self.record.weights[point] = w.detach()
            self.record.mixtures[point] = self._finish_unfused(mix, R).detach()
        out = at(sources, norm, out_eps=self._out_eps(norm, R))
        return out if norm is not None else self._finish_unfused(out, R)

    def _chained(self, point: int, sources: Sequence[torch.Tensor], carrier: torch.Tensor | None, norm,
                 carry_newest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`_mix` as a point of a chain (`attnres.ops.chain`): (the read's output, this point's carrier)."""
        R = len(sources)
        out, carrier = self.points[point].chained(sources, carrier, norm, out_eps=self._out_eps(norm, R),
                                                  carry_newest=carry_newest)
        return (out if norm is not None else self._finish_unfused(out, R)), carrier


class StandardResidual(Residual):
    """The PreNorm baseline: the running sum of the embedding and every sublayer output."""

    def start(self, embedding):
        return ResidualState(head=embedding)

    def _read(self, state, point, norm):
        if self.depth:
            self.record.mixtures[point] = state.head.detach()
        return (state.head if norm is None else norm(state.head)), state

    def write(self, state, output):
        return ResidualState((), state.head + output)


class FullResidual(Residual):
    """Full AttnRes: every point attends over the embedding and every earlier sublayer output.

    With `chain` (training, eager) the points form a chain (`attnres.ops.chain`): each source's gradient is summed in
    place, once, instead of written by every later point and added up by autograd. Recording reads break the chain.

    With `group` G > 1 the points are taken G at a time (docs/design.md section 4): at a group's first point, phase 1
    scores the sources so far for all G points in one pass (`depth_stats_per_query`; the groups' phase 1 a chain that
    sums each source's phase-1 gradients in place), and each point of the group then merges in only the sources
    written since (`merge_sources`). Point l then reads about l / G + G / 2 rows instead of l + 1,
    forward and backward, and keeps its u (`[N, d]` fp32) for the backward. A group reads the weights of G points
    from its first: not for FSDP2 (each layer's weights gathered for its own forward only) or a pipeline stage.
    `group=None` chooses: `FULL_GROUP` points where the chain would run and the backend compiles both phases'
    backward (`full_groups_pay`: the CPU's, 0.34x (fp32) and 0.50x (bf16) the chain's time in
    `benchmarks/full_training.py`), else none.
    """

    def __init__(self, num_layers, points, *, rescale_mixture=False, record=None, chain=False,
                 group: int | None = 0):
        super().__init__(num_layers, points, rescale_mixture=rescale_mixture, record=record)
        check_points(points, num_layers)
        self.chain = chain and not self.depth
        bad = isinstance(group, bool) or not isinstance(group, int) or group < 0
        if group is not None and bad:
            raise ValueError(f"group: expected a number of points >= 0 (0 or 1: no groups) or None, got {group!r}")
        if self.depth or isinstance(points, Mapping) or (group is None and not self.chain):
            group = 0
        self.group = group  # None: decided at the first read, from the sources' backend

    def start(self, embedding):
        return ResidualState(rows=(embedding,))

    def _read(self, state, point, norm):
        sources, stats = state.rows, state.stats
        if self.group is None:
            self.group = FULL_GROUP if full_groups_pay(sources[0], len(self.points)) else 0
        if self.group > 1 and (stats is None or not stats[0] <= point < stats[1]):
            stats, carrier = self._score(sources, point, state.carrier)
            state = state._replace(carrier=carrier)
        if stats is not None:
            state = ResidualState(sources, carrier=state.carrier, stats=None if point + 1 == stats[1] else stats)
            return self._merge_sources(point, stats, sources, norm), state
        if self.chain:
            out, carrier = self._chained(point, sources, state.carrier, norm)
            return out, state._replace(carrier=carrier)
        return self._mix(point, sources, norm), state._replace(carrier=None)

    def write(self, state, output):
        return ResidualState((*state.rows, output), None, state.carrier, state.stats)

    def _score(self, sources: tuple[torch.Tensor, ...], point: int, carrier: torch.Tensor | None):
        """Phase 1 of the group that starts at `point`: its points (up to G, with the first one's key eps) against
        the sources so far, as the next link of the groups' chain (`depth_stats_per_query`): ((start, stop, the
        statistics), the carrier)."""
        eps = self.points[point].eps
        stop = point + 1
        while stop < min(point + self.group, len(self.points)) and self.points[stop].eps == eps:
            stop += 1
        queries, gains = stacked_weights([self.points[k] for k in range(point, stop)])
        stats, carrier = depth_stats_per_query(sources, queries, gains, eps=eps, carrier=carrier)
        return (point, stop, stats), carrier

    def _merge_sources(self, point, stats, sources, norm) -> torch.Tensor:
        """Phase 2: this point's phase-1 statistics merged with the sources written since its group's first point."""
        start, _, scored = stats
        R = len(sources)
        out = merge_sources(scored[point - start], sources[start + 1:], **self._merge_arguments(point, norm, R),
                            dtype=sources[0].dtype)
        return out if norm is not None else self._finish_unfused(out, R)


class BlockResidual(Residual):
    """Block AttnRes with Kimi K3 timing: a bank of block summaries plus the running prefix of the current block.

    With `two_phase` (default: whenever it saves reads, i.e. a decoder layer's two points share the bank and it has
    several rows) the completed rows are scored once for both points (phase 1) and each point then merges in only its
    own prefix (phase 2). Recording depth forces the one-shot path, whose weights it keeps.

    With `chain` (training, eager) the one-shot points form a chain (`attnres.ops.chain`) whose carrier covers the
    bank rows: each row's gradient is summed in place over every later point, and each point writes a gradient of its
    own for its prefix only. A two-phase point, or a recording read, ends the chain; the next one-shot point starts
    another.
    """

    def __init__(self, num_layers, points, block_size: int, *, rescale_mixture=False, record=None, two_phase=None,
                 chain=False):
        super().__init__(num_layers, points, rescale_mixture=rescale_mixture, record=record)
        check_points(points, num_layers)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive number of decoder layers, got {block_size!r}")
        self.block_size = block_size
        self.two_phase = two_phase
        self.chain = chain and not self.depth

    @property
    def num_bank_rows(self) -> int:
        """Rows the bank needs for the whole forward: ceil(num_layers / block_size)."""
        return -(-self.num_layers // self.block_size)

    def start(self, embedding):
        return ResidualState(head=embedding)  # layer 0's attention point writes it as bank row 0

    def is_write_point(self, point: int) -> bool:
        """The attention-side read of a write layer (layer % block_size == 0)."""
        return point < 2 * self.num_layers and point % 2 == 0 and (point // 2) % self.block_size == 0

    def block_points(self, point: int) -> range:
        """`point` and the later points of its block and its decoder layer: they share the bank as it stands, and a
        layer reads only its own parameters (FSDP2 gathers them layer by layer; checkpointing replays one layer)."""
        return range(point, min(self.block_end(point), 2 * (point // 2) + 2))

    def block_end(self, point: int) -> int:
        """The point after the last of `point`'s block."""
        end = (point // 2 // self.block_size + 1) * self.block_size
        return 2 * end if end < self.num_layers else 2 * self.num_layers + 1

    def _read(self, state, point, norm):
        rows, prefix, stats, carrier = state.rows, state.head, state.stats, state.carrier
        if self.is_write_point(point):
            # the prefix is the block that just ended: it becomes a bank row, sources unchanged
            rows, prefix, stats = (*rows, prefix), None, None
        sources = rows if prefix is None else (*rows, prefix)
        if stats is None or not stats[0] <= point < stats[1]:
            stats = self._score(rows, self.block_points(point)) if rows else None
        state = ResidualState(rows=rows, head=prefix, stats=None if stats is None or point + 1 == stats[1] else stats)
        if stats is not None:
            return self._merge_prefix(point, stats, rows, prefix, norm), state
        if not self.chain:
            return self._mix(point, sources, norm), state
        # the carrier goes on with the bank rows; the prefix is read again only within the next prefix
        out, carrier = self._chained(point, sources, carrier, norm, carry_newest=prefix is None)
        return out, state._replace(carrier=carrier)

    def write(self, state, output):
        head = output if state.head is None else state.head + output
        return ResidualState(state.rows, head, state.carrier, state.stats)

    def use_two_phase(self, row: torch.Tensor, rows: int, points: int) -> bool:
        """Phase 1 over `rows` bank rows like `row` for `points` points, or one-shot reads?"""
        if self.depth or points < 2:
            return False
        if self.two_phase is not None:
            return self.two_phase
        training = torch.is_grad_enabled() and row.requires_grad
        if not backend_takes_two_phase(row.device.type, row.dtype, row.shape[-1], max(rows, points), training):
            return False
        return two_phase_pays(rows, points, row.element_size(), training=training)

    def _score(self, rows: tuple[torch.Tensor, ...], points: range) -> tuple[int, int, SoftmaxStats] | None:
        """Phase 1, where it pays: every point of `points` against the completed rows, each row read once."""
        if not self.use_two_phase(rows[0], len(rows), len(points)):
            return None
        queries, gains = stacked_weights([self.points[k] for k in points])
        return points.start, points.stop, depth_stats(rows, queries, gains, eps=self.points[points.start].eps)

    def _merge_prefix(self, point, stats, rows, prefix, norm) -> torch.Tensor:
        """Phase 2: this point's phase-1 statistics, merged with its own prefix (none at the write point)."""
        start, _, scored = stats
        num_sources = len(rows) + (prefix is not None)
        out = merge_prefix(
            SoftmaxStats(*(s[point - start] for s in scored)),
            prefix,
            **self._merge_arguments(point, norm, num_sources),
            dtype=rows[0].dtype,
            sources=rows,  # the backward recomputes u from the rows: no [N, d] fp32 kept per point
        )
        return out if norm is not None else self._finish_unfused(out, num_sources)


# Points per phase-1 group where Full chooses groups (`FullResidual(group=None)`): in `benchmarks/full_training.py` at
# SmolLM2-135M's shape, the fastest of 4 to 16 in fp32 and in bf16.
FULL_GROUP = 8


def full_groups_pay(source: torch.Tensor, points: int) -> bool:
    """Whether Full's phase-1 groups beat the chain for training on sources like `source` (`points` the model's
    aggregation points): where the backend has compiled kernels for both phases' backward (the CPU's; on a backend
    without them phase 2 runs as torch ops)."""
    device, dtype, d = source.device.type, source.dtype, source.shape[-1]
    phases = (("merge_sources_bwd", None), ("depth_stats_bwd_into", points))
    return all(backend_for(device, dtype, d, op, rows) is not PORTABLE for op, rows in phases)


def backend_takes_two_phase(device_type: str, dtype: torch.dtype, d: int, stats_rows: int, training: bool) -> bool:
    """False where the backend says two-phase never pays there (in `training`), or where it has a one-shot kernel but
    no phase-1 kernel for `stats_rows` rows or queries (its kernel beats torch ops)."""
    one_shot = backend_for(device_type, dtype, d)
    phase1 = backend_for(device_type, dtype, d, "depth_stats_fwd", stats_rows)
    phase1_falls_back = phase1 is PORTABLE and one_shot is not PORTABLE
    return (one_shot.two_phase_trains or not training) and not phase1_falls_back


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


def check_points(points: Sequence[DepthAttention] | Mapping[int, DepthAttention] | None, num_layers: int) -> None:
    if isinstance(points, Mapping):  # a resumed stream: only the points it reads
        return
    count = None if points is None else len(points)
    if count != 2 * num_layers + 1:
        raise ValueError(
            f"points: expected 2 * num_layers + 1 = {2 * num_layers + 1} aggregation points "
            f"(attention and MLP side of each layer, then the final read), got {count}"
        )
