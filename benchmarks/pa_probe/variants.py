"""NOTE: written for the probe build of pa_decode.py that read PA_PROBE_QK16 / PA_PROBE_VSQ at import
(run on H200, 2026-12-03; results in benchmarks/NOTES.md). The shipped kernel has those paths fixed
(QK16 = QK_DTYPE float16 with the scaled query, VSQ = _V_NAN_BY_MAXNUM), so today only the stages /
BT / programs-per-SM switches still change anything.

Time kernel variants of the Triton PA decode on the GPU (one process; variants switch by env +
module reload). Usage: python3 benchmarks/pa_probe/variants.py MAX_SECONDS > $OUT/variants.txt"""
import importlib, os, sys, time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from pa_backend import pa_decode  # noqa: E402
from pa_backend import triton as ptriton  # noqa: E402
from pa_backend.triton import pa_decode as kmod  # noqa: E402
from pa_backend.benchmark import DEFAULT_CONFIGS, bench_case, kv_bytes, accuracy  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
# name: (QK16, VSQ, stages, BT or None)
VARIANTS = {
    "A_base_s4": (0, 0, 4, None), "B_base_s5": (0, 0, 5, None),
    "C_new_s4": (1, 1, 4, None), "D_new_s5": (1, 1, 5, None), "E_new_s7": (1, 1, 7, None),
    "F_new_bt32_s7": (1, 1, 7, 32), "G_new_bt32_s5": (1, 1, 5, 32),
}
full = os.environ.get("PROBE_FULL", "C_new_s4,D_new_s5,E_new_s7,F_new_bt32_s7,G_new_bt32_s5").split(",")
pps_list = [int(x) for x in os.environ.get("PROBE_PPS", "4,8,16").split(",")]
minor = os.environ.get("PROBE_MINOR", "A_base_s4,D_new_s5,E_new_s7,F_new_bt32_s7").split(",")


def setv(name, pps):
    qk, vsq, st, bt = VARIANTS[name]
    os.environ.update(PA_PROBE_QK16=str(qk), PA_PROBE_VSQ=str(vsq), FLYDSL_BACKENDS_PA_TRITON_STAGES=str(st),
                      FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM=str(pps))
    if bt:
        os.environ["FLYDSL_BACKENDS_PA_TRITON_BT"] = str(bt)
    else:
        os.environ.pop("FLYDSL_BACKENDS_PA_TRITON_BT", None)
    importlib.reload(kmod)
    ptriton.decode_tiling.cache_clear()


for ci, (B, ctx, ql, Hq, Hkv, D, bs, scales) in enumerate(DEFAULT_CONFIGS):
    kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, "cuda")
    out = torch.empty_like(kw["query"])
    nbytes = kv_bytes(B, ctx, Hkv, D, scales)
    runs = ([(v, p) for v in ("A_base_s4", "B_base_s5") for p in (8,)] + [(v, p) for v in full for p in pps_list]
            if ci < 3 else [(v, 8) for v in minor])
    for name, pps in runs:
        if time.time() - t0 > budget:
            print("  budget reached", flush=True)
            break
        setv(name, pps)
        try:
            res = pa_decode(**kw, out=out, backend="triton")
            err = accuracy(kw, res)
            t = time_cuda_graph(lambda i: pa_decode(**kw, out=out, backend="triton"), inner=2, trials=30)
        except Exception as exc:
            print(f"  cfg{ci} {name} pps{pps}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        gb = nbytes / (t.median_us * 1e-6) / 1e9
        print(f"cfg{ci} B={B} ctx={ctx} ql={ql} Hq={Hq} page={bs} {scales} | {name} pps{pps}: {t.median_us:.1f} us "
              f"p10 {t.p10_us:.1f} p90 {t.p90_us:.1f} {100 * gb / copy:.1f}% err {err:.2e} [{time.time() - t0:.0f}s]", flush=True)
    del kw, out
    torch.cuda.empty_cache()
