"""AttnRes folders served by vLLM through the plugin (nothing imported by hand: the worker only calls `vllm.LLM`).

For llama, qwen3, qwen3_moe and gemma2, Block and Full, each a converted tiny model with its pseudo-queries and key
gains off their init: prompts of different lengths served together (one flattened batch per step, the depth
aggregation per token) give exactly the greedy tokens of transformers' `generate` on the same folder, in fp32, each
prompt generated alone. Served a second time they hit vLLM's prefix cache and give the same tokens. vLLM sees a text
model. Folders vLLM cannot serve are refused with a message naming the reason.

All cases run in one vLLM process (tests/serving/worker.py), started once for the module.
"""

from __future__ import annotations

import pytest

from tests.serving.conftest import run_worker
from tests.serving.families import BASE, FAMILIES, RESIDUALS, greedy, save_converted

MAX_TOKENS = 10
BLOCK = 32  # the engine's KV-cache block (tests/serving/conftest.py ENGINE)
# different lengths; the first fills two cache blocks, so a second round reuses them
PROMPTS = [
    [(7 * i + 3) % BASE["vocab_size"] for i in range(2 * BLOCK + 6)],
    [9, 1],
    [64, 3, 3, 120, 7, 45, 19],
    [5, 17, 3, 99, 42, 8, 61, 2, 77, 30, 11, 4],
]
CASES = [f"{family}-{residual}" for family in FAMILIES for residual in RESIDUALS]
# folders vLLM cannot serve: (name, family, residual, config overrides, what the message must name)
REFUSED = [
    ("head-dim-16", "llama", "block", dict(head_dim=16), "head_dim 16"),
    ("no-vllm-family", "helium", "block", {}, "vLLM has no model class HeliumForCausalLM"),
]


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    """(vLLM's results by case, transformers' greedy tokens by case)."""
    root = tmp_path_factory.mktemp("vllm_greedy")
    cases, reference = [], {}
    for name in CASES:
        family, residual = name.rsplit("-", 1)
        model = save_converted(family, residual, root / name)
        reference[name] = [greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
        cases.append(dict(name=name, model=str(root / name), prompts=PROMPTS, max_tokens=MAX_TOKENS, repeat=True))
    for name, family, residual, overrides, _ in REFUSED:
        save_converted(family, residual, root / name, **overrides)
        cases.append(dict(name=name, model=str(root / name), prompts=PROMPTS[:1], max_tokens=1))
    return run_worker(vllm_python, cases, root), reference


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(served, case):
    results, reference = served
    result = results[case]
    assert "error" not in result, result.get("error")
    assert result["architecture"] == "AttnResForCausalLM"
    assert result["tokens"] == reference[case]


@pytest.mark.parametrize("case", CASES)
def test_prefix_cache_hit_gives_same_tokens(served, case):
    results, reference = served
    result = results[case]
    assert result["prefix_caching"]
    assert result["cached"][0] == 2 * BLOCK  # the long prompt's two full blocks came from the cache
    assert result["tokens_again"] == reference[case]


@pytest.mark.parametrize("case", CASES)
def test_vllm_sees_a_text_model(served, case):
    assert served[0][case]["multimodal"] is False


@pytest.mark.parametrize("name, message", [pytest.param(r[0], r[4], id=r[0]) for r in REFUSED])
def test_unservable_folder_refused_clearly(served, name, message):
    error = served[0][name].get("error")
    assert error is not None and message in error, error
