#!/usr/bin/env bash
# Build a CPU-only environment with a real serving framework (no CUDA dependencies) and this checkout,
# for its integration tests:
#   bash integration_tests/setup-cpu-env.sh sglang /tmp/venv-sgl
#   PYTHONPATH=integration_tests/stubs /tmp/venv-sgl/bin/python -m pytest -q integration_tests/sglang
#   bash integration_tests/setup-cpu-env.sh vllm /tmp/venv-vllm
#   VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm/bin/python -m pytest -q integration_tests/vllm
# The framework itself is installed with --no-deps (its own requirements pull CUDA wheels); what it
# imports is in integration_tests/<framework>/requirements-cpu.txt, pinned by ../constraints-cpu.txt.
# integration_tests/stubs holds a minimal torchvision stand-in (SGLang imports it; the CPU torch build
# has no matching torchvision wheel), used only by the SGLang tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
framework=${1:?usage: setup-cpu-env.sh sglang|vllm VENV_DIR}
venv=${2:?usage: setup-cpu-env.sh sglang|vllm VENV_DIR}
case $framework in
  sglang) pkg="sglang==0.5.23"; extra=() ;;
  # --no-deps: their own requirements would pull a second (CUDA) torch / triton
  vllm) pkg="vllm==0.33.0"; extra=("xgrammar==0.2.8" "compressed-tensors==0.17.0") ;;
  *) echo "unknown framework $framework (sglang or vllm)" >&2; exit 2 ;;
esac
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip >/dev/null
"${pip[@]}" -c "$root/constraints-cpu.txt" torch triton
"${pip[@]}" --no-deps "$pkg"
"${pip[@]}" -c "$root/constraints-cpu.txt" -r "$root/integration_tests/$framework/requirements-cpu.txt"
if [ ${#extra[@]} -gt 0 ]; then "${pip[@]}" --no-deps "${extra[@]}"; fi
"${pip[@]}" --no-deps -e "$root"   # registers the framework's entry point
"$venv/bin/python" -c "import $framework, flydsl_backends; print('$framework', $framework.__version__)"
