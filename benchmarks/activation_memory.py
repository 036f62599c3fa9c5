"""Activation memory and step time of activation checkpointing, for the standard, Block and Full residuals, beside
transformers' own `LlamaForCausalLM` with the same weights.

One training step (forward with the loss, backward) of a Llama-shaped model (default d=512, 8 layers, T=1024, batch 1,
vocabulary 32000; the three residuals and transformers' Llama share every standard weight, the AttnRes pseudo-queries
are random), each without and with `model.activation_checkpointing_enable()` (whole decoder layers are recomputed in
backward from the residual state they took; transformers' default non-reentrant checkpoint unless --reentrant):

- saved MiB: bytes autograd holds for the step, counted with `torch.autograd.graph.saved_tensors_hooks`: the sum of
  the unique storages of every tensor saved for backward, parameters left out (they are held anyway; their total is
  printed apart). torch's checkpoint saves the inputs of each recompute through the same hooks, so they count;
- [T, vocab] MiB: the part of it in tensors whose last dimension is the vocabulary (the logits and the loss's
  log-softmax), which checkpointing the decoder layers cannot reduce;
- step s: median seconds of a step over --repeats rounds, the two variants of a residual timed alternately in the
  same process (round-robin, after a warm-up step each), and their ratio;
- vs transformers: the checkpointed saved bytes over transformers' checkpointed Llama's, with and without the
  [T, vocab] tensors (which are the same in every model and dominate at a large vocabulary).

Then, per residual, what the checkpointed step still saves, grouped by the op that created each tensor (its
`grad_fn`) and its shape, largest first. The optimiser step is left out: checkpointing does not change it.

    python -m benchmarks.activation_memory                       # writes docs/activation_memory.json
    OMP_NUM_THREADS=2 python -m benchmarks.activation_memory --repeats 5 --out /tmp/am.json
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import platform
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from attnres.atomic import atomic_write_text
from attnres.bench.models import KINDS, add_model_args, build_models
from attnres.bench.timing import median_times

MIB = 2**20
BASELINE = "transformers"  # transformers' own LlamaForCausalLM, the same weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=1024, help="sequence length T (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences a step (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=2, help="Block AttnRes decoder layers a block (default: 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is kept (default: %(default)s)")
    p.add_argument("--reentrant", action="store_true", help="torch's reentrant checkpoint (default: non-reentrant)")
    p.add_argument("--top", type=int, default=8, help="groups of the breakdown printed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/activation_memory.json"),
                   help="raw results, written atomically (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("dim", "layers", "heads", "vocab", "tokens", "batch", "block_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.top < 0:
        p.error(f"--top must be at least 0, got {args.top}")
    return args


def step(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def saved_tensors(model, ids: torch.Tensor, vocab: int) -> dict:
    """One step under `saved_tensors_hooks`: the unique non-parameter storages saved for backward, their total, the
    part in [..., vocab] tensors, and a breakdown by (creating op, shape, dtype)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, tuple]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in storages:
            op = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "(no grad_fn)"
            storages[ptr] = (storage.nbytes(), (op, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for nbytes, key in storages.values():
        groups[key][0] += 1
        groups[key][1] += nbytes
    breakdown = [
        {"op": op, "shape": list(shape), "dtype": dtype, "count": count, "bytes": nbytes}
        for (op, shape, dtype), (count, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    ]
    return {
        "saved_bytes": sum(nbytes for nbytes, _ in storages.values()),
        "vocab_bytes": sum(nbytes for nbytes, (_, shape, _) in storages.values() if shape and shape[-1] == vocab),
        "tensors": len(storages),
        "breakdown": breakdown,
    }


def measure(kind: str, model, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    plain = model
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable({"use_reentrant": args.reentrant})
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    memory = {"plain": saved_tensors(plain, ids, args.vocab), "checkpointed": saved_tensors(checkpointed, ids, args.vocab)}
    seconds = median_times(
        {"plain": lambda: step(plain, ids), "checkpointed": lambda: step(checkpointed, ids)}, args.repeats, warmup=1
    )
    return {
        "residual": kind,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **{f"{variant}_{key}": value[key] for variant, value in memory.items() for key in ("saved_bytes", "vocab_bytes")},
        "saved_ratio": memory["plain"]["saved_bytes"] / memory["checkpointed"]["saved_bytes"],
        "plain_seconds": seconds["plain"],
        "checkpointed_seconds": seconds["checkpointed"],
        "time_ratio": seconds["checkpointed"] / seconds["plain"],
        "breakdown_plain": memory["plain"]["breakdown"],
        "breakdown_checkpointed": memory["checkpointed"]["breakdown"],
    }


def add_baseline_ratios(results: list[dict]) -> None:
    """Each result's checkpointed saved bytes over the baseline's, with and without the [T, vocab] tensors."""
    base = next(r for r in results if r["residual"] == BASELINE)
    for r in results:
        r["vs_transformers"] = r["checkpointed_saved_bytes"] / base["checkpointed_saved_bytes"]
        r["vs_transformers_without_vocab"] = (r["checkpointed_saved_bytes"] - r["checkpointed_vocab_bytes"]) / (
            base["checkpointed_saved_bytes"] - base["checkpointed_vocab_bytes"]
        )


def print_tables(results: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nd={args.dim}, {args.layers} layers, T={args.tokens}, batch {args.batch}, vocab {args.vocab}, block size "
        f"{args.block_size}, {'reentrant' if args.reentrant else 'non-reentrant'} checkpoint, "
        f"{torch.get_num_threads()} threads; parameters {results[0]['parameter_bytes'] / MIB:.0f} MiB (not counted)\n"
    )
    print("| residual | saved MiB | saved MiB, ckpt | fewer | of which [T, vocab] MiB (ckpt) | ckpt vs transformers "
          "| without [T, vocab] | step s | step s, ckpt | time ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['residual']} | {r['plain_saved_bytes'] / MIB:.1f} | {r['checkpointed_saved_bytes'] / MIB:.1f} "
            f"| {r['saved_ratio']:.2f}x | {r['checkpointed_vocab_bytes'] / MIB:.1f} | {r['vs_transformers']:.2f}x "
            f"| {r['vs_transformers_without_vocab']:.2f}x | {r['plain_seconds']:.2f} | {r['checkpointed_seconds']:.2f} "
            f"| {r['time_ratio']:.2f} |"
        )
    for r in results:
        if not args.top:
            break
        print(f"\n{r['residual']}, checkpointed: what is still saved (largest groups)\n")
        print("| created by | shape | dtype | tensors | MiB |")
        print("| --- | --- | --- | ---: | ---: |")
        for g in r["breakdown_checkpointed"][: args.top]:
            print(f"| {g['op']} | {g['shape']} | {g['dtype']} | {g['count']} | {g['bytes'] / MIB:.2f} |")


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = build_models(
        dim=args.dim, layers=args.layers, heads=args.heads, vocab=args.vocab, block_size=args.block_size,
        max_tokens=args.tokens, seed=args.seed, kinds=KINDS,
    )
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    llama = LlamaForCausalLM(models["standard"].config.text_config)
    llama.load_state_dict(models["standard"].state_dict())
    results = []
    for kind, model in [(BASELINE, llama), *((kind, models[kind]) for kind in KINDS)]:
        results.append(measure(kind, model.train(), ids, args))
        print(f"{kind}: {results[-1]['saved_ratio']:.2f}x fewer saved bytes, time ratio {results[-1]['time_ratio']:.2f}",
              flush=True)
    add_baseline_ratios(results)
    print_tables(results, args)
    payload = {
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.machine(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "intermediate_size": models["standard"].config.intermediate_size,
        "results": results,
    }
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
