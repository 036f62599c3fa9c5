"""Pipeline parallel (attnres.distributed.pipeline) on 2 and 4 gloo ranks: loss and every parameter gradient equal
the single-process model, with and without cross-stage caching, and each hop sends exactly the bytes of the formulas.

One launch of 4 ranks runs every case (a launch costs seconds): the 2-rank cases run on two pairs at once."""

import re
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from attnres.distributed.pipeline import PipelinePlan, PipelineTrainer, hop_bytes, paper_rows
from tests.distributed.workers import run_ranks

BATCH, SEQ, DIM, VOCAB = 4, 8, 16, 64


@dataclass(frozen=True)
class Case:
    ranks: int
    residual: str
    layers: int
    schedule: str
    microbatches: int
    virtual_stages: int = 1
    cache_rows: bool = True
    block_size: int = 2
    two_phase: bool | None = None
    family: str = "llama"

    @property
    def id(self) -> str:
        cache = "cache" if self.cache_rows else "nocache"
        family = "" if self.family == "llama" else f"{self.family}-"
        return (f"P{self.ranks}-{family}{self.residual}-L{self.layers}-S{self.block_size}-{self.schedule}"
                f"-M{self.microbatches}-V{self.virtual_stages}-{cache}" + ("-two_phase" if self.two_phase else ""))

    def plan(self) -> PipelinePlan:
        return PipelinePlan(self.residual, self.layers, self.ranks, self.virtual_stages, self.block_size,
                            self.cache_rows)


CASES = [
    # 2 ranks: one chunk a rank (1F1B, GPipe) and two (interleaved), with and without caching
    Case(2, "block", 4, "1f1b", 2),
    Case(2, "block", 4, "gpipe", 2, block_size=4, two_phase=True),  # cut inside a block: phase 1 on resume
    Case(2, "block", 8, "interleaved", 2, 2, block_size=1),  # 2 blocks a chunk
    Case(2, "block", 8, "interleaved", 2, 2, block_size=1, cache_rows=False),
    Case(2, "full", 4, "1f1b", 2),
    Case(2, "full", 4, "interleaved", 2, 2),
    Case(2, "full", 4, "interleaved", 2, 2, cache_rows=False),
    Case(2, "standard", 4, "1f1b", 2),
    # zero bubble: the backward split into input and weight gradients (no cross-stage caching: see PipelineTrainer)
    Case(2, "block", 8, "zero-bubble", 2, 2, block_size=1, cache_rows=False),
    Case(2, "full", 4, "zero-bubble", 2, 2, cache_rows=False),
    # the last stage runs the family's own head: soft-capped (Gemma 2, with its sliding window) or scaled logits
    Case(2, "block", 4, "1f1b", 2, family="gemma2"),
    Case(2, "full", 4, "1f1b", 2, family="granite"),
    Case(2, "block", 4, "1f1b", 2, family="qwen3_moe"),  # its head reads router logits from the base model's output
    # 4 ranks: one layer a chunk, so with block size 2 every other hop cuts a block
    Case(4, "block", 4, "1f1b", 4, block_size=1),
    Case(4, "block", 8, "interleaved", 4, 2),
    Case(4, "block", 8, "interleaved", 4, 2, cache_rows=False),
    Case(4, "full", 8, "interleaved", 4, 2),
    Case(4, "full", 8, "interleaved", 4, 2, cache_rows=False),
    Case(4, "standard", 8, "interleaved", 4, 2),
]


FAMILY_FIELDS = {
    "gemma2": dict(head_dim=8, final_logit_softcapping=2.0, sliding_window=4, tie_word_embeddings=False),
    "granite": dict(logits_scaling=4.0),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}


