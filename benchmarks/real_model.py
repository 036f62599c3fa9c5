"""What AttnRes costs on a real pretrained model: SmolLM2-135M-Instruct (`attnres fetch smollm2-135m`) as transformers
loads it, against its exact Block and Full conversions (`attnres.convert_from_hf`), in one process. Its standard
conversion (the AttnRes decoder layer with the plain residual sum) runs beside them: what the layer costs apart from
the depth attention.

Two cases, each model once in every round (a shared machine's changing load then reaches all of them alike), in an
order that rotates from round to round (no model always runs after the same one), the median of the rounds' ratios to
the original. The conversions compute with the original's own weight tensors (theirs are only the AttnRes queries and
key gains): where a model's weights lie in memory moves a decode step, which streams them all, by several percent, and
that would be measured as AttnRes's cost. A deep copy of the original with weights of its own runs beside them as a
fifth model ("copy"): how far its ratio is from 1 is what the weights' place alone does, and how far a ratio can be
trusted. The original itself is a deep copy of the loaded model, whose weights would stay in the file's memory map.
- train: one optimizer step (forward with loss, backward, torch's fused AdamW) on 2 x 256 tokens of real text;
- decode: one greedy decode step at batch 1 with a KV cache of 64 tokens (the middle of a 64-token answer to a
  32-token prompt), the cache cropped back after each step. A step is short, so the rounds are many: a machine whose
  speed drifts over seconds then reaches the models alike.
The paper reports under 4% for training and under 2% for inference (Kimi K3 scale, on GPUs).

    python -m benchmarks.real_model                                # fp32 and bf16 on the CPU -> docs/real_model.json
    python -m benchmarks.real_model --device cuda --dtypes bf16     # on a GPU
    python -m benchmarks.real_model --random-weights                # the same shapes, nothing to download
    python -m benchmarks.real_model --profile train decode          # where the time goes: torch.profiler tables
                                                                     # -> docs/real_model_profile.json

Apart from subnormal floats (flushed to zero in every model unless `--keep-subnormals`), the cost does not depend on
the weights' values: `--random-weights` builds SmolLM2-135M's architecture from its config (below) with a random
init, for a machine without network (the GPU check's stage).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import sys
from pathlib import Path

import torch

from attnres.atomic import atomic_write_text
from attnres.bench.models import decode_step, fast_norms
from attnres.bench.timing import SUBNORMALS_HELP, flush_subnormals, round_times
from attnres.layers.kinds import BLOCK, FULL, STANDARD

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# SmolLM2-135M-Instruct's llama config (its config.json, as `attnres fetch smollm2-135m` writes it)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True)
# a few-second stand-in of the same family, for dry runs on a CPU
SMOKE = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)
ORIGINAL = "original"
COPY = "copy"  # a deep copy of the original, timed as the others are: how far a ratio moves with nothing changed
CASES = ("train", "decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=None, help="a transformers folder (default: `attnres fetch smollm2-135m`'s)")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's architecture with random weights instead of a folder (nothing to download)")
    p.add_argument("--smoke", action="store_true", help="a tiny model of the same family with random weights")
    p.add_argument("--block-size", type=int, default=5, help="Block AttnRes block size in layers (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"], help="(default: fp32 bf16)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="(default: train decode)")
    p.add_argument("--rounds", type=int, default=7, help="timed training rounds (default: %(default)s)")
    p.add_argument("--decode-rounds", type=int, default=200, help="timed decode rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each model first (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="training sequences per step (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="training tokens per sequence (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="tokens in the KV cache at decode (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: cuda if present)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--family-norms", action="store_true",
                   help="keep transformers' Python RMSNorm in every model instead of the fastest plain norm")
    p.add_argument("--keep-subnormals", action="store_true", help=SUBNORMALS_HELP)
    p.add_argument("--profile", nargs="+", choices=CASES, default=None,
                   help="instead of timing, profile each model in these cases with torch.profiler: print its table and "
                        "write each op's time per call and what Block and Full spend over the standard conversion")
    p.add_argument("--profile-rounds", type=int, default=5,
                   help="profiled calls of each model, one a round (default: %(default)s)")
    p.add_argument("--json", default=None,
                   help="where to write the figures (default: docs/real_model.json, with --profile "
                        "docs/real_model_profile.json)")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = "docs/real_model_profile.json" if args.profile else "docs/real_model.json"
    for name in ("block_size", "rounds", "decode_rounds", "batch", "tokens", "context", "profile_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def load_models(source: str | dict, dtype: torch.dtype, device: str, block_size: int, family_norms: bool) -> dict:
    """The original model (from a folder, or a llama config's fields with random weights), a deep copy of it, and
    its standard, Block and Full conversions, in `dtype` on `device`, every RMSNorm the fastest plain norm
    (`attnres.bench.models.fast_norms`: transformers' own is Python ops, slower than the PreNorm an AttnRes read
    fuses) unless `family_norms`. The standard conversion is the AttnRes decoder layer with the plain residual sum:
    what the layer costs apart from the depth attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from attnres.models import convert_from_hf

    if isinstance(source, dict):
        torch.manual_seed(0)
        original = LlamaForCausalLM(LlamaConfig(**source)).to(device, dtype)
    else:
        # a deep copy: loaded in its file's dtype, a model's weights stay in the file's memory map, which a CPU decode
        # step reads at another speed than the copy's weights
        original = copy.deepcopy(AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device))
    models = {
        ORIGINAL: original,
        COPY: copy.deepcopy(original),
        STANDARD: convert_from_hf(copy.deepcopy(original), residual=STANDARD),
        BLOCK: convert_from_hf(copy.deepcopy(original), residual=BLOCK, attn_res_block_size=block_size),
        FULL: convert_from_hf(copy.deepcopy(original), residual=FULL),
    }
    for name in (STANDARD, BLOCK, FULL):
        share_weights(models[name], original)
    if not family_norms:  # every model's norms as fast as a plain norm gets: the original's included
        for model in models.values():
            fast_norms(model, {type(original.model.norm)})
    return models


