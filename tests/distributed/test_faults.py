"""A rank that raises, dies or goes silent makes the other exit with a clear error within a bounded time."""

import os
import time

import pytest

from attnres.training import TrainConfig, train
from tests.distributed.test_data_parallel import DATA
from tests.distributed.workers import run_ranks

TIMEOUT_S = 5.0  # the process group's collective timeout: the bound when a rank goes silent instead of dying
STALL_S = 3 * TIMEOUT_S  # how long the silent rank sleeps: well past the others' timeout, short enough for CI


class Crash(RuntimeError):
    pass


def _rank_one_fails_at_step_two(rank: int, out: str, fault: str, parallel: str) -> None:
    config = TrainConfig(
        data=DATA, max_bytes=30_000, layers=2, dim=16, heads=2, ffn=32, seq_len=16, batch_size=4, steps=4,
        warmup=1, eval_interval=100, eval_batches=1, log_interval=1, out=out, progress=False, threads=1,
        parallel=parallel,
    )
    forwards_a_step = 2 if parallel == "pipeline" else 1  # the pipeline's 2 microbatches run the base model twice
    calls = 0

    def fail_at_step_two(module, args, kwargs, output):
        nonlocal calls
        calls += module.training
        if rank == 1 and calls == forwards_a_step + 1:
            if fault == "raise":
                raise Crash("rank 1 fails at training step 2")
            if fault == "exit":
                os._exit(3)  # dies at once: no exception, no cleanup, sockets closed by the OS
            time.sleep(STALL_S)  # "stall": alive but silent

    from attnres.training.loop import build_model

    model = build_model(config, 256)
    model.model.register_forward_hook(fail_at_step_two, with_kwargs=True)  # the base model: pipeline chunks run it
    train(config, model)


@pytest.mark.parametrize("fault, parallel", [("raise", "ddp"), ("exit", "ddp"), ("stall", "ddp"), ("raise", "pipeline"),
                                             ("raise", "tp"), ("raise", "fsdp")])
def test_failing_rank_stops_the_other_with_a_clear_error(tmp_path, fault, parallel):
    results = run_ranks(_rank_one_fails_at_step_two, 2, str(tmp_path / "run"), fault, parallel, timeout_s=TIMEOUT_S,
                        join_s=90)

    status, message = results[0]
    assert status == "error", results[0]  # not "hung" (still running after join_s, then killed) and not "ok"
    assert message.startswith("RankFailed: rank 0: a collective failed"), message
    assert "Resume from the last checkpoint with --resume." in message
    if fault == "raise":
        assert results[1][0] == "error" and "Crash: rank 1 fails at training step 2" in results[1][1], results[1]
    elif fault == "exit":
        assert results[1] == ("died", "rank 1 exited with code 3 without a result"), results[1]
    else:  # the silent rank is caught by the collective timeout, not by its late return
        assert f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in message, message
