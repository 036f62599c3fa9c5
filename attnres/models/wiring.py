"""The AttnRes decoder layer: a family's own decoder-layer modules, their residual rewired. State in, state out.

The family's own base model drives the layers (its embedding, scaling, masks, rotary embeddings and final norm stay
the family's): it calls `hidden_states = layer(hidden_states, **kwargs)` layer after layer and hands the last output
to its final norm. An AttnRes layer takes the residual state as that value and returns the new one (docs/design.md
section 7): layer 0 takes the family's embedding (v_0) and every later layer the `ResidualState` of tensors that the
layer before returned (Block: the bank and the partial sum; Full: every source; standard: the residual sum). Each layer
reads only its own parameters, so whatever wraps a whole layer (activation checkpointing, FSDP2, a pipeline stage)
works on it. The final read (`FinalRead`) turns the last state into the mixture the family's final norm normalises.

What a forward is asked to record (hidden states, depth weights, drafter captures) is output, not state: a `Records`
collector, keyed by layer and point. The model's forward hands it to the layers as the keyword argument
`attn_res_records` (only when something is recorded), so that activation checkpointing replays a layer with it: the
recompute reads the same way (unfused where a mixture is kept) and overwrites its own entries. The final read, which
is no checkpointed layer, finds it in `ACTIVE_RECORDS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils.output_capturing import CompileableContextVar

from attnres.layers import make_stream, resume_stream
from attnres.layers.depth_attention import KeyNorm, NamedPoint, PseudoQuery
from attnres.layers.kinds import STANDARD
from attnres.layers.streams import ResidualState, ResidualStream
from attnres.models.family import Sublayer, layer_parameters, run_sublayer

# Kimi K3 names of the two aggregation points of a decoder layer, and of the final read on the base model
SIDE_NAMES = ("self_attention_res", "mlp_res")
OUTPUT_POINT = "output_attn_res"


def add_points(owner: nn.Module, prefixes: tuple[str, ...], dim: int, eps: float) -> tuple[NamedPoint, ...]:
    """Register a query and a key norm under each K3 prefix on `owner`; the points that read them."""
    for prefix in prefixes:
        owner.add_module(f"{prefix}_proj", PseudoQuery(dim))
        owner.add_module(f"{prefix}_norm", KeyNorm(dim, eps))
    return tuple(NamedPoint(owner, prefix) for prefix in prefixes)


class FusedNorm:
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
class Records:
    """What one forward records besides its output.

    reads: decoder layers whose residual read to keep (the pre-norm mixture its attention side forms; `num_layers`:
    the final read), each as `mixtures_read[layer]`; depth: keep every point's depth weights and pre-norm mixture
    (`weights[point]`, `mixtures[point]`); final_state: the `ResidualState` the final read consumed; final_normed: the
    family's final norm output; layer_inputs: when a list, the layers run nothing and append the keyword arguments the
    family hands each of them (`AttnResPreTrainedModel.layer_inputs`).
    """

    reads: frozenset[int] = frozenset()
    depth: bool = False
    hidden: tuple[int, ...] = ()  # the hidden-state entries to report (the model's output), and the layers to capture
    capture: tuple[int, ...] = ()
    mixtures_read: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    mixtures: dict[int, torch.Tensor] = field(default_factory=dict)
    final_state: ResidualState | None = None
    final_normed: torch.Tensor | None = None
    layer_inputs: list[tuple[torch.Tensor | ResidualState, dict]] | None = None

    def keep_depth(self, stream: ResidualStream, first_point: int) -> None:
        for j, w in enumerate(stream.weights):
            self.weights[first_point + j] = w
        for j, m in enumerate(stream.mixtures):
            self.mixtures[first_point + j] = m


# the records of the forward running now, for the final read (set by the model's forward, as transformers' own
# output collector)
ACTIVE_RECORDS = CompileableContextVar("attn_res_records")


class SharedStream:
    """The one residual stream of a forward without autograd (eval mode, nothing recorded, not traced), which every
    decoder layer and the final read continue in turn: the model's forward makes it (`ACTIVE_STREAM`) and layer 0
    starts it from the embedding. A decode step then pays no stream per layer, and a Block's two-phase scoring spans
    its whole block. A layer continues it only from the very state it last handed on; any other caller (a pipeline
    stage, a layer called alone) resumes a stream of its own from the state it is given, with the same numbers."""

    __slots__ = ("config", "points", "stream", "state")

    def __init__(self, config, points: list[NamedPoint] | None):
        self.config, self.points = config, points
        self.stream: ResidualStream | None = None
        self.state: ResidualState | None = None  # what the stream last handed on

    def take(self, layer_idx: int, hidden_states: torch.Tensor | ResidualState) -> ResidualStream | None:
        """The stream, if `hidden_states` is where it stands (at layer 0: the embedding, which starts it)."""
        if layer_idx == 0 and isinstance(hidden_states, torch.Tensor):
            config = self.config
            options = _stream_options(config, None, inference=True, training=False)
            self.stream = make_stream(config.residual, hidden_states, config.num_hidden_layers, self.points, **options)
            return self.stream
        return self.stream if self.state is not None and hidden_states is self.state else None

    def hand_on(self) -> ResidualState:
        self.state = self.stream.state()
        return self.state


# the shared stream of the forward running now (set by the model's forward, where it applies)
ACTIVE_STREAM = CompileableContextVar("attn_res_stream")


# False inside `unchained_full_points()`: Full's points run one at a time in training too (never read when traced)
_FULL_CHAIN = contextvars.ContextVar("attn_res_full_chain", default=True)


@contextlib.contextmanager
def unchained_full_points():
    """Within the block, Full's training forwards run their points one at a time instead of as a chain: the same
    gradients, summed by autograd (for comparisons; docs/design.md section 3). A backward that replays a checkpointed
    layer must run within it too."""
    token = _FULL_CHAIN.set(False)
    try:
        yield
    finally:
        _FULL_CHAIN.reset(token)


def _stream_options(config, records: Records | None, inference: bool, training: bool) -> dict:
    """`training`: the forward has a backward (or reentrant checkpointing will replay it with one). Full's points then
    form a chain (`attnres.ops.chain`), except where traced (`torch.compile` takes the functional op) or within
    `unchained_full_points()`."""
    return dict(
        block_size=config.attn_res_block_size,
        rescale_mixture=config.attn_res_rescale_mixture,
        two_phase=config.attn_res_two_phase,
        record_weights=records is not None and records.depth,
        inference=inference,
        chain=training and not torch.compiler.is_compiling() and _FULL_CHAIN.get(),
    )


def _on_bank_path(state: ResidualState) -> bool:
    """Whether the layers before took Block's fused bank path: only it leaves a sublayer output pending."""
    return state.pending is not None


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """A family decoder layer's children (same names, so checkpoints convert key for key) plus, for Full and Block,
    the K3-named pseudo-queries and key norms of its two aggregation points.

    `sides` is what the family layer computes in each sublayer (`attnres.models.family.Sublayer`): the model's
    `attn_res_layer_plan`, installed by `install_plan`. Activation checkpointing (`gradient_checkpointing_enable`,
    or torch's `checkpoint_wrapper`) recomputes the whole layer from the state it took.
    """

    def __init__(self, family_layer: nn.Module, layer_idx: int, config, dim: int, eps: float):
        super().__init__()
        self.family_layer_cls = type(family_layer)
        for name, value in vars(family_layer).items():  # plain attributes its forward reads (attention_type, ...)
            if not name.startswith("_") and name not in ("training", "gradient_checkpointing"):
                setattr(self, name, value)
        for name, child in family_layer.named_children():
            self.add_module(name, child)
        self.layer_idx = layer_idx
        self.attn_res_config = config
        self.family_args = frozenset(layer_parameters(self.family_layer_cls))
        self.sides: tuple[Sublayer, Sublayer] | None = None
        self._family_norms: dict[str, type] = {}
        standard = config.residual == STANDARD
        self.points: tuple[NamedPoint, ...] = () if standard else add_points(self, SIDE_NAMES, dim, eps)

    def install_plan(self, sides: tuple[Sublayer, Sublayer]) -> None:
        """Take the layer plan; the PreNorm classes it was read with are kept, so that a norm swapped in later (PEFT,
        a kernel override) runs as its own module instead of being fused as the family's plain RMSNorm."""
        for side in sides:
            for name in (side.norm, side.body, *(n for n, _ in side.post)):
                if not isinstance(getattr(self, name, None), nn.Module):
                    raise ValueError(
                        f"attn_res_layer_plan: names {name!r}, which the {self.family_layer_cls.__name__} decoder "
                        f"layer does not have"
                    )
        self.sides = tuple(sides)
        self._family_norms = {side.norm: type(getattr(self, side.norm)) for side in sides}

    def forward(
        self, hidden_states: torch.Tensor | ResidualState, attn_res_records: Records | None = None, **kwargs
    ) -> ResidualState:
        """hidden_states: the residual state (layer 0: the family's embedding `[batch, seq, d]`; any later layer: the
        `ResidualState` the layer before returned); attn_res_records: what the forward records; kwargs: the family
        layer's own (masks, rotary embeddings, cache). Returns the state after this layer's two sublayers."""
        if self.sides is None:
            raise RuntimeError(
                "attn_res_layer_plan: the model was built on the meta device from a config without a layer plan; call "
                "model.plan_layers() once its weights are materialized"
            )
        records = attn_res_records
        if records is not None and records.layer_inputs is not None:
            records.layer_inputs.append((hidden_states, kwargs))
            return hidden_states
        shared = ACTIVE_STREAM.get()
        stream = None if shared is None else shared.take(self.layer_idx, hidden_states)
        if stream is None:
            shared, stream = None, self._stream(hidden_states, records)
        for k, side in enumerate(self.sides):
            if k == 0 and records is not None and self.layer_idx in records.reads:
                mixture = stream.read()  # what this layer reads as its residual: reported, then normed
                records.mixtures_read[self.layer_idx] = mixture
                x = getattr(self, side.norm)(mixture)
            else:
                x = self._read(stream, side)
            stream.write(run_sublayer(self, side, x, kwargs, self.family_args).to(x.dtype))
        if records is not None and records.depth:
            records.keep_depth(stream, 2 * self.layer_idx)
        if shared is not None:
            return shared.hand_on()
        return _passed_on_as_views(stream.state(), hidden_states)

    def _stream(self, state: torch.Tensor | ResidualState, records: Records | None) -> ResidualStream:
        config = self.attn_res_config
        i, num_layers = self.layer_idx, config.num_hidden_layers
        points = {2 * i + k: point for k, point in enumerate(self.points)}
        if i == 0:
            if not isinstance(state, torch.Tensor):
                raise TypeError(f"hidden_states: decoder layer 0 starts from the embedding tensor, got {type(state)}")
            # no gradient and no backward to replay the layer (reentrant checkpointing runs it without one): the
            # fused bank path (docs/design.md section 5); every later layer follows the state it is handed
            inference = not self._training()
            options = _stream_options(config, records, inference, not inference)
            stream = make_stream(config.residual, state, num_layers, points, **options)
            stream.end_point = 2  # this layer's points only
            return stream
        if not isinstance(state, ResidualState):
            raise TypeError(
                f"hidden_states: decoder layer {i} takes the ResidualState that layer {i - 1} returns, got "
                f"{type(state).__name__} (an AttnRes layer runs inside an AttnRes model's forward)"
            )
        options = _stream_options(config, records, _on_bank_path(state), self._training())
        return resume_stream(config.residual, state, i, num_layers, points, **options)

    def _training(self) -> bool:
        """Whether this forward has a backward, or reentrant checkpointing (which runs it without gradients) will
        replay it with one: the replay must make the same state."""
        return torch.is_grad_enabled() or (self.gradient_checkpointing and self.training)

    def _read(self, stream: ResidualStream, side: Sublayer) -> torch.Tensor:
        norm = getattr(self, side.norm)
        if side.fused_eps is not None and type(norm) is self._family_norms[side.norm]:
            return stream.read(FusedNorm(norm, side.fused_eps))
        return norm(stream.read())  # the family's own norm on the mixture (or a module swapped in for it)


