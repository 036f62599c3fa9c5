"""Pipeline parallel training on `torch.distributed.pipelining`, with the residual state sent between stages
(docs/design.md section 8).

The model is cut into C = P * V chunks of equal numbers of decoder layers (P ranks, V virtual stages each; chunk c
runs on rank c mod P). Chunk 0 owns the embedding; the last chunk owns the final read, the final norm and the family's
head. A rank keeps only what its chunks run (`keep_stages`): its parameters, gradients and optimizer state are its
stages' share of the model's. Within a stage, tensor parallel splits its layers over the stage's "tp" ranks (the
state then travels as each rank's tokens) and FSDP2 shards each chunk over its data-parallel ranks.
Between chunks travels the residual stream's `state()`: for Block the bank rows and the prefix (the residual add is
already folded into the prefix: a stream's write adds at once), for Full the list of sources, for the standard
residual the hidden sum. Rows travel stacked as one `[n, b, T, d]` tensor, the head (prefix or hidden) as
`[b, T, d]`, where b = batch / microbatches.

Cross-stage caching (`cache_rows`, docs/design.md section 8): with virtual stages the rank of chunk c + 1 ran chunk
c + 1 - P on the same microbatch before, and keeps the rows that chunk ended with; the hop after chunk c sends only
the rows past them. Rows per hop and microbatch, as implemented and tested (e_c = (c + 1) L / C layers done after
chunk c; rows(e) = ceil(e / S) bank rows for Block with block size S in decoder layers, 2e + 1 sources for Full, 0
for the standard residual; head = 1 for Block and standard, 0 for Full):

    without caching:  sent(c) = rows(e_c) + head                                    grows with c: O(C)
    with caching:     sent(c) = rows(e_c) - rows(e_{c+1-P}) + head   for c >= P - 1  bounded: O(P)

Bytes = rows * b * T * d * element size. The paper (arXiv 2603.15031, section 4) gives the totals over the C - 1
hops, in blocks, for N_p blocks produced a chunk: eq. 7, Comm_naive = C (C - 1) / 2 * N_p, and eq. 8, Comm_cached
= P (P - 1) / 2 * N_p + (V - 1) P^2 N_p. With blocks aligned to chunks (N_p = L / (C S) whole) the sums above are
`paper_rows` plus what the paper leaves out or rounds: without caching eq. 7 + (C - 1) (the embedding row b_0
travels on every hop); with caching eq. 8 + (P - 1) - (V - 1) P (N_p - 1) (eq. 8 counts ~P N_p a hop from the
second virtual stage on; the exact increment is the (P - 1) N_p blocks of the chunks since the receiver's previous
one, plus the prefix).

Gradients through cached rows: the later chunk uses them as detached leaves; its backward for a microbatch always
runs before the earlier chunk's (the gradient of chunk c + P flows back through chunk c + 1 to chunk c), so the
earlier chunk's outputs pass through `_ReturnCachedGrads`, whose backward hands the leaves' gradients to the rows.
A chunk sees its microbatches in order 0 .. M-1 in every schedule, which keys the cache per microbatch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from attnres.distributed.ranks import (
    RankFailed, collective, collective_device, is_collective_error, lost_rank_message,
)
from attnres.layers.kinds import BLOCK, FULL, STANDARD
from attnres.layers.residuals import ResidualState

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
_MULTI_CHUNK = ("interleaved", "zero-bubble")  # schedules that run several chunks a rank


@dataclass(frozen=True)
class PipelinePlan:
    """Which decoder layers each of the `ranks * virtual_stages` chunks runs, and which rows each hop sends."""

    residual: str
    num_layers: int
    ranks: int
    virtual_stages: int = 1
    block_size: int | None = None
    cache_rows: bool = True

    @property
    def num_stages(self) -> int:
        return self.ranks * self.virtual_stages

    @property
    def head_rows(self) -> int:
        """1 for the tensor that travels beside the rows (Block prefix, standard hidden sum); Full has none."""
        return 0 if self.residual == FULL else 1

    def rank_of(self, stage: int) -> int:
        """The rank that runs chunk `stage`."""
        return stage % self.ranks

    def layers(self, stage: int) -> range:
        per = self.num_layers // self.num_stages
        return range(stage * per, (stage + 1) * per)

    def rows_after(self, layers: int) -> int:
        """Rows of the residual state after the first `layers` decoder layers (Block bank, Full sources)."""
        if self.residual == BLOCK:
            return -(-layers // self.block_size)  # one row per write layer (layer % S == 0) done
        if self.residual == FULL:
            return 1 + 2 * layers
        return 0

    def cached_rows(self, stage: int) -> int:
        """Rows the rank of `stage` kept from its previous virtual stage on the same microbatch (leading rows)."""
        earlier = stage - self.ranks
        return self.rows_after(self.layers(earlier).stop) if self.cache_rows and earlier >= 0 else 0

    def sent_rows(self, hop: int) -> int:
        """Rows sent from chunk `hop` to chunk `hop + 1` per microbatch, the head included (the module docstring)."""
        return self.rows_after(self.layers(hop).stop) - self.cached_rows(hop + 1) + self.head_rows

    def keeps_rows(self, stage: int) -> bool:
        """Whether `stage`'s rank runs a later virtual stage that uses the rows `stage` ends with."""
        return self.cache_rows and self.residual != STANDARD and stage + self.ranks < self.num_stages


