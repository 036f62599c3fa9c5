"""GGUF files (`attnres.models.gguf`, `attnres convert model.gguf`): tiny ones written with `gguf.GGUFWriter`.

A good file converts with its tokenizer and chat template. A bad one gets one line from `attnres convert` (exit
status 2, no traceback) naming what is wrong, and no folder is written: a file cut short or corrupt, one that is not
GGUF, an architecture transformers cannot read, a family that is not PreNorm (refused before any weight is read), a
tokenizer that cannot be rebuilt, a file missing a weight or holding one of another shape, and a machine without the
`gguf` package. The real file, SmolLM2-135M's, is tests/models/test_real_checkpoint.py's.
"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnres.models.gguf as gguf_module
from attnres.cli import main
from attnres.models import AttnResForCausalLM
from attnres.models.gguf import INSTALL_HINT, load_gguf, read_gguf_header

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
LAYERS, DIM, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128


def byte_vocabulary() -> list[str]:
    """A byte-level BPE vocabulary: the 256 byte symbols, one merge, an end-of-text token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "<|endoftext|>"]


def write_gguf(path: Path, arch: str = "llama", tokenizer: str | None = "gpt2", parallel: bool = False,
               drop: str | None = None, widen: str | None = None) -> Path:
    """A tiny random model of `arch` as a GGUF file (fp32 tensors, llama.cpp's names). `tokenizer`: the
    `tokenizer.ggml.model` it declares (None: no tokenizer at all); `parallel`: no `ffn_norm` (StableLM's parallel
    residual); `drop`: a tensor left out; `widen`: a tensor written with 32 more columns."""
    try:
        import gguf
    except ImportError:  # the tests fail with the install command, never skip
        pytest.fail(INSTALL_HINT, pytrace=False)

    rng = np.random.default_rng(0)
    vocab = byte_vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_vocab_size(len(vocab))
    if arch == "stablelm":  # LayerNorms, a quarter of each head rotated
        writer.add_layer_norm_eps(1e-5)
        writer.add_rope_dimension_count(DIM // HEADS // 4)
    else:
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(DIM // HEADS)
    if tokenizer is not None:
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(vocab)
        writer.add_token_types([1] * (len(vocab) - 1) + [3])  # the last one a control token
        writer.add_token_merges(["Ġ t"])
        writer.add_bos_token_id(len(vocab) - 1)
        writer.add_eos_token_id(len(vocab) - 1)
        writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, *shape: int, center: float = 0.0) -> None:
        if name == drop:
            return
        if name == widen:
            shape = (*shape[:-1], shape[-1] + 32)
        writer.add_tensor(name, (center + 0.2 * rng.standard_normal(shape)).astype(np.float32))

    head = DIM // HEADS
    norms = ("weight", "bias") if arch == "stablelm" else ("weight",)
    add("token_embd.weight", len(vocab), DIM)
    for kind in norms:
        add(f"output_norm.{kind}", DIM, center=float(kind == "weight"))
    add("output.weight", len(vocab), DIM)
    for i in range(LAYERS):
        for kind in norms:
            add(f"blk.{i}.attn_norm.{kind}", DIM, center=float(kind == "weight"))
        add(f"blk.{i}.attn_q.weight", HEADS * head, DIM)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * head, DIM)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * head, DIM)
        add(f"blk.{i}.attn_output.weight", DIM, HEADS * head)
        if not parallel:
            for kind in norms:
                add(f"blk.{i}.ffn_norm.{kind}", DIM, center=float(kind == "weight"))
        add(f"blk.{i}.ffn_gate.weight", FFN, DIM)
        add(f"blk.{i}.ffn_up.weight", FFN, DIM)
        add(f"blk.{i}.ffn_down.weight", DIM, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def refused(argv: list[str], capsys) -> str:
    """The one line `attnres convert` printed on stderr for an expected mistake (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.splitlines()[-1]  # progress bars may come first, where the weights were read
    assert line.startswith("attnres convert: error: "), err
    return line


def assert_nothing_written(dst: Path) -> None:
    assert not dst.exists() and not list(dst.parent.glob(".tmp-*"))


def test_a_gguf_file_converts_with_its_tokenizer_and_chat_template(tiny, tmp_path, capsys):
    original, tokenizer = load_gguf(tiny, progress=False)
    assert type(original).__name__ == "LlamaForCausalLM" and tokenizer.chat_template == CHAT_TEMPLATE
    dst = tmp_path / "out"
    assert main(["convert", str(tiny), str(dst), "--residual", "full"]) == 0
    assert "converted 2-layer llama to residual=full" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(model) is AttnResForCausalLM
    saved = AutoTokenizer.from_pretrained(dst)
    assert saved.chat_template == CHAT_TEMPLATE and (dst / "chat_template.jinja").is_file()
    text = "the cat sat <|endoftext|>"
    assert saved(text).input_ids == tokenizer(text).input_ids
    ids = torch.tensor([saved(text).input_ids])
    with torch.no_grad():
        expected = original(ids).logits
        assert ((model(ids).logits - expected).norm() / expected.norm()).item() < 1e-5


def test_files_beside_the_gguf_file_do_not_change_its_tokenizer(tiny, tmp_path):
    """transformers reads `tokenizer_config.json` from the folder of the file it is given: the file is shown to it
    alone, so another model's files beside it change nothing."""
    folder = tmp_path / "shared"
    folder.mkdir()
    shutil.copy(tiny, folder / "tiny.gguf")
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer", "chat_template": "other"}')
    _, tokenizer = load_gguf(folder / "tiny.gguf", progress=False)
    _, alone = load_gguf(tiny, progress=False)
    assert type(tokenizer) is type(alone) and "Bert" not in type(tokenizer).__name__
    assert tokenizer.chat_template == CHAT_TEMPLATE


def _cut(data: bytes, size: int) -> bytes:
    return data[:size]


def _patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


def _first_key_length(data: bytes) -> int:
    return struct.unpack_from("<Q", data, 24)[0]


# (id, how the good file's bytes are spoiled, what the one line says)
SPOILED = [
    ("empty", lambda d: b"", "is not a GGUF file"),
    ("text", lambda d: b"hello world\n", "is not a GGUF file (it starts with b'hell'"),
    ("cut-in-the-magic", lambda d: _cut(d, 3), "is not a GGUF file"),
    ("cut-in-the-counts", lambda d: _cut(d, 10), "is truncated or corrupt (it ends at byte 10, inside its header"),
    ("cut-in-the-metadata", lambda d: _cut(d, 3000), "is truncated or corrupt (it ends at byte 3000, inside its header"),
    ("cut-in-the-tensors", lambda d: _cut(d, len(d) - 100), "is truncated (it has"),
    ("version", lambda d: _patched(d, 4, struct.pack("<I", 7)), "is corrupt (it declares GGUF version 7"),
    ("count", lambda d: _patched(d, 8, struct.pack("<Q", 2**60)), "is corrupt (it declares 1152921504606846976 tensors"),
    ("string-length", lambda d: _patched(d, 24, struct.pack("<Q", 2**40)), "is truncated or corrupt"),
    ("value-type", lambda d: _patched(d, 32 + _first_key_length(d), struct.pack("<I", 99)),
     "is corrupt (metadata 'general.architecture' has the unknown value type 99)"),
    ("utf-8", lambda d: _patched(d, 32, b"\xff\xfe"), "is corrupt ('utf-8' codec can't decode"),
]


@pytest.mark.parametrize("spoil, message", [pytest.param(s, m, id=i) for i, s, m in SPOILED])
def test_a_cut_or_corrupt_file_is_one_line(tiny, tmp_path, capsys, spoil, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(spoil(tiny.read_bytes()))
    dst = tmp_path / "out"
    line = refused(["convert", str(bad), str(dst)], capsys)
    assert line.startswith(f"attnres convert: error: gguf: {bad} ") and message in line, line
    assert_nothing_written(dst)
    with pytest.raises(ValueError, match="gguf: "):  # the library raises what the command prints
        read_gguf_header(bad)


def test_a_family_that_is_not_prenorm_is_refused_before_its_weights_are_read(tmp_path, capsys, monkeypatch):
    """StableLM with a parallel residual (no ffn_norm: attention and MLP read the same norm): transformers reads it,
    AttnRes refuses it with the reason, from the config alone."""
    path = write_gguf(tmp_path / "stablelm.gguf", arch="stablelm", parallel=True)
    monkeypatch.setattr(gguf_module, "load_gguf", _refuse_loading)
    dst = tmp_path / "out"
    line = refused(["convert", str(path), str(dst)], capsys)
    assert "the 'stablelm' decoder layer feeds its attention and its MLP the same input (a parallel residual)" in line
    assert_nothing_written(dst)


def _refuse_loading(*args, **kwargs):
    raise AssertionError("the weights were read before the family was checked")


def test_the_prenorm_form_of_the_same_family_converts(tmp_path, capsys):
    path = write_gguf(tmp_path / "stablelm.gguf", arch="stablelm")
    assert main(["convert", str(path), str(tmp_path / "out"), "--block-size", "1"]) == 0
    assert "converted 2-layer stablelm to residual=block" in capsys.readouterr().out


def test_an_architecture_transformers_cannot_read_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "bert.gguf", arch="bert")
    dst = tmp_path / "out"
    line = refused(["convert", str(path), str(dst)], capsys)
    assert "gguf: bert.gguf holds a 'bert' model, which transformers cannot read" in line
    assert_nothing_written(dst)


@pytest.mark.parametrize("tokenizer, declared", [("rwkv", "tokenizer.ggml.model 'rwkv'"),
                                                 (None, "no tokenizer.ggml.model")], ids=["rwkv", "none"])
def test_a_tokenizer_that_cannot_be_rebuilt_is_refused_by_name(tmp_path, capsys, monkeypatch, tokenizer, declared):
    path = write_gguf(tmp_path / "notok.gguf", tokenizer=tokenizer)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", _refuse_loading)
    dst = tmp_path / "out"
    line = refused(["convert", str(path), str(dst)], capsys)
    assert f"gguf: the tokenizer of notok.gguf cannot be rebuilt from the file (it declares {declared}" in line
    assert line.endswith("a model without its tokenizer is not loaded")
    assert_nothing_written(dst)


@pytest.mark.parametrize("spoil, message", [
    (dict(drop="blk.1.ffn_down.weight"), "model.layers.1.mlp.down_proj.weight is missing"),
    (dict(widen="blk.1.ffn_down.weight"), "model.layers.1.mlp.down_proj.weight has shape (64, 160) in the file, "
                                          "(64, 128) in the model"),
], ids=["missing", "shape"])
def test_a_file_without_every_weight_is_refused_not_filled_at_random(tmp_path, capsys, spoil, message):
    """transformers loads such a file with the weight at a random init, and says so only in a warning."""
    path = write_gguf(tmp_path / "partial.gguf", **spoil)
    dst = tmp_path / "out"
    line = refused(["convert", str(path), str(dst)], capsys)
    assert line == f"attnres convert: error: gguf: partial.gguf does not hold the weights of its llama model: {message}"
    assert_nothing_written(dst)


def test_without_the_gguf_package_the_error_is_the_install_command(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    dst = tmp_path / "out"
    line = refused(["convert", str(tiny), str(dst)], capsys)
    assert line == f"attnres convert: error: {INSTALL_HINT}" and 'pip install -e ".[gguf]"' in line
    assert_nothing_written(dst)
    with pytest.raises(ImportError, match="needs the `gguf` and `accelerate` packages"):
        load_gguf(tiny)
