"""What every experiment shares: a JSON ledger of finished runs, one timed training run, and the statistics of a gap.

A study writes its ledger (`docs/<study>.json`) atomically after every finished run, so an interrupted study keeps what
it measured and a rerun of the same command skips the runs already in it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from attnres.analysis.stats import paired_gaps
from attnres.analysis.stats import verdict as stats_verdict
from attnres.atomic import atomic_write_text
from attnres.training import TrainConfig, train
from attnres.training.logs import read_log

# The data and the optimiser every study shares: `attnres compare`'s (the Python standard library's sources, bytes,
# 16 x 128 bytes a step, AdamW with the schedule's peak lr 3e-3).
COMMON = dict(data="stdlib", max_bytes=4 * 2**20, seq_len=128, batch_size=16, lr=3e-3, eval_batches=8, progress=False,
              overwrite=True)

# a validation loss well below the plateau (about 3.0-3.1 nats/byte) where short warm-ups stall: "has started to learn"
LEARNED = 2.5
# the band of validation loss (nats/byte) where the runs slow down after the first fast drop
PLATEAU = (3.2, 2.9)



class Ledger:
    """The runs of one study, kept in a JSON file beside what describes them (`what`, `setup`, `command`: the one
    command that reproduces them all) and the commands that ran parts of it (`invocations`)."""

    def __init__(self, path: str | Path, what: str, setup: dict, module: str, parser: argparse.ArgumentParser,
                 argv: list[str] | None, summarise: Callable[[dict], object]):
        self.path = Path(path)
        saved = json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        self.runs: dict[str, dict] = saved.get("runs", {})
        argv = sys.argv[1:] if argv is None else argv
        self.head = {"what": what, "setup": setup, "command": study_command(module, parser, argv)}
        self.invocation = shlex.join(["python", "-m", module, *argv])
        self.summarise = summarise

    def __contains__(self, name: str) -> bool:
        return name in self.runs

    def add(self, name: str, record: dict) -> None:
        self.runs[name] = record
        self.save()

    def save(self) -> None:
        """Write the ledger, merged with runs other processes of the same study added to the file meanwhile (under
        a lock, so parts of one study, e.g. one model size each, can run side by side)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            saved = json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
            self.runs = {**saved.get("runs", {}), **self.runs}
            data = {**self.head, "invocations": sorted({*saved.get("invocations", []), self.invocation}),
                    "runs": self.runs, "summary": self.summarise(self.runs)}
            atomic_write_text(self.path, json.dumps(data, indent=1) + "\n")


def study_command(module: str, parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """The command that reproduces a whole ledger: `python -m module` with the options of `argv` that change what is
    measured.
    An option whose list is part of its default (`--seeds 1`, `--sizes L12-d64`) only picked part of the grid, and
    the script without it completes the grid, skipping the runs already there: it is left out."""
    given, defaults = vars(parser.parse_args(argv)), vars(parser.parse_args([]))
    words = ["python", "-m", module]
    for dest, value in given.items():
        default = defaults[dest]
        if value == default or (isinstance(value, list) and isinstance(default, list) and set(value) <= set(default)):
            continue
        flag = "--" + dest.replace("_", "-")
        words += [flag] if value is True else [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def timed_run(config: TrainConfig) -> dict:
    """Train `config`; its final validation loss, its curve, and the seconds its training steps took (the sum of the
    logged step times: evaluation and checkpoints excluded; also cumulated by logged step) as well as the wall and CPU
    time of the whole call."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = train(config)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens_per_step = config.batch_size * config.seq_len
    seconds, last, clock = 0.0, None, []
    for row in read_log(result.run_dir, "train"):  # each line covers the steps since the previous one
        last = row["step"] - config.log_interval if last is None else last
        seconds += (row["step"] - last) * tokens_per_step / row["tokens_per_s"]
        last = row["step"]
        clock.append((last, seconds))
    return {
        "steps": result.steps, "tokens": result.steps * tokens_per_step, "val_loss": result.final_val_loss,
        "train_loss": result.final_train_loss, "num_params": result.num_params, "train_s": seconds,
        "train_s_by_step": clock, "wall_s": wall, "cpu_s": cpu,
        "val_curve": [(r["step"], r["val_loss"]) for r in read_log(result.run_dir, "eval")],
    }


def step_times(models: dict[str, tuple], batch, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds of `steps` training steps (forward, backward, `optimizer.step`) of each (model, optimizer) of `models`
    on `batch`, in `rounds` rounds of each model in turn after one warm-up call each (first calls build and select
    kernels): side by side in one process, so a shared machine's changing load reaches every model alike."""

    def seconds(name: str) -> float:
        model, optimizer = models[name]
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in models:
        seconds(name)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name in times:
            times[name].append(seconds(name))
    return times


def steps_to(curve: list[tuple[int, float]], level: float) -> int | None:
    """The first evaluated step whose validation loss is below `level` (None: never)."""
    return next((s for s, v in curve if v < level), None)


def plateau_steps(curve: list[tuple[int, float]]) -> int | None:
    """Steps from the first evaluation below `PLATEAU[0]` to the first below `PLATEAU[1]`: how long the run sat
    on the plateau (to the resolution of the evaluation interval; None: never left it)."""
    into, out = steps_to(curve, PLATEAU[0]), steps_to(curve, PLATEAU[1])
    return None if into is None or out is None else out - into


_READINGS = {
    "below": "AttnRes lower (95% interval below 0)",
    "above": "standard lower (95% interval above 0)",
    "noise": "no measurable difference (95% interval spans 0)",
}


def paired_by_seed(a: dict[int, float], b: dict[int, float]) -> dict:
    """The gaps a - b over the seeds both hold, with their mean and 95% t interval (`paired_gaps`)."""
    return paired_gaps([a[s] - b[s] for s in sorted(a.keys() & b.keys())])


def verdict(stats: dict) -> str:
    """What a gap's interval says (`attnres.analysis.stats.verdict`), in the words of the result pages."""
    if not stats["n"]:
        return "not measured"
    if stats["ci95"] is None:
        return "one seed: no interval"
    return _READINGS[stats_verdict(tuple(stats["ci95"]))]


def progress(name: str, record: dict) -> None:
    print(f"{name}: val {record['val_loss']:.4f}, {record['train_s']:.0f} s training, {record['wall_s']:.0f} s wall",
          flush=True)
