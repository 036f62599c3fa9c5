"""GPU benchmark of the Triton depth-attention kernels against flash-linear-attention's `fused_attnres`.

For each shape: the forward and the backward of `attnres.ops.triton` and of `fla.ops.attnres.fused_attnres` on the
same inputs (their outputs are compared first), timed as medians of `triton.testing.do_bench` after warm-up and
autotuning. Effective bandwidth uses one bytes model for every row (DESIGN section 8, the floor of a memory-bound
op): the forward reads R sources and writes the output, (R+1)*N*d*e bytes; the backward reads the sources and the
output gradient and writes R gradients, (2R+1)*N*d*e. It is printed in GB/s and as a fraction of the HBM peak,
beside the device-to-device copy bandwidth measured first, and the speed-ups over fla.

    python benchmarks/gpu_bench.py                     # the shapes below, on one CUDA GPU
    python benchmarks/gpu_bench.py --deadline 300      # skip what would not finish in 300 s
    TRITON_INTERPRET=1 python benchmarks/gpu_bench.py --smoke   # the logic on CPU: tiny shapes, fla's naive twin

Run by benchmarks/gpu_check.sh; the peer is compared only where fla-core imports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    dim: int
    sources: int
    out_norm: bool
    dtype: torch.dtype = torch.bfloat16


SHAPES = [
    Shape("K3 aggregation (T=16384, d=7168, R=9)", 16384, 7168, 9, out_norm=False),
    Shape("training, fused PreNorm (8x4096 tokens, d=4096, R=9)", 32768, 4096, 9, out_norm=True),
]
SMOKE_SHAPES = [
    Shape("smoke d=100", 12, 100, 3, out_norm=False),
    Shape("smoke d=64 out norm", 10, 64, 9, out_norm=True),
]
EPS = 1e-6
# first guess of the seconds one fla case takes on an H200 (a guess: nobody has timed it there yet)
FLA_CASE_SECONDS = 200


@dataclass
class Row:
    shape: str
    impl: str
    direction: str
    ms: float
    gbps: float
    of_peak: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-tbs", type=float, default=4.8, help="HBM peak in TB/s (default: 4.8, an H200)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds this script may run (default: 420)")
    p.add_argument("--json", type=Path, help="also write the rows here (atomically)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the logic")
    args = p.parse_args(argv)
    if args.peak_tbs <= 0 or args.deadline <= 0:
        p.error("--peak-tbs and --deadline must be positive")
    return args


def median_ms(fn: Callable[[], object], smoke: bool) -> float:
    if smoke:  # the interpreter: one warm-up and a few wall-clock runs say only that the code runs
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth_gbps(device: torch.device, smoke: bool) -> float:
    """Device-to-device copy of 2 GiB (bytes read plus written over time): the practical ceiling."""
    n = 1 << 20 if smoke else 1 << 30
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), smoke)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(shape: Shape, device: torch.device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, d = shape.tokens, shape.dim
    randn = lambda *size: torch.randn(*size, generator=gen).to(device)  # noqa: E731
    sources = [(randn(n, d) * (0.5 + j / shape.sources)).to(shape.dtype) for j in range(shape.sources)]
    return {
        "sources": sources,
        "query": randn(d) * 2 / d**0.5,
        "key_gain": 1 + 0.1 * randn(d),
        "out_gain": 1 + 0.1 * randn(d) if shape.out_norm else None,
        "grad_out": randn(n, d).to(shape.dtype),
    }


def bench_ours(shape: Shape, inputs: dict, smoke: bool):
    from attnres.ops.triton import triton_depth_attention_bwd, triton_depth_attention_fwd

    xs, ow, go = inputs["sources"], inputs["out_gain"], inputs["grad_out"]
    c = (inputs["query"] * inputs["key_gain"]).float()
    out, weights, rstd = triton_depth_attention_fwd(xs, c, ow, EPS, EPS)
    grads, _, _ = triton_depth_attention_bwd(go, None, xs, c, ow, weights, rstd, EPS, EPS)
    fwd = median_ms(lambda: triton_depth_attention_fwd(xs, c, ow, EPS, EPS), smoke)
    bwd = median_ms(lambda: triton_depth_attention_bwd(go, None, xs, c, ow, weights, rstd, EPS, EPS), smoke)
    return out, grads, fwd, bwd


def bench_fla(shape: Shape, inputs: dict, smoke: bool):
    """fla's fused kernel on CUDA; in smoke mode its naive twin (the fused one refuses CPU tensors)."""
    from fla.ops.attnres import fused_attnres, naive_attnres

    attnres = naive_attnres if smoke else fused_attnres
    xs = [x.detach().requires_grad_() for x in inputs["sources"]]
    q, g, ow, go = inputs["query"], inputs["key_gain"], inputs["out_gain"], inputs["grad_out"]

    def forward():
        return attnres(q, xs, g, ow, rms_eps=EPS)

    out = forward()
    grads = torch.autograd.grad(out, xs, go, retain_graph=True)  # autograd.grad: no accumulation into .grad
    with torch.no_grad():
        fwd = median_ms(forward, smoke)
    bwd = median_ms(lambda: torch.autograd.grad(out, xs, go, retain_graph=True), smoke)
    return out.detach(), grads, fwd, bwd


