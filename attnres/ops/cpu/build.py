"""Compile the CPU kernel at first use and load it as `torch.ops.attnres_cpu`.

The kernel is built by the system C++ compiler (`$CXX`, default `c++`) straight into a shared library that
registers its ops with the PyTorch dispatcher: no ninja, no pybind11, no Python headers. It is compiled for the
machine it runs on (`-march=native`) and cached under `$ATTNRES_CACHE_DIR` (default `~/.cache/attnres`), keyed by
the source, the torch version, the compiler command and the CPU, so a later process only loads it. A build takes
about 45 s of one core, once per machine and torch version. A build no process has loaded for `UNUSED_DAYS` days is
removed when another is made: a machine that follows the source would otherwise keep every build (about 1.3 MB each).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

SOURCE = Path(__file__).with_name("depth_attention.cpp")
CACHE_ENV = "ATTNRES_CACHE_DIR"
UNUSED_DAYS = 30
FLAGS = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-DNDEBUG", "-w"]

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnres"
    return Path(os.environ.get(CACHE_ENV, default))


def _cpu_signature() -> str:
    """What -march=native depends on, so that a cache shared between machines never serves a foreign binary."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def compile_command(source: Path, library: Path) -> list[str]:
    lib_dirs = cpp_extension.library_paths()
    return [
        *shlex.split(os.environ.get("CXX", "c++")),
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(source),
        "-o",
        str(library),
        *(f"-L{p}" for p in lib_dirs),
        *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
    ]


def build_library() -> Path:
    """Path of the compiled library, compiling it first unless the cache already holds it.

    Raises `RuntimeError` with the compiler's output when compilation fails.
    """
    command = " ".join(compile_command(SOURCE, Path("library.so")))
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), command.encode(), _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = cache_dir()
    library = folder / f"attnres_cpu_{key}.so"
    if library.exists():
        _mark_used(library)
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # one compiler at a time: processes started together (test workers) wait for the first instead of all
    # compiling; the library is written under a private name and renamed, so no one loads a half-written file
    with open(folder / f"attnres_cpu_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        log.info("compiling the attnres CPU kernel into %s (once per machine and torch version)", library)
        try:
            result = subprocess.run(compile_command(SOURCE, Path(tmp)), capture_output=True, text=True)
            if result.returncode != 0:
                tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
                raise RuntimeError(f"compiling {SOURCE.name} failed (exit {result.returncode}):\n{tail}")
            os.replace(tmp, library)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    prune_unused(folder, keep=library)
    return library


def _mark_used(library: Path) -> None:
    """A build's modification time is when a process last loaded it, which `prune_unused` goes by (a read-only cache
    keeps its times)."""
    try:
        os.utime(library)
    except OSError:
        pass


def prune_unused(folder: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Removes the builds in `folder` that no process has loaded for `UNUSED_DAYS` days, but `keep`, with their lock
    files; returns them. One removed while a process loads it makes that process fall back to the torch path."""
    oldest = (time.time() if now is None else now) - UNUSED_DAYS * 86400
    removed = []
    for build in folder.glob("attnres_cpu_*.so"):
        try:
            if build != keep and build.stat().st_mtime < oldest:
                build.unlink()
                build.with_suffix(".lock").unlink(missing_ok=True)
                removed.append(build)
        except OSError:  # another process removed it first
            pass
    return removed
