# A small venv on top of the project's environment with the GPU machine's triton 3.6.0 and transformers 5.17.0 (attnres
# requires 5.24: gpu_check.sh carries it). Not part of CI (a cold compile there takes minutes CI does not have). Use:
#   source .ci/min_versions_env.sh
#   ATTNRES_GPU_COMPILE=full PYTHONPATH=. "$ATTNRES_MIN_VERSIONS_PYTHON" -m pytest -q tests/ops/test_gpu_compile.py \
#       tests/models/test_config_errors.py tests/models/test_modeling.py
min_venv="$PWD/build/min-versions"
python -m venv --system-site-packages "$min_venv"
"$min_venv/bin/python" -m pip install --quiet triton==3.6.0 transformers==5.17.0
export ATTNRES_MIN_VERSIONS_PYTHON="$min_venv/bin/python"
