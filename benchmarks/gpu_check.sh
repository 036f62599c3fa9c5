#!/usr/bin/env bash
# One command on a CUDA GPU machine (an H200; no network needed): installs what is missing from the wheels that
# benchmarks/download_wheels.sh put into wheels/, runs the Triton kernel tests on the GPU, then benchmarks the kernels
# against fla's fused_attnres (benchmarks/gpu_bench.py). Under 8 minutes: every stage has its own time limit, and the
# benchmark skips what its deadline leaves no time for.
#
#   benchmarks/gpu_check.sh            # from anywhere; writes runs/gpu_bench.json (and a copy into $OUT if set)
#
# Exit status: 0 when the tests pass and the benchmark ran, 1 otherwise; the benchmark runs even after a test failure.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
budget=${GPU_CHECK_SECONDS:-470}  # total, leaving margin under 8 minutes
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

step() { printf '\n=== %s (%ds elapsed)\n' "$1" $((SECONDS - start)); }

step "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
versions="import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__)"
if ! "$PYTHON" -c "$versions; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device visible to torch: nothing to check here (see benchmarks/gpu_bench.py --smoke for a CPU run)"
    exit 1
fi

step "install missing packages from wheels/"
site=${TMPDIR:-/tmp}/attnres-gpu-site
shopt -s nullglob
for wheel in wheels/*.whl; do
    dist=$(basename "$wheel"); dist=${dist%%-*}
    if "$PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
        echo "$dist: already installed"
    elif "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$wheel"; then
        echo "$dist: installed from $wheel"
    else
        echo "$dist: install from $wheel FAILED"
    fi
done
[[ -d "$site" ]] && export PYTHONPATH="$PYTHONPATH:$site"
"$PYTHON" -c "import fla.ops.attnres" 2>/dev/null || echo "fla-core not importable: the benchmark runs without the peer"

step "Triton kernel tests on CUDA"
if ! timeout -k 10 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/ops/test_triton.py tests/ops/test_triton_bank.py tests/ops/test_merge.py; then
    echo "KERNEL TESTS FAILED (or timed out)"
    status=1
fi

step "benchmark against fla's fused_attnres"
left=$((budget - (SECONDS - start)))
mkdir -p runs
if ((left < 60)); then
    echo "benchmark skipped: only ${left}s of the budget left"
    status=1
elif ! timeout -k 20 "$left" "$PYTHON" benchmarks/gpu_bench.py --deadline $((left - 20)) \
        --json runs/gpu_bench.json; then
    echo "BENCHMARK FAILED (or timed out)"
    status=1
fi
[[ -n "${OUT:-}" && -f runs/gpu_bench.json ]] && cp runs/gpu_bench.json "$OUT/"

step "done, status $status"
exit $status
