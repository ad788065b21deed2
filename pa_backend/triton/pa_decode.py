# FP8 paged-attention decode, Triton: split-K over the context, then a small reduce.
#
# Design
# ------
# Partition kernel. A task (s, h, p) is KV head h of item s (a sequence in decode, a chunk of query
# rows in prefill) and partition p of the tokens that item can see. P is a shape-only upper bound from
# the plan; the split itself is made on the device from the item's real context: the visible span
# [lo, ctx) (lo > 0 only under a sliding window) is cut into P_s <= P partitions of PT_s tokens (a
# multiple of ALIGN = max(BT, block size)), with P_s chosen per item like the planner does (enough
# programs to fill the GPU, no partition shorter than MIN_PT, long ones preferred; where the batch's work
# is small, shorter ones of about sqrt(8 x span) tokens, a few tasks per SM at most). Tasks p >= P_s do
# no work and the reduce reads only the P_s partials, so the work follows each sequence's context
# whatever the block table's width, and a captured CUDA graph replays with any context lengths.
# Two ways to launch the tasks (QUEUE):
# * grid (items, Hkv, P), one task per program (prefill, decode programs of 4 or 8 warps, and plans
#   that know their batch's max context, whose P is sized to it);
# * a task queue (one-warp decode programs of shape-only plans: CUDA graphs, eager calls, whose P is
#   sized to the table width): a grid of one wave of resident programs takes tasks from
#   a device counter (partition-major from the batch's longest split down: long partitions first).
#   A shape-only grid at a 128k-token table carries ~3 programs past each sequence's split per live
#   one, and the hardware then places the live ones unevenly (up to 12 on some SMs, 8 on others),
# so such a grid ran measurably slower than with an exact-width table. With the queue the programs of one SM that take
# tasks are capped at
#   ceil(tasks / SMs) (per-SM counters by %smid), the batch's longest split bounds the task space, and
#   the reduce kernel sets the counters back to zero for the next launch.
# The M dimension of the dots is the GQA group times the query rows: row m = i*G + g is query row
# i for query head h*G + g (M = G*QL padded to BM >= 16), so one KV read serves every query head
# that shares it.
# The loop walks token tiles of BT tokens (decode_tiling), a dynamic trip count; each token's
# block id is gathered from the table. K is read as a [BT, D] tile straight from the x-packed
# layout (16 FP8 bytes per (d//16, token) chunk) and widened FP8 -> FP16 in registers (exact);
# S = Q K^T runs on the tensor cores with FP32 accumulation, in log2 units (exp2), with the
# per-token K scale or the per-tensor one folded in, then the causal / sliding-window mask and an
# online softmax (m, l, acc [BM, D] FP32 in registers). The query enters the FP16 dot scaled per
# row by a power of two (2^-floor(log2 max|q|), folded back into the row's score scale): BF16 ->
# FP16 is then exact for every element within 2^-14 of its row's max, nothing can overflow, and
# the query is never rounded to FP8. P @ V runs in FP16 (FP8 values are exact in FP16; P in
# [0, 1] keeps 11 bits): the per-tensor V scale multiplies acc once at the end, a per-token one
# multiplies P's columns first.
# QK8 (programs of >= 64 rows on NVIDIA sm_89+, tiling.py fp8_qk): Q.K runs on FP8
# tensor cores instead. K and V^T are loaded as 2-D tiles ([BT, D] with a per-token row, [D, BT] with
# tokens contiguous in runs of 16 inside a block, a hint the compiler cannot derive through the gathered
# block id) so the pipeliner copies K from global memory straight into the wgmma's shared-memory layout
# (no FP8 -> FP16 widening of K, no register round trip); the query enters as two FP8 tiles, hi + lo / 16,
# which hold the BF16 query exactly (_split_query_fp8), and S = hi.K + (lo.K) / 16. V is still widened to
# FP16 for P @ V (P split into FP8 terms measured no faster, and one FP8 term alone breaks the error bound).
# Two loops per partition: tiles every query row sees whole (below the first row's position and
# past the last row's window start) run unmasked (no load masks, no score masks, no NaN clearing:
# all their tokens are written context); the few others (a window's edge, the causal diagonal, the
# context's end) run masked, 2 stages. In prefill the masked tiles are about rows/BT + 1 per chunk.
# Warps (decode_tiling): M = 16 decode programs are one warp (S, P and acc stay in that warp's
# registers: no cross-warp reduction, no shared-memory round trip of P, ~12 programs per SM); larger
# M splits rows across 4 or 8 warps.
# Pipelining (Triton 3.6): the block-id load is one indirection above the K/V loads, so
# num_stages <= 4 gives the K/V copies one shared buffer (no overlap inside a program); 5 gives two.
# Table entries are read only for tokens inside the partition, so stale ids past a sequence's
# extent are never dereferenced. K's NaN bytes in unused slots of a live page only reach scores,
# which `where` replaces by -inf; V's are cleared before the P @ V dot (maxNum on NVIDIA, `where`
# elsewhere), where P is exactly 0 for them.
#
# Prefill (ragged) reuses both kernels with RAGGED=1: the work items are chunks of at most QL
# query rows of one sequence (built once per batch by the plan), each behaving like a decode
# sequence whose context is what its last row sees.
#
# Reduce kernel, grid (work items, Hkv): combines the P_s partial (m, l, acc) with the softmax
# rescale, adds exp(sink - m) to the denominator when sinks are given, and writes the BM valid rows
# (zero when no token was attended). A grid launch whose P is 1 (a plan bounded by a short max
# context: small batches outside graphs) has nothing to combine: its task writes the rows itself
# (DIRECT, the same _store_rows) and the reduce is not launched. Padding rows (G * QL < BM: GQA 4
# pads 16 rows) are neither stored in the workspace nor read from it. The max over the partials is
# one load per RED_PC partitions; the weighted sums loop over them, UNROLL partitions per step (their
# loads in flight together; a plain loop costs one memory round trip per partition).
#
# Offsets: block ids, KV-head offsets into the caches and row offsets are int64 (caches > 2 GiB, any order
# of their dimensions); offsets inside one (block, head) slice and inside one query / output row are int32
# (the contract checks their spans). Token positions are int32: context lengths are clamped to [0, the table
# row's tokens] where they are read, the contract bounds a table at 2^30 tokens and a window below its width.

