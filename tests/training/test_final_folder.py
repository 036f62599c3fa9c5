"""A finished run is a standard transformers folder (`final/`): the byte tokenizer as a transformers tokenizer with the
training ids, atomic writes, and loading in a fresh interpreter with nothing but `import attnres`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.atomic import atomic_write_dir
from attnres.cli import main
from attnres.tokenization import byte_tokenizer, is_byte_tokenizer
from attnres.training import ByteTokenizer, TrainConfig, latest_checkpoint, read_corpus, tokenize_and_split, train

TEXTS = ["def f(x):\n    return x  # ASCII\n", "héllo wörld", "日本語のテキスト", "emoji 🙂 and Ā (U+0100)",
         "\t\r\n ~"]


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    """`threads` sets torch's process-wide thread count: give the next test modules theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def tiny(out, **overrides) -> TrainConfig:
    settings = dict(
        data="stdlib", max_bytes=20_000, residual="block", block_size=1, layers=2, dim=16, heads=2, ffn=32,
        seq_len=16, batch_size=2, steps=4, warmup=1, eval_interval=2, eval_batches=1, log_interval=1,
        checkpoint_interval=100, out=str(out), progress=False, threads=1,
    )
    return TrainConfig(**{**settings, **overrides})


def greedy(model, tokenizer, prompt: str, new: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=0, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


def test_the_byte_tokenizer_has_the_training_ids(tmp_path):
    tokenizer = byte_tokenizer()
    assert len(tokenizer) == ByteTokenizer.vocab_size == 256 and is_byte_tokenizer(tokenizer)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == ByteTokenizer.separator_id
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert is_byte_tokenizer(reloaded)
    for tok in (tokenizer, reloaded):
        for text in TEXTS:
            expected = ByteTokenizer().encode(text.encode("utf-8")).tolist()
            assert tok(text, add_special_tokens=False)["input_ids"] == expected, text
            assert tok(text)["input_ids"] == [0, *expected]  # a document start, as `attnres generate` prompts
            assert tok.decode(expected) == text and tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
        assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character decodes as the replacement
        assert tok("a\0b", add_special_tokens=False)["input_ids"] == [97, 0, 98]
    # the training stream: documents joined by the separator, as the tokenizer's special token
    docs = [t.encode("utf-8") for t in TEXTS]
    (tmp_path / "docs").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "docs" / f"{i}.txt").write_bytes(doc)
    splits = tokenize_and_split(read_corpus(str(tmp_path / "docs"), 10_000), ByteTokenizer(), val_fraction=0.0)
    joined = "\0".join(TEXTS) + "\0"
    assert splits.train.tolist() == tokenizer(joined, add_special_tokens=False)["input_ids"]


def test_atomic_write_dir_leaves_the_old_folder_or_the_new_one(tmp_path):
    target = tmp_path / "final"
    atomic_write_dir(target, lambda d: (d / "a.txt").write_text("old"))

    def fail(folder):
        (folder / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_dir(target, fail)
    assert (target / "a.txt").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    atomic_write_dir(target, lambda d: (d / "b.txt").write_text("new"))
    assert [p.name for p in target.iterdir()] == ["b.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step byte-level run, stopped after 2 steps and resumed to its end."""
    out = tmp_path_factory.mktemp("runs") / "run"
    train(tiny(out, stop_after=2))
    assert not (out / "final").exists()  # a run stopped early is not finished
    result = train(tiny(out, resume=True))
    return out, result


def test_a_finished_run_writes_a_transformers_folder(run):
    out, result = run
    final = out / "final"
    names = sorted(p.name for p in final.iterdir())
    assert names == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    saved = load_file(str(final / "model.safetensors"))
    checkpoint = load_file(str(latest_checkpoint(out / "checkpoints") / "model.safetensors"))
    assert saved.keys() == checkpoint.keys() and all(torch.equal(saved[k], checkpoint[k]) for k in saved)
    config = json.loads((final / "config.json").read_text())
    generation = json.loads((final / "generation_config.json").read_text())
    assert config["model_type"] == "attnres" and config["text_config"]["max_position_embeddings"] == 16
    for c in (config["text_config"], generation):
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (0, 0, 0)
    assert AutoTokenizer.from_pretrained(final).model_max_length == 16


def test_a_fresh_interpreter_loads_the_run_with_import_attnres_alone(run):
    """`import attnres` registers the Auto classes: AutoModelForCausalLM, AutoTokenizer and pipeline load `final/`
    with no attnres name used, no trust_remote_code."""
    out, result = run
    final = out / "final"
    script = f"""
import json, sys
import attnres
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
model = AutoModelForCausalLM.from_pretrained({str(final)!r}).eval()
tokenizer = AutoTokenizer.from_pretrained({str(final)!r})
ids = tokenizer("def ", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
text = pipeline("text-generation", model={str(final)!r})("def ", max_new_tokens=6, do_sample=False)
print(json.dumps([type(model).__name__, type(tokenizer).__name__, out, text[0]["generated_text"]]))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    name, tokenizer_name, ids, text = json.loads(done.stdout.strip().splitlines()[-1])
    model, tokenizer = result.model.eval(), byte_tokenizer()
    expected = greedy(model, tokenizer, "def ", 6)
    assert name == "AttnResForCausalLM" and ids == expected
    assert text == "def " + bytes(i for i in expected if i).decode("utf-8", errors="replace")


def test_generate_reads_the_runs_final_folder_or_its_last_checkpoint(run, tmp_path, capsys):
    out, result = run
    args = ["--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]
    assert main(["generate", "--model", str(out), *args]) == 0
    from_final = capsys.readouterr().out
    expected = greedy(result.model.eval(), byte_tokenizer(), "def ", 8)
    assert from_final == "def " + bytes(i for i in expected if i).decode("utf-8", errors="replace") + "\n"
    assert main(["generate", "--model", str(out / "final"), *args]) == 0
    assert capsys.readouterr().out == from_final
    # a run without final/ (stopped early, or older than final/): its last checkpoint, the same weights here
    older = tmp_path / "older"
    older.mkdir()
    for name in ("config.json", "checkpoints"):
        os.symlink(out / name, older / name)
    assert main(["generate", "--model", str(older), *args]) == 0
    assert capsys.readouterr().out == from_final
    for name in ("config.json", "checkpoints"):
        (older / name).unlink()
    older.joinpath("config.json").write_text((out / "config.json").read_text())
    with pytest.raises(ValueError, match="has neither a final/ folder nor a checkpoint yet"):
        main(["generate", "--model", str(older), *args, "--debug"])


def test_overwrite_removes_the_final_folder(run, tmp_path):
    out = tmp_path / "again"
    train(tiny(out, steps=1, eval_interval=1))
    assert (out / "final").is_dir()
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny(out, steps=1, eval_interval=1))
    train(tiny(out, steps=2, stop_after=1, eval_interval=1, overwrite=True))
    assert not (out / "final").exists()
