#!/usr/bin/env bash
# One command on a CUDA GPU machine without network (an H200): installs from wheels/ (prepared by
# benchmarks/download_wheels.sh on a machine with network, carried along) each package that is missing or at another
# version, then runs benchmarks/gpu_model_check.py: the operator's HBM fraction beside fla's fused_attnres first, then
# model-level parity of the kernels against the torch path, prefill and greedy decode (eager, torch.compile, CUDA
# graph), the Triton kernel tests on the GPU, model-level time ratios and peak memory; then benchmarks/real_model.py
# (SmolLM2-135M's shapes, random weights, bf16: the original against Block and Full); last, where the `vllm` package
# is installed, benchmarks/bench_vllm.py (output tokens/s under vLLM, original vs Block and Full; elsewhere a "not run"
# record). Every stage runs in its own process with its own time limit, so one that fails or hangs loses only itself;
# the whole run fits one command of 600 s.
#
#   benchmarks/gpu_check.sh            # from anywhere; results in $OUT when set, else runs/
#   benchmarks/gpu_check.sh --smoke    # the same stages on CPU, tiny sizes, Triton interpreted (CI runs this)
#   GPU_CHECK_INSTALL=1 PYTHON=venv/bin/python benchmarks/gpu_check.sh --smoke   # a dry run: installs from wheels/ too
#
# Written as they come (a run cut short keeps them), three files at most besides a stage under way (a machine reached
# by one command returns at most eight): gpu_check.json (the report, rewritten after every stage; the vLLM stage's
# record is its "vllm" entry), gpu_check.log (this script's output) and gpu_check.stages/ (the JSON of the stage under
# way, rewritten at every result and removed once the report holds it, and op_tests.log). Exit status: 0 when every
# stage ran (the vLLM stage may be "not run") and every parity check passed, 1 otherwise. At most 590 s in all: the
# budget (540 s, less what installing took), then at most 25 s past it if gpu_model_check.py overruns and 25 s for the
# vLLM stage.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
budget=${GPU_CHECK_SECONDS:-540}  # for everything: one command on the GPU machine is limited to 600 s
out_dir=${OUT:-runs}
json=${GPU_CHECK_JSON:-$out_dir/gpu_check.json}
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
mkdir -p "$(dirname "$json")"
exec > >(tee "${json%.json}.log") 2>&1

step() { printf '\n=== %s (%ds elapsed)\n' "$1" $((SECONDS - start)); }

step "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c 'import sys, torch, triton, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__},"
    f" triton {triton.__version__}, transformers {transformers.__version__}")'

step "install from wheels/ what is missing or at another version"
site=${TMPDIR:-/tmp}/attnres-gpu-site
rm -rf "$site"
if ((${#smoke[@]} > 0)) && [[ "${GPU_CHECK_INSTALL:-0}" != 1 ]]; then
    echo "--smoke: this environment as it is (GPU_CHECK_INSTALL=1 installs from wheels/ too: a dry run)"
elif [[ -d wheels ]]; then
    "$PYTHON" benchmarks/gpu_wheels.py wheels "$site"
else
    echo "no wheels/ folder (benchmarks/download_wheels.sh, carried): this machine's own packages"
fi
# PYTHONPATH comes before site-packages: a wheel installed here wins over another version installed there
if [[ -d "$site" ]]; then
    if PYTHONPATH="$site:$PYTHONPATH" "$PYTHON" -c "import transformers, attnres.models" 2>/dev/null; then
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        echo "the installed wheels do not import together with this machine's packages: using the machine's own"
    fi
fi
"$PYTHON" -c 'import transformers; print(f"transformers {transformers.__version__} from {transformers.__file__}")'

# where vllm is installed, its stage's seconds are kept back from the stages before it (default 150: op_hbm still
# gets more than the 200 s fla's case needs); the vLLM GPU wheel is too large to carry, so mostly it is not
vllm_seconds=0
if "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' 2>/dev/null; then
    vllm_seconds=${GPU_CHECK_VLLM_SECONDS:-150}
fi

# the real model's stage (benchmarks/real_model.py) is kept its seconds too
real_seconds=${GPU_CHECK_REAL_SECONDS:-90}

step "stages (benchmarks/gpu_model_check.py)"
left=$((budget - (SECONDS - start) - vllm_seconds - real_seconds))
# its last stage may run 10 s past the deadline (a hung child is terminated, then killed)
timeout -k 5 "$((left + 20))" "$PYTHON" benchmarks/gpu_model_check.py "${smoke[@]}" --deadline "$left" --json "$json"
status=$?

# merges a stage's JSON into the report under its name and removes it (a missing record: its failure)
merge_stage() {
"$PYTHON" - "$json" "$1" "$2" "$3" "$4" <<'EOF'
import json, os, sys
report_path, name, stage_path, rc, script = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
report = json.load(open(report_path)) if os.path.exists(report_path) else {}
stage = json.load(open(stage_path)) if rc == 0 and os.path.exists(stage_path) else None
if stage is None:
    stage = {"status": "timeout" if rc in (124, 137) else "failed", "why": f"{script} exited {rc} (see the log)"}
report[name] = stage
with open(report_path + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
os.replace(report_path + ".tmp", report_path)
if os.path.exists(stage_path):
    os.remove(stage_path)  # now in the report
if name == "vllm":
    print(f"vllm: {stage['status']}: " + stage.get("why", f"ratio to the original {stage.get('ratio_to_original')}"))
EOF
}

step "real model (benchmarks/real_model.py: SmolLM2-135M's shapes, original against its standard, Block and Full conversions)"
real_json=${json%.json}.stages/real_model.json
mkdir -p "$(dirname "$real_json")"
rm -f "$real_json"
if ((${#smoke[@]} > 0)); then
    real_args=(--smoke --device cpu --dtypes fp32 --rounds 1 --warmup 0)
else
    real_args=(--random-weights --device cuda --dtypes bf16 --rounds 5)
fi
left=$((budget - (SECONDS - start) - vllm_seconds))
timeout -k 5 "$((left > 20 ? left : 20))" "$PYTHON" benchmarks/real_model.py "${real_args[@]}" --json "$real_json"
real_rc=$?
merge_stage real_model "$real_json" "$real_rc" benchmarks/real_model.py

step "vllm (benchmarks/bench_vllm.py)"
vllm_json=${json%.json}.stages/vllm.json
mkdir -p "$(dirname "$vllm_json")"
rm -f "$vllm_json"
if ((${#smoke[@]} > 0)); then  # CPU: tiny sizes (vLLM's CPU attention takes head_dim 64)
    vllm_args=(--dim 128 --layers 2 --heads 2 --vocab 256 --requests 4 --prompt-tokens 8 24 --max-tokens 8)
else
    vllm_args=(--dtype bfloat16 --dim 1024 --layers 16 --heads 16 --vocab 32000 --block-size 2 --kv-cache-mib 1024)
fi
left=$((budget - (SECONDS - start)))
timeout -k 5 "$((left > 20 ? left : 20))" "$PYTHON" benchmarks/bench_vllm.py --if-installed "${vllm_args[@]}" \
    --repeats 1 --runs 2 --out "$vllm_json"
vllm_rc=$?
merge_stage vllm "$vllm_json" "$vllm_rc" benchmarks/bench_vllm.py

step "done, status $status, real model stage exit $real_rc, vLLM stage exit $vllm_rc"
exit $((status != 0 || real_rc != 0 || vllm_rc != 0))