import triton
import triton.language as tl

RED_PC = tl.constexpr(16)  # partitions per load of the reduce's max pass


@triton.jit
def _clamped(ctx, max_tokens):
    """A context length as the kernels read it: clamped to [0, the table row's tokens]. The data is not
    checked (a stale or corrupt entry, a negative padding value); a length past the row reads as the row,
    positions included, in the partition and the reduce kernel alike. The contract bounds a table at 2^30
    tokens and a window below the table's width, so every position sum stays in int32."""
    return tl.minimum(tl.maximum(ctx, 0), max_tokens)


@triton.jit
def _rows_of(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL: tl.constexpr, RAGGED: tl.constexpr):
    """(table row, first query row, number of rows, visible context) of work item i_s.

    Decode: item = sequence, QL rows each. Prefill: item = a chunk of at most QL query rows of one
    sequence, described by p_chunks[i_s] = (sequence, first row, rows, rows of the sequence after
    the chunk); its last row sees context_lengths[sequence] - rows_after tokens, and row i of the
    chunk tokens 0 .. that - rows + i, as in decode."""
    if RAGGED:
        seq = tl.load(p_chunks + i_s * 4).to(tl.int64)
        q0 = tl.load(p_chunks + i_s * 4 + 1).to(tl.int64)
        nrows = tl.load(p_chunks + i_s * 4 + 2)
        # minus the rows of the sequence after the chunk
        ctx = _clamped(tl.load(p_cl + seq * stride_cl), max_tokens) - tl.load(p_chunks + i_s * 4 + 3)
        ctx = tl.maximum(ctx, 0)  # <= 0: no row of the chunk sees a token either way
    else:
        seq = i_s
        q0 = i_s * QL
        nrows = QL
        ctx = _clamped(tl.load(p_cl + i_s * stride_cl), max_tokens)
    return seq, q0, nrows, ctx


