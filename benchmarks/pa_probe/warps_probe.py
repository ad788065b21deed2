"""Decode tiling probe at serving shape (128k-token tables): warps per program x BT x stages x the
planner's programs per SM, each setting checked against the float64 reference before it is timed.
Question: do one- or two-warp programs (no cross-warp reductions or barriers per tile, 11-12
programs per SM by registers) keep more bytes in flight than the shipped 4-warp BT 32 program?
Run on the GPU machine from the repo root: python3 benchmarks/pa_probe/warps_probe.py [max_seconds]
(PROBE_SETTINGS="pps/warps/stages/bt[/few[/maxnreg]];..." overrides the list; PROBE_CONFIGS indexes DEFAULT_CONFIGS)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps  # noqa: E402
from pa_backend import plan_decode  # noqa: E402
from pa_backend import triton as ptriton  # noqa: E402
from pa_backend.benchmark import DEFAULT_CONFIGS, TABLE_TOKENS, bench_case, kv_bytes  # noqa: E402
from probe_util import checked_timing  # noqa: E402  (this script's folder is on sys.path)

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
DEFAULT = ("16/4/5/32;16/1/5/16;32/1/5/16;16/1/7/16;16/1/5/32;32/1/5/32;16/1/7/32;32/1/7/32;16/2/5/16;32/2/5/16;"
           "16/2/5/32;16/2/7/32;32/1/4/16;32/1/6/16")
# "default": the shipped tiling and split (no overrides)
settings = [() if s == "default" else tuple(int(x) for x in s.split("/"))
            for s in os.environ.get("PROBE_SETTINGS", DEFAULT).split(";") if s]
ENV = ("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", "FLYDSL_BACKENDS_PA_TRITON_WARPS", "FLYDSL_BACKENDS_PA_TRITON_STAGES",
       "FLYDSL_BACKENDS_PA_TRITON_BT", "FLYDSL_BACKENDS_PA_FEW_PROGRAMS_PER_SM", "FLYDSL_BACKENDS_PA_TRITON_MAXNREG")
for ci in [int(i) for i in os.environ.get("PROBE_CONFIGS", "0,1,2,3").split(",")]:
    B, ctx, ql, Hq, Hkv, D, bs, scales = DEFAULT_CONFIGS[ci]
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda", table_tokens=TABLE_TOKENS)
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    out = torch.empty_like(kw["query"])
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    rows = []
    for s in settings:
        if time.time() - t0 > budget:
            print("  budget reached", flush=True)
            break
        for k in ENV:
            os.environ.pop(k, None)
        os.environ.update({k: str(v) for k, v in zip(ENV, s)})
        ptriton.decode_tiling.cache_clear()
        try:
            plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton")
            us, pct, err = checked_timing(plan, kw, args, out, nbytes, copy, trials=20)
            rows.append((us, s, err))
            print(f"  B={B} ctx={ctx} ql={ql} Hq={Hq}/{Hkv} pps/warps/stages/bt/few/maxnreg={'/'.join(map(str, s)) or 'default'}: "
                  f"{us:.1f} us ({pct:.1f}% of copy) rel.err {err:.2e}", flush=True)
        except Exception as exc:
            print(f"  {s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    rows.sort()
    print(f"best B={B} ctx={ctx} ql={ql}: " + "; ".join(f"{'/'.join(map(str, s))} {us:.1f} us ({e:.1e})"
                                                     for us, s, e in rows[:4]), flush=True)
    del kw, args, out
    torch.cuda.empty_cache()
for k in ENV:
    os.environ.pop(k, None)
