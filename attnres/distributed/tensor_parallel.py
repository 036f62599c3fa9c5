"""Tensor + sequence parallel on `torch.distributed.tensor.parallel` (docs/design.md section 8), applied onto an
unchanged AttnRes model as torchtitan applies its TP plan.

Inside each sublayer the family's own transformers TP plan (`base_model_tp_plan`: q/k/v and gate/up `ColwiseParallel`,
o/down `RowwiseParallel`) splits the attention heads and the MLP columns over the P ranks of a 1-D `DeviceMesh`. An
MoE sublayer's experts (Qwen3-MoE, Mixtral) are split by transformers' own expert-parallel styles from the family's
`base_model_ep_plan` (each rank holds E/P whole experts, `grouped_gemm`); its router sees every token, replicated.
Outside the sublayers everything AttnRes keeps (the Block bank rows and prefix, the Full sources, the standard
residual) lives sharded along the sequence: each rank holds tokens `[r*T/P, (r+1)*T/P)` of every row, and the depth
attention, which never mixes tokens, runs there on plain local tensors with no communication (our ops need no DTensor
rules). Each sublayer body all-gathers its normed input along the sequence (`PrepareModuleInput`: Shard(1) ->
Replicate) and reduce-scatters its output (`RowwiseParallel`'s partial sums -> Shard(1), `PrepareModuleOutput`; an
MoE sublayer's output, all-reduced by transformers' `ep_dispatch_experts` in its `all_reduce` implementation, is
sliced instead).

The family's base model computes the rotary embeddings and the attention mask for the whole sequence, which is what
the gathered attention body sees. Around the stream:
- the embedding is vocabulary-parallel (`RowwiseParallel`, all-reduced to every token) and the first decoder layer
  keeps its rank's tokens (Replicate -> Shard(1), a local slice);
- the final read's mixture is all-gathered before the final norm, and the head is `ColwiseParallel` over the
  vocabulary with its logits gathered, so logits and loss are the one-process ones on every rank (gather before the
  head, not loss parallel: the family's own loss and `logits_to_keep` run unchanged).
Every parameter is a DTensor on the mesh, as in torchtitan, so that optimizers (foreach ones included), gradient
clipping and `torch.distributed.checkpoint` see one kind of parameter. Those outside the TP plan (pseudo-queries, key
gains, the sublayer and final norms, per-head norms inside a body) are Replicate DTensors, and nothing swaps them:
- the family's norms compute on DTensors (`ReplicatedCompute`, torchtitan's `SequenceParallel` for norms): their
  input is declared as laid out (this rank's tokens, or its heads inside a body), so DTensor gives their weights a
  Partial gradient that the optimizer and the clipping sum over the ranks;
- our ops, which take plain tensors, read the pseudo-queries, key gains and fused norm weights through
  `local_weight` (`to_local` with a Partial gradient), the same sum by the same path.

A forward whose token count is not a multiple of P (a decode step: one token) runs with the residual state
replicated instead: every layout above that says Shard(1) says Replicate for that forward, so the sublayer outputs
are all-reduced and the KV cache (each rank's heads, every token) carries on from the sharded prefill. Recording
gradients needs the sharded layout (a multiple of P tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils._pytree import tree_map_only

from attnres.models.loading import ATTNRES_SUFFIXES

SEQUENCE = Shard(1)  # [batch, seq, hidden]: the layout of the residual state between sublayers
HEADS = Shard(-2)  # [batch, seq, heads, head_dim]: a per-head norm's input inside an attention body
_PER_HEAD_NORM = "replicated_with_grad_allreduce"  # a norm on this rank's heads, replicated
# what the family's transformers TP plan may say inside a dense sublayer body
_DENSE_STYLES = ("colwise", "rowwise", _PER_HEAD_NORM)
# an MoE body: its experts module and the expert-parallel style transformers gives it, which dispatches the body's
# tokens (every rank holds all of them, gathered) by an all-reduce: each rank runs its own experts on every token
_EXPERTS, _EXPERTS_STYLE, _EXPERTS_DISPATCH = "experts", "ep_dispatch_experts", "all_reduce"


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
        self._sequence_norms: list[ReplicatedCompute] = []  # norms on the residual side: (sequence layout)

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

    def use_layout(self, seq_len: int) -> None:
        """Switch every sequence-side layout for a forward of `seq_len` tokens: the base model's forward pre-hook, or
        a caller that runs the decoder layers itself (a pipeline chunk).

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
        for style in self._sequence_norms:
            style.layout = layout


