#!/usr/bin/env bash
# Build what a device call carries in .whl/ (git-ignored) for benchmarks/device_run.sh:
#   bash benchmarks/make_device_bundle.sh vllm [VENV]      (VENV: default /work/venv-vllm)
#   bash benchmarks/make_device_bundle.sh sglang [VENV]    (VENV: default /work/venv-sgl, a venv built by
#                                                           integration_tests/setup-cpu-env.sh sglang; needs the vllm
#                                                           bundle too)
# vllm:
# * .whl/vllm/vllm-<version>-py.tar.gz: vLLM's Python tree (the `vllm` package and its dist-info, which
#   platform detection reads) from a CPU venv where vllm was installed with --no-deps
#   (integration_tests/setup-cpu-env.sh), without compiled extensions, the vllm-rs binary, C++/CUDA
#   sources and bytecode;
# * .whl/vllm/*.whl: the import-time dependencies the GPU image lacks (its package list: "Python
#   packages already there" in the device README's KINDS.md) at the venv's versions, for CPython 3.12
#   x86_64 (the image's Python). Which ones: what a CPU engine run imported (integration_tests/e2e)
#   minus what the image holds, plus typing-extensions (pydantic-core 2.50 needs >= 4.16, newer than
#   the image's torch-era copy is known to be) and jiter (an openai requirement). manylinux tags up to
#   2_34 are named one by one: pip does not widen a --platform tag (the image's glibc is newer).
# sglang (for the integration_tests/sglang GPU cases; carry all of .whl, ~50 MiB):
# * .whl/extra/sglang-<version>-py.tar.gz: SGLang's Python tree without compiled files (~17 MiB);
# * .whl/extra/*.whl: what the modules those tests import need beyond the image and the vllm bundle's
#   wheels (found by listing the site-packages modules an import of them loads: 2026-12-04), plus what
#   sglang.Engine's processes import (e2e-sglang): setproctitle (scheduler, detokenizer) and python-multipart
#   (fastapi form routes), the rest being in the image or the vllm bundle (CPU engine's module list, 2026-12-04);
#   and for launch_server soundfile (with cffi, pycparser) and jsonschema (with referencing, rpds-py,
#   jsonschema-specifications). The vllm bundle carries the servers' uvicorn, and vllm serve's watchfiles,
#   prometheus-fastapi-instrumentator, model-hosting-container-standards and jmespath.
# Prints the sizes: everything a call carries, the repository included, must stay under 64 MiB.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:?usage: make_device_bundle.sh vllm|sglang [VENV]}
case $what in
  vllm) venv=${2:-/work/venv-vllm}; dest="$root/.whl/vllm" ;;
  sglang) venv=${2:-/work/venv-sgl}; dest="$root/.whl/extra" ;;
  *) echo "unknown bundle $what (vllm, sglang)" >&2; exit 2 ;;
esac
py="$venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$what")
rm -rf "$dest"
mkdir -p "$dest"

download() {  # pinned wheels for CPython 3.12 x86_64 into $dest
  # shellcheck disable=SC2046
  "$py" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    $(for v in 2014 _2_17 _2_24 _2_27 _2_28 _2_31 _2_34; do echo --platform "manylinux${v}_x86_64"; done) \
    --platform any -d "$dest" "$@"
}
pins() {  # name==version of each distribution as installed in the venv
  "$py" - "$venv" "$@" <<'PY'
import importlib.metadata as m, sys
venv, names = sys.argv[1], sys.argv[2:]
missing = [d for d in names if not any(True for _ in m.distributions(name=d))]
if missing:
    sys.exit(f"{venv} lacks {', '.join(missing)}: build it with integration_tests/setup-cpu-env.sh (sglang or vllm) "
             "and pass it as VENV")
print(" ".join(f"{d}=={m.version(d)}" for d in names))
PY
}

if [ "$what" = sglang ]; then
  tar czf "$dest/sglang-$version-py.tar.gz" -C "$site" --exclude='*.so' --exclude='__pycache__' --exclude='*.pyc' \
    sglang "sglang-$version.dist-info"
  # launch_server (integration_tests/e2e/test_sglang_serve.py): soundfile, jsonschema and what they need
  wheels=$(pins gguf traitlets opentelemetry-api dill ipython setproctitle python-multipart soundfile cffi pycparser \
           jsonschema referencing rpds-py jsonschema-specifications)  # exits if one is missing
  # shellcheck disable=SC2086
  download $wheels
  du -cb "$dest"/* | awk 'END {printf "bundle .whl/extra: %.1f MiB\n", $1 / 1048576}'
  exit 0
fi

tar czf "$dest/vllm-$version-py.tar.gz" -C "$site" \
  --exclude='*.so' --exclude='__pycache__' --exclude='*.pyc' --exclude='vllm/vllm-rs' \
  --exclude='*.hpp' --exclude='*.h' --exclude='*.cuh' --exclude='*.cu' --exclude='*.cpp' --exclude='*.cc' \
  --exclude="vllm-$version.dist-info/RECORD" \
  vllm "vllm-$version.dist-info"

# imported by vLLM 0.33 (LLM engine, V1 runner) and absent from the GPU image; pinned to the venv's versions
deps=(annotated-types apache-tvm-ffi cachetools cbor2 compressed-tensors fastapi httpcore2 httpx2 llguidance
      loguru msgspec openai openai-harmony orjson partial-json-parser pybase64 pydantic pydantic-core pyzmq
      sniffio starlette truststore typing-inspection xgrammar typing-extensions jiter
      uvicorn watchfiles prometheus-fastapi-instrumentator model-hosting-container-standards jmespath  # + vllm serve
      gguf)  # + the real-model tier's GGUF conversion (serving_accuracy_gpu)
wheels=$(pins "${deps[@]}")  # exits if one is missing
# shellcheck disable=SC2086
download $wheels

echo "bundle $dest:"
ls -l "$dest" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
du -cb "$dest"/* | awk 'END {printf "total %.1f MiB (a device call carries at most 64 MiB, repository included)\n",
                            $1 / 1048576}'
