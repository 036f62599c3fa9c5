"""Corpus reading, tokenizers, the train/validation split and the seeded window sampler."""

import sys
import types

import pytest
import torch

from attnres.training.data import (
    ByteTokenizer,
    Corpus,
    WindowSampler,
    check_fits,
    eval_batches,
    load_tokenizer,
    read_corpus,
    tokenize_and_split,
)


def test_stdlib_corpus_is_deterministic_capped_and_leaves_out_installed_packages():
    a = read_corpus("stdlib", max_bytes=300_000)
    b = read_corpus("stdlib", max_bytes=300_000)
    assert a.documents == b.documents
    assert a.num_bytes == 300_000  # the last file is cut to fit exactly
    assert "standard library" in a.description
    # the stdlib folder holds site-packages, whose files (torch, ...) differ between machines: never read
    big = read_corpus("stdlib", max_bytes=1 << 40)
    import json  # a stdlib module: its source must be there

    assert open(json.__file__, "rb").read() in big.documents
    assert open(pytest.__file__, "rb").read() not in big.documents


def test_folder_reads_text_files_recursively_in_sorted_order_skipping_binary_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second")
    (tmp_path / "a.md").write_text("first")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "d.dat").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / ".hidden").write_text("hidden")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden too")
    corpus = read_corpus(tmp_path, max_bytes=1000)
    assert corpus.documents == [b"first", b"second"]
    assert read_corpus([tmp_path / "b" / "2.txt", tmp_path / "a.md"], max_bytes=1000).documents == [b"second", b"first"]
    assert read_corpus(tmp_path, max_bytes=8).documents == [b"first", b"sec"]


def test_bad_data_fails_at_once_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"data: no such file or directory: .*missing"):
        read_corpus(tmp_path / "missing", max_bytes=100)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="data: the corpus is empty"):
        read_corpus(tmp_path, max_bytes=100)
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="data: .*blob.bin is not a UTF-8 text file"):
        read_corpus(tmp_path / "blob.bin", max_bytes=100)
    with pytest.raises(ValueError, match=r"expected hf:NAME"):
        read_corpus("hf:", max_bytes=100)


def test_hf_dataset_without_the_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError, match=r"data='hf:wikitext'.*pip install datasets"):
        read_corpus("hf:wikitext", max_bytes=100)


def test_hf_dataset_is_streamed_up_to_max_bytes_from_the_named_split_and_column(monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"content": "first row"}, {"content": ""}, {"content": "second row"}, {"content": "never read"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = read_corpus("hf:org/code:python:valid:content", max_bytes=15)
    assert calls == [("org/code", "python", "valid", True)]
    assert corpus.documents == [b"first row", b"second"]
    with pytest.raises(ValueError, match=r"data='hf:org/code': cannot read the dataset: KeyError: 'text'"):
        read_corpus("hf:org/code", max_bytes=100)  # the default column "text" is not there
    assert calls[-1] == ("org/code", None, "train", True)


def test_byte_tokenizer_joins_documents_with_nul_and_holds_out_the_tail():
    corpus = Corpus([b"ab", b"cde"], "two docs")
    splits = tokenize_and_split(corpus, ByteTokenizer(), val_fraction=0.3)
    stream = torch.cat([splits.train, splits.val])
    assert stream.tolist() == [97, 98, 0, 99, 100, 101, 0]
    assert len(splits.val) == 2 and splits.val.tolist() == [101, 0]
    assert ByteTokenizer().decode(splits.train) == "ab\0cd"


def test_sequence_longer_than_either_split_is_refused_naming_seq_len():
    corpus = Corpus([b"x" * 99], "tiny")
    splits = tokenize_and_split(corpus, ByteTokenizer(), val_fraction=0.1)  # 90 train, 10 val tokens
    check_fits(splits, seq_len=10, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"seq_len=11 is longer than the validation split \(10 tokens"):
        check_fits(splits, seq_len=11, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"seq_len=91 is longer than the training split \(90 tokens"):
        check_fits(splits, seq_len=91, val_fraction=0.1)


def test_sampler_is_seeded_resumable_and_draws_contiguous_windows():
    tokens = torch.arange(1000, dtype=torch.int32)
    a = WindowSampler(tokens, seq_len=16, batch_size=4, seed=3)
    b = WindowSampler(tokens, seq_len=16, batch_size=4, seed=3)
    first = a.next_batch()
    assert first.dtype == torch.int64 and first.shape == (4, 16)
    assert torch.equal(first - first[:, :1], torch.arange(16).expand(4, 16))  # windows are contiguous
    assert torch.equal(first, b.next_batch())
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(3)]
    c = WindowSampler(tokens, seq_len=16, batch_size=4, seed=99)
    c.load_state_dict(state)
    assert all(torch.equal(x, c.next_batch()) for x in expected)
    assert not torch.equal(WindowSampler(tokens, 16, 4, seed=4).next_batch(), first)


def test_sampler_reaches_the_last_window():
    tokens = torch.arange(5)
    sampler = WindowSampler(tokens, seq_len=4, batch_size=64, seed=0)
    assert set(sampler.next_batch()[:, 0].tolist()) == {0, 1}


def test_eval_batches_are_fixed_and_span_the_split():
    tokens = torch.arange(500)
    batches = eval_batches(tokens, seq_len=10, batch_size=3, num_batches=2)
    assert [b.shape for b in batches] == [(3, 10), (3, 10)]
    assert batches[0][0, 0] == 0 and batches[-1][-1, -1] == 499
    assert all(torch.equal(x, y) for x, y in zip(batches, eval_batches(tokens, 10, 3, 2)))


def test_hugging_face_tokenizer_from_a_local_folder(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == raw.get_vocab_size() and tokenizer.separator_id == raw.token_to_id("</s>")
    corpus = Corpus([b"def f(x):", b"return x"], "two docs")
    splits = tokenize_and_split(corpus, tokenizer, val_fraction=0.2)
    stream = torch.cat([splits.train, splits.val]).tolist()
    assert stream.count(tokenizer.separator_id) == 2 and stream[-1] == tokenizer.separator_id
    assert tokenizer.decode(torch.tensor(stream[: stream.index(tokenizer.separator_id)])).strip() == "def f(x):"
    with pytest.raises(ValueError, match=r"tokenizer='no/such-tokenizer'.*only local files"):
        load_tokenizer("no/such-tokenizer")
