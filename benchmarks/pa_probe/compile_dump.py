"""Compile the PA decode partition kernel for sm_90 on CPU and dump TTGIR / PTX / ptxas stats.
Usage: python benchmarks/pa_probe/compile_dump.py OUTDIR [KEY=VAL constexpr overrides...]"""
import inspect, os, re, subprocess, sys, tempfile
sys.path.insert(0, os.getcwd())
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pa_backend.triton.pa_decode import pa_decode_partition_kernel as fn

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
over = dict(a.split("=", 1) for a in sys.argv[2:])
warps = int(over.pop("warps", 4)); stages = int(over.pop("stages", 4))
ce = dict(HKV=1, G=16, QL=1, BM=16, D=128, BS=16, NBP=16, BT=64, QK_DTYPE=tl.bfloat16, PV_DTYPE=tl.float16,
          V5D=False, K_PER_TOKEN=False, V_PER_TOKEN=False, RAGGED=False, stride_vc_3=1)
for k, v in over.items():
    ce[k] = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp8": tl.float8e4nv}.get(v, None) or (v == "True" if v in ("True", "False") else int(v))
names = list(inspect.signature(fn.fn).parameters)
sig, attrs = {}, {}
for i, n in enumerate(names):
    if n in ce:
        sig[n] = "constexpr"; continue
    if n in ("p_kc", "p_vc"): t = "*fp8e4nv"
    elif n in ("p_bt", "p_cl", "p_chunks"): t = "*i32"
    elif n == "p_q": t = "*bf16"
    elif n.startswith("p_"): t = "*fp32"
    elif n == "softmax_scale": t = "fp32"
    else: t = "i32"
    sig[n] = t
    if n.startswith(("p_", "stride_")):
        attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
for k in ("ttir", "ttgir", "llir", "ptx"):
    open(os.path.join(out, "k." + k), "w").write(c.asm[k])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", os.path.join(out, "k.ptx"), "-o", os.path.join(out, "k.cubin")], capture_output=True, text=True)
print((r.stderr + r.stdout).strip().splitlines()[-2:])
print("shared", c.metadata.shared)
g = c.asm["ttgir"]
for pat in ("async_copy_global_to_local", "async_wait", "convert_layout", "local_alloc", "local_load", "warp_group_dot", "tt.dot", "tt.load"):
    print(pat, g.count(pat))
