"""Would Full pay for two-phase per decoder layer on CPU? Its kernels' time, layer by layer, in one process.

A Full layer's two points read the same older sources: the attention-side point reads v_0 .. v_{R-1} (R = 2l + 1 at
layer l), the MLP-side point those and the attention output. Two-phase per layer (docs/design.md section 4, with a
layer as the block) would score the R shared rows once for both queries (phase 1), finish the attention-side point
from its statistics, and merge the one new source into the MLP-side point's (phase 2): R reads of a row instead of
2R + 1. Two sides are timed for each layer, calls interleaved, each first in turn:

- "one_shot": what runs today, the forward of the points over R and R + 1 sources and the chain's backward of both
  (`depth_attention_bwd_into`, adding into the gradient sums as a point inside the chain does);
- "two_phase": phase 1 over the R rows with both queries, forward and backward (`depth_stats_fwd/bwd`, the kernels
  Block's two-phase runs), and phase 2 as one-shot points over one source (the finish: u / z and the output norm, a
  row read and one written) and two (the merge: u and the new source). Phase 2 has no CPU backward kernel: those two
  points stand for one, which would read and write as many rows. The side is generous to two-phase: its phase-1
  backward writes fresh gradient rows, which a chain would add into its sums (read, add, write) as the one-shot side
  does.

Per layer and over the schedule, the ratio two_phase / one_shot says whether the reads saved turn into time.

    python -m benchmarks.full_two_phase --threads 2 --cold
    python -m benchmarks.full_two_phase --threads 2 --cold --repeats 30 --out docs/full_two_phase.json
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from attnres.ops import cpu
from benchmarks.cpu_kernel_ab import EPS, compare, parse_schedule_args, schedule_inputs, time_interleaved
from benchmarks.gloo_ranks import write_record

SIDES = ("one_shot", "two_phase")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_schedule_args(__doc__, argv)


def layer_cases(ops, sources, cs, norm_weight, grad_out, layers: int) -> dict:
    """Both sides' calls for each layer l (its points over R = 2l + 1 and R + 1 of `sources`), as `time_interleaved`
    cases with one phase per layer; `cs` holds the two points' folded queries `[2, d]`."""
    cases = {side: {} for side in SIDES}
    into = sources[0].new_zeros(len(sources), *sources[0].shape)
    for layer in range(layers):
        r = 2 * layer + 1
        both = [ops.depth_attention_fwd(sources[:k], cs[q], norm_weight, EPS, EPS) for q, k in ((0, r), (1, r + 1))]
        one_shot = [partial(ops.depth_attention_fwd, sources[:k], cs[q], norm_weight, EPS, EPS)
                    for q, k in ((0, r), (1, r + 1))]
        one_shot += [partial(ops.depth_attention_bwd_into, grad_out, None, sources[:k], cs[q], norm_weight, w, rstd,
                             EPS, into[:k], True) for (q, k), (_, w, rstd) in zip(((1, r + 1), (0, r)), both[::-1])]
        m, z, u, rstd = ops.depth_stats_fwd(sources[:r], cs, EPS)
        grad_z, grad_u = torch.randn_like(z), torch.randn_like(u)
        finish = [ops.depth_attention_fwd(sources[:k], cs[0], norm_weight, EPS, EPS) for k in (1, 2)]
        two_phase = [partial(ops.depth_stats_fwd, sources[:r], cs, EPS)]
        two_phase += [partial(ops.depth_attention_fwd, sources[:k], cs[0], norm_weight, EPS, EPS) for k in (1, 2)]
        two_phase += [partial(ops.depth_attention_bwd_into, grad_out, None, sources[:k], cs[0], norm_weight, w,
                              point_rstd, EPS, into[:k], True) for k, (_, w, point_rstd) in zip((2, 1), finish[::-1])]
        two_phase += [partial(ops.depth_stats_bwd, grad_z, grad_u, sources[:r], cs, m, rstd)]
        cases["one_shot"][f"layer {layer} (R={r})"] = one_shot
        cases["two_phase"][f"layer {layer} (R={r})"] = two_phase
    return cases


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit("the attnres CPU kernel is not available (see the logged reason)")
    ops = torch.ops.attnres_cpu
    sources, c, norm_weight, grad_out = schedule_inputs(args.tokens, args.dim, 2 * args.layers)
    cs = torch.stack([c, c.flip(0)])
    cases = layer_cases(ops, sources, cs, norm_weight, grad_out, args.layers)
    times = time_interleaved(cases, args.repeats, args.cold)
    results = {}
    for phase in cases["one_shot"]:
        r = results[phase] = compare(times[("one_shot", phase)], times[("two_phase", phase)], SIDES)
        print(f"{phase:16s} one-shot {r['one_shot_ms']['median']:.2f} ms, two-phase {r['two_phase_ms']['median']:.2f} "
              f"ms (medians of {args.repeats}); two-phase / one-shot: min {r['two_phase_over_one_shot']['min']:.3f}, "
              f"median {r['two_phase_over_one_shot']['median']:.3f}")
    total = {side: [sum(t) for t in zip(*(times[(side, phase)] for phase in cases[side]))] for side in SIDES}
    results["schedule"] = compare(total["one_shot"], total["two_phase"], SIDES)
    ratio = results["schedule"]["two_phase_over_one_shot"]
    print(f"every layer     two-phase / one-shot: min {ratio['min']:.3f}, median {ratio['median']:.3f}")
    if args.out is not None:
        write_record("benchmarks.full_two_phase", args, argv, {"layers": args.layers}, results=results)
    return results


if __name__ == "__main__":
    main()
