#!/usr/bin/env bash
# One command on a CUDA GPU machine (an H200; no network needed): installs what is missing from the wheels that
# benchmarks/download_wheels.sh put into wheels/, then runs benchmarks/gpu_model_check.py: the Triton kernel tests on
# the GPU, model-level parity of the kernels against the torch path (training steps, prefill and greedy decode, under
# torch.compile and in a CUDA graph), peak memory, model-level time ratios and the operator's HBM fraction beside fla's
# fused_attnres. Under 8 minutes: every stage runs in its own process with its own time limit, so one that fails or
# hangs loses only itself. One JSON and a short table at the end.
#
#   benchmarks/gpu_check.sh            # from anywhere; writes runs/gpu_check.json (and a copy into $OUT if set)
#   benchmarks/gpu_check.sh --smoke    # the same stages on CPU, tiny sizes, Triton interpreted (CI runs this)
#
# Exit status: 0 when every stage ran and every parity check passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
budget=${GPU_CHECK_SECONDS:-470}  # total, leaving margin under 8 minutes
json=${GPU_CHECK_JSON:-runs/gpu_check.json}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
smoke=()
if [[ "${1:-}" == "--smoke" ]]; then
    smoke=(--smoke)
    export TRITON_INTERPRET=1
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--smoke]" >&2
    exit 2
fi

step() { printf '\n=== %s (%ds elapsed)\n' "$1" $((SECONDS - start)); }

if ((${#smoke[@]} == 0)); then
    step "environment"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

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
fi

step "stages (benchmarks/gpu_model_check.py)"
left=$((budget - (SECONDS - start)))
timeout -k 20 "$((left + 10))" "$PYTHON" benchmarks/gpu_model_check.py "${smoke[@]}" --deadline "$left" --json "$json"
status=$?
[[ -n "${OUT:-}" && -f "$json" ]] && cp "$json" "$OUT/"

step "done, status $status"
exit $((status != 0))
