"""Tuning sweep for the Triton paged-attention decode: planner programs-per-SM x warps x stages.

Run on the GPU machine from the repo root: python3 benchmarks/sweep_pa_triton.py [max_seconds]
SWEEP_CONFIGS (indices into DEFAULT_CONFIGS) and SWEEP_PPS / SWEEP_WARPS / SWEEP_STAGES / SWEEP_BT (comma lists) set the grid;
SWEEP_TABLES=random,sequential times each setting with scattered and with consecutive pages.
Prints one line per configuration (best six settings, CUDA-graph replay, median); the chosen
defaults live in pa_backend/planner.py (PROGRAMS_PER_SM) and pa_backend/triton/__init__.py.
"""

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from pa_backend import pa_decode  # noqa: E402
from pa_backend import triton as ptriton  # noqa: E402
from pa_backend.benchmark import DEFAULT_CONFIGS, bench_case, kv_bytes  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
pick = [int(i) for i in os.environ.get("SWEEP_CONFIGS", ",".join(map(str, range(len(DEFAULT_CONFIGS))))).split(",")]
layouts = os.environ.get("SWEEP_TABLES", "random").split(",")
for (B, ctx, ql, Hq, Hkv, D, bs, scales), tables in itertools.product([DEFAULT_CONFIGS[i] for i in pick], layouts):
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda", tables=tables)
    out = torch.empty_like(kw["query"])
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    res = []
    grid = [[int(x) for x in os.environ.get(f"SWEEP_{k}", d).split(",")]
            for k, d in (("PPS", "1,2,4,8"), ("WARPS", "4,8"), ("STAGES", "2,3"), ("BT", "32,64"))]
    for pps, warps, stages, bt in itertools.product(*grid):
        if time.time() - t0 > budget:
            break
        os.environ.update(FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM=str(pps), FLYDSL_BACKENDS_PA_TRITON_WARPS=str(warps),
                          FLYDSL_BACKENDS_PA_TRITON_STAGES=str(stages), FLYDSL_BACKENDS_PA_TRITON_BT=str(bt))
        ptriton.decode_tiling.cache_clear()
        try:
            t = time_cuda_graph(lambda i: pa_decode(**kw, out=out, backend="triton"), inner=2, trials=20)
        except Exception as exc:
            print(f"  pps={pps} w={warps} s={stages} bt={bt}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        res.append((t.median_us, pps, warps, stages, bt))
    res.sort()
    best = ", ".join(f"pps{p}/w{w}/s{s}/bt{b}: {us:.1f} ({100 * nbytes / (us * 1e-6) / 1e9 / copy:.0f}%)"
                     for us, p, w, s, b in res[:6])
    print(f"B={B} ctx={ctx} ql={ql} Hq={Hq} page={bs} {scales} {tables} pages | {best}", flush=True)
    del kw, out
    torch.cuda.empty_cache()
for k in ("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", "FLYDSL_BACKENDS_PA_TRITON_WARPS", "FLYDSL_BACKENDS_PA_TRITON_STAGES",
          "FLYDSL_BACKENDS_PA_TRITON_BT"):
    os.environ.pop(k, None)
