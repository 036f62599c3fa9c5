"""`train(config) -> RunResult`: one training run, in-process, from data to checkpoints.

The run folder (see `attnres.training.run_folder`) holds `config.json`, `log.jsonl` (see
`attnres.training.logs`), `checkpoints/` and, once the last step is done, `final/`: the model and its tokenizer as a
standard transformers folder (`AutoModelForCausalLM.from_pretrained(run_dir / "final")` after `import attnres`).
A resumed run (`resume=True`) restores the weights, the optimizer, the step, the data sampler's generator and the
RNG state from the latest checkpoint, so it ends with the same parameters, bit for bit, as a run that was never
stopped. A WSD branch (`branch_from=RUN/checkpoints/step-N`, `schedule="wsd"`) starts the same way from a checkpoint
of a longer WSD run with the same settings, taken before its decay (see `run_folder.branch_source`): it ends with the
parameters of a run of its own `steps` trained from scratch, at the cost of its decay steps only.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from attnres.distributed.ranks import (
    RankFailed, barrier, end_ranks, gather_on_main, init_ranks, local_device, lost_rank_message, on_main,
)
from attnres.distributed.materialize import materialize
from attnres.distributed.mesh import build_mesh, memory_line
from attnres.training.checkpoint import (
    latest_checkpoint, load_checkpoint, load_sharded_optimizer, save_checkpoint, save_sharded_checkpoint,
)
from attnres.training.config import TrainConfig
from attnres.training.data import WindowSampler, check_fits, eval_batches, load_tokenizer, read_corpus, tokenize_and_split
from attnres.training.init_from import load_init_from
from attnres.training.logs import RunLog, read_log
from attnres.training.optim import build_optimizer, lr_factor, set_lr
from attnres.training.run_folder import CHECKPOINTS, branch_source, describe_run, prepare_run_dir, save_final
from attnres.training.steps import check_settings, training_steps


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or inf; the weights of that step were not updated."""

    def __init__(self, step: int, what: str, value: float | str, checkpoint: Path | None):
        self.step, self.checkpoint = step, checkpoint
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}. The run stopped before updating the weights; "
            f"{kept}. Try a lower lr, a longer warmup or grad_clip, then resume or restart."
        )


@dataclass
class RunResult:
    run_dir: Path
    steps: int  # optimizer steps completed
    final_val_loss: float  # nats per token on the fixed validation batches, at the last step
    final_train_loss: float  # mean training loss over the last log interval
    num_params: int
    tokens_per_s: float  # training throughput of this invocation (evaluation and checkpoints excluded)
    val_history: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss) of this invocation
    model: nn.Module | None = field(default=None, repr=False)


