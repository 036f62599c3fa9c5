"""Tensor + sequence parallel on `torch.distributed.tensor.parallel` (docs/design.md section 8), applied onto an
unchanged AttnRes model as torchtitan applies its TP plan.

Inside each sublayer the family's own transformers TP plan (`base_model_tp_plan`: q/k/v and gate/up `ColwiseParallel`,
o/down `RowwiseParallel`) splits the attention heads and the MLP columns over the P ranks of a 1-D `DeviceMesh`.
Outside the sublayers everything AttnRes keeps (the Block bank rows and prefix, the Full sources, the standard
residual) lives sharded along the sequence: each rank holds tokens `[r*T/P, (r+1)*T/P)` of every row, and the depth
attention, which never mixes tokens, runs there on plain local tensors with no communication (our ops need no DTensor
rules). Each sublayer body all-gathers its normed input along the sequence (`PrepareModuleInput`: Shard(1) ->
Replicate) and reduce-scatters its output (`RowwiseParallel`'s partial sums -> Shard(1), `PrepareModuleOutput`).

The family's base model computes the rotary embeddings and the attention mask for the whole sequence, which is what
the gathered attention body sees. Around the stream:
- the embedding is vocabulary-parallel (`RowwiseParallel`, all-reduced to every token) and the first decoder layer
  keeps its rank's tokens (Replicate -> Shard(1), a local slice);
- the final read's mixture is all-gathered before the final norm, and the head is `ColwiseParallel` over the
  vocabulary with its logits gathered, so logits and loss are the one-process ones on every rank (gather before the
  head, not loss parallel: the family's own loss and `logits_to_keep` run unchanged).
Every parameter is a DTensor on the mesh, as in torchtitan, so that optimizers (foreach ones included), gradient
clipping and `torch.distributed.checkpoint` see one kind of parameter. Those outside the TP plan (pseudo-queries, key
gains, the sublayer and final norms, per-head norms inside a body) are replicated; for the length of the base model's
forward their modules hold local views of them (`to_local`, as FSDP2 swaps in its unsharded parameters), so that the
stream and our ops see plain tensors; under activation checkpointing until the backward is over, since it recomputes
whole decoder layers. A view that acts on this rank's tokens or heads only gets a partial gradient,
all-reduced over the mesh in backward (transformers' `replicated_with_grad_allreduce`, Megatron's sequence-parallel
norms); the final norm's acts on every token (gathered) and needs none.

A forward whose token count is not a multiple of P (a decode step: one token) runs with the residual state
replicated instead: every layout above that says Shard(1) says Replicate for that forward, so the sublayer outputs
are all-reduced and the KV cache (each rank's heads, every token) carries on from the sharded prefill. Recording
gradients needs the sharded layout (a multiple of P tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from attnres.distributed.data_parallel import collective

SEQUENCE = Shard(1)  # [batch, seq, hidden]: the layout of the residual state between sublayers
# what the family's transformers TP plan may say about a linear inside a sublayer body
_LINEAR_STYLES = ("colwise", "rowwise")
_LOCAL_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"  # a per-head norm: one of our replicated parameters


class TensorParallel:
    """What `parallelize_tensor` applied to a model: its `mesh`, and the layouts that change with each forward.

    `sequence_sharded` says how the last forward ran: True when its T tokens were split T/P a rank, False when the
    residual state was replicated (T not a multiple of P, e.g. a decode step).
    """

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.sequence_sharded = True
        self._shard_inputs: list[PrepareModuleInput] = []  # Replicate -> (sequence layout): the stream's start
        self._gather_inputs: list[PrepareModuleInput] = []  # (sequence layout) -> Replicate: bodies, final norm
        self._reduce_outputs: list[PrepareModuleOutput] = []  # partial sums -> (sequence layout): body outputs
        self._replicated: list[_Replicated] = []
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self.held = False  # a caller that runs the layers itself (a pipeline chunk) began the forward
        self.checkpointing = lambda: False  # whether the layers recompute themselves in backward

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    def local_tokens(self, seq_len: int) -> slice:
        """The sequence positions this rank holds in a forward of `seq_len` tokens (all of them when replicated)."""
        if seq_len % self.world_size:
            return slice(0, seq_len)
        per_rank = seq_len // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def begin(self, seq_len: int, held: bool = False) -> None:
        """Start a forward of `seq_len` tokens: the layouts, and the local views of the replicated parameters.
        `held`: the caller runs the decoder layers itself, outside the base model's forward (a pipeline chunk), and
        calls `end` after them; the base model's hooks then leave both alone."""
        self._use_layout(seq_len)
        self._use_local_views()
        self.held = held

    def end(self, output: torch.Tensor) -> None:
        """End a forward begun with `held=True`; `output` is what it returns (its backward ends the views' use when
        the layers recompute themselves)."""
        self.held = False
        self._end_forward(output, self.checkpointing())

    def _end_base_forward(self, output) -> None:
        if not self.held:
            self._end_forward(getattr(output, "last_hidden_state", None), self.checkpointing())

    def _use_layout(self, seq_len: int) -> None:
        """Switch every sequence-side layout for a forward of `seq_len` tokens (a base-model forward pre-hook).

        `PrepareModuleInput` and `PrepareModuleOutput` hooks read their style's layouts at each call, so setting them
        here switches the whole model."""
        sharded = seq_len % self.world_size == 0
        if not sharded and torch.is_grad_enabled():
            raise ValueError(
                f"input_ids: a forward that records gradients on {self.world_size} tensor-parallel ranks needs a "
                f"sequence length that is a multiple of {self.world_size}, got {seq_len}"
            )
        self.sequence_sharded = sharded
        layout = SEQUENCE if sharded else Replicate()
        for style in self._shard_inputs:
            style.desired_input_layouts = (layout,)
        for style in self._gather_inputs:
            if style.input_layouts is not None:
                style.input_layouts = (layout,)
            style.input_kwarg_layouts = dict.fromkeys(style.input_kwarg_layouts, layout)
        for style in self._reduce_outputs:
            style.desired_output_layouts = (layout, *style.desired_output_layouts[1:])

    def _use_local_views(self) -> None:
        """Give each replicated parameter's module a local view of it for this forward (a base-model pre-hook)."""
        self._restore()  # a forward that raised before its post-hook ran, or whose backward never came
        group = self.mesh.get_group()
        for module, name, partial_grad in self._replicated:
            param = module._parameters[name]  # whatever holds it now (FSDP may have swapped in its own)
            self._swapped.append((module, name, param))
            view = param.to_local()
            module._parameters[name] = _SumGradOverRanks.apply(view, group) if partial_grad else view

    def _end_forward(self, hidden, checkpointing: bool) -> None:
        """Give the parameters back after the forward (a base-model hook), or, when activation checkpointing will
        recompute layers in backward, once the backward is over: the recompute reads the same local views."""
        if not (checkpointing and isinstance(hidden, torch.Tensor) and hidden.requires_grad):
            self._restore()
            return

        def restore_after_backward(grad: torch.Tensor) -> torch.Tensor:
            torch.autograd.Variable._execution_engine.queue_callback(self._restore)
            return grad

        hidden.register_hook(restore_after_backward)

    def _restore(self) -> None:
        for module, name, param in self._swapped:
            module._parameters[name] = param
        self._swapped.clear()


