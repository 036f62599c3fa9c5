"""GGUF checkpoints (llama.cpp's single-file format) as plain transformers models with their tokenizer.

transformers reads a GGUF file itself (`from_pretrained(folder, gguf_file=name)`): it maps the architecture onto its
family, dequantizes every tensor and rebuilds the tokenizer and chat template from the file's metadata. What it
returns cannot be saved ("quantized with gguf"), so `load_gguf` moves the weights into a plain model of the same
family, which saves, converts and trains like any other. Before transformers sees the file, its header is checked,
so a truncated or corrupt file, an architecture transformers cannot load, or a file whose tokenizer cannot be rebuilt
each gets one clear error instead of a stack trace from deep inside a reader.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
_INSTALL_HINT = "reading GGUF files needs the `gguf` and `accelerate` packages: pip install 'attnres[gguf]'"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix: what a user passes where a model folder could be)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def gguf_architecture(path: str | os.PathLike) -> str:
    """The architecture a GGUF file declares (`general.architecture`), after checking that the whole file parses:
    a missing, truncated or corrupt file raises a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gguf: no file {path}")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"gguf: {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    try:
        reader = GGUFReader(path)  # parses the header and maps every tensor: a cut file fails here
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except KeyError:
        raise ValueError(f"gguf: {path} declares no general.architecture; it is not a model file") from None
    except Exception as e:  # noqa: BLE001 - the reader's errors on bad bytes are of many kinds; all mean the same
        raise ValueError(f"gguf: {path} is truncated or corrupt ({type(e).__name__}: {e})") from None


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = True):
    """The GGUF file `path` as `(model, tokenizer)`: a plain transformers causal LM of its family holding the
    dequantized weights in `dtype`, in eval mode, and the tokenizer with its chat template.

    Raises a ValueError naming the problem for a file that is not a complete GGUF model, an architecture transformers
    does not read, and a tokenizer it cannot rebuild (a model is never returned without one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging

    path = Path(path)
    architecture = gguf_architecture(path)
    try:  # the config alone: refuses an architecture transformers does not map onto a family
        load_gguf_checkpoint(str(path), return_tensors=False)
    except (ValueError, KeyError) as e:
        raise ValueError(f"gguf: {path.name} holds a {architecture!r} model that transformers cannot read: {e}") from None
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - missing or unreadable tokenizer metadata: one refusal
        raise ValueError(
            f"gguf: the tokenizer of {path.name} cannot be rebuilt ({type(e).__name__}: {e}); a model without its "
            f"tokenizer is not written"
        ) from None
    verbosity = logging.get_verbosity()
    if not progress:
        logging.set_verbosity_error()
        logging.disable_progress_bar()
    try:
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"gguf: transformers cannot load {path.name}: {e}") from None
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
    return _plain_copy(quantized), tokenizer


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


def gguf_to_folder(path: str | os.PathLike, dst: str | os.PathLike, progress: bool = True) -> Path:
    """Write the GGUF file `path` as a plain transformers folder `dst` (fp32 safetensors, config, generation config,
    tokenizer with its chat template), atomically: a reader sees no folder or the complete one."""
    from attnres.atomic import atomic_write_dir

    model, tokenizer = load_gguf(path, progress=progress)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_write_dir(dst, write)
