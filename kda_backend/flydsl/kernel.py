"""The project's own FlyDSL kernel for the fused KDA decode step (docs/design.md §3), flydsl 0.4.2 API.

Status: compiled and resource-checked for gfx950 and gfx942 on a CPU-only machine
(``COMPILE_ONLY=1``); it has never run on AMD hardware here. ``launch`` needs an AMD GPU.

Design
------
Grid: one CTA per (row n, head h), ``B*H`` CTAs on a 1-D grid (``bid = n*H + h``), NUM_WARPS
wave64 waves (default 4 = 256 threads). A CTA covers all V = 128 rows of the [V, K] state tile
of (slot(n), h). V is never split across CTAs, so the conv-window race of a V-split kernel (two
CTAs of one row shifting the same conv window; docs/design.md §3) cannot happen: each conv channel of a (row, head) is
read and shifted by exactly one thread of one
CTA, and that thread writes the shifted window only after it has read the old one.

Phases inside a CTA:
 1. Every lane issues its state loads first (16-byte buffer loads: 4 fp32 or 8 bf16 each).
 2. Prologue, one work item per thread (two for 256 threads): 3K = 384 conv items (channel c
    of q|k|v of head h: conv over the W-1 cached inputs + x, + bias, SiLU; shifted window
    stored back; the original BF16 bits are moved, not re-rounded) and K = 128 gate items
    (a, or in the f_b variant a = f_a[n] . f_b_weight[h, k, :] in FP32 with 16-byte loads;
    then g and exp(g)). Results go to LDS: y[3K] and exp(g)[K] (FP32). Items are wave-aligned
    (boundaries at multiples of 64), so the item-type branches never diverge inside a wave.
    Without the conv stage the items just widen x (already convolved + activated).
 3. One CTA barrier. Lane layout for the state: K-lane kl = lane % 8, row lane vr = lane // 8;
    lane owns V rows v = vi*(8*NUM_WARPS) + wave*8 + vr (vi < V/(8*NUM_WARPS)) and 16 K columns
    in KI chunks of VEC (fp32: 4 chunks of 4 at k = ki*32 + kl*4; bf16: 2 chunks of 8 at
    k = ki*64 + kl*8), so each load instruction of a wave reads 8 full 128-byte row segments.
    q, k, exp(g) for its 16 columns come from LDS; L2 norms, S.k, S.q, k.q are partial dot
    products reduced by an xor butterfly over the 8 K-lanes (offsets 1, 2, 4).
    Delta rule in FP32: S *= exp(g); v' = beta (v - S.k); S += v' k; o = S_decayed.q + v' (k.q)
    (algebraically S_new.q; both reductions run together). State stored back with 16-byte
    stores (BF16: rounded once, here).
 4. Norm stage: K-lane 0 of each row writes o to LDS; barrier; wave 0 reads the 128 values
    (2 per lane), full-wave butterfly for sum(o^2), writes o*rstd*w*sigmoid(gate) as BF16.
    Without the norm stage K-lane 0 writes BF16 o directly.

Registers (measured, flydsl 0.4.2 compile-only, same on gfx950 and gfx942 within 2): FP32 state
146-149 VGPRs (64 state values per lane + q/k/exp(g) 48), BF16 state 113-115; f_b variants 160
(FP32) / 124 (BF16) with the R-dot issued in scheduling groups (``fb_chunk``; 216 / 182
without). 0 AGPRs, no spills, no scratch; 3 (FP32) or 4 (BF16) waves per SIMD.
LDS: (3K + K + V) * 4 = 2560 bytes (2048 without the norm stage).

Padding rows (index < 0 or >= num_slots): threads t < V write zero output; no cache access.
Offsets: every per-CTA base (x row, a row, f_a row, b, gate row, out row, state slot + head,
conv_state slot) is a 64-bit pointer add; offsets inside one row / slot / weight are 32-bit BYTE
offsets (``contract.prepare`` checks those spans are < 2**31 elements, ``supports`` declines a call
whose span passes 2**31 bytes). Buffer descriptors are built from those bases (num_records
0xFFFFFFFF: no hardware bound to fall back on).

Runtime scalars (not in the specialization key): B (grid), num_slots, scale, lower_bound,
norm_eps and every stride. conv_state and conv_weight may have any strides (channel-major or
the width-major transpose view); b, out and output_gate any row / head strides.

The specializations shipped (compiled and resource-checked by the compile gate) and their VGPR
budgets are in ``shipped.py`` beside this file.
"""


