"""One device mesh on 4 gloo ranks: each composition's training curve equals one process's, and each rank's memory
line says it holds its share of the parameters, gradients and optimizer state. One launch runs every composition."""

import pytest
import torch

from attnres.distributed import ParallelDims
from attnres.training import TrainConfig, read_log, train
from tests.distributed.test_data_parallel import tiny
from tests.distributed.workers import run_ranks

# dim and heads divisible by the tensor-parallel ranks; 4 layers cut into 2 or 4 pipeline stages
SIZES = dict(layers=4, dim=32, heads=4, ffn=64, batch_size=8, residual="block", block_size=2)
MESHES = {
    "dp_shard 2 x tp 2": dict(dp_shard=2, tp=2),
    "dp_replicate 2 x dp_shard 2": dict(dp_replicate=2, dp_shard=2),  # HSDP: sharded over 2, replicated over 2
    "pp 2 x dp_shard 2": dict(pp=2, dp_shard=2),
    "pp 2 x tp 2": dict(pp=2, tp=2),
    "pp 4": dict(pp=4),
    # the other residuals, and a family with a sliding window and soft-capped logits, on the 3 kinds of composition
    "dp_shard 2 x tp 2, standard": dict(dp_shard=2, tp=2, residual="standard"),
    "pp 2 x tp 2, full": dict(pp=2, tp=2, residual="full"),
    "pp 2 x dp_shard 2, gemma2": dict(pp=2, dp_shard=2, base="gemma2",
                                      base_config=dict(head_dim=8, sliding_window=8, final_logit_softcapping=30.0)),
    "dp_shard 2 x tp 2, gemma2": dict(dp_shard=2, tp=2, base="gemma2",
                                      base_config=dict(head_dim=8, sliding_window=8, final_logit_softcapping=30.0)),
    # experts split over the tensor-parallel ranks (transformers' expert styles), FSDP2 over the rest
    "dp_shard 2 x tp 2, qwen3_moe": dict(dp_shard=2, tp=2, base="qwen3_moe",
                                         base_config=dict(head_dim=8, num_experts=4, num_experts_per_tok=2)),
}
MODEL_FIELDS = ("residual", "base", "base_config")
STEPS, STOP = 8, 6  # the resharded run: stopped at step 6 on one mesh, resumed on another
RESHARDED = "dp_shard 2 x tp 2, resumed as pp 2 x dp_shard 2"
STOPPED = "pp 2 x tp 2, stopped"  # resumed by one process


def _mesh_runs(rank: int, tmp: str) -> None:
    for name, settings in MESHES.items():
        train(tiny(f"{tmp}/{name}", **{**SIZES, **settings}))
    out = f"{tmp}/{RESHARDED}"
    train(tiny(out, **SIZES, steps=STEPS, stop_after=STOP, **MESHES["dp_shard 2 x tp 2"]))
    train(tiny(out, **SIZES, steps=STEPS, resume=True, **MESHES["pp 2 x dp_shard 2"]))
    train(tiny(f"{tmp}/{STOPPED}", **SIZES, steps=STEPS, stop_after=STOP, **MESHES["pp 2 x tp 2"]))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    results = run_ranks(_mesh_runs, 4, str(tmp), timeout_s=60.0, join_s=600.0)
    failed = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    return tmp


def _curve(run_dir) -> list[tuple[str, int, float]]:
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in read_log(run_dir)
            if r["kind"] in ("train", "eval")]


@pytest.mark.parametrize("mesh", MESHES)
def test_each_composition_follows_one_process(four_ranks, tmp_path, mesh):
    model = {k: v for k, v in MESHES[mesh].items() if k in MODEL_FIELDS}
    reference = train(tiny(tmp_path / "one", **{**SIZES, **model}))
    one, composed = _curve(reference.run_dir), _curve(four_ranks / mesh)
    assert [c[:2] for c in composed] == [c[:2] for c in one]
    torch.testing.assert_close([c[2] for c in composed], [c[2] for c in one], rtol=0, atol=1e-4)

    memory = {r["rank"]: r for r in read_log(four_ranks / mesh, "memory")}
    whole = read_log(reference.run_dir, "memory")[0]
    assert sorted(memory) == [0, 1, 2, 3]
    dims = {"pp": 1, "dp_shard": 1, "tp": 1, **{k: v for k, v in MESHES[mesh].items() if k not in MODEL_FIELDS}}
    if dims["pp"] == 1:
        share = 1 / (dims["dp_shard"] * dims["tp"])  # replicas hold a whole shard each
        for line in memory.values():  # the share, and a little more: a few small tensors stay replicated under TP
            for field in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert share * whole[field] * 0.99 <= line[field] <= 1.2 * share * whole[field], (mesh, line)
        return
    # a stage: its layers' share of the decoder layers, and the embedding (first) or the head and final read (last)
    model = reference.model
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    ends = max(model.model.embed_tokens.weight.nbytes, whole["param_bytes"] - layers - model.model.embed_tokens.weight.nbytes)
    for line in memory.values():
        bound = (layers / dims["pp"] + ends) / (dims["dp_shard"] * dims["tp"]) * (1.1 if dims["tp"] > 1 else 1)
        assert line["param_bytes"] <= 1.01 * bound, (mesh, line, bound)


def test_a_run_resumes_on_another_mesh(four_ranks, tmp_path):
    """Each rank saved what it held (torch.distributed.checkpoint); the run resumed on another mesh, or in one
    process, follows one process's curve."""
    reference = train(tiny(tmp_path / "one", **SIZES, steps=STEPS))
    stopped = four_ranks / STOPPED / "checkpoints" / f"step-{STOP:06d}"
    assert sorted(p.name for p in stopped.iterdir()) == ["sharded", "state.pt"]  # no weights gathered on rank 0
    alone = train(tiny(four_ranks / STOPPED, **SIZES, steps=STEPS, resume=True))
    one = _curve(reference.run_dir)
    for run_dir in (four_ranks / RESHARDED, alone.run_dir):
        resumed = _curve(run_dir)
        assert [c[:2] for c in resumed] == [c[:2] for c in one]
        torch.testing.assert_close([c[2] for c in resumed], [c[2] for c in one], rtol=0, atol=1e-4)
    assert sorted({r["rank"] for r in read_log(four_ranks / RESHARDED, "memory")}) == [0, 1, 2, 3]


def test_dims_fill_and_name_what_does_not_fit():
    assert ParallelDims.resolve(8, tp=2) == ParallelDims(dp_shard=4, tp=2)
    assert ParallelDims.resolve(8, pp=2, dp_replicate=2, tp=2).dp_shard == 1
    with pytest.raises(ValueError, match="pp=1 x dp_replicate=1 x dp_shard=3 x tp=2 = 6: expected the world size 4"):
        ParallelDims.resolve(4, dp_shard=3, tp=2)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        ParallelDims.resolve(4, tp=3)
    with pytest.raises(ValueError, match="tp: expected a positive integer, got 0"):
        ParallelDims.resolve(4, tp=0)
    with pytest.raises(ValueError, match="parallel: 'fsdp' is a shorthand for one mesh dimension"):
        TrainConfig(parallel="fsdp", tp=2)
    assert TrainConfig(parallel="tp").parallel_dims(4) == ParallelDims(tp=4)
