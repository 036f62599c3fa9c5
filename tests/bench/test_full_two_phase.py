"""benchmarks/full_two_phase.py: the two sides compute the same points, and the record covers every layer."""

from __future__ import annotations

import json

import pytest
import torch

from attnres.ops import cpu, merge_prefix
from attnres.ops.two_phase import SoftmaxStats
from benchmarks import full_two_phase
from benchmarks.cpu_kernel_ab import EPS, schedule_inputs


@pytest.mark.parametrize("name", ["tokens", "dim", "layers", "threads", "repeats"])
def test_sizes_must_be_positive(name):
    with pytest.raises(SystemExit):
        full_two_phase.parse_args([f"--{name}", "0"])


def test_phase_one_with_both_queries_gives_both_points_of_a_layer():
    """The premise of the study: the shared rows scored once for the layer's two queries, finished for the
    attention-side point and merged with the attention output for the MLP-side point, are the two one-shot points."""
    assert cpu.available()
    ops = torch.ops.attnres_cpu
    sources, c, norm_weight, _ = schedule_inputs(12, 32, 6)
    norm_weight = norm_weight + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(1))
    cs = torch.stack([c, c.flip(0)])
    r = 5  # layer 2
    m, z, u, _ = ops.depth_stats_fwd(sources[:r], cs, EPS)
    for q, prefix in ((0, None), (1, sources[r])):
        two_phase = merge_prefix(SoftmaxStats(m[q], z[q], u[q]), prefix, cs[q], eps=EPS, out_norm_weight=norm_weight,
                                 out_eps=EPS)
        one_shot = ops.depth_attention_fwd(sources[: r + q], cs[q], norm_weight, EPS, EPS)[0]
        torch.testing.assert_close(two_phase, one_shot)


def test_every_layer_times_both_sides_on_the_same_phases():
    ops = torch.ops.attnres_cpu
    sources, c, norm_weight, grad_out = schedule_inputs(8, 16, 4)
    cases = full_two_phase.layer_cases(ops, sources, torch.stack([c, c]), norm_weight, grad_out, layers=2)
    assert list(cases["one_shot"]) == list(cases["two_phase"]) == ["layer 0 (R=1)", "layer 1 (R=3)"]
    for side in cases.values():
        for calls in side.values():
            for call in calls:
                call()


def test_the_record_has_every_layer_and_the_schedule(tmp_path):
    out = tmp_path / "full_two_phase.json"
    full_two_phase.main(["--tokens", "16", "--dim", "32", "--layers", "2", "--repeats", "2", "--cold", "--out",
                         str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m benchmarks.full_two_phase")
    assert set(record["results"]) == {"layer 0 (R=1)", "layer 1 (R=3)", "schedule"}
    for summary in record["results"].values():
        assert summary["one_shot_ms"]["min"] > 0 and summary["two_phase_ms"]["min"] > 0
        assert summary["two_phase_over_one_shot"]["median"] == pytest.approx(
            summary["two_phase_ms"]["median"] / summary["one_shot_ms"]["median"])