import functools
from dataclasses import dataclass
from typing import Tuple

import torch

from backend_core.validation import INT32_MAX

from ..contract import KDAProblem

__all__ = [
    "SUPPORTED_H",
    "SUPPORTED_K",
    "SUPPORTED_W",
    "Spec",
    "spec_of",
    "kernel_name",
    "supports",
    "get_launcher",
    "launch",
    "compile_spec",
    "threads_of",
]

SUPPORTED_H = (3, 6, 12, 24, 32)
SUPPORTED_K = (128,)
SUPPORTED_W = (4,)
MAX_R = 512
DEFAULT_WARPS = 4


@dataclass(frozen=True)
class Spec:
    """Everything that changes the binary. Scalars and strides are runtime arguments."""

    H: int
    K: int = 128  # K == V
    W: int = 4  # conv width, 0 when the conv stage is off
    state: str = "fp32"  # 'fp32' | 'bf16'
    has_conv: bool = True
    has_bias: bool = False
    has_norm: bool = True
    has_f_b: bool = False
    R: int = 0  # f_b rank (0 without f_b)
    safe_gate: bool = False  # lower_bound given
    idx64: bool = False  # state_indices int64
    nw_fp32: bool = False  # norm_weight FP32 (else BF16)
    num_warps: int = DEFAULT_WARPS
    fb_chunk: int = 0  # f_b only: R elements per scheduling group (0: one group), see fb_chunk_for


def fb_chunk_for(state: str, has_f_b: bool, R: int = 128) -> int:
    """Launch config of the f_b variant: the R-dot is issued in groups of this many elements with a
    scheduling barrier between groups, which bounds the 16-byte operand loads in flight. Chosen
    from compile-only VGPR counts (gfx950, H=3; no timing was possible): FP32 state 216 VGPRs
    unchunked -> 160 at 64 (154 at 32); BF16 state 182 -> 124 at 32 (132 at 64). 64 for FP32
    keeps 3 waves/SIMD with two load round trips; 32 for BF16 reaches 4 waves/SIMD."""
    if not has_f_b:
        return 0
    for chunk in ((64, 32, 16, 8) if state == "fp32" else (32, 16, 8)):
        if R % chunk == 0:
            return chunk if R > chunk else 0
    return 0  # R % 8 != 0 is refused by supports()


def spec_of(p: KDAProblem) -> Spec:
    return Spec(
        H=p.H, K=p.K, W=p.W if p.has_conv else 0,
        state="fp32" if p.state.dtype == torch.float32 else "bf16",
        has_conv=p.has_conv, has_bias=p.conv_bias is not None, has_norm=p.has_norm,
        has_f_b=p.has_f_b, R=p.R if p.has_f_b else 0, safe_gate=p.lower_bound is not None,
        idx64=p.state_indices.dtype == torch.int64,
        nw_fp32=p.has_norm and p.norm_weight.dtype == torch.float32,
        num_warps=DEFAULT_WARPS,
        fb_chunk=fb_chunk_for("fp32" if p.state.dtype == torch.float32 else "bf16", p.has_f_b, p.R),
    )


def kernel_name(spec: Spec) -> str:
    """Unique per specialization; the variant that moves VGPRs most comes first so budgets.json
    prefixes can group kernels (state dtype, then gate source, then stages, then H/K/warps)."""
    n = f"kda_decode_{spec.state}_" + (f"fb{spec.R}c{spec.fb_chunk}" if spec.has_f_b else "gate")
    n += f"_conv{spec.W}{'b' if spec.has_bias else ''}" if spec.has_conv else "_noconv"
    n += ("_norm" + ("32" if spec.nw_fp32 else "")) if spec.has_norm else "_raw"
    if spec.safe_gate:
        n += "_safe"
    if spec.idx64:
        n += "_i64"
    return n + f"_h{spec.H}_k{spec.K}_w{spec.num_warps}"


def threads_of(spec: Spec) -> int:
    return 64 * spec.num_warps


