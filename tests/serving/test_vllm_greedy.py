"""AttnRes folders served by vLLM through the plugin (nothing imported by hand: the worker only calls `vllm.LLM`).

For llama, qwen3, qwen3_moe and gemma2, Block and Full, each a converted tiny model with its pseudo-queries and key
gains off their init: prompts of different lengths served together (one flattened batch per step, the depth
aggregation per token) give exactly the greedy tokens of transformers' `generate` on the same folder, in fp32, each
prompt generated alone. Served a second time they hit vLLM's prefix cache and give the same tokens. vLLM sees a text
model. Folders vLLM cannot serve are refused with a message naming the reason. A real checkpoint too: SmolLM2-135M
(tests/conftest.py) converted to Block as `attnres convert` does, a chat question and a source text, in fp32.

All cases run in one vLLM process (tests/serving/worker.py), started once for the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnres
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
REAL = "smollm2-135m-block"
REAL_TOKENS = 16


def real_checkpoint(source: Path, folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """SmolLM2-135M converted to Block (5 decoder layers a block) and saved to `folder`; its prompts (a chat question
    in its template, and the first 48 tokens of a standard-library source: one full cache block) and transformers'
    greedy tokens for them. vLLM runs past the end-of-turn token (the worker sets ignore_eos), so does the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model = attnres.convert_from_hf(original, residual="block", attn_res_block_size=5).eval()
    model.save_pretrained(folder)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"],
        tokenizer(Path(json.__file__).read_text(encoding="utf-8"))["input_ids"][:BLOCK + 16],
    ]
    model.generation_config.eos_token_id = None
    return prompts, [greedy(model, prompt, REAL_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def served(vllm_python, smollm2, tmp_path_factory):
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
    prompts, reference[REAL] = real_checkpoint(smollm2, root / REAL)
    cases.append(dict(name=REAL, model=str(root / REAL), prompts=prompts, max_tokens=REAL_TOKENS, repeat=True))
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


def test_a_real_checkpoint_gives_transformers_greedy_tokens(served):
    results, reference = served
    result = results[REAL]
    assert "error" not in result, result.get("error")
    assert result["architecture"] == "AttnResForCausalLM"
    assert result["tokens"] == reference[REAL]
    assert result["cached"][1] == BLOCK  # the source text's full block came from the cache
    assert result["tokens_again"] == reference[REAL]