class ReplicatedCompute(ParallelStyle):
    """A module outside the TP plan (a norm) whose parameters are Replicate DTensors, computed by DTensor: its plain
    input is declared as `layout` lays it out (this rank's tokens, or its heads inside a body; read at each call), and
    its output is plain again before any other forward hook of the module sees it. A norm that saw this rank's tokens
    or heads only gives its weight a Partial gradient, which the optimizer and the clipping sum over the ranks."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(module, args):
            x, *rest = args
            if isinstance(x, DTensor):
                return None
            return (DTensor.from_local(x, device_mesh, (self.layout,), run_check=False), *rest)

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(lambda module, args, out: tree_map_only(DTensor, DTensor.to_local, out),
                                     prepend=True)
        return module


def _replicate(model: nn.Module, mesh: DeviceMesh, computed: set[int]) -> None:
    """Every parameter the TP plan left plain becomes a Replicate DTensor (the ranks hold the same values already).
    Each must be read by DTensor (a `ReplicatedCompute` module's: ids in `computed`) or through `local_weight` (an
    AttnRes query or key gain): one that a family module reads itself would meet plain activations."""
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in computed and not f"{prefix}.{name}".endswith(ATTNRES_SUFFIXES):
                raise ValueError(
                    f"model: tensor parallel cannot run {prefix}.{name}: it is neither in the family's TP plan, nor "
                    f"a norm or an AttnRes weight that runs replicated"
                )
            module._parameters[name] = nn.Parameter(
                DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False),
                requires_grad=param.requires_grad,
            )


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
    _check_sizes(model.config, mesh.size())
    family_plan = _family_plan(model.config, layers[0].sides)
    tp = TensorParallel(mesh)

    embed = getattr(base, "embed_tokens", None)  # None on a pipeline stage without the embedding
    head = getattr(model, "lm_head", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if embed is not None:
        parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        embed.weight.register_post_accumulate_grad_hook(_grad_as_held)
    computed: set[int] = set()  # the plain parameters DTensor computes with (ReplicatedCompute modules')

    def compute_replicated(module: nn.Module, style: ReplicatedCompute) -> None:
        parallelize_module(module, mesh, style)
        computed.update(id(p) for p in module.parameters())

    for layer in layers:
        for side in layer.sides:
            body = getattr(layer, side.body)
            plan = _body_plan(model.config, side.body, body, family_plan[side.body], mesh.size())
            _parallelize_body(tp, body, side, plan, mesh)
            for name, style in plan.items():
                if style == _PER_HEAD_NORM:  # this rank's heads
                    compute_replicated(body.get_submodule(name), ReplicatedCompute(HEADS))
            if _is_moe(plan):  # the router sees every token (the body's gathered input)
                for name, child in body.named_children():
                    if name != _EXPERTS:
                        compute_replicated(child, ReplicatedCompute(Replicate()))
            for name in (side.norm, *(name for name, _ in side.post)):  # on the residual side: this rank's tokens
                tp._sequence_norms.append(ReplicatedCompute(SEQUENCE))
                compute_replicated(getattr(layer, name), tp._sequence_norms[-1])
    if embed is not None:  # the stream starts at layer 0, on the rank that embeds
        tp._shard_inputs.append(PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=SEQUENCE,
                                                   use_local_output=True))
        parallelize_module(base.layers[0], mesh, tp._shard_inputs[-1])
    if head is not None:  # the stream ends at the final norm, on the rank with the head: every token, gathered
        tp._gather_inputs.append(PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate()))
        parallelize_module(base.norm, mesh, tp._gather_inputs[-1])
        compute_replicated(base.norm, ReplicatedCompute(Replicate()))
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
        if tied:
            head.weight = embed.weight  # both vocabulary rows, Shard(0): one parameter again
    _replicate(model, mesh, computed)
    base.register_forward_pre_hook(_forward_hook(tp), with_kwargs=True)
    return tp


def _grad_as_held(param: nn.Parameter) -> None:
    """The vocabulary-parallel embedding's gradient arrives whole on every rank (Replicate): keep the rows this rank
    holds (a local slice, no communication), not a whole vocabulary's gradient beside a shard of it."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements and all(
            isinstance(p, Replicate) for p in grad.placements):
        param.grad = grad.redistribute(placements=param.placements)


def _forward_hook(tp: TensorParallel):
    """A base-model forward pre-hook: the layout of this forward, from its token count."""
    def begin(module, args, kwargs):
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        tokens = args[0] if tokens is None and args else tokens
        tp.use_layout(tokens.shape[1])

    return begin


