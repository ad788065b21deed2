"""Decode at serving shape: what did the one-round-trip reduce and the unspecialized batch scalars change?
(H200, issue 15; nothing here ships.)

Variants, each checked against the float64 reference before it is timed (CUDA-graph replay), then
profiled (torch.profiler: device time per kernel):
  shipped     the kernels as they are
  oldreduce   the reduce of 943dc19 (a program per (item, head) looping twice over the partitions),
              read from git (the device copy carries the landed history), launched on its old grid
  spec        the shipped kernels re-jitted without do_not_specialize (Triton then specializes the
              batch scalars: == 1, multiple of 16)
Cases: B=81/8k and B=200/32k (Hq 16 / Hkv 1), B=32/2k (Hq 32 / Hkv 8), 128k-token and exact tables.
Run on the GPU machine from the repo root: python3 benchmarks/pa_probe/reduce_probe.py [max_seconds]
Ran at 591771e (shipped = a one-round-trip reduce, grid items x Hkv x BM/2, since reverted): output in
reduce_H200_2026-12-04.txt. From 0ae9b8e on, shipped and oldreduce are the same kernel (943dc19's)."""
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps  # noqa: E402
from probe_util import Relaunch, module_at, probe_line  # noqa: E402  (this script's folder is on sys.path)
from pa_backend.benchmark import DEFAULT_CONFIGS, TABLE_TOKENS, bench_case, kv_bytes  # noqa: E402
from pa_backend.triton import pa_decode as kmod  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
SHIPPED = (kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel)
OLD_COMMIT = os.environ.get("PROBE_OLD_COMMIT", "943dc19")


def variant(name):
    if name == "shipped":
        return SHIPPED
    if name == "spec":
        return tuple(triton.jit(k.fn) for k in SHIPPED)
    mod = module_at(OLD_COMMIT, name="reduce_probe_old")
    # the old reduce on its old grid (items, Hkv), without the tiled reduce's tiling arguments
    return SHIPPED[0], Relaunch(mod.pa_decode_reduce_kernel, ("RB", "PC", "num_warps"),
                                lambda g, kw: (g[:2], dict(kw, num_warps=4 if kw["BM"] * kw["D"] <= 8192 else 8)))


copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
VARIANTS = os.environ.get("PROBE_VARIANTS", "shipped,oldreduce,spec").split(",")
kernels = {}
for v in VARIANTS:
    try:
        kernels[v] = variant(v)
    except Exception as exc:
        print(f"variant {v}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
for case in (DEFAULT_CONFIGS[0], DEFAULT_CONFIGS[3], DEFAULT_CONFIGS[1]):
    B, ctx, ql, Hq, Hkv, D, bs, scales = case
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    for width in (TABLE_TOKENS, 0):
        kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda", table_tokens=width)
        args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
        out = torch.empty_like(kw["query"])
        label = f"B={B} ctx={ctx} Hq={Hq}/{Hkv} table={int(kw['block_tables'].shape[1]) * bs}"
        for rnd in range(2):  # twice, to see order effects
            for v, (part, red) in kernels.items():
                if time.time() - t0 > budget:
                    print("  budget reached", flush=True)
                    break
                kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel = part, red
                probe_line(label, v, rnd, kw, args, out, nbytes, copy, ql)
        kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel = SHIPPED
        del kw, args, out
        torch.cuda.empty_cache()
