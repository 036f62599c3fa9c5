"""`TrainConfig`: every setting of a training run, checked when it is made."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from attnres.distributed.mesh import PARALLEL
from attnres.distributed.ranks import DEFAULT_TIMEOUT_S
from attnres.distributed.mesh import ParallelDims
from attnres.distributed.pipeline import SCHEDULES as PP_SCHEDULES
from attnres.layers.kinds import DEFAULT_BLOCK_SIZE, RESIDUAL_KINDS, STANDARD
from attnres.run_layout import FINAL
from attnres.training.optim import SCHEDULES

AUTOCAST = ("auto", "off", "bf16")
DEVICES = ("auto", "cpu", "cuda")

# settings that may change when a run is resumed: they do not change the parameters it ends with
RESUMABLE_CHANGES = frozenset(
    {"resume", "stop_after", "progress", "log_interval", "eval_interval", "checkpoint_interval", "keep_checkpoints",
     "allow_download", "out", "overwrite", "device", "threads", "keep_subnormals", "dist_timeout",
     # the mesh: a run resumes on another one (checkpoints reshard), with the same curve up to the sums' rounding
     "parallel", "pp", "dp_replicate", "dp_shard", "tp", "pp_schedule", "virtual_stages", "microbatches"}
)


@dataclass
class TrainConfig:
    """One training run. Field names match the `attnres train` flags (`seq_len` is `--seq-len`)."""

    # data
    data: str | list[str] = "stdlib"  # "stdlib", text files / folders, or "hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]"
    max_bytes: int = 16 * 2**20  # bytes of text read from `data`
    tokenizer: str = "bytes"  # "bytes" (vocab 256) or a Hugging Face tokenizer name / folder
    allow_download: bool = False  # let the Hugging Face tokenizer be fetched from the Hub
    val_fraction: float = 0.05  # the last part of the token stream, held out for validation
    # model
    base: str = "llama"  # the transformers decoder family (its model_type) the model is built from
    base_config: dict = field(default_factory=dict)  # more fields of the family's config (e.g. num_experts)
    residual: str = "block"
    block_size: int = DEFAULT_BLOCK_SIZE  # Block AttnRes block size, in decoder layers
    rescale_mixture: bool = False  # `attn_res_rescale_mixture` (docs/design.md section 2)
    layers: int = 6
    dim: int = 128
    heads: int = 4
    kv_heads: int | None = None  # None: as many as `heads`
    ffn: int | None = None  # None: 8/3 * dim rounded up to a multiple of 32 (SwiGLU at the size of a 4*dim MLP)
    tie_embeddings: bool = False
    activation_checkpointing: bool = False  # checkpoint whole decoder layers: recomputed in backward (less memory)
    init_from: str | None = None  # a pretrained causal LM folder or Hub name to continue from, converted exactly
    # optimisation
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 600
    lr: float = 3e-3
    warmup: int | None = None  # None: a tenth of the steps
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    decay_fraction: float = 0.2  # WSD: the share of the steps spent decaying
    weight_decay: float = 0.1
    attn_res_lr_mult: float = 0.1  # docs/design.md section 10: at 1.0 the depth softmax saturates and AttnRes loses
    attn_res_weight_decay: float = 0.0
    freeze_base: bool = False  # with init_from: train the AttnRes parameters only
    grad_clip: float = 1.0  # 0 turns clipping off (the norm is still logged)
    seed: int = 0
    autocast: str = "auto"  # "auto": bf16 on CUDA, off on CPU (measured slower there); "off"; "bf16"
    device: str = "auto"
    threads: int | None = None  # CPU threads for torch (torch.set_num_threads, process-wide); None: torch's default
    # on a CPU, subnormal floats are flushed to zero process-wide (torch.set_flush_denormal) unless this is set: x86
    # takes an assist per operation on one, and a depth softmax's tiny weights make them in the sublayers' backward
    keep_subnormals: bool = False
    parallel: str = "none"  # shorthand for one mesh dimension over every rank: "ddp", "fsdp", "tp", "pipeline"
    pp: int = 1  # mesh (under torchrun): pipeline stages; `batch_size` is the global batch
    dp_replicate: int = 1  # mesh: data-parallel replicas (DDP, or HSDP with dp_shard)
    dp_shard: int = -1  # mesh: data-parallel shards (FSDP2); -1: the ranks the other dimensions leave
    tp: int = 1  # mesh: tensor + sequence parallel ranks
    pp_schedule: str = "1f1b"  # pipeline: "gpipe", "1f1b", "interleaved" or "zero-bubble" (virtual_stages >= 2)
    virtual_stages: int = 1  # pipeline: chunks of decoder layers a rank
    microbatches: int | None = None  # pipeline: None: one per stage (ranks x virtual_stages)
    dist_timeout: float = DEFAULT_TIMEOUT_S  # seconds a collective waits for the other ranks before the run fails
    # run folder, logs, checkpoints
    out: str | None = None  # None: runs/<residual>-L<layers>-d<dim>-s<seed>
    resume: bool = False  # continue the run in `out` from its latest checkpoint (start it if there is none)
    overwrite: bool = False  # delete the run already in `out` and start afresh
    stop_after: int | None = None  # end this invocation after this many steps (checkpointed); resume continues
    branch_from: str | None = None  # a checkpoint of a WSD run with these settings but more steps: decay from it
    eval_interval: int = 100
    eval_batches: int = 8
    log_interval: int = 10
    checkpoint_interval: int = 200
    keep_checkpoints: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("max_bytes", "layers", "dim", "heads", "block_size", "seq_len", "batch_size", "steps",
                     "eval_interval", "eval_batches", "log_interval", "checkpoint_interval", "keep_checkpoints",
                     "virtual_stages"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("kv_heads", "ffn", "stop_after", "threads", "microbatches"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.warmup is not None:
            _check_int("warmup", self.warmup, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        _check_choice("residual", self.residual, RESIDUAL_KINDS)
        _check_base(self.base, self.base_config)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("autocast", self.autocast, AUTOCAST)
        _check_choice("device", self.device, DEVICES)
        _check_choice("parallel", self.parallel, PARALLEL)
        for name in ("pp", "dp_replicate", "tp"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("dp_shard", self.dp_shard, minimum=-1)
        if self.dp_shard == 0:
            raise ValueError("dp_shard: expected a positive integer or -1 (the ranks left), got 0")
        if self.parallel != "none" and self.parallel_dims_given:
            raise ValueError(
                f"parallel: {self.parallel!r} is a shorthand for one mesh dimension; give either it or "
                f"--pp/--dp-replicate/--dp-shard/--tp"
            )
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _check_float("dist_timeout", self.dist_timeout, low=0, low_open=True)
        _check_float("lr", self.lr, low=0, low_open=True)
        _check_float("val_fraction", self.val_fraction, low=0, high=1, low_open=True, high_open=True)
        _check_float("min_lr_ratio", self.min_lr_ratio, low=0, high=1)
        _check_float("decay_fraction", self.decay_fraction, low=0, high=1, low_open=True)
        for name in ("weight_decay", "attn_res_lr_mult", "attn_res_weight_decay", "grad_clip"):
            _check_float(name, getattr(self, name), low=0)
        if self.branch_from is not None and self.schedule != "wsd":
            raise ValueError(f"branch_from: expected schedule='wsd' (only WSD runs share a prefix), got {self.schedule!r}")
        if self.init_from is not None:
            _check_init_from(self)
        elif self.freeze_base:
            raise ValueError("freeze_base: expected init_from too (a pretrained base to freeze)")
        if self.resume and self.overwrite:
            raise ValueError("resume, overwrite: expected at most one of them to be set")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup: expected at most steps={self.steps} warm-up steps, got {self.warmup}")
        if not isinstance(self.data, (str, os.PathLike, list, tuple)) or (isinstance(self.data, (list, tuple)) and not self.data):
            raise TypeError(f"data: expected a path, a list of paths, 'stdlib' or 'hf:...', got {self.data!r}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 10

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else -(-8 * self.dim // 3 // 32) * 32

    def default_out(self) -> str:
        if self.init_from is not None:
            source = Path(str(self.init_from))
            name = source.parent.name if source.name == FINAL else source.name
            return os.path.join("runs", f"{self.residual}-from-{name}-s{self.seed}")
        family = "" if self.base == "llama" else f"{self.base}-"
        return os.path.join("runs", f"{family}{self.residual}-L{self.layers}-d{self.dim}-s{self.seed}")

    @property
    def parallel_dims_given(self) -> bool:
        """Whether a mesh dimension is set (a torchrun launch without one runs FSDP2 over every rank)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp) != (1, 1, -1, 1)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh for `world_size` ranks: `parallel`'s one dimension over all of them, or the mesh fields."""
        shorthand = {"ddp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pipeline": "pp"}.get(self.parallel)
        if shorthand is not None:
            return ParallelDims.resolve(world_size, **{"dp_shard": 1, shorthand: world_size})
        return ParallelDims.resolve(world_size, pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                                    tp=self.tp)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# the settings a from-scratch model is built from; with init_from the folder decides them
