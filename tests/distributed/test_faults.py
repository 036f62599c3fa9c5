"""A rank that raises makes the other exit with a clear error within a bounded time, never a hang."""

import time

from attnres.training import TrainConfig, train
from tests.distributed.test_data_parallel import DATA
from tests.distributed.workers import run_ranks

TIMEOUT_S = 10.0  # the process group's collective timeout: the bound when a rank goes silent instead of dying


class Crash(RuntimeError):
    pass


def _rank_one_raises_at_step_two(rank: int, out: str) -> None:
    config = TrainConfig(
        data=DATA, max_bytes=30_000, layers=2, dim=16, heads=2, ffn=32, seq_len=16, batch_size=4, steps=4,
        warmup=1, eval_interval=100, eval_batches=1, log_interval=1, out=out, progress=False, threads=1,
        parallel="ddp",
    )
    calls = 0

    def crash_at_second_forward(module, args, kwargs, output):
        nonlocal calls
        calls += module.training
        if rank == 1 and calls == 2:
            raise Crash("rank 1 fails at training step 2")

    from attnres.training.loop import build_model

    model = build_model(config, 256)
    model.register_forward_hook(crash_at_second_forward, with_kwargs=True)
    train(config, model)


def test_rank_that_raises_stops_the_other_with_a_clear_error(tmp_path):
    start = time.monotonic()
    results = run_ranks(_rank_one_raises_at_step_two, 2, str(tmp_path / "run"), timeout_s=TIMEOUT_S, join_s=60)
    elapsed = time.monotonic() - start

    assert results[1][0] == "error" and "Crash: rank 1 fails at training step 2" in results[1][1], results[1]
    status, message = results[0]
    assert status == "error", results[0]  # not "hung" (killed by the test) and not "ok"
    assert message.startswith("RankFailed: rank 0: a collective failed"), message
    assert "Resume from the last checkpoint with --resume." in message
    assert elapsed < 60, elapsed
