"""`attnres compare`: the main job. Train the PreNorm baseline and AttnRes models of the same size on the same
tokens, then print the table and draw the pictures."""

from __future__ import annotations

import sys
import time

from attnres.training.config import RESIDUALS


def register(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="train standard, Block and Full residual models side by side; table and pictures",
        description="Trains one model per residual kind with the same size, data (the Python standard library's "
        "sources, no download), seed and schedule, then prints validation loss, parameters and tokens/s, and "
        "writes loss.png, depth_weights_<kind>.png (mean depth weights, sources against aggregation points) and "
        "layers.png (per-sublayer input/output magnitudes and gradient norms) into --out. The defaults take about "
        "three and a half minutes on an idle 2-core machine. `attnres plot --out DIR` redraws the pictures.",
    )
    p.add_argument("--residuals", nargs="+", choices=RESIDUALS, default=["standard", "block", "full"],
                   help="kinds to train, in order (default: standard block full)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per model (default: %(default)s)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default: %(default)s)")
    p.add_argument("--dim", type=int, default=96, help="hidden size (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=2, help="Block AttnRes block size in decoder layers (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--attn-res-lr-mult", type=float, default=1.0,
                   help="learning-rate multiplier of the pseudo-queries and key gains. At this short budget 1 did "
                   "better than 0.1 (docs/results.md); longer runs favour 0.1, the default of `attnres train` "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
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
        base = TrainConfig(
            data=args.data if args.data else "stdlib", max_bytes=args.max_bytes, steps=args.steps, layers=args.layers,
            dim=args.dim, block_size=args.block_size, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
            attn_res_lr_mult=args.attn_res_lr_mult, seed=args.seed, eval_interval=max(args.steps // 6, 1),
            checkpoint_interval=args.steps, overwrite=True,
        )
        start = time.perf_counter()
        summary = compare(base, args.residuals, args.out)
    except (ValueError, TrainingDiverged) as e:
        print(f"attnres compare: error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_table(summary))
    print(f"\n{args.out}: loss.png, layers.png, depth_weights_*.png ({time.perf_counter() - start:.0f} s in all)")
    return 0


def plot(args) -> int:
    from attnres.analysis.report import draw

    try:
        paths = draw(args.out)
    except FileNotFoundError as e:
        print(f"attnres plot: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0
