# Warp-specialized FP8 paged-attention partition kernel, Gluon (NVIDIA sm_90 only).
#
# Design
# ------
# Replaces the Triton partition kernel's grid launch (pa_decode.py) for work items of 64 rows (GQA group x
# query rows, e.g. 16 x 4: MTP / speculative decoding) or 128 rows (prefill chunks of 32 rows x GQA 4), D = 128,
# 4-D value layout, per-tensor scales, no sliding window, on Hopper. The split, the workspace and the reduce
# are the shipped ones: a program (item, KV head, partition) writes the same (m, l, acc) partial the Triton
# task does (a launch of one partition per item, ``DIRECT``: the output rows with the sinks, as the Triton
# task).
# * Worker partition, 1 warp (the producer): per 64-token tile, the tile's block ids from the table (only
#   inside the partition), then cp.async copies of K [BT, D] (16-byte pieces of the x-packed layout) and
#   V^T [D, BT] (16 tokens contiguous) into slot j % NBUF of a shared-memory ring. Tokens past the
#   partition's end are zero-filled for K; V is copied per page, so the NaN bytes of a live page's unused
#   slots may enter (cleared by the consumer). A tile is handed over (wait_group, proxy fence, mbarrier
#   ``ready``) before the producer reads the next table entries.
# * Default partition, 4 warps = one warpgroup (the consumer): the query scaled per row by a power of two
#   and split exactly into two FP8 tiles in shared memory (hi + lo / 16, as pa_decode._split_query_fp8),
#   S = hi.K^T + (lo.K^T) / 16 on FP8 wgmma with K straight from its slot, V widened FP8 -> FP16 through
#   registers into the P.V operand buffer, the slot released (mbarrier ``empty``), the online softmax in
#   registers (exp2, log2 units; the causal diagonal and the partition's end masked in the tiles that reach
#   them, where V's NaN bytes are cleared with maxNum), acc += P.V with P from registers.
# * 128-row items: a second consumer warpgroup (a 4-warp worker partition) takes rows 64..127 and reads the same
#   slots; a slot is released once both have (``empty`` counts two arrivals), so one K/V load serves 128 rows
#   and the two warpgroups' softmax and dots interleave.
# Registers: 64 rows: Triton pads the program to 8 warps; the launch caps them at 128 per thread (two CTAs per
# SM); inside the specialized region the consumer gets ~184 (setmaxnreg), the producer 72. 128 rows: 12 warps
# with the padding, a cap of 168 (one CTA per SM), consumers 200-232, producer 72.
# Shared memory: NBUF x 16 KB ring, 16 KB FP16 V and 16 KB query per consumer: 96 KB at NBUF 4 with one
# consumer (two CTAs per SM), 128 KB at NBUF 4 with two (one CTA per SM).
# Not part of the package: kept here as a runnable experiment (``python3 benchmarks/gluon_decode.py`` on an sm_90
# GPU checks it against the float64 reference and times it against the shipped Triton kernel; its tests are
# benchmarks/test_gluon_decode.py). Measured on one Hopper GPU model (docs/performance.md): about as fast as
# the Triton kernel on the long multi-token decode, faster on shorter batches,
# within a few percent on prefill, so it never became the default. Profiles show it stalling mostly at CTA barriers and
# shared-memory scoreboards, with a tile taking several times what its dots and copies need; what limits it is
# not settled (candidates: one block-id load per page instead of per token, one barrier per tile, bulk copies of
# whole 2 KB pages; K's x-packed page appears to be wgmma's unswizzled K-major layout already).

import argparse
import functools
import os
import sys
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from backend_core import platform  # noqa: E402
from pa_backend.contract import PAProblem, check_layer  # noqa: E402
from pa_backend.triton.launch_state import Launch, clear_unworked_rows, launch_state  # noqa: E402
from pa_backend.triton.pa_decode_launch import _reduce  # noqa: E402
from pa_backend.triton.tiling import aligned16, fp8_qk, v_maxnum  # noqa: E402