class _Replicated(NamedTuple):
    module: nn.Module
    name: str
    partial_grad: bool  # its local view acts on this rank's tokens or heads only


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks (Megatron's copy to the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        collective(lambda: dist.all_reduce(grad, group=ctx.group), "summing a replicated parameter's gradient")
        return grad, None


def _replicate(tp: TensorParallel, model: nn.Module, whole: set[int]) -> None:
    """Every parameter the TP plan left plain becomes a Replicate DTensor; the local views of those not in `whole`
    (ids) sum their gradients over the ranks."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            module._parameters[name] = nn.Parameter(
                DTensor.from_local(param.detach(), tp.mesh, [Replicate()], run_check=False),
                requires_grad=param.requires_grad,
            )
            tp._replicated.append(_Replicated(module, name, id(param) not in whole))


def parallelize_tensor(model: nn.Module, mesh: DeviceMesh | None = None) -> TensorParallel:
    """Split `model` (an `AttnResForCausalLM` or `AttnResModel`) in place over the 1-D `mesh` (default: every rank
    of the default process group, on the device type of the model's weights); see the module docstring.

    Every rank passes the same model (same weights, e.g. the same seed or checkpoint) and then runs the same forwards
    on the same inputs; outputs (logits, loss, `last_hidden_state`) are whole on every rank, while the residual state
    of a forward (`residual_state`, `captured_hidden_states`, `depth_mixtures`) holds this rank's
    `local_tokens(T)` only. Returns the `TensorParallel` handle.
    """
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError(
                "mesh: expected a DeviceMesh or an initialized process group (torchrun, init_process_group)"
            )
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise ValueError(f"mesh: expected a 1-D DeviceMesh of tensor-parallel ranks, got {mesh.ndim} dimensions")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model: it is already parallelized (it holds DTensor parameters)")
    if not model.is_planned():
        model.plan_layers()
    base = model.model
    layers = [layer for layer in base.layers if layer.sides]  # a pipeline stage: its own
    body_plan = _body_plan(model.config, layers[0].sides, mesh.size())
    tp = TensorParallel(mesh)

    embed = getattr(base, "embed_tokens", None)  # None on a pipeline stage without the embedding
    head = getattr(model, "lm_head", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if embed is not None:
        parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for layer in layers:
        for side in layer.sides:
            _parallelize_body(tp, getattr(layer, side.body), side, body_plan[side.body], mesh)
    if embed is not None:  # the stream starts at layer 0, on the rank that embeds
        tp._shard_inputs.append(PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=SEQUENCE,
                                                   use_local_output=True))
        parallelize_module(base.layers[0], mesh, tp._shard_inputs[-1])
    if head is not None:  # the stream ends at the final norm, on the rank with the head
        tp._gather_inputs.append(PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate(),
                                                    use_local_output=True))
        parallelize_module(base.norm, mesh, tp._gather_inputs[-1])
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
        if tied:
            head.weight = embed.weight  # both vocabulary rows, Shard(0): one parameter again
    # the final norm sees every token (gathered); every other replicated parameter this rank's tokens or heads only
    _replicate(tp, model, whole={id(p) for p in base.norm.parameters()} if head is not None else set())
    tp.checkpointing = lambda: any(layer.gradient_checkpointing and layer.training for layer in layers)
    base.register_forward_pre_hook(_forward_hook(tp), with_kwargs=True)
    base.register_forward_hook(lambda module, args, output: tp._end_base_forward(output), always_call=True)
    return tp


def _forward_hook(tp: TensorParallel):
    """A base-model forward pre-hook: the layout of this forward, from its token count, and the local views."""
    def begin(module, args, kwargs):
        if tp.held:
            return
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        tokens = args[0] if tokens is None and args else tokens
        tp.begin(tokens.shape[1])

    return begin


def _parallelize_body(tp: TensorParallel, body: nn.Module, side, linears: dict[str, str], mesh: DeviceMesh) -> None:
    """Heads or columns of one sublayer body over the mesh, its input gathered along the sequence (kept a Replicate
    DTensor into the linears, so that backward reduce-scatters the summed input gradient once) and its output
    reduced back to the sequence layout as local tensors."""
    for name, style in linears.items():
        if style == "colwise":
            parallelize_module(body, mesh, {name: ColwiseParallel()})
        else:  # the body's output projection: partial sums, reduced by the body's output hook
            parallelize_module(body, mesh, {name: RowwiseParallel(output_layouts=Partial(), use_local_output=False)})
    if side.body_kwarg_input:
        gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQUENCE},
                                    desired_input_kwarg_layouts={"hidden_states": Replicate()})
    else:
        gather = PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate())
    outputs: tuple[Placement | None, ...] = (Partial(), None) if side.tuple_output else (Partial(),)
    reduce = PrepareModuleOutput(output_layouts=outputs, desired_output_layouts=(SEQUENCE, *outputs[1:]))
    parallelize_module(body, mesh, gather)
    parallelize_module(body, mesh, reduce)
    tp._gather_inputs.append(gather)
    tp._reduce_outputs.append(reduce)


def _body_plan(config, sides, world_size: int) -> dict[str, dict[str, str]]:
    """{body name: {linear name: "colwise" | "rowwise"}} from the family's transformers TP plan, checked."""
    family = config.base_model_type
    text = config.text_config
    plan = getattr(text, "base_model_tp_plan", None) or {}
    bodies = {side.body: {} for side in sides}
    for key, style in plan.items():
        parts = key.split(".")
        if parts[:2] != ["layers", "*"] or len(parts) < 3 or parts[2] not in bodies:
            continue
        if len(parts) == 4 and style in _LINEAR_STYLES:
            bodies[parts[2]][parts[3]] = style
        elif len(parts) != 4 or style != _LOCAL_GRAD_ALLREDUCE:
            raise ValueError(
                f"base_model_type: the {family!r} TP plan shards {key!r} as {style!r}; AttnRes tensor parallel "
                f"supports colwise/rowwise linears (dense attention and MLP), not {style!r}"
            )
    for body, linears in bodies.items():
        if list(linears.values()).count("rowwise") != 1 or "colwise" not in linears.values():
            raise ValueError(
                f"base_model_type: the {family!r} transformers TP plan gives sublayer {body!r} {linears or 'nothing'}; "
                f"tensor parallel needs column-parallel input projections and one row-parallel output projection"
            )
    sizes = {"num_attention_heads": text.num_attention_heads,
             "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
             "intermediate_size": text.intermediate_size, "vocab_size": text.vocab_size}
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"mesh: {name} = {size} does not split over {world_size} tensor-parallel ranks")
    return bodies
