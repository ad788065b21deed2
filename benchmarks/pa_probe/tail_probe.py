"""Decode at serving shape: the reduce and the gap before it (H200, issue 15; nothing here ships).

Variants, each checked against the float64 reference before it is timed (CUDA-graph replay of a
shape-only plan, 128k-token tables), then profiled (torch.profiler: device time per kernel):
  base      the kernels of PROBE_BASE_COMMIT (default 7e793ba: the reduce loops twice over the partitions,
            one memory round trip per partition, every workspace row stored and read), read from git (the
            device copy carries the landed history)
  tree      the tree's kernels (padding rows neither stored nor read, the max pass one load per 16
            partitions, the weighted sums unrolled: reduce_unroll)
  unroll1   the same with the weighted-sum loop not unrolled
  pps16 / pps24   the tree with FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM=16 / 24 (fewer, longer partitions:
            fewer partials to write and merge; the shipped value for one-warp programs is 32)
Ran at 392bd45 (output: tail_H200_2026-12-04.txt), when the tree also had the reduce as a programmatic
dependent launch of the partition kernel (variants "pdl*"; "nopdl" is today's "tree"). PDL changed
nothing measurable and was removed.
Cases: B=81/8k and B=200/32k (Hq 16 / Hkv 1), B=32/2k (Hq 32 / Hkv 8, GQA 4: 12 of 16 rows padding),
the mixed batch (B=64, 100..32k); B=81/8k and B=32/2k also with exact-width tables.
Run on the GPU machine from the repo root: python3 benchmarks/pa_probe/tail_probe.py [max_seconds]"""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps  # noqa: E402
from probe_util import Relaunch, module_at, probe_line  # noqa: E402  (this folder is on sys.path)
from pa_backend.benchmark import (DEFAULT_CONFIGS, MIXED_CONFIG, TABLE_TOKENS, bench_case, kv_bytes,  # noqa: E402
                                  mixed_lengths)
from pa_backend import triton as pt  # noqa: E402
from pa_backend.triton import pa_decode as kmod  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
t0 = time.time()
SHIPPED = (kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel)
BASE_COMMIT = os.environ.get("PROBE_BASE_COMMIT", "7e793ba")


def base_kernels():
    mod = module_at(BASE_COMMIT, name="tail_probe_base")
    drop = ("UNROLL",)  # the base kernels have no such parameter
    return Relaunch(mod.pa_decode_partition_kernel, drop), Relaunch(mod.pa_decode_reduce_kernel, drop)


# variant -> (kernels, environment)
VARIANTS = {"base": ("base", {}), "tree": ("tree", {}), "unroll1": ("tree1", {}),
            "pps16": ("tree", {"FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM": "16"}),
            "pps24": ("tree", {"FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM": "24"})}
pick = [v for v in os.environ.get("PROBE_VARIANTS", ",".join(VARIANTS)).split(",") if v]
kernels = {"tree": SHIPPED}
SHIPPED_UNROLL = pt.REDUCE_UNROLL
try:
    kernels["base"] = base_kernels()
except Exception as exc:
    print(f"base kernels ({BASE_COMMIT}): {type(exc).__name__}: {str(exc)[:300]}", flush=True)


copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s", flush=True)
cases = [(DEFAULT_CONFIGS[0], (TABLE_TOKENS, 0)), (DEFAULT_CONFIGS[1], (TABLE_TOKENS,)),
         (DEFAULT_CONFIGS[3], (TABLE_TOKENS, 0)), (MIXED_CONFIG, (TABLE_TOKENS,))]
for case, widths in cases:
    B, ctx, ql, Hq, Hkv, D, bs, scales = case
    lens = mixed_lengths(B, *ctx) if isinstance(ctx, tuple) else ctx
    for width in widths:
        kw = bench_case(B, lens, ql, Hq, Hkv, D, bs, scales, "cuda", table_tokens=width)
        args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
        nbytes = kv_bytes(B, kw["context_lengths"].tolist(), Hkv, D, scales)
        out = torch.empty_like(kw["query"])
        label = f"B={B} ctx={ctx} Hq={Hq}/{Hkv} table={int(kw['block_tables'].shape[1]) * bs}"
        for rnd in range(2):  # twice, to see order effects
            for v in pick:
                if time.time() - t0 > budget:
                    print("  budget reached", flush=True)
                    break
                which, env = VARIANTS[v]
                if which.rstrip("1") not in kernels:
                    continue
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel = kernels[which.rstrip("1")]
                pt.REDUCE_UNROLL = 1 if which == "tree1" else SHIPPED_UNROLL
                try:
                    probe_line(label, v, rnd, kw, args, out, nbytes, copy, ql)
                finally:
                    kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel = SHIPPED
                    pt.REDUCE_UNROLL = SHIPPED_UNROLL
                    for k, val in saved.items():
                        if val is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = val
        del kw, args, out
        torch.cuda.empty_cache()
print(f"done in {time.time() - t0:.0f} s", flush=True)
