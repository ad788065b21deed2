"""Resource report of the Triton paged-attention kernels compiled ahead of time, without a GPU: for sm_90
(ptxas: registers, spills) and for AMD gfx942 / gfx950 (the AMDGPU backend: VGPRs, scratch), each with
the constexprs the launcher picks on that vendor."""

from __future__ import annotations

import inspect
from typing import Dict, Optional

from backend_core.tests.aot import amdgcn_report as _amdgcn_report
from backend_core.tests.aot import ptxas_report as _ptxas_report

__all__ = ["ptxas_report", "amdgcn_report", "SHIPPED_CONFIGS", "SPILL_ALLOWED",
           "AMD_SCRATCH_ALLOWED"]

# (D, block_size, G * query_length rows, V 5-D, per-token scales) covering the shapes
SHIPPED_CONFIGS = [(D, bs, m, v5, pt) for D in (64, 128, 256) for bs in (16, 64, 128) for m in (16, 64)
                   for v5, pt in ((False, False), (True, True))]

# Spill bytes (stores) allowed per configuration; every other shipped configuration must not spill.
# Prefill D=128, M=256 (8 warps): 164 bytes with Triton 3.6, kept because it measured faster than the best
# spill-free setting (prefill_tiling's docstring says why).
# Decode D=128, M=16, one warp, task queue, capped at 168 registers (register_cap: 12 programs per SM):
# 4 bytes with tensor scales (kept: the uncapped program, 207 registers and 9 per SM, was much slower), 48 with
# the 5-D V layout and per-token scales (not timed on the GPU).
# The same prefill program writing its rows itself (P = 1, no reduce): 244 bytes (not timed alone; the
# engine's eager steps run it).
# Where they sit (ptxas_report's hot_spills, from the SASS): the decode programs' spills are all outside their
# tile loops (stored once per program, reloaded once per task: 1 / 12 instructions), the prefill tile's are in
# its tile loop (48 instructions per tile at M 256); the resource test keeps decode spills out of the tile loops.
# The D=256 one-query programs with the 5-D V layout and per-token scales (128 registers; task and direct
# launches): 4 bytes since context lengths are clamped where they are read (input safety; registers unchanged,
# the spill is outside their tile loops; not timed on the GPU).
# The small-work split (one more batch scalar, the sqrt rule in _partition_span) raised the
# one-warp queue program's spills outside its tile loops from 4 to 40 bytes (48 -> 72 with the 5-D V layout and
# per-token scales); none in the tile loops (hot_spills 0).
SPILL_ALLOWED = {("prefill", 128, 256): 512, ("direct-prefill", 128, 256): 512, (128, 16, 16, False, False): 40,
                 (128, 16, 16, True, True): 72, (256, 16, 16, True, True): 4,
                 ("direct", 256, 16, 1): 4}


# AMD (compiled here with Triton 3.6, never run on AMD hardware): scratch bytes per lane allowed per
# configuration (arch dropped from the key). None: every configuration the test compiles, with the tilings the
# launcher picks on AMD (decode_tiling / prefill_tiling with amd=True), has no scratch on gfx942 and gfx950.
AMD_SCRATCH_ALLOWED: Dict[tuple, int] = {}


def ptxas_report(D: int = 128, block_size: int = 16, M: Optional[int] = 16, v5d: bool = False, per_token: bool = False,
                 kernel: str = "partition", ragged: bool = False, queue=None, direct: bool = False,
                 sinks: bool = False) -> Dict[str, int]:
    """ptxas numbers (sm_90) of one shipped kernel configuration. ``queue``: the partition kernel's launch
    mode (None: what a shape-only decode plan uses, the task queue for one-warp programs); ``direct``: a
    grid launch with one partition per item that writes the output rows (no reduce), with ``sinks``."""
    fn, types, constexprs, divisible, warps, stages, maxnreg = _spec(D, block_size, M, v5d, per_token, kernel, ragged,
                                                                     queue, direct, sinks, amd=None)
    return _ptxas_report(fn, types, constexprs, divisible, warps, num_stages=stages, maxnreg=maxnreg)


def amdgcn_report(arch: str = "gfx942", D: int = 128, block_size: int = 16, M: Optional[int] = 16, v5d: bool = False,
                  per_token: bool = False, kernel: str = "partition", ragged: bool = False, queue=None,
                  direct: bool = False, sinks: bool = False) -> Dict[str, int]:
    """The AMDGPU backend's numbers (VGPRs, scratch bytes, LDS) of one shipped configuration compiled for
    ``arch`` as the launcher builds it there: the e4m3fnuz cache type on gfx942 (e4m3fn on gfx950), V's
    NaN bytes cleared with ``where`` (no maxNum), FP16 Q.K dots, no per-SM counters, no register cap."""
    fn, types, constexprs, divisible, warps, stages, _ = _spec(D, block_size, M, v5d, per_token, kernel, ragged,
                                                               queue, direct, sinks, amd=arch)
    return _amdgcn_report(fn, types, constexprs, divisible, warps, arch=arch, num_stages=stages)


