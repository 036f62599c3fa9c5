"""Benchmark of the CPU fast path of the depth-attention operator, against the torch path and `torch.sum`.

In one process: the machine's copy bandwidth (a large `copy_` into memory already touched), then for each dtype
the forward and the forward+backward of the compiled kernel (`attnres.ops.cpu`) and of the portable torch path,
and `torch.sum` over the same sources stacked (the cost of the plain residual sum: it reads the same bytes), and
phase 1 of the two-phase computation (forward, and backward alone) for S queries over the same sources, kernel
and torch path. The cases run round-robin, one call each per round, so that a change in the machine's load hits
all of them alike; times are medians over the rounds. Effective GB/s use the bytes model of docs/design.md section 9:
every source read once and the output written once; the backward reads the sources and the output gradient and
writes one gradient per source; phase 1 reads the sources once and writes the fp32 statistics u `[S, T, d]`, its
backward reads the sources and the gradient of u and writes one gradient per source. "vs S x 1-shot" compares
phase 1 with S one-shot forwards, the reads it replaces. The peak extra memory of a forward is what it allocates
through torch beyond its outputs, from the profiler's allocation events (the compiled kernel's own scratch is not
a torch allocation: by analysis it is a few d-long fp32 rows and 2R(2S + 1) registers of partial sums per
thread).

Fresh outputs of hundreds of MiB cost page faults as well as writes: every case also reports the minor page faults
of one call (median). The kernel asks for transparent huge pages for its outputs; torch does so for all of its
allocations under THP_MEM_ALLOC_ENABLE=1, so run once with and once without it to see how much of a difference is
page faults.

Arithmetic on subnormal floats takes a microcode assist on x86; the kernels read subnormal inputs as zero and flush
subnormal results (FlushSubnormals in the C++ source), and `--subnormal F` makes a fraction F of the source entries
subnormal to show it. `--processes N` runs the whole measurement in N fresh processes, one after another, and reports
each case's spread over them (the median, least and most of the per-process medians, and of its ratio to `torch.sum`)
beside every process's own figures.

    python -m benchmarks.bench_cpu                        # R=9, T=4096, d=2048, S=8 queries, fp32 and bf16
    THP_MEM_ALLOC_ENABLE=1 python -m benchmarks.bench_cpu --repeats 15 --json cpu.json
    python -m benchmarks.bench_cpu --processes 10 --dtypes fp32,bf16 --queries 0 --subnormal 0.01 \
        --json docs/bench_cpu_processes.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from attnres.atomic import atomic_write_text
from attnres.ops import cpu
from attnres.ops.depth_attention import torch_depth_attention_bwd, torch_depth_attention_fwd
from attnres.ops.two_phase import torch_depth_stats_bwd, torch_depth_stats_fwd

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-6


class Case:
    """One timed call, the bytes it moves by the bytes model, and how many rounds it takes part in."""

    def __init__(self, fn: Callable[[], object], nbytes: int, rounds: int):
        self.fn, self.nbytes, self.rounds, self.seconds, self.faults = fn, nbytes, rounds, [], []

    def median(self) -> float:
        return statistics.median(self.seconds)


def run_rounds(cases: dict[str, Case]) -> None:
    for case in cases.values():  # warm-up: first-touch of inputs, lazy initialisation
        case.fn()
    for r in range(max(c.rounds for c in cases.values())):
        for case in cases.values():
            if r < case.rounds:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                case.fn()
                case.seconds.append(time.perf_counter() - start)
                case.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes that `fn` holds allocated through torch beyond the tensors it returns."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak - sum(t.nbytes for t in result)


def with_subnormals(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """x with `fraction` of its entries replaced by a subnormal number of its dtype."""
    return x.masked_fill(torch.rand(x.shape) < fraction, torch.finfo(x.dtype).tiny / 8) if fraction else x


def dtype_cases(dtype: torch.dtype, args: argparse.Namespace) -> tuple[dict[str, Case], dict[str, Callable]]:
    """The timed cases of one dtype, and the forwards whose memory is measured."""
    R, T, d = args.sources, args.tokens, args.dim
    e = torch.finfo(dtype).bits // 8
    sources = [with_subnormals(torch.randn(T, d).to(dtype), args.subnormal) for _ in range(R)]
    stacked = torch.stack(sources)
    c = torch.randn(d) / d**0.5
    grad_out = torch.randn(T, d).to(dtype)

    def fwd(impl):
        return lambda: impl(sources, c, None, EPS, EPS)

    def fwd_bwd(impl_fwd, impl_bwd):
        def run():
            _, weights, rstd = impl_fwd(sources, c, None, EPS, EPS)
            return impl_bwd(grad_out, None, sources, c, None, weights, rstd, EPS, EPS)

        return run

    fwd_bytes = (R + 1) * T * d * e
    both_bytes = fwd_bytes + (2 * R + 1) * T * d * e
    fast_fwd, torch_fwd = fwd(cpu.cpu_depth_attention_fwd), fwd(torch_depth_attention_fwd)
    fast_both = fwd_bwd(cpu.cpu_depth_attention_fwd, cpu.cpu_depth_attention_bwd)
    torch_both = fwd_bwd(torch_depth_attention_fwd, torch_depth_attention_bwd)
    cases = {
        "torch.sum": Case(lambda: torch.sum(stacked, 0), fwd_bytes, args.repeats),
        "fast fwd": Case(fast_fwd, fwd_bytes, args.repeats),
        "fast fwd+bwd": Case(fast_both, both_bytes, args.repeats),
        "torch fwd": Case(torch_fwd, fwd_bytes, args.torch_repeats),
        "torch fwd+bwd": Case(torch_both, both_bytes, args.torch_repeats),
    }
    forwards = {"fast fwd": fast_fwd, "torch fwd": torch_fwd}
    if args.queries:
        S = args.queries
        cs = torch.randn(S, d) / d**0.5
        grad_z, grad_u = torch.randn(S, T), torch.randn(S, T, d)
        m, _, _, rstd = cpu.cpu_depth_stats_fwd(sources, cs, EPS)
        stats_fwd_bytes = R * T * d * e + S * T * d * 4
        stats_bwd_bytes = 2 * R * T * d * e + S * T * d * 4
        forwards["fast stats fwd"] = lambda: cpu.cpu_depth_stats_fwd(sources, cs, EPS)
        forwards["torch stats fwd"] = lambda: torch_depth_stats_fwd(sources, cs, EPS)
        for name, fn, nbytes, rounds in (
            ("fast stats fwd", forwards["fast stats fwd"], stats_fwd_bytes, args.repeats),
            ("torch stats fwd", forwards["torch stats fwd"], stats_fwd_bytes, args.torch_repeats),
            ("fast stats bwd", lambda: cpu.cpu_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, EPS),
             stats_bwd_bytes, args.repeats),
            ("torch stats bwd", lambda: torch_depth_stats_bwd(grad_z, grad_u, sources, cs, m, rstd, EPS),
             stats_bwd_bytes, args.torch_repeats),
        ):
            cases[name] = Case(fn, nbytes, rounds)
    if not args.torch_repeats:  # the torch path left out
        cases = {name: case for name, case in cases.items() if case.rounds}
        forwards = {name: fn for name, fn in forwards.items() if name in cases}
    return cases, forwards


def summarise(cases: dict[str, Case], forwards: dict[str, Callable], copy: Case, queries: int) -> dict:
    bandwidth = copy.nbytes / copy.median()
    rows = {}
    for name, case in cases.items():
        seconds = case.median()
        gbps = case.nbytes / seconds
        rows[name] = {"ms": seconds * 1e3, "GB/s": gbps / 1e9, "of_copy": gbps / bandwidth,
                      "faults_per_call": statistics.median(case.faults)}
    for name in ("fast fwd", "torch fwd"):
        if name in rows:
            rows[name]["vs_sum"] = rows[name]["ms"] / rows["torch.sum"]["ms"]
    for name in forwards:
        rows[name]["peak_extra_MiB"] = peak_extra_bytes(forwards[name]) / 2**20
    for name in ("fast fwd", "fast fwd+bwd", "fast stats fwd", "fast stats bwd"):
        if name in rows and name.replace("fast", "torch") in rows:
            rows[name]["vs_torch"] = rows[name]["ms"] / rows[name.replace("fast", "torch")]["ms"]
    if "fast stats fwd" in rows:
        rows["fast stats fwd"]["vs_one_shot"] = rows["fast stats fwd"]["ms"] / (queries * rows["fast fwd"]["ms"])
    return {"copy_GB/s": bandwidth / 1e9, "cases": rows}


def print_table(name: str, result: dict, args: argparse.Namespace) -> None:
    buffer_mib = args.tokens * args.dim * 4 / 2**20
    print(
        f"\n{name}: R={args.sources} T={args.tokens} d={args.dim}, copy {result['copy_GB/s']:.1f} GB/s "
        f"(one [T, d] fp32 buffer = {buffer_mib:.1f} MiB)"
    )
    print(f"{'case':<17}{'ms':>9}{'GB/s':>8}{'of copy':>9}{'vs sum':>8}{'vs torch':>9}{'extra MiB':>11}"
          f"{'vs S x 1-shot':>15}{'faults':>8}")
    for case, r in result["cases"].items():
        cells = [f"{r[k]:.2f}" if k in r else "" for k in ("vs_sum", "vs_torch", "peak_extra_MiB", "vs_one_shot")]
        print(f"{case:<17}{r['ms']:>9.1f}{r['GB/s']:>8.1f}{r['of_copy']:>9.0%}{cells[0]:>8}{cells[1]:>9}{cells[2]:>11}"
              f"{cells[3]:>15}{r['faults_per_call']:>8.0f}")


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2) + "\n")


def over_processes(args: argparse.Namespace, names: list[str]) -> dict:
    """The whole measurement in `args.processes` fresh processes, one after another; each case's spread over them."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = Path(tmp) / f"{i}.json"
            argv = strip_option(strip_option(sys.argv[1:], "--json"), "--processes")
            cmd = [sys.executable, "-m", __spec__.name, *argv, "--processes", "1", "--json", str(out)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
            fwd = runs[-1][names[0]]["cases"]["fast fwd"]
            print(f"process {i + 1}/{args.processes}: {names[0]} fast fwd {fwd['ms']:.1f} ms, {fwd['vs_sum']:.2f}x sum")
    spread = {}
    for name in names:
        spread[name] = {}
        for case in runs[0][name]["cases"]:
            ms = [run[name]["cases"][case]["ms"] for run in runs]
            row = {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms)}
            if "vs_sum" in runs[0][name]["cases"][case]:
                ratios = [run[name]["cases"][case]["vs_sum"] for run in runs]
                row.update(vs_sum_median=statistics.median(ratios), vs_sum_min=min(ratios), vs_sum_max=max(ratios))
            spread[name][case] = row
    return {"processes": runs, "spread": spread}


