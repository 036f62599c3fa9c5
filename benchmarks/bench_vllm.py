"""Output tokens/s under vLLM of an original model and its Block and Full AttnRes conversions, side by side.

Runs in vLLM's environment (`source .ci/vllm_env.sh`, then `$ATTNRES_VLLM_PYTHON benchmarks/bench_vllm.py`). It
builds a random-init Llama of the given size, saves it, converts it to Block and Full (pseudo-queries and key gains
moved off their init, so the depth softmax is not uniform) and serves the three folders with `vllm.LLM` through the
attnres plugin, each in a fresh process with the engine in it, one at a time, in `--repeats` rounds of the three. Each
serves the same greedy workload (`--requests` prompts of mixed lengths sent together, each generating `--max-tokens`
tokens) once untimed and `--runs` times timed. Kept per run: output tokens per second of wall time, and per CPU second
of the serving process (steadier on a shared machine); reported: medians, the median of the run-by-run ratios
AttnRes / original within rounds, and, from one more run under cProfile, the share of the serving time spent in the
AttnRes residual path (attnres code and its CPU kernels).

    OMP_NUM_THREADS=1 $ATTNRES_VLLM_PYTHON benchmarks/bench_vllm.py --out docs/bench_vllm.json   # CPU, fp32, eager
    python benchmarks/bench_vllm.py --dtype bfloat16 --out vllm_gpu.json         # GPU, the `vllm` package, eager

With `--if-installed` (the vLLM stage of benchmarks/gpu_check.sh), a Python without the `vllm` package writes a
"not run" record to `--out` and exits 0 instead of failing.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("original", "block", "full")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512, help="hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="attention heads, head_dim 64 (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=1,
                   help="Block AttnRes block size in decoder layers (default: %(default)s: 8 blocks of 8 layers)")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="prompt lengths, spread over this range (default: 16 128)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per model (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (default: %(default)s)")
    p.add_argument("--compiled", action="store_true", help="let vLLM compile and capture graphs (default: eager)")
    p.add_argument("--kv-cache-mib", type=int, default=128, help="KV cache per engine (default: %(default)s)")
    p.add_argument("--runs", type=int, default=2, help="timed runs per served model and round (default: %(default)s)")
    p.add_argument("--serve", nargs=2, metavar=("FOLDER", "SPEC"), help=argparse.SUPPRESS)  # one model, internal
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here (atomically)")
    p.add_argument("--if-installed", action="store_true",
                   help="without the vllm package, write a 'not run' record to --out and exit 0")
    args = p.parse_args(argv)
    for name in ("dim", "layers", "heads", "vocab", "block_size", "requests", "max_tokens", "repeats", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_tokens[0] <= args.prompt_tokens[1]:
        p.error(f"--prompt-tokens: expected 1 <= MIN <= MAX, got {args.prompt_tokens}")
    return args


def build_folders(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnres
    from attnres.serving.checks import family_architecture  # noqa: F401  (the plugin's module imports)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=int(2.75 * args.dim) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.dim // args.heads, max_position_embeddings=args.prompt_tokens[1] + args.max_tokens + 8,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    original = LlamaForCausalLM(config).eval()
    folders = {"original": root / "original"}
    original.save_pretrained(folders["original"])
    gen = torch.Generator().manual_seed(1)
    for kind in ("block", "full"):
        model = attnres.convert_from_hf(original, residual=kind, attn_res_block_size=args.block_size)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_res_proj.weight"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        folders[kind] = root / kind
        model.save_pretrained(folders[kind])
    return folders


def workload(args: argparse.Namespace) -> list[list[int]]:
    low, high = args.prompt_tokens
    lengths = [low + (high - low) * i // max(args.requests - 1, 1) for i in range(args.requests)]
    return [[(31 * r + 7 * j) % (args.vocab - 1) + 1 for j in range(n)] for r, n in enumerate(lengths)]


def engine_args(args: argparse.Namespace) -> dict:
    return dict(
        skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=not args.compiled,
        max_model_len=args.prompt_tokens[1] + args.max_tokens + 8, max_num_seqs=args.requests,
        gpu_memory_utilization=0.1 if _on_cpu() else 0.25, kv_cache_memory_bytes=args.kv_cache_mib << 20,
    )


def serve(folder: str, spec_path: str) -> None:
    """In a fresh process, the engine in it: serve `folder`, run the workload once untimed, then `runs` times; print
    each run's output tokens per second of wall time and per CPU second of this process (all its threads)."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=folder, **spec["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels built, caches allocated
    runs = []
    for _ in range(spec["runs"]):
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(dict(wall=tokens / wall, cpu=tokens / cpu))
    profile = cProfile.Profile()
    profile.runcall(llm.generate, prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps(dict(runs=runs, attnres_share=attnres_share(profile))), flush=True)