def share_weights(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Make each of `model`'s parameters named as one of `source`'s that very parameter (tied ones included): both
    models then read the same weight memory, and a training step of either updates it."""
    for name, param in source.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, param)


def real_tokens(source: str | dict, count: int) -> torch.Tensor:
    """`count` token ids of real text: the standard library's sources in the model's own tokenizer (random ids for a
    model with random weights)."""
    from transformers import AutoTokenizer

    if isinstance(source, dict):
        return torch.randint(0, source["vocab_size"], (count,), generator=torch.Generator().manual_seed(0))
    folder = source
    from attnres.training.data import read_corpus

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = b"\n".join(read_corpus("stdlib", 8 * count).documents).decode("utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < count:
        raise ValueError(f"tokens: the corpus gave {len(ids)} tokens, fewer than the {count} asked for")
    return torch.tensor(ids[:count])


def training_step(model, ids: torch.Tensor):
    from attnres.training.optim import fused_adamw

    model.train()
    optimizer = fused_adamw(model.parameters(), lr=1e-6)  # small: the weights stay those of a real model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


def case_functions(case: str, models: dict, tokens: torch.Tensor, args) -> dict:
    device = next(models[ORIGINAL].parameters()).device
    if case == "train":
        ids = tokens[: args.batch * args.tokens].view(args.batch, args.tokens).to(device)
        return {name: training_step(m, ids) for name, m in models.items()}
    context, token = tokens[None, : args.context].to(device), tokens[None, args.context : args.context + 1].to(device)
    return {name: decode_step(m, context, token) for name, m in models.items()}


def counting_faults(fns: dict) -> tuple[dict, dict[str, list[int]]]:
    """The functions, each wrapped to record the process's minor page faults during each of its calls, and the lists
    they record into. A fault is the kernel mapping a page of memory freshly allocated: the C library's malloc returns
    large freed blocks to the kernel, so a step that allocates them again pays for their pages again, in system time
    that every model pays about alike (it shrinks every ratio)."""
    faults: dict[str, list[int]] = {name: [] for name in fns}

    def counted(name, fn):
        def call():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fn()
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

        return call

    return {name: counted(name, fn) for name, fn in fns.items()}, faults


def summarise(times: dict[str, list[float]], faults: dict[str, list[int]]) -> dict:
    rounds = len(times[ORIGINAL])
    ratios = {name: [t[i] / times[ORIGINAL][i] for i in range(rounds)] for name, t in times.items() if name != ORIGINAL}
    return {
        "ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "ratio": {name: statistics.median(r) for name, r in ratios.items()},
        # the timed calls' faults: round_times' warm-up calls come first
        "page_faults": {name: statistics.median(f[-rounds:]) for name, f in faults.items()},
        "round_ratios": ratios,
        "seconds": times,
    }


# ops whose self time per call differs between two models by less than this share of the base model's total are left
# out of the JSON's differences
PROFILE_MIN_SHARE = 0.001


def profile(fns: dict, device: str, rounds: int) -> dict:
    """Each model's torch.profiler record of one call per round, the models in an order that rotates from round to
    round as the timed rounds' (a shared machine's drift then reaches them alike): the last round's table printed, and
    returned as each op's median self CPU time and count per call over the rounds, with what Block and Full spend over
    the standard conversion, op by op, largest first."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    names = list(fns)
    for fn in fns.values():
        fn()
    seen = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            with torch_profile(activities=activities) as prof:
                fns[name]()
            seen[name].append({e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()})
            if r == rounds - 1:
                print(f"--- {name}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    ops = {
        name: {key: {"self_ms": statistics.median(run.get(key, (0.0, 0))[0] for run in runs),
                     "calls": statistics.median(run.get(key, (0.0, 0))[1] for run in runs)}
               for key in set().union(*runs)}
        for name, runs in seen.items()
    }
    record = {"self_cpu_ms": {name: sum(e["self_ms"] for e in o.values()) for name, o in ops.items()}, "ops": ops}
    record["over_standard"] = {name: over(ops[name], ops[STANDARD]) for name in (BLOCK, FULL)}
    record["parts_over_standard"] = {name: parts(ops[name], ops[STANDARD]) for name in (BLOCK, FULL)}
    return record


