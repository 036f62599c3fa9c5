"""The AttnRes decoder layer: a family's own decoder-layer modules, their residual rewired through one stream.

A forward of the family's own base model drives the layers (its embedding, scaling, masks, rotary embeddings and
final norm stay the family's). Each layer receives the per-forward `ForwardState` as the keyword argument
`attn_res`, which the family passes through to its layers; the first layer starts the residual stream from its input
(the family's v_0), each sublayer reads its normed input from the stream and writes its output v back, and the last
layer makes the final read, whose mixture the family's final norm then normalises.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from attnres.layers import ResidualStream, make_stream
from attnres.layers.depth_attention import KeyNorm, NamedPoint, PseudoQuery
from attnres.models.family import Sublayer, plan_layer, probe_tolerance, run_sublayer

# Kimi K3 names of the two aggregation points of a decoder layer, and of the final read on the base model
SIDE_NAMES = ("self_attention_res", "mlp_res")
OUTPUT_POINT = "output_attn_res"


def add_points(owner: nn.Module, prefixes: Sequence[str], dim: int, eps: float) -> tuple[NamedPoint, ...]:
    """Register a query and a key norm under each K3 prefix on `owner`; the points that read them."""
    for prefix in prefixes:
        owner.add_module(f"{prefix}_proj", PseudoQuery(dim))
        owner.add_module(f"{prefix}_norm", KeyNorm(dim, eps))
    return tuple(NamedPoint(owner, prefix) for prefix in prefixes)


class _Norm:
    """What a stream needs of a sublayer's plain RMSNorm PreNorm to fuse it: its weight and eps (and a call, for the
    standard residual)."""

    __slots__ = ("module", "eps")

    def __init__(self, module: nn.Module, eps: float):
        self.module, self.eps = module, eps

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@dataclass
class ForwardState:
    """Everything AttnRes keeps for one forward (DESIGN section 6): made per call, never kept across calls.

    points: the 2L + 1 aggregation points in schedule order (None for "standard"); record_weights: keep every
    point's depth weights and pre-norm mixture; capture: decoder layers whose drafter hidden state to keep;
    inference: Block takes the fused bank path; probe: read each layer's plan from the family layer instead;
    start, stop: run decoder layers start .. stop - 1 only (a pipeline chunk), resuming at `start` from the
    `stream.state()` (rows, head) of a stream that ran the layers before it.
    """

    config: object
    points: list | None = None
    record_weights: bool = False
    capture: Sequence[int] = ()
    inference: bool = False
    probe: bool = False
    start: int = 0
    stop: int | None = None
    resume_from: tuple[list[torch.Tensor], torch.Tensor | None] | None = None
    stream: ResidualStream | None = None
    captured: dict = field(default_factory=dict)

    def runs(self, layer_idx: int) -> bool:
        return self.start <= layer_idx < (self.config.num_hidden_layers if self.stop is None else self.stop)

    def begin(self, embedding: torch.Tensor) -> ResidualStream:
        """The stream of this forward, started at layer `start` from the embedding (or from `resume_from`)."""
        config = self.config
        stream = make_stream(
            config.residual,
            embedding,
            config.num_hidden_layers,
            self.points,
            block_size=config.attn_res_block_size,
            rescale_mixture=config.attn_res_rescale_mixture,
            two_phase=config.attn_res_two_phase,
            record_weights=self.record_weights,
            inference=self.inference,
        )
        if self.stop is not None:
            stream.stop_layer = self.stop  # phase 1 scores only the points of the layers this forward runs
        if self.start:
            stream.resume(self.start, *self.resume_from)
        self.stream = stream
        return stream


class AttnResDecoderLayer(nn.Module):
    """A family decoder layer's children (same names, so checkpoints convert key for key) plus, for Full and Block,
    the K3-named pseudo-queries and key norms of its two aggregation points.

    `sides` is what the family layer computes in each sublayer (`attnres.models.family.Sublayer`), read from the
    family layer itself by a probe forward before first use.
    """

    gradient_checkpointing = False  # set by `PreTrainedModel.gradient_checkpointing_enable`

    def __init__(self, family_layer: nn.Module, layer_idx: int, residual: str, dim: int, eps: float):
        super().__init__()
        self.family_layer_cls = type(family_layer)
        for name, value in vars(family_layer).items():  # plain attributes its forward reads (attention_type, ...)
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in family_layer.named_children():
            self.add_module(name, child)
        self.layer_idx = layer_idx
        self.sides: tuple[Sublayer, Sublayer] | None = None
        self.points: tuple[NamedPoint, ...] = () if residual == "standard" else add_points(self, SIDE_NAMES, dim, eps)

    def forward(self, hidden_states: torch.Tensor, *args, attn_res: ForwardState | None = None, **kwargs):
        if attn_res is None:
            raise TypeError(
                "attn_res: an AttnRes decoder layer runs inside an AttnRes model's forward (AttnResForCausalLM or "
                "AttnResModel), which passes it the forward's residual state; do not call the inner family model alone"
            )
        if args:
            raise TypeError(f"{type(self).__name__}: pass every argument after hidden_states by keyword")
        if attn_res.probe:
            return self._probe(hidden_states, kwargs, attn_res.config.base_model_type)
        if not attn_res.runs(self.layer_idx):
            return hidden_states
        stream = attn_res.stream if self.layer_idx > attn_res.start else attn_res.begin(hidden_states)
        kwargs = self._drop_cache_if_checkpointing(kwargs)
        for k, side in enumerate(self.sides):
            if k == 0 and self.layer_idx - 1 in attn_res.capture:
                mixture = stream.read()
                attn_res.captured[self.layer_idx - 1] = mixture
                x = getattr(self, side.norm)(mixture)
            else:
                x = self._read(stream, side)
            stream.write(self._sublayer(side, x, kwargs).to(x.dtype))
        if self.layer_idx == attn_res.config.num_hidden_layers - 1:
            final = stream.read()  # the family's final norm follows
            if self.layer_idx in attn_res.capture:
                attn_res.captured[self.layer_idx] = final
            return final
        # what the family's loop hands on (and `output_hidden_states` records): the residual sum for the standard
        # residual; for AttnRes the input, since the state travels in the stream
        return stream.hidden if attn_res.config.residual == "standard" else hidden_states

    def _read(self, stream: ResidualStream, side: Sublayer) -> torch.Tensor:
        norm = getattr(self, side.norm)
        if side.fused_eps is not None and type(norm) is side.norm_class:
            return stream.read(_Norm(norm, side.fused_eps))
        return norm(stream.read())  # the family's own norm on the mixture (or a module swapped in for it)

    def _sublayer(self, side: Sublayer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The sublayer's output v; under activation checkpointing its internals (attention and MLP activations, the
        bulk of a step's memory) are recomputed in backward from `x`. The stream's reads are not: their saved tensors
        are the sources, which the stream holds anyway, and a replay would write the stream twice."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(partial(run_sublayer, self, side, kwargs=kwargs), x)
        return run_sublayer(self, side, x, kwargs)

    def _drop_cache_if_checkpointing(self, kwargs: dict) -> dict:
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return kwargs
        if kwargs.get("cache") is not None or kwargs.get("use_cache"):
            warnings.warn("activation checkpointing recomputes the sublayers: the KV cache is not used in training")
            kwargs = {**kwargs, "cache": None, "use_cache": False}
        return kwargs

    def _probe(self, hidden_states: torch.Tensor, kwargs: dict, family: str) -> torch.Tensor:
        """Read this layer's sides from the family layer's own forward, then hold the plan, wired as the standard
        residual, to the family layer's output. Returns the family layer's output (the probe forward is the family's)."""
        dim = hidden_states.shape[-1]
        sides = plan_layer(self, self.family_layer_cls, family, dim, hidden_states, kwargs)
        with torch.no_grad():
            want = self.family_layer_cls.forward(self, hidden_states, **kwargs)
            got = hidden_states
            for side in sides:
                got = got + run_sublayer(self, side, getattr(self, side.norm)(got), kwargs)
        tol = probe_tolerance(want.dtype)
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max())):
            raise ValueError(
                f"base model: the {family!r} decoder layer {self.layer_idx} does more than its two sublayers and "
                f"their residual adds (the plan {sides} differs from its output by "
                f"{float((got.float() - want.float()).abs().max()):.3g}); AttnRes cannot rewire it exactly"
            )
        self.sides = sides
        return want
