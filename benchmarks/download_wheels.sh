#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that benchmarks/gpu_check.sh installs on a GPU machine without one.
#
#   benchmarks/download_wheels.sh            # into wheels/ (git-ignored), for CPython 3.12 on linux x86_64
#   PYTHON_VERSION=3.11 benchmarks/download_wheels.sh
#
# What such a machine lacks: fla-core (the peer, pure Python) and its one requirement einops, and the transformers the
# CPU test suite runs (5.24.0) with the huggingface-hub it needs. The GPU machine comes with Python 3.12, torch 2.11
# (CUDA 13.0), triton 3.6.0 and transformers 5.17.0; attnres imports and trains on 5.17, but 5.17 still names the KV
# cache `past_key_values` where attnres passes and reads `cache`, so its decode needs the newer one. torch and triton
# are never downloaded here. gpu_check.sh installs a wheel when its package is missing there or at another version,
# and falls back to the machine's own packages when the result does not import. The folder is about 20 MiB and is
# sent to the GPU machine with the repository (benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PACKAGES=(fla-core==0.6.0 einops==0.8.2 transformers==5.24.0 huggingface-hub==1.31.0 hf-xet==1.8.0 click==8.5.1)

mkdir -p wheels
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest wheels \
    --implementation cp --python-version "$PYTHON_VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${PACKAGES[@]}"
ls -l wheels/*.whl