@triton.jit
def _partition_span(ctx, nrows, sliding_window, P, few_target, min_pt, long_pt, short_target, ALIGN: tl.constexpr):
    """(lo, PT, P_s) of one work item: its visible tokens [lo, ctx) cut into P_s partitions of PT
    tokens (the last one shorter). lo > 0 only under a sliding window (aligned down to ALIGN).
    P_s: at most the grid's P; enough partitions for ``few_target`` (fills the GPU at this batch
    size), more only while they stay ``long_pt`` tokens long, never shorter than ``min_pt`` -- except
    where the batch's work is small (few items x KV heads: ``short_target`` > 1, the planner's
    SHORT_TASKS_PER_SM x SMs / work): there up to ``short_target`` partitions of about sqrt(8 x span)
    tokens (32 at 128 tokens, 64 at 512, 128 at 2048), which shortens each task's serial tile chain
    while the tasks stay few."""
    lo = tl.where(sliding_window > 0, tl.maximum(ctx - nrows + 1 - sliding_window, 0), 0)
    lo = (lo // ALIGN) * ALIGN
    span = tl.maximum(ctx - lo, 0)
    p_s = tl.minimum(tl.maximum(tl.cdiv(span, long_pt), few_target), tl.cdiv(span, min_pt))
    # floor(sqrt(span // 8)): IEEE sqrt, the same in the partition and the reduce kernel (exact below 2^24)
    p_short = tl.sqrt_rn((span // 8).to(tl.float32)).to(tl.int32)
    p_s = tl.maximum(p_s, tl.minimum(p_short, short_target))
    p_s = tl.maximum(tl.minimum(p_s, P), 1)
    pt = tl.cdiv(tl.cdiv(span, p_s), ALIGN) * ALIGN
    pt = tl.maximum(pt, ALIGN)
    return lo, pt, tl.cdiv(span, pt)


@triton.jit
def _split_query_fp8(x):
    """(hi, lo) FP8 e4m3fn with x == hi + lo / 16 for an FP32 ``x`` holding BF16 values scaled so each
    row's max |x| is in [128, 256): hi is x cut to 4 significant bits (sign, exponent and the top 3
    mantissa bits), the residual x - hi holds x's remaining 4 bits, so lo = 16 * residual cut the same
    way loses nothing. Both are FP8 values for every element >= 2^-6 (2^-13 of its row's max): the query
    is exact there; smaller elements are off by < 2^-9 (2^-16 of the max). Cutting instead of rounding
    makes the conversions exact, the interpreter's included (it mis-rounds carries into the exponent)."""
    hi = (x.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
    lo = (((x - hi) * 16.0).to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)


@triton.jit
def _attend_tile(
    b_m, b_l, b_acc, b_q, b_q_lo, row_scale, last, first, m_valid, tile_start, end,
    p_kc, p_vc, p_ks, p_vs, p_block_tables, seq, i_h, num_blocks,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
    stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, stride_block_tables,
    D: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
    V5D: tl.constexpr, K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr, V_MAXNUM: tl.constexpr,
    MASKED: tl.constexpr, QK8: tl.constexpr,
):
    """One tile of BT tokens from ``tile_start``: gather K/V from the paged cache, S = Q K^T, the
    online-softmax update and acc += P V. MASKED=0 is the steady state: every token of the tile is
    inside the context and visible to every query row (no loads masked, no score masked, no NaN
    clearing); MASKED=1 tiles (the causal diagonal, a sliding window's edge, the partition's last
    tile) mask tokens past ``end`` and apply the per-row visibility [first, last]."""
    o_d = tl.arange(0, D)
    o_t = tl.arange(0, BT)
    TB: tl.constexpr = BT if BT < BS else BS
    NT: tl.constexpr = BT // TB
    o_nt = tl.arange(0, NT)
    o_tb = tl.arange(0, TB)
    # NT pieces of TB tokens, each contiguous inside one block
    blk_idx = tile_start // BS + o_nt  # [NT] table columns
    if BT >= BS:  # whole blocks: the first token of every piece is the block's first
        t0 = 0
    else:  # a block split into BS / BT tiles (tile_start is a multiple of BT)
        t0 = tl.multiple_of(tile_start % BS, TB)
    t_p = t0 + o_tb  # [TB] token offsets inside the block
    # table entries are read only for pieces inside the context (stale ids past a sequence's extent
    # are never dereferenced); loads are masked per piece, so the mask is constant along the
    # contiguous axis and the loads still vectorize
    live_pc = (tile_start + o_nt * TB) < end  # [NT]
    if MASKED:
        b = tl.load(p_block_tables + seq * stride_block_tables + blk_idx, mask=live_pc, other=0).to(tl.int64)
    else:
        b = tl.load(p_block_tables + seq * stride_block_tables + blk_idx).to(tl.int64)
    # a block id outside the cache (a corrupted table: the reference raises ValueError) reads block 0
    # instead: the result is meaningless but no load leaves the caches
    b = tl.where((b >= 0) & (b < num_blocks), b, 0)
    # with per-token scales and D <= 128 the K/V loads stay masked in both loops too (sm_90: 96
    # registers, 5 programs/SM, instead of 104 and 4; at D = 256 the masked form spills)
    LOAD_MASKED: tl.constexpr = MASKED or ((K_PER_TOKEN or V_PER_TOKEN) and D <= 128)
    if QK8:
        # 2-D tiles straight into the FP8 dots' shared memory (no register round trip): K [BT, D] with a
        # per-token row (16-byte chunks along D), V^T [D, BT] with tokens contiguous in runs of 16 inside a
        # block (the hint the compiler cannot derive through the gathered block id: every block holds a
        # multiple of 16 tokens, tiles start at multiples of 16, the host checks the strides)
        b_tok = tl.reshape(tl.broadcast_to(b[:, None], (NT, TB)), (BT,))  # the block id of every token
        tin = (tile_start + o_t) % BS
        live_tp = (tile_start + (o_t // TB) * TB) < end  # live_pc per token
        k_off = b_tok[:, None] * stride_kc_b + tin[:, None] * stride_kc_t + (o_d // 16)[None, :] * stride_kc_c \
            + (o_d % 16)[None, :]
        k_off = tl.max_contiguous(tl.multiple_of(k_off, [1, 16]), [1, 16])
        if V5D:
            v_off = b_tok[None, :] * stride_vc_b + (tin // 16)[None, :] * stride_vc_2 + o_d[:, None] * stride_vc_3 \
                + (tin % 16)[None, :]
        else:
            v_off = b_tok[None, :] * stride_vc_b + o_d[:, None] * stride_vc_2 + tin[None, :] * stride_vc_3
        v_off = tl.max_contiguous(tl.multiple_of(v_off, [1, 16]), [1, 16])
        if LOAD_MASKED:
            b_k = tl.load(p_kc + i_h * stride_kc_h + k_off, mask=live_tp[:, None], other=0.0)
            b_vt = tl.load(p_vc + i_h * stride_vc_h + v_off, mask=live_tp[None, :], other=0.0)
        else:
            b_k = tl.load(p_kc + i_h * stride_kc_h + k_off)
            b_vt = tl.load(p_vc + i_h * stride_vc_h + v_off)
        # FP8 K straight from shared memory into FP8 dots; Q = hi + lo / 16 exactly (_split_query_fp8)
        b_s = tl.dot(b_q, tl.trans(b_k), tl.dot(b_q_lo, tl.trans(b_k)) * 0.0625) * row_scale[:, None]
    else:
        o_tb16 = tl.arange(0, TB // 16)
        o_c = tl.arange(0, D // 16)
        o_16 = tl.arange(0, 16)
        # offsets built with the contiguous axis last (an arange) so loads vectorize to 16 bytes, then
        # merged to [BT, D]; K [NT, TB, D/16, 16] from key_cache[b, h, c, t, 16]
        p_k = p_kc + i_h * stride_kc_h + b[:, None, None, None] * stride_kc_b \
            + t_p[None, :, None, None] * stride_kc_t + o_c[None, None, :, None] * stride_kc_c \
            + o_16[None, None, None, :]
        if V5D:  # value_cache[b, h, t // 16, d, t % 16] as [D, NT, TB/16, 16]
            p_v = p_vc + i_h * stride_vc_h + o_d[:, None, None, None] * stride_vc_3 \
                + b[None, :, None, None] * stride_vc_b + (t0 // 16 + o_tb16)[None, None, :, None] * stride_vc_2 \
                + o_16[None, None, None, :]
        else:  # value_cache[b, h, d, t] as [D, NT, TB]
            p_v = p_vc + i_h * stride_vc_h + o_d[:, None, None] * stride_vc_2 + b[None, :, None] * stride_vc_b \
                + t_p[None, None, :] * stride_vc_3
        if LOAD_MASKED:
            b_k = tl.load(p_k, mask=live_pc[:, None, None, None], other=0.0)
            if V5D:
                b_v = tl.load(p_v, mask=live_pc[None, :, None, None], other=0.0)
            else:
                b_v = tl.load(p_v, mask=live_pc[None, :, None], other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
        b_k = tl.reshape(b_k, (BT, D)).to(tl.float16)
        b_vt = tl.reshape(b_v, (D, BT))  # V^T
        b_s = tl.dot(b_q, tl.trans(b_k)) * row_scale[:, None]
    # [NT, TB] tokens in the context; the per-token scale loads stay masked in both loops (unmasked,
    # the pipeliner prefetched them into registers: 96 -> 128 registers, 5 -> 4 programs per SM)
    live_p = (tile_start + o_nt[:, None] * TB + o_tb[None, :]) < end
    if K_PER_TOKEN:
        ks_t = tl.load(p_ks + b[:, None] * stride_ks_b + i_h * stride_ks_h + t_p[None, :], mask=live_p, other=0.0)
        b_s = b_s * tl.reshape(ks_t, (BT,))[None, :]
    if MASKED:
        tok = tile_start + o_t
        live_t = tok < end
        allowed = (tok[None, :] <= last[:, None]) & (tok[None, :] >= first[:, None]) & live_t[None, :] \
            & m_valid[:, None]
        b_s = tl.where(allowed, b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    else:
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_base = m_new
    b_p = tl.exp2(b_s - m_base[:, None])
    alpha = tl.exp2(b_m - m_base)
    b_l = b_l * alpha + tl.sum(b_p, 1)
    if MASKED:
        # V's NaN bytes in unused slots of a live page: P is exactly 0 there, but 0 * NaN is NaN
        if V_MAXNUM:  # IEEE maxNum returns the non-NaN operand; every FP8 value is >= -448
            b_vt = tl.maximum(b_vt.to(tl.float16), tl.full([1, 1], -448.0, tl.float16))
        else:
            b_vt = tl.where(live_t[None, :], b_vt.to(tl.float32), 0.0).to(tl.float16)
    else:
        b_vt = b_vt.to(tl.float16)
    if V_PER_TOKEN:
        vs_t = tl.load(p_vs + b[:, None] * stride_vs_b + i_h * stride_vs_h + t_p[None, :], mask=live_p, other=0.0)
        b_p = b_p * tl.reshape(vs_t, (BT,))[None, :]
    b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(tl.float16), tl.trans(b_vt))
    return m_new, b_l, b_acc


@triton.jit
def _store_rows(b_m, b_l, b_acc, p_sinks, p_out, q0, row, grp, m_valid, i_h, stride_o_t, stride_o_h,
                G: tl.constexpr, D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The output rows of a merged partial: l and acc are sums of exp(score - b_m) (natural log; b_m may
    be -inf when nothing was attended, then both are 0). A sink adds exp(sink - m) to the denominator;
    a row that attended no token is written as zeros."""
    attended = b_l > 0
    if HAS_SINKS:
        b_sink = tl.load(p_sinks + i_h * G + grp)
        m_new = tl.maximum(b_m, b_sink)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(b_m - m_base)
        b_l = b_l * w + tl.exp(b_sink - m_base)
        b_acc = b_acc * w[:, None]
    b_o = tl.where(attended[:, None], b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None], 0.0)
    o_d = tl.arange(0, D)
    p_o = p_out + (q0 + row)[:, None] * stride_o_t + (i_h * G + grp)[:, None] * stride_o_h + o_d[None, :]
    tl.store(p_o, b_o.to(p_out.dtype.element_ty), mask=m_valid[:, None])


@triton.jit
def _max_partitions(p_cl, stride_cl, n_items, nrows, sliding_window, P, max_tokens, few_target, min_pt, long_pt,
                    short_target, ALIGN: tl.constexpr):
    """The most partitions any decode sequence of the batch splits into (<= P): the task space's
    partition bound, read from the context lengths on the device."""
    most = tl.full([], 1, tl.int32)
    for i0 in tl.range(0, n_items, 128):
        o = i0 + tl.arange(0, 128)
        c = _clamped(tl.load(p_cl + o.to(tl.int64) * stride_cl, mask=o < n_items, other=0), max_tokens)
        n = _partition_span(c, nrows, sliding_window, P, few_target, min_pt, long_pt, short_target, ALIGN)[2]
        most = tl.maximum(most, tl.max(n, 0))
    return most


@triton.jit
def _partition_task(
    i_s, i_h, i_p, p_q, p_kc, p_vc, p_ks, p_vs, p_block_tables, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc, p_sinks,
    p_out,
    P, softmax_scale, sliding_window, max_tokens, num_blocks, few_target, min_pt, long_pt, short_target,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
    stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h,
    stride_block_tables, stride_cl,
    HKV: tl.constexpr, G: tl.constexpr, QL: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BT: tl.constexpr, ALIGN: tl.constexpr,
    V5D: tl.constexpr, K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr, RAGGED: tl.constexpr,
    V_MAXNUM: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr, QK8: tl.constexpr,
):
    """Partition i_p of KV head i_h of work item i_s: its tiles, then its (m, l, acc) partial (DIRECT: the
    output rows)."""
    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, D)
    row = o_m // G  # query row within the sequence (decode) or chunk (prefill)
    grp = o_m % G
    seq, q0, nrows, ctx = _rows_of(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL, RAGGED)
    m_valid = (o_m < G * QL) & (row < nrows)
    p_qrow = p_q + (q0 + row)[:, None] * stride_q_t + (i_h * G + grp)[:, None] * stride_q_h + o_d[None, :]
    # Q scaled per row by a power of two (exact) into FP16's range
    b_qf = tl.load(p_qrow, mask=m_valid[:, None], other=0.0).to(tl.float32)
    q_e = tl.max(tl.abs(b_qf), 1).to(tl.int32, bitcast=True) & 0x7F800000
    q_pow = tl.where(q_e > 0, q_e.to(tl.float32, bitcast=True), 1.0)
    if QK8:  # max |q| of a row in [128, 256): hi and lo hold the BF16 query exactly (_split_query_fp8)
        b_q, b_q_lo = _split_query_fp8(b_qf * (128.0 / q_pow)[:, None])
        q_pow = q_pow * 0.0078125
    else:
        b_q = (b_qf * (1.0 / q_pow)[:, None]).to(tl.float16)
        b_q_lo = b_q
    last = ctx - nrows + row  # row sees tokens first..last
    first = tl.where(sliding_window > 0, last - sliding_window + 1, 0)

    lo, pt, n_live = _partition_span(ctx, nrows, sliding_window, P, few_target, min_pt, long_pt, short_target, ALIGN)
    live_p_ = i_p < n_live
    start = lo + i_p * pt
    end = tl.minimum(start + pt, ctx)  # ctx: at most the table row's tokens (_clamped)
    end = tl.maximum(end, start)  # partitions past the span (start >= ctx) have no tiles
    # Tiles [u0, u1) are seen whole by every query row (keys up to the first row's position, from
    # the last row's window start): no masking there. The rest of [start, end) — a sliding
    # window's edge before u0, the causal diagonal and the context's end after u1 — is masked.
    full_lo = tl.where(sliding_window > 0, ctx - sliding_window, 0)  # the last row's first visible token
    full_hi = tl.minimum(ctx - nrows + 1, end)  # the first row sees tokens < ctx - nrows + 1
    u0 = tl.minimum(start + tl.cdiv(tl.maximum(full_lo - start, 0), BT) * BT, end)
    u1 = tl.minimum(tl.maximum(start + (tl.maximum(full_hi - start, 0) // BT) * BT, u0), end)
    n_pre = tl.cdiv(u0 - start, BT)
    n_full = (u1 - u0) // BT
    n_masked = n_pre + tl.cdiv(end - u1, BT)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, D], dtype=tl.float32)
    qk_scale = softmax_scale * 1.4426950408889634  # scores in log2 units: exp2 below
    if not K_PER_TOKEN:
        qk_scale = qk_scale * tl.load(p_ks)
    row_scale = qk_scale * q_pow
    i_hkv = i_h.to(tl.int64)  # the caches' head offsets in int64: a head stride times Hkv may pass 2^31
    # dynamic trip counts: the partition's own tiles, whatever the table width
    for jt in tl.range(0, n_full):
        b_m, b_l, b_acc = _attend_tile(
            b_m, b_l, b_acc, b_q, b_q_lo, row_scale, last, first, m_valid, u0 + jt * BT, end,
            p_kc, p_vc, p_ks, p_vs, p_block_tables, seq, i_hkv, num_blocks,
            stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
            stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, stride_block_tables,
            D, BS, BT, V5D, K_PER_TOKEN, V_PER_TOKEN, V_MAXNUM, False, QK8)
    # a few tiles per partition: 2 stages (fewer registers than the steady loop; the sm_90 resource test)
    for jt in tl.range(0, n_masked, num_stages=2):
        tile_start = tl.where(jt < n_pre, start + jt * BT, u1 + (jt - n_pre) * BT)
        b_m, b_l, b_acc = _attend_tile(
            b_m, b_l, b_acc, b_q, b_q_lo, row_scale, last, first, m_valid, tile_start, end,
            p_kc, p_vc, p_ks, p_vs, p_block_tables, seq, i_hkv, num_blocks,
            stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t, stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
            stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h, stride_block_tables,
            D, BS, BT, V5D, K_PER_TOKEN, V_PER_TOKEN, V_MAXNUM, True, QK8)
    if not V_PER_TOKEN:
        b_acc = b_acc * tl.load(p_vs)
    b_m = b_m * 0.6931471805599453  # back to natural-log units for the reduce (and the sinks)
    if DIRECT:  # one partition per item (P == 1): the task's partial is the result, no reduce launch
        _store_rows(b_m, b_l, b_acc, p_sinks, p_out, q0, row, grp, m_valid, i_h, stride_o_t, stride_o_h, G, D,
                    HAS_SINKS)
    else:
        ws = ((i_s * HKV + i_h) * P + i_p) * BM
        keep = live_p_ & m_valid  # padding rows (GQA group x query rows < BM) are never read back
        tl.store(p_ws_m + ws + o_m, b_m, mask=keep)
        tl.store(p_ws_l + ws + o_m, b_l, mask=keep)
        tl.store(p_ws_acc + (ws + o_m)[:, None] * D + o_d[None, :], b_acc, mask=keep[:, None])


# Scalars that change with the batch or the plan are not specialized: Triton would otherwise compile a
# variant per class of value (== 1, a multiple of 16, other) of each, so a server's first steps with new
# batch sizes, split counts or contexts stalled on compiles (an SGLang engine was seen compiling in the middle
# of a steady decode run). Strides stay specialized
# (their divisibility is what vectorizes the loads).
BATCH_SCALARS = ("n_items", "P", "num_sms", "sliding_window", "max_tokens", "num_blocks", "few_target", "min_pt",
                 "long_pt", "short_target")


@triton.jit(do_not_specialize=BATCH_SCALARS)
def pa_decode_partition_kernel(
    p_q, p_kc, p_vc, p_ks, p_vs, p_block_tables, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc, p_sinks, p_out, p_queue,
    n_items, P, num_sms, softmax_scale, sliding_window, max_tokens, num_blocks, few_target, min_pt, long_pt,
    short_target,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
    stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h,
    stride_block_tables, stride_cl,
    HKV: tl.constexpr, G: tl.constexpr, QL: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BT: tl.constexpr, ALIGN: tl.constexpr,
    V5D: tl.constexpr, K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr, RAGGED: tl.constexpr,
    V_MAXNUM: tl.constexpr, QUEUE: tl.constexpr, SM_SLOTS: tl.constexpr, DIRECT: tl.constexpr,
    HAS_SINKS: tl.constexpr, QK8: tl.constexpr = False,
):
    # two call sites of the task on purpose: the grid path runs it outside any loop (inside the queue's
    # loop the 4-warp page-64 program grew from 92 to 150 registers)
    if not QUEUE:  # grid (items, Hkv, P): one task per program
        _partition_task(
            tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2),
            p_q, p_kc, p_vc, p_ks, p_vs, p_block_tables, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc, p_sinks, p_out,
            P, softmax_scale, sliding_window, max_tokens, num_blocks, few_target, min_pt, long_pt, short_target,
            stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
            stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3, stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h,
            stride_block_tables, stride_cl, HKV, G, QL, BM, D, BS, BT, ALIGN, V5D, K_PER_TOKEN, V_PER_TOKEN, RAGGED,
            V_MAXNUM, DIRECT, HAS_SINKS, QK8)
    else:
        # tasks (item, KV head, partition), partition-major from the highest partition down (the
        # long sequences' partitions first, the short ones' last), bounded by the batch's longest split
        n_part = _max_partitions(p_cl, stride_cl, n_items, QL, sliding_window, P, max_tokens, few_target, min_pt,
                                 long_pt, short_target, ALIGN)
        per_part = n_items * HKV
        n_tasks = n_part * per_part
        t = n_tasks
        if SM_SLOTS > 0:
            # at most ceil(tasks / SMs) programs of one SM take tasks: the hardware fills some SMs'
            # slots before others' when the grid is near a full wave, and fewer tasks than programs
            # would otherwise pile onto those SMs (p_queue[1 + sm] counts the SM's programs)
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [n_items], dtype=tl.int32, is_pure=False,
                                           pack=1)
            rank = tl.atomic_add(p_queue + 1 + sm % SM_SLOTS, 1, sem="relaxed")
            if rank < tl.cdiv(n_tasks, num_sms):
                t = tl.atomic_add(p_queue, 1, sem="relaxed")
        else:
            t = tl.atomic_add(p_queue, 1, sem="relaxed")
        while t < n_tasks:
            i_p = n_part - 1 - t // per_part
            i_s = ((t % per_part) // HKV).to(tl.int64)
            i_h = t % HKV
            _partition_task(
                i_s, i_h, i_p, p_q, p_kc, p_vc, p_ks, p_vs, p_block_tables, p_cl, p_chunks, p_ws_m, p_ws_l, p_ws_acc,
                p_sinks, p_out, P, softmax_scale, sliding_window, max_tokens, num_blocks, few_target, min_pt, long_pt,
                short_target,
                stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
                stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3, stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h,
                stride_block_tables, stride_cl, HKV, G, QL, BM, D, BS, BT, ALIGN, V5D, K_PER_TOKEN, V_PER_TOKEN, RAGGED,
                V_MAXNUM, False, HAS_SINKS, QK8)
            t = tl.atomic_add(p_queue, 1, sem="relaxed")


@triton.jit(do_not_specialize=("sliding_window", "few_target", "min_pt", "long_pt", "short_target", "P", "max_tokens"))
def pa_decode_reduce_kernel(
    p_ws_m, p_ws_l, p_ws_acc, p_sinks, p_out, p_cl, p_chunks, p_queue,
    sliding_window, few_target, min_pt, long_pt, short_target, P, max_tokens,
    stride_o_t, stride_o_h, stride_cl,
    HKV: tl.constexpr, G: tl.constexpr, QL: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
    ALIGN: tl.constexpr, HAS_SINKS: tl.constexpr, RAGGED: tl.constexpr, QUEUE: tl.constexpr, SM_SLOTS: tl.constexpr,
    UNROLL: tl.constexpr = 1,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, D)
    row = o_m // G
    grp = o_m % G
    seq, q0, nrows, ctx = _rows_of(p_cl, stride_cl, p_chunks, i_s, max_tokens, QL, RAGGED)
    m_valid = (o_m < G * QL) & (row < nrows)
    lo, pt, n_live = _partition_span(ctx, nrows, sliding_window, P, few_target, min_pt, long_pt, short_target, ALIGN)
    base = (i_s * HKV + i_h) * P * BM
    if QUEUE:
        if (i_s == 0) & (i_h == 0):  # the partition kernel has drained the task queue: ready for the next launch
            tl.store(p_queue, 0)
            if SM_SLOTS > 0:
                o_sm = tl.arange(0, SM_SLOTS)
                tl.store(p_queue + 1 + o_sm, tl.zeros([SM_SLOTS], tl.int32))
    # the max over partitions: RED_PC partitions' rows per load, independent of each other
    o_c = tl.arange(0, RED_PC)
    m_all = tl.full([BM], float("-inf"), dtype=tl.float32)
    for p0 in tl.range(0, n_live, RED_PC):
        o_w = base + (p0 + o_c)[:, None] * BM + o_m[None, :]
        c_m = tl.load(p_ws_m + o_w, mask=((p0 + o_c) < n_live)[:, None] & m_valid[None, :], other=float("-inf"))
        m_all = tl.maximum(m_all, tl.max(c_m, 0))
    m_base = tl.where(m_all == float("-inf"), 0.0, m_all)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, D], dtype=tl.float32)
    for p in tl.range(0, n_live, loop_unroll_factor=UNROLL):
        w = tl.exp(tl.load(p_ws_m + base + p * BM + o_m, mask=m_valid, other=float("-inf")) - m_base)
        b_l += tl.load(p_ws_l + base + p * BM + o_m, mask=m_valid, other=0.0) * w
        b_acc += tl.load(p_ws_acc + (base + p * BM + o_m)[:, None] * D + o_d[None, :], mask=m_valid[:, None],
                         other=0.0) * w[:, None]
    _store_rows(m_base, b_l, b_acc, p_sinks, p_out, q0, row, grp, m_valid, i_h, stride_o_t, stride_o_h, G, D,
                HAS_SINKS)
