"""The token-sharded Block prefill on 2 gloo ranks equals the unsharded forward; foreign bank rows are refused."""

import pytest
import torch

from attnres.distributed.token_shard import ShardedBank, TokenShard, token_sharded_prefill
from attnres.models import AttnResConfig, AttnResForCausalLM


def _tiny_block_model() -> AttnResForCausalLM:
    config = AttnResConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, residual="block", attn_res_block_size=2,
    )
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).eval()
    with torch.no_grad():  # non-zero pseudo-queries: the depth softmax is not uniform
        for point in model.aggregation_points():
            point.proj.weight.normal_()
    return model


def compare_with_unsharded(rank: int) -> dict:
    model = _tiny_block_model()
    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))  # 9 tokens: 4 + 5
    with torch.no_grad():
        state = model.forward_state()  # hands us the forward's stream afterwards
        full_logits = model(input_ids, attn_res=state).logits
    full = ShardedBank(state.stream.bank, state.stream.nvb, TokenShard(0, 1, 9), batch=2)

    logits, bank = token_sharded_prefill(model, input_ids)
    shard = bank.shard
    torch.testing.assert_close(logits, full_logits[:, shard.start : shard.stop])
    mine = range(shard.start, shard.stop)
    torch.testing.assert_close(bank.read(mine), full.read(mine))
    foreign = range(0, 1) if rank == 1 else range(shard.stop - 1, shard.stop + 1)  # straddles into rank 1's rows
    with pytest.raises(ValueError, match="was written by rank"):
        bank.read(foreign)
    return {"positions": (shard.start, shard.stop), "bank_rows": bank.bank.shape[0], "written": bank.written}


def test_sharded_prefill_equals_unsharded_forward(two_ranks):
    """`two_ranks` ran `compare_with_unsharded` on 2 gloo ranks (see conftest.py); it asserts inside each rank."""
    results, _ = two_ranks
    rows = 3  # bank rows written: the embedding, block 1 (layers 0-1); block 2 is the prefix at the final read
    assert results["token_shard"] == [{"positions": (0, 4), "bank_rows": 2 * 4, "written": rows - 1},
                                      {"positions": (4, 9), "bank_rows": 2 * 5, "written": rows - 1}]


def test_bank_read_guard_without_a_process_group():
    bank = ShardedBank(torch.zeros(2 * 3, 4, 8), written=2, shard=TokenShard(1, 3, 9), batch=2)  # positions 3..5
    assert bank.read(range(3, 6)).shape == (2, 3, 2, 8)
    with pytest.raises(ValueError, match="position 6 was written by rank 2"):
        bank.read(range(5, 7))
    with pytest.raises(ValueError, match="position 2 was written by rank 0"):
        bank.read(range(2, 4))
    with pytest.raises(ValueError, match="positions: expected a non-empty range"):
        bank.read(range(4, 4))


def test_sharded_prefill_needs_a_process_group():
    with pytest.raises(ValueError, match="expected an initialized process group"):
        token_sharded_prefill(_tiny_block_model(), torch.zeros(1, 4, dtype=torch.long))