def over(ops: dict, base: dict) -> dict:
    """`ops`' self time per call minus `base`'s (ms), op by op where they differ by at least PROFILE_MIN_SHARE of
    `base`'s total, largest difference first."""
    none = {"self_ms": 0.0, "calls": 0.0}
    least = PROFILE_MIN_SHARE * sum(e["self_ms"] for e in base.values())
    diff = {key: ops.get(key, none)["self_ms"] - base.get(key, none)["self_ms"] for key in ops.keys() | base.keys()}
    return {key: round(ms, 4) for key, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if abs(ms) >= least}


# The parts of a step that AttnRes adds or removes, by the ops (profiler keys) that make each up: a C++ autograd node's
# backward is its `CppNode<...>` key.
PROFILE_PARTS = {
    "fused norms (attnres_cpu::point and its backward)": (
        "attnres_cpu::point", "torch::autograd::CppNode<(anonymous namespace)::Point>"),
    "Block's chained points (attnres_cpu::chained_point and its backward)": (
        "attnres_cpu::chained_point", "torch::autograd::CppNode<(anonymous namespace)::ChainedPoint>"),
    "Full's phase 1 (depth_stats_fwd, depth_stats_bwd_into)": (
        "attnres_cpu::depth_stats_fwd", "attnres_cpu::depth_stats_bwd_into"),
    "Full's phase 2 (attnres_cpu::merge_sources and its backward)": (
        "attnres_cpu::merge_sources", "torch::autograd::CppNode<(anonymous namespace)::MergeSources>"),
    "Full's phase-1 chain in Python (_ChainedStats and its backward)": ("_ChainedStats", "_ChainedStatsBackward"),
    "fused reads (attnres_cpu::bank_aggregate)": ("attnres_cpu::bank_aggregate",),
}


