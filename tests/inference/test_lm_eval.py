"""EleutherAI's lm-evaluation-harness scores AttnRes folders through its `hf` backend (no downloads): a converted
zero-query model exactly as the Llama it came from, the same at batch 1 and 4, and `python -m attnres.eval` runs
its command line on a local task."""

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnres
from attnres.tokenization import byte_tokenizer

import lm_eval
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

REQUESTS = [  # (context, continuation): ASCII, empty context (scored after the BOS/NUL), multi-byte UTF-8, lengths
    ("The cat", " sat on the mat"),
    ("", "hello"),
    ("héllo wörld", " 世界"),
    ("a" * 40, "b" * 10),
    ("x", "y"),
    ("def f():\n", "    return 1"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny random Llama over bytes and its zero-query Block AttnRes conversion, each saved with the byte
    tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
    )
    llama = LlamaForCausalLM(config).eval()
    converted = attnres.convert_from_hf(llama, residual="block", attn_res_block_size=2)
    root = tmp_path_factory.mktemp("lm_eval")
    for name, model in (("llama", llama), ("attnres", converted)):
        model.save_pretrained(root / name)
        byte_tokenizer(model_max_length=64).save_pretrained(root / name)
    return root


def scores(pretrained, batch_size: int) -> list[tuple[float, bool]]:
    lm = HFLM(pretrained=pretrained, backend="causal", batch_size=batch_size, device="cpu", dtype="float32")
    requests = [Instance("loglikelihood", {}, request, i) for i, request in enumerate(REQUESTS)]
    return lm.loglikelihood(requests, disable_tqdm=True)


def assert_same_scores(a, b) -> None:
    assert [greedy for _, greedy in a] == [greedy for _, greedy in b]
    for (x, _), (y, _) in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-5), (x, y)


def test_a_converted_model_scores_as_its_original_at_batch_1_and_4(folders):
    original = scores(str(folders / "llama"), 1)
    assert all(math.isfinite(s) and s < 0 for s, _ in original)
    converted = scores(str(folders / "attnres"), 1)
    assert_same_scores(converted, original)
    assert_same_scores(scores(str(folders / "attnres"), 4), converted)
    model = attnres.AttnResForCausalLM.from_pretrained(folders / "attnres").eval()  # a model object, not a folder
    lm = HFLM(pretrained=model, tokenizer=byte_tokenizer(model_max_length=64), backend="causal", batch_size=4)
    requests = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)]
    assert_same_scores(lm.loglikelihood(requests), converted)


def test_backend_causal_silences_the_model_type_warning(folders, caplog):
    warning = "neither marked as CausalLM or Seq2SeqLM"
    with caplog.at_level(logging.WARNING):
        HFLM(pretrained=str(folders / "attnres"), backend="default", device="cpu", dtype="float32")
    assert warning in caplog.text  # "attnres" is not in transformers' built-in table of causal model types
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        lm = HFLM(pretrained=str(folders / "attnres"), backend="causal", device="cpu", dtype="float32")
    assert warning not in caplog.text and lm.backend == "causal"


def test_the_lm_eval_command_line_with_attnres_registered(folders, tmp_path):
    """`python -m attnres.eval run ...` in a fresh interpreter, on a task read from a local JSON Lines file."""
    rows = [dict(context=c, continuation=t) for c, t in REQUESTS]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "tiny.yaml").write_text(
        "task: attnres_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n",
        encoding="utf-8",
    )
    command = [
        sys.executable, "-m", "attnres.eval", "run", "--model", "hf",
        "--model_args", f"pretrained={folders / 'attnres'},backend=causal,dtype=float32", "--device", "cpu",
        "--batch_size", "4", "--tasks", str(tmp_path / "tiny.yaml"), "--output_path", str(tmp_path / "out" / "r.json"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|attnres_tiny|" in done.stdout and "neither marked as CausalLM" not in done.stderr
    (results,) = (tmp_path / "out").glob("r_*.json")
    assert json.loads(results.read_text())["results"]["attnres_tiny"]["acc,none"] == 0.0  # a random model
