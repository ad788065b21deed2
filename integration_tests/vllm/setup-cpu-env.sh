#!/usr/bin/env bash
# Build a CPU-only environment with the real vllm==0.33.0 (no CUDA dependencies) and this checkout,
# for the vLLM integration tests:
#   bash integration_tests/vllm/setup-cpu-env.sh /tmp/venv-vllm
#   VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm/bin/python -m pytest -q integration_tests/vllm
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:?usage: setup-cpu-env.sh VENV_DIR}
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip >/dev/null
"${pip[@]}" -c "$root/constraints-cpu.txt" torch triton
"${pip[@]}" --no-deps "vllm==0.33.0"
"${pip[@]}" -c "$root/constraints-cpu.txt" -r "$root/integration_tests/vllm/requirements-cpu.txt"
# --no-deps: their own requirements would pull a second (CUDA) triton / torch
"${pip[@]}" --no-deps "xgrammar==0.2.8" "compressed-tensors==0.17.0"
"${pip[@]}" --no-deps -e "$root"   # registers the vllm.general_plugins entry point
"$venv/bin/python" -c "import vllm, flydsl_backends; print('vllm', vllm.__version__)"
