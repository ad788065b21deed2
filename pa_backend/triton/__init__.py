"""Triton implementation of ``pa_decode`` (split-K partitions + reduce), ``pa_prefill`` (the same
kernels over chunks of query rows, built on the host from the query offsets the plan holds) and
``write_kv``.

Launch state (grid, tiling, split-K plan, prefill chunks on the device, workspace views) is built
once per plan (``PAProblem.plan``: one forward batch) and layer shape, then reused by every layer:
a layer's call only launches. No step reads device memory on the host.

Status: tested under TRITON_INTERPRET=1 on CPU, compiled for sm_90 (no spills but the measured
exceptions in the SPILL_ALLOWED list of pa_backend/tests/triton_resources.py), and run on NVIDIA GPUs (the GPU grid of
pa_backend/tests/test_gpu.py); ``backend="auto"`` chooses it on NVIDIA GPUs. Not run on AMD (no AMD
GPU here; there the task queue runs without the per-SM limit, which reads NVIDIA's %smid).
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch

from backend_core import platform
from backend_core.launch import bind
from backend_core.validation import CheckMemo, env_positive_int

from ..contract import PAProblem, WriteProblem
from ..fp8 import fp8_max, fp8_nan_byte
from ..planner import (
    FEW_PROGRAMS_PER_SM,
    PROGRAMS_PER_SM,
    QUEUE_SM_SLOTS,
    plan_partitions,
    task_queue,
    work_rows,
    workspace,
)

__all__ = ["available", "supports", "run", "decode_tiling", "prefill_tiling", "split_policy", "reduce_warps",
           "reduce_unroll", "register_cap", "fp8_qk"]


def available() -> Tuple[bool, str]:
    return platform.triton_runnable()


def supports(p) -> Tuple[bool, str]:
    ok, why = platform.triton_device_ok(p.device)
    if not ok:
        return ok, why
    if p.cache.key_cache.dtype != torch.float8_e4m3fn and not (p.device.type == "cuda" and platform.is_hip()):
        return False, "float8_e4m3fnuz caches need an AMD GPU (the CPU interpreter and NVIDIA have no fnuz)"
    return True, "ok"


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
    gluon_mode()
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
def prefill_tiling(D: int, G: int, block_size: int = 16, amd: bool = False,
                   m: Optional[int] = None) -> Tuple[int, int, int, int]:
    """(query rows per work item, BT, warps, stages) of a prefill launch: a work item is a tile of
    query rows of one sequence times its GQA group (the dots' M = rows * G). FLYDSL_BACKENDS_PA_PREFILL_M
    / _BT / _WARPS / _STAGES override them (call ``prefill_tiling.cache_clear()`` after changing them).
    On NVIDIA, D=128: M 256, BT 64, 8 warps, 2 stages, the fastest setting of a tuning sweep (about 10%
    ahead of M 128 with 4 warps; docs/performance.md), although ptxas spills 164 bytes at M 256 with
    Triton 3.6; the resource test allows exactly this configuration's spills (SPILL_ALLOWED in
    pa_backend/tests/triton_resources.py).

    ``m``: this M instead (the Gluon kernel's 128-row prefill items, gluon_prefill).

    ``amd``: the tiling for AMD GPUs, not run there (no AMD GPU here). NVIDIA's M 256 / 8-warp tile
    needs all 256 VGPRs and 64 KB of LDS there and spills ~500 bytes per lane (gfx942 496, gfx950 524):
    an 8-wave workgroup caps a wave at 256 registers. D <= 128 takes M 128, BT 64, 4 warps, 1 stage
    instead (the tile sizes vLLM 0.33's paged prefix-prefill Triton kernel launches with on ROCm as on
    CUDA; a 4-wave workgroup may use the accumulation registers too): no scratch on either arch
    (the resource test's amdgcn_report). D 256 keeps M 64 (no scratch).
    """
    m = m or env_positive_int("FLYDSL_BACKENDS_PA_PREFILL_M",
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


def run(p):
    if isinstance(p, WriteProblem):
        return _run_write(p)
    return _run_attention(p)


def fp8_write_constants(dtype: torch.dtype) -> dict:
    """write_kv_kernel's constexprs of the cache's FP8 format: its largest value, the exponent below which
    its values are subnormal, and its NaN byte (e4m3fn: 448, -6, 0x7F; e4m3fnuz: 240, -7, 0x80)."""
    return dict(FMAX=fp8_max(dtype), MIN_EXP=-7 if dtype == torch.float8_e4m3fnuz else -6, NAN_BYTE=fp8_nan_byte(dtype))


def _run_write(p: WriteProblem) -> None:
    from .write_kv import write_kv_kernel  # imports triton

    c = p.cache
    T = int(p.key.shape[0])
    if T == 0:
        return None
    # a call with the same addresses, shapes and strides as an earlier one (a server's layers, step after
    # step): the launch made for it again, every argument kept (backend_core.launch.Bound)
    bound = _WRITE_LAUNCHES.get(p.memo_key) if p.memo_key is not None else None
    if bound is not None and bound():
        return None
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    _, bound = bind(
        write_kv_kernel, (T, c.Hkv), (),
        p.key, p.value, kc, vc, ks, vs, p.slot_mapping, c.num_blocks * c.block_size, p.slot_mapping.stride(0),
        p.key.stride(0), p.key.stride(1), p.value.stride(0), p.value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0) if c.k_per_token else 0, ks.stride(1) if c.k_per_token else 0,
        vs.stride(0) if c.v_per_token else 0, vs.stride(1) if c.v_per_token else 0,
        D=c.D, BS=c.block_size, **fp8_write_constants(kc.dtype),
        V5D=c.v_transposed, K_PER_TOKEN=c.k_per_token, V_PER_TOKEN=c.v_per_token, num_warps=1 if c.D <= 128 else 2,
    )
    if bound is not None and p.memo_key is not None:
        _WRITE_LAUNCHES.put(p.memo_key, p.device, bound)
    return None


# write_kv's launches by check-memo key (least recently used dropped first); a Bound holds no tensor
_WRITE_LAUNCHES = CheckMemo(1024)


def prefill_chunks(qsl, rows_per_chunk: int):
    """Work items of a ragged batch: chunks of at most ``rows_per_chunk`` query rows of one
    sequence, as (sequence, first query row, rows, rows of the sequence after the chunk) — the
    kernel sees context_lengths[sequence] - rows_after tokens for the chunk's last row. From the
    host query offsets ``qsl`` (no device read)."""
    items = []
    for s in range(len(qsl) - 1):
        ql = qsl[s + 1] - qsl[s]
        for r0 in range(0, max(ql, 0), rows_per_chunk):
            n = min(rows_per_chunk, ql - r0)
            items.append((s, qsl[s] + r0, n, ql - r0 - n))
    return items


def _to_device(rows, device):
    """(device tensor, its pinned host source or None). The caller keeps the host source as long as the
    device tensor: a copy recorded into a CUDA graph (a plan's first run inside a capture) reads that host
    memory again at every replay, so it must not return to the pinned-memory cache."""
    t = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int32)
    if device.type == "cuda":
        t = t.pin_memory()
        return t.to(device, non_blocking=True), t  # no host sync
    return t.to(device), None


class _Launch:
    """Everything a layer's launch needs that does not change between the layers of one batch."""

    def __init__(self, p: PAProblem):
        c = p.cache
        self.G, self.D = p.Hq // c.Hkv, c.D
        amd = p.device.type == "cuda" and platform.is_hip()
        if p.is_decode:
            self.QL, self.items, self.chunks = p.query_length, p.num_seqs, None
            self.zero_rows = None
        else:
            # the Gluon kernel's prefill takes 128-row items (gluon_decode.py), the Triton kernel 256
            self.prefill_m = GLUON_PREFILL_M if gluon_prefill(p) else None
            self.QL = prefill_tiling(self.D, self.G, c.block_size, amd, self.prefill_m)[0]
            # the chunks that see the most context first (a sequence's last chunks): the long programs
            # start in the first wave instead of forming the tail
            rows = sorted(prefill_chunks(p.query_start_loc_host, self.QL), key=lambda r: r[3])
            self.items = len(rows)
            self.chunks, self._chunks_host = _to_device(rows, p.device)
            self.zero_rows = (p.query_start_loc_host[0], p.query_start_loc_host[-1])  # rows outside every sequence
        self.BM = work_rows(self.G, self.QL)
        if p.is_decode:
            bt, self.warps, self.stages = decode_tiling(self.D, self.BM, c.block_size, amd)
        else:
            _, bt, self.warps, self.stages = prefill_tiling(self.D, self.G, c.block_size, amd, self.prefill_m)
        if bt & (bt - 1) or bt < 16:
            raise ValueError(f"BT={bt}: expected a power of two >= 16")
        if c.block_size & (c.block_size - 1):
            # a block of 48, 80, 96 or 112 tokens: tiles of its largest power-of-two divisor (>= 16), so a
            # tile always lies inside one block
            bt = min(bt, c.block_size & -c.block_size)
        self.bt = bt
        self.align = max(bt, c.block_size)
        self.max_tokens = int(p.block_tables.shape[1]) * c.block_size
        bound = self.max_tokens
        plan = p.plan
        if plan is not None and plan.max_context is not None:
            bound = min(bound, max(int(plan.max_context), 1))
        # the small-work split for shape-only decode plans (CUDA graphs, eager calls without a bound; measured on
        # decode only, so prefill's items keep the 256-token floor); a plan bounded by its batch's max context
        # keeps one partition per short sequence (written directly, no reduce)
        self.split = plan_partitions(self.items, c.Hkv, bound, platform.sm_count(p.device), p.num_partitions or 0,
                                     *split_policy(self.warps),
                                     small_split=p.is_decode and (plan is None or plan.max_context is None))
        self.ws = workspace(p.device, self.items, c.Hkv, self.split.P, self.BM, self.D) if self.items else None
        # one-warp decode programs of a shape-only plan (the table width bounds the context: CUDA graphs,
        # eager calls) take tasks from a device queue (pa_decode.py): such a grid carries programs past
        # each sequence's split, and the live ones land unevenly. A plan that knows its batch's max context
        # sizes the grid to it, and the grid is then as fast or faster (measured; docs/performance.md).
        # Larger programs keep the grid.
        self.queue_mode = (p.is_decode and self.warps == 1 and not p.num_partitions
                           and (plan is None or plan.max_context is None))
        self.queue = task_queue(p.device) if self.items else None
        self.tasks = self.items * c.Hkv * self.split.P  # the task space's upper bound (shape-only)
        self.sms = platform.sm_count(p.device) if p.device.type == "cuda" else 4  # interpreter: a few programs
        self.resident_key = (p.device, self.D, self.BM, self.bt, self.warps, self.stages, c.v_transposed,
                             c.k_per_token, c.v_per_token, not p.is_decode, register_cap(self.warps))
        self.v_maxnum = _v_maxnum(p.device)
        self.qk8 = fp8_qk(p.device, c, self.BM, p.query.dtype)
        # per-SM program counters (NVIDIA: %smid): a power of two >= the SM count
        self.sm_slots = min(1 << (self.sms - 1).bit_length(), QUEUE_SM_SLOTS) if self.v_maxnum else 0
        cap = register_cap(self.warps, self.queue_mode, p.is_decode) if self.v_maxnum else None  # NVIDIA
        self.launch_options = {"maxnreg": cap} if cap else {}
        self.grid = None if self.queue_mode else (self.items, c.Hkv, self.split.P)  # queue: set on first launch
        # one partition per item (a plan bounded by a short max context, or a narrow table): the partition
        # kernel writes the output rows itself and the reduce is not launched (one launch per layer less)
        self.direct = not self.queue_mode and self.split.P == 1
        self.reduce_warps, self.reduce_unroll = reduce_warps(self.D, self.BM), reduce_unroll(self.D, self.BM)
        # the warp-specialized Gluon partition kernel instead of the Triton one (gluon_decode.py)
        self.gluon = gluon_ws(p, self)
        # a plan's bound launches (backend_core.launch.bind) by layer signature; eager calls: none
        self.bound = {} if plan is not None else None


# programs per SM of each compiled partition kernel (platform.resident_programs), filled by its first
# launch: the grid of later launches (and of captured graphs) is one wave of resident programs
_RESIDENT: dict = {}


def launch_state(p: PAProblem) -> _Launch:
    """The launch state of ``p``: made once per plan and layer shape (eager calls: every call)."""
    if p.plan is None:
        return _Launch(p)
    c = p.cache
    key = ("triton", p.Hq, c.Hkv, c.D, c.block_size, p.num_partitions)
    st = p.plan.state.get(key)
    if st is None:
        st = p.plan.state[key] = _Launch(p)
    return st


def _clear_unworked_rows(L: "_Launch", p: PAProblem) -> bool:
    """Zero the output rows outside every work item (a prefill's padding rows); whether any item has work."""
    if L.zero_rows is not None:
        p.out[:L.zero_rows[0]].zero_()
        p.out[L.zero_rows[1]:].zero_()
    return L.items > 0


def _run_attention(p: PAProblem) -> torch.Tensor:
    L = launch_state(p)
    if not _clear_unworked_rows(L, p):
        return p.out
    c = p.cache
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    ws_m, ws_l, ws_acc = L.ws
    sinks = p.sinks if p.sinks is not None else ws_m  # any fp32 pointer when there are none
    # the later layers of a plan with this layer's signature (shapes, strides, dtypes, alignment, scalars):
    # only the query, caches, scales, sinks and output change, so their addresses go into the bound launches'
    # argument lists (no argument list or launch key built per layer)
    bound = L.bound.get(p.layer_key) if L.bound is not None and p.layer_key is not None else None
    if bound is not None and bound[0](p.query, kc, vc, ks, vs, sinks, p.out):
        if bound[1] is not None:
            _reduce(L, bound[1], sinks, p)
        return p.out
    if L.gluon and gluon_covers(p):
        return _run_gluon(L, sinks, p)
    from .pa_decode import pa_decode_partition_kernel  # imports triton

    chunks = L.chunks if L.chunks is not None else p.context_lengths
    sp = L.split
    grid = L.grid
    if grid is None:  # the queue: one wave of resident programs (an estimate until the kernel has run once)
        per_sm = _RESIDENT.get(L.resident_key)
        grid = (max(1, min(L.tasks, L.sms * (per_sm or platform.resident_programs(p.device, L.warps)))),)
        if per_sm:
            L.grid = grid
    k, part = bind(
        pa_decode_partition_kernel, grid, _PARTITION_VARY,
        p.query, kc, vc, ks, vs, p.block_tables, p.context_lengths, chunks, ws_m, ws_l, ws_acc, sinks, p.out, L.queue,
        L.items, sp.P, L.sms, p.softmax_scale, p.sliding_window, L.max_tokens, c.num_blocks, sp.few, sp.min_tokens,
        sp.long_tokens, sp.short,
        p.query.stride(0), p.query.stride(1), p.out.stride(0), p.out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0) if c.k_per_token else 0, ks.stride(1) if c.k_per_token else 0,
        vs.stride(0) if c.v_per_token else 0, vs.stride(1) if c.v_per_token else 0,
        p.block_tables.stride(0), p.context_lengths.stride(0),
        HKV=c.Hkv, G=L.G, QL=L.QL, BM=L.BM, D=L.D, BS=c.block_size, BT=L.bt, ALIGN=L.align,
        V5D=c.v_transposed, K_PER_TOKEN=c.k_per_token, V_PER_TOKEN=c.v_per_token, RAGGED=not p.is_decode,
        V_MAXNUM=L.v_maxnum, QUEUE=L.queue_mode, SM_SLOTS=L.sm_slots, DIRECT=L.direct,
        HAS_SINKS=L.direct and p.sinks is not None,  # read only by a direct launch (no second compile otherwise)
        QK8=L.qk8 and _aligned16(kc, vc),
        num_warps=L.warps, num_stages=L.stages, **L.launch_options,
    )
    red = None
    if not L.direct:
        red = _reduce(L, None, sinks, p)  # (the queue's counters are zeroed by it: launched before anything else)
        if red is None:
            part = None  # both kernels bound or neither
    if L.queue_mode and L.resident_key not in _RESIDENT:
        _RESIDENT[L.resident_key] = platform.resident_programs(p.device, L.warps, k)
    if part is not None and L.bound is not None and p.layer_key is not None and L.grid is not None:
        L.bound[p.layer_key] = (part, red)
    return p.out


# the partition kernel's arguments that change between the layers of a plan: query, key/value caches and
# scales, sinks, output (the order of its parameters); the reduce kernel's: sinks, output
_PARTITION_VARY = (0, 1, 2, 3, 4, 11, 12)
_REDUCE_VARY = (3, 4)


def _reduce(L: "_Launch", bound, sinks, p: PAProblem):
    """The reduce launch of ``p`` (through ``bound`` when given and taken). Returns a Bound for the plan's
    later layers, or None."""
    from .pa_decode import pa_decode_reduce_kernel

    c, sp = p.cache, L.split
    try:
        if bound is not None and bound(sinks, p.out):
            return bound
        ws_m, ws_l, ws_acc = L.ws
        chunks = L.chunks if L.chunks is not None else p.context_lengths
        return bind(
            pa_decode_reduce_kernel, (L.items, c.Hkv), _REDUCE_VARY,
            ws_m, ws_l, ws_acc, sinks, p.out, p.context_lengths, chunks, L.queue,
            p.sliding_window, sp.few, sp.min_tokens, sp.long_tokens, sp.short, sp.P, L.max_tokens,
            p.out.stride(0), p.out.stride(1), p.context_lengths.stride(0),
            HKV=c.Hkv, G=L.G, QL=L.QL, BM=L.BM, D=L.D, ALIGN=L.align, HAS_SINKS=p.sinks is not None,
            RAGGED=not p.is_decode, QUEUE=L.queue_mode, SM_SLOTS=L.sm_slots,
            UNROLL=L.reduce_unroll, num_warps=L.reduce_warps,
        )[1]
    except BaseException:
        # the reduce zeroes the task counters the partition kernel just used; without it every later
        # launch on this device would find its queue drained and do nothing
        if L.queue_mode and not (p.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            L.queue.zero_()
        raise


# the Gluon kernel's ring slots, its producer warp's registers and the launch's register cap (gluon_decode.py);
# 128-row items (two consumer warpgroups): the same slots and producer, a cap of 168 and 200 per consumer
GLUON_SLOTS, GLUON_PRODUCER_REGS, GLUON_MAXNREG = 4, 72, 128
GLUON_SLOTS_128, GLUON_MAXNREG_128, GLUON_CONSUMER_REGS = 4, 168, 200
GLUON_PREFILL_M = 128


def gluon_mode() -> str:
    """FLYDSL_BACKENDS_PA_GLUON: unset or "0" -> "off", "1" -> "decode" (the 64-row decode programs), "all" ->
    "all" (prefill's 128-row items too)."""
    raw = os.environ.get("FLYDSL_BACKENDS_PA_GLUON", "").strip()
    if raw not in ("", "0", "1", "all"):
        raise ValueError(f"FLYDSL_BACKENDS_PA_GLUON={raw!r}: expected 0, 1 or all")
    return {"": "off", "0": "off", "1": "decode", "all": "all"}[raw]


def gluon_ws(p: PAProblem, L: "_Launch") -> bool:
    """Whether the plan's layers run on the warp-specialized Gluon kernel (gluon_decode.py) where they can:
    Hopper (sm_90: wgmma; not in Triton's interpreter), decode programs of 64 rows launched on a grid with a
    reduce (P > 1; FLYDSL_BACKENDS_PA_GLUON=1), and prefill items of 128 rows too (=all): ``gluon_eligible``.
    Opt-in, because it measured within a few percent of the Triton kernel on the long cases (faster on shorter
    batches; docs/performance.md) and has run on one GPU model only. It launches through Triton's ``kernel[grid]`` at
    every layer
    (no bound launch: more host time per layer in eager steps; none under CUDA graphs). Each layer is checked again
    (``gluon_covers``): the launch state is made from a plan's first layer, and a later one may have a sliding
    window (models that alternate them), other scales, another cache layout or alignment; such a layer takes the
    Triton kernel."""
    mode = gluon_mode()
    return (mode == "all" or (mode == "decode" and p.is_decode)) and gluon_eligible(p, L)


@functools.lru_cache(maxsize=1)
def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper ops (triton.experimental.gluon, Triton 3.6): an experimental
    API, so a Triton without it keeps the Triton kernel."""
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except Exception:  # noqa: BLE001 (no triton, or one without Gluon's Hopper ops)
        return False
    return True


def gluon_device(device: torch.device) -> bool:
    """An sm_90 GPU (wgmma; not Triton's interpreter) with a Triton that has Gluon's Hopper ops: fixed for a
    launch state, checked when it is made (gluon_eligible, gluon_prefill)."""
    return (device.type == "cuda" and _v_maxnum(device) and platform.device_info(device).sm_version == 90
            and gluon_available())


def gluon_covers(p: PAProblem, window: bool = True) -> bool:
    """What the Gluon kernel covers of a layer on a ``gluon_device``: D 128 on the FP8 Q.K path (e4m3fn caches
    with 16-byte strides), 16-token pages (larger ones spill 8 bytes), the 4-D value layout, per-tensor scales,
    no sliding window (``window=False``: whatever the window). Checked for every layer of a plan made for it."""
    c = p.cache
    return (c.D == 128 and fp8_qk(p.device, c, 128, p.query.dtype) and _aligned16(c.key_cache, c.value_cache)
            and c.block_size == 16 and not c.v_transposed and not c.k_per_token and not c.v_per_token
            and (p.sliding_window == 0 or not window))


def gluon_prefill(p: PAProblem) -> bool:
    """Whether the prefill launch state of ``p`` is made for the Gluon kernel: items of GLUON_PREFILL_M rows
    instead of prefill_tiling's (FLYDSL_BACKENDS_PA_PREFILL_M does not apply then). Decided on the plan's first
    layer, whatever its window (a model's first layer may have one where most do not)."""
    return not p.is_decode and gluon_mode() == "all" and gluon_device(p.device) and gluon_covers(p, window=False)


def gluon_eligible(p: PAProblem, L: "_Launch") -> bool:
    """Whether launch state ``L`` suits the Gluon kernel (gluon_ws's conditions but the switch and the layer's)."""
    rows_ok = (L.BM == 64 and not L.direct) if p.is_decode else L.BM == GLUON_PREFILL_M
    return gluon_device(p.device) and gluon_covers(p, window=False) and rows_ok and L.qk8 and not L.queue_mode


def _run_gluon(L: "_Launch", sinks, p: PAProblem, slots: Optional[int] = None,
               producer_regs: int = GLUON_PRODUCER_REGS, maxnreg: Optional[int] = None,
               consumer_regs: int = GLUON_CONSUMER_REGS) -> torch.Tensor:
    """The Gluon partition kernel, then the shipped reduce (none for a direct launch); ``sinks``: p.sinks or any
    fp32 pointer. The caller has zeroed the rows outside every sequence and skipped empty batches
    (_clear_unworked_rows). ``slots`` /
    ``producer_regs`` / ``maxnreg`` / ``consumer_regs``: the ring depth and register split (None: the
    defaults for the item's rows; other values for tuning experiments)."""
    from .gluon_decode import gluon_partition_kernel  # imports triton's gluon

    c, sp = p.cache, L.split
    kc, vc = c.key_cache, c.value_cache
    if slots is None:
        slots = GLUON_SLOTS if L.BM == 64 else GLUON_SLOTS_128
    if maxnreg is None:
        maxnreg = GLUON_MAXNREG if L.BM == 64 else GLUON_MAXNREG_128
    ws_m, ws_l, ws_acc = L.ws
    chunks = L.chunks if L.chunks is not None else p.context_lengths
    gluon_partition_kernel[(L.items, c.Hkv, sp.P)](
        p.query, kc, vc, c.key_scale, c.value_scale, p.block_tables, p.context_lengths, chunks, ws_m, ws_l, ws_acc,
        p.out, sinks, sp.P, p.softmax_scale, L.max_tokens, c.num_blocks, sp.few, sp.min_tokens, sp.long_tokens,
        sp.short, p.query.stride(0), p.query.stride(1), p.out.stride(0), p.out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2),
        p.block_tables.stride(0), p.context_lengths.stride(0),
        HKV=c.Hkv, G=L.G, QL=L.QL, BM=L.BM, D=L.D, BS=c.block_size, BT=64, ALIGN=L.align, NBUF=slots,
        PRODUCER_REGS=producer_regs, RAGGED=not p.is_decode, DIRECT=L.direct, CONSUMER_REGS=consumer_regs,
        HAS_SINKS=L.direct and p.sinks is not None,  # read only by a direct launch (no second compile otherwise)
        num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))
    if not L.direct:
        _reduce(L, None, sinks, p)
    return p.out


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
    return _v_maxnum(device) and platform.device_info(device).sm_version >= 89


def _fp8_qk_override() -> str:
    """FLYDSL_BACKENDS_PA_FP8_QK: "" (the default), "0" or "1"; ValueError otherwise."""
    raw = os.environ.get("FLYDSL_BACKENDS_PA_FP8_QK", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"FLYDSL_BACKENDS_PA_FP8_QK={raw!r}: expected 0 or 1")
    return raw


def _aligned16(*caches: torch.Tensor) -> bool:
    """Every stride but the unit one and the base address a multiple of 16 bytes: the QK8 path's 2-D tile
    loads declare 16-byte runs the compiler cannot derive through the gathered block ids (otherwise the
    call takes the FP16 dots)."""
    return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:-1]) for t in caches)


def _v_maxnum(device: torch.device) -> bool:
    """V's NaN bytes are cleared with maxNum on NVIDIA GPUs (PTX max returns the non-NaN operand);
    the interpreter (numpy) and AMD (not checked here) use `where`."""
    return device.type == "cuda" and not platform.is_hip() and not platform.triton_interpreter_enabled()