def gbps(bytes_moved: int, ms: float) -> float:
    return bytes_moved / ms / 1e6


class Budget:
    """The script's deadline, and the time one fla case is expected to take (its autotuning dominates: it compiles
    some 50 configs per kernel), updated from the last case measured."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.fla_case = FLA_CASE_SECONDS

    def left(self) -> float:
        return self.end - time.monotonic()


class Stopped(BaseException):
    """SIGTERM (the `timeout` of gpu_check.sh): stop measuring, report what was measured. A BaseException, like
    KeyboardInterrupt, so that no library's `except Exception` swallows or wraps it."""


def run_shape(shape: Shape, args, device: torch.device, have_fla: bool, budget: Budget, rows: list[Row]) -> None:
    """Measure one shape, appending to `rows` as results come (a stop keeps them)."""
    n, d, R = shape.tokens, shape.dim, shape.sources
    e = torch.finfo(shape.dtype).bits // 8
    bytes_fwd, bytes_bwd = (R + 1) * n * d * e, (2 * R + 1) * n * d * e
    inputs = make_inputs(shape, device)

    def add(impl, direction, ms):
        rate = gbps(bytes_fwd if direction == "fwd" else bytes_bwd, ms)
        rows.append(Row(shape.name, impl, direction, ms, rate, rate / (args.peak_tbs * 1e3)))

    out, grads, fwd, bwd = bench_ours(shape, inputs, args.smoke)
    add("attnres triton", "fwd", fwd)
    add("attnres triton", "bwd", bwd)
    print(f"  attnres triton: fwd {fwd:.3f} ms ({rows[-2].gbps:.0f} GB/s), bwd {bwd:.3f} ms ({rows[-1].gbps:.0f} GB/s)")
    if not have_fla:
        print("  fla: not importable, comparison skipped")
        return
    if budget.left() < budget.fla_case and not args.smoke:
        print(f"  fla: skipped, {budget.left():.0f} s left and a case takes about {budget.fla_case:.0f} s")
        return
    started = time.monotonic()
    peer_out, peer_grads, pfwd, pbwd = bench_fla(shape, inputs, args.smoke)
    budget.fla_case = 1.2 * (time.monotonic() - started)
    err_out = relative_error(out, peer_out)
    err_grad = max(relative_error(a, b) for a, b in zip(grads, peer_grads))
    verdict = "agree" if max(err_out, err_grad) < 2e-2 else "MISMATCH"
    print(f"  vs fla: relative error output {err_out:.1e}, source grads {err_grad:.1e} ({verdict})")
    peer = "fla naive_attnres" if args.smoke else "fla fused_attnres"
    add(peer, "fwd", pfwd)
    add(peer, "bwd", pbwd)
    print(f"  {peer}: fwd {pfwd:.3f} ms, bwd {pbwd:.3f} ms; speed-up fwd {pfwd / fwd:.2f}x, bwd {pbwd / bwd:.2f}x")


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.deadline)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment (read when triton is imported)", file=sys.stderr)
            return 2
        device, shapes = torch.device("cpu"), SMOKE_SHAPES
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: --smoke under TRITON_INTERPRET=1 checks the logic on CPU", file=sys.stderr)
            return 2
        device, shapes = torch.device("cuda"), SHAPES
    try:
        import fla.ops.attnres  # noqa: F401

        have_fla = True
    except ImportError as exc:
        print(f"fla-core not importable ({exc}); benchmarking attnres alone")
        have_fla = False

    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}, triton {triton.__version__}; HBM peak {args.peak_tbs} TB/s")
    copy = copy_bandwidth_gbps(device, args.smoke)
    print(f"device-to-device copy: {copy:.0f} GB/s ({copy / (args.peak_tbs * 1e3):.0%} of peak)")

    rows: list[Row] = []

    def report() -> None:
        if args.json:
            payload = {"device": name, "copy_gbps": copy, "peak_tbs": args.peak_tbs, "rows": [asdict(r) for r in rows]}
            write_json(args.json, payload)

    def stop(signum, frame):
        raise Stopped

    signal.signal(signal.SIGTERM, stop)
    try:
        for shape in shapes:
            if budget.left() <= 0:
                print(f"{shape.name}: skipped, deadline reached")
                continue
            print(f"{shape.name}, {str(shape.dtype)[6:]}{', out norm' if shape.out_norm else ''}:", flush=True)
            run_shape(shape, args, device, have_fla, budget, rows)
            report()  # after every shape, so that a run stopped by its time limit keeps what it measured
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except Stopped:
        print("stopped by SIGTERM (time limit): the table holds what was measured until then")
        report()

    print(f"\n{'shape':<56} {'impl':<18} {'dir':<4} {'ms':>9} {'GB/s':>7} {'of peak':>8}")
    for r in rows:
        print(f"{r.shape:<56} {r.impl:<18} {r.direction:<4} {r.ms:>9.3f} {r.gbps:>7.0f} {r.of_peak:>8.1%}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