def _aligned16(t: torch.Tensor, row_strides=()) -> bool:
    if t.data_ptr() % 16:
        return False
    return all((s * t.element_size()) % 16 == 0 for s in row_strides)


def supports(p: KDAProblem) -> Tuple[bool, str]:
    """Shape / layout coverage of this kernel (no hardware checks)."""
    if p.H not in SUPPORTED_H:
        return False, f"H={p.H} not in {SUPPORTED_H} (only the head counts compiled and resource-checked are enabled)"
    if p.K not in SUPPORTED_K or p.V != p.K:
        return False, f"K=V={p.K} not in {SUPPORTED_K} (the lane layout is built for 128-dim heads)"
    if p.has_conv and p.W not in SUPPORTED_W:
        return False, f"conv width W={p.W} not in {SUPPORTED_W}"
    if p.has_f_b and (p.R % 8 or p.R > MAX_R):
        return False, f"f_b rank R={p.R}: expected a multiple of 8 up to {MAX_R} (16-byte loads)"
    # buffer loads and stores take 32-bit BYTE offsets from a base set per row / slot / head (the contract bounds
    # the spans in elements, for the Triton kernel's int32 element offsets, and records the largest in bytes)
    nbytes, name, what = p.largest_piece
    if nbytes > INT32_MAX:
        return False, (f"{name}: {what} spans {nbytes} bytes, past the 32-bit byte offsets of the kernel's buffer "
                       "accesses")
    # 16-byte vector accesses: the state slots and the f_b operands must be 16-byte aligned
    if not _aligned16(p.state, (p.state.stride(0),)):
        return False, "state: the 16-byte state transactions need a 16-byte aligned base and slot stride"
    if p.has_f_b and not (_aligned16(p.f_a, (p.f_a.stride(0),))
                          and _aligned16(p.f_b_weight, (p.f_b_weight.stride(0), p.f_b_weight.stride(1)))):
        return False, "f_a / f_b_weight: the 16-byte loads need 16-byte aligned rows"
    return True, "ok"


