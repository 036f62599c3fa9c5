"""benchmarks/step_ops.py: per-op profile of the small model's steps, its excess table and its record."""

from __future__ import annotations

import json

import pytest

from benchmarks import step_ops


def test_the_record_has_every_model_and_the_excess_of_block_and_full(tmp_path):
    out = tmp_path / "step_ops.json"
    step_ops.main(["--steps", "2", "--rounds", "1", "--warmup", "0", "--threads", "1", "--batch", "2", "--tokens",
                   "8", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.step_ops")
    assert record["settings"]["batch"] == 2 and record["settings"]["tokens"] == 8
    assert set(record["total_ms"]) == set(record["wall_ms"]) == {"standard", "block", "full"}
    assert all(ms > 0 for ms in record["total_ms"].values())
    assert all(ms > 0 for ms in record["wall_ms"].values())
    assert set(record["excess_ms"]) == {"block", "full"}
    # the point op runs in every model (the standard one's fused norms), Block's points cost more; Full's chained
    # points are an op of their own, which the standard model never runs
    ops = record["per_op"]
    point, chained = "attnres_cpu::point", "attnres_cpu::chained_point"
    assert ops["block"][point]["calls"] > ops["standard"][point]["calls"] > 0
    assert record["excess_ms"]["block"][point] == pytest.approx(ops["block"][point]["ms"] - ops["standard"][point]["ms"])
    assert chained not in ops["standard"] and ops["full"][chained]["calls"] > 0
    assert record["excess_ms"]["full"][chained] == pytest.approx(ops["full"][chained]["ms"])


@pytest.mark.parametrize("flag", ["--batch", "--tokens", "--steps", "--rounds", "--top"])
def test_counts_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        step_ops.main([flag, "0"])
    assert flag in capsys.readouterr().err
