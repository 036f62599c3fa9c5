"""What the AttnRes wiring costs on top of a transformers family: a family's own causal LM against the same weights
converted to AttnRes models, standard residual first (the adapter's own overhead: the same computation through our
layers), then Block and Full with random pseudo-queries.

In one process, timed round-robin (`attnres.bench.timing.median_times`): a training step (forward with loss, backward,
AdamW) and a decode step after a KV cache of `--context` tokens. Prints a table of ratios to the family's own model and
writes the raw figures as JSON (atomically) to `--out`.

    python -m benchmarks.family_overhead                       # llama, d=512, 8 layers
    python -m benchmarks.family_overhead --family qwen3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import attnres
from attnres.atomic import atomic_write_text
from attnres.bench.models import KINDS, decode_step, training_step
from attnres.bench.timing import median_times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama", help="transformers model_type (default: %(default)s)")
    p.add_argument("--dim", type=int, default=512, help="hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=1024, help="training tokens, batch 1 (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="cached tokens before a decode step (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=2, help="decoder layers a block (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed training steps per model (default: %(default)s)")
    p.add_argument("--decode-repeats", type=int, default=60, help="timed decode steps per model (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="docs/family_overhead.json", help="JSON of the figures (default: %(default)s)")
    return p.parse_args(argv)


def build(args) -> dict[str, torch.nn.Module]:
    """The family's own model and its conversions (same weights; AttnRes queries random for Block and Full)."""
    fields = dict(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=-(-8 * args.dim // 3 // 32) * 32,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  max_position_embeddings=max(args.tokens, args.context + 1))
    torch.manual_seed(0)
    family = AutoModelForCausalLM.from_config(CONFIG_MAPPING[args.family](**fields))
    models = {args.family: family}
    for residual in KINDS:
        model = attnres.convert_from_hf(family, residual=residual, attn_res_block_size=args.block_size)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_res_proj.weight"):
                    p.normal_(0.0, 0.3)
        models[f"attnres-{residual}"] = model
    return models


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = build(args)
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    context, token = torch.randint(0, args.vocab, (1, args.context)), torch.randint(0, args.vocab, (1, 1))
    train = median_times({k: training_step(m, ids) for k, m in models.items()}, args.repeats)
    decode = median_times({k: decode_step(m, context, token) for k, m in models.items()}, args.decode_repeats, warmup=3)
    results = {"settings": vars(args), "torch_threads": torch.get_num_threads(), "train_s": train, "decode_s": decode}
    write_json(args.out, results)
    print(f"{args.family}, d={args.dim}, {args.layers} layers, {torch.get_num_threads()} threads; ratio to the family")
    print("| model | train step ms | x family | decode ms | x family |\n| --- | ---: | ---: | ---: | ---: |")
    for k in models:
        print(f"| {k} | {1e3 * train[k]:.1f} | {train[k] / train[args.family]:.3f} | {1e3 * decode[k]:.2f} | "
              f"{decode[k] / decode[args.family]:.3f} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
