"""Bad input fails before any kernel runs, with a ValueError or TypeError whose message names the argument."""

from __future__ import annotations

import pytest
import torch

from attnres import depth_attention, depth_stats, finish_stats, merge_stats, naive_depth_attention, naive_depth_stats

D = 8


def x(*shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*(shape or (3, D)), dtype=dtype, device=device)


GOOD = {"sources": [x(), x()], "query": x(D)}

# (id, overrides of GOOD and keyword arguments, exception, message pattern that must name the argument)
ATTENTION_CASES = [
    ("empty-sources", {"sources": []}, ValueError, r"^sources: expected at least one"),
    ("empty-stack", {"sources": torch.empty(0, 3, D)}, ValueError, r"^sources: expected at least one"),
    ("stack-1d", {"sources": x(D)}, ValueError, r"^sources: a stacked tensor must have shape \[R, \.\.\., d\]"),
    ("sources-not-a-sequence", {"sources": 3}, TypeError, r"^sources: expected a sequence"),
    ("source-not-a-tensor", {"sources": [x(), [1.0] * D]}, TypeError, r"^sources\[1\]: expected a torch.Tensor"),
    ("shape-mismatch", {"sources": [x(), x(4, D)]}, ValueError, r"^sources\[1\]: .*shape"),
    ("d-mismatch", {"sources": [x(), x(3, D + 1)]}, ValueError, r"^sources\[1\]: .*shape"),
    ("d-zero", {"sources": [x(3, 0)], "query": x(0)}, ValueError, r"^sources\[0\]: expected shape \[\.\.\., d\] with d >= 1"),
    ("dtype-mismatch", {"sources": [x(), x(dtype=torch.bfloat16)]}, TypeError, r"^sources\[1\]: .*dtype"),
    ("device-mismatch", {"sources": [x(), x(device="meta")]}, ValueError, r"^sources\[1\]: .*device"),
    ("integer-sources", {"sources": [torch.ones(3, D, dtype=torch.int64)]}, TypeError, r"^sources\[0\]: expected a floating dtype"),
    ("bool-sources", {"sources": [torch.ones(3, D, dtype=torch.bool)]}, TypeError, r"^sources\[0\]: expected a floating dtype"),
    ("query-size", {"query": x(D + 1)}, ValueError, r"^query: expected shape \[8\] or \[1, 8\]"),
    ("query-rows", {"query": x(2, D)}, ValueError, r"^query: expected shape"),
    ("query-integer", {"query": torch.ones(D, dtype=torch.int32)}, TypeError, r"^query: expected a floating dtype"),
    ("query-not-a-tensor", {"query": [0.0] * D}, TypeError, r"^query: expected a torch.Tensor"),
    ("query-device", {"query": x(D, device="meta")}, ValueError, r"^query: .*device"),
    ("gain-size", {"key_norm_weight": x(D - 1)}, ValueError, r"^key_norm_weight: expected shape \[8\]"),
    ("gain-row", {"key_norm_weight": x(1, D)}, ValueError, r"^key_norm_weight: expected shape \[8\]"),
    ("gain-integer", {"key_norm_weight": torch.ones(D, dtype=torch.int64)}, TypeError, r"^key_norm_weight: expected a floating"),
    ("out-gain-size", {"out_norm_weight": x(2 * D)}, ValueError, r"^out_norm_weight: expected shape \[8\]"),
    ("out-gain-device", {"out_norm_weight": x(D, device="meta")}, ValueError, r"^out_norm_weight: .*device"),
    ("eps-zero", {"eps": 0.0}, ValueError, r"^eps: expected a positive float"),
    ("eps-negative", {"eps": -1e-6}, ValueError, r"^eps: expected a positive float"),
    ("eps-nan", {"eps": float("nan")}, ValueError, r"^eps: expected a positive float"),
    ("eps-string", {"eps": "1e-6"}, TypeError, r"^eps: expected a positive float"),
    ("eps-bool", {"eps": True}, TypeError, r"^eps: expected a positive float"),
    ("out-eps-zero", {"out_norm_weight": x(D), "out_eps": 0.0}, ValueError, r"^out_eps: expected a positive float"),
    ("out-eps-nan", {"out_eps": float("nan")}, ValueError, r"^out_eps: expected a positive float"),
]


@pytest.mark.parametrize("op", [depth_attention, naive_depth_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("overrides, error, match", [c[1:] for c in ATTENTION_CASES], ids=[c[0] for c in ATTENTION_CASES])
def test_depth_attention_rejects(op, overrides, error, match):
    kwargs = GOOD | overrides
    with pytest.raises(error, match=match):
        op(kwargs.pop("sources"), kwargs.pop("query"), **kwargs)


STATS_CASES = [
    ("empty-sources", {"sources": []}, ValueError, r"^sources: expected at least one"),
    ("dtype-mismatch", {"sources": [x(), x(dtype=torch.float16)]}, TypeError, r"^sources\[1\]: .*dtype"),
    ("device-mismatch", {"sources": [x(), x(device="meta")]}, ValueError, r"^sources\[1\]: .*device"),
    ("queries-1d", {"queries": x(D)}, ValueError, r"^queries: expected shape \[S, 8\]"),
    ("queries-size", {"queries": x(2, D + 1)}, ValueError, r"^queries: expected shape \[S, 8\]"),
    ("queries-none", {"queries": torch.empty(0, D)}, ValueError, r"^queries: expected shape \[S, 8\] with S >= 1"),
    ("queries-integer", {"queries": torch.ones(2, D, dtype=torch.int64)}, TypeError, r"^queries: expected a floating"),
    ("queries-device", {"queries": x(2, D, device="meta")}, ValueError, r"^queries: .*device"),
    ("gains-size", {"key_norm_weights": x(2, D - 1)}, ValueError, r"^key_norm_weights: expected shape \[S, 8\]"),
    ("eps-negative", {"eps": -1.0}, ValueError, r"^eps: expected a positive float"),
]


@pytest.mark.parametrize("op", [depth_stats, naive_depth_stats], ids=lambda f: f.__name__)
@pytest.mark.parametrize("overrides, error, match", [c[1:] for c in STATS_CASES], ids=[c[0] for c in STATS_CASES])
def test_depth_stats_rejects(op, overrides, error, match):
    kwargs = {"sources": [x(), x()], "queries": x(2, D)} | overrides
    with pytest.raises(error, match=match):
        op(kwargs.pop("sources"), kwargs.pop("queries"), **kwargs)


def test_depth_stats_rejects_a_gain_per_query_mismatch():
    with pytest.raises(ValueError, match=r"^key_norm_weights: expected one gain per query, shape \(2, 8\)"):
        depth_stats([x()], x(2, D), x(3, D))


def test_merge_and_finish_reject_mismatched_statistics():
    a, b = depth_stats([x()], x(2, D)), depth_stats([x(4, D)], x(2, D))
    with pytest.raises(ValueError, match=r"^merge_stats: both sides must have the same shape"):
        merge_stats(a, b)
    with pytest.raises(ValueError, match=r"^out_norm_weight: expected shape \[8\] or \[2, 8\]"):
        finish_stats(a, x(3, D))
    with pytest.raises(ValueError, match=r"^out_norm_weight: .*device"):
        finish_stats(a, x(D, device="meta"))
    with pytest.raises(ValueError, match=r"^out_eps: expected a positive float"):
        finish_stats(a, out_eps=0.0)
