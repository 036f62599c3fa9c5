"""Everything only a GPU can check, in one run: the Triton kernels inside whole models, memory and speed.

Stages, in this order (by value: the headline measurement first), each in a forked child process with its own time
limit (a hang, an out-of-memory or a CUDA error that poisons the context ends that stage only; what it measured
before stays, since every stage writes its results as they come):

- env: device, versions; stops the run where no CUDA device is visible (outside --smoke).
- op_hbm: the operator at T=16K, d=7168, R=9, bf16: fraction of HBM peak and of the measured copy bandwidth, beside
  flash-linear-attention's `fused_attnres` (benchmarks/gpu_bench.py), then its other shapes while time is left; a
  case that fails is recorded and the next one runs.
- parity: loss and every parameter gradient of one training step through the Triton kernels and through the torch-op
  path (`ATTNRES_BACKEND=torch`), Block with two-phase forced on and off and Full, fp32 and bf16. Both are held to an
  fp64 copy of the model: a case passes when the kernels' error is at most twice the torch path's, plus a floor
  (1e-5 fp32, 1e-3 bf16, relative). Which kernels ran is counted, so a silent fallback to torch fails the case.
- decode: prefill and greedy decode of a Block model (the fused bank ops), the torch path as reference, then the
  Triton kernels eager, under `torch.compile` (inductor), and last with decode captured in a CUDA graph (a
  StaticCache, static input buffers; a failed capture can poison the context): same tokens, logits to fp32 rounding.
- op_tests: the Triton kernel tests on CUDA (pytest, one config per kernel, the log in the stages folder; skipped in
  --smoke, where the CPU suite runs them interpreted).
- timing: Block/standard and Full/standard time of a training step, a prefill and a decode step at that size.
  In both, every model's plain RMSNorms are the fastest plain norm (`attnres.bench.models.fast_norms`), the standard
  baseline's included, as AttnRes fuses its PreNorms.
- memory: peak memory (`torch.cuda.max_memory_allocated` above the parameters) and bytes autograd saves for one
  forward + backward, standard / Block (two-phase auto, forced off, forced on) / Full, d=2048, 8 layers, T=4096, bf16.

All results go into one JSON (`--json`) and a short table is printed at the end, with the issue-13 targets.

    python benchmarks/gpu_model_check.py --json runs/gpu_check.json           # on a CUDA machine (gpu_check.sh)
    TRITON_INTERPRET=1 python benchmarks/gpu_model_check.py --smoke           # the same stages on CPU, tiny sizes

--smoke routes CPU tensors to the Triton kernels (under the interpreter), so the parity checks compare the same
kernels for real; timings only show that the code runs; the CUDA graph variant runs its static-buffer loop uncaptured;
`torch.compile` uses the eager backend on the decode step only (dynamo's tracing of the model in this loop; inductor
compiles C++ for about half a minute per graph on CPU, and tests/models/test_compile.py holds the fake kernels to
aot_eager); peak memory
is left out (no CUDA allocator), saved bytes are measured; op_hbm runs gpu_bench.py's first smoke shapes only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import importlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from attnres.atomic import atomic_write_text  # noqa: E402
from attnres.models import AttnResConfig, AttnResForCausalLM  # noqa: E402
from attnres.ops.depth_attention import point_kernels_from  # noqa: E402
from attnres.ops.triton.depth_attention import SINGLE_CONFIG_ENV  # noqa: E402

MIB = 2**20
OP_TESTS = ["tests/ops/test_triton.py", "tests/ops/test_triton_bank.py", "tests/ops/test_merge.py"]
# the targets a GPU run is held to
TARGETS = {"op fwd of HBM peak": 0.85, "train block/standard": 1.03, "decode block/standard": 1.02}


@dataclasses.dataclass(frozen=True)
class Model:
    dim: int
    layers: int
    heads: int
    vocab: int
    block_size: int

    def fields(self) -> dict:
        return dict(vocab_size=self.vocab, hidden_size=self.dim, intermediate_size=-(-8 * self.dim // 3 // 32) * 32,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads, max_position_embeddings=8192)


@dataclasses.dataclass(frozen=True)
class Sizes:
    parity: Model
    parity_tokens: int
    parity_batch: int
    decode: Model
    prompt: int
    new_tokens: int
    decode_two_phase: bool | None  # None: the model's own choice
    compile_backend: str
    compile_prefill: bool  # the prefill compiled too (else eager, and only the decode step compiled)
    big: Model  # memory and timing
    big_tokens: int
    context: int  # cached tokens before a timed decode step
    repeats: int
    decode_repeats: int
    warmup: int


GPU_SIZES = Sizes(
    parity=Model(256, 6, 4, 256, 2), parity_tokens=256, parity_batch=2,
    # two-phase forced on, so that prefill and decode both run phase 1 and the fused merge (4 layers: inductor's compile
    # time grows with the graph)
    decode=Model(512, 4, 8, 256, 2), prompt=320, new_tokens=24, decode_two_phase=True, compile_backend="inductor",
    compile_prefill=True,
    big=Model(2048, 8, 16, 32000, 2), big_tokens=4096, context=1024, repeats=10, decode_repeats=50, warmup=3,
)
SMOKE_SIZES = Sizes(
    parity=Model(32, 2, 4, 64, 1), parity_tokens=8, parity_batch=2,
    decode=Model(32, 2, 4, 64, 1), prompt=6, new_tokens=3, decode_two_phase=True, compile_backend="eager",
    compile_prefill=False,
    big=Model(32, 2, 4, 64, 1), big_tokens=16, context=8, repeats=1, decode_repeats=1, warmup=0,
)

# (name, residual, attn_res_two_phase, dtype) of the parity stage
PARITY_CASES = [
    ("block two-phase fp32", "block", True, torch.float32),
    ("block one-shot fp32", "block", False, torch.float32),
    ("full fp32", "full", None, torch.float32),
    ("block two-phase bf16", "block", True, torch.bfloat16),
    ("block one-shot bf16", "block", False, torch.bfloat16),
    ("full bf16", "full", None, torch.bfloat16),
]
# the kernels a case must have called on the Triton path (a fallback to torch would call none)
EXPECTED_KERNELS = {
    ("block", True): ("depth_stats_fwd", "depth_stats_bwd", "merge_prefix_fwd", "merge_prefix_bwd"),
    # training: the one-shot points form a chain (attnres/ops/chain.py)
    ("block", False): ("depth_attention_fwd", "depth_attention_bwd_into"),
    ("full", None): ("depth_attention_fwd", "depth_attention_bwd_into"),
}
ERROR_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
# a stage's most seconds and the least it is worth starting with, in the order they run: by value, the headline
# measurement (the operator's HBM fraction, fla's fused kernel beside it: its autotuning alone takes minutes) first
LIMITS = {"env": (45, 10), "op_hbm": (270, 60), "parity": (70, 20), "decode": (100, 30), "op_tests": (120, 30),
          "timing": (50, 20), "memory": (40, 15)}
STAGES = tuple(LIMITS)


# --- what a child process records -------------------------------------------------------------------------------


class Recorder:
    """A stage's results, rewritten to its JSON file at every `set` so a killed stage keeps what it measured."""

    def __init__(self, path: Path):
        self.path, self.data, self.errors, self.tracebacks = path, {}, {}, {}

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self._flush()

    def error(self, key: str, exc: BaseException) -> None:
        """Record a failure: its message in `errors`, its traceback in `tracebacks` (the JSON may be all that comes back
        from a GPU machine)."""
        self.errors[key] = f"{type(exc).__name__}: {exc}"
        self.tracebacks[key] = traceback.format_exc(limit=12)[-4000:]
        print(f"  {key}: FAILED {self.errors[key]}\n{self.tracebacks[key]}", flush=True)
        self._flush()

    def _flush(self) -> None:
        payload = {"result": self.data, "errors": self.errors, "tracebacks": self.tracebacks}
        atomic_write_text(self.path, json.dumps(payload, indent=1, default=str))


