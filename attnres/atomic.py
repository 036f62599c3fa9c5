"""Atomic writes: a reader sees the old file (or folder) or the complete new one, never a partial one.

The new content is written beside its destination under a hidden temporary name, fsynced, then renamed into place
with `os.replace`; a crash at any point leaves no partial file under the destination's name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"  # the temporary names' prefix: what a killed writer leaves behind starts with it


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)` on a temporary file beside `path`, fsync it, then rename it to `path`.

    Readers see the old file or the complete new one, never a partial one; the temporary file is removed if
    `write` fails.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` on an empty temporary folder beside `path`, fsync its files, then rename it to `path`.

    A folder already at `path` is first renamed aside and removed once the new one is in place, so a reader sees
    the old complete folder, or (for the instant between the two renames) none, or the new complete one; never a
    partial one. The temporary folder is removed if `write` fails.
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    old = path.with_name(f"{TMP_PREFIX}{path.name}.old.{os.getpid()}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        fsync_tree(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def fsync_tree(folder: Path) -> None:
    """Make every file under `folder`, and the folder's entries, durable (before it is renamed into place)."""
    for file in folder.rglob("*"):
        if file.is_file():
            _fsync(file)
    _fsync_dir(folder)


def replace_durably(src: Path, dst: Path) -> None:
    """`os.replace(src, dst)`, made durable in `dst`'s folder."""
    os.replace(src, dst)
    _fsync_dir(dst.parent)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; directories cannot be opened for fsync on Windows, where this is skipped."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
