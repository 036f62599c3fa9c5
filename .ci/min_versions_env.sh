# Sourced by .ci/run: a small venv on top of the project's environment with the oldest versions the project supports
# and the GPU machine runs (triton 3.6.0, transformers 5.17.0). tests/ops/test_min_versions.py runs the ahead-of-time
# GPU compile and the model tests in it; under CI it fails when ATTNRES_MIN_VERSIONS_PYTHON is not set.
min_venv="$PWD/build/min-versions"
python -m venv --system-site-packages "$min_venv"
"$min_venv/bin/python" -m pip install --quiet triton==3.6.0 transformers==5.17.0
export ATTNRES_MIN_VERSIONS_PYTHON="$min_venv/bin/python"
