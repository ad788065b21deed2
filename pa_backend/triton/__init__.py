"""Triton implementation of ``pa_decode`` (split-K partitions + reduce), ``pa_prefill`` (the same
kernels over chunks of query rows; one host read of query_start_loc / context_lengths to build
the chunks, so prefill is not graph-capturable) and ``write_kv``.

Status: tested under TRITON_INTERPRET=1 on CPU, compiled for sm_90 without spills, and run on an
H200 (the GPU grid of pa_backend/tests/test_gpu.py); ``backend="auto"`` chooses it on NVIDIA GPUs.
Not run on AMD (no AMD GPU here).
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

from backend_core import platform
from ..contract import PAProblem, WriteProblem
from ..fp8 import fp8_max
from ..planner import PROGRAMS_PER_SM, plan_partitions, work_rows, workspace

__all__ = ["available", "supports", "run", "decode_tiling", "reduce_warps"]


def available() -> Tuple[bool, str]:
    return platform.triton_runnable()


def supports(p) -> Tuple[bool, str]:
    ok, why = platform.triton_device_ok(p.device)
    if not ok:
        return ok, why
    if p.cache.key_cache.dtype != torch.float8_e4m3fn and not (p.device.type == "cuda" and platform.is_hip()):
        return False, "float8_e4m3fnuz caches need an AMD GPU (the CPU interpreter and NVIDIA have no fnuz)"
    return True, "ok"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return v


@functools.lru_cache(maxsize=1024)
def decode_tiling(D: int, BM: int) -> Tuple[int, int, int]:
    """(BT tokens per tile, warps, pipeline stages) of the partition kernel (BT is capped at the
    partition's length by the caller). The live tiles (K or V [BT, D], acc [BM, D], S [BM, BT])
    must fit a thread's registers: the sm_90 resource test checks every shipped shape for spills.
    FLYDSL_BACKENDS_PA_TRITON_BT / _WARPS / _STAGES override them for tuning sweeps (call
    ``decode_tiling.cache_clear()`` after changing them)."""
    bt = (64 if D <= 128 else 32) // (2 if BM * D > 8192 else 1)
    bt = _env_int("FLYDSL_BACKENDS_PA_TRITON_BT", bt)
    if bt & (bt - 1) or bt < 16:
        raise ValueError(f"FLYDSL_BACKENDS_PA_TRITON_BT={bt}: expected a power of two >= 16")
    # H200 sweep (benchmarks/NOTES.md): 4 warps and 4 stages won at every decode shape measured;
    # D = 256 tiles need 8 warps to stay clear of spills
    return (bt, _env_int("FLYDSL_BACKENDS_PA_TRITON_WARPS", 4 if D <= 128 else 8),
            _env_int("FLYDSL_BACKENDS_PA_TRITON_STAGES", 4))


def programs_per_sm() -> int:
    """The planner's programs-per-SM target (FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM overrides it)."""
    return _env_int("FLYDSL_BACKENDS_PA_PROGRAMS_PER_SM", PROGRAMS_PER_SM)


def reduce_warps(D: int, BM: int) -> int:
    return 4 if BM * D <= 8192 else 8


def _qk_dtype():
    import triton.language as tl

    return tl.float16 if platform.triton_interpreter_enabled() else tl.bfloat16


def run(p):
    if isinstance(p, WriteProblem):
        return _run_write(p)
    return _run_attention(p)


def _run_write(p: WriteProblem) -> None:
    from .write_kv import write_kv_kernel  # imports triton

    c = p.cache
    T = int(p.key.shape[0])
    if T == 0:
        return None
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    write_kv_kernel[(T, c.Hkv)](
        p.key, p.value, kc, vc, ks, vs, p.slot_mapping, c.num_blocks * c.block_size, p.slot_mapping.stride(0),
        p.key.stride(0), p.key.stride(1), p.value.stride(0), p.value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0) if c.k_per_token else 0, ks.stride(1) if c.k_per_token else 0,
        vs.stride(0) if c.v_per_token else 0, vs.stride(1) if c.v_per_token else 0,
        D=c.D, BS=c.block_size, FMAX=fp8_max(kc.dtype), MIN_EXP=-7 if kc.dtype == torch.float8_e4m3fnuz else -6,
        V5D=c.v_transposed, K_PER_TOKEN=c.k_per_token, V_PER_TOKEN=c.v_per_token, num_warps=1 if c.D <= 128 else 2,
    )
    return None