def _parallelize_body(tp: TensorParallel, body: nn.Module, side, plan: dict[str, str], mesh: DeviceMesh) -> None:
    """Heads, columns or expert columns of one sublayer body over the mesh, its input gathered along the sequence
    (kept a Replicate DTensor, so that backward reduce-scatters the summed input gradient once) and its output
    reduced back to the sequence layout as local tensors.

    A dense body's output projection leaves partial sums, reduce-scattered by the body's output hook. An MoE body's
    experts run transformers' own expert-parallel styles ("grouped_gemm": E/P whole experts a rank;
    "ep_dispatch_experts" with the "all_reduce" implementation: every rank runs its experts on every token, the routes
    to other ranks' experts masked, and all-reduces their output and the gradients of their inputs); its output is then
    whole, and the output hook keeps this rank's tokens."""
    if _is_moe(plan):
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        # the ranks that share a batch are the expert group itself: the body's input is gathered on every rank
        apply_expert_parallelism(body, mesh, mesh, plan, ep_implementation=_EXPERTS_DISPATCH)
        output: Placement = Replicate()
    else:
        for name, style in plan.items():
            if style == "colwise":
                parallelize_module(body, mesh, {name: ColwiseParallel()})
            elif style == "rowwise":
                parallelize_module(body, mesh,
                                   {name: RowwiseParallel(output_layouts=Partial(), use_local_output=False)})
        output = Partial()
    if side.body_kwarg_input:
        gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQUENCE},
                                    desired_input_kwarg_layouts={"hidden_states": Replicate()})
    else:
        gather = PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate())
    outputs: tuple[Placement | None, ...] = (output, None) if side.tuple_output else (output,)
    reduce = PrepareModuleOutput(output_layouts=outputs, desired_output_layouts=(SEQUENCE, *outputs[1:]))
    parallelize_module(body, mesh, gather)
    parallelize_module(body, mesh, reduce)
    tp._gather_inputs.append(gather)
    tp._reduce_outputs.append(reduce)


def _is_moe(plan: dict[str, str]) -> bool:
    return plan.get(_EXPERTS) == _EXPERTS_STYLE


def _family_plan(config, sides) -> dict[str, dict[str, str]]:
    """{body name: {path inside the body: style}}: the family's transformers TP plan on the decoder layers' bodies,
    with its expert-parallel plan for the experts of MoE bodies."""
    text = config.text_config
    plan = {**(getattr(text, "base_model_tp_plan", None) or {}), **(getattr(text, "base_model_ep_plan", None) or {})}
    bodies = {side.body: {} for side in sides}
    for key, style in plan.items():
        layers, star, body, *path = key.split(".")
        if (layers, star) == ("layers", "*") and body in bodies and path:
            bodies[body][".".join(path)] = style
    return bodies


def _body_plan(config, name: str, body: nn.Module, entries: dict[str, str], world_size: int) -> dict[str, str]:
    """The entries of the family plan that name something this body has (an MoE model's dense layers have no
    experts, its sparse ones no dense projections), checked: a dense body (column-parallel input projections, one
    row-parallel output projection, per-head norms) or an MoE body (transformers' expert-parallel styles, nothing
    else)."""
    family = config.base_model_type
    plan = {path: style for path, style in entries.items() if _has(body, path)}
    if _is_moe(plan):
        allowed = {_EXPERTS: _EXPERTS_STYLE, f"{_EXPERTS}.gate_up_proj": "grouped_gemm",
                   f"{_EXPERTS}.down_proj": "grouped_gemm"}
        if plan != allowed:
            raise ValueError(
                f"base_model_type: the {family!r} TP and EP plans give the experts of sublayer {name!r} {plan}; AttnRes "
                f"tensor parallel runs MoE sublayers whose only sharded parts are transformers' expert-parallel "
                f"styles (grouped_gemm gate_up_proj and down_proj, ep_dispatch_experts)"
            )
        _check_split(family, f"sublayer {name!r}", body.get_submodule(_EXPERTS).num_experts, world_size, "experts")
        return plan
    wrong = {path: style for path, style in plan.items() if "." in path or style not in _DENSE_STYLES}
    if wrong:
        path, style = next(iter(wrong.items()))
        raise ValueError(
            f"base_model_type: the {family!r} TP plan shards 'layers.*.{name}.{path}' as {style!r}; AttnRes tensor "
            f"parallel supports colwise/rowwise linears, per-head norms and transformers' MoE expert-parallel styles"
        )
    styles = list(plan.values())
    if styles.count("rowwise") != 1 or "colwise" not in styles:
        raise ValueError(
            f"base_model_type: the {family!r} transformers TP plan gives sublayer {name!r} {plan or 'nothing'}; "
            f"tensor parallel needs column-parallel input projections and one row-parallel output projection"
        )
    for path, style in plan.items():
        if style == "colwise":
            _check_split(family, f"{name}.{path}", body.get_submodule(path).out_features, world_size)
    return plan


def _has(body: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        module = body.get_submodule(owner)
    except AttributeError:
        return False
    return isinstance(getattr(module, leaf, None), (nn.Module, nn.Parameter))


def _check_split(family: str, name: str, size: int, world_size: int, parts: str = "columns") -> None:
    if size % world_size:
        raise ValueError(f"mesh: the {family!r} {name} has {size} {parts}, which do not split over {world_size} "
                         f"tensor-parallel ranks")


def _check_sizes(config, world_size: int) -> None:
    """Heads and vocabulary rows split evenly over the ranks (whole heads: the attention reshapes by them)."""
    text = config.text_config
    sizes = {"num_attention_heads": text.num_attention_heads,
             "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
             "vocab_size": text.vocab_size}
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"mesh: {name} = {size} does not split over {world_size} tensor-parallel ranks")
