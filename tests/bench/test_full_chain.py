"""benchmarks/full_chain.py: its record, and the switch it flips around the unchained steps only."""

from __future__ import annotations

import json
import os

from attnres.models.wiring import FULL_CHAIN_ENV
from benchmarks import full_chain


def test_the_unchained_step_runs_with_the_switch_off_and_restores_it():
    seen = []
    full_chain.unchained(lambda: seen.append(os.environ.get(FULL_CHAIN_ENV)))()
    assert seen == ["0"] and FULL_CHAIN_ENV not in os.environ


def test_the_record_times_the_three_steps_at_both_sizes(tmp_path):
    out = tmp_path / "full_chain.json"
    full_chain.main(["--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.full_chain")
    [results] = record["rounds"]
    assert set(results) == {"16x128", "1x4"}
    for size in results.values():
        assert set(size["ms"]) == {"standard", "full", "full unchained"}
        assert all(ms > 0 for ms in size["ms"].values())
        assert size["tokens_per_s_vs_standard"]["standard"] == 1.0
