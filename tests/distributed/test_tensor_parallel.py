"""Tensor + sequence parallel on 2 gloo ranks equals one process: logits, loss, every gradient and the residual state
(each rank's token rows), for standard, Full and Block (and a tied head), per-head norms (Qwen3) and MoE experts
(Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert); then a prefill with a KV cache and one decode step, and
`generate`; FSDP2 x TP on a 1 x 2 and a 2 x 1 mesh."""

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from attnres.distributed import apply_fsdp, parallelize_tensor
from attnres.layers.bank import BankState
from attnres.layers.residuals import ResidualState
from attnres.models import AttnResConfig, AttnResForCausalLM
from tests.distributed.workers import run_ranks
from tests.models import TINY, off_init_

CASES = {
    "standard": {"residual": "standard"},
    "full": {"residual": "full"},
    "block": {"residual": "block", "attn_res_block_size": 2},
    "block, tied head": {"residual": "block", "attn_res_block_size": 1, "tie_word_embeddings": True},
    "qwen3 (per-head norms in the attention)": {"base_model_type": "qwen3", "residual": "full", "head_dim": 8},
    # whole experts over the ranks by transformers' own expert-parallel styles; layer 1 dense (an MoE model's
    # mlp_only_layers)
    "qwen3_moe": {"base_model_type": "qwen3_moe", "residual": "block", "attn_res_block_size": 2, "head_dim": 8,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1]},
    "mixtral": {"base_model_type": "mixtral", "residual": "full", "num_local_experts": 4, "num_experts_per_tok": 2},
    # a shared expert beside the routed ones: it runs whole on every rank, on the body's gathered tokens
    "qwen2_moe": {"base_model_type": "qwen2_moe", "residual": "full", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
}
BATCH, SEQ = 2, 8


def _model(case: str, **changes) -> AttnResForCausalLM:
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**{**TINY, **CASES[case], **changes}))
    off_init_(model)
    return model


def _rows(model, state: ResidualState | BankState) -> list[torch.Tensor]:
    """The residual state the final read consumed, each `[batch, tokens, hidden]` (the inference bank: its rows)."""
    if isinstance(state, BankState):  # one [tokens, NB, hidden] bank
        return list(state.bank.unflatten(0, state.shape[:2]).unbind(2))
    return [*state.rows, *([] if state.head is None else [state.head])]


def _forward(model, input_ids, **kwargs):
    out = model(input_ids, output_residual_state=True, **kwargs)
    return out, _rows(model, out.residual_state)


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _check_training(model, ref, tp, input_ids) -> None:
    out, rows = _forward(model, input_ids, labels=input_ids)
    out_ref, rows_ref = _forward(ref, input_ids, labels=input_ids)
    out.loss.backward()
    out_ref.loss.backward()
    torch.testing.assert_close(out.logits, out_ref.logits)
    torch.testing.assert_close(out.loss, out_ref.loss)
    mine = tp.local_tokens(SEQ)
    assert tp.sequence_sharded and mine.stop - mine.start == SEQ // 2
    assert len(rows) == len(rows_ref)
    for row, row_ref in zip(rows, rows_ref):
        torch.testing.assert_close(row, row_ref[:, mine])  # this rank's tokens of every row, and only those
    grads_ref = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), grads_ref[name], msg=name)
        assert p.grad.to_local().shape == p.to_local().shape, name  # a rank holds its part of each gradient


@torch.no_grad()
def _check_decode(model, ref, tp, input_ids) -> tuple[int, ...]:
    """Prefill (sequence-sharded, KV cache of this rank's heads) and one decode step (replicated) after it."""
    prompt, step = input_ids[:, :SEQ], input_ids[:, SEQ:]
    out, rows = _forward(model, prompt, use_cache=True)
    out_ref, rows_ref = _forward(ref, prompt, use_cache=True)
    torch.testing.assert_close(out.logits, out_ref.logits)
    for row, row_ref in zip(rows, rows_ref, strict=True):
        torch.testing.assert_close(row, row_ref[:, tp.local_tokens(SEQ)])
    nxt = model(step, cache=out.cache, use_cache=True)
    assert not tp.sequence_sharded  # one token a sequence: replicated over the ranks
    nxt_ref = ref(step, cache=out_ref.cache, use_cache=True)
    torch.testing.assert_close(nxt.logits, nxt_ref.logits)
    return tuple(nxt.cache.layers[0].keys.shape)