def attnres_share(profile: cProfile.Profile) -> float:
    """The share of a profiled run's time spent in attnres code and its CPU kernels (the AttnRes residual path; the
    plugin's forward loop, which only calls the family's modules, counts as vLLM's). Our files are found by the
    package's own folder: a venv may live under a folder named attnres too."""
    import attnres
    import attnres.serving.vllm_model as plugin_model

    package = os.path.dirname(attnres.__file__) + os.sep
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)
    total = sum(entry[2] for entry in stats.values())
    ours = sum(entry[2] for (file, _, name), entry in stats.items()
               if (file.startswith(package) and file != plugin_model.__file__) or "attnres_cpu" in name)
    return ours / total


def measure(args: argparse.Namespace, folders: dict[str, Path], root: Path) -> dict[str, dict[str, list[float]]]:
    """Rounds of the three models in turn, each served in a fresh process (one engine on the machine at a time), so
    that the machine's load of the moment reaches the three alike within a round."""
    spec = root / "spec.json"
    spec.write_text(json.dumps(dict(engine=engine_args(args), prompts=workload(args), max_tokens=args.max_tokens,
                                    runs=args.runs)))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in the process whose CPU time is read
    runs = {kind: {"wall": [], "cpu": [], "attnres_share": []} for kind in KINDS}
    for repeat in range(args.repeats):
        for kind in KINDS[repeat % 3:] + KINDS[:repeat % 3]:  # each model first in some round
            proc = subprocess.run([sys.executable, __file__, "--serve", str(folders[kind]), str(spec)],
                                  capture_output=True, text=True, env=env)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.exit(f"bench_vllm: serving {kind} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            result = json.loads(line[len("RESULT "):])
            for run in result["runs"]:
                for key in ("wall", "cpu"):
                    runs[kind][key].append(run[key])
            runs[kind]["attnres_share"].append(result["attnres_share"])
            print(f"round {repeat + 1}/{args.repeats} {kind}: {runs[kind]['wall'][-args.runs:]} tokens/s", flush=True)
    return runs


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def not_installed_record() -> dict | None:
    """The 'not run' record for a Python without the vllm package (None where it has one)."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    return dict(status="not run", why=f"vllm is not installed on this machine ({sys.executable} finds no module named "
                                      f"'vllm'); install vllm there to run this benchmark")


def write_json(path: Path, result: dict) -> None:
    tmp_out = path.with_name(path.name + ".tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp_out, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return
    if args.if_installed and (record := not_installed_record()) is not None:
        print(f"bench_vllm: not run: {record['why']}")
        if args.out:
            write_json(args.out, record)
        return
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        root = Path(tmp)
        folders = build_folders(args, root)
        runs = measure(args, folders, root)
    import torch
    import vllm

    median = {kind: {k: statistics.median(r[k]) for k in ("wall", "cpu")} for kind, r in runs.items()}
    # run by run within a round, then the median: a round's three processes share the machine's load of the moment
    ratios = {
        kind: {k: statistics.median(a / b for a, b in zip(runs[kind][k], runs["original"][k])) for k in ("wall", "cpu")}
        for kind in ("block", "full")
    }
    result = dict(
        status="ok",
        what="vLLM output tokens/s, greedy, original Llama vs its Block and Full AttnRes conversions",
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        settings={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                  if k not in ("out", "serve", "if_installed")},
        environment=dict(vllm=vllm.__version__, torch=torch.__version__, python=platform.python_version(),
                         machine=platform.machine(), cpus=os.cpu_count(),
                         omp_num_threads=os.environ.get("OMP_NUM_THREADS")),
        load_average_1min=os.getloadavg()[0],
        attnres_share_of_time={kind: statistics.median(r["attnres_share"]) for kind, r in runs.items()},
        output_tokens_per_s={kind: r["wall"] for kind, r in runs.items()},
        output_tokens_per_cpu_s={kind: r["cpu"] for kind, r in runs.items()},
        median=median,
        ratio_to_original=ratios,
    )
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
