"""`attnres train`: train a decoder LM with a standard, Full or Block residual on a corpus that needs no download."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from attnres.distributed.mesh import PARALLEL
from attnres.distributed.pipeline import SCHEDULES as PP_SCHEDULES
from attnres.layers.kinds import RESIDUAL_KINDS
from attnres.training.config import AUTOCAST, DEVICES, TrainConfig
from attnres.training.optim import SCHEDULES

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (standard, full or block residual) and log, evaluate and checkpoint it",
        description="Train a Llama-style decoder with a standard, Full AttnRes or Block AttnRes residual. The run "
        "folder (--out) gets config.json, log.jsonl (train and eval lines) and atomic checkpoints; --resume "
        "continues a stopped run to the same parameters as an uninterrupted one.",
    )
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="text files or folders (recursive, text files only), or hf:NAME[:CONFIG[:SPLIT[:COLUMN]]] for a "
                   "Hugging Face dataset (needs `datasets` and a network). Default: the .py sources of this Python's "
                   "standard library, no download")
    d.add_argument("--max-bytes", type=int, default=DEFAULTS["max_bytes"], help="bytes of text to read (default: %(default)s)")
    d.add_argument("--tokenizer", default=DEFAULTS["tokenizer"],
                   help="'bytes' (byte-level, vocab 256, NUL separates files) or a Hugging Face tokenizer name or "
                   "folder, searched locally unless --allow-download (default: %(default)s)")
    d.add_argument("--allow-download", action="store_true",
                   help="let --tokenizer or --init-from be fetched from the Hugging Face Hub")
    d.add_argument("--val-fraction", type=float, default=DEFAULTS["val_fraction"],
                   help="the last part of the token stream, held out for validation (default: %(default)s)")

    m = p.add_argument_group("model")
    m.add_argument("--residual", choices=RESIDUAL_KINDS, default=DEFAULTS["residual"], help="(default: %(default)s)")
    m.add_argument("--block-size", type=int, default=DEFAULTS["block_size"],
                   help="Block AttnRes block size, counted in decoder layers (default: %(default)s)")
    m.add_argument("--rescale-mixture", action="store_true",
                   help="attn_res_rescale_mixture: a zero-query AttnRes model computes exactly the standard model")
    m.add_argument("--init-from", default=None, metavar="FOLDER",
                   help="continue training a pretrained causal LM: a local transformers folder (any supported family, "
                   "or a run's final/) or a Hub name with --allow-download, converted exactly to --residual (its "
                   "step-0 validation loss is the folder's own); its tokenizer is used, and the architecture flags "
                   "(--layers, --dim, --heads, --kv-heads, --ffn, --tie-embeddings, --base, --base-config, "
                   "--tokenizer) are refused")
    m.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="decoder layers (default: %(default)s)")
    m.add_argument("--dim", type=int, default=DEFAULTS["dim"], help="hidden size (default: %(default)s)")
    m.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="attention heads (default: %(default)s)")
    m.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as --heads)")
    m.add_argument("--ffn", type=int, default=None,
                   help="SwiGLU intermediate size (default: 8/3 * dim rounded up to a multiple of 32)")
    m.add_argument("--tie-embeddings", action="store_true", help="share the input embedding with the output head")
    m.add_argument("--base", default=DEFAULTS["base"], metavar="FAMILY",
                   help="the transformers decoder family to build the model from, by model_type, e.g. llama, qwen3, "
                   "qwen3_moe, gemma2, mixtral, deepseek_v3 (default: %(default)s); the sizes above apply to it")
    m.add_argument("--base-config", nargs="+", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="more fields of the family's config, values in JSON (e.g. num_experts=8 num_experts_per_tok=2)")
    m.add_argument("--activation-checkpointing", action="store_true",
                   help="checkpoint each decoder layer: backward recomputes its forward from the residual state it "
                   "took (less memory, about one more forward of compute)")

    o = p.add_argument_group("optimisation")
    o.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens a sequence (default: %(default)s)")
    o.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="sequences a step (default: %(default)s)")
    o.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps (default: %(default)s)")
    o.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="peak AdamW learning rate (default: %(default)s)")
    o.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: a tenth of --steps)")
    o.add_argument("--schedule", choices=SCHEDULES, default=DEFAULTS["schedule"],
                   help="decay after warm-up: cosine, or wsd (stable, then linear decay over --decay-fraction of the "
                   "steps) (default: %(default)s)")
    o.add_argument("--min-lr-ratio", type=float, default=DEFAULTS["min_lr_ratio"],
                   help="the schedule ends at lr * this (default: %(default)s)")
    o.add_argument("--decay-fraction", type=float, default=DEFAULTS["decay_fraction"],
                   help="wsd: share of the steps spent decaying (default: %(default)s)")
    o.add_argument("--branch-from", default=None, metavar="CHECKPOINT",
                   help="wsd: start from RUN/checkpoints/step-N of a longer wsd run with the same settings (N at or "
                   "before both decays start) and decay from there; ends as a run of --steps trained from scratch "
                   "would, for the cost of the decay only")
    o.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"],
                   help="AdamW weight decay of the weight matrices; norms, biases and embeddings get none (default: %(default)s)")
    o.add_argument("--attn-res-lr-mult", type=float, default=DEFAULTS["attn_res_lr_mult"],
                   help="learning-rate multiplier of the AttnRes pseudo-queries and key gains; at 1 the depth softmax "
                   "saturates early and AttnRes loses at small scale (docs/design.md section 10; default: %(default)s)")
    o.add_argument("--freeze-base", action="store_true",
                   help="with --init-from and a Block or Full residual: train the AttnRes parameters only (at "
                   "--lr times --attn-res-lr-mult), the pretrained weights stay as they are")
    o.add_argument("--attn-res-weight-decay", type=float, default=DEFAULTS["attn_res_weight_decay"],
                   help="weight decay of the AttnRes parameters (default: %(default)s)")
    o.add_argument("--grad-clip", type=float, default=DEFAULTS["grad_clip"],
                   help="clip the global gradient norm to this; 0: no clipping (default: %(default)s)")
    o.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seeds the weights and the batches (default: %(default)s)")
    o.add_argument("--autocast", choices=AUTOCAST, default=DEFAULTS["autocast"],
                   help="bf16 autocast (weights and optimizer stay fp32). auto: on for CUDA, off on CPU, where bf16 "
                   "autocast measured slower than fp32 (default: %(default)s)")
    o.add_argument("--device", choices=DEVICES, default=DEFAULTS["device"], help="(default: %(default)s: CUDA if present)")
    o.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own choice). On a machine whose cores other jobs "
                   "share, 1 can be many times faster than 2")
    o.add_argument("--keep-subnormals", action="store_true",
                   help="on a CPU, keep subnormal floats (default: flush them to zero, torch.set_flush_denormal: each "
                   "operation on one costs x86 a microcode assist, and a depth softmax's tiny weights make them in the "
                   "sublayers' backward, up to 2.8x a step's time)")

    dp = p.add_argument_group("distributed (launch with torchrun; --pp x --dp-replicate x --dp-shard x --tp = the ranks)")
    dp.add_argument("--dp-shard", type=int, default=DEFAULTS["dp_shard"],
                    help="data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2, one group "
                    "per decoder layer); -1: the ranks the other dimensions leave (default: %(default)s)")
    dp.add_argument("--dp-replicate", type=int, default=DEFAULTS["dp_replicate"],
                    help="data-parallel replicas (DDP alone, HSDP with --dp-shard) (default: %(default)s)")
    dp.add_argument("--tp", type=int, default=DEFAULTS["tp"],
                    help="tensor + sequence parallel ranks: attention heads and MLP columns split over them, the "
                    "residual state over the sequence (dense families) (default: %(default)s)")
    dp.add_argument("--pp", type=int, default=DEFAULTS["pp"],
                    help="pipeline stages: the decoder layers cut into stages, the residual state sent between them "
                    "(torch.distributed.pipelining) (default: %(default)s)")
    dp.add_argument("--parallel", choices=PARALLEL, default=DEFAULTS["parallel"],
                    help="shorthand for one dimension over every rank: ddp (--dp-replicate N), fsdp (--dp-shard N), "
                    "tp (--tp N), pipeline (--pp N) (default: %(default)s)")
    dp.add_argument("--pp-schedule", choices=PP_SCHEDULES, default=DEFAULTS["pp_schedule"],
                    help="pipeline schedule; interleaved and zero-bubble need --virtual-stages >= 2; zero-bubble sends "
                         "every row (no cross-stage caching) (default: %(default)s)")
    dp.add_argument("--virtual-stages", type=int, default=DEFAULTS["virtual_stages"],
                    help="pipeline: chunks of decoder layers a rank; the layers split evenly into ranks x this "
                    "(default: %(default)s)")
    dp.add_argument("--microbatches", type=int, default=None,
                    help="pipeline: microbatches a step; --batch-size must be a multiple (default: one per stage)")
    dp.add_argument("--dist-timeout", type=float, default=DEFAULTS["dist_timeout"],
                    help="seconds a collective waits for the other ranks before the run fails (default: %(default)s)")

    r = p.add_argument_group("run folder")
    r.add_argument("--out", default=None, help="run folder (default: runs/<residual>-L<layers>-d<dim>-s<seed>)")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (or start it when there is none)")
    r.add_argument("--overwrite", action="store_true", help="delete the run already in --out and start afresh")
    r.add_argument("--stop-after", type=int, default=None,
                   help="end this invocation after this many steps, checkpointed; --resume continues to --steps")
    r.add_argument("--eval-interval", type=int, default=DEFAULTS["eval_interval"], help="(default: %(default)s)")
    r.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"],
                   help="fixed validation batches, spread over the held-out split (default: %(default)s)")
    r.add_argument("--log-interval", type=int, default=DEFAULTS["log_interval"], help="(default: %(default)s)")
    r.add_argument("--checkpoint-interval", type=int, default=DEFAULTS["checkpoint_interval"],
                   help="(default: %(default)s; the last step is always saved)")
    r.add_argument("--keep-checkpoints", type=int, default=DEFAULTS["keep_checkpoints"], help="(default: %(default)s)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def config_from_args(args) -> TrainConfig:
    values = {name: getattr(args, name) for name in DEFAULTS if hasattr(args, name)}
    values["base_config"] = dict(getattr(args, "base_config", None) or [])
    if values.get("data") is None:
        values["data"] = DEFAULTS["data"]
    elif len(values["data"]) == 1:
        values["data"] = values["data"][0]
    return TrainConfig(**values)


def run(args) -> int:
    from attnres.distributed import RankFailed
    from attnres.training import TrainingDiverged, train

    try:  # a bad setting (ValueError) is the command line's one-line error, like every command's
        result = train(config_from_args(args))
    except (TrainingDiverged, RankFailed) as e:
        print(f"attnres train: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone reports
        return 0
    print(
        f"{result.run_dir}: {result.steps} steps, val loss {result.final_val_loss:.4f}, "
        f"{result.num_params:,} parameters, {result.tokens_per_s:,.0f} tokens/s"
    )
    return 0
