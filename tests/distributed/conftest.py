import pytest

from tests.distributed.test_data_parallel import stop_then_resume
from tests.distributed.workers import run_ranks


def _two_rank_checks(rank: int, tmp: str) -> dict:
    return {"train": stop_then_resume(rank, tmp)}


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """One launch of 2 gloo ranks for the tests that need a healthy group (each launch costs seconds of imports):
    ({"train": rank 0's result}, the folder of the training runs)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    results = run_ranks(_two_rank_checks, 2, str(tmp), timeout_s=60.0, join_s=300.0)  # a shared machine can be slow
    failed = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    return {"train": results[0][1]["train"]}, tmp
