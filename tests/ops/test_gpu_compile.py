"""Every Triton kernel compiled ahead of time for sm_90 (H100/H200) and sm_100 (B200) on this CPU machine, the way a
GPU would build it on its first call.

Each case calls the real launcher (`triton_depth_attention_fwd`, ...) with CPU tensors (`torch.empty`: never
touched) and captures the launch instead of running it. The captured call then goes through the autotuner's own
prune path (`Autotuner.prune_configs`, with positional and keyword arguments split as Triton splits them), the
heuristics, Triton's real argument binder (`create_function_from_signature`: integer 1 becomes a constant, multiples
of 16 and 16-byte aligned pointers get divisibility hints) and `triton.compiler.compile` for a CUDA target. The
bundled `ptxas -v` then reports registers and spills of each config the autotuner may pick.

Cases cover one token (N == 1, every decode step), short and long N, every d class up to 7168 (a tail, small, one
token per tile, the largest), aligned and unaligned rows, every dtype and every constexpr branch. A config that
spills more than MAX_SPILL_BYTES per thread fails.

    python -m pytest tests/ops/test_gpu_compile.py                     # the Triton of this environment
    python tests/ops/test_gpu_compile.py                               # also prints registers and spills per kernel

By default (what CI runs: a cold compile of the whole matrix takes over ten minutes on 2 cores) the cases at the
largest d compile every config the prune keeps, for both targets (spills grow with d and differ by target); every
other case compiles the first config it keeps, for sm_90 (the front end that fails on N == 1 or a constexpr branch
is the same for both). `ATTNRES_GPU_COMPILE=full` compiles every config of every case for both targets.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch

import triton

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime.autotuner import Autotuner, Heuristics  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from attnres.ops.triton import bank, depth_attention, merge, two_phase  # noqa: E402

if depth_attention.INTERPRETING:  # the kernels were defined with the interpreter's single config: nothing to check
    raise pytest.UsageError("tests/ops/test_gpu_compile.py compiles for GPU targets: run it without TRITON_INTERPRET")

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_100": GPUTarget("cuda", 100, 32)}
# Bytes of spill stores per thread a config the autotuner may pick can have: a few dozen registers' worth, which the
# L1 holds, next to a tile of thousands of elements per program; a kernel that spills its rows spills kilobytes (the
# backward kernels at d = 7168 with 4 warps did, until their prune left those configs out). At d = 7168 the phase-2
# backward spills even with 16 warps (128 registers a thread at most): about 200 bytes on sm_90, 448 on sm_100 with an
# fp32 prefix.
MAX_SPILL_BYTES = 512
SMS = 132  # an H200's streaming multiprocessors: the persistent grids' size
D_CLASSES = (64, 100, 1024, 4096, 7168)  # small, unaligned tail, mid, one or two tokens per tile, the largest
LONG_N = 4096  # a multiple of 16 (a divisibility hint) past every tile; N == 1 is a constant; 7 a short count
LARGEST = (7168, LONG_N)  # (d, N) where registers are scarcest: the branch cases run here
TAIL = (100, 7)
FULL = os.environ.get("ATTNRES_GPU_COMPILE") == "full"
LAUNCHER_MODULES = (depth_attention, two_phase, merge, bank)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple
    kwargs: dict


class Recorder:
    """Stands in for a kernel object in its launcher's module: `kernel[grid](*args, **kwargs)` is recorded."""

    def __init__(self, name: str, launches: list[Launch]):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.name, args, kwargs))


def kernels() -> dict[str, object]:
    return {name: getattr(module, name) for module in LAUNCHER_MODULES for name in vars(module)
            if name.endswith("_kernel") and isinstance(getattr(module, name), (Autotuner, Heuristics, JITFunction))}