def parts(ops: dict, base: dict) -> dict:
    """`ops`' self time per call minus `base`'s (ms) for each of PROFILE_PARTS that differs, then "every other op" and
    "in all", each with its share of `base`'s total (the docs' table of where a step's extra time goes)."""
    none = {"self_ms": 0.0}
    total = sum(e["self_ms"] for e in base.values())
    diff = {key: ops.get(key, none)["self_ms"] - base.get(key, none)["self_ms"] for key in ops.keys() | base.keys()}
    out = {part: sum(diff.get(key, 0.0) for key in keys) for part, keys in PROFILE_PARTS.items()}
    out = {part: ms for part, ms in out.items() if ms}
    every = sum(diff.values())
    out |= {"every other op": every - sum(out.values()), "in all": every}
    return {part: {"ms": round(ms, 1), "share": round(ms / total, 4)} for part, ms in out.items()}


# what changes how the C library's malloc hands memory back to the kernel (and so the page faults of each step)
ALLOCATOR_VARIABLES = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def allocator_description(environ=os.environ) -> str:
    """The process's malloc settings from its environment (a preloaded allocator, glibc's tunables), or that it runs
    the C library's malloc as it comes."""
    settings = [f"{name}={environ[name]}" for name in ALLOCATOR_VARIABLES if environ.get(name)]
    return "; ".join(settings) or "the C library's malloc, default settings"


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and which of its instruction sets a bf16 step's matmuls and AttnRes's kernels can use (the
    bf16 ones do not give fp32 products, so the kernels run fp32 FMAs), where Linux says; else the platform's name."""
    try:
        info = cpuinfo.read_text()
    except OSError:
        return platform.processor() or platform.machine()
    pairs = (line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    name = fields.get("model name", platform.machine())
    flags = fields.get("flags", "").split()
    return f"{name} ({', '.join(f for f in ('avx512f', 'avx512_bf16', 'amx_bf16') if f in flags) or 'no AVX-512'})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    subnormals = flush_subnormals(args.keep_subnormals)
    if args.smoke or args.random_weights:
        source, name = (SMOKE, "llama (smoke sizes), random weights") if args.smoke else (
            SMOLLM2_135M, "SmolLM2-135M architecture, random weights")
    else:
        if args.folder is None:
            from attnres.models.fetch import fetch

            args.folder = str(fetch("smollm2-135m"))
        source, name = args.folder, Path(args.folder).name
    tokens = real_tokens(source, max(args.batch * args.tokens, args.context + 1))
    results = []
    for dtype_name in args.dtypes:
        models = load_models(source, DTYPES[dtype_name], args.device, args.block_size, args.family_norms)
        for case in args.profile or args.cases:
            fns = case_functions(case, models, tokens, args)
            if args.profile:
                results.append({"case": case, "dtype": dtype_name, **profile(fns, args.device, args.profile_rounds)})
                continue
            rounds = args.rounds if case == "train" else args.decode_rounds
            fns, faults = counting_faults(fns)
            times = round_times(fns, rounds, args.warmup, args.device)
            row = {"case": case, "dtype": dtype_name, **summarise(times, faults)}
            results.append(row)
            print(f"{case:6s} {dtype_name}: original {row['ms'][ORIGINAL]:8.1f} ms, "
                  f"{row['page_faults'][ORIGINAL]:.0f} page faults; "
                  + "; ".join(f"{k} {row['ratio'][k]:.3f}x" for k in (COPY, STANDARD, BLOCK, FULL)), flush=True)
        del models
    record = {
        "model": name, "block_size": args.block_size, "device": args.device,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "cpu": cpu_description(),
        "allocator": allocator_description(),
        "train_shape": [args.batch, args.tokens], "decode": {"batch": 1, "context": args.context},
        **({"profile_rounds": args.profile_rounds} if args.profile else {
            "rounds": args.rounds, "decode_rounds": args.decode_rounds, "warmup": args.warmup}),
        "norms": "family" if args.family_norms else "fastest plain (attnres.bench.models.fast_norms)",
        "subnormals": subnormals,
        "command": "python -m benchmarks.real_model " + " ".join(sys.argv[1:]),
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
