#!/usr/bin/env bash
# Build a CPU-only environment with the real sglang==0.5.23 (no CUDA dependencies) and this checkout,
# for the SGLang integration tests:
#   bash integration_tests/sglang/setup-cpu-env.sh /tmp/venv-sgl
#   PYTHONPATH=integration_tests/stubs /tmp/venv-sgl/bin/python -m pytest -q integration_tests/sglang
# integration_tests/stubs holds a minimal torchvision stand-in (SGLang imports it; the CPU torch
# build has no matching torchvision wheel), used only by these tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:?usage: setup-cpu-env.sh VENV_DIR}
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip >/dev/null
"${pip[@]}" -c "$root/constraints-cpu.txt" torch triton
"${pip[@]}" --no-deps "sglang==0.5.23"
"${pip[@]}" -c "$root/constraints-cpu.txt" -r "$root/integration_tests/sglang/requirements-cpu.txt"
"${pip[@]}" --no-deps -e "$root"   # registers the sglang.srt.plugins entry point
"$venv/bin/python" -c "import sglang, flydsl_backends; print('sglang', sglang.__version__)"