def hop_bytes(plan: PipelinePlan, micro_batch: int, seq_len: int, hidden: int, element_size: int) -> list[int]:
    """Bytes each hop (chunk c to c + 1, c = 0 .. C-2) sends per microbatch, by the formulas of the module docstring."""
    return [plan.sent_rows(c) * micro_batch * seq_len * hidden * element_size for c in range(plan.num_stages - 1)]


def paper_rows(ranks: int, virtual_stages: int, blocks_per_chunk: int) -> tuple[int, int]:
    """The paper's eq. 7 and eq. 8: block rows sent over all hops of one microbatch, without and with caching."""
    P, V, n = ranks, virtual_stages, blocks_per_chunk
    C = P * V
    return C * (C - 1) // 2 * n, P * (P - 1) // 2 * n + (V - 1) * P * P * n


class HopTraffic:
    """What this rank's chunks handed to their PipelineStage for sending: per hop, (rows, bytes) of each microbatch."""

    def __init__(self):
        self.sends: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def record(self, hop: int, tensors: tuple[torch.Tensor, ...], head_rows: int) -> None:
        rows = sum(t.shape[0] for t in tensors[: len(tensors) - head_rows]) + head_rows
        self.sends[hop].append((rows, sum(t.numel() * t.element_size() for t in tensors)))

    def per_hop(self) -> dict[int, tuple[int, int]]:
        """{hop: (rows, bytes) per microbatch}; every microbatch of a hop sends the same."""
        out = {}
        for hop, sends in self.sends.items():
            if len(set(sends)) != 1:
                raise RuntimeError(f"hop {hop}: microbatches sent different amounts {sorted(set(sends))}")
            out[hop] = sends[0]
        return out


class RowCache:
    """One rank's cross-stage cache: the rows a chunk ended with, kept per microbatch for the rank's next virtual
    stage, and the leaves that stage made of them (whose gradients flow back to the rows)."""

    def __init__(self):
        self.kept: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.leaves: dict[tuple[int, int], list[torch.Tensor]] = {}

    def keep(self, key: tuple[int, int], rows: list[torch.Tensor]) -> None:
        self.kept[key] = rows

    def take(self, key: tuple[int, int]) -> list[torch.Tensor]:
        leaves = [row.detach().requires_grad_() for row in self.kept.pop(key)]
        self.leaves[key] = leaves
        return leaves

    def clear(self) -> None:
        self.kept.clear()
        self.leaves.clear()

    def check_empty(self) -> None:
        if self.kept or self.leaves:
            left = sorted(self.kept) + sorted(self.leaves)
            raise RuntimeError(f"cross-stage cache: (chunk, microbatch) entries left after the step: {left}")


