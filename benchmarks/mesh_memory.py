"""Per-rank memory and communication of one training step on each device-mesh composition, on 4 gloo ranks on CPU,
beside one process, with what `attnres estimate` predicts for the communication.

The model is `attnres train`'s (Llama family, Block AttnRes, block size 2; default d=512, 8 layers, T=1024,
vocabulary 32000), trained by the loop's own steps (`attnres.training.steps`) and AdamW param groups. The second of two
steps is measured (the optimizer state exists by then). Per rank:
- parameter, gradient and optimizer-state bytes: the local tensors it holds after the step (the run log's memory line);
- peak activations: the largest sum, during forward and backward, of the storages autograd saved for backward that
  are not parameters (`saved_tensors_hooks`; a storage counts until its last saved tensor is freed);
- collectives: the tensor bytes each collective op took (a `TorchDispatchMode` over the c10d ops), by op; for the
  pipeline, the bytes its chunks handed to the stages for sending.
The communication check: the tensor-parallel collectives of the decoder layers are measured as the difference between
this model and one with half the layers (so the embedding, head and loss traffic cancels), per layer, against
`attnres estimate`'s figure; the pipeline's hand-off bytes against its per-hop formula.

    python -m benchmarks.mesh_memory                    # writes docs/mesh_memory.json
    python -m benchmarks.mesh_memory --dim 64 --layers 4 --tokens 64 --vocab 256 --out /tmp/mesh.json
"""

from __future__ import annotations

import argparse
import weakref
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from attnres.analysis.cost import hop_bytes_per_microbatch, tp_layer_bytes
from attnres.bench.models import add_model_args
from benchmarks.gloo_ranks import run_on_gloo_ranks, write_record

MIB = 2**20
RANKS = 4
COMPOSITIONS = {
    "dp_shard 4": dict(dp_shard=4),
    "dp_shard 2 x tp 2": dict(dp_shard=2, tp=2),
    "pp 2 x dp_shard 2": dict(pp=2, dp_shard=2),
    "pp 2 x tp 2": dict(pp=2, tp=2),
    "pp 4": dict(pp=4),
}
COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "allreduce_", "_allgather_base_",
               "allgather_", "_reduce_scatter_base_", "reduce_scatter_", "broadcast_", "send", "recv_"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=1024, help="sequence length T (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="global batch, sequences (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("docs/mesh_memory.json"), help="(default: %(default)s)")
    return p.parse_args(argv)


