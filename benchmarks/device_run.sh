#!/usr/bin/env bash
# One device call: GPU tests, verify, and the KDA benchmark. Usage (on the device machine, repo root):
#   FLYDSL_BACKENDS_COMMIT=<sha> bash benchmarks/device_run.sh [tests|verify|bench|all]
# Optional wheels (fla-core for the composed baseline) travel in .whl/ and go to /tmp/site.
set -u
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  python3 -m pytest -q -m gpu -x kda_backend pa_backend -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" | tail -15
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$what" = all ] || [ "$what" = verify ]; then
  python3 -m flydsl_backends verify 2>&1 | tee "$out/verify.txt" | tail -45
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 -m flydsl_backends bench kda --out "$out/kda_bench.csv" 2>&1 | tee "$out/bench.txt"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
exit $rc
