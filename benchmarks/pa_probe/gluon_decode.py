"""Probe: a warp-specialized Gluon partition kernel for the multi-token decode and the prefill (NVIDIA sm_90).

Question (benchmarks/NOTES.md, fifteenth session): the ql 4 decode (B=200, 200k context, Hq=16, Hkv=1, D=128,
page 16, per-tensor scales, 128k tables) runs at ~41% of the copy bandwidth on the H200 with the shipped
Triton kernel, bound inside the SM by one warpgroup's serial chain (load, Q.K, softmax, widen V, P.V). The
issue's target is 70%. Prediction: a producer warp that owns the copies (cp.async into a ring of NBUF K/V
slots, handed over with mbarriers) lets the consumer warpgroup's chain run without waiting for memory, and
the two resident CTAs of an SM overlap their chains.

Design (the shipped kernel's split, workspace and reduce are reused unchanged: this replaces only the
partition kernel's grid launch for M = 64 rows, D = 128, 16-token pages, the 4-D value layout, per-tensor
scales, no window):
* grid (items, Hkv, P) as the shipped grid launch; a program's partition [start, end) comes from the same
  device-side split (``_partition_span``);
* worker partition, 1 warp: for each 64-token tile, gathers the tile's 4 block ids and issues cp.async
  copies of K [BT, D] (16-byte pieces of the x-packed layout) and V^T [D, BT] (16 tokens contiguous) into
  slot j % NBUF (tokens past the partition's end are zero-filled: no stale id is dereferenced, no NaN byte
  of an unused slot enters), then hands tile j - NBUF + 1 over once its copies have landed
  (wait_group, proxy fence, mbarrier arrive);
* default partition, 4 warps (one warpgroup): the query as two FP8 tiles in shared memory (hi + lo / 16,
  exact: the shipped ``_split_query_fp8``), S = hi.K^T + (lo.K^T) / 16 on FP8 wgmma straight from the K
  slot, V widened FP8 -> FP16 through registers into a wgmma operand buffer, the slot released, online
  softmax in registers (exp2, log2 units), acc += P.V (P from registers);
* the partial (m in natural-log units, l, acc times the V scale) goes to the shipped workspace (a launch of one
  partition per item, the shipped plan's ``direct``: the output rows).

Prefill (the issue's 3x target over gather + SDPA; the shipped kernel reaches ~294 TFLOP/s on the H200): the
same kernel over the shipped ragged work items (chunks of 32 query rows x GQA 4 = M 128, the shipped plan at
FLYDSL_BACKENDS_PA_PREFILL_M=128). A second consumer warpgroup (a 4-warp worker partition) takes rows 64..127
of the item and reads the same K/V slots (each slot is released by both), so one K/V load serves 128 rows
and the two warpgroups' softmax and dots interleave. One CTA per SM (12 warps with Triton's padding, a cap of
168 registers: consumers 200, producer 72; no spills).

Run on a GPU: ``python3 benchmarks/pa_probe/gluon_decode.py [seconds]`` (accuracy against float64 and the
shipped kernel, then CUDA-graph timings of both, several NBUF; short decode and prefill cases first, then the
ql 4 decode target and the bench's prefill cases). On CPU: ``--compile`` compiles it for sm_90
and prints ptxas' registers / spills (no interpreter runs Gluon).
"""
import faulthandler
import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

sys.path.insert(0, os.getcwd())

CTX_CAP = gl.constexpr(1 << 30)


