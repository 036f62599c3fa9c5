"""The AttnRes decoder layer: a family's own decoder-layer modules, their residual rewired. State in, state out.

The family's own base model drives the layers (its embedding, scaling, masks, rotary embeddings and final norm stay
the family's): it calls `hidden_states = layer(hidden_states, **kwargs)` layer after layer and hands the last output
to its final norm. An AttnRes layer takes the residual state as that value and returns the new one (docs/design.md
section 7): layer 0 takes the family's embedding (v_0) and every later layer the state of tensors that the layer
before returned (Block: the bank and the partial sum; Full: every source; standard: the residual sum). How the state
is read and written is the residual object's (`attnres.layers.residuals`): the model's forward makes one for the whole
forward and hands it to every layer as the keyword argument `attn_res_residual`; a layer run alone (a pipeline stage)
makes its own. Each layer reads only its own parameters, so whatever wraps a whole layer (activation checkpointing,
FSDP2, a pipeline stage) works on it. The final read (`FinalRead`) turns the last state into the mixture the family's
final norm normalises.

What a forward is asked to record (hidden states, depth weights, drafter captures) is output, not state: a `Records`
collector, keyed by layer and point, that the residual object's reads fill. Activation checkpointing replays a layer
with the same residual object: the recompute reads the same way (unfused where a mixture is kept) and overwrites its
own entries.
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

from attnres.layers import make_residual
from attnres.layers.depth_attention import KeyNorm, NamedPoint, PseudoQuery
from attnres.layers.kinds import STANDARD
from attnres.layers.residuals import PreNorm, Recorder, Residual, ResidualState
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


@dataclass
class Records(Recorder):
    """What one forward records besides its output (and `Recorder`'s depth weights and mixtures).

    reads: decoder layers whose residual read to keep (the pre-norm mixture its attention side forms; `num_layers`:
    the final read), each as `mixtures_read[layer]`; hidden: the hidden-state entries to report (the model's output);
    capture: the layers to capture; final_state: the state the final read consumed; final_normed: the family's final
    norm output.
    """

    reads: frozenset[int] = frozenset()
    hidden: tuple[int, ...] = ()
    capture: tuple[int, ...] = ()
    mixtures_read: dict[int, torch.Tensor] = field(default_factory=dict)
    final_state: ResidualState | None = None
    final_normed: torch.Tensor | None = None

    def keeps(self, point: int) -> bool:
        return point % 2 == 0 and point // 2 in self.reads

    def keep(self, point: int, mixture: torch.Tensor) -> None:
        self.mixtures_read[point // 2] = mixture


# the residual object of the forward running now, for the final read (set by the model's forward, as transformers'
# own output collector)
ACTIVE_RESIDUAL = CompileableContextVar("attn_res_residual")


# False inside `unchained_points()`: Full's and Block's points run one at a time in training too (never read when
# traced)
_CHAIN = contextvars.ContextVar("attn_res_chain", default=True)


@contextlib.contextmanager
def unchained_points():
    """Within the block, Full's and Block's training forwards run their points one at a time instead of as a chain:
    the same gradients, summed by autograd (for comparisons; docs/design.md section 3). A backward that replays a
    checkpointed layer must run within it too."""
    token = _CHAIN.set(False)
    try:
        yield
    finally:
        _CHAIN.reset(token)


def residual_for(
    config, points, *, backward: bool, records: Records | None = None, layerwise: bool = False,
    checkpointing: bool = False, chain: bool = True,
) -> Residual:
    """The residual object of a forward (or of a layer or final read run alone) over `points`.

    `backward`: the forward has a backward, or reentrant checkpointing will replay it with one: the autograd residuals
    (Full's and Block's one-shot points a chain, except where traced, as `torch.compile` takes the functional op, or
    within `unchained_points()`, or without `chain`). Otherwise the inference backends: Block's fused bank
    (docs/design.md section 5) and Full's direct kernel calls; `layerwise` where each layer's weights are at hand
    during its own forward only (FSDP2).
    Full's phase-1 groups are as `attn_res_full_group` sets them; chosen (None), none under FSDP2 or activation
    `checkpointing`, which keeps only each layer's input (a group keeps each point's u, `[tokens, d]` fp32).
    """
    group = config.attn_res_full_group
    if layerwise or (group is None and checkpointing):
        group = 0
    return make_residual(
        config.residual,
        config.num_hidden_layers,
        points,
        block_size=config.attn_res_block_size,
        rescale_mixture=config.attn_res_rescale_mixture,
        two_phase=config.attn_res_two_phase,
        record=records,
        inference=not backward,
        layerwise=layerwise,
        chain=chain and backward and not torch.compiler.is_compiling() and _CHAIN.get(),
        full_group=group,
    )


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """A family decoder layer's children (same names, so checkpoints convert key for key) plus, for Full and Block,
    the K3-named pseudo-queries and key norms of its two aggregation points.

    `sides` is what the family layer computes in each sublayer (`attnres.models.family.Sublayer`): the model's
    `attn_res_layer_plan`, installed by `install_plan`. `chained`: run alone (a pipeline stage), its points form chains
    in training (`attnres.ops.chain`); a stage whose schedule runs parts of the backward twice turns it off.
    Activation checkpointing (`gradient_checkpointing_enable`, or torch's `checkpoint_wrapper`) recomputes the whole
    layer from the state it took.
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
        self._held: dict[str, frozenset[str]] = {}
        self.chained = True
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
        self._held = {side.body: side.held_arguments(self.family_args) for side in sides}

    def forward(self, hidden_states, attn_res_residual: Residual | None = None, **kwargs):
        """hidden_states: the residual state (layer 0: the family's embedding `[batch, seq, d]`; any later layer: the
        state the layer before returned); attn_res_residual: the forward's residual object; kwargs: the family
        layer's own (masks, rotary embeddings, cache). Returns the state after this layer's two sublayers."""
        residual = attn_res_residual or self.own_residual()
        attention, mlp = self.plan()
        state = residual.enter(self.layer_idx, hidden_states)
        x, state = residual.read(state, 2 * self.layer_idx, self.prenorm(attention))
        state = residual.write(state, self.sublayer(attention, x, kwargs))
        x, state = residual.read(state, 2 * self.layer_idx + 1, self.prenorm(mlp))
        state = residual.write(state, self.sublayer(mlp, x, kwargs))
        return passed_on_as_views(state, hidden_states)

    def plan(self) -> tuple[Sublayer, Sublayer]:
        if self.sides is None:
            raise RuntimeError(
                "attn_res_layer_plan: the model was built on the meta device from a config without a layer plan; call "
                "model.plan_layers() once its weights are materialized"
            )
        return self.sides

    def prenorm(self, side: Sublayer) -> PreNorm:
        """The side's PreNorm: fused into the read when it is the family's plain RMSNorm, the module the plan was read
        with (a module swapped in for it runs as itself)."""
        norm = self._modules[side.norm]  # the registry itself: nn.Module.__getattr__ searches it at a cost
        return PreNorm(norm, side.fused_eps if type(norm) is self._family_norms[side.norm] else None)

    def sublayer(self, side: Sublayer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """What the family's sublayer adds to its residual, for the normed input `x`."""
        out = run_sublayer(self, side, x, kwargs, self._held[side.body])
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def own_residual(self) -> Residual:
        """The residual object of this layer run outside a model's forward (a pipeline stage): over its own points."""
        points = {2 * self.layer_idx + k: point for k, point in enumerate(self.points)}
        backward = torch.is_grad_enabled() or (self.gradient_checkpointing and self.training)
        return residual_for(self.attn_res_config, points, backward=backward, chain=self.chained)


def passed_on_as_views(state: ResidualState, given) -> ResidualState:
    """`state` with every tensor this layer took and hands on unchanged (Block's earlier bank rows, Full's earlier
    sources) replaced by a view of it: each layer's outputs are then its own autograd nodes, whose gradients are
    complete when the backward reaches this layer. Hooks on a layer's outputs fire then (FSDP2 gathers the layer's
    parameters for backward from such hooks); on the taken tensor itself they would fire only when the backward
    reaches the layer that wrote it. Views share storage: nothing is copied. A state with a carrier needs none: the
    chain's later points (`attnres.ops.chain`) track only the carrier and Full's newest source or Block's prefix (which
    a write point takes as its new bank row), this layer's own, and views of the older sources would never be reached
    in backward. Phase-1 groups (never under FSDP2) carry one too: their later reads track the sources of their own
    group and the groups' carrier, and view nodes would only cost."""
    if not torch.is_grad_enabled() or state.carrier is not None:
        return state
    taken = {id(given)} if isinstance(given, torch.Tensor) else {id(t) for t in (*given.rows, given.head)}

    def own(t):
        return t.view_as(t) if t is not None and id(t) in taken else t

    return state._replace(rows=tuple(own(t) for t in state.rows), head=own(state.head))


class LayerInputs(nn.Module):
    """Stands in for decoder layer `layer_idx` while the family's base model hands out the layers' inputs
    (`AttnResPreTrainedModel.layer_inputs`): appends (hidden states, keyword arguments) to `inputs` and runs nothing."""

    def __init__(self, layer_idx: int, inputs: list):
        super().__init__()
        self.layer_idx, self.inputs = layer_idx, inputs

    def forward(self, hidden_states, **kwargs):
        self.inputs.append((hidden_states, kwargs))
        return hidden_states


class FinalRead:
    """The read before the family's final norm (a forward pre-hook on it): the last state in, the mixture over every
    source out (for "standard": the residual sum). `points`: the final read's point on the base model (none for
    "standard"), which looks its parameters up by name at every call."""

    def __init__(self, config, points: tuple[NamedPoint, ...]):
        self.config, self.points = config, points

    def __call__(self, norm: nn.Module, args: tuple):
        if isinstance(args[0], torch.Tensor):
            return None  # a tensor already (a pipeline stage made the read itself)
        return (self.read(args[0]), *args[1:])

    @staticmethod
    def after(norm: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """A forward hook on the final norm: keeps its output when the forward records hidden states."""
        residual = ACTIVE_RESIDUAL.get()
        records = None if residual is None else residual.record
        if records is not None and records.hidden:
            records.final_normed = output

    def read(self, state) -> torch.Tensor:
        L = self.config.num_hidden_layers
        residual = ACTIVE_RESIDUAL.get()
        if residual is None:
            residual = residual_for(self.config, {2 * L: p for p in self.points}, backward=torch.is_grad_enabled())
        if residual.record is not None:
            residual.record.final_state = state
        return residual.read(state, 2 * L)[0]


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
