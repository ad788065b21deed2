"""Launcher of the Triton paged-attention kernels (pa_decode.py): ``pa_decode`` and ``pa_prefill``.

``run_attention(p)`` takes a checked layer (``PAProblem``, with ``p.plan`` the plan running it) and launches
the partition kernel, then the reduce kernel (none when every item has one partition). The launch state comes
from the plan (``launch_state.py``); a plan's later layers with the first one's signature launch through the
bound launches kept there (``backend_core.launch.bind``: only the query, caches, scales, sinks and output
change), so no argument list or launch key is built per layer.

Status: tested under TRITON_INTERPRET=1 on CPU, compiled for sm_90 (no spills but the exceptions in the
SPILL_ALLOWED list of pa_backend/tests/triton_resources.py) and run on NVIDIA GPUs (pa_backend/tests/test_gpu.py);
``backend="auto"`` chooses it on NVIDIA GPUs. Not run on AMD (there the task queue runs without the per-SM
limit, which reads NVIDIA's %smid).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend_core import platform
from backend_core.launch import bind

from .launch_state import RESIDENT, Launch, clear_unworked_rows, launch_state
from .tiling import aligned16

if TYPE_CHECKING:  # annotations only (the contract imports the registries, which import this)
    from ..contract import PAProblem

__all__ = ["run_attention"]


def run_attention(p: PAProblem) -> torch.Tensor:
    L = launch_state(p)
    if not clear_unworked_rows(L, p):
        return p.out
    c = p.cache
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    ws_m, ws_l, ws_acc = L.ws
    sinks = p.sinks if p.sinks is not None else ws_m  # any fp32 pointer when there are none
    # the later layers of a plan with this layer's signature (shapes, strides, dtypes, alignment, scalars):
    # only the query, caches, scales, sinks and output change, so their addresses go into the bound launches'
    # argument lists (no argument list or launch key built per layer)
    bound = L.bound.get(p.layer_key) if p.layer_key is not None else None
    if bound is not None and bound[0](p.query, kc, vc, ks, vs, sinks, p.out):
        if bound[1] is not None:
            _reduce(L, bound[1], sinks, p)
        return p.out
    from .pa_decode import pa_decode_partition_kernel  # imports triton

    chunks = L.chunks if L.chunks is not None else p.context_lengths
    sp = L.split
    grid = L.grid
    if grid is None:  # the queue: one wave of resident programs (an estimate until the kernel has run once)
        per_sm = RESIDENT.get(L.resident_key)
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
        QK8=L.qk8 and aligned16(kc, vc),
        num_warps=L.warps, num_stages=L.stages, **L.launch_options,
    )
    red = None
    if not L.direct:
        red = _reduce(L, None, sinks, p)  # (the queue's counters are zeroed by it: launched before anything else)
        if red is None:
            part = None  # both kernels bound or neither
    if L.queue_mode and L.resident_key not in RESIDENT:
        RESIDENT[L.resident_key] = platform.resident_programs(p.device, L.warps, k)
    if part is not None and p.layer_key is not None and L.grid is not None:
        L.bound[p.layer_key] = (part, red)
    return p.out


# the partition kernel's arguments that change between the layers of a plan: query, key/value caches and
# scales, sinks, output (the order of its parameters); the reduce kernel's: sinks, output
_PARTITION_VARY = (0, 1, 2, 3, 4, 11, 12)
_REDUCE_VARY = (3, 4)


def _reduce(L: "Launch", bound, sinks, p: PAProblem):
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
