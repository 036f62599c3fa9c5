"""Training data: a corpus read into one token stream, a held-out tail for validation, and seeded batches.

The default corpus needs no download: the `.py` sources of the Python standard library that ship with the
interpreter, read in sorted path order (so every machine with the same Python reads the same bytes), without
`site-packages`. `--data` takes text files, folders (recursive) or `hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]`.

Documents are joined with the tokenizer's separator id into one 1-D stream. The last `val_fraction` of the
stream is the validation split (whole files at the end, so validation text is unseen). Training batches are
random contiguous windows drawn from a seeded `torch.Generator`, whose state travels with the checkpoints.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnres.tokenization import BYTE_VOCAB_SIZE, SEPARATOR_ID

STDLIB = "stdlib"  # the `data` value that selects the default corpus
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SNIFF_BYTES = 8192


# ---------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Bytes are the tokens: ids 0..255, no ids reserved.

    The NUL byte (id 0) separates documents. Text files never contain it (a file with NUL bytes is not read as
    text), so it acts as an end-of-document token without growing the vocabulary past 256.
    `attnres.tokenization.byte_tokenizer()` is the same tokenizer as a transformers one (a run's `final/` holds it).
    """

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    separator_id = SEPARATOR_ID

    def encode(self, document: bytes) -> torch.Tensor:
        """`[n]` uint8 ids of one document."""
        return torch.frombuffer(bytearray(document), dtype=torch.uint8) if document else torch.empty(0, dtype=torch.uint8)

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer; documents are separated by its EOS id (or nothing, when it has none)."""

    def __init__(self, name: str, local_files_only: bool = True):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"tokenizer={name!r}: a Hugging Face tokenizer needs the `transformers` package") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
        except Exception as e:  # noqa: BLE001 - any failure to load is the same user error
            hint = " (only local files are searched; pass allow_download / --allow-download)" if local_files_only else ""
            raise ValueError(f"tokenizer={name!r}: cannot load it{hint}: {e}") from e
        self.name = name
        self.vocab_size = len(self.tokenizer)
        self.separator_id = self.tokenizer.eos_token_id

    def encode(self, document: bytes) -> torch.Tensor:
        ids = self.tokenizer(document.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist())


def load_tokenizer(name: str, allow_download: bool = False) -> ByteTokenizer | HFTokenizer:
    """`"bytes"` for the byte-level tokenizer, else a Hugging Face tokenizer name or local folder."""
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    return HFTokenizer(name, local_files_only=not allow_download)


# ---------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    """Raw documents in reading order and a one-line description of where they came from."""

    documents: list[bytes]
    description: str

    @property
    def num_bytes(self) -> int:
        return sum(len(d) for d in self.documents)


def read_corpus(data: str | os.PathLike | list, max_bytes: int) -> Corpus:
    """Read at most `max_bytes` of text from `data` (see the module docstring); the last document is cut to fit.

    `data` is `"stdlib"`, `"hf:..."`, a path, or a list of paths. Raises ValueError naming `data` for a path
    that does not exist, a dataset that cannot be read, or a corpus with no text at all.
    """
    if isinstance(data, (list, tuple)):
        paths = [Path(p) for p in data]
        description = ", ".join(str(p) for p in paths)
    elif str(data) == STDLIB:
        return _read_files(_stdlib_files(), max_bytes, f"Python {sysconfig.get_python_version()} standard library sources")
    elif str(data).startswith("hf:"):
        return _read_hf_dataset(str(data), max_bytes)
    else:
        paths = [Path(data)]
        description = str(data)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"data: no such file or directory: {', '.join(missing)}")
    return _read_files(_text_files(paths), max_bytes, description)


@functools.lru_cache(maxsize=1)  # the walk takes a noticeable fraction of a second; runs in a row share it
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(p for p in _walk_sorted(root) if p.suffix == ".py")


def _text_files(paths: list[Path]) -> list[Path]:
    """Named files as given (they must be text); folders recursively, sorted, skipping hidden and binary files."""
    files = []
    for path in paths:
        if path.is_dir():
            files.extend(p for p in _walk_sorted(path) if _looks_like_text(p))
        elif _looks_like_text(path):
            files.append(path)
        else:
            raise ValueError(f"data: {path} is not a UTF-8 text file")
    return files


def _walk_sorted(root: Path) -> list[Path]:
    """Every file under `root` except hidden ones and installed packages, in sorted path order."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        found.extend(Path(folder) / n for n in names if not n.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _looks_like_text(path: Path) -> bool:
    """No NUL byte and valid UTF-8 in the first 8 KiB (a multi-byte character cut at the end is fine)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _read_files(files: Sequence[Path], max_bytes: int, description: str) -> Corpus:
    documents, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        with open(path, "rb") as f:
            document = f.read(min(max_bytes - total, os.fstat(f.fileno()).st_size))
        if b"\0" in document:  # the sniffed head was clean but the rest is binary: not a text file after all
            continue
        if document:
            documents.append(document)
            total += len(document)
    _check_not_empty(documents, description)
    return Corpus(documents, f"{description}: {len(documents)} files, {total} bytes")


def _read_hf_dataset(spec: str, max_bytes: int) -> Corpus:
    """`hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]` (empty fields take the defaults: no config, `train`, `text`), streamed."""
    fields = spec[len("hf:") :].split(":")
    if not fields[0] or len(fields) > 4:
        raise ValueError(f"data={spec!r}: expected hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]")
    name, config, split, column = (fields + [""] * 3)[:4]
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data={spec!r}: Hugging Face datasets need the `datasets` package (pip install datasets)") from None
    try:
        rows = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        documents, total = [], 0
        for row in rows:
            text = row[column or "text"]
            document = text.encode("utf-8")[: max_bytes - total]
            if document:
                documents.append(document)
                total += len(document)
            if total >= max_bytes:
                break
    except Exception as e:  # noqa: BLE001 - network, name, split and column errors all mean the same to the user
        raise ValueError(f"data={spec!r}: cannot read the dataset: {type(e).__name__}: {e}") from e
    _check_not_empty(documents, spec)
    return Corpus(documents, f"{spec}: {len(documents)} rows, {total} bytes")


def _check_not_empty(documents: list[bytes], description: str) -> None:
    if not documents:
        raise ValueError(f"data: the corpus is empty: no text found in {description}")


# ---------------------------------------------------------------------------------------------- token stream


@dataclass(frozen=True)
class TokenSplits:
    """The token stream cut in two: `train` `[n_train]` and `val` `[n_val]` (uint8 or int32 ids)."""

    train: torch.Tensor
    val: torch.Tensor
    fingerprint: str  # sha256 of the whole stream: a resumed run checks it trains on the same tokens


def tokenize_and_split(corpus: Corpus, tokenizer, val_fraction: float) -> TokenSplits:
    """Encode every document, join with the separator, and hold out the last `val_fraction` of the tokens."""
    separator = [] if tokenizer.separator_id is None else [tokenizer.separator_id]
    pieces = []
    for document in corpus.documents:
        ids = tokenizer.encode(document)
        pieces.append(ids)
        pieces.append(torch.tensor(separator, dtype=ids.dtype))
    stream = torch.cat(pieces)
    n_val = int(len(stream) * val_fraction)
    fingerprint = hashlib.sha256(stream.numpy().tobytes()).hexdigest()
    return TokenSplits(stream[: len(stream) - n_val], stream[len(stream) - n_val :], fingerprint)


def check_fits(splits: TokenSplits, seq_len: int, val_fraction: float) -> None:
    """Both splits must hold at least one window of `seq_len` tokens."""
    total = len(splits.train) + len(splits.val)
    if len(splits.train) < seq_len:
        raise ValueError(
            f"seq_len={seq_len} is longer than the training split ({len(splits.train)} tokens of {total}): "
            "lower seq_len or give more data (data, max_bytes)"
        )
    if len(splits.val) < seq_len:
        raise ValueError(
            f"seq_len={seq_len} is longer than the validation split ({len(splits.val)} tokens, "
            f"val_fraction={val_fraction} of {total}): lower seq_len, raise val_fraction or give more data"
        )


class WindowSampler:
    """Batches of random contiguous windows, `[batch_size, seq_len]` int64, from a seeded generator.

    The generator state is the whole iterator state: `state_dict()` / `load_state_dict()` make a resumed run
    draw the same batches as an uninterrupted one.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if len(tokens) < seq_len:
            raise ValueError(f"seq_len={seq_len} is longer than the {len(tokens)} tokens to sample from")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len)

    def next_batch(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.seq_len + 1, (self.batch_size,), generator=self.generator)
        return self.tokens[starts[:, None] + self._offsets].long()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def eval_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, num_batches: int) -> list[torch.Tensor]:
    """A fixed validation set: `num_batches` batches `[batch_size, seq_len]` of windows spread evenly over `tokens`."""
    n = num_batches * batch_size
    starts = torch.linspace(0, len(tokens) - seq_len, n, dtype=torch.float64).long()  # exact for any length
    windows = tokens[starts[:, None] + torch.arange(seq_len)].long()
    return list(windows.split(batch_size))
