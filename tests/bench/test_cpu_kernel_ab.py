"""benchmarks/cpu_kernel_ab.py: its arguments and sources (compiling two kernels is the benchmark's own work)."""

import subprocess

import pytest

from attnres.ops.cpu.build import SOURCE
from benchmarks import cpu_kernel_ab


def test_the_same_revision_twice_is_refused():
    with pytest.raises(SystemExit):
        cpu_kernel_ab.parse_args(["--base", "HEAD", "--head", "HEAD"])


@pytest.mark.parametrize("name", ["tokens", "dim", "layers", "threads", "repeats"])
def test_sizes_must_be_positive(name):
    with pytest.raises(SystemExit):
        cpu_kernel_ab.parse_args(["--base", "HEAD", f"--{name}", "0"])


def test_source_counts_must_be_positive():
    with pytest.raises(SystemExit):
        cpu_kernel_ab.parse_args(["--base", "HEAD", "--sources", "1", "0"])
    assert cpu_kernel_ab.parse_args(["--base", "HEAD", "--sources", "1", "13"]).sources == [1, 13]


def test_single_points_time_each_count_forward_and_backward():
    """With the kernel loaded as `attnres_cpu`, the single-point cases run and cover every count, all three ways."""
    import torch

    from attnres.ops import cpu

    assert cpu.available()
    sources = [torch.randn(8, 16) for _ in range(3)]
    cases = cpu_kernel_ab.single_points(torch.ops.attnres_cpu, sources, torch.randn(16), torch.ones(16),
                                        torch.randn(8, 16), [1, 3])
    assert list(cases) == [f"{phase} R={r}" for r in (1, 3) for phase in ("forward", "backward", "bank")]
    assert all(len(calls) == 1 for calls in cases.values())
    out, weights, _ = cases["forward R=3"][0]()
    assert out.shape == (8, 16) and weights.shape == (3, 8)
    grads, _, _ = cases["backward R=1"][0]()
    assert len(grads) == 1 and grads[0].shape == (8, 16)
    for r in (1, 3):  # the fused aggregation of the same rows is the one-shot forward, bit for bit
        assert torch.equal(cases[f"bank R={r}"][0](), cases[f"forward R={r}"][0]()[0])


def test_full_schedule_points_in_order_and_the_chain_sums_every_points_gradients():
    """The schedule's calls are its points (forward over 1 .. R sources); run in order, the chain's backward leaves in
    its buffer each source's gradient summed over every point, as the one-shot backwards give it."""
    import torch

    from attnres.ops import cpu

    assert cpu.available()
    ops = torch.ops.attnres_cpu
    sources = [torch.randn(8, 16, dtype=torch.float64) for _ in range(4)]
    c, w, grad_out = torch.randn(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64), torch.randn(
        8, 16, dtype=torch.float64)
    saved = [ops.depth_attention_fwd(sources[:r], c, w, 1e-6, 1e-6) for r in range(1, 5)]
    chain = cpu_kernel_ab.full_schedule(ops, sources, c, w, grad_out, saved, chained=True)
    one_shot = cpu_kernel_ab.full_schedule(ops, sources, c, w, grad_out, saved, chained=False)
    assert [call()[0].shape[0] for call in chain["forward"]] == [8] * 4
    for call in chain["backward"]:
        call()
    into = chain["backward"][0].args[8]  # the buffer the last point writes and every other point adds into
    expected = [sum(call()[0][j] for call in one_shot["backward"][j:]) for j in range(4)]
    for j in range(4):
        torch.testing.assert_close(into[j], expected[j])


def test_the_working_tree_source_and_an_unknown_revision():
    assert cpu_kernel_ab.kernel_source(cpu_kernel_ab.WORKTREE) == SOURCE.read_text()
    with pytest.raises(SystemExit, match="no-such-revision"):
        cpu_kernel_ab.kernel_source("no-such-revision")


def _git_head() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cpu_kernel_ab.ROOT, capture_output=True,
                              text=True)
    except FileNotFoundError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.skipif(_git_head() is None, reason="needs git and a git checkout")
def test_a_record_names_the_commits_its_revisions_resolve_to():
    """`HEAD~1` in a record would name another commit once the next one lands: the record keeps the commit."""
    head = _git_head()
    assert cpu_kernel_ab.commit_of("HEAD") == head
    assert cpu_kernel_ab.commit_of(cpu_kernel_ab.WORKTREE) == cpu_kernel_ab.WORKTREE
    with pytest.raises(SystemExit, match="no-such-revision"):
        cpu_kernel_ab.commit_of("no-such-revision")


def test_interleaved_timing_runs_every_call_of_both_sides_and_keeps_the_timed_repeats():
    """Two warm-up rounds, then one time per repeat and (side, phase): the sum of the phase's calls."""
    ran = []
    cases = {side: {phase: [lambda s=side, p=phase, k=k: ran.append((s, p, k)) for k in range(2)]
                    for phase in ("forward", "backward")} for side in ("base", "head")}
    times = cpu_kernel_ab.time_interleaved(cases, repeats=3, cold=False)
    assert set(times) == {(side, phase) for side in ("base", "head") for phase in ("forward", "backward")}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert len(ran) == (3 + 2) * 2 * 2 * 2 and all(ran.count(call) == 5 for call in set(ran))
    assert ran[:2] == [("head", "forward", 0), ("head", "forward", 1)]  # the sides take turns running first
    assert ran[4:6] == [("head", "backward", 0), ("head", "backward", 1)]
    assert ran[8:10] == [("base", "forward", 0), ("base", "forward", 1)]


def test_compare_names_its_sides():
    r = cpu_kernel_ab.compare([2.0, 4.0, 3.0], [1.0, 2.0, 3.0], ("kernel", "floor"))
    assert r["kernel_ms"] == {"min": 2000.0, "median": 3000.0}
    assert r["floor_over_kernel"] == {"min": 0.5, "median": 2.0 / 3.0}
