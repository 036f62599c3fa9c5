"""Residual streams: one forward's residual path driven point by point, for code that runs the sublayers itself.

    stream = make_stream("block", embedding, L, points, block_size=S)
    for each decoder layer:
        x = stream.read(layer.input_layernorm);          stream.write(layer.self_attn(x))
        x = stream.read(layer.post_attention_layernorm); stream.write(layer.mlp(x))
    h = stream.read(model.norm)

A stream is a residual object (`attnres.layers.residuals`) with the state it last returned and the index of the next
point: each read is the next aggregation point in schedule order. `state()` between two decoder layers is what the
next layer takes, and `resume_stream` continues from one at any layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from attnres.layers.depth_attention import DepthAttention
from attnres.layers.factory import make_residual
from attnres.layers.residuals import Recorder, Residual, ResidualState


class ResidualStream:
    """`residual`'s reads and writes in schedule order, from `point`, reading points before `end_point`."""

    def __init__(self, residual: Residual, state: ResidualState | None, point: int = 0, end_point: int | None = None):
        self.residual, self._state, self.point = residual, state, point
        self.end_point = 2 * residual.num_layers + 1 if end_point is None else end_point
        self._pending_write = False

    @property
    def num_layers(self) -> int:
        return self.residual.num_layers

    @property
    def is_final(self) -> bool:
        return self.point == 2 * self.num_layers

    @property
    def current(self) -> ResidualState | None:
        """The state the last read or write returned."""
        return self._state

    @property
    def weights(self) -> list[torch.Tensor]:
        """With `record_weights`: every read's depth weights so far, in schedule order (none for "standard")."""
        record = self.residual.record
        return [] if record is None else [record.weights[k] for k in sorted(record.weights)]

    def read(self, norm=None) -> torch.Tensor:
        if self._pending_write:
            raise RuntimeError(f"read: aggregation point {self.point - 1} still waits for its sublayer's write")
        if self.point >= self.end_point:
            raise RuntimeError("read: the final read has already been made; a stream serves one forward")
        out, self._state = self.residual.read(self._state, self.point, norm)
        self._pending_write = not self.is_final
        self.point += 1
        return out

    def write(self, output: torch.Tensor) -> None:
        if not self._pending_write:
            raise RuntimeError("write: each write must follow the read of its own sublayer")
        self._pending_write = False
        self._state = self.residual.write(self._state, output)

    def state(self) -> ResidualState:
        """The state between two decoder layers (what the next layers read, and pipeline stages send), or after the
        final read."""
        if self._pending_write or self.point % 2 and self.point <= 2 * self.num_layers:
            raise RuntimeError("state: a stream has a state only between decoder layers")
        return self.current

    def resume(self, layer: int, state: ResidualState, end_point: int | None = None) -> None:
        """Continue at decoder `layer` (`num_layers`: the final read) from the `state()` of a stream that ran layers
        0 .. layer-1, reading points before `end_point` (default: to the end of the forward)."""
        if self.point != 0 or not 0 < layer <= self.num_layers:
            raise ValueError(f"layer: expected a fresh stream and 0 < layer <= {self.num_layers}, got {layer}")
        self.point, self._state = 2 * layer, state
        if end_point is not None:
            self.end_point = end_point


def make_stream(
    residual: str,
    embedding: torch.Tensor | None,
    num_layers: int,
    points: Sequence[DepthAttention] | Mapping[int, DepthAttention] | None = None,
    *,
    record_weights: bool = False,
    **options,
) -> ResidualStream:
    """The residual stream of kind `residual` ("standard", "full" or "block") for one forward.

    `points`: the 2L + 1 aggregation points in schedule order (not needed for "standard"); `record_weights` keeps, for
    every read, the depth weights in `stream.weights` (none for "standard"); `options`: `make_residual`'s
    (`block_size`, `rescale_mixture`, `two_phase`, `inference`, `chain`). A stream made without an embedding waits
    for `resume` (`resume_stream`).
    """
    record = Recorder(depth=True) if record_weights else None
    stream_residual = make_residual(residual, num_layers, points, record=record, **options)
    return ResidualStream(stream_residual, None if embedding is None else stream_residual.start(embedding))


def resume_stream(
    residual: str,
    state: ResidualState,
    layer: int,
    num_layers: int,
    points: Mapping[int, DepthAttention] | None = None,
    **options,
) -> ResidualStream:
    """The stream of decoder `layer` alone (`num_layers`: the final read), continuing from the `state` that layers
    0 .. layer-1 left. `points` maps the point indices it reads (2 layer and 2 layer + 1, or 2L) to their points.
    `options`: `make_stream`'s."""
    stream = make_stream(residual, None, num_layers, points, **options)
    stream.resume(layer, state, end_point=min(2 * layer + 2, 2 * num_layers + 1))
    return stream