@gluon.jit
def _rows(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL: gl.constexpr, RAGGED: gl.constexpr):
    """(table row, first query row, rows, visible context) of work item i_s: the shipped pa_decode._rows_of
    (decode: a sequence of QL rows; prefill: a chunk p_chunks[i_s] = (sequence, first row, rows, rows after);
    a context length clamped to [0, the table row's tokens] as there)."""
    if RAGGED:
        seq = gl.load(p_chunks + i_s * 4).to(gl.int64)
        q0 = gl.load(p_chunks + i_s * 4 + 1).to(gl.int64)
        nrows = gl.load(p_chunks + i_s * 4 + 2)
        ctx = gl.minimum(gl.maximum(gl.load(p_cl + seq * stride_cl), 0), max_tokens) - gl.load(p_chunks + i_s * 4 + 3)
        ctx = gl.maximum(ctx, 0)
    else:
        seq = i_s
        q0 = i_s * QL
        nrows = QL
        ctx = gl.minimum(gl.maximum(gl.load(p_cl + i_s * stride_cl), 0), max_tokens)
    return seq, q0, nrows, ctx


@gluon.jit
def _span(ctx, i_p, P, few_target, min_pt, long_pt, short_target, ALIGN: gl.constexpr):
    """(start, end, live partitions) of partition i_p of an item that sees ``ctx`` tokens: the shipped split
    (pa_decode._partition_span without a window, the small-work term included: the shipped reduce reads
    the partials of as many partitions as that rule gives)."""
    p_s = gl.minimum(gl.maximum(gl.cdiv(ctx, long_pt), few_target), gl.cdiv(ctx, min_pt))
    p_short = gl.sqrt_rn((ctx // 8).to(gl.float32)).to(gl.int32)
    p_s = gl.maximum(p_s, gl.minimum(p_short, short_target))
    p_s = gl.maximum(gl.minimum(p_s, P), 1)
    pt = gl.maximum(gl.cdiv(gl.cdiv(ctx, p_s), ALIGN) * ALIGN, ALIGN)
    n_live = gl.cdiv(ctx, pt)
    start = i_p * pt
    end = gl.maximum(gl.minimum(start + pt, ctx), start)
    return start, end, n_live


@gluon.jit
def _producer(p_kc, p_vc, p_block_tables, k_ring, v_ring, ready, empty, seq, i_h, start, end, num_blocks,
              stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2,
              stride_block_tables,
              D: gl.constexpr, BS: gl.constexpr, BT: gl.constexpr, NBUF: gl.constexpr):
    KL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0])  # K [BT, D]: 16 bytes along D per access
    VL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, 1], [1, 0])  # V^T [D, BT]: 16 tokens per access
    n_tiles = gl.cdiv(end - start, BT)
    o_tk = gl.arange(0, BT, gl.SliceLayout(1, KL))
    o_dk = gl.arange(0, D, gl.SliceLayout(0, KL))
    o_tv = gl.arange(0, BT, gl.SliceLayout(0, VL))
    o_dv = gl.arange(0, D, gl.SliceLayout(1, VL))
    k_in = gl.max_contiguous(gl.multiple_of((o_dk // 16) * stride_kc_c + (o_dk % 16), 16), 16)
    v_in = o_dv * stride_vc_2
    kbase = p_kc + i_h * stride_kc_h
    vbase = p_vc + i_h * stride_vc_h
    p_row = p_block_tables + seq * stride_block_tables
    for j in range(n_tiles):
        s = j % NBUF
        # first hand over tile j - NBUF + 1 (the oldest of the NBUF - 1 in flight), so the consumer never
        # waits for this tile's table loads and address math
        if j >= NBUF - 1:
            async_copy.wait_group(NBUF - 2)
            fence_async_shared()  # the wgmma reads K through the async proxy
            gl.thread_barrier()  # every lane's fence before the (one) arrive: bar.warp.sync in this warp
            mbarrier.arrive(ready.index((j - (NBUF - 1)) % NBUF))
        # the slot's previous tile (j - NBUF) released by the consumer (passes at once for the first NBUF)
        mbarrier.wait(empty.index(s), ((j // NBUF) & 1) ^ 1)
        t0 = start + j * BT
        tok_k = t0 + o_tk
        live_k = tok_k < end
        bk = gl.load(p_row + tok_k // BS, mask=live_k, other=0)
        bk = gl.where((bk >= 0) & (bk < num_blocks), bk, 0).to(gl.int64)
        k_row = gl.multiple_of(bk * stride_kc_b + (tok_k % BS) * stride_kc_t, 16)
        async_copy.async_copy_global_to_shared(k_ring.index(s), kbase + k_row[:, None] + k_in[None, :],
                                               mask=live_k[:, None])
        tok_v = t0 + o_tv
        # per page (the mask must be constant along each 16-token copy): a live page's slots past the
        # context are copied too; the consumer clears their NaN bytes in the masked tiles
        live_v = (t0 + (o_tv // BS) * BS) < end
        bv = gl.load(p_row + tok_v // BS, mask=live_v, other=0)
        bv = gl.where((bv >= 0) & (bv < num_blocks), bv, 0).to(gl.int64)
        v_col = gl.max_contiguous(gl.multiple_of(bv * stride_vc_b + tok_v % BS, 16), 16)
        async_copy.async_copy_global_to_shared(v_ring.index(s), vbase + v_in[:, None] + v_col[None, :],
                                               mask=live_v[None, :])
        async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    for j in range(gl.maximum(n_tiles - (NBUF - 1), 0), n_tiles):
        mbarrier.arrive(ready.index(j % NBUF))


@gluon.jit
def _consumer(p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring, ready, empty,
              i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
              stride_q_t, stride_q_h, stride_o_t, stride_o_h,
              CI: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, QL: gl.constexpr, BM: gl.constexpr,
              D: gl.constexpr, BT: gl.constexpr, NBUF: gl.constexpr, DIRECT: gl.constexpr, HAS_SINKS: gl.constexpr):
    """Consumer warpgroup CI: rows CI * 64 .. CI * 64 + 63 of the item's BM, over every tile of the partition;
    then its partial into the workspace (DIRECT: its output rows)."""
    MW: gl.constexpr = 64  # rows per consumer warpgroup (wgmma M 64 per warpgroup)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    QLY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    VR: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # V^T [D, BT] from its slot
    q_hi = q_his.index(CI)
    q_lo = q_los.index(CI)
    v16 = v16s.index(CI)
    # the query, scaled per row by a power of two into [128, 256), as hi + lo / 16 (exact for BF16)
    o_m = CI * MW + gl.arange(0, MW, gl.SliceLayout(1, QLY))
    o_d = gl.arange(0, D, gl.SliceLayout(0, QLY))
    qrow = q0 + (o_m // G).to(gl.int64)
    q_ok = (o_m < G * QL) & (o_m // G < nrows)  # padding rows (and a short chunk's missing ones): 0
    qf = gl.load(p_q + qrow[:, None] * stride_q_t + (i_h * G + o_m % G)[:, None] * stride_q_h
                 + o_d[None, :], mask=q_ok[:, None], other=0.0).to(gl.float32)
    q_e = gl.max(gl.abs(qf), 1).to(gl.int32, bitcast=True) & 0x7F800000
    q_pow = gl.where(q_e > 0, q_e.to(gl.float32, bitcast=True), 1.0)
    x = qf * (128.0 / q_pow)[:, None]
    hi = (x.to(gl.int32, bitcast=True) & -1048576).to(gl.float32, bitcast=True)
    lo = (((x - hi) * 16.0).to(gl.int32, bitcast=True) & -1048576).to(gl.float32, bitcast=True)
    q_hi.store(hi.to(gl.float8e4nv))
    q_lo.store(lo.to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()
    row_scale = gl.convert_layout(row_scale0 * q_pow * 0.0078125, gl.SliceLayout(1, S_L))

    rows = (CI * MW + gl.arange(0, MW, gl.SliceLayout(1, S_L))) // G
    last = ctx - nrows + rows  # row sees tokens <= last
    cols = gl.arange(0, BT, gl.SliceLayout(0, S_L))
    full_hi = gl.minimum(ctx - nrows + 1, end)  # tiles ending at or below it are seen whole by every row
    m_i = gl.full([MW], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([MW], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([MW, D], gl.float32, O_L)
    zero_s = gl.zeros([MW, BT], gl.float32, S_L)
    n_tiles = gl.cdiv(end - start, BT)
    for j in range(n_tiles):
        s = j % NBUF
        mbarrier.wait(ready.index(s), (j // NBUF) & 1)
        k_t = k_ring.index(s).permute((1, 0))  # [D, BT], D contiguous per token: the FP8 wgmma's K-major B
        s_hi = warpgroup_mma(q_hi, k_t, zero_s, use_acc=False, is_async=True)
        s_lo = warpgroup_mma(q_lo, k_t, zero_s, use_acc=False, is_async=True)
        t0 = start + j * BT
        masked = t0 + BT > full_hi  # the causal diagonal and the partition's end
        vt = v_ring.index(s).load(VR).to(gl.float16)
        if masked:  # NaN bytes of a live page's unused slots: maxNum returns the other operand
            vt = gl.maximum(vt, gl.full([D, BT], -448.0, gl.float16, VR))
        s_hi, s_lo = warpgroup_mma_wait(num_outstanding=0, deps=(s_hi, s_lo))
        mbarrier.arrive(empty.index(s))  # K and V are out of the slot (for this consumer)
        v16.store(vt)
        scores = (s_hi + s_lo * 0.0625) * row_scale[:, None]
        if masked:
            tok = t0 + cols
            ok = (tok[None, :] <= last[:, None]) & (tok[None, :] < end)
            scores = gl.where(ok, scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, 1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = gl.exp2(scores - m_base[:, None])
        alpha = gl.exp2(m_i - m_base)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        p16 = gl.convert_layout(p.to(gl.float16), P_L)
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of V is in v16
        acc = warpgroup_mma(p16, v16.permute((1, 0)), acc)

    o_r = CI * MW + gl.arange(0, MW, gl.SliceLayout(1, O_L))
    o_c = gl.arange(0, D, gl.SliceLayout(0, O_L))
    acc = acc * gl.load(p_vs)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    if DIRECT:  # one partition: the output rows (a row that attended nothing: zeros), as _store_rows
        attended = l_o > 0
        if HAS_SINKS:  # exp(sink - m) joins the denominator (natural-log units)
            m_o = gl.convert_layout(m_i * 0.6931471805599453, gl.SliceLayout(1, O_L))
            sink = gl.load(p_sinks + i_h * G + o_r % G)
            m_s = gl.maximum(m_o, sink)
            m_sb = gl.where(m_s == float("-inf"), 0.0, m_s)
            w = gl.exp(m_o - m_sb)
            l_o = l_o * w + gl.exp(sink - m_sb)
            acc = acc * w[:, None]
        o = gl.where(attended[:, None], acc / gl.where(l_o > 0, l_o, 1.0)[:, None], 0.0)
        row_ok = (o_r < G * QL) & (o_r // G < nrows)
        p_o = (p_out + (q0 + (o_r // G).to(gl.int64))[:, None] * stride_o_t
               + (i_h * G + o_r % G)[:, None] * stride_o_h + o_c[None, :])
        gl.store(p_o, o.to(p_out.dtype.element_ty), mask=row_ok[:, None])
    elif i_p < n_live:
        ws = ((i_s * HKV + i_h) * P + i_p) * BM
        gl.store(p_ws_m + ws + o_r, gl.convert_layout(m_i * 0.6931471805599453, gl.SliceLayout(1, O_L)))
        gl.store(p_ws_l + ws + o_r, l_o)
        gl.store(p_ws_acc + (ws + o_r)[:, None] * D + o_c[None, :], acc)


@gluon.jit(do_not_specialize=("P", "max_tokens", "num_blocks", "few_target", "min_pt", "long_pt", "short_target"))
def gluon_partition_kernel(
    p_q, p_kc, p_vc, p_ks, p_vs, p_block_tables, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc, p_out, p_sinks,
    P, softmax_scale, max_tokens, num_blocks, few_target, min_pt, long_pt, short_target,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2,
    stride_block_tables, stride_cl,
    HKV: gl.constexpr, G: gl.constexpr, QL: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
    BT: gl.constexpr, ALIGN: gl.constexpr, NBUF: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    RAGGED: gl.constexpr = False, DIRECT: gl.constexpr = False, CONSUMER_REGS: gl.constexpr = 200,
    HAS_SINKS: gl.constexpr = False,
):
    # BM 64: one consumer warpgroup (the default partition); BM 128 (prefill): a second one as a worker
    # partition, on the other 64 rows of the item, reading the same K/V slots (each slot released by both)
    NC: gl.constexpr = BM // 64
    i_s = gl.program_id(0).to(gl.int64)
    i_h = gl.program_id(1)
    i_p = gl.program_id(2)
    seq, q0, nrows, ctx = _rows(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL, RAGGED)
    start, end, n_live = _span(ctx, i_p, P, few_target, min_pt, long_pt, short_target, ALIGN)
    K_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    V_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    V16_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_ring = gl.allocate_shared_memory(gl.float8e4nv, [NBUF, BT, D], K_SL)
    v_ring = gl.allocate_shared_memory(gl.float8e4nv, [NBUF, D, BT], V_SL)
    v16s = gl.allocate_shared_memory(gl.float16, [NC, D, BT], V16_SL)
    q_his = gl.allocate_shared_memory(gl.float8e4nv, [NC, 64, D], K_SL)
    q_los = gl.allocate_shared_memory(gl.float8e4nv, [NC, 64, D], K_SL)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)  # the producer's arrive (every consumer waits on it)
        mbarrier.init(empty.index(i), count=NC)  # each consumer's release
    row_scale0 = softmax_scale * 1.4426950408889634 * gl.load(p_ks)  # log2 units, K's per-tensor scale
    i_hkv = i_h.to(gl.int64)
    # (argument tuples written out in each call: a tuple built in the kernel and extended does not keep
    # the constexprs the partitions' layouts need)
    if NC == 1:
        gl.warp_specialize(
            [(_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring,
                          ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 0, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS)),
             (_producer, (p_kc, p_vc, p_block_tables, k_ring, v_ring, ready, empty, seq, i_hkv, start, end, num_blocks,
                          stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2,
                          stride_block_tables, D, BS, BT, NBUF))],
            [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize(
            [(_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring,
                          ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 0, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS)),
             (_producer, (p_kc, p_vc, p_block_tables, k_ring, v_ring, ready, empty, seq, i_hkv, start, end, num_blocks,
                          stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2,
                          stride_block_tables, D, BS, BT, NBUF)),
             (_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring,
                          ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 1, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS))],
                           [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


# ---------------------------------------------------------------------------------------------------------------
# Launcher: the shipped split, workspace and reduce around this partition kernel.

# the ring slots, the producer warp's registers and the launch's register cap; 128-row items (two consumer
# warpgroups): the same slots and producer, a cap of 168 and 200 registers per consumer
GLUON_SLOTS, GLUON_PRODUCER_REGS, GLUON_MAXNREG = 4, 72, 128
GLUON_SLOTS_128, GLUON_MAXNREG_128, GLUON_CONSUMER_REGS = 4, 168, 200
GLUON_PREFILL_M = 128  # prefill items of 128 rows (the Triton kernel's are 256)


@functools.lru_cache(maxsize=1)
def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper ops (an experimental API; this module imports them, so here it is
    whether the import worked)."""
    return True


def gluon_device(device: torch.device) -> bool:
    """An sm_90 GPU (wgmma; not Triton's interpreter)."""
    return device.type == "cuda" and v_maxnum(device) and platform.device_info(device).sm_version == 90


def gluon_covers(p: PAProblem, window: bool = True) -> bool:
    """What the kernel covers of a layer: D 128 on the FP8 Q.K path (e4m3fn caches with 16-byte strides), 16-token
    pages (larger ones spill 8 bytes), the 4-D value layout, per-tensor scales, no sliding window
    (``window=False``: whatever the window)."""
    c = p.cache
    return (c.D == 128 and fp8_qk(p.device, c, 128, p.query.dtype) and aligned16(c.key_cache, c.value_cache)
            and c.block_size == 16 and not c.v_transposed and not c.k_per_token and not c.v_per_token
            and (p.sliding_window == 0 or not window))


def gluon_eligible(p: PAProblem, L: Launch) -> bool:
    """Whether launch state ``L`` suits the kernel: decode programs of 64 rows launched on a grid with a reduce
    (P > 1), or prefill items of GLUON_PREFILL_M rows (FLYDSL_BACKENDS_PA_PREFILL_M=128 makes them)."""
    rows_ok = (L.BM == 64 and not L.direct) if p.is_decode else L.BM == GLUON_PREFILL_M
    return gluon_device(p.device) and gluon_covers(p) and rows_ok and L.qk8 and not L.queue_mode


def run_gluon(L: Launch, p: PAProblem, slots: Optional[int] = None, producer_regs: int = GLUON_PRODUCER_REGS,
              maxnreg: Optional[int] = None, consumer_regs: int = GLUON_CONSUMER_REGS) -> torch.Tensor:
    """The Gluon partition kernel, then the shipped reduce (none for a direct launch). ``slots`` /
    ``producer_regs`` / ``maxnreg`` / ``consumer_regs``: the ring depth and register split (None: the defaults
    for the item's rows)."""
    if not clear_unworked_rows(L, p):
        return p.out
    c, sp = p.cache, L.split
    kc, vc = c.key_cache, c.value_cache
    sinks = p.sinks if p.sinks is not None else L.ws[0]  # any fp32 pointer when there are none
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


def gluon_layer(plan, query, key_cache, value_cache, key_scale, value_scale, *, sinks=None, out=None, **layer):
    """One layer of ``plan`` (a ``pa_backend`` plan) on the Gluon kernel: (out, launch state); ValueError where
    the kernel does not cover it (the shipped Triton kernel serves such layers)."""
    p = check_layer(plan.batch, query=query, key_cache=key_cache, value_cache=value_cache, key_scale=key_scale,
                    value_scale=value_scale, sinks=sinks, out=out, anchor="block_tables", **layer)
    p.plan = plan
    L = launch_state(p)
    if not gluon_eligible(p, L):
        raise ValueError("the Gluon kernel does not cover this layer (sm_90, D 128, 16-token pages, 4-D V, "
                         "per-tensor scales, 64-row decode items with P > 1 or 128-row prefill items)")
    return run_gluon(L, p), L


# ---------------------------------------------------------------------------------------------------------------
# The experiment: against the float64 reference, then timed against the shipped Triton kernel.

DECODE_CASES = [(B, ctx) for B, ctx in ((1, 8192), (5, 4096), (64, 8192), (200, 200_000 // 16 * 16))]
PREFILL_CASES = [([2048] * 4, [2048 + 4096] * 4), ([300, 129], [8192, 129])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The Gluon partition kernel against the reference and the shipped "
                                             "Triton kernel (sm_90)")
    ap.add_argument("--check-only", action="store_true", help="compare against the reference, no timing")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs an sm_90 GPU")
        return 2
    os.environ["FLYDSL_BACKENDS_PA_PREFILL_M"] = str(GLUON_PREFILL_M)  # prefill items of 128 rows
    from backend_core.timing import time_cuda_graph
    from pa_backend import plan_decode, plan_prefill
    from pa_backend.cases import make_pa_case
    from pa_backend.tests.test_triton import rel_to_reference
    from pa_backend.triton.tiling import prefill_tiling
    from pa_backend.verify import tolerance

    prefill_tiling.cache_clear()
    names = ("query", "key_cache", "value_cache", "key_scale", "value_scale")
    rc = 0
    cases = [("decode", dict(context_lengths=[ctx] * B, query_length=4), B) for B, ctx in DECODE_CASES]
    cases += [("prefill", dict(context_lengths=ctx, query_lengths=ql), len(ql)) for ql, ctx in PREFILL_CASES]
    for kind, shape, B in cases:
        params = dict(Hq=16, Hkv=1) if kind == "decode" else dict(Hq=32, Hkv=8)
        case = make_pa_case(**shape, **params, D=128, block_size=16, device="cuda", seed=B)
        kw = dict(case.kwargs)
        if kind == "decode":
            plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=4, backend="triton")
        else:
            plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                                query_start_loc_host=kw["query_start_loc"].tolist(), backend="triton")
        layer = [kw[k] for k in names]
        out = torch.full_like(kw["query"], float("nan"))
        try:
            gluon_layer(plan, *layer, out=out)
        except ValueError as exc:
            print(f"{kind} B={B}: {exc}")
            continue
        err = rel_to_reference(case, out)
        ok = bool(torch.isfinite(out).all()) and err <= tolerance(torch.device("cuda"))
        rc |= 0 if ok else 1
        line = f"{kind} B={B} {shape}: rel err {err:.2e} {'ok' if ok else 'FAILED'}"
        if not args.check_only:
            o2 = torch.empty_like(out)
            tg = time_cuda_graph(lambda i: gluon_layer(plan, *layer, out=o2))
            tt = time_cuda_graph(lambda i: plan.run(*layer, out=o2))
            line += f"; gluon {tg.median_us:.1f} us, triton {tt.median_us:.1f} us ({tt.median_us / tg.median_us:.2f}x)"
        print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