class _ReturnCachedGrads(torch.autograd.Function):
    """Identity on a chunk's outputs; its backward also returns, for the rows the rank kept, the gradients that the
    rank's later virtual stage accumulated into its leaves of them."""

    @staticmethod
    def forward(ctx, cache: RowCache, key: tuple[int, int], num_outputs: int, *tensors):
        ctx.cache, ctx.key, ctx.num_outputs = cache, key, num_outputs
        return tuple(t.view_as(t) for t in tensors[:num_outputs])

    @staticmethod
    def backward(ctx, *grads):
        leaves = ctx.cache.leaves.pop(ctx.key)
        return (None, None, None, *grads, *(leaf.grad for leaf in leaves))


class PipelineChunk(nn.Module):
    """The decoder layers `plan.layers(index)` of `model` (an `AttnResForCausalLM`), as one pipeline stage module.

    forward: chunk 0 takes input_ids `[b, T]`; later chunks take ([rows `[n, b, T, d]`,] head `[b, T, d]`) as the
    plan sends them (no rows tensor when n = 0; no head for Full). It returns the same for the next chunk, or, for
    the last, the logits `[b, T, vocab]`. Parameters are the model's own (shared, not copied). `chained`: the layers'
    points form chains in training (`attnres.ops.chain`); not where the schedule splits the backward (zero bubble),
    whose weight pass runs parts of the backward again from the gradients its input pass kept, where a chained point
    would add into its gradient buffer in place once more.
    """

    def __init__(self, model: nn.Module, plan: PipelinePlan, index: int, cache: RowCache, traffic: HopTraffic,
                 tp=None, chained: bool = True):
        super().__init__()
        inner = model.model
        self.plan, self.index, self.cache, self.traffic, self.tp = plan, index, cache, traffic, tp
        self.is_first, self.is_last = index == 0, index == plan.num_stages - 1
        self.layers = nn.ModuleList(inner.layers[i] for i in plan.layers(index))
        for layer in self.layers:
            layer.chained = chained
        if self.is_first:
            self.embed_tokens = inner.embed_tokens
        if self.is_last:
            self.norm, self.lm_head = inner.norm, model.lm_head
            if plan.residual != STANDARD:  # the final read's parameters
                self.output_attn_res_proj = inner.output_attn_res_proj
                self.output_attn_res_norm = inner.output_attn_res_norm
        # in a tuple, not registered: the chunk's parameters are only those it runs
        self._model = (model,)
        self.microbatch = 0  # the next forward's microbatch: a chunk sees them in order

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This chunk's decoder layers on the state the previous chunk sent, with the keyword arguments (masks, rotary
        embeddings) the family's own base model hands them; the last chunk makes the final read, the final norm and
        the head."""
        key = (self.index, self.microbatch)
        self.microbatch += 1
        model = self._model[0]
        if self.is_first:
            self._begin_tensor_parallel(inputs[0].shape[1])
            layer_inputs = model.layer_inputs(input_ids=inputs[0])
            state = layer_inputs[0][0]  # the family's embedding
        else:
            rows, head = self._unpack(inputs, key)
            state = ResidualState(rows=tuple(rows), head=head)
            ref = head if head is not None else rows[0]  # stands in for the embedding the family computes first
            if self.tp is not None:  # the state is this rank's tokens; masks and rotary embeddings cover them all
                ref = ref.new_empty(ref.shape[0], ref.shape[1] * self.tp.world_size, *ref.shape[2:])
            self._begin_tensor_parallel(ref.shape[1])
            layer_inputs = model.layer_inputs(inputs_embeds=ref)
        for i in self.plan.layers(self.index):
            state = model.model.layers[i](state, **layer_inputs[i][1])
        if self.is_last:  # the family's own head: logit scaling or soft-capping included
            outputs = model.head_logits(self.norm(model.final_read(state)))
        else:
            outputs = self._pack(list(state.rows), state.head, key)
        return outputs

    def _begin_tensor_parallel(self, seq_len: int) -> None:
        """Tensor parallel within the stage: the layouts of this chunk's forward (the chunk runs its layers outside
        the base model's forward, whose pre-hook sets them otherwise)."""
        if self.tp is not None:
            self.tp.use_layout(seq_len)

    def _unpack(self, inputs: tuple[torch.Tensor, ...], key: tuple[int, int]):
        head = inputs[-1] if self.plan.head_rows else None
        sent = list(inputs[0].unbind(0)) if len(inputs) > self.plan.head_rows else []
        cached = self.cache.take((self.index - self.plan.ranks, key[1])) if self.plan.cached_rows(self.index) else []
        return cached + sent, head

    def _pack(self, rows: list[torch.Tensor], head: torch.Tensor | None, key: tuple[int, int]):
        new_rows = rows[self.plan.cached_rows(self.index + 1) :]  # the receiving rank holds the rest
        outputs = ((torch.stack(new_rows),) if new_rows else ()) + ((head,) if head is not None else ())
        if self.plan.keeps_rows(self.index):
            self.cache.keep(key, rows)
            outputs = _ReturnCachedGrads.apply(self.cache, key, len(outputs), *outputs, *rows)
        self.traffic.record(self.index, outputs, self.plan.head_rows)
        return outputs


