"""Per-rank cost of tensor + sequence parallel (`attnres.distributed.parallelize_tensor`) against one process.

Every rank builds the same Block AttnRes model (Llama-shaped, fp32, default d=256, 4 layers, block size 2, T=512
tokens), keeps an unparallelised copy as the one-process baseline, and measures both in the same process:

- bank bytes: the `[tokens, NB, d]` bank of a no-grad prefill (`BankState.bank`), against `attnres estimate`'s
  `bank_bytes` and `bank_bytes_per_rank` (`attnres.analysis.cost.residual_cost`);
- FLOPs of that prefill, counted with `torch.utils.flop_counter.FlopCounterMode` per module: the attention sublayers
  (`self_attn`: projections and the attention itself), the MLPs, the whole model; ratio to one process. A DTensor op
  is counted on the local shards it runs (the mode steps aside and counts what DTensor dispatches);
- bytes a training step holds: parameters (local shards) and what autograd saves for backward
  (`saved_tensors_hooks`);
- bytes communicated by this rank per decoder layer (collective payloads: the full tensor of an all-gather, the input
  of a reduce-scatter or all-reduce), forward of the prefill and forward + backward of a training step, counted by a
  dispatch mode on the collectives and attributed to a layer with `ModTracker`; against the expected all-gather and
  reduce-scatter of `[B, T, d]` per sublayer (one each way in forward, and the same again in backward).

    torchrun --nproc-per-node 2 -m benchmarks.tp_costs            # writes docs/tp_costs.json (rank 0)
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import platform
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from attnres.analysis.cost import DTYPE_BYTES, residual_cost
from attnres.atomic import atomic_write_text
from attnres.distributed import parallelize_tensor
from attnres.models import AttnResConfig, AttnResForCausalLM

_GATHERS = {"all_gather_into_tensor", "allgather_", "_allgather_base_"}
_REDUCES = {"reduce_scatter_tensor", "reduce_scatter_", "_reduce_scatter_base_", "all_reduce", "allreduce_"}


class LocalShards(TorchDispatchMode):
    """Entered inside a FlopCounterMode: DTensor ops step aside, so that the counter sees (and counts) the ops on
    local shards that DTensor dispatches, not one op at the global shape."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return func(*args, **(kwargs or {}))


class CommBytes(TorchDispatchMode):
    """Bytes of every collective this rank takes part in, by (inside a decoder layer or not, forward | backward, op).

    Inside or outside, not which layer: in backward `ModTracker` sees a decoder layer begin only when its output is
    in the loss's graph, and an AttnRes layer hands its state on in the stream, not as its output."""

    def __init__(self, tracker: ModTracker, world_size: int):
        super().__init__()
        self.tracker, self.world_size = tracker, world_size
        self.bytes = collections.defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives on local tensors, which we see next
        name = func._overloadpacket.__name__
        if name in _GATHERS or name in _REDUCES:
            local = next(t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            payload = local.nbytes * (self.world_size if name in _GATHERS else 1)
            where = "layers" if any(re.search(r"\.layers\.\d+", p) for p in self.tracker.parents) else "outside"
            self.bytes[(where, "backward" if self.tracker.is_bw else "forward", name)] += payload
        return func(*args, **(kwargs or {}))


def build(args) -> AttnResForCausalLM:
    config = AttnResConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.tokens, residual="block", attn_res_block_size=args.block_size,
    )
    torch.manual_seed(0)
    model = AttnResForCausalLM(config)
    model.set_attn_implementation("eager")  # matmuls FlopCounterMode counts (it has no formula for CPU's fused SDPA)
    with torch.no_grad():
        for point in model.aggregation_points():
            point.proj.weight.normal_(std=0.1)
    return model


def prefill(model, input_ids) -> tuple[int, dict[str, int]]:
    """Bank bytes and FLOPs by module kind of one no-grad prefill."""
    with torch.no_grad():
        model(input_ids)  # warm-up: DTensor's first call of an op runs its sharding propagation on the global shapes
    with torch.no_grad(), FlopCounterMode(display=False) as flops, LocalShards():
        out = model(input_ids, output_residual_state=True)  # no gradient: the fused bank path, one [tokens, NB, d] bank
    counts = flops.get_flop_counts()

    def total(pattern: str) -> int:
        return sum(sum(ops.values()) for name, ops in counts.items() if re.fullmatch(pattern, name))

    attention = r".*\.layers\.\d+\.self_attn"
    kinds = {"attention": attention, "attention_projections": attention + r"\.\w+_proj",
             "mlp": r".*\.layers\.\d+\.mlp", "model": "Global"}
    counted = {kind: total(pattern) for kind, pattern in kinds.items()}
    counted["attention_scores_and_values"] = counted["attention"] - counted.pop("attention_projections")
    return out.residual_state.rows[0].nbytes, counted


