"""How far the Full chain's backward kernel is from the least work on its bytes, point by point, in one process.

A chained point's backward (`depth_attention_bwd_into`, attnres/ops/chain.py) must read each token's R source rows
and its gradient row, and read, add to and write back the chain's R gradient-sum rows. `benchmarks/chain_floor.cpp`
moves exactly those bytes with the least arithmetic (one dot and one multiply-add per element, tokens split across
threads as the kernel splits them), compiled with the project's flags. Both are timed on the Full schedule of a
model (points over 1, 2, ..., 2L + 1 sources of `[tokens, d]`, from the last point to the first as the chain runs
them), calls interleaved, each first in turn. The ratio floor / kernel says what share of the kernel's time its
bytes account for: near 1, only moving fewer bytes makes the backward faster; well below 1, its arithmetic and
per-token work cost the rest. With `--cold` the caches are flushed before every point, as in a model.

Two more sides are timed over the whole schedule only (their phases split the work differently): a lazy backward,
in which each point only writes its gradient row (reading its output gradient and mixture) and each source's gradient
is formed once, when the chain reaches the source's producer, from the source and the kept rows of every later point.
"lazy_floor" is the least work on its bytes (`lazy_point`, `lazy_source`); "lazy" is that backward written plainly
with all its arithmetic, the query gradients included (`lazy_point_backward`, `lazy_source_backward`, both in the same
file), which says whether the bytes it saves turn into time.

    python -m benchmarks.chain_floor --threads 2 --cold
    python -m benchmarks.chain_floor --threads 2 --cold --repeats 40 --out docs/chain_floor.json
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from functools import partial
from pathlib import Path

import torch

from attnres.ops import cpu
from attnres.ops.cpu.build import compile_command
from benchmarks.cpu_kernel_ab import (
    EPS,
    compare,
    parse_schedule_args,
    schedule_inputs,
    time_interleaved,
)
from benchmarks.gloo_ranks import write_record

FLOOR_SOURCE = Path(__file__).with_name("chain_floor.cpp")
SIDES = ("kernel", "floor")  # compared point by point; LAZY_SIDES over the schedule only
LAZY_SIDES = ("lazy_floor", "lazy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_schedule_args(__doc__, argv)


def load_floor(folder: Path):
    """`chain_floor.cpp` compiled with the project's flags, its ops as `torch.ops.attnres_chain_floor` (`bwd_into`,
    `lazy_point`, `lazy_source`, `lazy_point_backward`, `lazy_source_backward`; compiled once per process: a library
    registers its ops only once)."""
    try:
        torch.ops.attnres_chain_floor.bwd_into
    except (AttributeError, RuntimeError):
        library = folder / "chain_floor.so"
        subprocess.run(compile_command(FLOOR_SOURCE, library), check=True)
        torch.ops.load_library(str(library))
    return torch.ops.attnres_chain_floor


def chain_cases(floor, sources, c, norm_weight, grad_out) -> dict:
    """Every side's backward over buffers of its own, as `time_interleaved` cases: one phase per point ("R" sources),
    from the last point (every source, writing the sums) to the first (adding). A lazy phase is one call, its point's
    backward and then its newest source's, as one node of a lazy chain would run them; the newest source's depth weights
    at every later point, each point's mixture and its rstd come from the kernel's forward, every point has query c."""
    ops = torch.ops.attnres_cpu
    count = len(sources)
    into = {side: sources[0].new_zeros(count, *sources[0].shape) for side in SIDES}
    kept, grads = torch.empty_like(into["floor"]), torch.empty_like(into["floor"])
    dm_dot_o = sources[0].new_zeros(count, sources[0].shape[0])
    queries = c.expand(count, -1).contiguous()
    saved = {r: ops.depth_attention_fwd(sources[:r], c, norm_weight, EPS, EPS)[1:] for r in range(1, count + 1)}
    cases = {side: {} for side in (*SIDES, *LAZY_SIDES)}
    for r in range(count, 0, -1):
        xs, accumulate = sources[:r], r < count
        weights, rstd = saved[r]  # the point's depth weights [R, N] and key rstd
        cases["kernel"][str(r)] = [partial(ops.depth_attention_bwd_into, grad_out, None, xs, c, norm_weight, weights,
                                           rstd, EPS, into["kernel"][:r], accumulate)]
        cases["floor"][str(r)] = [partial(floor.bwd_into, grad_out, xs, weights, into["floor"][:r], accumulate)]
        newest = r - 1
        later = torch.stack([saved[p][0][newest] for p in range(r, count + 1)])
        rows = list(kept[newest:])
        mixture = sum(w[:, None] * x for w, x in zip(weights, xs))
        cases["lazy_floor"][str(r)] = [partial(
            in_turn, partial(floor.lazy_point, grad_out, mixture, kept[newest]),
            partial(floor.lazy_source, sources[newest], rows, later, grads[newest]))]
        mixture_rstd = torch.rsqrt(mixture.square().mean(-1) + EPS)
        cases["lazy"][str(r)] = [partial(
            in_turn,
            partial(floor.lazy_point_backward, grad_out, mixture, norm_weight, mixture_rstd, kept[newest],
                    dm_dot_o[newest]),
            partial(floor.lazy_source_backward, sources[newest], rows, dm_dot_o[newest:], later, queries[newest:],
                    EPS, grads[newest]))]
    return cases


def in_turn(*calls) -> None:
    """One timed call of a phase that runs several kernels back to back (no flush between them)."""
    for call in calls:
        call()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not cpu.available():
        raise SystemExit("chain_floor: the project's CPU kernel is not available here (a C++ compiler is needed)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        floor = load_floor(Path(tmp))
    count = 2 * args.layers + 1
    cases = chain_cases(floor, *schedule_inputs(args.tokens, args.dim, count))
    times = time_interleaved(cases, args.repeats, args.cold)
    points = list(cases["kernel"])
    per_point = {r: compare(times[("kernel", r)], times[("floor", r)], SIDES) for r in points}
    totals = {side: [sum(k) for k in zip(*(times[(side, r)] for r in points))] for side in cases}
    schedule = compare(*(totals[side] for side in SIDES), SIDES)
    lazy_floor = compare(totals["floor"], totals["lazy_floor"], ("floor", "lazy_floor"))
    lazy = compare(totals["kernel"], totals["lazy"], ("kernel", "lazy"))
    for r in reversed(points):
        ratio = per_point[r]["floor_over_kernel"]
        print(f"R = {int(r):2d}: floor / kernel {ratio['median']:.3f} (median), {ratio['min']:.3f} (min)")
    s = schedule
    print(f"schedule: kernel {s['kernel_ms']['median']:.2f} ms, floor {s['floor_ms']['median']:.2f} ms (medians of "
          f"{args.repeats}); floor / kernel {s['floor_over_kernel']['median']:.3f}")
    print(f"lazy floor: {lazy_floor['lazy_floor_ms']['median']:.2f} ms, {lazy_floor['lazy_floor_over_floor']['median']:.3f}"
          f" x the floor; lazy backward: {lazy['lazy_ms']['median']:.2f} ms, {lazy['lazy_over_kernel']['median']:.3f} x "
          "the kernel (medians)")
    results = {"schedule": schedule, "lazy_floor": lazy_floor, "lazy": lazy, "points": per_point}
    if args.out is not None:
        write_record("benchmarks.chain_floor", args, argv, {"points": count}, results=results)
    return results


if __name__ == "__main__":
    main()