class _Elsewhere(nn.Module):
    """Takes the place of a decoder layer another pipeline rank runs, so a rank holds only its own."""

    sides = ()  # planned, with no sublayer here

    def __init__(self, index: int):
        super().__init__()
        self.layer_idx = index

    def forward(self, hidden_states, **kwargs):
        raise RuntimeError(f"decoder layer {self.layer_idx} runs on another pipeline rank")


def keep_stages(model: nn.Module, plan: PipelinePlan, rank: int) -> None:
    """Delete from `model` (in place) what the chunks of `rank` do not run: other ranks' decoder layers (stand-ins
    take their places, so layer names keep their indices), the embedding unless the rank runs the first chunk, the
    final read, the final norm and the head unless it runs the last."""
    base = model.model
    mine = {i for stage in range(rank, plan.num_stages, plan.ranks) for i in plan.layers(stage)}
    for i in range(len(base.layers)):
        if i not in mine:
            base.layers[i] = _Elsewhere(i)
    if plan.rank_of(0) != rank:
        base.embed_tokens = None
    if plan.rank_of(plan.num_stages - 1) != rank:
        base.norm, model.lm_head = nn.Identity(), None
        for name in ("output_attn_res_proj", "output_attn_res_norm"):
            if hasattr(base, name):
                delattr(base, name)


def _check_model(model: nn.Module) -> None:
    from attnres.models.modeling_attnres import AttnResForCausalLM

    if not isinstance(model, AttnResForCausalLM):
        raise TypeError(f"model: expected an AttnResForCausalLM, got {type(model).__name__}")
    if model.config.tie_word_embeddings:
        raise ValueError("model: tie_word_embeddings must be off (the embedding and the head live on different stages)")
    if getattr(model.config.text_config, "output_router_logits", False):
        raise ValueError("model: output_router_logits must be off (the router's auxiliary loss needs every layer's "
                         "router logits, and the last stage sees its own layers only)")