class KernelCounts:
    """Installs the Triton backend with every kernel counted; in smoke mode it also serves CPU tensors (the
    interpreter), so the same kernels run there."""

    def __init__(self, smoke: bool):
        from attnres.ops import registry
        from attnres.ops.triton import KERNELS as triton

        self.calls: collections.Counter = collections.Counter()
        # the point kernels are composed from the counted one-shot ones: a point counts once, as its one-shot kernel
        point_ops = {"point_fwd", "point_bwd", "point_bwd_into"}
        counted = {op: self._counted(op, fn) for op, fn in triton.kernels.items() if op not in point_ops}
        counted |= point_kernels_from(counted["depth_attention_fwd"], counted["depth_attention_bwd"],
                                      counted["depth_attention_bwd_into"])
        registry.register_backend("cpu" if smoke else "cuda", dataclasses.replace(triton, kernels=counted))

    def _counted(self, op: str, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.calls[op] += 1
            return fn(*args, **kwargs)

        run.__dict__.pop("kernel", None)  # an inference stream then calls the counted op at every point
        return run

    def take(self) -> dict[str, int]:
        calls, self.calls = dict(self.calls), collections.Counter()
        return calls


@contextlib.contextmanager
def backend(name: str):
    """`ATTNRES_BACKEND` for the block: "auto" (the Triton kernels here) or "torch"."""
    from attnres.ops.registry import BACKEND_ENV

    saved = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(kind: str, model: Model, device: torch.device, dtype: torch.dtype, two_phase: bool | None = None,
          fast_norms: bool = False):
    """A model of `kind` built on `device` with seed 0, pseudo-queries and key gains away from their init (a zero query
    hides a wrong key gain and a wrong grouping); with `fast_norms` every plain RMSNorm the fastest plain norm
    (`attnres.bench.models.fast_norms`: the fair baseline of the memory and timing stages)."""
    torch.manual_seed(0)
    config = AttnResConfig(**model.fields(), residual=kind, attn_res_block_size=model.block_size,
                           attn_res_two_phase=two_phase)
    with torch.device(device):
        lm = AttnResForCausalLM(config)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("_res_norm.weight"):
                p.normal_(1.0, 0.3)
    if fast_norms:
        from attnres.bench.models import fast_norms as use_fast_norms

        use_fast_norms(lm)
    return lm.to(dtype)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --- stages (each runs in its own child process) --------------------------------------------------------------------


def stage_env(rec: Recorder, smoke: bool) -> None:
    import transformers
    import triton

    rec.set("torch", torch.__version__)
    rec.set("triton", triton.__version__)
    rec.set("transformers", transformers.__version__)
    rec.set("fla", fla_status())
    if smoke:
        rec.set("device", "cpu (Triton interpreter)")
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    props = torch.cuda.get_device_properties(0)
    rec.set("device", f"{props.name}, {props.total_memory / 2**30:.0f} GiB")


def fla_status() -> str:
    """fla-core's version, or why its attnres ops do not import: fla queries the device at import, so anything may be
    raised, not only an ImportError (a stage must not fail on the peer)."""
    try:
        fla = importlib.import_module("fla")
        importlib.import_module("fla.ops.attnres")
        return getattr(fla, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        return f"not importable ({type(exc).__name__}: {exc})"


def loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def errors_against(ref: tuple, got: tuple, truth: tuple | None = None) -> dict:
    """Relative error of the loss and the worst parameter gradient of `got` against `ref` (same parameters). A gradient
    that vanishes in exact arithmetic (layer 0's attention-side point has one source, so its weight is exactly 1) is
    rounding noise in every path: where the reference gradient is below 1e-8 of the median gradient norm, the error is
    taken relative to the median norm instead (a wrong gradient there is still of that scale). `truth` (default: `ref`)
    says which gradients vanish."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    if set(ref_grads) != set(grads):
        raise AssertionError(f"different parameters received gradients: {sorted(set(ref_grads) ^ set(grads))}")
    norms = {n: g.double().norm().item() for n, g in (truth or ref)[1].items()}
    typical = sorted(norms.values())[len(norms) // 2]
    scale = {n: norm if norm > 1e-8 * typical else typical for n, norm in norms.items()}
    per_param = {n: (grads[n].double() - ref_grads[n].double()).norm().item() / scale[n] for n in ref_grads}
    worst = max(per_param, key=per_param.get)
    return {"loss": relative_error(loss, ref_loss), "grad": per_param[worst], "worst_param": worst}


def parity_verdict(truth: tuple, torch_run: tuple, kernel_run: tuple, torch_calls: dict, kernel_calls: dict,
                   expected: tuple[str, ...], floor: float) -> dict:
    """A case passes when the kernels ran (each of `expected` called on the kernel run, none on the torch run) and the
    kernel run's loss and worst gradient are no further from the fp64 truth than twice the torch run's, plus `floor`."""
    e_torch, e_kernels = errors_against(truth, torch_run), errors_against(truth, kernel_run)
    routed = all(kernel_calls.get(op, 0) > 0 for op in expected) and not torch_calls
    passed = routed and all(e_kernels[k] <= 2 * e_torch[k] + floor for k in ("loss", "grad"))
    return {"passed": passed, "routed": routed, "kernels_vs_fp64": e_kernels, "torch_vs_fp64": e_torch,
            "kernels_vs_torch": errors_against(torch_run, kernel_run, truth), "floor": floor,
            "kernel_calls": kernel_calls,
            "expected_kernels": expected, "gradients": len(truth[1])}


def stage_parity(rec: Recorder, sizes: Sizes, device: torch.device, counts: KernelCounts) -> None:
    model_size, gen = sizes.parity, torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_size.vocab, (sizes.parity_batch, sizes.parity_tokens), generator=gen).to(device)
    for name, kind, two_phase, dtype in PARITY_CASES:
        try:
            reference = build(kind, model_size, device, torch.float64, two_phase).train()
            truth = loss_and_grads(reference, ids)  # fp64: always the torch path
            model = copy.deepcopy(reference).to(dtype)
            with backend("torch"):
                torch_run = loss_and_grads(model, ids)
            torch_calls = counts.take()
            with backend("auto"):
                kernel_run = loss_and_grads(model, ids)
            calls = counts.take()
            row = parity_verdict(truth, torch_run, kernel_run, torch_calls, calls, EXPECTED_KERNELS[(kind, two_phase)],
                                 ERROR_FLOOR[dtype])
            rec.set(name, row)
            e_kernels, e_torch = row["kernels_vs_fp64"], row["torch_vs_fp64"]
            print(f"  {name}: grads vs fp64 kernels {e_kernels['grad']:.2e} torch {e_torch['grad']:.2e}, "
                  f"loss {e_kernels['loss']:.2e} / {e_torch['loss']:.2e}; {'PASS' if row['passed'] else 'FAIL'}",
                  flush=True)
            del reference, model
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            rec.error(name, exc)


def greedy_dynamic(call, prompt: torch.Tensor, steps: int, device: torch.device) -> dict:
    """Prefill, then `steps` greedy tokens with a DynamicCache; the last position's logits of every call."""
    logits, times = [], []
    with torch.no_grad():
        out = call(prompt, use_cache=True, logits_to_keep=1)
        cache = out.cache
        for _ in range(steps):
            logits.append(out.logits[:, -1].float())
            token = logits[-1].argmax(-1, keepdim=True)
            sync(device)
            start = time.perf_counter()
            out = call(token, cache=cache, use_cache=True, logits_to_keep=1)
            sync(device)
            times.append(time.perf_counter() - start)
    return {"logits": torch.cat(logits), "seconds": times}


def greedy_static(call, model, prompt: torch.Tensor, steps: int, device: torch.device, graph: bool,
                  prefill_call=None) -> dict:
    """Prefill (by `prefill_call`, default `call`), then `steps` greedy tokens by `call` with a StaticCache and static
    input buffers; with `graph` (CUDA only) the decode step is captured once in a CUDA graph and replayed, the token
    and position copied into its buffers."""
    from transformers import StaticCache

    length = prompt.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 1)
    logits, times = [], []
    with torch.no_grad():
        out = (prefill_call or call)(prompt, cache=cache, cache_position=torch.arange(length, device=device),
                                     use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].float()
        token = first.argmax(-1, keepdim=True).clone()
        position = torch.tensor([length], device=device)

        def step() -> torch.Tensor:
            return call(token, cache=cache, cache_position=position, use_cache=True, logits_to_keep=1).logits[:, -1]

        replay = step
        if graph:
            # warm-up and capture compute the first decode step (the same token at the same position: idempotent)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                static_logits = step()
            print("  decode step captured in a CUDA graph", flush=True)

            def graphed() -> torch.Tensor:
                captured.replay()
                return static_logits

            replay = graphed

        logits.append(first)
        for i in range(steps):
            if i:
                token.copy_(logits[-1].argmax(-1, keepdim=True))
                position.fill_(length + i)
            sync(device)
            start = time.perf_counter()
            new = replay().float().clone()
            sync(device)
            times.append(time.perf_counter() - start)
            logits.append(new)
    return {"logits": torch.cat(logits[:-1]), "seconds": times, "captured": graph}


def stage_decode(rec: Recorder, sizes: Sizes, device: torch.device, counts: KernelCounts) -> None:
    """Greedy tokens and per-step logits of each variant against the torch path (same model, fp32)."""
    model = build("block", sizes.decode, device, torch.float32, sizes.decode_two_phase).eval()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, sizes.decode.vocab, (1, sizes.prompt), generator=gen).to(device)
    steps = sizes.new_tokens
    with backend("torch"):
        ref = greedy_dynamic(model, prompt, steps, device)
    counts.take()
    ref_tokens = ref["logits"].argmax(-1)
    rec.set("reference", {"tokens": ref_tokens.tolist(), "ms_per_token": 1e3 * statistics.median(ref["seconds"])})
    compiled = torch.compile(model, backend=sizes.compile_backend)
    variants = {
        "triton eager": lambda: greedy_dynamic(model, prompt, steps, device),
        f"triton torch.compile ({sizes.compile_backend})":
            lambda: greedy_static(compiled, model, prompt, steps, device, graph=False,
                                  prefill_call=compiled if sizes.compile_prefill else model),
        "triton cuda graph" if device.type == "cuda" else "triton static buffers (smoke: not captured)":
            lambda: greedy_static(model, model, prompt, steps, device, graph=device.type == "cuda"),
    }
    for name, run in variants.items():
        try:
            started = time.perf_counter()
            with backend("auto"):
                got = run()
            calls = counts.take()
            tokens = got["logits"].argmax(-1)
            err = relative_error(got["logits"], ref["logits"])
            same = torch.equal(tokens, ref_tokens)
            routed = calls.get("bank_aggregate", 0) > 0
            passed = same and err <= 1e-4 and routed
            ms = 1e3 * statistics.median(got["seconds"])
            rec.set(name, {"passed": passed, "tokens_equal": same, "logits_rel_err": err, "kernel_calls": calls,
                           "ms_per_token": ms, "seconds": time.perf_counter() - started,
                           "captured": got.get("captured", False)})
            print(f"  {name}: tokens {'equal' if same else 'DIFFER'}, logits {err:.2e}, {ms:.2f} ms/token; "
                  f"{'PASS' if passed else 'FAIL'}", flush=True)
        except Exception as exc:  # noqa: BLE001
            rec.error(name, exc)  # for the graph variant: the capture's own error (what torch and Triton allow)