def _arg_types(fn, cache_type: str = "*fp8e4nv") -> Dict[str, str]:
    """The Triton type strings of kernel ``fn``'s runtime arguments, by this package's naming: FP8 caches
    (``cache_type``), int32 tables / lengths / chunks / slots / queue, BF16 activations, other pointers fp32,
    the softmax scale fp32, strides and batch scalars int32 (constexprs are not listed)."""
    types = {}
    for n in inspect.signature(fn.fn).parameters:
        if n in ("p_kc", "p_vc"):
            types[n] = cache_type
        elif n in ("p_block_tables", "p_cl", "p_slots", "p_chunks", "p_queue"):
            types[n] = "*i32"
        elif n in ("p_q", "p_out", "p_k", "p_v"):
            types[n] = "*bf16"
        elif n.startswith("p_"):
            types[n] = "*fp32"
        elif n == "softmax_scale":
            types[n] = "fp32"
        elif n.startswith("stride_") or n in ("sliding_window", "capacity", "max_tokens", "num_blocks", "few_target",
                                              "short_target", "min_pt", "long_pt", "P", "n_items", "num_sms"):
            types[n] = "i32"
    return types


def _spec(D, block_size, M, v5d, per_token, kernel, ragged, queue, direct, sinks, amd):
    """(kernel, argument types, constexprs, 16-divisible arguments, warps, stages, register cap) of one
    configuration as the launcher builds it on NVIDIA sm_90 (``amd`` None) or on the AMD ``amd`` arch."""
    from pa_backend.triton.pa_decode import pa_decode_partition_kernel, pa_decode_reduce_kernel
    from pa_backend.triton.write_kv import write_kv_kernel

    fn = {"partition": pa_decode_partition_kernel, "reduce": pa_decode_reduce_kernel, "write": write_kv_kernel}[kernel]
    types = _arg_types(fn, "*fp8e4b8" if amd == "gfx942" else "*fp8e4nv")  # fp8.py: e4m3fnuz on gfx942
    # the launcher passes these flags as bools; Triton compiles some integer constexprs differently (with
    # V5D = K_PER_TOKEN = 1 the gfx950 D 256 decode program spilled 140 bytes, with True none)
    v5d, per_token, direct, sinks = bool(v5d), bool(per_token), bool(direct), bool(sinks)
    maxnreg = None
    if kernel == "partition":
        from pa_backend.planner import work_rows
        from pa_backend.triton.tiling import decode_tiling, prefill_tiling

        if ragged:  # prefill: GQA 4, the shipped prefill tiling (M None: its rows)
            G = 4
            rows, bt, warps, stages = prefill_tiling(D, G, block_size, amd is not None)
            QL = rows if M is None else M // G
        else:
            G, QL = M, 1
        BM = work_rows(G, QL)
        if not ragged:
            bt, warps, stages = decode_tiling(D, BM, block_size, amd is not None)
        constexprs = dict(HKV=1, G=G, QL=QL, BM=BM, D=D, BS=block_size, BT=bt, ALIGN=max(bt, block_size), V5D=v5d,
                          K_PER_TOKEN=per_token, V_PER_TOKEN=per_token, RAGGED=ragged, V_MAXNUM=amd is None,
                          QUEUE=(warps == 1 and not ragged and not direct) if queue is None else queue,
                          SM_SLOTS=0 if amd else 256, DIRECT=direct, HAS_SINKS=sinks,
                          QK8=BM >= 64 and amd is None)  # what fp8_qk picks on sm_90 with e4m3fn caches
        from pa_backend.triton.tiling import register_cap

        maxnreg = register_cap(warps, constexprs["QUEUE"], not ragged) if amd is None else None
    elif kernel == "write":
        import torch

        from pa_backend.triton.write_kv_launch import fp8_write_constants

        fp8 = torch.float8_e4m3fnuz if amd == "gfx942" else torch.float8_e4m3fn  # the cache format _run_write sees
        constexprs = dict(D=D, BS=block_size, **fp8_write_constants(fp8), V5D=v5d, K_PER_TOKEN=per_token,
                          V_PER_TOKEN=per_token)
        warps = 1 if D <= 128 else 2
        stages = 3
    else:
        from pa_backend.triton.tiling import reduce_unroll, reduce_warps

        BM = M
        constexprs = dict(HKV=1, G=M, QL=1, BM=BM, D=D, ALIGN=64, HAS_SINKS=True, RAGGED=ragged, QUEUE=True,
                          SM_SLOTS=0 if amd else 256, UNROLL=reduce_unroll(D, BM))
        warps, stages = reduce_warps(D, BM), 3
    if kernel in ("partition", "write") and not v5d:
        # Triton specializes an integer argument equal to 1 as a constant at launch: the 4-D V
        # layout's token stride is 1, and the compiled code (vectorized loads) depends on it
        types.pop("stride_vc_3")
        constexprs["stride_vc_3"] = 1
    divisible = [n for n in types if n.startswith(("p_", "stride_"))]
    return fn, types, constexprs, divisible, warps, stages, maxnreg
