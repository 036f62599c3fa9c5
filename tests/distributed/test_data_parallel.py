"""DDP, FSDP2 and pipeline training on 2 gloo ranks equals 1-process training with the same global batch, and resumes."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attnres.training
from attnres.distributed import local_rows
from attnres.training import TrainConfig, read_log, train

DATA = str(Path(attnres.training.__file__).parent)  # a few source files: quicker to read than the stdlib walk


def tiny(out, **overrides) -> TrainConfig:
    settings = dict(
        data=DATA, max_bytes=30_000, residual="block", block_size=1, layers=2, dim=16, heads=2, ffn=32,
        seq_len=16, batch_size=4, steps=4, warmup=1, eval_interval=2, eval_batches=1, log_interval=1,
        checkpoint_interval=100, out=str(out), progress=False, threads=1,
    )
    return TrainConfig(**{**settings, **overrides})


def curve(run_dir, kind: str, field: str) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in read_log(run_dir, kind)]


# each run's settings beyond `tiny`; the pipelines cut the layers into 2 stages (1f1b) or 2 x 2 (interleaved). Every
# run splits the batch in two (ranks or microbatches); see `assert_same_weights` for how the final weights compare
RUNS = {
    "ddp": dict(parallel="ddp"),
    "fsdp": dict(parallel="fsdp"),
    "pipeline": dict(parallel="pipeline", pp_schedule="1f1b"),
    "pipeline-interleaved": dict(parallel="pipeline", pp_schedule="interleaved", virtual_stages=2, layers=4,
                                 microbatches=2),
    "tp": dict(parallel="tp"),
}


def stop_then_resume(rank: int, tmp: str) -> None:
    """For each parallelism: train 2 of 4 steps (checkpointed), then resume to the end, as after a crash."""
    for name, settings in RUNS.items():
        train(tiny(f"{tmp}/{name}", stop_after=2, **settings))
        train(tiny(f"{tmp}/{name}", resume=True, **settings))


def test_two_ranks_match_one_process_and_resume(two_ranks, tmp_path):
    """`two_ranks` ran `stop_then_resume` on 2 gloo ranks (see conftest.py)."""
    results, tmp = two_ranks
    assert results["train"] is None
    before = torch.get_num_threads()
    references = {layers: train(tiny(tmp_path / f"one-{layers}", layers=layers)) for layers in (2, 4)}
    torch.set_num_threads(before)

    for parallel, settings in RUNS.items():
        reference = references[settings.get("layers", 2)]
        run_dir = tmp / parallel
        for kind, field in (("train", "loss"), ("train", "grad_norm"), ("eval", "val_loss")):
            one, two = curve(reference.run_dir, kind, field), curve(run_dir, kind, field)
            assert [s for s, _ in two] == [s for s, _ in one], (parallel, kind, two)
            torch.testing.assert_close([v for _, v in two], [v for _, v in one], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{parallel} {kind} {field}: {m}")
        # one writer: only rank 0's complete checkpoint of the last step is left (keep_checkpoints=1)
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000004"]
        # final/ holds the whole model (fsdp: gathered from the shards), as the 1-process run's does
        final, one_final = load_file(str(run_dir / "final" / "model.safetensors")), load_file(
            str(reference.run_dir / "final" / "model.safetensors"))
        assert final.keys() == one_final.keys(), parallel
        assert_same_weights(final, one_final, parallel)


def assert_same_weights(final: dict, reference: dict, run: str) -> None:
    """Per tensor, the norm of the difference within 1e-5 of the tensor's norm. AdamW divides each element's update
    by that element's own gradient size, so an element whose gradient sits at float32 rounding level (sums over
    ranks or microbatches round in another order) moves by a rounding-dependent amount: measured up to 2.2e-6 in one
    of 4096 elements, whatever the parallelism. A wrong gradient moves whole tensors, orders of magnitude more."""
    for name, want in reference.items():  # a tensor that stays zero (layer 0's query: one source) must stay zero
        gap = ((final[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert gap <= 1e-5, f"{run} final/: {name} differs by {gap:.2e} of its norm"


def test_each_rank_keeps_a_disjoint_shard_of_the_global_batch():
    batch = torch.arange(12).reshape(6, 2)
    shards = [local_rows(batch, rank, 3) for rank in range(3)]
    assert [s.shape[0] for s in shards] == [2, 2, 2]
    assert torch.equal(torch.cat(shards), batch)  # disjoint and complete, in rank order
    with pytest.raises(ValueError, match="batch_size: expected a multiple of the 4 data-parallel ranks, got 6"):
        local_rows(batch, 0, 4)