@gluon.jit
def _rows(p_cl, stride_cl, p_chunks, i_s, QL: gl.constexpr, RAGGED: gl.constexpr):
    """(table row, first query row, rows, visible context) of work item i_s: the shipped pa_decode._rows_of
    (decode: a sequence of QL rows; prefill: a chunk p_chunks[i_s] = (sequence, first row, rows, rows after))."""
    if RAGGED:
        seq = gl.load(p_chunks + i_s * 4).to(gl.int64)
        q0 = gl.load(p_chunks + i_s * 4 + 1).to(gl.int64)
        nrows = gl.load(p_chunks + i_s * 4 + 2)
        ctx = gl.minimum(gl.maximum(gl.load(p_cl + seq * stride_cl), 0), CTX_CAP) - gl.load(p_chunks + i_s * 4 + 3)
        ctx = gl.maximum(ctx, 0)
    else:
        seq = i_s
        q0 = i_s * QL
        nrows = QL
        ctx = gl.minimum(gl.maximum(gl.load(p_cl + i_s * stride_cl), 0), CTX_CAP)
    return seq, q0, nrows, ctx


@gluon.jit
def _span(ctx, i_p, P, few_target, min_pt, long_pt, max_tokens, ALIGN: gl.constexpr):
    """(start, end, live partitions) of partition i_p of an item that sees ``ctx`` tokens: the shipped split
    (pa_decode._partition_span without a window)."""
    p_s = gl.minimum(gl.maximum(gl.cdiv(ctx, long_pt), few_target), gl.cdiv(ctx, min_pt))
    p_s = gl.maximum(gl.minimum(p_s, P), 1)
    pt = gl.maximum(gl.cdiv(gl.cdiv(ctx, p_s), ALIGN) * ALIGN, ALIGN)
    n_live = gl.cdiv(ctx, pt)
    start = i_p * pt
    end = gl.maximum(gl.minimum(gl.minimum(start + pt, ctx), max_tokens), start)
    return start, end, n_live