# ------------------------------------------------------------------------------------------------
# kernel factory
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def get_launcher(spec: Spec):
    """The ``@flyc.jit`` launcher of one specialization (imports flydsl)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr, range_constexpr, rocdl
    from flydsl.expr.typing import T

    H, K = spec.H, spec.K
    V = K
    HK = H * K
    W = spec.W
    R = spec.R
    NW = spec.num_warps
    NT = 64 * NW
    if V % (8 * NW):
        raise ValueError(f"Spec: V={V} is not a multiple of 8*num_warps={8 * NW}")
    VI = V // (8 * NW)  # state rows per lane
    ST32 = spec.state == "fp32"
    VEC = 4 if ST32 else 8  # elements per 16-byte state transaction
    KSTEP = 8 * VEC  # K columns covered by the 8 K-lanes per chunk
    KI = K // KSTEP  # chunks per lane
    ESZ = 4 if ST32 else 2
    NITEMS = 4 * K  # 3K conv items + K gate items
    HAS_CONV, HAS_BIAS, HAS_NORM, HAS_FB = spec.has_conv, spec.has_bias, spec.has_norm, spec.has_f_b
    SAFE, IDX64, NW32 = spec.safe_gate, spec.idx64, spec.nw_fp32
    NAME = kernel_name(spec)
    FAST = fx.arith.FastMathFlags.fast
    LOG2E = 1.4426950408889634
    FB_CHUNK = spec.fb_chunk if HAS_FB else 0
    if FB_CHUNK and (FB_CHUNK % 8 or R % FB_CHUNK):
        raise ValueError(f"Spec: fb_chunk={FB_CHUNK} must be a multiple of 8 dividing R={R}")
    FB_BREAKS = {r for r in range(1, max(R // 8, 1)) if FB_CHUNK and (r * 8) % FB_CHUNK == 0}


    @fx.struct
    class Smem:
        y: fx.Array[fx.Float32, 3 * K, 16]
        g: fx.Array[fx.Float32, K, 16]
        o: fx.Array[fx.Float32, V, 16]

    # -- straight-line helpers (no runtime control flow here: they are not AST-rewritten) --------
    def i32(v):
        return fx.Int32(v)

    def rsrc(t, elem_off=None):
        p = fx.get_iter(t)
        if elem_off is not None:
            p = fx.add_offset(p, elem_off)
        return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(p))

    def ld(rs, ty, byte_off):
        return rocdl.raw_ptr_buffer_load(ty, rs, i32(byte_off), i32(0), 0)

    def st(val, rs, byte_off):
        v = val.ir_value() if hasattr(val, "ir_value") else val
        rocdl.raw_ptr_buffer_store(v, rs, i32(byte_off).ir_value(), i32(0).ir_value())

    def ld_bf16(rs, byte_off):
        return fx.BFloat16(ld(rs, T.bf16, byte_off)).to(fx.Float32)

    def ld_f32(rs, byte_off):
        return fx.Float32(ld(rs, T.f32, byte_off))

    def fexp(x):
        return fx.math.exp2(x * LOG2E, fastmath=FAST)

    def sigmoid(x):
        return 1.0 / (1.0 + fexp(-x))

    def kred(x):  # sum over the 8 K-lanes of a row group
        for off in (1, 2, 4):
            x = x + x.shuffle_xor(off, 64)
        return x

    def wred(x):  # sum over the whole wave
        for off in (1, 2, 4, 8, 16, 32):
            x = x + x.shuffle_xor(off, 64)
        return x

    def vsum(vs):
        acc = vs[0]
        for v in vs[1:]:
            acc = acc + v
        return acc.reduce(fx.ReductionOp.ADD)

    @flyc.kernel(name=NAME)
    def kda_kernel(
        x: fx.Tensor, cw: fx.Tensor, cb: fx.Tensor, cs: fx.Tensor, a: fx.Tensor, fa: fx.Tensor,
        fbw: fx.Tensor, b: fx.Tensor, A_log: fx.Tensor, dt_bias: fx.Tensor, state: fx.Tensor,
        idx: fx.Tensor, gate: fx.Tensor, nw: fx.Tensor, out: fx.Tensor,
        num_slots: fx.Int64, scale: fx.Float32, lower_bound: fx.Float32, norm_eps: fx.Float32,
        sx0: fx.Int64, scw0: fx.Int32, scw1: fx.Int32, scs0: fx.Int64, scs1: fx.Int32, scs2: fx.Int32,
        sa0: fx.Int64, sfa0: fx.Int64, sfb0: fx.Int32, sfb1: fx.Int32, sb0: fx.Int64, sb1: fx.Int64,
        ss0: fx.Int64, sidx: fx.Int64, sg0: fx.Int64, sg1: fx.Int64, so0: fx.Int64, so1: fx.Int64,
    ):
        st_vec_t = T.vec(VEC, T.f32 if ST32 else T.bf16)
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        n = bid // H
        h = bid % H
        n64 = fx.Int64(n)
        h64 = fx.Int64(h)
        lane = tid % 64
        wave = tid // 64
        kl = lane % 8
        vr = lane // 8

        rs_idx = rsrc(idx, n64 * sidx)
        if const_expr(IDX64):
            slot = fx.Int64(ld(rs_idx, T.i64, 0))
        else:
            slot = fx.Int64(fx.Int32(ld(rs_idx, T.i32, 0)))
        rs_out = rsrc(out, n64 * so0 + h64 * so1)

        def _live():
            lds = fx.SharedAllocator().allocate(Smem).peek()
            ly = lds.y.view(fx.make_layout(3 * K, 1))
            lg = lds.g.view(fx.make_layout(K, 1))
            lo = lds.o.view(fx.make_layout(V, 1))

            # 1. state tile first (longest latency)
            rs_st = rsrc(state, slot * ss0 + h64 * (V * K))
            s_off = []
            s_raw = []
            for vi in range_constexpr(VI):
                v_row = vi * (8 * NW) + wave * 8 + vr
                for ki in range_constexpr(KI):
                    off = (v_row * K + ki * KSTEP + kl * VEC) * ESZ
                    s_off.append(off)
                    s_raw.append(ld(rs_st, st_vec_t, off))

            # 2. prologue: conv / activation items and gate items -> LDS
            rs_x = rsrc(x, n64 * sx0)
            if const_expr(HAS_CONV):
                rs_cw = rsrc(cw)
                rs_cs = rsrc(cs, slot * scs0)
                if const_expr(HAS_BIAS):
                    rs_cb = rsrc(cb)

            def conv_item(c):
                part = c // K
                gc = part * HK + h * K + (c % K)
                x_raw = ld(rs_x, T.bf16, gc * 2)
                xv = fx.BFloat16(x_raw).to(fx.Float32)
                if const_expr(HAS_CONV):
                    acc = xv * ld_f32(rs_cw, (gc * scw0 + (W - 1) * scw1) * 4)
                    if const_expr(HAS_BIAS):
                        acc = acc + ld_f32(rs_cb, gc * 4)
                    win = []
                    for j in range_constexpr(W - 1):
                        s_raw_j = ld(rs_cs, T.bf16, (gc * scs1 + j * scs2) * 2)
                        win.append(s_raw_j)
                        acc = acc + fx.BFloat16(s_raw_j).to(fx.Float32) * ld_f32(rs_cw, (gc * scw0 + j * scw1) * 4)
                    y = acc * sigmoid(acc)
                    for j in range_constexpr(W - 2):
                        st(win[j + 1], rs_cs, (gc * scs1 + j * scs2) * 2)
                    st(x_raw, rs_cs, (gc * scs1 + (W - 2) * scs2) * 2)
                else:
                    y = xv
                fx.memref_store(y, ly, c)

            def gate_item(kk):
                ch = h * K + kk
                if const_expr(HAS_FB):
                    rs_fa = rsrc(fa, n64 * sfa0)
                    rs_fb = rsrc(fbw, h64 * fx.Int64(sfb0))
                    # R in chunks of FB_CHUNK elements; a scheduling barrier between chunks keeps
                    # only one chunk of 16-byte operand loads in flight (bounds the VGPRs)
                    accs = []
                    for r in range_constexpr(R // 8):
                        if const_expr(r in FB_BREAKS):
                            rocdl.sched_barrier(0)
                        wv = fx.Vector(ld(rs_fb, T.vec(8, T.bf16), (kk * sfb1 + r * 8) * 2)).to(fx.Float32)
                        av = fx.Vector(ld(rs_fa, T.vec(8, T.bf16), r * 16)).to(fx.Float32)
                        accs.append(wv * av if not accs else fx.math.fma(wv, av, accs.pop()))
                    av_sum = vsum(accs)
                else:
                    rs_a = rsrc(a, n64 * sa0)
                    av_sum = ld_bf16(rs_a, ch * 2)
                z = av_sum + ld_f32(rsrc(dt_bias), ch * 4)
                A = fexp(ld_f32(rsrc(A_log), h * 4))
                if const_expr(SAFE):
                    g = lower_bound * sigmoid(A * z)
                else:
                    sp = (z > 20.0).select(z, fx.math.log1p(fexp(z), fastmath=FAST))
                    g = -(A * sp)
                fx.memref_store(fexp(g), lg, kk)

            for j in range_constexpr((NITEMS + NT - 1) // NT):
                lo_i = j * NT
                hi_i = min(NITEMS, lo_i + NT)
                item = tid + lo_i
                if const_expr(hi_i <= 3 * K):
                    conv_item(item)
                elif const_expr(lo_i >= 3 * K):
                    if item < NITEMS:
                        gate_item(item - 3 * K)
                else:
                    if item < 3 * K:
                        conv_item(item)
                    if item >= 3 * K:
                        if item < NITEMS:
                            gate_item(item - 3 * K)

            beta = sigmoid(ld_bf16(rsrc(b, n64 * sb0 + h64 * sb1), 0))
            fx.gpu.barrier()

            # 3. delta rule on the lane's rows / columns
            qv, kv, ev = [], [], []
            for ki in range_constexpr(KI):
                k0 = ki * KSTEP + kl * VEC
                qv.append(fx.Vector.from_elements([fx.memref_load(ly, k0 + e) for e in range_constexpr(VEC)],
                                                  fx.Float32))
                kv.append(fx.Vector.from_elements([fx.memref_load(ly, K + k0 + e) for e in range_constexpr(VEC)],
                                                  fx.Float32))
                ev.append(fx.Vector.from_elements([fx.memref_load(lg, k0 + e) for e in range_constexpr(VEC)],
                                                  fx.Float32))
            sq = kred(vsum([q * q for q in qv]))
            sk = kred(vsum([k * k for k in kv]))
            rq = fx.math.rsqrt(sq + 1e-6, fastmath=FAST) * scale
            rk = fx.math.rsqrt(sk + 1e-6, fastmath=FAST)
            qv = [q * rq for q in qv]
            kv = [k * rk for k in kv]
            kq = kred(vsum([kv[i] * qv[i] for i in range_constexpr(KI)]))

            for vi in range_constexpr(VI):
                v_row = vi * (8 * NW) + wave * 8 + vr
                vv = fx.memref_load(ly, 2 * K + v_row)
                sd = []
                for ki in range_constexpr(KI):
                    s = fx.Vector(s_raw[vi * KI + ki])
                    if const_expr(not ST32):
                        s = s.to(fx.Float32)
                    sd.append(s * ev[ki])
                dot_k = kred(vsum([sd[i] * kv[i] for i in range_constexpr(KI)]))
                dot_q = kred(vsum([sd[i] * qv[i] for i in range_constexpr(KI)]))
                vn = beta * (vv - dot_k)
                o = dot_q + vn * kq
                for ki in range_constexpr(KI):
                    s_new = sd[ki] + kv[ki] * vn
                    if const_expr(not ST32):
                        s_new = s_new.to(fx.BFloat16)
                    st(s_new, rs_st, s_off[vi * KI + ki])

                def _emit(_o=o, _v=v_row):
                    if const_expr(HAS_NORM):
                        fx.memref_store(_o, lo, _v)
                    else:
                        st(_o.to(fx.BFloat16), rs_out, _v * 2)

                if kl == 0:
                    _emit()

            # 4. gated RMSNorm epilogue
            if const_expr(HAS_NORM):
                fx.gpu.barrier()

                def _norm():
                    o0 = fx.memref_load(lo, lane)
                    o1 = fx.memref_load(lo, lane + 64)
                    rstd = fx.math.rsqrt(wred(o0 * o0 + o1 * o1) * (1.0 / V) + norm_eps, fastmath=FAST)
                    rs_g = rsrc(gate, n64 * sg0 + h64 * sg1)
                    rs_w = rsrc(nw)
                    for e, oe in ((0, o0), (1, o1)):
                        vpos = lane + 64 * e
                        if const_expr(NW32):
                            wgt = ld_f32(rs_w, vpos * 4)
                        else:
                            wgt = ld_bf16(rs_w, vpos * 2)
                        yv = oe * rstd * wgt * sigmoid(ld_bf16(rs_g, vpos * 2))
                        st(yv.to(fx.BFloat16), rs_out, vpos * 2)

                if wave == 0:
                    _norm()

        def _dead():
            st(fx.Float32(0.0).to(fx.BFloat16), rs_out, tid * 2)

        live = (slot >= 0) & (slot < num_slots)
        dead = (slot < 0) | (slot >= num_slots)
        if live:
            _live()
        if dead:
            if tid < V:
                _dead()

    @flyc.jit
    def kda_launch(
        x: fx.Tensor, cw: fx.Tensor, cb: fx.Tensor, cs: fx.Tensor, a: fx.Tensor, fa: fx.Tensor,
        fbw: fx.Tensor, b: fx.Tensor, A_log: fx.Tensor, dt_bias: fx.Tensor, state: fx.Tensor,
        idx: fx.Tensor, gate: fx.Tensor, nw: fx.Tensor, out: fx.Tensor,
        num_slots: fx.Int64, scale: fx.Float32, lower_bound: fx.Float32, norm_eps: fx.Float32,
        sx0: fx.Int64, scw0: fx.Int32, scw1: fx.Int32, scs0: fx.Int64, scs1: fx.Int32, scs2: fx.Int32,
        sa0: fx.Int64, sfa0: fx.Int64, sfb0: fx.Int32, sfb1: fx.Int32, sb0: fx.Int64, sb1: fx.Int64,
        ss0: fx.Int64, sidx: fx.Int64, sg0: fx.Int64, sg1: fx.Int64, so0: fx.Int64, so1: fx.Int64,
        batch: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        kda_kernel(
            x, cw, cb, cs, a, fa, fbw, b, A_log, dt_bias, state, idx, gate, nw, out,
            num_slots, scale, lower_bound, norm_eps,
            sx0, scw0, scw1, scs0, scs1, scs2, sa0, sfa0, sfb0, sfb1, sb0, sb1,
            ss0, sidx, sg0, sg1, so0, so1,
        ).launch(grid=(batch * H, 1, 1), block=(NT, 1, 1), stream=stream)

    return kda_launch


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------


def _args_of(p: KDAProblem) -> list:
    return p.kernel_tensors() + p.kernel_scalars() + p.kernel_strides() + [p.B]


def launch(p: KDAProblem) -> torch.Tensor:
    """Run one decode step on the current torch stream (AMD GPU); fills and returns ``p.out``."""
    if p.B == 0:
        return p.out
    ok, why = supports(p)
    if not ok:
        raise ValueError(f"FlyDSL KDA kernel: {why}")
    fn = get_launcher(spec_of(p))
    stream = torch.cuda.current_stream(p.device) if p.device.type == "cuda" else None
    import flydsl.expr as fx

    fn(*_args_of(p), fx.Stream(stream) if stream is None else stream)
    return p.out


# ------------------------------------------------------------------------------------------------
# compile-only builds (the shipped list and budgets: shipped.py)
# ------------------------------------------------------------------------------------------------


def example_problem(spec: Spec, B: int = 2, slots: int = 4, width_major_conv: bool = False) -> KDAProblem:
    """A CPU problem of the spec's shapes and dtypes (realistic strides) for compile-only builds."""
    from ..contract import prepare

    H, K = spec.H, spec.K
    C = 3 * H * K
    bf, f32 = torch.bfloat16, torch.float32
    sdt = f32 if spec.state == "fp32" else bf
    x = torch.zeros(B, C, dtype=bf)
    if spec.has_conv:
        W = spec.W
        cw = torch.zeros(C, W, dtype=f32)
        if width_major_conv:
            cs = torch.zeros(slots, W - 1, C, dtype=bf).transpose(1, 2)
        else:
            cs = torch.zeros(slots, C, W - 1, dtype=bf)
        cb = torch.zeros(C, dtype=f32) if spec.has_bias else None
    else:
        cw = cs = cb = None
    state = torch.zeros(slots, H, K, K, dtype=sdt)
    idx = torch.arange(B, dtype=torch.int64 if spec.idx64 else torch.int32)
    b = torch.zeros(1, B, H, dtype=bf)
    if spec.has_norm:
        gate = torch.zeros(B, H, K, dtype=bf)
        nw = torch.zeros(K, dtype=f32 if spec.nw_fp32 else bf)
    else:
        gate = nw = None
    common = dict(
        x=x, conv_weight=cw, conv_state=cs, b=b, A_log=torch.zeros(H, dtype=f32),
        dt_bias=torch.zeros(H * K, dtype=f32), state=state, state_indices=idx, output_gate=gate,
        norm_weight=nw, conv_bias=cb, lower_bound=-5.0 if spec.safe_gate else None,
        out=torch.zeros(H, B, K, dtype=bf).transpose(0, 1),  # heads-outer rows
    )
    if spec.has_f_b:
        return prepare(f_a=torch.zeros(B, spec.R, dtype=bf), f_b_weight=torch.zeros(H, K, spec.R, dtype=bf),
                       a=None, with_f_b=True, **common)
    return prepare(a=torch.zeros(B, H * K, dtype=bf), **common)


def compile_spec(spec: Spec) -> dict:
    """Compile one specialization (needs COMPILE_ONLY=1, ARCH = FLYDSL_GPU_ARCH) and return its
    resources (``backend_core.flydsl_compile.resources_of``). Raises on a compile error."""
    from backend_core import flydsl_compile

    problems = flydsl_compile.toolchain_problems()
    if problems:
        raise RuntimeError("FlyDSL compile-only toolchain not ready: " + "; ".join(problems))
    p = example_problem(spec)
    if spec_of(p) != spec:
        raise ValueError(f"compile_spec: example problem maps to {spec_of(p)}, not {spec}")
    import flydsl.expr as fx

    fn = get_launcher(spec)
    fn(*_args_of(p), fx.Stream(None))
    res = flydsl_compile.resources_of(fn)
    if res["kernel"] != kernel_name(spec):
        raise RuntimeError(f"compile_spec: compiled kernel {res['kernel']!r}, expected {kernel_name(spec)!r}")
    return res
