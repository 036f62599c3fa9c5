"""The run log: one JSON object a line in `log.jsonl`.

Line kinds (`"kind"`): `train` (step, loss, lr, grad_norm, tokens_per_s, elapsed_s; loss and grad norm averaged
over the log interval), `eval` (step, val_loss) and `diverged` (step, loss, grad_norm). `step` counts completed
optimizer steps; the `eval` line of step 0 is the untrained model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from attnres.atomic import atomic_write_text
from attnres.run_layout import LOG_FILE



def read_log(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """The records of a run folder's log, in order; only those of `kind` when given."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


class RunLog:
    """Appends records to `log.jsonl`, flushed line by line so a crashed run keeps its history."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOG_FILE

    def write(self, kind: str, **fields) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: a resumed run redoes those steps and logs them again."""
        if not self.path.is_file():
            return
        kept = [r for r in read_log(self.path.parent) if r["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
