"""`attnres generate` and `attnres convert` end to end on tiny local folders (no downloads)."""

import io
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from attnres.cli import main
from attnres.inference import ByteStreamer, load_for_generation
from attnres.models import AttnResForCausalLM
from attnres.training.checkpoint import save_checkpoint
from tests.models.test_modeling import randomize_attnres_


def byte_model(tiny_config, **overrides):
    model = AttnResForCausalLM(tiny_config(**{"vocab_size": 256, "initializer_range": 0.2, **overrides})).eval()
    randomize_attnres_(model)
    return model


def greedy_continuation(model, prompt: str, new: int) -> str:
    """What the byte-level model continues `prompt` with, greedily, after the document separator (NUL)."""
    ids = torch.tensor([[0, *prompt.encode()]])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=0, pad_token_id=0)[0, ids.shape[1] :]
    return bytes(i for i in out.tolist() if i != 0).decode("utf-8", errors="replace")


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w1")


def test_generate_streams_greedy_bytes_from_a_saved_model(tiny_config, tmp_path, capsys):
    model = byte_model(tiny_config)
    model.save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "héllo ", "--max-new-tokens", "20", "--temperature", "0"]) == 0
    expected = greedy_continuation(model, "héllo ", 20)
    assert len(expected) > 5 and capsys.readouterr().out == "héllo " + expected + "\n"


def test_generate_leaves_transformers_progress_bars_as_they_were(tiny_config, tmp_path, capsys):
    """The loading bar is off while `attnres generate` loads (nothing before the text), and only then: a program
    that runs the command in its own process keeps its bars."""
    from transformers.utils import logging as hf_logging

    byte_model(tiny_config).save_pretrained(tmp_path)
    hf_logging.enable_progress_bar()
    main(["generate", "--model", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2", "--temperature", "0"])
    assert hf_logging.is_progress_bar_enabled()
    assert "Loading" not in capsys.readouterr().err


def test_generate_from_a_training_run_folder(tiny_config, tmp_path, capsys):
    model = byte_model(tiny_config)
    (tmp_path / "config.json").write_text(json.dumps({"train": {"tokenizer": "bytes"}, "model": model.config.to_dict()}))
    save_checkpoint(tmp_path / "checkpoints", 3, model, {})
    main(["generate", "--model", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"])
    assert capsys.readouterr().out == "def " + greedy_continuation(model, "def ", 8) + "\n"


def test_generate_samples_reproducibly_with_the_folders_tokenizer(tiny_config, tmp_path, capsys):
    model = byte_model(tiny_config, vocab_size=64)
    model.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer = load_for_generation(tmp_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and type(loaded) is AttnResForCausalLM
    args = ["generate", "--model", str(tmp_path), "--prompt", "w3 w4", "--max-new-tokens", "6", "--seed", "3"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first and first.startswith("w3 w4") and len(first.split()) > 2


def test_byte_streamer_waits_for_complete_characters():
    out = io.StringIO()
    streamer = ByteStreamer(out)
    streamer.put(torch.tensor([[0, 104, 105]]))  # the prompt: skipped
    streamer.put(torch.tensor([0xC3]))  # the first byte of "é"
    assert out.getvalue() == ""
    streamer.put(torch.tensor([0xA9]))
    streamer.put(torch.tensor([0]))  # the document separator is not printed
    streamer.end()
    assert out.getvalue() == "é\n"


def test_generate_clamps_new_tokens_to_the_context_left(tiny_config, tmp_path, capsys):
    model = byte_model(tiny_config, max_position_embeddings=16)
    model.save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--temperature", "0"]
    assert main(base + ["--prompt", "x" * 20]) == 2
    assert re.search(r"prompt: its 21 tokens leave no room .* context of 16 positions", capsys.readouterr().err)
    assert main(base + ["--prompt", "x" * 15]) == 2
    assert "prompt: its 16 tokens leave no room" in capsys.readouterr().err
    assert main(base + ["--prompt", "x" * 9]) == 0  # the default --max-new-tokens 128 on a 16-position model
    out, err = capsys.readouterr()
    assert "max_new_tokens 128 lowered to 6: the prompt's 10 tokens leave 6 of the model's 16 positions" in err
    assert out == "x" * 9 + greedy_continuation(model, "x" * 9, 6) + "\n"
    byte_model(tiny_config, max_position_embeddings=128).save_pretrained(tmp_path / "128")
    assert main(["generate", "--model", str(tmp_path / "128"), "--prompt", "hi"]) == 0  # every default
    assert "max_new_tokens 128 lowered to 125: the prompt's 3 tokens" in capsys.readouterr().err


def test_convert_writes_an_attnres_folder_with_the_same_logits(tmp_path, capsys):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
    )
    source = LlamaForCausalLM(config).eval()
    src, dst = tmp_path / "llama", tmp_path / "attnres"
    source.save_pretrained(src)
    word_tokenizer().save_pretrained(src)
    with pytest.raises(ValueError, match="holds a 'llama' model, not an AttnRes one; convert it first"):
        load_for_generation(src)

    assert main(["convert", str(src), str(dst), "--block-size", "2"]) == 0
    assert "residual=block, 2 decoder layers a block" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(model) is AttnResForCausalLM and model.config.attn_res_block_size == 2
    assert (dst / "tokenizer.json").is_file() and not list(tmp_path.glob(".tmp-*"))
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = source(ids).logits
        assert ((model(ids).logits - expected).norm() / expected.norm()).item() < 1e-5
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2  # an expected mistake: one line on stderr, no traceback
    err = capsys.readouterr().err
    assert err.startswith("attnres convert: error: dst: ") and "already exists" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="dst: .* already exists"):  # --debug shows the traceback
        main(["convert", str(src), str(dst), "--debug"])
    main(["convert", str(src), str(tmp_path / "full"), "--residual", "full", "--no-rescale"])
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full").config
    assert full.residual == "full" and not full.attn_res_rescale_mixture


@pytest.mark.parametrize("argv, message", [
    (["convert", "no_such_dir", "out"], "src: no folder no_such_dir; to fetch a Hugging Face Hub name, pass --allow-download"),
    (["train", "--steps", "0"], "steps"),
])
def test_an_expected_mistake_is_one_line_on_stderr_and_exit_status_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATTNRES_DEBUG", raising=False)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"attnres {argv[0]}: error: ") and message in out.err, out.err
    assert out.err.count("\n") == 1 and "Traceback" not in out.err
    monkeypatch.setenv("ATTNRES_DEBUG", "1")
    with pytest.raises((ValueError, OSError)):
        main(argv)
    monkeypatch.delenv("ATTNRES_DEBUG")
    with pytest.raises((ValueError, OSError)):
        main(["--debug", *argv])
