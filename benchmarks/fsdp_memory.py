"""Per-rank peak bytes of parameters, gradients and optimizer state under DDP, FSDP2 on the root only, FSDP2 per
decoder layer (`attnres.distributed.apply_fsdp`, what `attnres train --parallel fsdp` runs) and the pipeline
(`PipelineTrainer`, 1F1B, what `--parallel pipeline` runs), on 2 gloo ranks on CPU.

The model is `attnres train`'s (Llama family, Block AttnRes, block size 2; default d=512, 8 layers, vocabulary 32000),
trained with the project's AdamW param groups. The second of two steps is measured (the optimizer state exists by
then). A `TorchDispatchMode` samples at every op of forward, backward and the optimizer step, and after the step: the
sum of the unique storages of
- parameters: the model's (FSDP: the local shards) and whatever full parameters the modules hold at that moment (FSDP
  registers them while a group is gathered and frees their storage after);
- gradients: the `.grad` of those tensors (FSDP: full gradients in backward, sharded ones after the reduce-scatter);
- optimizer state: the local tensors of `optimizer.state`.
The peak is the largest sum over the samples; its parts at that sample are printed beside it. Communication buffers
(DDP's buckets, FSDP's all-gather and reduce-scatter buffers) and activations are not counted.

    python -m benchmarks.fsdp_memory              # writes docs/fsdp_memory.json
    python -m benchmarks.fsdp_memory --dim 128 --vocab 256 --out /tmp/fsdp.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnres.bench.models import add_model_args
from benchmarks.gloo_ranks import run_on_gloo_ranks, write_record

MIB = 2**20
MODES = ("ddp", "fsdp_root", "fsdp_per_layer", "pipeline")
RANKS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=64, help="sequence length T (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="global batch, sequences (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("docs/fsdp_memory.json"), help="(default: %(default)s)")
    return p.parse_args(argv)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ParamGradOptBytes(TorchDispatchMode):
    """Samples parameter, gradient and optimizer-state bytes at every op; keeps the sample with the largest sum."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.params = list(model.parameters())  # FSDP: the sharded ones, which live while the full ones come and go
        self.peak = {"total": 0}

    def sample(self) -> None:
        params = {id(p): p for p in self.params}
        for module in self.model.modules():
            params.update((id(p), p) for p in module._parameters.values() if p is not None)
        params = list(params.values())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        now = {
            "params": _storages(params),
            "grads": _storages(p.grad for p in params if p.grad is not None),
            "optimizer": _storages(state),
        }
        now["total"] = sum(now.values())
        if now["total"] > self.peak["total"]:
            self.peak = now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def _build(args, mode: str):
    from attnres.training import TrainConfig
    from attnres.training.loop import build_model
    from attnres.training.optim import build_optimizer

    config = TrainConfig(layers=args.layers, dim=args.dim, heads=args.heads, residual="block", block_size=2,
                         seq_len=args.tokens)
    model = build_model(config, args.vocab)
    if mode == "ddp":
        from attnres.distributed import apply_ddp

        trained = apply_ddp(model)
    elif mode == "fsdp_root":
        from torch.distributed.fsdp import fully_shard

        trained = fully_shard(model)  # one group for the whole model, the FSDP of before per-layer sharding
    elif mode == "fsdp_per_layer":
        from attnres.distributed import apply_fsdp

        trained = apply_fsdp(model)
    else:
        from attnres.distributed import PipelineTrainer

        trained = PipelineTrainer(model, schedule="1f1b", microbatches=RANKS)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, attn_res_lr_mult=0.1, attn_res_weight_decay=0.0)
    return model, trained, optimizer


def _step(args, mode: str, trained, rank: int) -> None:
    batch = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    if mode == "pipeline":
        trained.step(batch, batch)  # every rank the whole batch, in microbatches
    else:
        rows = batch.chunk(RANKS)[rank]
        trained(input_ids=rows, labels=rows).loss.backward()


def _per_rank(rank: int, args) -> dict:
    out = {}
    for mode in MODES:
        model, trained, optimizer = _build(args, mode)
        for step in range(2):
            probe = ParamGradOptBytes(model, optimizer)
            with probe:
                _step(args, mode, trained, rank)
                optimizer.step()
            probe.sample()
            optimizer.zero_grad(set_to_none=True)
        out[mode] = {**probe.peak, "model_params": sum(p.numel() for p in model.parameters())}
        del model, trained, optimizer
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    per_rank = run_on_gloo_ranks(_per_rank, RANKS, args)
    ddp = [r["ddp"]["total"] for r in per_rank]
    print(f"d={args.dim}, {args.layers} layers, vocabulary {args.vocab}, {RANKS} gloo ranks; per-rank peak MiB")
    print(f"{'mode':<16} {'rank':>4} {'total':>9} {'params':>9} {'grads':>9} {'optim':>9} {'vs ddp':>7}")
    for mode in MODES:
        for rank, r in enumerate(per_rank):
            m = r[mode]
            print(f"{mode:<16} {rank:>4} {m['total'] / MIB:>9.1f} {m['params'] / MIB:>9.1f} {m['grads'] / MIB:>9.1f} "
                  f"{m['optimizer'] / MIB:>9.1f} {m['total'] / ddp[rank]:>7.2f}")
    write_record("benchmarks.fsdp_memory", args, argv, {"ranks": RANKS, "residual": "block", "block_size": 2},
                 bytes_per_rank=per_rank)


if __name__ == "__main__":
    main()
