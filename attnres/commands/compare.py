"""`attnres compare`: the main job. Train the PreNorm baseline and AttnRes models of the same size on the same
tokens, then print the table and draw the pictures."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time

from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE, FULL, RESIDUAL_KINDS, STANDARD


# The warm-up `attnres compare` trains with, chosen by experiments/warmup_stall.py (docs/warmup_stall.md): the
# shortest of 30/60/100/150/200 steps at which the PreNorm baseline does not stall at lr 3e-3 (see WARMUP_HELP).
WARMUP = 100
# The seed standard deviation of the final validation loss measured there, pooled over standard and Block at the
# warm-ups that do not stall PreNorm (100, 150, 200; two seeds each, 6 degrees of freedom). `--seeds 1` judges the
# gaps by it, since one seed per residual measures no spread of its own. tests/analysis/test_compare.py checks it,
# and the numbers below, against docs/warmup_stall.json.
MEASURED_SEED_STD = 0.0483
MEASURED_SEED_DOF = 6
MEASURED_SEED_STD_SOURCE = "docs/warmup_stall.json: standard and Block, 2 seeds, warm-ups 100-200"

WARMUP_HELP = """\
why a 100-step warm-up (experiments/warmup_stall.py, docs/warmup_stall.md): these defaults (lr 3e-3, 300 steps),
standard and Block, 2 seeds, final validation loss in nats/byte:

  warm-up   standard (per seed)     Block (per seed)        Block - standard
  30        2.119 (1.996, 2.242)    1.723 (1.739, 1.707)    -0.396
  60        1.770 (1.758, 1.781)    1.560 (1.592, 1.528)    -0.210
  100       1.633 (1.580, 1.686)    1.568 (1.551, 1.585)    -0.065
  150       1.627 (1.620, 1.635)    1.523 (1.522, 1.525)    -0.104
  200       1.669 (1.610, 1.729)    1.525 (1.543, 1.508)    -0.144

With 30 or 60 warm-up steps PreNorm stalls on a plateau near 3.0-3.1 nats/byte for 40-60 steps and ends 0.14 to
0.49 above its best; from 100 steps on it ends within the seed spread (0.048, pooled over 100-200) of its best.
100 is the shortest such warm-up, and Block is within one seed spread of its own best there too. At 30 steps
most of the gap (-0.40) is the baseline's stall.
The closing line judges each gap by its 95% t interval from the seed spread (attnres.analysis.stats): with two
seeds a setting the spread itself is uncertain, and the t quantile widens the interval for it.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="train standard, Block and Full residual models side by side; table, verdict and pictures",
        description=textwrap.fill(
            "Trains each residual kind with the same size, data (the Python standard library's sources, no "
            "download), seeds and schedule, then prints validation loss (mean and per seed), parameters and "
            "tokens/s, and a closing line computed from the seeds: a gap whose 95% t interval (from the seed "
            "spread) spans 0 reads 'within seed noise at this budget', another one 'X leads by ...'. Writes loss.png, "
            "depth_weights_<kind>.png (mean depth weights, sources against aggregation points), layers.png "
            "(per-sublayer input/output magnitudes and gradient norms) and summary.json into --out. The defaults "
            "train six models (three kinds, two seeds each), about 7 minutes on an idle 2-core machine; "
            "`attnres plot --out DIR` redraws the pictures.", 100),
        epilog=WARMUP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--residuals", nargs="+", choices=RESIDUAL_KINDS, default=[STANDARD, BLOCK, FULL],
                   help="kinds to train, in order (default: standard block full)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per model (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help="linear warm-up steps, for every kind (default: %(default)s; see below why)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default: %(default)s)")
    p.add_argument("--dim", type=int, default=96, help="hidden size (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="Block AttnRes block size in decoder layers (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--attn-res-lr-mult", type=float, default=1.0,
                   help="learning-rate multiplier of the pseudo-queries and key gains. At this short budget 1 did "
                   "better than 0.1 (docs/compare_summary.json against docs/compare_summary_x01.json); longer runs "
                   "favour 0.1, the default of `attnres train` (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=2,
                   help="seeds per residual: --seed, --seed+1, ... With one, the gaps are judged by the seed spread "
                   f"measured in {MEASURED_SEED_STD_SOURCE} ({MEASURED_SEED_STD:.4f}) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own choice; 1 on a shared machine)")
    p.add_argument("--max-bytes", type=int, default=4 * 2**20, help="bytes of corpus to read (default: %(default)s)")
    p.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="text files or folders instead of the standard library's sources")
    p.add_argument("--out", default="runs/compare", help="comparison folder (default: %(default)s)")
    p.set_defaults(func=run)

    q = sub.add_parser("plot", help="redraw the pictures of an `attnres compare` folder",
                       description="Redraws loss.png, depth_weights_<kind>.png and layers.png from the summary.json "
                       "and run logs of a comparison folder.")
    q.add_argument("--out", default="runs/compare", help="comparison folder (default: %(default)s)")
    q.set_defaults(func=plot)


def run(args) -> int:
    from attnres.analysis.report import compare, format_table
    from attnres.training import TrainConfig, TrainingDiverged

    try:
        if args.seeds < 1:
            raise ValueError(f"seeds: expected at least 1, got {args.seeds}")
        base = TrainConfig(
            data=args.data if args.data else "stdlib", max_bytes=args.max_bytes, steps=args.steps, layers=args.layers,
            dim=args.dim, block_size=args.block_size, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
            warmup=min(args.warmup, args.steps), attn_res_lr_mult=args.attn_res_lr_mult, seed=args.seed,
            eval_interval=max(args.steps // 6, 1), checkpoint_interval=args.steps, overwrite=True,
            threads=args.threads,
        )
        start = time.perf_counter()
        summary = compare(base, args.residuals, args.out, seeds=range(args.seed, args.seed + args.seeds),
                          noise_std=MEASURED_SEED_STD if args.seeds == 1 else None,
                          noise_dof=MEASURED_SEED_DOF if args.seeds == 1 else None,
                          noise_source=MEASURED_SEED_STD_SOURCE if args.seeds == 1 else None)
    except TrainingDiverged as e:  # a bad setting (ValueError) is the command line's one-line error
        print(f"attnres compare: error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_table(summary))
    print()
    print(summary["verdict"]["line"])
    print(f"\n{args.out}: loss.png, layers.png, depth_weights_*.png, summary.json "
          f"({time.perf_counter() - start:.0f} s in all)")
    return 0


def plot(args) -> int:
    from attnres.analysis.report import draw

    paths = draw(args.out)  # a missing folder (FileNotFoundError) is the command line's one-line error
    print("\n".join(str(p) for p in paths))
    return 0