def _check_checkpointing(input_ids, case: str = "block") -> None:
    """Activation checkpointing recomputes whole decoder layers in backward, their collectives included."""
    ref = _model(case)
    model = copy.deepcopy(ref)
    parallelize_tensor(model)
    for m in (ref, model):
        m.train().activation_checkpointing_enable()
        m(input_ids, labels=input_ids).loss.backward()
    grads_ref = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), grads_ref[name], msg=name)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def _check_optimizer_steps(input_ids) -> None:
    """A few steps of a foreach optimizer with gradient clipping (every parameter a DTensor: no mixed lists) follow one
    process's losses and gradient norms. SGD: Adam's first steps move every coordinate by about the learning rate
    whatever its gradient's size, so rounding in near-zero gradients would show as noise."""
    ref = _model("full")
    model = copy.deepcopy(ref)
    parallelize_tensor(model)
    curves = []
    for m in (ref, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True)
        curve = []
        for _ in range(3):
            loss = m(input_ids, labels=input_ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            curve.append(torch.stack([loss.detach(), _full(norm)]))
        curves.append(torch.stack(curve))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # the tolerance of the data-parallel loss curves (test_data_parallel): sums over ranks round in another order
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=1e-6)


def _check_fsdp_by_tp(input_ids) -> None:
    """2-D: FSDP2 (`apply_fsdp` over "dp": a group per decoder layer, then the root) on the tensor-parallel model
    (over "tp"), torchtitan's order, on a 1 x 2 and a 2 x 1 mesh: each dp rank takes its rows of the batch, and the
    gradients are the one-process ones."""
    ref = _model("block")
    ref(input_ids, labels=input_ids).loss.backward()
    for shape in ((1, 2), (2, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        model = _model("block")
        parallelize_tensor(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"])
        rows = input_ids.chunk(shape[0])[mesh["dp"].get_local_rank()]
        model(rows, labels=rows).loss.backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad, msg=name)


def tensor_parallel_checks(rank: int) -> dict:
    input_ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    results = {}
    for case in CASES:
        ref = _model(case)
        model = copy.deepcopy(ref)
        tp = parallelize_tensor(model)
        _check_training(model, ref, tp, input_ids[:, :SEQ])
        cache_shape = _check_decode(model.eval(), ref.eval(), tp, input_ids)
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        experts = getattr(model.model.layers[0].mlp, "experts", None)
        results[case] = {"q_proj": tuple(q_proj.to_local().shape), "cache_keys": cache_shape,
                         "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                         "experts": experts and [tuple(p.to_local().shape) for p in (experts.gate_up_proj,
                                                                                      experts.down_proj)]}
    # a checkpoint: torch.distributed.checkpoint gathers the whole weights, the one-process model's
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.testing.assert_close(whole, ref.state_dict())
    _check_optimizer_steps(input_ids[:, :SEQ])
    _check_checkpointing(input_ids[:, :SEQ])
    _check_fsdp_by_tp(input_ids[:, :SEQ])
    # generate: a sharded prefill, then replicated decode steps on the KV cache
    generated = model.generate(input_ids[:, :SEQ], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(generated, ref.generate(input_ids[:, :SEQ], max_new_tokens=3, do_sample=False))
    with pytest.raises(ValueError, match="needs a sequence length that is a multiple of 2"):
        model.train()(input_ids[:, :3], labels=input_ids[:, :3])
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_tensor(model)
    _check_checkpointing(input_ids[:, :SEQ], "qwen3 (per-head norms in the attention)")  # replicated inside a body
    with pytest.raises(ValueError, match="num_key_value_heads = 1 does not split over 2"):
        parallelize_tensor(_model("standard", num_key_value_heads=1))
    with pytest.raises(ValueError, match="the 'qwen3_moe' sublayer 'mlp' has 3 experts, which do not split over 2"):
        parallelize_tensor(_model("qwen3_moe", num_experts=3, mlp_only_layers=[]))
    return results


@pytest.fixture(scope="module")
def tp_results():
    results = run_ranks(tensor_parallel_checks, 2, join_s=240)
    failed = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    return [results[r][1] for r in (0, 1)]


def test_tensor_parallel_equals_one_process(tp_results):
    """Each rank asserted the equalities inside; here: every rank holds half the query heads and half the KV heads."""
    d, heads, kv = TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"]
    head_dim = d // heads
    for result in tp_results:
        for case in CASES:
            assert result[case]["q_proj"] == (heads // 2 * head_dim, d)
            assert result[case]["cache_keys"] == (BATCH, kv // 2, SEQ + 1, head_dim)
            assert result[case]["tied"] == CASES[case].get("tie_word_embeddings", False)
            moe = CASES[case].get("moe_intermediate_size", TINY["intermediate_size"])  # Mixtral's: intermediate_size
            experts = [(2, 2 * moe, d), (2, d, moe)] if "num_experts_per_tok" in CASES[case] else None
            assert result[case]["experts"] == experts  # each rank: two whole experts of the four


def test_needs_a_mesh_or_a_process_group():
    with pytest.raises(ValueError, match="expected a DeviceMesh or an initialized process group"):
        parallelize_tensor(_model("standard"))
