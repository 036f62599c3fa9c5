"""Install, from a folder of wheels, each package this Python lacks or has at another version, into a folder of its own
(the caller puts it ahead on PYTHONPATH): how benchmarks/gpu_check.sh brings a GPU machine without network to the
versions the check needs. A package at the wheel's own version is left as it is; one at any other version is not (the
GPU machine's transformers 5.17 imports attnres but names the KV cache differently). Standard library only: it runs
before anything is installed.

    python benchmarks/gpu_wheels.py wheels/ /tmp/attnres-gpu-site
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path


def wheel_version(wheel: Path) -> tuple[str, str]:
    """(distribution, version) from a wheel's file name: distribution-version(-build)?-python-abi-platform.whl."""
    parts = wheel.name.split("-")
    if not wheel.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"wheels: expected files named distribution-version-python-abi-platform.whl, got {wheel.name}")
    return parts[0], parts[1]


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(wheels: list[Path], site: Path) -> list[str]:
    """Install into `site` (emptied first) every wheel whose package is missing or at another version; one line per
    wheel saying what was found and done."""
    shutil.rmtree(site, ignore_errors=True)
    needed, lines = [], []
    for wheel in sorted(wheels):
        dist, want = wheel_version(wheel)
        have = installed_version(dist)
        if have == want:
            lines.append(f"{dist} {want}: installed")
        else:
            needed.append(wheel)
            lines.append(f"{dist} {want}: from {wheel} (found: {have or 'none'})")
    if needed:  # one pip call: the wheels share folders such as bin/, which separate calls would not replace
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(site), *map(str, needed)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines.append(f"installed {len(needed)} wheels into {site}" if done.returncode == 0 else
                     f"install into {site} FAILED (pip exited {done.returncode}): {done.stderr.strip()[-2000:]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheels", type=Path, help="folder of .whl files (benchmarks/download_wheels.sh)")
    p.add_argument("site", type=Path, help="folder to install into (emptied first)")
    args = p.parse_args(argv)
    if not args.wheels.is_dir():
        p.error(f"wheels: expected a folder of .whl files, got {args.wheels}")
    lines = install(list(args.wheels.glob("*.whl")), args.site)
    print("\n".join(lines) if lines else f"no wheels in {args.wheels}")
    return 1 if any("FAILED" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