def build_model(case: Case):
    """A tiny model with random pseudo-queries and key gains (zero queries cannot see a wrong schedule)."""
    from attnres.models import AttnResConfig, AttnResForCausalLM

    torch.manual_seed(0)
    config = AttnResConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=case.layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, residual=case.residual,
        attn_res_block_size=case.block_size, attn_res_two_phase=case.two_phase, base_model_type=case.family,
        **FAMILY_FIELDS.get(case.family, {}),
    )
    model = AttnResForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "res_proj" in name:
                p.normal_(0, 0.5)
            elif "res_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def bad_arguments(group) -> list[str]:
    """The ValueError message of each bad setting (`group` has 2 ranks)."""
    messages = []
    for case in [
        Case(2, "block", 3, "1f1b", 2),  # 3 layers on 2 ranks
        Case(2, "block", 4, "interleaved", 2, 2),  # 4 layers in 2 x 2 chunks is fine: not an error
        Case(2, "block", 4, "1f1b", 1),  # fewer microbatches than ranks
        Case(2, "block", 4, "1f1b", 2, 2),  # 1f1b with virtual stages
        Case(2, "block", 4, "interleaved", 2, 1),  # interleaved without
        Case(2, "block", 4, "zigzag", 2),
    ]:
        try:
            PipelineTrainer(build_model(case), schedule=case.schedule, microbatches=case.microbatches,
                            virtual_stages=case.virtual_stages, group=group)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    try:
        PipelineTrainer(build_model(CASES[2]), schedule="zero-bubble", microbatches=2, virtual_stages=2,
                        cache_rows=True, group=group)
    except ValueError as e:
        messages.append(str(e))
    trainer = PipelineTrainer(build_model(CASES[0]), microbatches=2, group=group)
    try:
        trainer.step(torch.zeros(3, SEQ, dtype=torch.long), torch.zeros(3, SEQ, dtype=torch.long))
    except ValueError as e:
        messages.append(str(e))
    return messages


