"""Models built on the meta device and made real after parallelizing (`attnres.distributed.materialize`): each rank
allocates only what it holds, and what it holds equals the same part of the model one process builds from the same
seed, for tensor parallel (MoE experts' packed columns included), FSDP2 over tensor parallel, and pipeline stages."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from attnres.distributed import apply_fsdp, parallelize_tensor
from attnres.distributed.materialize import materialize
from attnres.distributed.pipeline import PipelinePlan, keep_stages
from attnres.training.loop import build_model
from tests.distributed.test_data_parallel import tiny
from tests.distributed.workers import run_ranks

VOCAB = 64
CASES = {
    "llama, block": dict(layers=4, dim=32, heads=4, ffn=64),
    "qwen3_moe, full": dict(layers=4, dim=32, heads=4, ffn=32, residual="full", base="qwen3_moe",
                            base_config=dict(head_dim=8, num_experts=4, num_experts_per_tok=2)),
    "gemma2, tied": dict(layers=4, dim=32, heads=4, ffn=64, base="gemma2", tie_embeddings=True,
                         base_config=dict(head_dim=8, sliding_window=8)),
}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _held_equal_one_process(rank: int, tmp: str) -> dict:
    held = {}
    for case, settings in CASES.items():
        config = tiny(tmp, **settings)
        one = dict(build_model(config, VOCAB).named_parameters())

        tp = build_model(config, VOCAB, device="meta")
        assert all(p.is_meta for p in tp.parameters())
        parallelize_tensor(tp, init_device_mesh("cpu", (2,)))
        materialize(tp, "cpu", config.seed)
        for name, param in tp.named_parameters():
            assert isinstance(param, DTensor), name
            torch.testing.assert_close(param.full_tensor(), one[name], rtol=0, atol=0, msg=f"{case}: {name}")

        fsdp = build_model(config, VOCAB, device="meta")
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        parallelize_tensor(fsdp, mesh["tp"])
        apply_fsdp(fsdp, mesh["dp"])
        materialize(fsdp, "cpu", config.seed)
        for name, param in fsdp.named_parameters():
            torch.testing.assert_close(_whole(param), one[name], rtol=0, atol=0, msg=f"{case}: {name}")

        if not config.tie_embeddings:  # a pipeline stage: the embedding and head live on different stages
            stage = build_model(config, VOCAB, device="meta")
            keep_stages(stage, PipelinePlan(stage.config.residual, 4, 2, 1, 2, True), rank)
            materialize(stage, "cpu", config.seed)
            names = dict(stage.named_parameters())
            for name, param in names.items():
                torch.testing.assert_close(param, one[name], rtol=0, atol=0, msg=f"{case}: {name}")
            held[case] = sum(p.numel() for p in names.values()) / sum(p.numel() for p in one.values())
    return held


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    results = run_ranks(_held_equal_one_process, 2, str(tmp_path_factory.mktemp("meta")), join_s=240)
    failed = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    return [results[r][1] for r in (0, 1)]


def test_each_rank_holds_its_part_of_the_one_process_model(held):
    """Each rank asserted the equalities inside; here: a pipeline stage of 2 holds its layers and its end of the
    model only (about half the parameters, the embedding or the head besides)."""
    for case in held[0]:
        assert 0.3 < held[0][case] < 0.7 and 0.3 < held[1][case] < 0.7, (case, held)
        assert held[0][case] + held[1][case] == pytest.approx(1.0)


def test_a_parameter_no_init_writes_is_named(tmp_path):
    model = build_model(tiny(tmp_path), VOCAB, device="meta")
    model.model.layers[0].mlp.register_parameter("extra", nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(ValueError, match=r"no init writes model\.layers\.0\.mlp\.extra"):
        materialize(model, "cpu", 0)


def test_the_seed_decides_every_weight(tmp_path):
    first, again = (dict(build_model(tiny(tmp_path, seed=3), VOCAB).named_parameters()) for _ in range(2))
    other = dict(build_model(tiny(tmp_path, seed=4), VOCAB).named_parameters())
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
