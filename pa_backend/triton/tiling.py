"""Tiling policy and tuning variables of the Triton paged-attention kernels.

What a launch's shape decides before anything runs: tokens per tile, warps and pipeline stages of the
partition kernel (``decode_tiling``, ``prefill_tiling``), the split-K targets per program size
(``split_policy``), the register cap (``register_cap``), the reduce's warps and unroll, and whether Q.K runs
on FP8 tensor cores (``fp8_qk``). Each default comes with the reason it was chosen; the measurements are in
docs/performance.md. The ``FLYDSL_BACKENDS_PA_*`` tuning variables override them for sweeps
(docs/environment.md); ``check_environment`` parses them all up front.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

from backend_core import platform
from backend_core.validation import env_positive_int

from ..planner import FEW_PROGRAMS_PER_SM, PROGRAMS_PER_SM, work_rows

__all__ = ["check_environment", "decode_tiling", "prefill_tiling", "split_policy", "register_cap", "reduce_warps",
           "reduce_unroll", "fp8_qk", "aligned16", "v_maxnum"]


# the positive-integer tuning variables this module reads (each at its first use)
_TUNING_INTS = ("FLYDSL_BACKENDS_PA_TRITON_BT", "FLYDSL_BACKENDS_PA_TRITON_WARPS", "FLYDSL_BACKENDS_PA_TRITON_STAGES",
                "FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", "FLYDSL_BACKENDS_PA_FEW_PROGRAMS_PER_SM",
                "FLYDSL_BACKENDS_PA_PREFILL_M", "FLYDSL_BACKENDS_PA_PREFILL_BT", "FLYDSL_BACKENDS_PA_PREFILL_WARPS",
                "FLYDSL_BACKENDS_PA_PREFILL_STAGES")


def check_environment() -> None:
    """Parse every tuning variable of the Triton paged ops now (the CLI checks them up front): ValueError naming
    the first malformed one. The kernels read them at their first call."""
    for name in _TUNING_INTS:
        env_positive_int(name, 1)
    if os.environ.get("FLYDSL_BACKENDS_PA_TRITON_MAXNREG", "").strip() not in ("", "0"):
        env_positive_int("FLYDSL_BACKENDS_PA_TRITON_MAXNREG", 0)
    _fp8_qk_override()


@functools.lru_cache(maxsize=1024)
def decode_tiling(D: int, BM: int, block_size: int = 16, amd: bool = False) -> Tuple[int, int, int]:
    """(BT tokens per tile, warps, pipeline stages) of the partition kernel. The live tiles (K or V
    [BT, D], acc [BM, D], S [BM, BT]) must fit a thread's registers: the sm_90 resource test checks
    every shipped shape for spills. FLYDSL_BACKENDS_PA_TRITON_BT / _WARPS / _STAGES override them
    for tuning sweeps (call ``decode_tiling.cache_clear()`` after changing them).

    M = 16 rows at D <= 128 and pages under 64 tokens (decode with GQA x query rows <= 16): one
    warp per program, BT 16. A 4-warp program splits S and acc across its warps, so every tile
    paid cross-warp max/sum reductions and a shared-memory round trip of P, each behind a barrier;
    a one-warp program has none of them and ~12 fit an SM by registers (168 each), which keeps more
    tiles in flight (1.3-1.6x faster; docs/performance.md). M = 64 (4 query rows x GQA 16) keeps 4
    warps, one per 16 rows: a single warp holding all 64 rows, or each query row as a one-warp work item
    of its own (pages read 4x, mostly from L2), measured slower.

    ``amd``: the tiling for AMD GPUs (wavefronts of 64), where nothing here has run: the NVIDIA
    tiling but BT 16 at D 256, so no configuration needs scratch (at BT 32 the 8-warp D 256 program
    with per-token scales and the 5-D V layout spilled 8-20 bytes per lane on gfx942; BT 16 has
    none on gfx942 or gfx950 and fits 3-4 waves per SIMD; the resource test's amdgcn_report)."""
    bt = (64 if D <= 128 else 32) // (2 if BM * D > 8192 else 1)
    if amd and D > 128:
        bt = 16
    warps = 4 if D <= 128 else 8
    if D <= 128 and BM == 16 and block_size < 64:
        bt, warps = 16, 1
    elif D == 128 and BM == 16:
        bt = 32  # 64-token pages: 4 warps, BT 32 measured faster than BT 64 or one warp
    bt = env_positive_int("FLYDSL_BACKENDS_PA_TRITON_BT", bt)
    if bt & (bt - 1) or bt < 16:
        raise ValueError(f"FLYDSL_BACKENDS_PA_TRITON_BT={bt}: expected a power of two >= 16")
    # 5 stages: the first count at which Triton 3.6 double-buffers the K/V copies (pa_decode.py)
    return (bt, env_positive_int("FLYDSL_BACKENDS_PA_TRITON_WARPS", warps),
            env_positive_int("FLYDSL_BACKENDS_PA_TRITON_STAGES", 5))


def split_policy(warps: int) -> Tuple[int, int]:
    """(programs per SM, few programs per SM) the split-K planner aims for with programs of
    ``warps`` warps (planner.plan_partitions): one-warp programs fit ~12 per SM, so they need more
    partitions to fill the GPU than the 4-warp ones (5 per SM); 32 / 8 measured best for one warp
    (16 / 8 and 16 / 4 slower). FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM / _FEW_PROGRAMS_PER_SM override them (tuning)."""
    pps, few = (32, 8) if warps == 1 else (PROGRAMS_PER_SM, FEW_PROGRAMS_PER_SM)
    return (env_positive_int("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", pps),
            env_positive_int("FLYDSL_BACKENDS_PA_FEW_PROGRAMS_PER_SM", few))


@functools.lru_cache(maxsize=1024)
def prefill_tiling(D: int, G: int, block_size: int = 16, amd: bool = False) -> Tuple[int, int, int, int]:
    """(query rows per work item, BT, warps, stages) of a prefill launch: a work item is a tile of
    query rows of one sequence times its GQA group (the dots' M = rows * G). FLYDSL_BACKENDS_PA_PREFILL_M
    / _BT / _WARPS / _STAGES override them (call ``prefill_tiling.cache_clear()`` after changing them).
    On NVIDIA, D=128: M 256, BT 64, 8 warps, 2 stages, the fastest setting of a tuning sweep (about 10%
    ahead of M 128 with 4 warps; docs/performance.md), although ptxas spills 164 bytes at M 256 with
    Triton 3.6; the resource test allows exactly this configuration's spills (SPILL_ALLOWED in
    pa_backend/tests/triton_resources.py).

    ``amd``: the tiling for AMD GPUs, not run there (no AMD GPU here). NVIDIA's M 256 / 8-warp tile
    needs all 256 VGPRs and 64 KB of LDS there and spills ~500 bytes per lane (gfx942 496, gfx950 524):
    an 8-wave workgroup caps a wave at 256 registers. D <= 128 takes M 128, BT 64, 4 warps, 1 stage
    instead (the tile sizes vLLM 0.33's paged prefix-prefill Triton kernel launches with on ROCm as on
    CUDA; a 4-wave workgroup may use the accumulation registers too): no scratch on either arch
    (the resource test's amdgcn_report). D 256 keeps M 64 (no scratch).
    """
    m = env_positive_int("FLYDSL_BACKENDS_PA_PREFILL_M",
                         (128 if amd else 256) if D == 128 else 128 if D < 128 else 64)
    rows = max(1, m // G)
    bt, warps, stages = decode_tiling(D, work_rows(G, rows), block_size, amd)
    if D <= 128 and work_rows(G, rows) >= 128:
        bt, warps, stages = (64, 4, 1) if amd else (64, 8, 2)
    return (rows, env_positive_int("FLYDSL_BACKENDS_PA_PREFILL_BT", bt),
            env_positive_int("FLYDSL_BACKENDS_PA_PREFILL_WARPS", warps),
            env_positive_int("FLYDSL_BACKENDS_PA_PREFILL_STAGES", stages))


def register_cap(warps: int, queue: bool = True, decode: bool = True):
    """ptxas' register cap of a partition launch of ``warps`` warps on NVIDIA (None: no cap): the task
    queue's programs (``queue``); a grid launch of multi-warp decode programs only under the override;
    one-warp grid launches and prefill none. One-warp queue programs: 168, so 12 fit an SM; without it
    the queue loop compiles to 207 registers (9 per SM) and runs far slower (so did a cap of 184, 11 per SM;
    docs/performance.md).
    FLYDSL_BACKENDS_PA_TRITON_MAXNREG overrides it (0: no cap)."""
    raw = os.environ.get("FLYDSL_BACKENDS_PA_TRITON_MAXNREG", "").strip()
    if not (queue or (warps > 1 and decode and raw)) or raw == "0":
        return None
    if raw:
        return env_positive_int("FLYDSL_BACKENDS_PA_TRITON_MAXNREG", 0)
    return 168 if warps == 1 else None


# the most partitions the reduce's loop loads per step (loop_unroll_factor: their loads are independent,
# so an unrolled step has them in flight together; without it each partition costs a memory round trip)
REDUCE_UNROLL = 4


def reduce_warps(D: int, BM: int) -> int:
    return 4 if BM * D <= 8192 else 8


def reduce_unroll(D: int, BM: int) -> int:
    """Partitions per unrolled step of the reduce: up to REDUCE_UNROLL while their partials take at most
    64 registers per thread (D=128, 16 rows: 4; 64 rows: 1, where 4 spilled)."""
    per_thread = BM * D // (32 * reduce_warps(D, BM))
    return max(1, min(REDUCE_UNROLL, 64 // max(per_thread, 1)))




def fp8_qk(device: torch.device, cache, BM: int, query_dtype: torch.dtype) -> bool:
    """Whether the partition kernel's Q.K runs on FP8 tensor cores (pa_decode.py, ``QK8``): K goes from
    shared memory straight into the dots (no FP8 -> FP16 widening, no register round trip) and the BF16
    query enters as an exact pair of FP8 tiles (``_split_query_fp8``: q is not rounded). On by default
    for the wgmma programs (M >= 64 rows: multi-token decode, prefill) on NVIDIA sm_89+ with e4m3fn
    caches and BF16 queries. Never for FP16 queries (the override included): the pair holds 8 significant
    bits, BF16's but not FP16's 11, so it would cut an FP16 query (rel. error 3.6e-3 against 2.2e-4 with
    FP16 dots on a 40-row prefill). It is on because it measured 1.1-1.4x faster on the multi-token decode and
    prefill cases at the same error (docs/performance.md). One-warp M = 16 programs keep
    FP16 dots (their operands pass through registers anyway); AMD keeps them too (not run there).
    FLYDSL_BACKENDS_PA_FP8_QK=0 / 1 overrides the default (1 also runs it in Triton's interpreter, where
    the CPU tests check it)."""
    raw = _fp8_qk_override()
    if raw == "0" or BM < 64 or cache.key_cache.dtype != torch.float8_e4m3fn or query_dtype != torch.bfloat16:
        return False
    if device.type == "cuda" and platform.is_hip():
        return False  # not run on AMD: the FP16 dots there
    if raw == "1":
        return True
    return v_maxnum(device) and platform.device_info(device).sm_version >= 89


def _fp8_qk_override() -> str:
    """FLYDSL_BACKENDS_PA_FP8_QK: "" (the default), "0" or "1"; ValueError otherwise."""
    raw = os.environ.get("FLYDSL_BACKENDS_PA_FP8_QK", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"FLYDSL_BACKENDS_PA_FP8_QK={raw!r}: expected 0 or 1")
    return raw


def aligned16(*caches: torch.Tensor) -> bool:
    """Every stride but the unit one and the base address a multiple of 16 bytes: the QK8 path's 2-D tile
    loads declare 16-byte runs the compiler cannot derive through the gathered block ids (otherwise the
    call takes the FP16 dots)."""
    return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:-1]) for t in caches)


def v_maxnum(device: torch.device) -> bool:
    """V's NaN bytes are cleared with maxNum on NVIDIA GPUs (PTX max returns the non-NaN operand);
    the interpreter (numpy) and AMD (not checked here) use `where`."""
    return device.type == "cuda" and not platform.is_hip() and not platform.triton_interpreter_enabled()
