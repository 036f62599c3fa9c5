"""A/B of the compiled CPU kernel between two revisions of its source, in one process, calls interleaved.

Each revision's `attnres/ops/cpu/depth_attention.cpp` (a git revision, or the working tree) is compiled with the
project's own flags under an op namespace of its own, so both load side by side; each repeat times the base's calls
and the head's on the same sources, each first in turn. On a shared, noisy machine this keeps load changes out of the
ratio, which separate processes do not. The case is the Full schedule of a model (aggregation points over 1, 2, ...,
2L + 1 sources of `[tokens, d]`), its forward and its backward (with the fused output norm), calling the kernels
directly; the backward is the chain's (each point adding into one gradient buffer, attnres/ops/chain.py) when both
revisions have it. With `--sources R [R ...]` it times single points over R sources instead (forward, the one-shot
backward, and the fused inference aggregation of R - 1 bank rows and a prefix), where a per-point cost shows apart
from the schedule's: R = 1 is a plain fused RMSNorm. With `--cold` the caches are flushed (a buffer larger than the
last-level cache written) before every point, as in a model, where a sublayer runs between two points and its sources
were written long before: then a kernel's misses show, which in a loop of points over the same sources stay hidden.

    python -m benchmarks.cpu_kernel_ab --base HEAD~1                     # the working tree against its parent
    python -m benchmarks.cpu_kernel_ab --base 9b70f0a --head 4214f55 --threads 2 --out docs/cpu_kernel_ab.json
    python -m benchmarks.cpu_kernel_ab --base HEAD~1 --sources 1 2 4 13  # single points
    python -m benchmarks.cpu_kernel_ab --base HEAD~1 --cold               # each point with cold caches
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from attnres.ops.cpu.build import SOURCE, compile_command
from benchmarks.gloo_ranks import write_record

ROOT = Path(__file__).resolve().parents[1]
WORKTREE = "worktree"
EPS = 1e-6
COLD_MIB = 128  # written before each point with --cold: several times any last-level cache of a 2-core machine


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    """The flags of a Full schedule timed point by point."""
    p.add_argument("--tokens", type=int, default=2048, help="tokens per source (default: 16 x 128)")
    p.add_argument("--dim", type=int, default=96, help="residual width d (default: the small model's 96)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers L: points over 1 .. 2L + 1 sources")
    p.add_argument("--cold", action="store_true",
                   help=f"flush the caches ({COLD_MIB} MiB written) before every point; only the points are timed")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=40, help="interleaved repeats (default 40)")
    p.add_argument("--out", type=Path, default=None, help="JSON record to write (default: print only)")


def check_schedule_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("tokens", "dim", "layers", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive number, got {getattr(args, name)}")


def parse_schedule_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The schedule's flags alone, checked: the arguments of a study of the kernels at one revision
    (benchmarks/chain_floor.py, benchmarks/full_two_phase.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_schedule_args(p)
    args = p.parse_args(argv)
    check_schedule_args(p, args)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision of the reference kernel source")
    p.add_argument("--head", default=WORKTREE, help=f"git revision to compare, or {WORKTREE!r} (default)")
    p.add_argument("--sources", type=int, nargs="+", default=None, metavar="R",
                   help="time single points over R sources each instead of the Full schedule")
    add_schedule_args(p)
    args = p.parse_args(argv)
    if args.base == args.head:
        p.error("--base and --head: expected two different revisions")
    check_schedule_args(p, args)
    if args.sources is not None and min(args.sources) < 1:
        p.error(f"--sources: expected positive numbers of sources, got {args.sources}")
    return args


def _git(*args: str, revision: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"--base/--head: {revision!r} is a git revision, and git is not installed") from None
    if done.returncode != 0:
        raise SystemExit(f"--base/--head: git cannot read {revision!r}: {done.stderr.strip()}")
    return done.stdout


def kernel_source(revision: str) -> str:
    if revision == WORKTREE:
        return SOURCE.read_text()
    return _git("show", f"{revision}:{SOURCE.relative_to(ROOT).as_posix()}", revision=revision)


def commit_of(revision: str) -> str:
    """The commit a revision names now (a record keeps it: `HEAD~1` names another one after the next commit)."""
    return revision if revision == WORKTREE else _git("rev-parse", "--short", revision, revision=revision).strip()


def load_ops(name: str, source: str, folder: Path):
    """The kernel compiled from `source` with its ops registered as `torch.ops.<name>`."""
    renamed = source.replace("TORCH_LIBRARY(attnres_cpu,", f"TORCH_LIBRARY({name},").replace(
        "TORCH_LIBRARY_IMPL(attnres_cpu,", f"TORCH_LIBRARY_IMPL({name},"
    )
    if renamed.count(name) != 2:
        raise SystemExit(f"{name}: the kernel source does not register the attnres_cpu library as expected")
    cpp, library = folder / f"{name}.cpp", folder / f"{name}.so"
    cpp.write_text(renamed)
    subprocess.run(compile_command(cpp, library), check=True)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, name)


def full_schedule(ops, sources, c, norm_weight, grad_out, saved, chained: bool):
    """The forward and the backward of the Full schedule, each a list of its points' calls in order. With `chained`,
    the backward is the chain's (attnres/ops/chain.py): the points from the last to the first, each adding its source
    gradients into one buffer (the last point writes it)."""
    into = sources[0].new_empty(len(sources), *sources[0].shape) if chained else None
    forward = [partial(ops.depth_attention_fwd, sources[:r], c, norm_weight, EPS, EPS)
               for r in range(1, len(sources) + 1)]
    if chained:
        backward = [partial(ops.depth_attention_bwd_into, grad_out, None, sources[:r], c, norm_weight, weights, rstd,
                            EPS, into[:r], r < len(sources))
                    for r, (_, weights, rstd) in reversed(list(enumerate(saved, start=1)))]
    else:
        backward = [partial(ops.depth_attention_bwd, grad_out, None, sources[:r], c, norm_weight, weights, rstd, EPS)
                    for r, (_, weights, rstd) in enumerate(saved, start=1)]
    return {"forward": forward, "backward": backward}


def single_points(ops, sources, c, norm_weight, grad_out, counts):
    """The forward, the one-shot backward and the fused bank aggregation (`bank_aggregate`: rows 0 .. R - 2 as the
    bank, row R - 1 as the prefix, no pending add, no write) of single points over each number of sources in
    `counts`."""
    cases = {}
    for r in counts:
        xs = sources[:r]
        _, weights, rstd = ops.depth_attention_fwd(xs, c, norm_weight, EPS, EPS)
        bank = torch.stack(xs[:-1], dim=1) if r > 1 else xs[0].new_empty(xs[0].shape[0], 1, xs[0].shape[1])
        cases[f"forward R={r}"] = [partial(ops.depth_attention_fwd, xs, c, norm_weight, EPS, EPS)]
        cases[f"backward R={r}"] = [partial(ops.depth_attention_bwd, grad_out, None, xs, c, norm_weight, weights,
                                            rstd, EPS)]
        cases[f"bank R={r}"] = [partial(ops.bank_aggregate, bank, r - 1, xs[-1], None, c, norm_weight, EPS, EPS,
                                        False)]
    return cases


def has_chain(ops) -> bool:
    """Whether a revision's kernel has the chain's backward (`depth_attention_bwd_into`, from 0863e47 on)."""
    try:
        ops.depth_attention_bwd_into
    except (AttributeError, RuntimeError):
        return False
    return True


def schedule_inputs(tokens: int, dim: int, count: int):
    """`count` sources `[tokens, dim]`, a folded query c, an output-norm gain and a gradient: the same seeded inputs in
    every script that times the kernel (here and benchmarks/chain_floor.py)."""
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(tokens, dim, generator=gen) for _ in range(count)]
    c = 0.1 * torch.randn(dim, generator=gen)
    return sources, c, torch.ones(dim), torch.randn(tokens, dim, generator=gen)


def time_interleaved(cases: dict, repeats: int, cold: bool) -> dict[tuple[str, str], list[float]]:
    """Seconds per repeat of each (side, phase) of `cases` ({side: {phase: [calls]}}, every side with the same
    phases): per repeat, after two warm-up rounds, every phase's calls of every side, the sides' order reversed from
    one repeat to the next; a phase's time is the sum of its calls'. With `cold` the caches are flushed before every
    call, and only the calls are timed."""
    sides = list(cases)
    phases = list(cases[sides[0]])
    times = {(side, phase): [] for side in sides for phase in phases}
    flush = torch.empty(COLD_MIB * 2**20 // 4) if cold else None
    for repeat in range(repeats + 2):
        for phase in phases:
            for side in sides if repeat % 2 else sides[::-1]:  # neither always runs first
                seconds = 0.0
                for call in cases[side][phase]:
                    if flush is not None:
                        flush.fill_(repeat)
                    start = time.perf_counter()
                    call()
                    seconds += time.perf_counter() - start
                if repeat >= 2:
                    times[(side, phase)].append(seconds)
    return times


def compare(base: list[float], head: list[float], names: tuple[str, str] = ("base", "head")) -> dict:
    """Minimum and median ms of two sides' times, and the second's over the first's."""
    a, b = names
    return {
        f"{a}_ms": {"min": 1e3 * min(base), "median": 1e3 * statistics.median(base)},
        f"{b}_ms": {"min": 1e3 * min(head), "median": 1e3 * statistics.median(head)},
        f"{b}_over_{a}": {"min": min(head) / min(base), "median": statistics.median(head) / statistics.median(base)},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {side: load_ops(f"ab_{side}", kernel_source(rev), Path(tmp)) for side, rev in
               (("base", args.base), ("head", args.head))}
    count = max(args.sources) if args.sources else 2 * args.layers + 1
    sources, c, norm_weight, grad_out = schedule_inputs(args.tokens, args.dim, count)
    if args.sources:
        chained = False
        cases = {side: single_points(o, sources, c, norm_weight, grad_out, args.sources) for side, o in ops.items()}
    else:
        saved = [ops["base"].depth_attention_fwd(sources[:r], c, norm_weight, EPS, EPS) for r in range(1, count + 1)]
        chained = all(has_chain(o) for o in ops.values())
        print(f"backward: {'the chain (bwd_into)' if chained else 'one point at a time (bwd)'}")
        cases = {side: full_schedule(o, sources, c, norm_weight, grad_out, saved, chained) for side, o in ops.items()}
    times = time_interleaved(cases, args.repeats, args.cold)
    results = {}
    for phase in cases["base"]:
        r = results[phase] = compare(times[("base", phase)], times[("head", phase)])
        print(f"{phase:12s} base {r['base_ms']['min']:.2f} ms, head {r['head_ms']['min']:.2f} ms (min of "
              f"{args.repeats}); head / base: min {r['head_over_base']['min']:.3f}, median "
              f"{r['head_over_base']['median']:.3f}")
    if args.out is not None:
        case = {"sources": args.sources} if args.sources else {"points": count, "chained_backward": chained}
        case["cold"] = args.cold
        case["commits"] = {"base": commit_of(args.base), "head": commit_of(args.head)}
        write_record("benchmarks.cpu_kernel_ab", args, argv, case, results=results)


if __name__ == "__main__":
    main()