def check_pipeline(schedule: str, microbatches: int, virtual_stages: int, num_layers: int, ranks: int) -> None:
    """A ValueError naming the setting that cannot make a pipeline of `num_layers` decoder layers over `ranks`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    _positive_int("microbatches", microbatches)
    _positive_int("virtual_stages", virtual_stages)
    if (schedule in _MULTI_CHUNK) != (virtual_stages > 1):
        raise ValueError(
            f"virtual_stages: the {schedule!r} schedule needs {'>= 2' if schedule in _MULTI_CHUNK else '1'}, "
            f"got {virtual_stages}"
        )
    if num_layers % (ranks * virtual_stages):
        raise ValueError(
            f"virtual_stages: {ranks} ranks x {virtual_stages} virtual stages must divide num_hidden_layers="
            f"{num_layers} into equal chunks"
        )
    if schedule == "1f1b" and microbatches < ranks:
        raise ValueError(f"microbatches: the 1f1b schedule needs at least one per rank ({ranks}), got {microbatches}")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


class PipelineTrainer:
    """Pipeline-parallel forward and backward of an `AttnResForCausalLM` over the ranks of `group` (default: all).

    Every rank passes the same model (same weights); the trainer deletes from it what this rank's chunks do not run
    (`keep_stages`), so a rank holds its stages only. Each rank calls `step` with the same batch and computes only its
    chunks. `schedule`: "gpipe", "1f1b" (one chunk a rank), "interleaved" (`ScheduleInterleaved1F1B`, `virtual_stages`
    >= 2 chunks a rank) or "zero-bubble" (`ScheduleInterleavedZeroBubble`, likewise). `cache_rows`: cross-stage
    caching (only changes anything with virtual stages; default: on, except under "zero-bubble", whose backward of a
    chunk's inputs reaches only the rows it received, not those its rank kept). `tp_mesh`: the tensor-parallel ranks of this stage (`parallelize_tensor` on its layers; the stages then
    exchange each rank's tokens of the state). `dp_mesh`: the data-parallel ranks of this stage, over which FSDP2
    shards each chunk (per decoder layer, then the chunk). `traffic` counts what this rank's chunks sent in the last step.
    """

    def __init__(self, model: nn.Module, *, schedule: str = "1f1b", microbatches: int, virtual_stages: int = 1,
                 cache_rows: bool | None = None, group: dist.ProcessGroup | None = None, dp_mesh=None, tp_mesh=None):
        _check_model(model)
        if cache_rows is None:
            cache_rows = schedule != "zero-bubble"
        elif cache_rows and schedule == "zero-bubble":
            raise ValueError("cache_rows: the 'zero-bubble' schedule computes a chunk's input gradients for the rows it "
                             "received only, so it cannot keep rows between a rank's chunks; pass cache_rows=False")
        if not dist.is_initialized():
            raise ValueError("PipelineTrainer: expected an initialized process group (torchrun or init_process_group)")
        ranks, config = dist.get_world_size(group), model.config
        check_pipeline(schedule, microbatches, virtual_stages, config.num_hidden_layers, ranks)
        self.model, self.schedule_name, self.microbatches = model, schedule, microbatches
        self.plan = PipelinePlan(config.residual, config.num_hidden_layers, ranks, virtual_stages,
                                 config.attn_res_block_size, cache_rows)
        self.group, self.rank = group, dist.get_rank(group)
        self.cache, self.traffic = RowCache(), HopTraffic()
        keep_stages(model, self.plan, self.rank)
        self.tp = None
        if tp_mesh is not None:
            from attnres.distributed.tensor_parallel import parallelize_tensor

            self.tp = parallelize_tensor(model, tp_mesh)
        self.chunks = [PipelineChunk(model, self.plan, c, self.cache, self.traffic, self.tp,
                                     chained=schedule != "zero-bubble")
                       for c in range(self.rank, self.plan.num_stages, ranks)]
        if dp_mesh is not None:
            from attnres.distributed.data_parallel import shard_chunk

            for chunk in self.chunks:
                shard_chunk(chunk, dp_mesh)
        self._schedule, self._shape = None, None

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains: those of its chunks (all the model holds)."""
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients, spread over the stages (and sharded within them), to a global 2-norm of at most
        `max_norm`, as `torch.nn.utils.clip_grad_norm_` does in one process; returns the norm before clipping, on every
        rank. torch's own norm is DTensor-aware (a shard's norm is reduced over its mesh); the stages' squared norms
        are added over the pipeline group."""
        from torch.distributed.tensor import DTensor

        params = self.parameters()
        local = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        local = local.full_tensor() if isinstance(local, DTensor) else local
        squared = local.float().square().to(collective_device(self.group))
        collective(lambda: dist.all_reduce(squared, group=self.group), "adding up the gradient norm")
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(local.device))
        return total.item()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward and backward of the batch input_ids `[B, T]` with labels `[B, T]` (-100: ignored; shifted inside,
        as in `AttnResForCausalLM`); gradients accumulate into the parameters' `.grad`. Returns the mean loss over the
        microbatches (the batch loss when every microbatch counts the same number of labels), on every rank."""
        if input_ids.dim() != 2 or input_ids.shape[0] % self.microbatches:
            raise ValueError(
                f"input_ids: expected [batch, seq] with batch a multiple of microbatches={self.microbatches}, "
                f"got {list(input_ids.shape)}"
            )
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels: expected the shape of input_ids {list(input_ids.shape)}, got {list(labels.shape)}"
            )
        if self._shape != tuple(input_ids.shape):
            self._schedule, self._shape = self._build(*input_ids.shape), tuple(input_ids.shape)
        for chunk in self.chunks:
            chunk.microbatch = 0
        self.traffic.sends.clear()
        losses: list[torch.Tensor] = []
        last = self.chunks[-1].is_last
        inputs = (input_ids,) if self.chunks[0].is_first else ()
        try:
            self._schedule.step(*inputs, target=labels if last else None, losses=losses)
        except RuntimeError as e:  # this rank's own error stays itself; a lost rank's becomes RankFailed
            if is_collective_error(e):
                raise RankFailed(lost_rank_message("running the pipeline schedule", e)) from e
            raise
        self.cache.check_empty()
        return self._loss_from_last_stage(losses)

    def evaluate(self, input_ids: torch.Tensor) -> float:
        """The mean loss of the batch `input_ids` (labels: itself) through the pipeline, forward only, on every rank.

        It records no backward, but runs with gradients enabled: without them the first layer starts the fused
        inference bank, whose state has another layout than the one the stages exchange."""
        if self._shape != tuple(input_ids.shape):
            self._schedule, self._shape = self._build(*input_ids.shape), tuple(input_ids.shape)
        for chunk in self.chunks:
            chunk.microbatch = 0
        losses: list[torch.Tensor] = []
        last = self.chunks[-1].is_last
        inputs = (input_ids,) if self.chunks[0].is_first else ()
        try:
            self._schedule.eval(*inputs, target=input_ids if last else None, losses=losses)
        except RuntimeError as e:
            if is_collective_error(e):
                raise RankFailed(lost_rank_message("evaluating through the pipeline", e)) from e
            raise
        self.cache.clear()  # no backward takes the leaves
        return self._loss_from_last_stage(losses)

    def _loss_from_last_stage(self, losses: list[torch.Tensor]) -> float:
        last = self.chunks[-1].is_last
        device = collective_device(self.group)
        loss = torch.stack(losses).mean().detach().float().to(device) if last else torch.zeros((), device=device)
        last_rank = self.plan.rank_of(self.plan.num_stages - 1)
        collective(lambda: dist.broadcast(loss, group=self.group, group_src=last_rank), "sharing the loss")
        return loss.item()

    def _build(self, batch: int, seq: int):
        from torch.distributed.pipelining import (
            PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
        )

        plan, config = self.plan, self.model.config
        b = batch // self.microbatches
        weight = next(self.chunks[0].parameters())
        dtype, device = weight.dtype, weight.device

        tokens = seq // self.tp.world_size if self.tp is not None else seq  # a tensor-parallel rank's share

        def state(hop: int) -> tuple[torch.Tensor, ...]:
            """Meta tensors of what hop `hop` carries (static shapes: no shape inference run through the chunks)."""
            row, rows = (b, tokens, config.hidden_size), plan.sent_rows(hop) - plan.head_rows
            shapes = ([(rows, *row)] if rows else []) + ([row] if plan.head_rows else [])
            return tuple(torch.empty(s, device="meta", dtype=dtype, requires_grad=True) for s in shapes)

        stages = []
        for chunk in self.chunks:
            c = chunk.index
            inputs = (torch.empty(b, seq, dtype=torch.long, device="meta"),) if c == 0 else state(c - 1)
            logits = torch.empty(b, seq, config.vocab_size, device="meta", dtype=dtype, requires_grad=True)
            outputs = (logits,) if chunk.is_last else state(c)
            stages.append(PipelineStage(chunk, c, plan.num_stages, device, input_args=inputs, output_args=outputs,
                                        group=self.group))

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)

        if self.schedule_name == "interleaved":
            return ScheduleInterleaved1F1B(stages, self.microbatches, loss_fn=loss_fn)
        if self.schedule_name == "zero-bubble":
            return ScheduleInterleavedZeroBubble(stages, self.microbatches, loss_fn=loss_fn)
        cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
        return cls(stages[0], self.microbatches, loss_fn=loss_fn)
