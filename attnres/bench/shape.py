"""What the residual-path benchmarks at one model's shape share (`benchmarks/full_reads.py`,
`benchmarks/full_training.py`): their shape and machine options, SmolLM2-135M's shape by default, and the JSON
record that names the command that wrote it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from attnres.atomic import atomic_write_text

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """--layers, --dim, --dtypes, --threads and --json."""
    p.add_argument("--layers", type=int, default=30, help="decoder layers L (default: %(default)s)")
    p.add_argument("--dim", type=int, default=576, help="hidden size d (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"], help="(default: fp32 bf16)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")


def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Exit with the parser's error for the first of `names` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")


def write_record(path: Path, module: str, argv: list[str] | None, shape: dict, results: list) -> None:
    """The JSON record at `path`, written atomically: the shape, the machine's threads and torch, the command that
    reproduces it (`python -m module` and its arguments) and the results."""
    command = " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])
    record = {**shape, "threads": torch.get_num_threads(), "torch": torch.__version__, "command": command,
              "results": results}
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
