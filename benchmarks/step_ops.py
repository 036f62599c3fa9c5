"""Where an AttnRes training step spends its time beyond the standard model's, op by op, in one process.

The model of `attnres bench --groups small` (d=96, 6 layers, vocabulary 256, 16 x 128 tokens, every plain norm the
fused kernel): the standard model and Block and Full, each profiled over `--steps` training steps in turn,
`--rounds` times, with torch.profiler. Per op name, the self CPU time per step (averaged over the rounds) of each
model; printed sorted by how much more Block (or Full) spends than the standard model. The ops that both models run
on the same shapes (the matmuls, attention) should cost the same; how far they differ is the spread of the machine,
against which the AttnRes ops' own excess reads. Each round also times `--steps` unprofiled steps of each model, one
of each in turn: their median is the wall time per step, which counts the Python around the ops as well. With `--batch 1
--tokens 4` the ops have almost nothing to compute, and what remains is each step's fixed cost (Python, dispatch,
autograd, the optimizer's loop over parameters), which a step of any size pays. Writes the table as JSON to `--out`.

    python -m benchmarks.step_ops
    python -m benchmarks.step_ops --rounds 6 --steps 3 --out docs/step_ops.json
    python -m benchmarks.step_ops --batch 1 --tokens 4 --rounds 6 --steps 20   # the fixed cost of a step
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from attnres.bench import models
from attnres.bench.config import SuiteConfig
from attnres.bench.timing import round_times
from benchmarks.gloo_ranks import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3,
                   help="profiled steps, then timed steps, per model and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4, help="rounds, each profiling every model (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps per model first (default: %(default)s)")
    p.add_argument("--top", type=int, default=12, help="ops printed per model, by excess (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    p.add_argument("--out", type=Path, default=None, help="JSON record to write (default: print only)")
    args = p.parse_args(argv)
    for name in ("batch", "tokens", "steps", "rounds", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive number, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup: expected a non-negative number, got {args.warmup}")
    return args


def profile_ms(step, steps: int) -> tuple[Counter, Counter]:
    """Self CPU milliseconds and calls per op name, per step, over `steps` calls of `step`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ms, calls = Counter(), Counter()
    for event in prof.key_averages():
        ms[event.key] += event.self_cpu_time_total / 1e3 / steps
        calls[event.key] += event.count / steps
    return ms, calls


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    built = models.build_small_models(tokens=max(args.tokens, SuiteConfig.small_tokens))
    ids = torch.randint(0, 256, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    steps = {kind: models.training_step(model, ids) for kind, model in built.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    ms = {kind: Counter() for kind in steps}
    calls = {kind: Counter() for kind in steps}
    wall = {kind: [] for kind in steps}
    for _ in range(args.rounds):
        for kind, step in steps.items():
            round_ms, round_calls = profile_ms(step, args.steps)
            for name in round_ms:
                ms[kind][name] += round_ms[name] / args.rounds
                calls[kind][name] += round_calls[name] / args.rounds
        for kind, times in round_times(steps, args.steps, warmup=0).items():  # one step of each model in turn
            wall[kind] += times
    wall_ms = {kind: 1e3 * statistics.median(times) for kind, times in wall.items()}
    base = ms["standard"]
    print("self CPU ms per step: " + ", ".join(f"{kind} {sum(m.values()):.1f}" for kind, m in ms.items()))
    print("wall ms per step (unprofiled, median): " + ", ".join(f"{kind} {t:.2f}" for kind, t in wall_ms.items()))
    excess = {}
    for kind in list(steps)[1:]:
        names = sorted(set(base) | set(ms[kind]), key=lambda n: base[n] - ms[kind][n])
        excess[kind] = {n: ms[kind][n] - base[n] for n in names}
        print(f"{kind}: ops by their excess over the standard model's (ms per step; calls per step)")
        for name in names[: args.top] + names[-3:]:
            print(f"  {excess[kind][name]:+7.2f}  {ms[kind][name]:7.2f} vs {base[name]:7.2f}  "
                  f"{calls[kind][name]:5.0f} vs {calls['standard'][name]:5.0f}  {name[:70]}")
    if args.out is not None:
        per_op = {kind: {n: {"ms": ms[kind][n], "calls": calls[kind][n]} for n in ms[kind]} for kind in ms}
        write_record("benchmarks.step_ops", args, argv, {"threads": torch.get_num_threads()},
                     total_ms={kind: sum(m.values()) for kind, m in ms.items()}, wall_ms=wall_ms, excess_ms=excess,
                     per_op=per_op)


if __name__ == "__main__":
    main()
