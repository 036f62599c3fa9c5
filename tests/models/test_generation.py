"""Generation with the KV cache: cached decoding reproduces full forwards, in `generate`, sampling and `pipeline`.

The AttnRes stream (and the Block bank) is per forward; only the attention keys and values persist across steps.
"""

import pytest
import torch
from transformers import DynamicCache, PreTrainedTokenizerFast, pipeline

from attnres.layers import bank
from attnres.models import AttnResForCausalLM

from .test_modeling import randomize_attnres_

# (residual, attn_res_block_size) on 4 decoder layers: standard, Full, Block at 1 (Full's grouping), 2 and 3 (a
# block ends mid-model), so write layers fall both in the prompt's forward and in every decode step
KINDS = [("standard", 2), ("full", 2), ("block", 1), ("block", 2), ("block", 3)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_model(tiny_config, residual="block", block_size=2, **overrides):
    """Random nonzero queries and gains, and a wider init, so that tokens differ and argmax ties are unlikely."""
    config = tiny_config(
        residual=residual, attn_res_block_size=block_size, num_hidden_layers=4, initializer_range=0.2, **overrides
    )
    model = AttnResForCausalLM(config).eval()
    randomize_attnres_(model)
    return model


def left_padded_batch():
    """Three prompts of 7, 4 and 1 tokens, left-padded with id 0."""
    lengths = [7, 4, 1]
    ids = torch.randint(1, 64, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, : 7 - n] = 0
        mask[row, : 7 - n] = 0
    return ids, mask


@pytest.mark.parametrize("residual, block_size", KINDS, ids=lambda v: str(v))
def test_greedy_with_cache_equals_greedy_without(tiny_config, residual, block_size):
    model = random_model(tiny_config, residual, block_size)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (3, 17)
    assert torch.equal(cached, uncached)
    assert len(cached[:, 7:].unique()) > 3  # a real continuation, not one repeated token
    for row, n in ((1, 4), (2, 1)):  # padding is invisible: a padded prompt continues as it does alone
        alone = model.generate(ids[row : row + 1, 7 - n :], max_new_tokens=10, do_sample=False)
        assert torch.equal(alone[0, n:], cached[row, 7:])


@pytest.mark.parametrize("batch", [1, 3, 16, 64])
def test_cached_decode_step_matches_a_full_forward(tiny_config, batch, monkeypatch):
    """A decode step (T = batch tokens) through the fused bank path gives the last-token logits of a full forward."""
    made = []
    start = bank.BlockBank.start
    # a forward's bank starts at layer 0 from the embedding (later layers read the state it hands on)
    monkeypatch.setattr(bank.BlockBank, "start", lambda self, emb: made.append(emb.shape) or start(self, emb))
    model = random_model(tiny_config, "block", 3)
    ids = torch.randint(0, 64, (batch, 9))
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).cache
        step = model(ids[:, 6:7], cache=cache).logits[:, -1]
        chunk = model(ids[:, 7:], cache=cache).logits  # several new tokens after a cache: the offset causal mask
        full = model(ids).logits
    assert made[1] == (batch, 1, 32)  # the decode step went through the bank, one row per sequence
    assert cache.get_seq_length() == 9
    assert rel_err(step, full[:, 6]) < 1e-5
    assert rel_err(chunk, full[:, 7:]) < 1e-5


def test_sampling_is_seeded_and_unchanged_by_the_cache(tiny_config):
    model = random_model(tiny_config)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.95, pad_token_id=0)
    runs = []
    for seed, use_cache in ((1, True), (1, False), (1, True), (2, True)):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, use_cache=use_cache, **kwargs))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], runs[3])
    assert runs[0].min() >= 0 and runs[0].max() < 64


def test_sliding_window_cache_keeps_the_window_and_matches_no_cache(tiny_config):
    model = random_model(tiny_config, base_model_type="mistral", sliding_window=3)
    ids = torch.randint(1, 64, (2, 6))
    cached = model.generate(ids, max_new_tokens=8, do_sample=False)
    uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    assert cache.layers[0].is_sliding and cache.layers[0].keys.shape[-2] == 2  # DynamicCache keeps window - 1 keys
    far = ids.clone()
    far[:, 0] = (ids[:, 0] + 1) % 64
    window_one = random_model(tiny_config, base_model_type="mistral", sliding_window=1)  # each position sees only itself: no token mixing
    with torch.no_grad():
        a, b = window_one(ids).logits, window_one(far).logits
    assert torch.equal(a[:, 1:], b[:, 1:]) and not torch.equal(a[:, 0], b[:, 0])


def test_pipeline_text_generation_with_a_local_tokenizer(tiny_config):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(64)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0")
    model = random_model(tiny_config)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompt = "w3 w14 w15 w9"
    text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)[0, 4:]
    assert text.split() == [f"w{i}" for i in expected.tolist()]


def test_cache_arguments(tiny_config):
    model = random_model(tiny_config)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache)  # the older name of `cache`
        assert out.cache is cache and cache.get_seq_length() == 5
        assert model(ids, use_cache=False).cache is None
        model.train()
        assert model(ids).cache is None  # training mode starts no cache
        model.eval()
        with pytest.raises(ValueError, match="cache, past_key_values: pass the KV cache once"):
            model(ids, cache=DynamicCache(), past_key_values=DynamicCache())
        with pytest.raises(TypeError, match="cache: expected a transformers Cache"):
            model(ids, cache=((torch.zeros(1),),))
        with pytest.raises(ValueError, match=r"attention_mask: expected a \[batch, seq\] = \[2, 6\] .* 5 cached"):
            model(ids[:, :1], cache=cache, attention_mask=torch.ones(2, 1))


def test_dynamic_rope_past_max_position_embeddings_matches_the_family():
    """Dynamic NTK rope rescales only past max_position_embeddings: the converted model follows Llama there too,
    with and without the KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnres

    torch.manual_seed(0)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=8, rope_parameters=rope)).eval()
    model = attnres.convert_from_hf(llama, residual="block", attn_res_block_size=1)
    ids = torch.randint(0, 64, (1, 14))
    with torch.no_grad():
        want = llama(ids).logits
        assert ((model(ids).logits - want).norm() / want.norm()) < 1e-5
    greedy = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, **greedy), llama.generate(ids, **greedy))