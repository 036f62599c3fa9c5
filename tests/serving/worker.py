"""Runs inside the vLLM venv (tests/serving drive it in a subprocess): serves each case's folder with `vllm.LLM` in
this one process and writes what came out as JSON.

    python worker.py SPEC.json OUT.json

SPEC: {"engine": {LLM keyword arguments}, "cases": [{"name", "model", "prompts": [[token ids], ...], "max_tokens",
"repeat": serve the prompts a second time (prefix caching)}]}. OUT: per case name either {"tokens": [[...], ...],
"cached": [cached prompt tokens of the second round], "multimodal", "prefix_caching", "architecture"} or
{"error": "<type>: <message>"} (a folder vLLM refused).
"""

from __future__ import annotations

import gc
import json
import sys


def serve(case: dict, engine: dict) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=case["model"], **engine)
    except Exception as error:  # the refusal is the result
        return {"error": f"{type(error).__name__}: {error}"}
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if case.get("repeat"):
        again = llm.generate(prompts, params, use_tqdm=False)
        result["tokens_again"] = [list(o.outputs[0].token_ids) for o in again]
        result["cached"] = [o.num_cached_tokens for o in again]
    config = llm.llm_engine.vllm_config
    result["multimodal"] = config.model_config.is_multimodal_model
    result["prefix_caching"] = bool(config.cache_config.enable_prefix_caching)
    result["architecture"] = config.model_config.architecture
    del llm
    gc.collect()
    return result


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    results = {case["name"]: serve(case, spec["engine"]) for case in spec["cases"]}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
