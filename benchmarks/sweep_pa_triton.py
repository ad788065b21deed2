"""Tuning sweep for the Triton paged-attention kernels at serving shape (128k-token tables).

Run on the GPU machine from the repo root: python3 benchmarks/sweep_pa_triton.py [max_seconds]
Decode: planner programs-per-SM x warps x stages x BT over DEFAULT_CONFIGS[SWEEP_CONFIGS]
(SWEEP_PPS / SWEEP_WARPS / SWEEP_STAGES / SWEEP_BT, comma lists). Prefill (SWEEP_PREFILL=1):
rows-per-item M x BT x warps x stages over PREFILL_CONFIGS[SWEEP_PREFILL_CONFIGS] (SWEEP_PM /
SWEEP_PBT / SWEEP_PWARPS / SWEEP_PSTAGES). CUDA-graph replay of a plan, median; best six settings per configuration. The
chosen defaults live in pa_backend/planner.py and pa_backend/triton/tiling.py.
"""

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from pa_backend import plan_decode, plan_prefill  # noqa: E402
from pa_backend.benchmark import DEFAULT_CONFIGS, PREFILL_CONFIGS, TABLE_TOKENS, bench_case, kv_bytes  # noqa: E402
from pa_backend.triton import tiling as ptriton  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
ENV = ("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", "FLYDSL_BACKENDS_PA_TRITON_WARPS", "FLYDSL_BACKENDS_PA_TRITON_STAGES",
       "FLYDSL_BACKENDS_PA_TRITON_BT", "FLYDSL_BACKENDS_PA_PREFILL_M", "FLYDSL_BACKENDS_PA_PREFILL_BT",
       "FLYDSL_BACKENDS_PA_PREFILL_WARPS", "FLYDSL_BACKENDS_PA_PREFILL_STAGES",
       "FLYDSL_BACKENDS_PA_FEW_PROGRAMS_PER_SM")


def grid(spec):
    return [[int(x) for x in os.environ.get(k, d).split(",")] for k, d in spec]


def sweep(label, kw, make_plan, names, settings, nbytes, flops):
    out = torch.empty_like(kw["query"])
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    res = []
    for vals in itertools.product(*settings):
        if time.time() - t0 > budget:
            break
        for k in ENV:
            os.environ.pop(k, None)
        os.environ.update({n: str(v) for n, v in zip(names, vals)})
        ptriton.decode_tiling.cache_clear()
        ptriton.prefill_tiling.cache_clear()
        try:
            plan = make_plan()
            t = time_cuda_graph(lambda i: plan.run(**args, out=out), inner=2, trials=15)
        except Exception as exc:
            print(f"  {vals}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        res.append((t.median_us, vals))
    res.sort()
    tag = "/".join(n.split("_")[-1].lower() for n in names)
    best = ", ".join(f"{tag}={'/'.join(map(str, v))}: {us:.1f} us "
                     + (f"({100 * nbytes / (us * 1e-6) / 1e9 / copy:.0f}%)" if not flops
                        else f"({flops / us / 1e6:.0f} TF/s)")
                     for us, v in res[:6])
    print(f"{label} | {best}", flush=True)


pick = [int(i) for i in os.environ.get("SWEEP_CONFIGS", "0,1,2").split(",") if i != ""]
for i in pick:
    B, ctx, ql, Hq, Hkv, D, bs, scales = DEFAULT_CONFIGS[i]
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda", table_tokens=TABLE_TOKENS)
    names = ENV[:4]
    settings = grid((("SWEEP_PPS", "16,32"), ("SWEEP_WARPS", "1,4"), ("SWEEP_STAGES", "5,6"), ("SWEEP_BT", "16,32")))
    sweep(f"decode B={B} ctx={ctx} ql={ql} Hq={Hq} page={bs} {scales}", kw,
          lambda kw=kw, ql=ql: plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql,
                                           backend="triton"),
          names, settings, kv_bytes(B, ctx, Hkv, D, scales), 0)
    del kw
    torch.cuda.empty_cache()
if os.environ.get("SWEEP_PREFILL", "1") == "1":
    ppick = [int(i) for i in os.environ.get("SWEEP_PREFILL_CONFIGS", "0,1,2").split(",") if i != ""]
    for B, prefix, new, Hq, Hkv, D, bs, scales in [PREFILL_CONFIGS[i] for i in ppick]:
        kw = bench_case(B, prefix + new, new, Hq, Hkv, D, bs, scales, "cuda", table_tokens=TABLE_TOKENS)
        qsl = [i * new for i in range(B + 1)]
        qs = torch.tensor(qsl, dtype=torch.int32, device="cuda")
        flops = 4 * B * Hq * D * sum(prefix + 1 + i for i in range(new))
        names = ENV[4:]
        settings = grid((("SWEEP_PM", "64,128"), ("SWEEP_PBT", "32,64"), ("SWEEP_PWARPS", "4,8"),
                         ("SWEEP_PSTAGES", "2,3,4")))
        sweep(f"prefill B={B} prefix={prefix} new={new} Hq={Hq} Hkv={Hkv}", kw,
              lambda kw=kw, qs=qs, qsl=qsl: plan_prefill(kw["block_tables"], qs, kw["context_lengths"],
                                                         query_start_loc_host=qsl, backend="triton"),
              names, settings, 0, flops)
        del kw
        torch.cuda.empty_cache()
for k in ENV:
    os.environ.pop(k, None)