class SavedActivations:
    """Peak bytes of the non-parameter storages autograd holds for backward."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in _local_params(model)}
        self.live: dict[int, list] = {}  # storage pointer -> [bytes, saved tensors alive]
        self.now = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.params:
            entry = self.live.setdefault(key, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        return t

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


class CollectiveBytes(TorchDispatchMode):
    """Tensor bytes each collective op took, by op name."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and name in COLLECTIVES:
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _local_params(model):
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _measure(args, dims: dict, layers: int) -> dict:
    """One composition on this process's group (or one process when no group): the measured step's figures."""
    from attnres.distributed.ranks import Ranks
    from attnres.distributed.mesh import build_mesh, memory_line
    from attnres.training import TrainConfig
    from attnres.training.loop import build_model
    from attnres.training.optim import build_optimizer
    from attnres.training.steps import training_steps

    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = Ranks(dist.get_rank(), world) if world > 1 else Ranks()
    config = TrainConfig(layers=layers, dim=args.dim, heads=args.heads, residual="block", block_size=2,
                         seq_len=args.tokens, batch_size=args.batch, threads=1, **dims)
    shape = config.parallel_dims(world)
    mesh = build_mesh(shape, "cpu") if world > 1 else None
    model = build_model(config, args.vocab)
    steps = training_steps(model, config, ranks, shape, mesh)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0)
    batch = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    no_autocast = torch.autocast("cpu", enabled=False)
    for step in range(2):
        saved, collectives = SavedActivations(model), CollectiveBytes()
        with saved.hooks(), collectives:
            steps.run(batch, no_autocast, 1.0)
        optimizer.step()
        line = memory_line(ranks.rank, model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    trainer = getattr(steps, "trainer", None)
    handed = {hop: sent for hop, sent in trainer.traffic.per_hop().items()} if trainer is not None else {}
    return {**line, "activation_bytes": saved.peak, "collective_bytes": dict(collectives.bytes),
            "pipeline_hop_bytes": handed}


def _per_rank(rank: int, args) -> dict:
    out = {name: _measure(args, dims, args.layers) for name, dims in COMPOSITIONS.items()}
    for name, dims in COMPOSITIONS.items():  # half the layers: the decoder layers' own tensor-parallel traffic
        if dims.get("tp", 1) > 1:
            out[f"{name}, half the layers"] = _measure(args, dims, args.layers // 2)
    return out


def _tp_check(args, per_rank: list[dict]) -> dict:
    """Measured all-gather + reduce-scatter bytes per decoder layer per rank against `attnres estimate`'s."""
    checks = {}
    for name, dims in COMPOSITIONS.items():
        tp = dims.get("tp", 1)
        if tp == 1:
            continue
        rows = args.batch // (dims.get("dp_shard", 1))  # the rows one tensor-parallel group runs
        def layer_bytes(r):
            full, half = r[name]["collective_bytes"], r[f"{name}, half the layers"]["collective_bytes"]
            ops = ("all_gather_into_tensor", "reduce_scatter_tensor")
            return sum(full.get(op, 0) - half.get(op, 0) for op in ops) / (args.layers - args.layers // 2)
        # a pipeline rank holds layers / pp of them: its difference covers that many
        per_stage = dims.get("pp", 1)
        measured = [layer_bytes(r) * per_stage for r in per_rank]
        predicted = tp_layer_bytes(rows, args.tokens, args.dim, 4, tp)
        checks[name] = {"measured_per_layer": measured, "predicted_per_layer": predicted,
                        "ratio": [m / predicted for m in measured]}
    return checks


def _pipeline_check(args, per_rank: list[dict]) -> dict:
    checks = {}
    for name, dims in COMPOSITIONS.items():
        pp = dims.get("pp", 1)
        if pp == 1:
            continue
        microbatches = pp
        rows = args.batch // dims.get("dp_shard", 1) // microbatches
        tokens = args.tokens // dims.get("tp", 1)
        measured = {}
        for r in per_rank:
            measured.update({int(h): v[1] for h, v in r[name]["pipeline_hop_bytes"].items()})
        predicted = hop_bytes_per_microbatch("block", args.layers, pp, 1, 2, rows, tokens, args.dim, 4)
        checks[name] = {"measured_per_hop": [measured[h] for h in sorted(measured)], "predicted_per_hop": predicted}
    return checks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    one = _measure(args, {}, args.layers)
    per_rank = run_on_gloo_ranks(_per_rank, RANKS, args)
    print(f"d={args.dim}, {args.layers} layers, T={args.tokens}, batch {args.batch}, vocabulary {args.vocab}, "
          f"{RANKS} gloo ranks; per-rank MiB after the second step (activations: peak saved for backward)")
    print(f"{'composition':<22} {'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'params/1p':>9}")
    rows = [("one process", 0, one)] + [(n, r, per_rank[r][n]) for n in COMPOSITIONS for r in range(RANKS)]
    for name, rank, m in rows:
        print(f"{name:<22} {rank:>4} {m['param_bytes'] / MIB:>8.1f} {m['grad_bytes'] / MIB:>8.1f} "
              f"{m['optim_bytes'] / MIB:>8.1f} {m['activation_bytes'] / MIB:>8.1f} "
              f"{m['param_bytes'] / one['param_bytes']:>9.2f}")
    tp, pipeline = _tp_check(args, per_rank), _pipeline_check(args, per_rank)
    for name, check in tp.items():
        print(f"{name}: tensor-parallel bytes per decoder layer, measured / attnres estimate: "
              f"{', '.join(f'{x:.3f}' for x in check['ratio'])}")
    for name, check in pipeline.items():
        print(f"{name}: pipeline hand-off bytes per hop, measured {check['measured_per_hop']}, "
              f"predicted {check['predicted_per_hop']}")
    write_record("benchmarks.mesh_memory", args, argv, {"ranks": RANKS, "residual": "block", "block_size": 2},
                 one_process=one, per_rank=per_rank, tensor_parallel_check=tp, pipeline_check=pipeline)


if __name__ == "__main__":
    main()
