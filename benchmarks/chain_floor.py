"""How far the Full chain's backward kernel is from the least work on its bytes, point by point, in one process.

A chained point's backward (`depth_attention_bwd_into`, attnres/ops/chain.py) must read each token's R source rows
and its gradient row, and read, add to and write back the chain's R gradient-sum rows. `benchmarks/chain_floor.cpp`
moves exactly those bytes with the least arithmetic (one dot and one multiply-add per element, tokens split across
threads as the kernel splits them), compiled with the project's flags. Both are timed on the Full schedule of a
model (points over 1, 2, ..., 2L + 1 sources of `[tokens, d]`, from the last point to the first as the chain runs
them), calls interleaved, each first in turn. The ratio floor / kernel says what share of the kernel's time its
bytes account for: near 1, only moving fewer bytes makes the backward faster; well below 1, its arithmetic and
per-token work cost the rest. With `--cold` the caches are flushed before every point, as in a model.

    python -m benchmarks.chain_floor --threads 2 --cold
    python -m benchmarks.chain_floor --threads 2 --cold --repeats 40 --out docs/chain_floor.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from attnres.ops import cpu
from attnres.ops.cpu.build import compile_command
from benchmarks.cpu_kernel_ab import COLD_MIB, EPS, add_schedule_args, check_schedule_args
from benchmarks.gloo_ranks import write_record

FLOOR_SOURCE = Path(__file__).with_name("chain_floor.cpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_schedule_args(p)
    args = p.parse_args(argv)
    check_schedule_args(p, args)
    return args


def load_floor(folder: Path):
    """`chain_floor.cpp` compiled with the project's flags, its op as `torch.ops.attnres_chain_floor.bwd_into` (once
    per process: a library registers its ops only once)."""
    try:
        return torch.ops.attnres_chain_floor.bwd_into
    except (AttributeError, RuntimeError):
        pass
    library = folder / "chain_floor.so"
    subprocess.run(compile_command(FLOOR_SOURCE, library), check=True)
    torch.ops.load_library(str(library))
    return torch.ops.attnres_chain_floor.bwd_into


def chain_points(floor, sources, c, norm_weight, grad_out):
    """Per point of the chain, from the last (every source, writing the sums) to the first (adding): the kernel's
    backward and the floor's, each a call over its own gradient-sum buffer."""
    ops = torch.ops.attnres_cpu
    count = len(sources)
    into = {side: sources[0].new_zeros(count, *sources[0].shape) for side in ("kernel", "floor")}
    points = []
    for r in range(count, 0, -1):
        xs = sources[:r]
        _, weights, rstd = ops.depth_attention_fwd(xs, c, norm_weight, EPS, EPS)
        accumulate = r < count
        points.append((r, {
            "kernel": lambda xs=xs, w=weights, s=rstd, a=accumulate, r=r: ops.depth_attention_bwd_into(
                grad_out, None, xs, c, norm_weight, w, s, EPS, into["kernel"][:r], a),
            "floor": lambda xs=xs, w=weights, a=accumulate, r=r: floor(grad_out, xs, w, into["floor"][:r], a),
        }))
    return points


def summarize(seconds: dict[str, list[float]]) -> dict:
    kernel, floor = seconds["kernel"], seconds["floor"]
    return {
        "kernel_ms": {"min": 1e3 * min(kernel), "median": 1e3 * statistics.median(kernel)},
        "floor_ms": {"min": 1e3 * min(floor), "median": 1e3 * statistics.median(floor)},
        "floor_over_kernel": {"min": min(floor) / min(kernel),
                              "median": statistics.median(floor) / statistics.median(kernel)},
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not cpu.available():
        raise SystemExit("chain_floor: the project's CPU kernel is not available here (a C++ compiler is needed)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        floor = load_floor(Path(tmp))
    gen = torch.Generator().manual_seed(0)
    count = 2 * args.layers + 1
    sources = [torch.randn(args.tokens, args.dim, generator=gen) for _ in range(count)]
    c = 0.1 * torch.randn(args.dim, generator=gen)
    norm_weight, grad_out = torch.ones(args.dim), torch.randn(args.tokens, args.dim, generator=gen)
    points = chain_points(floor, sources, c, norm_weight, grad_out)
    times = {(r, side): [] for r, _ in points for side in ("kernel", "floor")}
    flush = torch.empty(COLD_MIB * 2**20 // 4) if args.cold else None
    for repeat in range(args.repeats + 2):  # two warm-up rounds
        for side in ("kernel", "floor") if repeat % 2 else ("floor", "kernel"):  # neither always runs first
            for r, calls in points:
                if flush is not None:
                    flush.fill_(repeat)
                start = time.perf_counter()
                calls[side]()
                if repeat >= 2:
                    times[(r, side)].append(time.perf_counter() - start)
    per_point = {str(r): summarize({side: times[(r, side)] for side in ("kernel", "floor")}) for r, _ in points}
    schedule = summarize({side: [sum(times[(r, side)][k] for r, _ in points) for k in range(args.repeats)]
                          for side in ("kernel", "floor")})
    for r, _ in reversed(points):
        ratio = per_point[str(r)]["floor_over_kernel"]
        print(f"R = {r:2d}: floor / kernel {ratio['median']:.3f} (median), {ratio['min']:.3f} (min)")
    s = schedule
    print(f"schedule: kernel {s['kernel_ms']['median']:.2f} ms, floor {s['floor_ms']['median']:.2f} ms (medians of "
          f"{args.repeats}); floor / kernel {s['floor_over_kernel']['median']:.3f}")
    results = {"schedule": schedule, "points": per_point}
    if args.out is not None:
        write_record("benchmarks.chain_floor", args, argv, {"points": count}, results=results)
    return results


if __name__ == "__main__":
    main()