MEMORY_KINDS = [("standard", "standard", None), ("block", "block", None), ("block one-shot", "block", False),
                ("block two-phase", "block", True), ("full", "full", None)]


def stage_memory(rec: Recorder, sizes: Sizes, device: torch.device, counts: KernelCounts) -> None:
    """Per kind: peak allocated memory of one forward + backward above what was allocated before (parameters),
    and the bytes autograd saves for it (benchmarks/activation_memory.py's count)."""
    from activation_memory import saved_tensors

    size = sizes.big
    ids = torch.randint(0, size.vocab, (1, sizes.big_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    for name, kind, two_phase in MEMORY_KINDS:
        try:
            model = build(kind, size, device, torch.bfloat16, two_phase, fast_norms=True).train()
            with backend("auto"):
                saved = saved_tensors(model, ids, size.vocab)["saved_bytes"]
                model.zero_grad(set_to_none=True)
                row = {"saved_MiB": saved / MIB}
                if device.type == "cuda":
                    sync(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    model(ids, labels=ids).loss.backward()
                    sync(device)
                    row["peak_above_params_MiB"] = (torch.cuda.max_memory_allocated(device) - before) / MIB
            row["kernel_calls"] = counts.take()
            rec.set(name, row)
            print(f"  {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.endswith("MiB")), flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            rec.error(name, exc)
    standard = rec.data.get("standard", {})
    for row in rec.data.values():
        for key, ratio in (("saved_MiB", "saved_x_standard"), ("peak_above_params_MiB", "peak_x_standard")):
            if key in standard and key in row:
                row[ratio] = row[key] / standard[key]
    rec.set("standard", standard)


def stage_timing(rec: Recorder, sizes: Sizes, device: torch.device, counts: KernelCounts) -> None:
    """Time of a training step (forward, backward, AdamW), a prefill and a decode step of Block and Full over the
    standard model's, timed round-robin in this process (attnres.bench)."""
    from attnres.bench.models import decode_step, prefill, training_step
    from attnres.bench.timing import median_times

    size, gen = sizes.big, torch.Generator().manual_seed(0)
    kinds = ("standard", "block", "full")
    models = {kind: build(kind, size, device, torch.bfloat16, fast_norms=True) for kind in kinds}
    ids = torch.randint(0, size.vocab, (1, sizes.big_tokens), generator=gen).to(device)
    context = torch.randint(0, size.vocab, (1, sizes.context), generator=gen).to(device)
    token = torch.randint(0, size.vocab, (1, 1), generator=gen).to(device)
    cases = {
        "train": (lambda m: training_step(m, ids), sizes.repeats),
        "prefill": (lambda m: prefill(m, ids), sizes.repeats),
        "decode": (lambda m: decode_step(m, context, token), sizes.decode_repeats),
    }
    with backend("auto"):
        for case, (make, repeats) in cases.items():
            try:
                seconds = median_times({k: make(m) for k, m in models.items()}, repeats, sizes.warmup, device)
                row = {"ms": {k: 1e3 * s for k, s in seconds.items()},
                       "ratio": {k: s / seconds["standard"] for k, s in seconds.items()}}
                rec.set(case, row)
                print(f"  {case}: block {row['ratio']['block']:.3f}, full {row['ratio']['full']:.3f} "
                      f"(standard {row['ms']['standard']:.2f} ms)", flush=True)
            except Exception as exc:  # noqa: BLE001
                rec.error(case, exc)
    rec.set("kernel_calls", counts.take())


def stage_op_hbm(rec: Recorder, sizes: Sizes, device: torch.device, smoke: bool, seconds: float) -> None:
    """benchmarks/gpu_bench.py's cases: the K3 aggregation shape with fla first, then the others while time is left."""
    import gpu_bench

    args = gpu_bench.parse_args(["--smoke"] if smoke else [])
    budget = gpu_bench.Budget(seconds)
    fla = fla_status()
    have_fla = not fla.startswith("not importable")
    rec.set("fla", fla)
    copy_gbps = gpu_bench.copy_bandwidth_gbps(device, smoke)
    rec.set("copy_gbps", copy_gbps)
    rec.set("peak_tbs", args.peak_tbs)
    rows: list = []
    shapes = gpu_bench.SMOKE_SHAPES if smoke else gpu_bench.SHAPES
    bank_shapes = gpu_bench.SMOKE_BANK_SHAPES if smoke else gpu_bench.BANK_SHAPES
    merge_shapes = gpu_bench.SMOKE_MERGE_SHAPES if smoke else gpu_bench.MERGE_SHAPES
    plan = [(gpu_bench.run_shape, shapes[0], (have_fla, budget))]
    plan += [(gpu_bench.run_bank_shape, s, ()) for s in bank_shapes]
    plan += [(gpu_bench.run_merge_shape, s, ()) for s in merge_shapes]
    plan += [(gpu_bench.run_shape, s, (have_fla, budget)) for s in shapes[1:]]
    if smoke:  # one case of each kind: the interpreter takes a few seconds a case
        plan = plan[:3]
    for run, shape, extra in plan:
        if budget.left() <= 0:
            break
        print(f"  {shape.name}:", flush=True)
        try:  # one case's failure is recorded, the others still run
            run(shape, args, device, *extra, rows) if extra else run(shape, args, device, rows)
        except Exception as exc:  # noqa: BLE001
            rec.error(shape.name, exc)
        rec.set("rows", [dataclasses.asdict(r) for r in gpu_bench.of_copy(rows, copy_gbps)])
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- the parent: runs each stage in a child, merges, reports ---------------------------------------------------------


def child(stage: str, path: Path, smoke: bool, seconds: float) -> None:
    """Body of a stage's child process: exit 0 when the stage ran without an error, 1 otherwise."""
    rec = Recorder(path)
    try:
        sizes, device = (SMOKE_SIZES, torch.device("cpu")) if smoke else (GPU_SIZES, torch.device("cuda"))
        if stage == "env":
            stage_env(rec, smoke)
        elif stage == "op_hbm":
            stage_op_hbm(rec, sizes, device, smoke, seconds - 15)
        else:
            counts = KernelCounts(smoke)
            {"parity": stage_parity, "decode": stage_decode, "memory": stage_memory, "timing": stage_timing}[stage](
                rec, sizes, device, counts)
    except Exception as exc:  # noqa: BLE001 - reported in the stage's JSON
        rec.error("stage", exc)
    os._exit(1 if rec.errors else 0)  # no atexit handlers of the parent's libraries in a forked child


def run_op_tests(seconds: float, log: Path) -> dict:
    """The kernel tests on the GPU, their whole output in `log` as it comes. One config per kernel: autotuning each of
    the dozens of kernel variants they compile would not fit the stage."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *OP_TESTS]
    env = {**os.environ, SINGLE_CONFIG_ENV: "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
    lines = log.read_text(errors="replace").strip().splitlines()
    print("\n".join(lines[-15:]), flush=True)
    result = {"returncode": returncode, "summary": lines[-1] if lines else "", "log": str(log),
              "tail": "\n".join(lines[-40:])[-3000:]}
    status = "timeout" if returncode is None else "ok" if returncode == 0 else "failed"
    return {"status": status, "result": result}


def process_context(smoke: bool):
    """How stage processes start. On a GPU machine from a fork server: a process that imported torch, transformers and
    attnres but never touched CUDA, so no child inherits a CUDA state (CUDA does not survive a fork, and a library's
    `torch.cuda.is_available()` at import initialises the driver). In --smoke, forks of this process: no CUDA, and no
    second interpreter to start."""
    if smoke:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "attnres.models", "attnres.bench.models"])
    return context


def run_stage(stage: str, seconds: float, smoke: bool, workdir: Path) -> dict:
    if stage == "op_tests":
        if smoke:
            return {"status": "skipped", "result": {"why": "the CPU suite runs these kernel tests interpreted"}}
        return run_op_tests(seconds, workdir / "op_tests.log")
    path = workdir / f"{stage}.json"
    path.unlink(missing_ok=True)  # a file left by an earlier run is not this run's result
    proc = process_context(smoke).Process(target=child, args=(stage, path, smoke, seconds))
    proc.start()
    proc.join(seconds)
    timed_out = proc.is_alive()
    if timed_out:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    got = json.loads(path.read_text()) if path.exists() else {"result": {}, "errors": {}}
    status = "timeout" if timed_out else "ok" if proc.exitcode == 0 else "failed"
    if status == "failed" and not got["errors"]:
        got["errors"]["stage"] = f"child exited with {proc.exitcode} (killed by a signal if negative)"
    return {"status": status, **got}


def checks(stages: dict) -> list[dict]:
    """Every pass/fail check the stages made, flattened."""
    found = []
    for stage in ("parity", "decode"):
        for name, row in stages.get(stage, {}).get("result", {}).items():
            if isinstance(row, dict) and "passed" in row:
                found.append({"stage": stage, "case": name, "passed": row["passed"]})
    return found


def targets(stages: dict) -> list[dict]:
    """The targets, from what was measured (absent where the stage did not measure it)."""
    out = []
    rows = stages.get("op_hbm", {}).get("result", {}).get("rows", [])
    k3 = [r for r in rows if r["shape"] == rows[0]["shape"]] if rows else []
    by = {(r["impl"], r["direction"]): r for r in k3}
    if ("attnres triton", "fwd") in by:
        value = by[("attnres triton", "fwd")]["of_peak"]
        met = value >= TARGETS["op fwd of HBM peak"]
        out.append({"target": "op fwd of HBM peak >= 0.85", "value": value, "met": met})
    peer = next((impl for impl, _ in by if impl.startswith("fla")), None)
    if peer and ("attnres triton", "bwd") in by:
        ours = by[("attnres triton", "fwd")]["ms"] + by[("attnres triton", "bwd")]["ms"]
        theirs = by[(peer, "fwd")]["ms"] + by[(peer, "bwd")]["ms"]
        out.append({"target": f"op fwd+bwd / {peer} <= 1", "value": ours / theirs, "met": ours <= theirs})
    timing = stages.get("timing", {}).get("result", {})
    for case, key in (("train", "train block/standard"), ("decode", "decode block/standard")):
        if case in timing:
            value = timing[case]["ratio"]["block"]
            out.append({"target": f"{key} <= {TARGETS[key]}", "value": value, "met": value <= TARGETS[key]})
    return out


def print_table(report: dict) -> None:
    print(f"\n{'stage':<10}{'status':<9}{'s':>6}  figures")
    for name, stage in report["stages"].items():
        print(f"{name:<10}{stage['status']:<9}{stage.get('seconds', 0):>6.0f}  {headline(name, stage)}")
        for key, err in stage.get("errors", {}).items():
            print(f"{'':<27}error in {key}: {err[:160]}")
    for c in report["checks"]:
        print(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['stage']}: {c['case']}")
    for t in report["targets"]:
        print(f"  target {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'NOT met'})"
              + (" [smoke: not a measurement]" if report["smoke"] else ""))


def headline(name: str, stage: dict) -> str:
    r = stage.get("result", {})
    if name == "env":
        return f"{r.get('device')}; torch {r.get('torch')}, triton {r.get('triton')}, fla {r.get('fla')}"
    if name == "op_tests":
        return r.get("summary") or r.get("why", "")
    if name == "memory":
        return "; ".join(f"{k} {v.get('peak_x_standard', v.get('saved_x_standard', 1.0)):.2f}x"
                         for k, v in r.items() if isinstance(v, dict))
    if name == "timing":
        return "; ".join(f"{case} block {v['ratio']['block']:.3f} full {v['ratio']['full']:.3f}"
                         for case, v in r.items() if isinstance(v, dict) and "ratio" in v)
    if name == "op_hbm":
        return f"copy {r.get('copy_gbps', 0):.0f} GB/s, {len(r.get('rows', []))} rows"
    passed = [row["passed"] for row in r.values() if isinstance(row, dict) and "passed" in row]
    return f"{sum(passed)}/{len(passed)} cases pass"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--deadline", type=float, default=440.0, help="seconds for all stages (default: %(default)s)")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="stages to run (default: all)")
    p.add_argument("--json", type=Path, default=ROOT / "runs" / "gpu_check.json", help="report (default: %(default)s)")
    args = p.parse_args(argv)
    if args.deadline <= 0:
        p.error(f"--deadline: expected a positive number of seconds, got {args.deadline}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke needs TRITON_INTERPRET=1 in the environment (read when triton is imported)", file=sys.stderr)
        return 2
    end = time.monotonic() + args.deadline
    workdir = args.json.parent / f"{args.json.stem}.stages"
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"smoke": args.smoke, "deadline_s": args.deadline, "stages": {}}
    stages = [s for s in STAGES if s in args.stages]
    for i, stage in enumerate(stages):
        reserve = sum(LIMITS[s][1] for s in stages[i + 1 :])
        most, least = LIMITS[stage]
        seconds = end - time.monotonic() - reserve
        seconds = seconds if most is None else min(most, seconds)
        if seconds < least:
            report["stages"][stage] = {"status": "skipped", "result": {"why": f"{seconds:.0f} s of the deadline left"}}
            continue
        print(f"\n=== {stage} (at most {seconds:.0f} s)", flush=True)
        started = time.monotonic()
        result = run_stage(stage, seconds, args.smoke, workdir)
        result["seconds"], result["limit_s"] = time.monotonic() - started, seconds
        report["stages"][stage] = result
        report["checks"], report["targets"] = checks(report["stages"]), targets(report["stages"])
        atomic_write_text(args.json, json.dumps(report, indent=1, default=str))
        # now in the report: the GPU machine returns at most 8 files, so only a stage under way keeps its own
        (workdir / f"{stage}.json").unlink(missing_ok=True)
        if stage == "env" and result["status"] != "ok":
            print("the environment stage failed: no further stage can run")
            break
    report["checks"], report["targets"] = checks(report["stages"]), targets(report["stages"])
    atomic_write_text(args.json, json.dumps(report, indent=1, default=str))
    print_table(report)
    print(f"wrote {args.json}")
    bad = [s for s, r in report["stages"].items() if r["status"] not in ("ok", "skipped")]
    return 1 if bad or not all(c["passed"] for c in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
