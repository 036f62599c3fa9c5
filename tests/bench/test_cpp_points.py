"""benchmarks/cpp_points.py: its record, and the Python points it swaps in around its own steps only."""

from __future__ import annotations

import json

import pytest
import torch

from attnres.ops import backends, cpu
from benchmarks import cpp_points

pytestmark = pytest.mark.skipif(cpu.disabled() or not cpu.available(), reason="CPU kernel unavailable")


def test_the_python_step_selects_backends_without_point_ops_and_restores_them():
    x = torch.empty(2, 8)
    seen = []
    cpp_points.python_points(lambda: seen.append(backends.select_backend(x)))()
    assert seen[0].name == "cpu" and seen[0].point is None and seen[0].chained_point is None
    assert backends.select_backend(x).point is not None


def test_the_record_times_each_model_both_ways_at_both_sizes(tmp_path):
    out = tmp_path / "cpp_points.json"
    cpp_points.main(["--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.cpp_points")
    [results] = record["rounds"]
    assert set(results) == {"16x128", "1x4"}
    kinds = {"standard", "block", "full"}
    for size in results.values():
        assert set(size["ms"]) == kinds | {f"{kind} python points" for kind in kinds}
        assert all(ms > 0 for ms in size["ms"].values())
        for kind in kinds:
            assert size["saved_ms"][kind] == pytest.approx(size["ms"][f"{kind} python points"] - size["ms"][kind])
        assert {variant: ratios["standard"] for variant, ratios in size["tokens_per_s_vs_standard"].items()} == {
            "cpp": 1.0, "python points": 1.0}
