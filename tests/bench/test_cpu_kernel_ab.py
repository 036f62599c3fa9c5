"""benchmarks/cpu_kernel_ab.py: its arguments and sources (compiling two kernels is the benchmark's own work)."""

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


def test_the_working_tree_source_and_an_unknown_revision():
    assert cpu_kernel_ab.kernel_source(cpu_kernel_ab.WORKTREE) == SOURCE.read_text()
    with pytest.raises(SystemExit, match="no-such-revision"):
        cpu_kernel_ab.kernel_source("no-such-revision")
