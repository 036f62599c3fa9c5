"""Benchmark of the depth-attention operator (`attnres.depth_attention`) against its naive twin and `torch.sum`.

In one process, for each dtype: the forward and the forward+backward of the public operator, of the readable twin
`attnres.naive_depth_attention`, and of `torch.sum` over the same sources stacked `[R, T, d]` (the plain residual
sum, the cost AttnRes replaces). Times are medians over repeats, after warm-up. Effective GB/s use one bytes model
for every row (docs/design.md section 9: the aggregation is memory-bound): the forward reads R*T*d*e bytes and writes
T*d*e; the backward reads the sources and the output gradient and writes one gradient per source, (2R+1)*T*d*e.

    python -m benchmarks.bench_op                           # R=9, T=1024, d=2048, fp32 and bf16 (~1 min on 2 cores)
    python -m benchmarks.bench_op --tokens 4096 --dtypes bf16 fp16 --repeats 9
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import torch

from attnres import depth_attention, naive_depth_attention
from attnres.bench.timing import median_seconds
from attnres.ops.registry import backend_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=9, help="number of sources R (default: 9)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens T (default: 1024)")
    p.add_argument("--dim", type=int, default=2048, help="hidden size d (default: 2048)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"], help="(default: fp32 bf16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is kept (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before each measurement (default: 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: cuda if present)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("sources", "tokens", "dim", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be non-negative, got {args.warmup}")
    return args


def bench_dtype(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple[str, str, float, int]]:
    """(implementation, mode, seconds, bytes of the model) for the three implementations, forward and fwd+bwd;
    the attnres row names the backend that ran."""
    R, T, d, device = args.sources, args.tokens, args.dim, torch.device(args.device)
    e = torch.finfo(dtype).bits // 8
    stacked = torch.randn(R, T, d, device=device).to(dtype).requires_grad_()  # torch.sum's input
    sources = [x.detach().clone().requires_grad_() for x in stacked.unbind(0)]  # the operators': R tensors
    query = (torch.randn(d, device=device) / d**0.5).to(dtype).requires_grad_()
    gain = torch.ones(d, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(T, d, device=device).to(dtype)
    leaves = [stacked, *sources, query, gain]

    impls = {
        "torch.sum": lambda: stacked.sum(0),
        "naive": lambda: naive_depth_attention(sources, query, gain, eps=EPS),
        "attnres": lambda: depth_attention(sources, query, gain, eps=EPS),
    }

    def forward_backward(impl: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            impl().backward(grad_out)
            for t in leaves:
                t.grad = None

        return run

    fwd_bytes = (R + 1) * T * d * e
    bwd_bytes = (2 * R + 1) * T * d * e
    rows = []
    for name, impl in impls.items():
        with torch.no_grad():
            rows.append((name, "fwd", median_seconds(impl, args.repeats, args.warmup, device), fwd_bytes))
        seconds = median_seconds(forward_backward(impl), args.repeats, args.warmup, device)
        rows.append((name, "fwd+bwd", seconds, fwd_bytes + bwd_bytes))
        if name == "attnres":
            rows[-2:] = [(f"attnres[{backend_name(sources[0])}]", *row[1:]) for row in rows[-2:]]
        gc.collect()
    return rows


def format_table(results: dict[str, list[tuple[str, str, float, int]]]) -> str:
    header = f"{'dtype':5} {'impl':15} {'mode':7} {'ms':>9} {'x torch.sum':>11} {'x naive':>8} {'GB/s':>7}"
    lines = [header, "-" * len(header)]
    for dtype_name, rows in results.items():
        times = {(name, mode): s for name, mode, s, _ in rows}
        for name, mode, seconds, nbytes in sorted(rows, key=lambda r: (r[1] != "fwd", r[0] != "torch.sum", r[0])):
            lines.append(
                f"{dtype_name:5} {name:15} {mode:7} {seconds * 1e3:9.2f} {seconds / times['torch.sum', mode]:11.2f} "
                f"{seconds / times['naive', mode]:8.2f} {nbytes / seconds / 1e9:7.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    threads = f", {torch.get_num_threads()} threads" if args.device == "cpu" else ""
    print(
        f"depth attention: R={args.sources} T={args.tokens} d={args.dim} on {args.device}{threads}, torch "
        f"{torch.__version__}; median of {args.repeats} after {args.warmup} warm-up; x = time ratio (lower is faster)"
    )
    results = {name: bench_dtype(DTYPES[name], args) for name in args.dtypes}
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
