"""FP8 tensor-core Q.K for the wgmma programs (ql 4 decode, prefill), 2026-12-04 (fifth session).

Question: with K fed from shared memory straight into FP8 dots (2-D tile loads, the BF16 query as an exact
hi + lo FP8 pair), does the M >= 64 program stop being bound by the FP8 -> FP16 widening of K and its
register -> shared-memory round trip? (The recorded run, mma8_H200_2026-12-04.txt, is of the first version,
commit a4e48b1 with the V hint fixed, whose FLYDSL_BACKENDS_PA_MMA8 also had P.V variants 2 / 3: they gave
NaN and were not faster, and were removed; its mode 1 is today's FLYDSL_BACKENDS_PA_FP8_QK=1.)
Settings: decode "qk8/warps/stages/bt", prefill "qk8/m/bt/warps/stages" ("-" keeps the shipped value);
every setting is checked against the float64 reference before it is timed (CUDA-graph replay, median).
Run on the GPU machine from the repo root: python3 benchmarks/pa_probe/mma8_probe.py [max_seconds]
(PROBE_DECODE / PROBE_PREFILL: ';'-separated settings; PROBE_CONFIGS / PROBE_PREFILL_CONFIGS: indices)."""
import os
import sys
import time

DRY = not os.environ.get("PROBE_DRY", "") == ""  # CPU interpreter, tiny shapes, no timing (checks the script)
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from pa_backend import plan_decode, plan_prefill  # noqa: E402
from pa_backend import triton as ptriton  # noqa: E402
from pa_backend.benchmark import (DEFAULT_CONFIGS, PREFILL_CONFIGS, TABLE_TOKENS, accuracy, bench_case,  # noqa: E402
                                  kv_bytes)

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
DEV = "cpu" if DRY else "cuda"
copy = 1.0 if DRY else copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
DEC_ENV = ("FLYDSL_BACKENDS_PA_FP8_QK", "FLYDSL_BACKENDS_PA_TRITON_WARPS", "FLYDSL_BACKENDS_PA_TRITON_STAGES",
           "FLYDSL_BACKENDS_PA_TRITON_BT")
PRE_ENV = ("FLYDSL_BACKENDS_PA_FP8_QK", "FLYDSL_BACKENDS_PA_PREFILL_M", "FLYDSL_BACKENDS_PA_PREFILL_BT",
           "FLYDSL_BACKENDS_PA_PREFILL_WARPS", "FLYDSL_BACKENDS_PA_PREFILL_STAGES")


def apply(names, setting):
    for k in DEC_ENV + PRE_ENV:
        os.environ.pop(k, None)
    for k, v in zip(names, setting.split("/")):
        if v != "-":
            os.environ[k] = v
    ptriton.decode_tiling.cache_clear()
    ptriton.prefill_tiling.cache_clear()


def run(label, kw, acc_kw, make_plan, names, settings, metric):
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    out = torch.empty_like(kw["query"])
    rows = []
    for s in settings:
        if time.time() - t0 > budget:
            print("  budget reached", flush=True)
            break
        apply(names, s)
        try:
            plan = make_plan()
            out.fill_(float("nan"))
            plan.run(**args, out=out)
            err = accuracy(acc_kw, out)
            us = 1.0 if DRY else time_cuda_graph(lambda i: plan.run(**args, out=out), inner=2, trials=20).median_us
            rows.append((us, s, err))
            print(f"  {label} {s}: {us:.1f} us ({metric(us)}) rel.err {err:.2e}", flush=True)
        except Exception as exc:
            print(f"  {label} {s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    rows.sort()
    print(f"best {label}: " + "; ".join(f"{s} {us:.1f} us ({e:.1e})" for us, s, e in rows[:4]), flush=True)


DEC = os.environ.get("PROBE_DECODE", "0/-/-/-;1/-/-/-;1/-/6/-;1/-/4/-")
PRE = os.environ.get("PROBE_PREFILL", "0/-/-/-/-;1/-/-/-/-;1/64/64/4/3;1/128/64/8/3")
for ci in [int(i) for i in os.environ.get("PROBE_CONFIGS", "2").split(",") if i]:
    B, ctx, ql, Hq, Hkv, D, bs, scales = DEFAULT_CONFIGS[ci] if not DRY else (2, 100, 4, 16, 1, 128, 16, "tensor")
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, DEV, table_tokens=TABLE_TOKENS if not DRY else 256)
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    run(f"decode B={B} ctx={ctx} ql={ql} Hq={Hq}/{Hkv}", kw, kw,
        lambda: plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton"),
        DEC_ENV, [s for s in DEC.split(";") if s], lambda us: f"{100 * nbytes / (us * 1e-6) / 1e9 / copy:.1f}% of copy")
    del kw
    if not DRY:
        torch.cuda.empty_cache()
for ci in [int(i) for i in os.environ.get("PROBE_PREFILL_CONFIGS", "0,1,2").split(",") if i]:
    B, prefix, new, Hq, Hkv, D, bs, scales = PREFILL_CONFIGS[ci] if not DRY else (2, 40, 70, 8, 2, 64, 16, "tensor")
    kw = bench_case(B, prefix + new, new, Hq, Hkv, D, bs, scales, DEV, table_tokens=TABLE_TOKENS if not DRY else 256)
    qsl = [i * new for i in range(B + 1)]
    qs = torch.tensor(qsl, dtype=torch.int32, device=DEV)
    acc_kw = dict(kw, query_start_loc=qs)
    acc_kw.pop("query_length", None)
    flops = 4 * B * Hq * D * sum(prefix + 1 + i for i in range(new))
    run(f"prefill B={B} prefix={prefix} new={new} Hq={Hq}/{Hkv}", kw, acc_kw,
        lambda: plan_prefill(kw["block_tables"], qs, kw["context_lengths"], query_start_loc_host=qsl, backend="triton"),
        PRE_ENV, [s for s in PRE.split(";") if s], lambda us: f"{flops / us / 1e6:.0f} TF/s")
    del kw, acc_kw
    if not DRY:
        torch.cuda.empty_cache()
apply((), "")
