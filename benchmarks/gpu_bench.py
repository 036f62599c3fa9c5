"""GPU benchmark of the Triton depth-attention kernels against flash-linear-attention's `fused_attnres`, of the
fused inference kernels (`bank_aggregate`, `bank_merge`) against the unfused path they replace, and of two-phase's
phase 2 (`merge_prefix`, forward + backward) against the composition it replaced.

For each shape: the forward and the backward of `attnres.ops.triton` and of `fla.ops.attnres.fused_attnres` on the
same inputs (their outputs are compared first), timed as medians of `triton.testing.do_bench` after warm-up and
autotuning. Effective bandwidth uses one bytes model for every row (docs/design.md section 9, the floor of a
memory-bound op): the forward reads R sources and writes the output, (R+1)*N*d*e bytes; the backward reads the sources
and the output gradient and writes R gradients, (2R+1)*N*d*e. It is printed in GB/s, as a fraction of the HBM peak
(4.8 TB/s on an H200's datasheet) and as a fraction of the device-to-device copy bandwidth measured first (about
4.3 TB/s there: the practical ceiling), and the speed-ups over fla.

Inference points (docs/design.md section 5), bf16, with the pending add and the fused PreNorm: a read point over all NB
bank rows and the prefix, a write point over NB - 1 rows that also writes the prefix as row NB - 1, and a phase-2 merge.
Their bytes models count what each must touch: a read point reads nvb rows, the prefix and the output and writes the
prefix and the result, (nvb + 4)*N*d*e; a write point also writes a bank row, (nvb + 5)*N*d*e; a merge reads the fp32
statistics u, the prefix and the output and writes two rows, (4 + 4e)*N*d. The baseline of the fused aggregation is
the path it replaces (torch add, torch row write, then the one-shot Triton forward over the bank rows, which it reads
as strided views and so copies first), that of the merge the torch-op path.

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


@dataclass(frozen=True)
class BankShape:
    name: str
    tokens: int
    dim: int
    bank_rows: int
    dtype: torch.dtype = torch.bfloat16


BANK_SHAPES = [
    BankShape("K3 decode, bank (N=64, NB=8, d=7168)", 64, 7168, 8),
    BankShape("K3 prefill, bank (N=16384, NB=8, d=7168)", 16384, 7168, 8),
]
SMOKE_BANK_SHAPES = [BankShape("smoke bank d=100", 6, 100, 3)]
# phase 2 of two-phase training (one point: prefix score, merge, finish, out norm), forward + backward
MERGE_SHAPES = [Shape("training phase 2 (8x4096 tokens, d=4096)", 32768, 4096, 1, out_norm=True)]
SMOKE_MERGE_SHAPES = [Shape("smoke phase 2 d=100", 12, 100, 1, out_norm=True)]
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
    of_copy: float | None = None  # of the device-to-device copy bandwidth measured in the same run


def of_copy(rows: list[Row], copy_gbps: float) -> list[Row]:
    """The rows with their fraction of the measured copy bandwidth (the practical ceiling) filled in."""
    for row in rows:
        row.of_copy = row.gbps / copy_gbps
    return rows


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


def device_randn(device: torch.device, seed: int):
    """randn drawn on `device` itself (the K3 shapes need about 1e9 samples: minutes on a CPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return lambda *size: torch.randn(*size, generator=gen, device=device)


def make_inputs(shape: Shape, device: torch.device) -> dict:
    n, d = shape.tokens, shape.dim
    randn = device_randn(device, 0)
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


def make_bank_inputs(shape: BankShape, device: torch.device) -> dict:
    n, d, nb = shape.tokens, shape.dim, shape.bank_rows
    randn = device_randn(device, 0)
    return {
        "bank": (randn(n, nb, d) * (0.5 + torch.arange(nb, device=device) / nb)[:, None]).to(shape.dtype),
        "prefix": randn(n, d).to(shape.dtype),
        "output": (0.01 * randn(n, d)).to(shape.dtype),  # small: the timed calls add it again and again
        "query": randn(d) * 2 / d**0.5,
        "key_gain": 1 + 0.1 * randn(d),
        "out_gain": 1 + 0.1 * randn(d),
    }


def unfused_bank_aggregate(bank, nvb, prefix, output, query, key_gain, out_norm_weight, eps, out_eps, write):
    """The path the fused kernel replaces: torch add and row write, then the one-shot Triton forward."""
    from attnres.ops.triton import triton_depth_attention_fwd

    prefix.add_(output)
    if write:
        bank[:, nvb] = prefix
    sources = [bank[:, j] for j in range(nvb + write)] + ([] if write else [prefix])
    return triton_depth_attention_fwd(sources, query.float() * key_gain.float(), out_norm_weight, eps, out_eps)[0]


def torch_bank_merge(*args):
    """`bank_merge` on its torch-op path (the backend forced to torch for the call)."""
    from attnres.ops.registry import BACKEND_ENV
    from attnres.ops.bank import bank_merge

    saved = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = "torch"
    try:
        return bank_merge(*args)
    finally:
        if saved is None:
            del os.environ[BACKEND_ENV]
        else:
            os.environ[BACKEND_ENV] = saved


def run_bank_shape(shape: BankShape, args, device: torch.device, rows: list[Row]) -> None:
    """The fused inference kernels against their unfused paths at a read point, a write point and a merge: states
    compared first (prefix and bank bit for bit, the mixture by relative error), then timed, appending to `rows`."""
    from attnres.ops.naive import naive_depth_stats
    from attnres.ops.triton import triton_bank_aggregate, triton_bank_merge

    n, d, nb = shape.tokens, shape.dim, shape.bank_rows
    e = torch.finfo(shape.dtype).bits // 8
    t = make_bank_inputs(shape, device)
    common = (t["output"], t["query"], t["key_gain"], t["out_gain"], EPS, EPS)
    stats = naive_depth_stats([t["bank"][:, j] for j in range(nb)], t["query"][None], t["key_gain"][None], eps=EPS)
    m, z, u = (s[0] for s in stats)
    points = {  # kind: (fused, unfused, arguments after the state, bytes)
        "read": (triton_bank_aggregate, unfused_bank_aggregate, (nb, False), (nb + 4) * n * d * e),
        "write": (triton_bank_aggregate, unfused_bank_aggregate, (nb - 1, True), (nb - 1 + 5) * n * d * e),
        "merge": (triton_bank_merge, torch_bank_merge, (), (4 + 4 * e) * n * d),
    }
    for kind, (fused, unfused, extra, bytes_moved) in points.items():
        states = [(t["bank"].clone(), t["prefix"].clone()) for _ in range(2)]

        def call(fn, state):
            bank, prefix = state
            if kind == "merge":
                return lambda: fn(m, z, u, prefix, *common)
            nvb, write = extra
            return lambda: fn(bank, nvb, prefix, *common, write)

        out, ref = call(fused, states[0])(), call(unfused, states[1])()
        same_state = all(torch.equal(a, b) for a, b in zip(*states))
        err = relative_error(out, ref)
        ms_fused = median_ms(call(fused, states[0]), args.smoke)
        ms_unfused = median_ms(call(unfused, states[1]), args.smoke)
        for impl, ms in (("fused triton", ms_fused), ("unfused", ms_unfused)):
            rate = gbps(bytes_moved, ms)
            rows.append(Row(shape.name, impl, kind, ms, rate, rate / (args.peak_tbs * 1e3)))
        verdict = "agree" if same_state and err < 1e-2 else "MISMATCH"
        print(f"  {kind}: fused {ms_fused:.3f} ms ({gbps(bytes_moved, ms_fused):.0f} GB/s), unfused"
              f" {ms_unfused:.3f} ms, speed-up {ms_unfused / ms_fused:.2f}x; state"
              f" {'bit-exact' if same_state else 'DIFFERS'}, relative error {err:.1e} ({verdict})")
        del states, out, ref


def run_merge_shape(shape: Shape, args, device: torch.device, rows: list[Row]) -> None:
    """`merge_prefix` (one op, Triton on CUDA) against the composition it replaced (a phase-1 call on the prefix,
    `merge_stats`, `finish_stats`), forward + backward, outputs and gradients compared first."""
    from attnres.ops import SoftmaxStats, depth_stats, finish_stats, merge_prefix, merge_stats

    n, d, dtype = shape.tokens, shape.dim, shape.dtype
    e = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(0)
    stats = depth_stats([torch.randn(n, d, device=device, generator=g, dtype=dtype) for _ in range(4)],
                        torch.randn(1, d, device=device, generator=g) / d**0.5, torch.ones(1, d, device=device))
    m, z, u = stats.m[0], stats.z[0].requires_grad_(), stats.u[0].requires_grad_()
    x = torch.randn(n, d, device=device, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(d, device=device, generator=g) / d**0.5).requires_grad_()
    gain, o = (torch.ones(d, device=device, requires_grad=True) for _ in range(2))
    grad = torch.randn(n, d, device=device, generator=g, dtype=dtype)
    leaves = [z, u, x, w, gain, o]

    def fused():
        out = merge_prefix(SoftmaxStats(m, z, u), x, w, gain, eps=EPS, out_norm_weight=o, out_eps=EPS, dtype=dtype)
        return out, torch.autograd.grad(out, leaves, grad)

    def composition():
        own = depth_stats([x], w[None], gain[None], eps=EPS)
        merged = merge_stats(SoftmaxStats(m[None], z[None], u[None]), own)
        out = finish_stats(merged, o, out_eps=EPS, dtype=dtype)[0]
        return out, torch.autograd.grad(out, leaves, grad)

    (out, grads), (ref, ref_grads) = fused(), composition()
    # z's gradient is left out: under the (scale-invariant) output norm it is zero up to rounding in both paths
    err = max(relative_error(a, b) for i, (a, b) in enumerate(zip((out, *grads), (ref, *ref_grads))) if i != 1)
    bytes_moved = (12 + 5 * e) * n * d  # forward: u, prefix, out; backward: u, prefix, grad, du, dx (fp32 u, du)
    ms_fused, ms_composed = median_ms(fused, args.smoke), median_ms(composition, args.smoke)
    for impl, ms in (("merge_prefix", ms_fused), ("composition", ms_composed)):
        rate = gbps(bytes_moved, ms)
        rows.append(Row(shape.name, impl, "f+b", ms, rate, rate / (args.peak_tbs * 1e3)))
    print(f"  fwd+bwd: merge_prefix {ms_fused:.3f} ms ({gbps(bytes_moved, ms_fused):.0f} GB/s), composition"
          f" {ms_composed:.3f} ms, speed-up {ms_composed / ms_fused:.2f}x; worst relative error {err:.1e}"
          f" ({'agree' if err < 2e-2 else 'MISMATCH'})")


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
        device, shapes, bank_shapes, merge_shapes = torch.device("cpu"), SMOKE_SHAPES, SMOKE_BANK_SHAPES, SMOKE_MERGE_SHAPES
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: --smoke under TRITON_INTERPRET=1 checks the logic on CPU", file=sys.stderr)
            return 2
        device, shapes, bank_shapes, merge_shapes = torch.device("cuda"), SHAPES, BANK_SHAPES, MERGE_SHAPES
    try:  # fla queries the device at import: anything may be raised
        import fla.ops.attnres  # noqa: F401

        have_fla = True
    except Exception as exc:  # noqa: BLE001
        print(f"fla-core not importable ({type(exc).__name__}: {exc}); benchmarking attnres alone")
        have_fla = False

    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}, triton {triton.__version__}; HBM peak {args.peak_tbs} TB/s")
    copy = copy_bandwidth_gbps(device, args.smoke)
    print(f"device-to-device copy: {copy:.0f} GB/s ({copy / (args.peak_tbs * 1e3):.0%} of peak)")

    rows: list[Row] = []

    def report() -> None:
        if args.json:
            payload = {"device": name, "copy_gbps": copy, "peak_tbs": args.peak_tbs,
                       "rows": [asdict(r) for r in of_copy(rows, copy)]}
            write_json(args.json, payload)

    def stop(signum, frame):
        raise Stopped

    signal.signal(signal.SIGTERM, stop)
    try:
        for shape in bank_shapes:  # first: a few seconds each, where an fla case takes minutes
            print(f"{shape.name}, {str(shape.dtype)[6:]}, out norm:", flush=True)
            run_bank_shape(shape, args, device, rows)
            report()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for shape in merge_shapes:
            print(f"{shape.name}, {str(shape.dtype)[6:]}, out norm:", flush=True)
            run_merge_shape(shape, args, device, rows)
            report()
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

    print(f"\n{'shape':<56} {'impl':<18} {'dir':<5} {'ms':>9} {'GB/s':>7} {'of peak':>8} {'of copy':>8}")
    for r in of_copy(rows, copy):
        print(f"{r.shape:<56} {r.impl:<18} {r.direction:<5} {r.ms:>9.3f} {r.gbps:>7.0f} {r.of_peak:>8.1%}"
              f" {r.of_copy:>8.1%}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
