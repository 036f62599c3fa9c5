"""`attnres bench`: the benchmark suite (operator, residual streams, fused inference, model level), JSON + chart +
table."""

from __future__ import annotations

from pathlib import Path

import torch

from attnres.bench import SuiteConfig, run_suite
from attnres.bench.config import DTYPES, GROUPS
from attnres.bench.timing import SUBNORMALS_HELP
from attnres.bench.report import markdown_table, write_chart, write_json

DEFAULTS = SuiteConfig()


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time AttnRes against the plain residual, its twins and the compiled peer; write JSON and a chart",
        description="In one process: the machine's copy bandwidth, then each case and its baselines side by side "
        "(medians of repeats after warm-up): the operator forward and forward+backward and the fused inference "
        "aggregation (each against its twin, torch.sum over the same stacked sources and flash-linear-attention's "
        "naive_attnres under torch.compile, with GB/s of the docs/design.md section 9 bytes model); the residual "
        "stream as "
        "the models run it (two-phase group: standard against Block one-shot and two-phase); the training step, "
        "prefill and decode of Block and Full AttnRes against the standard model; the training step of the small "
        "model of `attnres compare` (small group); the model cases, whose steps alternate round by round, also "
        "give the spread of each model's time over the standard model's within a round. The models' plain "
        "RMSNorms get the fastest plain norm, the standard baseline's included, unless --family-norms.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every case in seconds")
    p.add_argument("--out", type=Path, default=Path("runs/bench"),
                   help="folder for bench.json and bench.png (default: runs/bench)")
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=None, help="cases to run (default: all)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None,
                   help="operator dtypes (default: fp32 bf16)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd flash-linear-attention peer")
    p.add_argument("--family-norms", action="store_true",
                   help="keep the family's Python RMSNorm in the models (default: the fastest plain norm for all)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    p.add_argument("--keep-subnormals", action="store_true", help=SUBNORMALS_HELP)
    p.add_argument("--compile-timeout", type=float, default=None,
                   help="skip the compiled peer once one compile takes longer, seconds "
                   f"(default: {DEFAULTS.compile_timeout:g})")
    sizes = p.add_argument_group("sizes (defaults: full suite; --quick shrinks the ones not given)")
    for name, help_text in (
        ("sources", "R, sources of the operator"), ("tokens", "T of the operator cases"), ("dim", "d of the operator"),
        ("stream_layers", "decoder layers of the residual-stream case"),
        ("stream_block_size", "its block size, decoder layers"), ("model_dim", "hidden size of the models"),
        ("model_layers", "decoder layers"), ("model_heads", "attention heads"),
        ("model_tokens", "T of training and prefill"),
        ("vocab", "vocabulary size"), ("block_size", "decoder layers per block of the Block model"),
        ("batch", "sequences per training step"), ("context", "cached tokens before a decode step"),
        ("repeats", "timed rounds per case"), ("decode_repeats", "timed rounds of the decode case"),
        ("warmup", "untimed calls per implementation"), ("copy_mib", "size of the copy-bandwidth probe, MiB"),
        ("small_dim", "hidden size of the small model"), ("small_layers", "its decoder layers"),
        ("small_batch", "its sequences per step"), ("small_tokens", "its tokens per sequence"),
        ("small_repeats", "timed rounds of the small model"),
    ):
        sizes.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                       help=f"{help_text} (default: {getattr(DEFAULTS, name)})")
    p.set_defaults(func=run)


def config_from_args(args) -> SuiteConfig:
    fields = SuiteConfig.__dataclass_fields__
    given = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    if args.groups:
        given["groups"] = tuple(args.groups)
    if args.dtypes:
        given["dtypes"] = tuple(args.dtypes)
    given["compile"] = not args.no_compile
    given["family_norms"] = args.family_norms
    given["keep_subnormals"] = args.keep_subnormals
    return SuiteConfig.quick(**given) if args.quick else SuiteConfig(**given)


def run(args) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        raise SystemExit(f"attnres bench: {err}") from None
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"attnres bench: --threads: expected a positive number, got {args.threads}")
        torch.set_num_threads(args.threads)
    result = run_suite(cfg).to_dict()
    json_path = write_json(result, args.out / "bench.json")
    chart_path = write_chart(result, args.out / "bench.png")
    print()
    print(markdown_table(result))
    print(f"\nwrote {json_path} and {chart_path}")
    return 0
