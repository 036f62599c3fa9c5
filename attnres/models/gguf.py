"""GGUF checkpoints (llama.cpp's single-file format) as plain transformers models with their tokenizer.

transformers reads a GGUF file itself (`from_pretrained(folder, gguf_file=name)`): it maps the architecture onto its
family, dequantizes every tensor and rebuilds the tokenizer and chat template from the file's metadata. What it
returns cannot be saved ("quantized with gguf"), so `load_gguf` moves the weights into a plain model of the same
family, which saves, converts and trains like any other.

Before transformers sees the file, `read_gguf_header` walks its header and tensor table and checks that every tensor
lies inside the file, so a truncated or corrupt file gets one clear error instead of a stack trace from deep inside a
reader. Then, in this order and before any weight is read: an architecture transformers cannot read, and a tokenizer
it cannot rebuild from the file, are refused with a ValueError naming the file; then a weight of the family's model
that the file lacks (or holds in another shape), which transformers would leave at a random init. transformers reads
only the file: it is shown to transformers alone in a folder of its own, so files beside it (another model's
`tokenizer_config.json`) change nothing.
"""

from __future__ import annotations

import contextlib
import copy
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
GGUF_VERSIONS = (2, 3)  # v1 (2023) counted in 32 bits; neither transformers nor llama.cpp reads it any more
INSTALL_HINT = "reading GGUF files needs the `gguf` and `accelerate` packages: pip install -e \".[gguf]\""

# the GGUF metadata value types (gguf.GGUFValueType): the fixed-size ones as struct formats; 8 is a string, 9 an array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix: what a user passes where a model folder could be)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file declares, read without touching its tensor data."""

    architecture: str  # `general.architecture`, llama.cpp's name (e.g. "llama", "qwen2moe")
    tokenizer: str | None  # `tokenizer.ggml.model`: "gpt2" (byte-level BPE), "llama" (sentencepiece), ...
    tensors: int
    size: int  # bytes, the whole file


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file `path`, after checking the whole file's layout: the magic bytes, the version, every
    metadata entry, the tensor table, and that each tensor's data lies inside the file. A missing file raises
    FileNotFoundError; anything else wrong raises a ValueError naming the file and what is wrong ("truncated", "not a
    GGUF file", "corrupt")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gguf: no file {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ValueError(f"gguf: {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        block_sizes = _block_sizes()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return _walk(blob, size, block_sizes)
            except _Bad as e:
                raise ValueError(f"gguf: {path} is {e.what} ({e})") from None
            except (struct.error, UnicodeDecodeError) as e:
                raise ValueError(f"gguf: {path} is corrupt ({e})") from None


def gguf_architecture(path: str | os.PathLike) -> str:
    """The architecture the GGUF file `path` declares, after `read_gguf_header`'s checks."""
    return read_gguf_header(path).architecture


def gguf_config(path: str | os.PathLike):
    """The transformers config of the model in the GGUF file `path` (its family's config class), without reading a
    tensor. Raises a ValueError for a file that is not a complete GGUF model or an architecture transformers does not
    read."""
    header = read_gguf_header(path)
    with _alone(path) as (folder, name):
        return _family_config(folder, name, header)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True, config=None):
    """The GGUF file `path` as `(model, tokenizer)`: a plain transformers causal LM of its family holding the
    dequantized weights in `dtype`, in eval mode, and the tokenizer with its chat template. `config`: the file's
    config if already read (`gguf_config`), so that it is not parsed again.

    Raises a ValueError naming the problem for a file that is not a complete GGUF model, an architecture transformers
    does not read, a tokenizer it cannot rebuild (all three before any tensor is read), and a file missing a weight of
    its family's model or holding one of another shape (transformers would leave it at a random init)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    header = read_gguf_header(path)
    _require_packages()
    path = Path(path)
    with _alone(path) as (folder, name):
        if config is None:
            config = _family_config(folder, name, header)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as e:  # noqa: BLE001 - missing or unreadable tokenizer metadata, of many kinds: one refusal
            declared = f"tokenizer.ggml.model {header.tokenizer!r}" if header.tokenizer else "no tokenizer.ggml.model"
            raise ValueError(
                f"gguf: the tokenizer of {path.name} cannot be rebuilt from the file (it declares {declared}; "
                f"{type(e).__name__}: {e}); a model without its tokenizer is not loaded"
            ) from None
        shown, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
        logging.set_verbosity_error()  # its loading report: what matters in it is refused below, in one line
        if not progress:
            logging.disable_progress_bar()
        try:
            quantized, report = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, config=config, dtype=dtype, output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported, then refused below with the others
            )
        except (ValueError, RuntimeError) as e:  # not a causal LM (T5, encoders), a weight that does not convert
            raise ValueError(f"gguf: transformers cannot load {path.name} as a causal LM: {e}") from None
        finally:
            logging.set_verbosity(verbosity)
            (logging.enable_progress_bar if shown else logging.disable_progress_bar)()
    wrong = [f"{key} is missing" for key in sorted(report["missing_keys"])] + [
        f"{key} has shape {tuple(theirs)} in the file, {tuple(ours)} in the model"
        for key, theirs, ours in sorted(report["mismatched_keys"])
    ]
    if wrong:  # transformers would leave them at a random init: a model that runs but is not the file's
        raise ValueError(
            f"gguf: {path.name} does not hold the weights of its {config.model_type} model: "
            f"{'; '.join(wrong[:4])}{f' (and {len(wrong) - 4} more)' if len(wrong) > 4 else ''}"
        )
    return _plain_copy(quantized), tokenizer


def gguf_to_folder(path: str | os.PathLike, dst: str | os.PathLike, progress: bool = True) -> Path:
    """Write the GGUF file `path` as a plain transformers folder `dst` (fp32 safetensors, config, generation config,
    tokenizer with its chat template), atomically: a reader sees no folder or the complete one."""
    from attnres.atomic import atomic_write_dir

    model, tokenizer = load_gguf(path, progress=progress)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_write_dir(dst, write)


# ---------------------------------------------------------------------------------------------------------------------


class _Bad(Exception):
    """What is wrong with a file's layout: `what` is "truncated", "corrupt", or "truncated or corrupt" (a header that
    runs past the end of the file: a cut file, or a length that is garbage)."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