@gluon.jit
def _producer(p_kc, p_vc, p_bt, k_ring, v_ring, ready, empty, seq, i_h, start, end, num_blocks,
              stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2, stride_bt_s,
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
    p_row = p_bt + seq * stride_bt_s
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


@gluon.jit(do_not_specialize=("P", "max_tokens", "num_blocks", "few_target", "min_pt", "long_pt"))
def gluon_partition_kernel(
    p_q, p_kc, p_vc, p_ks, p_vs, p_bt, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc, p_out, p_sinks,
    P, softmax_scale, max_tokens, num_blocks, few_target, min_pt, long_pt,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2,
    stride_bt_s, stride_cl,
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
    seq, q0, nrows, ctx = _rows(p_cl, stride_cl, p_chunks, i_s, QL, RAGGED)
    start, end, n_live = _span(ctx, i_p, P, few_target, min_pt, long_pt, max_tokens, ALIGN)
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
            [(_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring, ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 0, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS)),
             (_producer, (p_kc, p_vc, p_bt, k_ring, v_ring, ready, empty, seq, i_hkv, start, end, num_blocks,
                          stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2,
                          stride_bt_s, D, BS, BT, NBUF))],
            [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize(
            [(_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring, ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 0, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS)),
             (_producer, (p_kc, p_vc, p_bt, k_ring, v_ring, ready, empty, seq, i_hkv, start, end, num_blocks,
                          stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2,
                          stride_bt_s, D, BS, BT, NBUF)),
             (_consumer, (p_q, p_out, p_sinks, p_ws_m, p_ws_l, p_ws_acc, p_vs, q_his, q_los, v16s, k_ring, v_ring, ready, empty,
                          i_s, i_h, i_p, P, n_live, q0, nrows, ctx, start, end, row_scale0,
                          stride_q_t, stride_q_h, stride_o_t, stride_o_h, 1, HKV, G, QL, BM, D, BT, NBUF, DIRECT,
                          HAS_SINKS))],
                           [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def launch(p, L, nbuf: int = 4, producer_regs: int = 72, consumer_regs: int = 200):
    """The Gluon partition kernel of checked problem ``p`` with the shipped launch state ``L``
    (pa_backend.triton.launch_state), then the shipped reduce (none when L.direct: one partition per item,
    the kernel writes the output rows)."""
    from pa_backend.triton import _aligned16, _reduce
    c = p.cache
    kc, vc = c.key_cache, c.value_cache
    if not (L.qk8 and _aligned16(kc, vc)):  # e4m3fn caches, 16-byte strides: what the copies' hints declare
        raise ValueError("the Gluon probe needs the QK8 path's caches (e4m3fn, 16-byte aligned strides)")
    if not (L.BM in (64, 128) and L.D == 128 and c.block_size == 16 and not c.v_transposed and not c.k_per_token
            and not c.v_per_token and p.sliding_window == 0 and not L.queue_mode):
        raise ValueError("the Gluon probe covers M 64 / 128, D 128, 16-token pages, 4-D V, per-tensor scales, "
                         "no window, grid launches")
    if L.zero_rows is not None:
        p.out[:L.zero_rows[0]].zero_()
        p.out[L.zero_rows[1]:].zero_()
    if L.items == 0:
        return p.out
    sp = L.split
    ws_m, ws_l, ws_acc = L.ws
    chunks = L.chunks if L.chunks is not None else p.context_lengths
    sinks = p.sinks if p.sinks is not None else ws_m  # any fp32 pointer when there are none
    gluon_partition_kernel[(L.items, c.Hkv, sp.P)](
        p.query, kc, vc, c.key_scale, c.value_scale, p.block_tables, p.context_lengths, chunks, ws_m, ws_l, ws_acc,
        p.out, sinks, sp.P, p.softmax_scale, L.max_tokens, c.num_blocks, sp.few, sp.min_tokens, sp.long_tokens,
        p.query.stride(0), p.query.stride(1), p.out.stride(0), p.out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2),
        p.block_tables.stride(0), p.context_lengths.stride(0),
        HKV=c.Hkv, G=L.G, QL=L.QL, BM=L.BM, D=L.D, BS=c.block_size, BT=64, ALIGN=L.align, NBUF=nbuf,
        PRODUCER_REGS=producer_regs, RAGGED=not p.is_decode, DIRECT=L.direct, CONSUMER_REGS=consumer_regs,
        HAS_SINKS=L.direct and p.sinks is not None,  # read only by a direct launch (no second compile otherwise)
        num_warps=4, **_maxnreg(L.BM))
    if not L.direct:
        _reduce(L, None, sinks, p)
    return p.out


def _maxnreg(BM: int = 64):
    # the launch's register cap. BM 64: Triton pads the warp-specialized program to 8 warps, and without a
    # cap it takes 256 registers per thread (one CTA per SM); 128 gives two, the consumer warpgroup then
    # gets ~184 inside the specialized region (setmaxnreg), the producer warp PRODUCER_REGS. BM 128 (two
    # consumer warpgroups, 12 warps with the padding): one CTA per SM, 168 (GL_MAXNREG_PREFILL)
    raw = os.environ.get("GL_MAXNREG" if BM == 64 else "GL_MAXNREG_PREFILL", "128" if BM == 64 else "168")
    return {"maxnreg": int(raw)} if raw and raw != "0" else {}


def compile_sm90(nbuf: int = 4, producer_regs: int = 72, prefill: bool = False, consumer_regs: int = 200,
                 direct: bool = True):
    """ptxas' resource numbers for sm_90 (backend_core.aot.ptxas_report; no GPU needed): the ql 4 decode
    (BM 64, GQA 16) or the prefill (BM 128 = 32 rows x GQA 4, ragged chunks; ``direct``: one partition per
    chunk, the output rows written by the kernel, else the workspace)."""
    from backend_core.aot import ptxas_report
    types = {n: "*fp32" for n in ("p_ks", "p_vs", "p_ws_m", "p_ws_l", "p_ws_acc", "p_sinks")}
    types.update(p_q="*bf16", p_out="*bf16", p_kc="*fp8e4nv", p_vc="*fp8e4nv", p_bt="*i32", p_cl="*i32",
                 p_chunks="*i32", softmax_scale="fp32")
    types.update({n: "i32" for n in ("P", "max_tokens", "num_blocks", "few_target", "min_pt", "long_pt",
                                     "stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_kc_b",
                                     "stride_kc_h", "stride_kc_c", "stride_kc_t", "stride_vc_b", "stride_vc_h",
                                     "stride_vc_2", "stride_bt_s", "stride_cl")})
    ce = dict(HKV=1, G=16, QL=4, BM=64, D=128, BS=16, BT=64, ALIGN=64, NBUF=nbuf, PRODUCER_REGS=producer_regs,
              RAGGED=False, DIRECT=False, CONSUMER_REGS=consumer_regs, HAS_SINKS=False)
    if prefill:
        ce.update(HKV=8, G=4, QL=32, BM=128, RAGGED=True, DIRECT=direct, CONSUMER_REGS=consumer_regs,
                  HAS_SINKS=direct)
    return ptxas_report(gluon_partition_kernel, types, ce, [n for n in types if n.startswith(("p_", "stride_"))],
                        num_warps=4, maxnreg=_maxnreg(ce["BM"]).get("maxnreg"))


def _gpu_probe(seconds: float):
    import time
    import torch
    from pa_backend import pa_decode, plan_prefill
    from pa_backend.benchmark import accuracy, bench_case
    from pa_backend.contract import check_layer, prepare_attention
    from pa_backend.triton import launch_state, prefill_tiling
    from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph
    t_end = time.time() + seconds
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbps(device=dev) * 1e9
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)

    def prefill_m(m):  # the shipped prefill tiling's M (None: its default, 256 at D 128)
        if m is None:
            os.environ.pop("FLYDSL_BACKENDS_PA_PREFILL_M", None)
        else:
            os.environ["FLYDSL_BACKENDS_PA_PREFILL_M"] = str(m)
        prefill_tiling.cache_clear()

    # short and ragged cases first (the partition's end, the causal diagonal, a short last chunk: a hang or a
    # wrong row shows early), then the targets (128k tables everywhere). Decode: (B, ctx, new rows); prefill:
    # (B, cached prefix, new rows), GQA 4 (Hq 32, Hkv 8), the bench's prefill cases last.
    cases = [("decode", 5, 70, 4), ("prefill", 2, 100, 70), ("decode", 64, 777, 4), ("prefill", 3, 0, 300),
             ("decode", 8, 3001, 4), ("decode", 32, 8192, 4), ("decode", 200, 200_000, 4),
             ("prefill", 4, 6144, 2048), ("prefill", 1, 30720, 2048), ("prefill", 8, 0, 1024)]
    for kind, B, ctx, ql in cases:
        prefill = kind == "prefill"
        Hq, Hkv = (32, 8) if prefill else (16, 1)
        total = ctx + ql if prefill else ctx
        kw = bench_case(B, total, ql, Hq, Hkv, 128, 16, "tensor", dev, table_tokens=131072)
        layer = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
        if prefill:
            # as the bench and the adapters: a plan per batch from the host offsets, bounded by the longest
            # context (a new plan per tiling: a plan keeps its launch state); its first run (the graph timer's
            # warm-up, outside the capture) makes the chunks
            kw.pop("query_length")
            qsl = [i * ql for i in range(B + 1)]
            kw["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32, device=dev)

            def new_plan():
                return plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                                    query_start_loc_host=qsl, max_context=total, backend="triton")
            plan = new_plan()
            run = lambda out: plan.run(**layer, out=out)  # noqa: E731
            flops = 4 * B * Hq * 128 * sum(total - ql + 1 + i for i in range(ql))
            size = lambda t: f"{flops / (t * 1e-6) / 1e12:.0f} TFLOP/s"  # noqa: E731
        else:
            run = lambda out: pa_decode(**kw, out=out, backend="triton")  # noqa: E731
            nbytes = B * ctx * 128 * 2  # K and V bytes read (Hkv 1, D 128)
            size = lambda t: f"{nbytes / (t * 1e-6) / copy * 100:.1f}% of copy"  # noqa: E731
        big = B * total * Hkv > 10**6
        inner, trials = (4, 15) if big else (10, 30)
        desc = f"{kind} B={B} {'prefix' if prefill else 'ctx'}={ctx} ql={ql} Hq={Hq} Hkv={Hkv}"
        ref_out = torch.full_like(kw["query"], float("nan"))
        prefill_m(None)
        run(ref_out)
        err_ship = accuracy(kw, ref_out)
        t_s = time_cuda_graph(lambda i: run(ref_out), inner=inner, trials=trials).median_us
        print(f"{desc}: shipped {t_s:.1f} us ({size(t_s)}), rel err {err_ship:.2e}", flush=True)
        if prefill:  # the Gluon kernel's prefill works on chunks of 32 rows (M 128): the shipped one at that M
            prefill_m(128)
            plan = new_plan()
            o128 = torch.full_like(kw["query"], float("nan"))
            run(o128)
            t128 = time_cuda_graph(lambda i: run(o128), inner=inner, trials=trials).median_us
            print(f"  shipped at M 128: {t128:.1f} us ({size(t128)}), rel err {accuracy(kw, o128):.2e}", flush=True)
            variants = ((3, 72, 200), (2, 72, 200), (4, 72, 200))
        else:
            variants = ((4, 72, 0), (3, 72, 0), (6, 72, 0), (2, 72, 0)) if B * ctx > 10**5 else ((4, 72, 0), (2, 72, 0))
        for nbuf, regs, cregs in variants:
            if time.time() > t_end:
                print("time budget spent", flush=True)
                return
            out = torch.full_like(kw["query"], float("nan"))
            if prefill:  # the M-128 plan's problem and launch state (as plan.run builds them)
                p = check_layer(plan.batch, **layer, out=out, anchor="block_tables")
                p.plan = plan
            else:
                p = prepare_attention(**kw, out=out)
            L = launch_state(p)
            faulthandler.dump_traceback_later(90, exit=True)  # a hang (a barrier never completes) ends the probe
            try:
                launch(p, L, nbuf, regs, cregs or 200)
                torch.cuda.synchronize()
                faulthandler.cancel_dump_traceback_later()
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                faulthandler.cancel_dump_traceback_later()
                print(f"  NBUF={nbuf} regs={regs}: {type(e).__name__}: {str(e)[:600]}", flush=True)
                continue
            err = accuracy(kw, out)
            diff = (out.float() - ref_out.float()).abs().max().item()
            out.fill_(float("nan"))
            t_g = time_cuda_graph(lambda i: launch(p, L, nbuf, regs, cregs or 200), inner=inner, trials=trials,
                                  after_capture=lambda: out.fill_(float("nan"))).median_us
            err_replay = accuracy(kw, out)
            print(f"  gluon NBUF={nbuf} producer regs={regs}{f' consumer regs={cregs}' if cregs else ''}"
                  f"{' direct' if L.direct else f' P={L.split.P}'}: {t_g:.1f} us ({size(t_g)}, {t_s / t_g:.2f}x), "
                  f"rel err {err:.2e} (replayed {err_replay:.2e}), max |gluon - shipped| {diff:.2e}", flush=True)
        prefill_m(None)
        del kw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--compile" in sys.argv:
        for nbuf, regs in ((4, 72), (3, 72), (6, 72), (2, 72)):
            print(f"NBUF={nbuf} producer regs={regs}:", compile_sm90(nbuf, regs))
        for nbuf, regs, cregs, direct in ((3, 72, 200, True), (2, 72, 200, True), (4, 72, 200, True),
                                          (3, 72, 200, False)):
            print(f"prefill NBUF={nbuf} producer regs={regs} consumer regs={cregs} direct={direct}:",
                  compile_sm90(nbuf, regs, True, cregs, direct))
    else:
        _gpu_probe(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