def strip_option(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and its value (given as `--opt v` or `--opt=v`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(f"{option}="):
            out.append(a)
    return out


def print_spread(spread: dict, processes: int) -> None:
    print(f"\nspread over {processes} fresh processes (median [least, most] of the per-process medians)")
    print(f"{'dtype':<6}{'case':<17}{'ms':>26}{'vs sum':>22}")
    for name, cases in spread.items():
        for case, r in cases.items():
            ratio = ""
            if "vs_sum_median" in r:
                ratio = f"{r['vs_sum_median']:.2f} [{r['vs_sum_min']:.2f}, {r['vs_sum_max']:.2f}]"
            ms = f"{r['ms_median']:.1f} [{r['ms_min']:.1f}, {r['ms_max']:.1f}]"
            print(f"{name:<6}{case:<17}{ms:>26}{ratio:>22}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=9, help="R, the number of sources (default 9)")
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens (default 4096)")
    parser.add_argument("--dim", type=int, default=2048, help="d, model width (default 2048)")
    parser.add_argument("--queries", type=int, default=8, help="S, queries of the phase-1 cases; 0 skips them (default 8)")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, from {','.join(DTYPES)}")
    parser.add_argument("--repeats", type=int, default=11, help="rounds; the median is reported (default 11)")
    parser.add_argument("--torch-repeats", type=int, default=3,
                        help="rounds of the slow torch path; 0 leaves it out (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--subnormal", type=float, default=0.0,
                        help="fraction of the source entries made subnormal (default 0; the kernels' FlushSubnormals "
                        "reads them as zero)")
    parser.add_argument("--processes", type=int, default=1,
                        help="run everything in this many fresh processes and report the spread (default 1)")
    args = parser.parse_args()
    names = args.dtypes.split(",")
    if unknown := [n for n in names if n not in DTYPES]:
        parser.error(f"--dtypes: unknown {unknown}, expected names from {list(DTYPES)}")
    if min(args.sources, args.tokens, args.dim, args.repeats) < 1 or args.torch_repeats < 0:
        parser.error("--sources, --tokens, --dim and --repeats must be at least 1, --torch-repeats at least 0")
    if args.queries < 0:
        parser.error("--queries must be at least 0")
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if not 0 <= args.subnormal <= 1:
        parser.error(f"--subnormal must be a fraction in [0, 1], got {args.subnormal}")
    if args.processes > 1:
        results = over_processes(args, names)
        print_spread(results["spread"], args.processes)
        if args.json is not None:
            write_json(args.json, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                   **results})
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not cpu.available():
        parser.exit(1, "the compiled CPU kernel is not available (see the log above); nothing to compare\n")

    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(f"threads {torch.get_num_threads()}, THP_MEM_ALLOC_ENABLE={thp}")
    results = {"threads": torch.get_num_threads(), "THP_MEM_ALLOC_ENABLE": thp}
    results["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    copy_src = torch.ones(args.sources * args.tokens * args.dim)
    copy_dst = torch.zeros_like(copy_src)
    for name in names:
        cases, forwards = dtype_cases(DTYPES[name], args)
        copy = Case(lambda: copy_dst.copy_(copy_src), 2 * copy_src.nbytes, args.repeats)  # read + write
        run_rounds({"copy": copy, **cases})
        results[name] = summarise(cases, forwards, copy, args.queries)
        print_table(name, results[name], args)
    if args.json is not None:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