def _prefill_chunks(p: PAProblem, rows_per_chunk: int):
    """(chunks [n, 4] int32 on the device, first row, end row): each chunk is (sequence, first query
    row, rows, context its last row sees). Reads query_start_loc and context_lengths (host sync)."""
    qsl = p.query_start_loc_host
    ctx = p.context_lengths.tolist()
    items = []
    for s in range(p.num_seqs):
        ql = qsl[s + 1] - qsl[s]
        for r0 in range(0, max(ql, 0), rows_per_chunk):
            n = min(rows_per_chunk, ql - r0)
            items.append((s, qsl[s] + r0, n, ctx[s] - ql + r0 + n))
    chunks = torch.tensor(items or [(0, 0, 0, 0)], dtype=torch.int32).to(p.device)
    return chunks, len(items), qsl[0], qsl[-1]


def _run_attention(p: PAProblem) -> torch.Tensor:
    import triton.language as tl

    from .pa_decode import pa_decode_partition_kernel, pa_decode_reduce_kernel  # imports triton

    c = p.cache
    G, D = p.Hq // c.Hkv, c.D
    if p.is_decode:
        QL, items, chunks = p.query_length, p.num_seqs, p.context_lengths
    else:
        QL = max(1, 64 // G)
        chunks, items, r_first, r_end = _prefill_chunks(p, QL)
        p.out[:r_first].zero_()  # rows outside every sequence
        p.out[r_end:].zero_()
    if items == 0:
        return p.out
    BM = work_rows(G, QL)
    bt, warps, stages = decode_tiling(D, BM)
    sms = platform.sm_count(p.device)
    max_tokens = int(p.block_tables.shape[1]) * c.block_size
    P, nbp = plan_partitions(items, c.Hkv, max_tokens, c.block_size, sms, p.num_partitions or 0,
                             programs_per_sm())
    if c.block_size & (c.block_size - 1):
        # a block of 48, 80, 96 or 112 tokens: tiles of its largest power-of-two divisor (>= 16), so a
        # tile always lies inside one block and the tile count per partition is exact
        bt = min(bt, c.block_size & -c.block_size)
    else:
        bt = min(bt, nbp * c.block_size)  # both powers of two: the tile count per partition is exact
    ws_m, ws_l, ws_acc = workspace(p.device, items, c.Hkv, P, BM, D)
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    pa_decode_partition_kernel[(items, c.Hkv, P)](
        p.query, kc, vc, ks, vs, p.block_tables, p.context_lengths, chunks, ws_m, ws_l, ws_acc,
        p.softmax_scale, p.sliding_window, max_tokens,
        p.query.stride(0), p.query.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0) if c.k_per_token else 0, ks.stride(1) if c.k_per_token else 0,
        vs.stride(0) if c.v_per_token else 0, vs.stride(1) if c.v_per_token else 0,
        p.block_tables.stride(0), p.context_lengths.stride(0),
        HKV=c.Hkv, G=G, QL=QL, BM=BM, D=D, BS=c.block_size, NBP=nbp, BT=bt, QK_DTYPE=_qk_dtype(), PV_DTYPE=tl.float16,
        V5D=c.v_transposed, K_PER_TOKEN=c.k_per_token, V_PER_TOKEN=c.v_per_token, RAGGED=not p.is_decode,
        num_warps=warps, num_stages=stages,
    )
    pa_decode_reduce_kernel[(items, c.Hkv)](
        ws_m, ws_l, ws_acc, p.sinks if p.sinks is not None else ws_m, p.out, p.context_lengths, chunks,
        p.out.stride(0), p.out.stride(1), p.context_lengths.stride(0),
        HKV=c.Hkv, G=G, QL=QL, BM=BM, D=D, P=P, HAS_SINKS=p.sinks is not None, RAGGED=not p.is_decode,
        num_warps=reduce_warps(D, BM),
    )
    return p.out
