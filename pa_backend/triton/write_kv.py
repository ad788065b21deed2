# FP8 KV-cache write, Triton.
#
# Grid (tokens, Hkv). Program (t, h) loads K[t, h, :] and V[t, h, :] (D values, FP32 in registers),
# finds the slot (block = slot // block_size, offset = slot % block_size; negative or past the
# cache: the token is skipped, nothing stored), computes the per-token scale amax(|x|) / fp8_max
# when the cache uses per-token scales (and stores it), and stores clamp(x / scale) rounded to FP8
# into the x-packed K layout [b, h, d // 16, offset, d % 16] and either V layout. Block ids are
# int64, and so are head offsets (caches > 2 GiB, in any order of their dimensions).
#
# Rounding: the scale and x / scale are IEEE divisions (as torch's), then the value is rounded to the
# FP8 grid in FP32 (3 mantissa bits, round half to even, subnormals below 2**MIN_EXP), so the final
# conversion is exact. That gives the same bytes as torch's conversion on every backend, including
# Triton's CPU interpreter, whose own FP8 conversion mis-rounds when rounding carries into the exponent.
# (Triton's fp32 `/` is the approximate div.full.f32 on NVIDIA: an ulp off torch's now and then.)
# Non-finite inputs follow the reference too: a NaN is stored as the one positive FP8 NaN byte (the reference
# drops the sign as well, which followed the device's division there; per-token: the token's scale
# is NaN), an inf saturates to +-fp8_max under a per-tensor scale and makes a per-token scale inf (the
# element itself inf / inf = NaN, the token's finite elements 0).

import triton
import triton.language as tl


@triton.jit
def _round_to_fp8_grid(x, FMAX: tl.constexpr, MIN_EXP: tl.constexpr):
    a = tl.minimum(tl.abs(x), FMAX)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP)
    step = tl.exp2((e - 3).to(tl.float32))
    y = a / step
    f = tl.floor(y)
    d = y - f
    up = (d > 0.5) | ((d == 0.5) & ((f.to(tl.int32) & 1) == 1))
    r = tl.where(up, f + 1.0, f) * step
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_store(b_x, p_cache_tok, o_cache, p_scale_tok, live, FMAX: tl.constexpr, MIN_EXP: tl.constexpr,
                    NAN_BYTE: tl.constexpr, PER_TOKEN: tl.constexpr):
    # IEEE divisions (div_rn): Triton's `/` on fp32 is the approximate div.full.f32 on NVIDIA, which left
    # per-token scales 1 ulp off the reference writer's on a GPU
    if PER_TOKEN:
        sc = tl.maximum(tl.math.div_rn(tl.max(tl.abs(b_x), 0), FMAX), 1.1754943508222875e-38)
        # a NaN in the token makes its scale NaN, as torch's amax does (tl.max / tl.maximum skip NaN)
        sc = tl.where(tl.max((b_x != b_x).to(tl.int32), 0) > 0, float("nan"), sc)
        tl.store(p_scale_tok, sc, mask=live)
    else:
        sc = tl.load(p_scale_tok)
    b_y = tl.math.div_rn(b_x, tl.broadcast_to(sc, b_x.shape))
    b_q = _round_to_fp8_grid(b_y, FMAX, MIN_EXP).to(p_cache_tok.dtype.element_ty).to(tl.uint8, bitcast=True)
    # NaN (a NaN input, a NaN scale, inf / inf) is stored as the format's NaN byte: the grid rounding's
    # min / max would make it finite, and the interpreter's FP8 conversion has no NaN
    b_q = tl.where(b_y != b_y, NAN_BYTE, b_q)
    tl.store(p_cache_tok.to(tl.pointer_type(tl.uint8)) + o_cache, b_q, mask=live)


@triton.jit
def write_kv_kernel(
    p_k, p_v, p_kc, p_vc, p_ks, p_vs, p_slots, capacity, stride_slot,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_b, stride_kc_h, stride_kc_c, stride_kc_t,
    stride_vc_b, stride_vc_h, stride_vc_2, stride_vc_3,
    stride_ks_b, stride_ks_h, stride_vs_b, stride_vs_h,
    D: tl.constexpr, BS: tl.constexpr, FMAX: tl.constexpr, MIN_EXP: tl.constexpr, NAN_BYTE: tl.constexpr,
    V5D: tl.constexpr,
    K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)  # head offsets in int64: a cache's head stride times Hkv may pass 2^31
    o_d = tl.arange(0, D)
    slot = tl.load(p_slots + i_t * stride_slot).to(tl.int64)
    live = (slot >= 0) & (slot < capacity)
    slot = tl.where(live, slot, 0)
    b = slot // BS
    off = slot % BS
    b_k = tl.load(p_k + i_t * stride_k_t + i_h * stride_k_h + o_d).to(tl.float32)
    b_v = tl.load(p_v + i_t * stride_v_t + i_h * stride_v_h + o_d).to(tl.float32)
    o_kc = (o_d // 16) * stride_kc_c + off * stride_kc_t + o_d % 16
    if V5D:
        o_vc = (off // 16) * stride_vc_2 + o_d * stride_vc_3 + off % 16
    else:
        o_vc = o_d * stride_vc_2 + off * stride_vc_3
    if K_PER_TOKEN:
        p_ks_tok = p_ks + b * stride_ks_b + i_h * stride_ks_h + off
    else:
        p_ks_tok = p_ks
    if V_PER_TOKEN:
        p_vs_tok = p_vs + b * stride_vs_b + i_h * stride_vs_h + off
    else:
        p_vs_tok = p_vs
    _quantize_store(b_k, p_kc + b * stride_kc_b + i_h * stride_kc_h, o_kc, p_ks_tok, live, FMAX, MIN_EXP, NAN_BYTE,
                    K_PER_TOKEN)
    _quantize_store(b_v, p_vc + b * stride_vc_b + i_h * stride_vc_h, o_vc, p_vs_tok, live, FMAX, MIN_EXP, NAN_BYTE,
                    V_PER_TOKEN)
