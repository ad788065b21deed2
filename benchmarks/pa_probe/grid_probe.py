"""Where does the table-width cost of decode go? (H200, issue 15: 128k tables vs exact-width tables.)

A CUDA graph's decode grid is shape-only: (sequences, Hkv, P) with P sized for the longest context
the table could hold, and programs past a sequence's own split (p >= P_s) exit without work. With
one-warp programs at 128k tables that is ~3 dead programs per live one (B=81/8k: 53 vs 14 per
sequence). This probe times, per case, the exact-width table against the 128k table under kernel
variants built from the shipped source at run time (nothing here ships):
  base    the shipped kernel
  exit    dead programs return before loading the query (the split is computed first)
  pfirst  the partition index on grid axis 0: a sequence's dead programs are dispatched right
          after its live ones, instead of all dead programs after every live one
and the planner's programs-per-SM target (the P of the 128k grid). Every setting is checked
against the float64 reference before it is timed.
Run on the GPU machine from the repo root: python3 benchmarks/pa_probe/grid_probe.py [max_seconds]"""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps  # noqa: E402
from pa_backend import plan_decode  # noqa: E402
from pa_backend.benchmark import DEFAULT_CONFIGS, MIXED_CONFIG, TABLE_TOKENS, bench_case, kv_bytes  # noqa: E402
from pa_backend.triton import pa_decode as kmod  # noqa: E402
from probe_util import Relaunch, checked_timing, kernel_times, module_from_source  # noqa: E402  (this folder)

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
SRC = open(kmod.__file__).read()
SHIPPED = kmod.pa_decode_partition_kernel


def _sub(src, old, new):
    if old not in src:
        raise RuntimeError(f"variant edit does not apply: {old[:60]!r}")
    return src.replace(old, new, 1)


def variant_source(name):
    src = SRC
    if "exit" in name:
        src = _sub(src, "    seq, q0, nrows, ctx = _rows_of(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL, RAGGED)\n    m_valid",
                   "    seq, q0, nrows, ctx = _rows_of(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL, RAGGED)\n"
                   "    lo0, pt0, n_live0 = _partition_span(ctx, nrows, sliding_window, P, few_target, min_pt, long_pt, short_target,\n"
                   "                                         ALIGN)\n"
                   "    if i_p >= n_live0:\n        return\n    m_valid")
    if "pfirst" in name:
        src = _sub(src, "    i_s = tl.program_id(0).to(tl.int64)\n    i_h = tl.program_id(1)\n    i_p = tl.program_id(2)\n"
                   "    P = tl.num_programs(2)",
                   "    i_s = tl.program_id(2).to(tl.int64)\n    i_h = tl.program_id(1)\n    i_p = tl.program_id(0)\n"
                   "    P = tl.num_programs(0)")
    if "smid" in name:  # each live program writes its SM id into m[row 0] (the output is then meaningless)
        src = _sub(src, "    tl.store(p_ws_m + ws + o_m, b_m, mask=live_p_)",
                   "    smid = tl.inline_asm_elementwise(\"mov.u32 $0, %smid;\", \"=r,r\", [i_h], dtype=tl.int32,\n"
                   "                                     is_pure=False, pack=1)\n"
                   "    tl.store(p_ws_m + ws + o_m, tl.where(o_m == 0, smid.to(tl.float32), b_m), mask=live_p_)")
    return src


_kernels = {}


def use(name):
    if name == "base":
        kmod.pa_decode_partition_kernel = SHIPPED
        return
    if name not in _kernels:
        mod = module_from_source(variant_source(name), f"grid_probe_{name.replace('+', '_')}")
        k = mod.pa_decode_partition_kernel
        # the pfirst variant's grid axes 0 and 2 are swapped
        _kernels[name] = Relaunch(k, adapt=lambda g, kw: ((g[2], g[1], g[0]), kw)) if "pfirst" in name else k
    kmod.pa_decode_partition_kernel = _kernels[name]


def setup(case, width):
    """(bench_case kwargs, one layer's arguments, an output buffer) of ``case`` at ``width`` tokens."""
    B, ctx, ql, Hq, Hkv, D, bs, scales = case
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda", table_tokens=width)
    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    return kw, args, torch.empty_like(kw["query"])


def timed(kw, args, out, plan, nbytes):
    """(median us, % of copy, rel. err, the plan's P) of one planned decode, checked before timed."""
    us, pct, err = checked_timing(plan, kw, args, out, nbytes, copy)
    return f"{us:.1f} us ({pct:.1f}% of copy) rel.err {err:.2e}", next(iter(plan.state.values())).split.P


copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
# the variants edit the 3-D grid kernel of fbbb544 (run there: PROBE_VARIANTS=base,exit,pfirst,exit+pfirst
# PROBE_PPS=0,16,12); on the task-queue kernel only "base" applies
VARIANTS = os.environ.get("PROBE_VARIANTS", "base").split(",")
PPS = [int(x) for x in os.environ.get("PROBE_PPS", "0").split(",")]  # 0: the shipped target
CASES = [DEFAULT_CONFIGS[0], DEFAULT_CONFIGS[3], DEFAULT_CONFIGS[1], MIXED_CONFIG]
for ci in [int(i) for i in os.environ.get("PROBE_CASES", "0,1,2,3").split(",") if i]:
    B, ctx, ql, Hq, Hkv, D, bs, scales = CASES[ci]
    if isinstance(ctx, tuple):
        g = torch.Generator().manual_seed(1)
        ctx = [int(x) for x in torch.linspace(ctx[0], ctx[1], B)[torch.randperm(B, generator=g)]]
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    label = f"B={B} ctx={'mixed' if isinstance(ctx, list) else ctx} Hq={Hq}/{Hkv}"
    for width in (0, TABLE_TOKENS):
        kw, args, out = setup((B, ctx, ql, Hq, Hkv, D, bs, scales), width)
        runs = [("base", 0)] if width == 0 else [(v, p) for v in VARIANTS for p in PPS]
        for name, pps in runs:
            if time.time() - t0 > budget:
                print("  budget reached", flush=True)
                break
            os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)
            if pps:
                os.environ["FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM"] = str(pps)
            try:
                use(name)
                plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton")
                res, P = timed(kw, args, out, plan, nbytes)
                print(f"  {label} table={int(kw['block_tables'].shape[1]) * bs} {name} pps={pps or 'default'} P={P}: "
                      f"{res}", flush=True)
            except Exception as exc:
                print(f"  {label} {name} pps={pps}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del kw, args, out
        torch.cuda.empty_cache()
use("base")
os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)

# PROBE_ISOLATE=1: which difference between the exact and the 128k table costs the time? The same
# sequences and pages, timed in turn (twice, to see order effects): the 128k table; the exact table;
# the 128k table's first columns as a view (exact width, 128k row stride); the 128k table planned
# with max_context = the context (the exact table's grid, 128k max_tokens).
if os.environ.get("PROBE_ISOLATE"):
    for ci in (0, 1):
        B, ctx, ql, Hq, Hkv, D, bs, scales = CASES[ci]
        nbytes = kv_bytes(B, ctx, Hkv, D, scales)
        kw, args, out = setup(CASES[ci], TABLE_TOKENS)
        wide = kw["block_tables"]
        nb = -(-ctx // bs)
        tables = {"wide": (wide, None), "exact": (wide[:, :nb].contiguous(), None), "view": (wide[:, :nb], None),
                  "wide+max_context": (wide, ctx)}
        for rnd in range(2):
            for name, (bt, mc) in tables.items():
                plan = plan_decode(bt, kw["context_lengths"], query_length=ql, max_context=mc, backend="triton")
                res, P = timed(dict(kw, block_tables=bt), args, out, plan, nbytes)
                print(f"  isolate B={B} ctx={ctx} Hq={Hq}/{Hkv} round {rnd} {name} (stride {bt.stride(0)}, P={P}): {res}",
                      flush=True)
        del kw, args, out, tables, wide
        torch.cuda.empty_cache()

# PROBE_KERNELS=1: per-kernel device time (torch.profiler) of the partition and reduce kernels at
# B=81/8k with the grid's P at 14 (the exact table's), 20 and 53 (the 128k table's), and the partition
# kernel alone.
if os.environ.get("PROBE_KERNELS"):
    B, ctx, ql, Hq, Hkv, D, bs, scales = CASES[0]
    kw, args, out = setup(CASES[0], TABLE_TOKENS)
    for pps in ("0", "12", "8"):  # P = 53, 20, 14 with one-warp programs at B=81
        os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)
        if pps != "0":
            os.environ["FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM"] = pps
        plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton")
        times = kernel_times(plan, args, out, runs=50)
        P = next(iter(plan.state.values())).split.P
        for key, (us, n) in times.items():
            print(f"  kernels B=81/8k P={P} {key}: {us:.1f} us x {n}", flush=True)
    os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)

# PROBE_SMID=1: how are the live programs spread over the SMs when the grid holds dead ones? Each live
# program records its SM id; printed: live programs per SM (min / max / SMs with none) at P = 14, 20, 53.
if os.environ.get("PROBE_SMID"):
    B, ctx, ql, Hq, Hkv, D, bs, scales = CASES[0]
    kw, args, out = setup(CASES[0], TABLE_TOKENS)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for pps in ("8", "12", "0"):
        os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)
        if pps != "0":
            os.environ["FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM"] = pps
        use("smid")
        plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=ql, backend="triton")
        st = None
        for rep in range(3):
            plan.run(**args, out=out)
            torch.cuda.synchronize()
            st = next(iter(plan.state.values()))
            m = st.ws[0]  # [items, Hkv, P, BM]
            live = 14  # B=81/8k: every sequence splits into 14 partitions
            ids = m[:, :, :live, 0].flatten().long().cpu()
            hist = torch.bincount(ids, minlength=sms)
            order = ids.view(B, live).t().flatten()[:48].tolist()  # dispatch order: x fastest, then z
            print(f"  smid P={st.split.P} rep {rep}: live per SM min {int(hist.min())} max {int(hist.max())} "
                  f"SMs with none {int((hist == 0).sum())}; first 48 live programs' SMs {order}", flush=True)
    use("base")
    os.environ.pop("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", None)
from pa_backend import triton as _pt  # noqa: E402

print("resident programs per SM by kernel:", getattr(_pt, "_RESIDENT", {}), flush=True)
