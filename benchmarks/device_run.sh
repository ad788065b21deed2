#!/usr/bin/env bash
# One device call running any of: tests-kda tests-pa verify bench-kda bench-pa sweep-pa (default: all
# but the sweep). Usage (on the device machine, repo root):
#   FLYDSL_BACKENDS_COMMIT=<sha> bash benchmarks/device_run.sh tests-pa verify bench-pa
# Optional wheels (fla-core for the composed KDA baseline) travel in .whl/ and go to /tmp/site.
# Each step's output goes to $OUT/<step>.txt; bench CSVs to $OUT/<op>_bench.csv.
set -u
steps=${*:-tests-kda tests-pa verify bench-kda bench-pa}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
for step in $steps; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    tests-kda) cmd=(python3 -m pytest -q -m gpu kda_backend -p no:cacheprovider -rf) ;;
    # the PA interpreter tests pick the GPU when there is one: run them all (write_kv, safety cases)
    tests-pa) cmd=(python3 -m pytest -q pa_backend -p no:cacheprovider -rf) ;;
    verify) cmd=(python3 -m flydsl_backends verify) ;;
    bench-kda|bench-pa) cmd=(python3 -m flydsl_backends bench "${step#bench-}" --out "$out/${step#bench-}_bench.csv") ;;
    sweep-pa) cmd=(python3 benchmarks/sweep_pa_triton.py "${SWEEP_SECONDS:-300}") ;;
    *) echo "unknown step $step"; rc=2; continue ;;
  esac
  timeout "${STEP_TIMEOUT:-900}" "${cmd[@]}" > "$out/$step.txt" 2>&1
  s=$?
  tail -40 "$out/$step.txt"
  rc=$((rc | s))
done
exit $rc