def step_memory(model, input_ids) -> dict:
    """Bytes this rank holds for a training step: its parameters (local shards), and the unique non-parameter
    storages autograd saves for backward (`saved_tensors_hooks`; a DTensor counts its local tensor), in all and in
    tensors whose last dimension is the vocabulary (logits, log-softmax: whole on every rank)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    params = {t.untyped_storage().data_ptr() for t in local}
    saved: dict[int, tuple[int, bool]] = {}
    vocab = model.config.vocab_size

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), tensor.shape[-1:] == (vocab,)))
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"parameters": sum(t.nbytes for t in local), "saved_for_backward": sum(n for n, _ in saved.values()),
            "saved_vocab_rows": sum(n for n, is_vocab in saved.values() if is_vocab)}


def comm_per_layer(model, input_ids, world_size: int) -> dict:
    tracker = ModTracker()
    with tracker, CommBytes(tracker, world_size) as comm:
        with torch.no_grad():
            model(input_ids)
        prefill_bytes = dict(comm.bytes)
        comm.bytes.clear()
        model(input_ids, labels=input_ids).loss.backward()
        train_bytes = dict(comm.bytes)
    num_layers = model.config.num_hidden_layers
    return {"prefill": _per_layer(prefill_bytes, num_layers), "train_step": _per_layer(train_bytes, num_layers)}


def _per_layer(counted: dict, num_layers: int) -> dict:
    """{"per_layer": {phase: {op: bytes}}, "outside_layers": ...}: the layers' total over their number (they are
    alike), and what the embedding, final norm and head exchange."""
    out: dict = {"per_layer": {}, "outside_layers": {}}
    for (where, phase, op), nbytes in sorted(counted.items()):
        if where == "layers":
            out["per_layer"].setdefault(phase, {})[op] = nbytes / num_layers
        else:
            out["outside_layers"].setdefault(phase, {})[op] = nbytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "tp_costs.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    one = build(args)
    model = copy.deepcopy(one)
    parallelize_tensor(model)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    tokens = args.batch * args.tokens
    bank_one, flops_one = prefill(one, input_ids)
    bank_tp, flops_tp = prefill(model, input_ids)
    estimate = residual_cost(tokens, args.layers, args.block_size, args.hidden, dtype="fp32", ranks=world)
    memory_one, memory_tp = step_memory(one, input_ids), step_memory(model, input_ids)
    comm = comm_per_layer(model, input_ids, world)
    row_bytes = tokens * args.hidden * DTYPE_BYTES["fp32"]  # one [B, T, d] activation
    layer = one.model.layers[0]
    replicated_grad_bytes = sum(p.nbytes for p in layer.parameters() if p.dim() == 1 or p.shape[0] == 1)
    result = {
        "command": f"torchrun --nproc-per-node {world} -m benchmarks.tp_costs " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"ranks": world, "residual": "block", "dtype": "fp32", "family": "llama"},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "rank": rank,
        "bank_bytes": {"one_process": bank_one, "per_rank": bank_tp, "estimate": estimate.bank_bytes,
                       "estimate_per_rank": estimate.bank_bytes_per_rank, "ratio": bank_tp / bank_one},
        "prefill_flops": {kind: {"one_process": flops_one[kind], "per_rank": flops_tp[kind],
                                 "ratio": flops_tp[kind] / flops_one[kind]} for kind in flops_one},
        "train_step_bytes": {kind: {"one_process": memory_one[kind], "per_rank": memory_tp[kind],
                                    "ratio": memory_tp[kind] / memory_one[kind]} for kind in memory_one},
        "comm_bytes_per_layer": comm,
        "expected_comm_bytes_per_layer": {
            "forward": {"all_gather_into_tensor": 2 * row_bytes, "reduce_scatter_tensor": 2 * row_bytes},
            "backward": {"all_gather_into_tensor": 2 * row_bytes, "reduce_scatter_tensor": 2 * row_bytes,
                         "allreduce_": replicated_grad_bytes},
            "note": "one [B, T, d] all-gather into and one reduce-scatter out of each of the layer's 2 sublayers; "
                    "backward: the same, reversed, plus the all-reduce of the gradients of the layer's replicated "
                    "parameters (pseudo-queries, key gains, PreNorm gains); counted inside the layers too, once a step "
                    "and so 1/L a layer here: the final read's point's gradients, and the all-gather that gives the "
                    "embedding its tokens' gradient back",
        },
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        text = json.dumps({"ranks": gathered}, indent=1)
        atomic_write_text(args.out, text + "\n")
        print(json.dumps({k: gathered[0][k] for k in ("bank_bytes", "prefill_flops", "train_step_bytes")}, indent=1))
        print(json.dumps(gathered[0]["comm_bytes_per_layer"], indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