ARCHITECTURE_FIELDS = ("base", "base_config", "layers", "dim", "heads", "kv_heads", "ffn", "tie_embeddings", "tokenizer")


def _check_init_from(config: TrainConfig) -> None:
    if not isinstance(config.init_from, (str, os.PathLike)) or not str(config.init_from):
        raise TypeError(f"init_from: expected a model folder or a Hub name, got {config.init_from!r}")
    given = [name for name in ARCHITECTURE_FIELDS if getattr(config, name) != _DEFAULTS[name]]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{', '.join(given)}: the model and its tokenizer come from init_from={str(config.init_from)!r}; leave "
            f"{flags} at the default"
        )
    if config.freeze_base and config.residual == STANDARD:
        raise ValueError("freeze_base: expected residual 'block' or 'full' (a standard model has no AttnRes parameters "
                         "to train)")


def _check_base(base: str, base_config: dict) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if base not in CONFIG_MAPPING:
        raise ValueError(f"base: expected a transformers model_type such as 'llama' or 'qwen3_moe', got {base!r}")
    if not isinstance(base_config, dict) or not all(isinstance(k, str) for k in base_config):
        raise ValueError(f"base_config: expected a dict of {base} config fields, got {base_config!r}")


_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
             for f in dataclasses.fields(TrainConfig)}


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


def _check_float(name: str, value, low=None, high=None, low_open=False, high_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    ok = value == value  # NaN fails every range
    if low is not None:
        ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        raise ValueError(f"{name}: expected a number {' and '.join(s for s in (lo, hi) if s)}, got {value}")
