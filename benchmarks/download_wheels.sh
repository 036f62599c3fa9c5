#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that benchmarks/gpu_check.sh installs on a GPU machine without one.
#
#   benchmarks/download_wheels.sh            # into wheels/ (git-ignored), for CPython 3.12 on linux x86_64
#   PYTHON_VERSION=3.11 benchmarks/download_wheels.sh
#
# Only what such a machine may lack: fla-core (the peer, pure Python) and its one requirement einops. torch with CUDA
# and triton come with the GPU machine and are never downloaded here. Versions are pinned to the ones the CPU test
# suite runs with; gpu_check.sh installs a wheel only when its package is missing there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PACKAGES=(fla-core==0.6.0 einops==0.8.2)

mkdir -p wheels
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest wheels \
    --implementation cp --python-version "$PYTHON_VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${PACKAGES[@]}"
ls -l wheels/*.whl