def record(call: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """The launches `call` makes, with the persistent grids sized for an H200."""
    launches: list[Launch] = []
    with monkeypatch.context() as patch:
        for module in LAUNCHER_MODULES:
            for name in vars(module):
                if name in kernels():
                    patch.setattr(module, name, Recorder(name, launches))
            if hasattr(module, "num_programs"):
                patch.setattr(module, "num_programs", lambda device, work: max(1, min(work, 4 * SMS)))
        call()
    return launches


def expand(kernel, args: tuple, kwargs: dict, every_config: bool = True) -> Iterator[tuple[JITFunction, dict]]:
    """(jit function, keyword arguments) of every config the autotuner may run (or the first), through its own prune
    path."""
    if isinstance(kernel, Autotuner):
        kernel.nargs = dict(zip(kernel.arg_names, args))  # what Autotuner.run sets before pruning
        try:
            configs = kernel.prune_configs(kwargs)
        finally:
            kernel.nargs = None
        for config in configs if every_config else configs[:1]:
            yield from expand(kernel.fn, args, {**kwargs, **config.all_kwargs()}, every_config)
    elif isinstance(kernel, Heuristics):
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}
        rules = {k: rule(named) for k, rule in kernel.values.items()}
        yield from expand(kernel.fn, args, {**kwargs, **rules}, every_config)
    else:
        yield kernel, kwargs


@dataclass(frozen=True)
class Build:
    kernel: str
    config: str
    registers: int
    spill_bytes: int