def build_model(config: TrainConfig, vocab_size: int, device: torch.device | str = "cpu") -> nn.Module:
    """The `AttnResForCausalLM` the config describes (on the `config.base` family's own modules), built on the meta
    device and initialised on `device` from `config.seed` (`attnres.distributed.materialize`); `device="meta"` leaves
    it there, for a caller that parallelizes it first. The sizes apply to the family's fields of those names; its
    other `*intermediate_size` fields (MoE experts) get the MLP size and its `head_dim` the hidden size over the
    heads, unless `base_config` sets them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from attnres.models import AttnResConfig, AttnResForCausalLM

    family_fields = CONFIG_MAPPING[config.base]().to_dict()
    sizes = {k: config.ffn_size for k in family_fields if k.endswith("intermediate_size")}
    if "head_dim" in family_fields:
        sizes["head_dim"] = config.dim // config.heads
    family = dict(
        sizes,
        vocab_size=vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads or config.heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    family.update(config.base_config)  # the family's own fields, as given: they override the sizes above
    model_config = AttnResConfig(
        base_model_type=config.base,
        **family,
        residual=config.residual,
        attn_res_block_size=config.block_size,
        attn_res_rescale_mixture=config.rescale_mixture,
    )
    with torch.device("meta"):
        model = AttnResForCausalLM(model_config)
    model.plan_layers()
    if config.activation_checkpointing:
        model.activation_checkpointing_enable()
    return model if device == "meta" else materialize(model, device, config.seed)


def train(config: TrainConfig, model: nn.Module | None = None) -> RunResult:
    """Train `model` (default: `build_model(config, ...)`) as `config` says; see the module docstring.

    `model` is any module whose `forward(input_ids=[B, T], labels=[B, T])` returns an object with `.loss` (the
    mean next-token loss, labels shifted inside, as in transformers). Every setting and the data are checked
    before anything is written: bad ones raise ValueError naming the setting. A loss or gradient norm that
    becomes NaN or inf raises `TrainingDiverged`.

    With `config.parallel` "ddp", "fsdp" or "pipeline" every rank of the process group (started from torchrun's
    environment when none is) calls `train`; see `attnres.training.steps`. A lost rank raises `RankFailed`.
    """
    device = _resolve_device(config.device)
    ranks = init_ranks(config.parallel != "none" or config.parallel_dims_given, device, config.dist_timeout)
    try:
        return _train(config, model, ranks, local_device(device))
    except RuntimeError as e:
        if not ranks.distributed or isinstance(e, TrainingDiverged):
            raise
        if isinstance(e, (RankFailed, dist.DistError)):
            message = str(e) if isinstance(e, RankFailed) else lost_rank_message("training", e)
            raise RankFailed(f"{message} Resume from the last checkpoint with --resume.") from e
        raise
    finally:
        end_ranks(ranks)


def _train(config: TrainConfig, model: nn.Module | None, ranks, device: torch.device) -> RunResult:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if device.type == "cpu" and not config.keep_subnormals:
        torch.set_flush_denormal(True)
    autocast_dtype = _resolve_autocast(config.autocast, device)
    run_dir = Path(config.out or config.default_out())
    if model is not None and config.init_from is not None:
        raise ValueError("init_from: the run was given a model too; give either a model or init_from")
    pretrained = None
    if config.init_from is not None:  # a pretrained folder, converted exactly, with its own tokenizer; on the meta
        model, tokenizer, pretrained = load_init_from(config)  # device: each rank loads what it holds, once parallelized
        torch.manual_seed(config.seed)
    else:
        tokenizer = load_tokenizer(config.tokenizer, config.allow_download)
        if model is None:  # on the meta device: each rank allocates only what it holds, once parallelized
            model = build_model(config, tokenizer.vocab_size, device="meta")
        torch.manual_seed(config.seed)
    corpus = read_corpus(config.data, config.max_bytes)
    splits = tokenize_and_split(corpus, tokenizer, config.val_fraction)
    check_fits(splits, config.seq_len, config.val_fraction)
    dims = config.parallel_dims(ranks.world_size)
    check_settings(config, dims)
    data = {"corpus": corpus.description, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
            "train_tokens": len(splits.train), "val_tokens": len(splits.val), "fingerprint": splits.fingerprint}
    run_info = describe_run(config, model, data, device, autocast_dtype)
    branch = branch_source(config, run_info) if config.branch_from is not None else None
    on_main(lambda: prepare_run_dir(run_dir, config, run_info), ranks)

    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model.to(device)
    model.train()
    mesh = build_mesh(dims, device.type) if ranks.distributed else None
    checkpoints = run_dir / CHECKPOINTS
    last = (latest_checkpoint(checkpoints) if config.resume else None) or branch  # its own checkpoint comes first

    # TP and FSDP shard `model`, PP cuts it, then each rank allocates (or loads) what it holds; DDP wraps it. A run
    # that resumes from a checkpoint reads its weights from there only, not the init_from folder first
    def allocate(m: nn.Module) -> None:
        if pretrained is not None and last is None:
            pretrained.load(m, device, config.seed, progress=config.progress and ranks.is_main)
        elif on_meta:
            materialize(m, device, config.seed)

    steps = training_steps(model, config, ranks, dims, mesh, allocate)
    state = load_checkpoint(last, model, stage_only=dims.pp > 1) if last is not None else None  # what it holds
    optimizer = build_optimizer(
        model, lr=config.lr, weight_decay=config.weight_decay, attn_res_lr_mult=config.attn_res_lr_mult,
        attn_res_weight_decay=config.attn_res_weight_decay,
    )
    sampler = WindowSampler(splits.train, config.seq_len, config.batch_size, config.seed)
    val_batches = [b.to(device) for b in eval_batches(splits.val, config.seq_len, config.batch_size, config.eval_batches)]
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    log = RunLog(run_dir) if ranks.is_main else _NoLog()

    step = 0
    if state is not None:
        if "optimizer" in state:
            steps.load_optimizer_state(optimizer, state["optimizer"])
        else:  # a distributed run's sharded checkpoint: whatever this rank now holds of it
            load_sharded_optimizer(last, model, optimizer)
        sampler.load_state_dict(state["sampler"])
        _set_rng_state(state["rng"])
        step = state["step"]
    if config.resume:
        log.truncate_after(step if last is not None else -1)  # the steps past the checkpoint are done again

    def evaluate() -> tuple[int, float]:
        val_loss = steps.evaluate(val_batches, autocast)
        log.write("eval", step=step, val_loss=val_loss)
        return step, val_loss

    end = min(config.steps, config.stop_after or config.steps)
    first_step = step
    val_history = [evaluate()] if step == 0 else []
    tokens_per_step = config.batch_size * config.seq_len
    window, train_time, train_loss, postfix = _Window(), 0.0, math.nan, {}
    start = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, disable=not (config.progress and ranks.is_main), unit="step",
               dynamic_ncols=True)
    try:
        while step < end:
            t0 = time.perf_counter()
            lr = set_lr(optimizer, lr_factor(
                step, steps=config.steps, warmup=config.warmup_steps, schedule=config.schedule,
                min_lr_ratio=config.min_lr_ratio, decay_fraction=config.decay_fraction,
            ))
            loss_value, norm_value = steps.run(sampler.next_batch().to(device), autocast, config.grad_clip or math.inf)
            for what, value in (("loss", loss_value), ("gradient norm", norm_value)):
                if not math.isfinite(value):  # checked before optimizer.step(): the weights stay those of `step`
                    log.write("diverged", step=step + 1, loss=loss_value, grad_norm=norm_value)
                    raise TrainingDiverged(step + 1, what, value, latest_checkpoint(checkpoints))
            optimizer.step()
            if step == first_step:  # what each rank holds once gradients and optimizer state exist
                for line in gather_on_main(memory_line(ranks.rank, model, optimizer), ranks):
                    log.write("memory", step=step + 1, **line)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            seconds = time.perf_counter() - t0
            train_time += seconds
            window.add(loss_value, norm_value, seconds)

            if step % config.log_interval == 0 or step == end:
                train_loss, grad_norm_mean, tokens_per_s = window.flush(tokens_per_step)
                log.write("train", step=step, loss=train_loss, lr=lr, grad_norm=grad_norm_mean,
                          tokens_per_s=tokens_per_s, elapsed_s=time.perf_counter() - start)
                postfix.update(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if step % config.eval_interval == 0 or step == end:
                val_history.append(evaluate())
                postfix["val"] = f"{val_history[-1][1]:.3f}"
            if step % config.checkpoint_interval == 0 or step == end:
                _check_finite_weights(model, step, latest_checkpoint(checkpoints))  # only good weights are saved
                state = {"sampler": sampler.state_dict(), "rng": _rng_state()}
                if ranks.distributed:  # each rank saves what it holds: nothing is gathered
                    save_sharded_checkpoint(checkpoints, step, model, optimizer, state, config.keep_checkpoints, ranks)
                else:
                    state["optimizer"] = steps.optimizer_state(optimizer)
                    save_checkpoint(checkpoints, step, model, state, keep=config.keep_checkpoints)
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
    finally:
        bar.close()
    if step == config.steps and hasattr(model, "save_pretrained"):  # complete: model and tokenizer as final/
        weights = steps.final_weights()  # sharded, staged: gathered whole on rank 0
        full = None if weights is model else weights
        on_main(lambda: save_final(run_dir, model, tokenizer, config.seq_len, state_dict=full), ranks)
    barrier(ranks, "finishing")  # the last checkpoint and final/ are complete before any rank returns

    if not val_history:  # resumed a run that had already reached its end: report its last evaluation
        val_history = [(r["step"], r["val_loss"]) for r in read_log(run_dir, "eval") if r["step"] == step]
    steps_run = step - first_step
    return RunResult(
        run_dir=run_dir,
        steps=step,
        final_val_loss=val_history[-1][1] if val_history else math.nan,
        final_train_loss=train_loss,
        num_params=run_info["num_params"],
        tokens_per_s=steps_run * tokens_per_step / train_time if steps_run else math.nan,
        val_history=val_history,
        model=model,
    )


def _check_finite_weights(model: nn.Module, step: int, checkpoint: Path | None) -> None:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise TrainingDiverged(step, f"parameter {name}", "not finite", checkpoint)


class _NoLog:
    """The log of ranks other than 0: they write nothing."""

    def write(self, kind: str, **fields) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass


class _Window:
    """Sums over one log interval."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.losses, self.norms, self.seconds = [], [], 0.0

    def add(self, loss: float, grad_norm: float, seconds: float) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.seconds += seconds

    def flush(self, tokens_per_step: int) -> tuple[float, float, float]:
        """(mean loss, mean gradient norm, tokens per second) of the interval; starts the next one."""
        n = len(self.losses)
        result = sum(self.losses) / n, sum(self.norms) / n, n * tokens_per_step / self.seconds
        self.reset()
        return result


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _resolve_autocast(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 for "bf16", and for "auto" on a CUDA device that has it. On CPU "auto" is off: without native bf16
    matrix units (AVX2 here) bf16 autocast measured several times slower than fp32."""
    if name == "bf16":
        return torch.bfloat16
    if name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