def _overrun(size: int, needed: int) -> _Bad:
    return _Bad("truncated or corrupt", f"it ends at byte {size}, inside its header, which needs byte {needed}")


class _Reader:
    """A cursor over the file's bytes that refuses to read past its end."""

    def __init__(self, blob, size: int):
        self.blob, self.size, self.pos = blob, size, 0

    def take(self, fmt: str):
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise _overrun(self.size, self.pos + width)
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += width
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > self.size:
            raise _overrun(self.size, self.pos + length)
        text = bytes(self.blob[self.pos : self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def skip(self, length: int) -> None:
        if self.pos + length > self.size:
            raise _overrun(self.size, self.pos + length)
        self.pos += length


def _walk(blob, size: int, block_sizes: dict[int, tuple[int, int]]) -> GGUFHeader:
    r = _Reader(blob, size)
    r.pos = len(GGUF_MAGIC)
    version = r.take("<I")
    if version not in GGUF_VERSIONS:
        raise _Bad("corrupt", f"it declares GGUF version {version}; only versions 2 and 3 are read")
    tensor_count, kv_count = r.take("<Q"), r.take("<Q")
    if max(tensor_count, kv_count) > size:  # each entry takes at least a byte: a count beyond that is garbage
        raise _Bad("corrupt", f"it declares {tensor_count} tensors and {kv_count} metadata entries in {size} bytes")
    metadata = {}
    for _ in range(kv_count):
        key = r.string()
        kind = r.take("<I")
        metadata[key] = _value(r, kind, key)
    tensors = []
    for _ in range(tensor_count):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        ggml_type, offset = r.take("<I"), r.take("<Q")
        if ggml_type not in block_sizes:
            raise _Bad("corrupt", f"tensor {name} has the unknown ggml type {ggml_type}")
        elements, (block, block_bytes) = math.prod(dims), block_sizes[ggml_type]
        tensors.append((name, offset, elements // block * block_bytes))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1:
        raise _Bad("corrupt", f"general.alignment is {alignment!r}")
    data_start = -(-r.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        end = data_start + offset + nbytes
        if end > size:
            raise _Bad("truncated", f"it has {size} bytes, and tensor {name} ends at byte {end}")
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise _Bad("corrupt", "it declares no general.architecture, which a model file has")
    tokenizer = metadata.get("tokenizer.ggml.model")
    return GGUFHeader(architecture, tokenizer if isinstance(tokenizer, str) else None, len(tensors), size)


def _value(r: _Reader, kind: int, key: str):
    """One metadata value (arrays of strings are skipped: a vocabulary is read by transformers, when needed)."""
    if kind in _SCALAR:
        return r.take(_SCALAR[kind])
    if kind == _STRING:
        return r.string()
    if kind != _ARRAY:
        raise _Bad("corrupt", f"metadata {key!r} has the unknown value type {kind}")
    element, count = r.take("<I"), r.take("<Q")
    if element == _STRING:
        for _ in range(count):
            r.skip(r.take("<Q"))
    elif element in _SCALAR:
        r.skip(count * struct.calcsize(_SCALAR[element]))
    else:  # arrays of arrays: no metadata key in use has one
        raise _Bad("corrupt", f"metadata {key!r} is an array of the unsupported value type {element}")
    return count


def _block_sizes() -> dict[int, tuple[int, int]]:
    """`{ggml type id: (elements a block, bytes a block)}`, from the `gguf` package (which transformers needs too)."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


@contextlib.contextmanager
def _alone(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """`(folder, name)` under which transformers sees the GGUF file `path` alone: a temporary folder holding a link to
    it. transformers reads `tokenizer_config.json` from the folder of the file it is given; a file of another model
    beside a GGUF file would otherwise change its tokenizer."""
    path = Path(path).resolve()
    with tempfile.TemporaryDirectory(prefix="attnres-gguf-") as folder:
        try:
            os.symlink(path, Path(folder) / path.name)
            linked = True
        except OSError:  # no symbolic links here (Windows without the privilege): the file's own folder
            linked = False
        yield (folder if linked else str(path.parent)), path.name


def _require_packages() -> None:
    """transformers reads GGUF files with `gguf` (the config of most architectures) and `accelerate` (the weights)."""
    import importlib.util

    if any(importlib.util.find_spec(package) is None for package in ("gguf", "accelerate")):
        raise ImportError(INSTALL_HINT)


def _family_config(folder: str, name: str, header: GGUFHeader):
    from transformers import AutoConfig

    _require_packages()
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"gguf: {name} holds a {header.architecture!r} model, which transformers cannot read: {e}"
        ) from None


def _plain_copy(quantized):
    """The same model without the GGUF quantization record, so that it saves: a fresh instance of its class built
    on the meta device from its config, holding its (already dequantized) tensors."""
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    for name, buffer in quantized.named_buffers():  # rotary frequencies: not in the state dict
        owner, _, attr = name.rpartition(".")
        plain.get_submodule(owner).register_buffer(attr, buffer, persistent=False)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    return plain.eval()