def _passed_on_as_views(state: ResidualState, given: torch.Tensor | ResidualState) -> ResidualState:
    """`state` with every tensor this layer took and hands on unchanged (Block's earlier bank rows, Full's earlier
    sources) replaced by a view of it: each layer's outputs are then its own autograd nodes, whose gradients are
    complete when the backward reaches this layer. Hooks on a layer's outputs fire then (FSDP2 gathers the layer's
    parameters for backward from such hooks); on the taken tensor itself they would fire only when the backward
    reaches the layer that wrote it. Views share storage: nothing is copied. A Full state with a carrier needs none: the
    chain's later points track only its newest source and the carrier (`attnres.ops.chain`), both this layer's own,
    and views of the older sources would never be reached in backward."""
    if not torch.is_grad_enabled() or state.carrier is not None:
        return state
    taken = {id(given)} if isinstance(given, torch.Tensor) else {id(t) for t in (*given.rows, given.head)}

    def own(t):
        return t.view_as(t) if t is not None and id(t) in taken else t

    return state._replace(rows=tuple(own(t) for t in state.rows), head=own(state.head))


class FinalRead:
    """The read before the family's final norm (a forward pre-hook on it): the last `ResidualState` in, the mixture
    over every source out (for "standard": the residual sum). `points`: the final read's point on the base model (none
    for "standard"), which looks its parameters up by name at every call."""

    def __init__(self, config, points: tuple[NamedPoint, ...]):
        self.config, self.points = config, points

    def __call__(self, norm: nn.Module, args: tuple):
        state = args[0]
        if not isinstance(state, ResidualState):
            return None  # a tensor already (a pipeline stage made the read itself)
        return (self.read(state), *args[1:])

    @staticmethod
    def after(norm: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """A forward hook on the final norm: keeps its output when the forward records hidden states."""
        records = ACTIVE_RECORDS.get()
        if records is not None and records.hidden:
            records.final_normed = output

    def read(self, state: ResidualState) -> torch.Tensor:
        shared = ACTIVE_STREAM.get()
        if shared is not None and shared.state is not None and state is shared.state:
            return shared.stream.read()
        config, records = self.config, ACTIVE_RECORDS.get()
        L = config.num_hidden_layers
        points = {2 * L: point for point in self.points}
        options = _stream_options(config, records, _on_bank_path(state), torch.is_grad_enabled())
        stream = resume_stream(config.residual, state, L, L, points, **options)
        final = stream.read()
        if records is not None:
            records.final_state = state
            if L in records.reads:
                records.mixtures_read[L] = final
            if records.depth:
                records.keep_depth(stream, 2 * L)
        return final


def flat_tensor_checkpoint(checkpoint_func):
    """`checkpoint_func` (`torch.utils.checkpoint.checkpoint` with its options) for a function of structures of tensors
    (a layer's `ResidualState`): the function is checkpointed over the flat tensors of its arguments and returns the
    flat tensors of its output, so that reentrant checkpointing, which sees only tensor arguments, gives every tensor
    of the state its gradient. Non-tensor leaves (None) pass around the checkpoint unchanged."""

    @functools.wraps(checkpoint_func)
    def run(function, *args):
        leaves, spec = tree_flatten(args)
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        out = {}

        def flat_function(*tensors):
            filled = list(leaves)
            for i, tensor in zip(at, tensors):
                filled[i] = tensor
            out["leaves"], out["spec"] = tree_flatten(function(*tree_unflatten(filled, spec)))
            return tuple(leaf for leaf in out["leaves"] if isinstance(leaf, torch.Tensor))

        tensors = iter(checkpoint_func(flat_function, *(leaves[i] for i in at)))
        result = [next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in out["leaves"]]
        return tree_unflatten(result, out["spec"])

    return run