def run_cases(rank: int) -> dict:
    """The 4-rank cases on all 4 ranks, then the 2-rank cases split over the pairs {0, 1} and {2, 3}, which run at
    the same time: {case id: (rank in the pipeline, loss, {parameter: gradient} of this rank's chunks, {hop: (rows,
    bytes)})}, and on the first pair the messages of `bad_arguments`."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    pair = pairs[rank // 2]
    out = {}
    two_rank_cases = [c for c in CASES if c.ranks == 2]
    for case in [c for c in CASES if c.ranks == 4] + two_rank_cases[rank // 2 :: 2]:
        group = None if case.ranks == 4 else pair
        model = build_model(case)
        trainer = PipelineTrainer(model, schedule=case.schedule, microbatches=case.microbatches,
                                  virtual_stages=case.virtual_stages, cache_rows=case.cache_rows, group=group)
        loss = trainer.step(*make_batch())
        # numpy arrays: tensors would travel through shared memory that dies with this process
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        out[case.id] = (dist.get_rank(group), loss, grads, trainer.traffic.per_hop())
    if rank < 2:
        out["errors"] = bad_arguments(pair)
    return out


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, list[tuple]], list]:
    """One launch of 4 gloo ranks (a launch costs seconds): ({case id: [(loss, gradients, traffic) of each pipeline
    rank]}, the messages of `bad_arguments`)."""
    launched = run_ranks(run_cases, 4, timeout_s=60.0, join_s=150.0)
    failed = {rank: value for rank, (status, value) in launched.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    by_case = defaultdict(dict)
    for _, value in launched.values():
        for key, (pipeline_rank, *result) in ((k, v) for k, v in value.items() if k != "errors"):
            by_case[key][pipeline_rank] = result
    return {key: [ranks[r] for r in sorted(ranks)] for key, ranks in by_case.items()}, launched[0][1]["errors"]


def hops(results, case: Case) -> list[tuple[int, int]]:
    """(rows, bytes) each hop sent per microbatch, in hop order, gathered from the ranks that sent them."""
    traffic = {}
    for _, _, per_hop in results[0][case.id]:
        traffic.update(per_hop)
    assert sorted(traffic) == list(range(case.ranks * case.virtual_stages - 1))
    return [traffic[c] for c in sorted(traffic)]


def reference(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(case)
    ids, labels = make_batch()
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_loss_and_gradients_equal_one_process(results, case):
    per_rank = results[0][case.id]
    assert len(per_rank) == case.ranks
    want_loss, want_grads = reference(case)
    got = {}
    for loss, grads, _ in per_rank:
        assert loss == pytest.approx(want_loss, rel=1e-6)  # every rank returns the loss
        assert not set(grads) & set(got), "a parameter has gradients on two ranks"
        got.update({n: torch.from_numpy(g) for n, g in grads.items()})
    assert set(got) == set(want_grads)  # every parameter is some rank's
    for name, want in want_grads.items():
        # relative to the largest entry; the floor is for layer 0's attention query, whose gradient is zero up to
        # rounding (one source), far below the others (1e-4 .. 1e-1)
        assert (got[name] - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-8, name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bytes_per_hop_equal_the_formulas(results, case):
    plan = case.plan()
    sent = hops(results, case)
    assert [rows for rows, _ in sent] == [plan.sent_rows(c) for c in range(plan.num_stages - 1)]
    assert [size for _, size in sent] == hop_bytes(plan, BATCH // case.microbatches, SEQ, DIM, 4)


# rows per hop worked out by hand from the schedules (module docstring of attnres.distributed.pipeline)
HAND_ROWS = {
    "P2-block-L8-S1-interleaved-M2-V2-cache": [3, 3, 3],  # bank 2, 4, 6 rows + prefix; the rank holds 2, 4 of them
    "P2-block-L8-S1-interleaved-M2-V2-nocache": [3, 5, 7],
    "P2-full-L4-S2-interleaved-M2-V2-cache": [3, 2, 2],  # sources 3, 5, 7; the rank holds 3, 5
    "P2-full-L4-S2-interleaved-M2-V2-nocache": [3, 5, 7],
    "P4-block-L8-S2-interleaved-M4-V2-cache": [2, 2, 3, 2, 3, 2, 3],  # bank 1 1 2 2 3 3 4; held 1 1 2 2 from hop 3
    "P4-block-L8-S2-interleaved-M4-V2-nocache": [2, 2, 3, 3, 4, 4, 5],
    "P4-full-L8-S2-interleaved-M4-V2-cache": [3, 5, 7, 6, 6, 6, 6],
    "P4-full-L8-S2-interleaved-M4-V2-nocache": [3, 5, 7, 9, 11, 13, 15],
    "P4-standard-L8-S2-interleaved-M4-V2-cache": [1] * 7,
}


@pytest.mark.parametrize("case", [c for c in CASES if c.id in HAND_ROWS], ids=lambda c: c.id)
def test_rows_per_hop_by_hand(results, case):
    assert [rows for rows, _ in hops(results, case)] == HAND_ROWS[case.id]


ALIGNED = [c for c in CASES if c.residual == "block" and c.layers % (c.ranks * c.virtual_stages * c.block_size) == 0]


@pytest.mark.parametrize("case", ALIGNED, ids=lambda c: c.id)
def test_rows_over_all_hops_against_the_papers_equations_7_and_8(results, case):
    """Blocks aligned to chunks: eq. 7 plus the embedding row on each hop; eq. 8 exact to its rounding."""
    P, V = case.ranks, case.virtual_stages
    blocks_per_chunk = case.layers // (P * V * case.block_size)
    naive, cached = paper_rows(P, V, blocks_per_chunk)
    total = sum(rows for rows, _ in hops(results, case))
    if case.cache_rows and V > 1:
        assert total == cached + (P - 1) - (V - 1) * P * (blocks_per_chunk - 1)
    else:
        assert total == naive + (P * V - 1)


@pytest.mark.parametrize("residual", ["block", "full"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_caching_sends_fewer_bytes_from_the_second_virtual_stage_on(results, residual, ranks):
    with_cache, without = (
        [size for _, size in hops(results, next(c for c in CASES if c.ranks == ranks and c.residual == residual
                                                 and c.schedule == "interleaved" and c.cache_rows == flag))]
        for flag in (True, False)
    )
    assert with_cache[: ranks - 1] == without[: ranks - 1]  # the first pass over the ranks has nothing cached
    assert all(a < b for a, b in zip(with_cache[ranks - 1 :], without[ranks - 1 :]))
    assert max(with_cache) < max(without)  # the peak hop shrinks


def test_bad_arguments_raise_value_errors_naming_them(results):
    messages = results[1]
    assert messages[0].startswith("virtual_stages: 2 ranks x 1 virtual stages must divide num_hidden_layers=3")
    assert messages[1] is None
    assert messages[2].startswith("microbatches: the 1f1b schedule needs at least one per rank (2), got 1")
    assert messages[3].startswith("virtual_stages: the '1f1b' schedule needs 1, got 2")
    assert messages[4].startswith("virtual_stages: the 'interleaved' schedule needs >= 2, got 1")
    assert messages[5].startswith("schedule: expected one of")
    assert messages[6].startswith("cache_rows: the 'zero-bubble' schedule computes a chunk's input gradients")
    assert messages[7].startswith("input_ids: expected [batch, seq] with batch a multiple of microbatches=2")


def test_tied_embeddings_and_other_models_are_refused():
    from attnres.models import AttnResConfig, AttnResForCausalLM

    tied = AttnResForCausalLM(AttnResConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=DIM,
                                            num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="model: tie_word_embeddings must be off"):
        PipelineTrainer(tied, microbatches=2)
    with pytest.raises(TypeError, match="model: expected an AttnResForCausalLM, got Linear"):
        PipelineTrainer(torch.nn.Linear(2, 2), microbatches=2)
    routed = AttnResForCausalLM(AttnResConfig(
        base_model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        output_router_logits=True,
    ))
    with pytest.raises(ValueError, match="model: output_router_logits must be off"):
        PipelineTrainer(routed, microbatches=2)


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize("residual, block_size", [("block", 1), ("block", 3), ("full", 2), ("standard", 2)])
def test_chained_chunks_compute_the_models_logits_in_one_process(residual, block_size, two_phase):
    """The chunks' forward, chained by hand (no PipelineStage): bit-exact with one-shot reads; two-phase reads may
    differ in rounding where a chunk starts inside a block (phase 1 then scores fewer queries at once)."""
    from attnres.distributed.pipeline import HopTraffic, PipelineChunk, RowCache

    case = Case(4, residual, 6, "gpipe", 1, block_size=block_size, two_phase=two_phase)  # 6 layers in 3 chunks
    model = build_model(case)
    model.config.attn_res_full_group = 0  # a stage reads each point over all its sources: so must the whole model
    plan = PipelinePlan(residual, 6, ranks=3, block_size=block_size, cache_rows=False)
    ids, _ = make_batch()
    out = (ids,)
    for c in range(plan.num_stages):
        out = PipelineChunk(model, plan, c, RowCache(), HopTraffic())(*out)
    want = model(ids).logits
    if two_phase:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(out, want)


def test_a_stream_exports_its_state_only_between_layers_and_resumes_only_fresh():
    from attnres.layers import make_stream
    from attnres.layers.residuals import ResidualState

    model = build_model(Case(2, "block", 2, "1f1b", 2))
    hidden = torch.randn(1, 2, DIM)
    stream = make_stream("block", hidden, 2, model.aggregation_points(), block_size=1)
    stream.read()
    with pytest.raises(RuntimeError, match="state: a stream has a state only between decoder layers"):
        stream.state()
    with pytest.raises(ValueError, match="layer: expected a fresh stream and 0 < layer <= 2, got 1"):
        stream.resume(1, ResidualState(rows=(hidden,), head=hidden))


@pytest.mark.parametrize("settings, message", [
    (dict(pp_schedule="interleaved"), "virtual_stages: the 'interleaved' schedule needs >= 2, got 1"),
    (dict(layers=3), "virtual_stages: 2 ranks x 1 virtual stages must divide num_hidden_layers=3 into equal chunks"),
    (dict(batch_size=6, microbatches=4), "batch_size: expected a multiple of the 4 microbatches x 1 data-parallel ranks, got 6"),
    (dict(microbatches=1), "microbatches: the 1f1b schedule needs at least one per rank (2), got 1"),
])
def test_train_checks_pipeline_settings_before_it_writes_anything(settings, message):
    from attnres.distributed import ParallelDims
    from attnres.training import TrainConfig
    from attnres.training.steps import check_settings

    config = TrainConfig(**{"parallel": "pipeline", "layers": 4, "batch_size": 8, **settings})
    with pytest.raises(ValueError, match=re.escape(message)):
        check_settings(config, ParallelDims(pp=2))
    with pytest.raises(ValueError, match="pp_schedule: expected one of gpipe, 1f1b, interleaved, zero-bubble, got 'zigzag'"):
        TrainConfig(parallel="pipeline", pp_schedule="zigzag")