def compile_launch(launch: Launch, target_name: str) -> list[Build]:
    target = TARGETS[target_name]
    backend = make_backend(target)
    builds = []
    ints = [a for a in (*launch.args, *launch.kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    widest = LARGEST[0] in ints  # a case at the largest d
    if not (FULL or widest or target_name == "sm_90"):
        return []
    for fn, kwargs in expand(kernels()[launch.kernel], launch.args, launch.kwargs, every_config=FULL or widest):
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        registers, spills = compiled_usage(fn, signature, constexprs, attrs, options, target_name)
        shown = {k: v for k, v in kwargs.items() if k not in ("debug", "instrumentation_mode")}
        builds.append(Build(launch.kernel, describe(shown, launch.args, fn), registers, spills))
    return builds


@functools.lru_cache(maxsize=None)
def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    suffix = "a" if arch in (90, 100) else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", source.name,
                              "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    assert registers and spills, log
    return int(registers.group(1)), int(spills.group(1))


def compiled_usage(fn, signature, constexprs, attrs, options, target_name: str) -> tuple[int, int]:
    target = TARGETS[target_name]
    compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return _ptxas_usage(compiled.asm["ptx"], target.arch)


def describe(kwargs: dict, args: tuple, fn: JITFunction) -> str:
    named = dict(zip(fn.arg_names, args))
    ints = {k: v for k, v in named.items() if isinstance(v, int) and not isinstance(v, bool)}
    consts = {k: (str(v).replace("tl.", "") if not isinstance(v, (int, bool)) else v) for k, v in kwargs.items()}
    return " ".join(f"{k}={v}" for k, v in {**ints, **consts}.items())


# --- the cases: each calls a launcher as the ops do -----------------------------------------------------------------


def sources(r: int, n: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.empty(n, d, dtype=dtype) for _ in range(r)]


def vec(d: int) -> torch.Tensor:
    return torch.ones(d)


def one_shot_fwd(d, n, dtype=torch.bfloat16, out_norm=True, r=3):
    return lambda: depth_attention.triton_depth_attention_fwd(
        sources(r, n, d, dtype), vec(d), vec(d) if out_norm else None, 1e-6, 1e-6)


def one_shot_bwd(d, n, dtype=torch.bfloat16, out_norm=True, grad_weights=True, r=3, accumulate=False):
    def call():
        stats = torch.empty(r, n)
        args = (torch.empty(n, d, dtype=dtype), torch.empty(r, n) if grad_weights else None, sources(r, n, d, dtype),
                vec(d), vec(d) if out_norm else None, stats, stats, 1e-6, 1e-6)
        if accumulate:  # a chained point (attnres/ops/chain.py) adds onto the gradients it is given
            depth_attention.triton_depth_attention_bwd_into(*args, list(torch.empty(r, n, d, dtype=dtype)), r)
        else:
            depth_attention.triton_depth_attention_bwd(*args)
    return call


def stats_fwd(d, n, dtype=torch.bfloat16, queries=2, r=3):
    return lambda: two_phase.triton_depth_stats_fwd(sources(r, n, d, dtype), torch.ones(queries, d), 1e-6)


def stats_bwd(d, n, dtype=torch.bfloat16, queries=2, r=3):
    def call():
        two_phase.triton_depth_stats_bwd(
            torch.empty(queries, n), torch.empty(queries, n, d), sources(r, n, d, dtype), torch.ones(queries, d),
            torch.empty(queries, n), torch.empty(r, n), 1e-6)
    return call


def merge_fwd(d, n, dtype=torch.bfloat16, prefix=True, out_norm=True):
    return lambda: merge.triton_merge_prefix_fwd(
        torch.empty(n), torch.empty(n), torch.empty(n, d), torch.empty(n, d, dtype=dtype) if prefix else None,
        vec(d) if prefix else None, vec(d) if out_norm else None, 1e-6, 1e-6, dtype)


def merge_bwd(d, n, dtype=torch.bfloat16, prefix=True, out_norm=True):
    return lambda: merge.triton_merge_prefix_bwd(
        torch.empty(n, d, dtype=dtype), torch.empty(n), torch.empty(n), torch.empty(n, d),
        torch.empty(n, d, dtype=dtype) if prefix else None, vec(d) if prefix else None, vec(d) if out_norm else None,
        1e-6, 1e-6)


def bank_aggregate(d, n, dtype=torch.bfloat16, output=True, write=False, out_norm=True, rows=8):
    nvb = rows - 1 if write else rows  # a write point stores the prefix as the last row
    return lambda: bank.triton_bank_aggregate(
        torch.empty(n, rows, d, dtype=dtype), nvb, torch.empty(n, d, dtype=dtype),
        torch.empty(n, d, dtype=dtype) if output else None, vec(d), vec(d), vec(d) if out_norm else None, 1e-6, 1e-6,
        write)


def bank_merge(d, n, dtype=torch.bfloat16, output=True, out_norm=True):
    return lambda: bank.triton_bank_merge(
        torch.empty(n), torch.empty(n), torch.empty(n, d), torch.empty(n, d, dtype=dtype),
        torch.empty(n, d, dtype=dtype) if output else None, vec(d), vec(d), vec(d) if out_norm else None, 1e-6, 1e-6)


def flips(**options) -> list[dict]:
    """One case per value of each option beside the defaults."""
    return [{k: v} for k, values in options.items() for v in values]


# per op: (launcher, the branch options to flip); every op also runs each d class at each N with its defaults
OPS = {
    "one_shot_fwd": (one_shot_fwd, flips(dtype=DTYPES, out_norm=(False,))),
    "one_shot_bwd": (one_shot_bwd, flips(dtype=DTYPES, out_norm=(False,), grad_weights=(False,), accumulate=(True,))),
    # the backward's [S, R] tiles are padded to 16, 32 or 64: each pad, for queries and for sources
    "stats_fwd": (stats_fwd, flips(dtype=DTYPES, queries=(1, 64))),
    "stats_bwd": (stats_bwd, flips(dtype=DTYPES, queries=(1, 20, 64), r=(20, 64))),
    "merge_fwd": (merge_fwd, flips(dtype=DTYPES, prefix=(False,), out_norm=(False,))),
    "merge_bwd": (merge_bwd, flips(dtype=DTYPES, prefix=(False,), out_norm=(False,))),
    "bank_aggregate": (bank_aggregate, flips(dtype=DTYPES, output=(False,), write=(True,), out_norm=(False,))),
    "bank_merge": (bank_merge, flips(dtype=DTYPES, output=(False,), out_norm=(False,))),
}


def cases(op: str) -> list[Callable[[], object]]:
    """Every d class at a long N (every tile the autotuner has) and at N == 1, a short unaligned tail, and each
    branch option at the scarcest registers."""
    launcher, options = OPS[op]
    grid = [launcher(d, n) for d in D_CLASSES for n in (LONG_N, 1)] + [launcher(*TAIL)]
    return grid + [launcher(*LARGEST, **option) for option in options]


def builds(op: str, target: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Build], list[str]]:
    """(every distinct build of the op's cases, the compile errors)."""
    seen, out, errors = set(), [], []
    for case in cases(op):
        for launch in record(case, monkeypatch):
            try:
                for build in compile_launch(launch, target):
                    if (build.kernel, build.config) not in seen:
                        seen.add((build.kernel, build.config))
                        out.append(build)
            except Exception as exc:  # noqa: BLE001  (every failing case is listed, not just the first)
                errors.append(f"{launch.kernel} {describe(launch.kwargs, launch.args, kernels()[launch.kernel])}: "
                              f"{type(exc).__name__}: {str(exc)[-600:]}")
    return out, errors


def op_builds(job: tuple[str, str]) -> tuple[list[Build], list[str]]:
    op, target = job
    # a forked child must not enter an OpenMP parallel region: GNU libgomp's thread pool does not survive fork, and
    # the launchers' small torch ops (a sum over programs) hung there; one thread runs them inline
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        return builds(op, target, monkeypatch)


def build_all(jobs: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[list[Build], list[str]]]:
    """Each (op, target) in a forked worker, one per core: compiling is CPU-bound and Triton compiles in-process."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(jobs, pool.map(op_builds, jobs)))


@pytest.fixture(scope="module")
def compiled(request) -> dict:
    """The builds of every (op, target) the session selected, compiled up front in parallel."""
    jobs = sorted({(item.callspec.params["op"], item.callspec.params["target"]) for item in request.session.items
                   if getattr(item, "originalname", "") == "test_every_config_compiles_without_spilling"})
    return build_all(jobs)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_config_compiles_without_spilling(op, target, compiled):
    got, errors = compiled[(op, target)]
    assert not errors, "\n".join(errors)
    assert got, "no launch recorded"
    spilling = [f"{b.kernel} [{b.config}]: {b.spill_bytes} bytes, {b.registers} registers" for b in got
                if b.spill_bytes > MAX_SPILL_BYTES]
    assert not spilling, f"spill stores above {MAX_SPILL_BYTES} bytes per thread:\n" + "\n".join(spilling)


def test_the_prune_reads_keyword_constexprs_as_the_autotuner_passes_them():
    """Autotuner.run hands the positional arguments as named_args and D_PAD (a keyword) separately."""
    configs = depth_attention.tile_configs((1024, 4096, 8192), (4, 8))
    kept = depth_attention.distinct_tiles(configs, {"N": 4096}, D=7168, D_PAD=8192, OUT_NORM=True)
    assert {(c.kwargs["TILE"], c.num_warps) for c in kept} == {(1024, 4), (1024, 8)}


def test_the_backward_prune_leaves_out_configs_that_spill_their_rows():
    configs = depth_attention.tile_configs((1024, 4096), (4, 8, 16))
    kept = depth_attention.tiles_within(32)(configs, {"N": 4096}, D=7168, D_PAD=8192)
    assert {c.num_warps for c in kept} == {8, 16}  # 4 warps would hold 64 elements of each row per thread
    kept = depth_attention.tiles_within(16)(configs, {"N": 4096}, D=65536, D_PAD=65536)
    assert {c.num_warps for c in kept} == {16}  # none fits: the fewest elements per thread stay


def test_every_kernel_is_covered(monkeypatch):
    launched = {launch.kernel for op in OPS for case in cases(op)[:1] + cases(op)[-1:]
                for launch in record(case, monkeypatch)}
    assert launched == set(kernels())


def usage_table() -> str:
    """Registers and spill bytes per kernel and target: the range over every config and case."""
    results = build_all([(op, target) for target in sorted(TARGETS) for op in sorted(OPS)])
    lines = []
    for target in sorted(TARGETS):
        per_kernel: dict[str, list[Build]] = {}
        for op in sorted(OPS):
            got, errors = results[(op, target)]
            lines += [f"ERROR {target} {e}" for e in errors]
            for b in got:
                per_kernel.setdefault(b.kernel, []).append(b)
        for kernel, bs in sorted(per_kernel.items()):
            worst = max(bs, key=lambda b: (b.spill_bytes, b.registers))
            lines.append(f"{target} {kernel}: {len(bs)} builds, registers {min(b.registers for b in bs)}-"
                         f"{max(b.registers for b in bs)}, spill bytes max {worst.spill_bytes} [{worst.config}]")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"triton {triton.__version__}")
    print(usage_table())
    sys.exit(0)
