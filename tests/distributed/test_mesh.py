"""One device mesh on 4 gloo ranks: each composition's training curve equals one process's, and each rank's memory
line says it holds its share of the parameters, gradients and optimizer state; continued training from a pretrained
folder reads only each rank's part of the folder's weights. One launch runs every composition."""

import json
from pathlib import Path

import pytest
import torch

from attnres.distributed import ParallelDims
from attnres.training import TrainConfig, read_log, train
from attnres.training.optim import is_attn_res_param
from tests.distributed.test_data_parallel import tiny
from tests.distributed.workers import run_ranks
from tests.training.test_init_from import continued, family_folder

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
    # whole experts split over the tensor-parallel ranks (transformers' expert-parallel styles), FSDP2 over the rest
    "dp_shard 2 x tp 2, qwen3_moe": dict(dp_shard=2, tp=2, base="qwen3_moe",
                                         base_config=dict(head_dim=8, num_experts=4, num_experts_per_tok=2)),
}
MODEL_FIELDS = ("residual", "base", "base_config")
STEPS, STOP = 8, 6  # the resharded run: stopped at step 6 on one mesh, resumed on another
RESHARDED = "dp_shard 2 x tp 2, resumed as pp 2 x dp_shard 2"
STOPPED = "pp 2 x tp 2, stopped"  # resumed by one process
# continued training (`init_from`) from folders transformers' `save_pretrained` wrote: Qwen3-MoE's and Mixtral's hold
# per-expert weights (Mixtral's under legacy names), which transformers' loading fuses into each rank's part
INIT_FROM = {
    "init_from llama, dp_shard 2 x tp 2": ("llama", dict(dp_shard=2, tp=2)),
    "init_from qwen3_moe, dp_shard 2 x tp 2": ("qwen3_moe", dict(dp_shard=2, tp=2)),
    "init_from mixtral, pp 2 x tp 2": ("mixtral", dict(pp=2, tp=2)),
}
CONTINUED = dict(block_size=2, batch_size=4)  # block size in decoder layers; the batch splits over 2 ranks or microbatches


def _continued(tmp, name: str, **settings):
    family, dims = INIT_FROM[name]
    return continued(Path(tmp), Path(tmp) / family, name, **CONTINUED, **dims, **settings)


class _CountingFile:
    """A safetensors file opened by `safe_open`, counting the bytes of every tensor read from its slices."""

    def __init__(self, opened, counter: list[int]):
        self.opened, self.counter = opened, counter

    def __enter__(self):
        self.opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)

    def keys(self):
        return self.opened.keys()

    def get_slice(self, key):
        return _CountingSlice(self.opened.get_slice(key), self.counter)


class _CountingSlice:
    def __init__(self, part, counter: list[int]):
        self.part, self.counter = part, counter

    def get_shape(self):
        return self.part.get_shape()

    def get_dtype(self):
        return self.part.get_dtype()

    def __getitem__(self, index):
        tensor = self.part[index]
        self.counter[0] += tensor.nbytes
        return tensor


def _continued_runs(rank: int, tmp: str) -> None:
    """Each continued run; each rank writes the bytes it read from the folder and those of the family weights it
    holds (its local parts)."""
    import safetensors

    plain = safetensors.safe_open
    for name in INIT_FROM:
        counter = [0]
        safetensors.safe_open = lambda *args, **kwargs: _CountingFile(plain(*args, **kwargs), counter)
        try:
            model = train(_continued(tmp, name)).model
        finally:
            safetensors.safe_open = plain
        held = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes
                   for n, p in model.named_parameters() if not is_attn_res_param(n))
        (Path(tmp) / name / f"read-{rank}.json").write_text(json.dumps({"read": counter[0], "held": held}))


def _mesh_runs(rank: int, tmp: str) -> None:
    for name, settings in MESHES.items():
        train(tiny(f"{tmp}/{name}", **{**SIZES, **settings}))
    _continued_runs(rank, tmp)
    out = f"{tmp}/{RESHARDED}"
    train(tiny(out, **SIZES, steps=STEPS, stop_after=STOP, **MESHES["dp_shard 2 x tp 2"]))
    train(tiny(out, **SIZES, steps=STEPS, resume=True, **MESHES["pp 2 x dp_shard 2"]))
    train(tiny(f"{tmp}/{STOPPED}", **SIZES, steps=STEPS, stop_after=STOP, **MESHES["pp 2 x tp 2"]))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    for family in {family for family, _ in INIT_FROM.values()}:  # widths the tensor-parallel ranks divide
        family_folder(tmp / family, family, hidden_size=SIZES["dim"], heads=SIZES["heads"])
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
    _assert_same_curve(four_ranks / mesh, reference.run_dir)
    dims = {k: v for k, v in MESHES[mesh].items() if k not in MODEL_FIELDS}
    _assert_shares(four_ranks / mesh, reference, dims)


@pytest.mark.parametrize("name", INIT_FROM)
def test_continued_training_reads_each_ranks_part(four_ranks, tmp_path, name):
    """A continued run follows the one-process continued run; each rank read from the folder exactly the bytes of
    the family weights it holds (its local parts: transformers' shard-on-read), and holds its share."""
    reference = train(continued(tmp_path, four_ranks / INIT_FROM[name][0], "one", **CONTINUED))
    _assert_same_curve(four_ranks / name, reference.run_dir)
    dims = INIT_FROM[name][1]
    _assert_shares(four_ranks / name, reference, dims)
    folder = sum(p.nbytes for n, p in reference.model.named_parameters() if not is_attn_res_param(n))
    reads = [json.loads((four_ranks / name / f"read-{rank}.json").read_text()) for rank in range(4)]
    for line in reads:
        assert line["read"] == line["held"] < folder / 2, (name, line, folder)
    assert sum(line["read"] for line in reads) >= folder  # every weight was read by some rank


def _assert_same_curve(run_dir, reference_dir) -> None:
    one, composed = _curve(reference_dir), _curve(run_dir)
    assert [c[:2] for c in composed] == [c[:2] for c in one]
    torch.testing.assert_close([c[2] for c in composed], [c[2] for c in one], rtol=0, atol=1e-4)


def _assert_shares(run_dir, reference, dims: dict) -> None:
    """Each rank's memory line: its share of one process's parameters, gradients and optimizer state."""
    memory = {r["rank"]: r for r in read_log(run_dir, "memory")}
    whole = read_log(reference.run_dir, "memory")[0]
    assert sorted(memory) == [0, 1, 2, 3]
    dims = {"pp": 1, "dp_shard": 1, "tp": 1, **dims}
    if dims["pp"] == 1:
        share = 1 / (dims["dp_shard"] * dims["tp"])  # replicas hold a whole shard each
        for line in memory.values():  # the share, and a little more: a few small tensors stay replicated under TP
            for field in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert share * whole[field] * 0.99 <= line[field] <= 1.2 * share * whole[field], (run_dir, line)
        return
    # a stage: its layers' share of the decoder layers, and the embedding (first) or the head and final read (last)
    model = reference.model
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    ends = max(model.model.embed_tokens.weight.nbytes, whole["param_bytes"] - layers - model.model.embed_tokens.weight.nbytes)
    for line in memory.values():
        bound = (layers / dims["pp"] + ends) / (dims["dp_shard"] * dims["tp"]) * (1.1 if dims["tp"] > 1 else 1)
        assert line["param_bytes"] <= 1.01 * bound, (run_dir, line, bound)


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
