# Fused KDA speculative-verify step, Triton (NVIDIA and AMD; CPU through the interpreter).
#
# Design
# ------
# Grid: (H, B). Program (h, b) owns the whole [V, K] recurrent-state tile of request b, head h, and all
# q | k | v channels of head h, for all T_b tokens of the request: the state is read once, stays in
# registers (FP32) across the tokens, and is written once per token where the call says (a state slot
# per step, or a row x step of the step buffer). One program per (request, head) means no program ever
# reads a channel or a state element another program writes, so no cross-program protocol is needed
# (the decode kernel's V split needs one); the price is B*H programs, few at small B.
#
# In registers per program: the state tile S [V, K] (FP32, rounded to the state dtype after every token
# as a decode step stores it), the committed conv window of its channels (W-1 BF16 vectors per group,
# read once), the conv taps and bias (FP32, loaded once: reloading them per token keeps 64-bit pointer
# vectors live across the loop, which costs more registers), and per token q, k [K], v, o [V] and the
# gate [K] (from `a`, or the FP32 dot f_a . f_b_weight[h]^T over [K, RC] chunks). At K = 128 with 4
# warps this spills a little on sm_90 (tens of bytes; tests/triton_resources.py VERIFY_CONFIGS): the
# [K] vectors are replicated across the tile's rows. Splitting V over programs is the way to a smaller
# tile; it needs the decode kernel's last-program protocol for the conv windows and the norm.
#
# Conv windows: token t's window is its own x row behind its W-1 nearest ancestors (t-1, t-2, .. for a
# chain; parent_indices for a tree), falling back into the committed window; ancestors' x rows are
# re-read from `x` (cache hits), so chains and trees share one code path. The committed conv state is
# read before a CTA barrier and written after it (the slot form rewrites it in place).
#
# Trees: a token whose parent is not the previous token reloads the parent's state from the step buffer
# the program itself wrote (a CTA barrier after each token's stores makes them visible to all threads).
#
# Padding requests (see kda_verify) mask every cache load and store off and write zero output rows.
# Row and slot offsets are int64; offsets within one slot, step or row are int32 (the contract checks).

import triton
import triton.language as tl


@triton.jit
def _load_window(p_cs_slot, o_c, offset, live, stride_cs_c, stride_cs_w, W: tl.constexpr):
    """The committed window of channels o_c, newest first: (r1, r2, r3) (r2, r3 repeat r1 when W < 4)."""
    p = p_cs_slot + o_c * stride_cs_c + offset * stride_cs_w
    r1 = tl.load(p + (W - 2) * stride_cs_w, mask=live, other=0.0)
    r2 = r1
    r3 = r1
    if W > 2:
        r2 = tl.load(p + (W - 3) * stride_cs_w, mask=live, other=0.0)
    if W > 3:
        r3 = tl.load(p + (W - 4) * stride_cs_w, mask=live, other=0.0)
    return r1, r2, r3


@triton.jit
def _parent(p_par_row, j, stride_par_t, HAS_PARENTS: tl.constexpr):
    """The ancestor index before j: -1 for token 0, j-1 past the request's start (into the committed
    window), the tree parent when it is in [0, j), else j-1."""
    prev = j - 1
    if HAS_PARENTS:
        cand = tl.load(p_par_row + tl.maximum(j, 0) * stride_par_t, mask=j > 0, other=0).to(tl.int64)
        prev = tl.where((j > 0) & (cand >= 0) & (cand < j), cand, prev)
    return prev


@triton.jit
def _entry(p_x_req, j, o_c, stride_x_n, r1, r2, r3):
    """Window entry for ancestor j: x row j of the request, or a committed entry for j < 0."""
    xv = tl.load(p_x_req + tl.maximum(j, 0) * stride_x_n + o_c, mask=(j >= 0) & (o_c >= 0), other=0.0)
    init = tl.where(j == -1, r1, tl.where(j == -2, r2, r3))
    return tl.where(j >= 0, xv, init)


@triton.jit
def _load_weights(p_cw, p_cb, o_c, stride_cw_c, stride_cw_w, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Conv weights of channels o_c, newest tap first (w1 multiplies x_t), and the bias, FP32."""
    p_w = p_cw + o_c * stride_cw_c
    w1 = tl.load(p_w + (W - 1) * stride_cw_w)
    w2 = tl.load(p_w + (W - 2) * stride_cw_w)
    w3 = w2
    w4 = w2
    if W > 2:
        w3 = tl.load(p_w + (W - 3) * stride_cw_w)
    if W > 3:
        w4 = tl.load(p_w + (W - 4) * stride_cw_w)
    bias = tl.zeros_like(w1)
    if HAS_BIAS:
        bias = tl.load(p_cb + o_c)
    return w1, w2, w3, w4, bias


@triton.jit
def _conv_token(x_t, e1, e2, e3, w1, w2, w3, w4, bias, W: tl.constexpr):
    """SiLU(conv) of one token: x_t * w1 + e1 * w2 + e2 * w3 + e3 * w4 + bias, FP32."""
    acc = x_t.to(tl.float32) * w1 + e1.to(tl.float32) * w2 + bias
    if W > 2:
        acc += e2.to(tl.float32) * w3
    if W > 3:
        acc += e3.to(tl.float32) * w4
    return acc * tl.sigmoid(acc)


@triton.jit
def _store_window(p_base, o_c, x_t, e1, e2, mask, stride_c, stride_w, W: tl.constexpr):
    """The window after a token (W-1 entries, newest last) of channels o_c."""
    p = p_base + o_c * stride_c
    tl.store(p + (W - 2) * stride_w, x_t, mask=mask)
    if W > 2:
        tl.store(p + (W - 3) * stride_w, e1, mask=mask)
    if W > 3:
        tl.store(p + (W - 4) * stride_w, e2, mask=mask)


@triton.jit
def _group(p_x_req, p_x_t, o_c, a1, a2, a3, r1, r2, r3, w1, w2, w3, w4, bias, p_scs_t, live,
           stride_x_n, stride_scs_c, stride_scs_w, W: tl.constexpr, HAS_CONV: tl.constexpr,
           STEP_CONV: tl.constexpr):
    """q, k or v channels o_c of one token: conv + SiLU over the token's window (or x as is), FP32;
    with STEP_CONV the window after the token is stored to the step buffer."""
    x_t = tl.load(p_x_t + o_c)
    if HAS_CONV:
        e1 = _entry(p_x_req, a1, o_c, stride_x_n, r1, r2, r3)
        e2 = e1
        e3 = e1
        if W > 2:
            e2 = _entry(p_x_req, a2, o_c, stride_x_n, r1, r2, r3)
        if W > 3:
            e3 = _entry(p_x_req, a3, o_c, stride_x_n, r1, r2, r3)
        y = _conv_token(x_t, e1, e2, e3, w1, w2, w3, w4, bias, W)
        if STEP_CONV:
            _store_window(p_scs_t, o_c, x_t, e1, e2, live, stride_scs_c, stride_scs_w, W)
    else:
        y = x_t.to(tl.float32)
    return y


@triton.jit
def kda_verify_kernel(
    p_x, p_cw, p_cb, p_cs, p_a, p_fa, p_fbw, p_b, p_A_log, p_dt_bias, p_state, p_si, p_qsl, p_nacc,
    p_ss, p_ssi, p_scs, p_par, p_gate, p_nw, p_out,
    N, num_slots, num_rows, scale, lower_bound, norm_eps,
    stride_x_n, stride_cw_c, stride_cw_w, stride_cs_slot, stride_cs_c, stride_cs_w,
    stride_a_n, stride_fa_n, stride_fbw_h, stride_fbw_k, stride_b_n, stride_b_h,
    stride_s_slot, stride_si_b, stride_si_t, stride_qsl, stride_nacc,
    stride_ss_row, stride_ss_t, stride_ssi, stride_scs_row, stride_scs_t, stride_scs_c, stride_scs_w,
    stride_par_b, stride_par_t, stride_g_n, stride_g_h, stride_o_n, stride_o_h,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
    R: tl.constexpr, BR: tl.constexpr, RC: tl.constexpr,
    HAS_CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_FB: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, SLOT_FORM: tl.constexpr, HAS_PARENTS: tl.constexpr,
    HAS_QSL: tl.constexpr, HAS_NACC: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)

    # The request's rows: T_b clamped to [0, T] and to the rows of x (device data never addresses past them).
    if HAS_QSL:
        r0 = tl.load(p_qsl + i_n * stride_qsl).to(tl.int64)
        r1 = tl.load(p_qsl + (i_n + 1) * stride_qsl).to(tl.int64)
        Tn = tl.minimum(tl.maximum(r1 - r0, 0), T)
        Tn = tl.where(r0 < 0, 0, tl.maximum(tl.minimum(Tn, N - r0), 0))
        r0 = tl.where(r0 < 0, 0, r0)
    else:
        r0 = i_n * T
        Tn = tl.minimum(T, N - r0)

    # Where the committed state and window come from; padding requests are masked off everywhere.
    if SLOT_FORM:
        if HAS_NACC:
            acc = tl.load(p_nacc + i_n * stride_nacc).to(tl.int64)
        else:
            acc = tl.full([], 1, tl.int64)
        ok = (acc >= 1) & (acc <= T)
        acc = tl.where(ok, acc, 1)
        s_read = tl.load(p_si + i_n * stride_si_b + (acc - 1) * stride_si_t).to(tl.int64)
        s_conv = tl.load(p_si + i_n * stride_si_b).to(tl.int64)
        live = ok & (s_read >= 0) & (s_read < num_slots)
        if HAS_CONV:
            live = live & (s_conv >= 0) & (s_conv < num_slots)
        offset = acc - 1
        row = tl.full([], 0, tl.int64)
    else:
        s_read = tl.load(p_si + i_n * stride_si_b).to(tl.int64)
        s_conv = s_read
        row = tl.load(p_ssi + i_n * stride_ssi).to(tl.int64)
        live = (s_read >= 0) & (s_read < num_slots) & (row >= 0) & (row < num_rows)
        offset = tl.full([], 0, tl.int64)
    s_read = tl.where(live, s_read, 0)
    s_conv = tl.where(live, s_conv, 0)
    row = tl.where(live, row, 0)

    o_tile = i_h * (V * K) + o_v[:, None] * K + o_k[None, :]
    b_S = tl.load(p_state + s_read * stride_s_slot + o_tile, mask=live, other=0.0).to(tl.float32)

    o_q = i_h * K + o_k
    o_kc = H * K + i_h * K + o_k
    o_vc = 2 * H * K + i_h * V + o_v
    p_cs_slot = p_cs + s_conv * stride_cs_slot
    if HAS_CONV:
        q1, q2, q3 = _load_window(p_cs_slot, o_q, offset, live, stride_cs_c, stride_cs_w, W)
        k1, k2, k3 = _load_window(p_cs_slot, o_kc, offset, live, stride_cs_c, stride_cs_w, W)
        v1, v2, v3 = _load_window(p_cs_slot, o_vc, offset, live, stride_cs_c, stride_cs_w, W)
        # loaded once: the taps stay in registers across the tokens
        qw1, qw2, qw3, qw4, qb = _load_weights(p_cw, p_cb, o_q, stride_cw_c, stride_cw_w, W, HAS_BIAS)
        kw1, kw2, kw3, kw4, kb = _load_weights(p_cw, p_cb, o_kc, stride_cw_c, stride_cw_w, W, HAS_BIAS)
        vw1, vw2, vw3, vw4, vb = _load_weights(p_cw, p_cb, o_vc, stride_cw_c, stride_cw_w, W, HAS_BIAS)
    else:
        q1 = tl.zeros([K], dtype=tl.bfloat16)
        q2 = q1
        q3 = q1
        k1 = q1
        k2 = q1
        k3 = q1
        v1 = tl.zeros([V], dtype=tl.bfloat16)
        v2 = v1
        v3 = v1
        qw1 = tl.zeros([K], dtype=tl.float32)
        qw2 = qw1
        qw3 = qw1
        qw4 = qw1
        qb = qw1
        kw1 = qw1
        kw2 = qw1
        kw3 = qw1
        kw4 = qw1
        kb = qw1
        vw1 = tl.zeros([V], dtype=tl.float32)
        vw2 = vw1
        vw3 = vw1
        vw4 = vw1
        vb = vw1

    b_A = tl.exp(tl.load(p_A_log + i_h))
    b_dtb = tl.load(p_dt_bias + i_h * K + o_k)
    if HAS_NORM:
        b_w = tl.load(p_nw + o_v).to(tl.float32)

    # Every thread has read the committed caches before any thread of this program writes one.
    tl.debug_barrier()

    p_x_req = p_x + r0 * stride_x_n
    p_par_row = p_par + i_n * stride_par_b
    p_ss_row = p_ss + row * stride_ss_row
    p_scs_row = p_scs + row * stride_scs_row
    STEP_CONV: tl.constexpr = HAS_CONV and not SLOT_FORM
    for t in range(0, Tn):
        p_x_t = p_x_req + t * stride_x_n
        i_r = r0 + t
        a1 = _parent(p_par_row, t, stride_par_t, HAS_PARENTS)
        a2 = _parent(p_par_row, a1, stride_par_t, HAS_PARENTS)
        a3 = _parent(p_par_row, a2, stride_par_t, HAS_PARENTS)
        if HAS_PARENTS:
            # a tree token whose parent is not the previous token continues from the parent's stored state
            far = (t > 0) & (a1 != t - 1)
            b_P = tl.load(p_ss_row + tl.maximum(a1, 0) * stride_ss_t + o_tile, mask=live & far, other=0.0)
            b_S = tl.where(far, b_P.to(tl.float32), b_S)
        p_scs_t = p_scs_row + t * stride_scs_t
        b_q = _group(p_x_req, p_x_t, o_q, a1, a2, a3, q1, q2, q3, qw1, qw2, qw3, qw4, qb, p_scs_t, live,
                     stride_x_n, stride_scs_c, stride_scs_w, W, HAS_CONV, STEP_CONV)
        b_k = _group(p_x_req, p_x_t, o_kc, a1, a2, a3, k1, k2, k3, kw1, kw2, kw3, kw4, kb, p_scs_t, live,
                     stride_x_n, stride_scs_c, stride_scs_w, W, HAS_CONV, STEP_CONV)
        b_v = _group(p_x_req, p_x_t, o_vc, a1, a2, a3, v1, v2, v3, vw1, vw2, vw3, vw4, vb, p_scs_t, live,
                     stride_x_n, stride_scs_c, stride_scs_w, W, HAS_CONV, STEP_CONV)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)

        if HAS_FB:
            b_a = tl.zeros([K], dtype=tl.float32)
            for r_0 in tl.static_range(0, BR, RC):
                o_r = r_0 + tl.arange(0, RC)
                m_r = o_r < R
                b_fa = tl.load(p_fa + i_r * stride_fa_n + o_r, mask=m_r, other=0.0).to(tl.float32)
                p_fbw_t = p_fbw + i_h * stride_fbw_h + o_k[:, None] * stride_fbw_k + o_r[None, :]
                b_fbw = tl.load(p_fbw_t, mask=m_r[None, :], other=0.0).to(tl.float32)
                b_a += tl.sum(b_fbw * b_fa[None, :], 1)
        else:
            b_a = tl.load(p_a + i_r * stride_a_n + i_h * K + o_k).to(tl.float32)
        b_z = b_a + b_dtb
        if USE_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(b_A * b_z)
        else:
            # log1p(exp(z)) to a few ulps (as the decode kernel): log(1 + e) loses e below FP32's epsilon
            b_e = tl.exp(b_z)
            b_u = 1.0 + b_e
            b_d = b_u - 1.0
            b_sp = tl.where(b_d == 0.0, b_e, tl.log(b_u) * (b_e / tl.where(b_d == 0.0, 1.0, b_d)))
            b_g = -b_A * tl.where(b_z > 20.0, b_z, b_sp)
        b_beta = tl.sigmoid(tl.load(p_b + i_r * stride_b_n + i_h.to(tl.int64) * stride_b_h).to(tl.float32))

        b_S = b_S * tl.exp(b_g)[None, :]
        b_vnew = b_beta * (b_v - tl.sum(b_S * b_k[None, :], 1))
        b_S = b_S + b_vnew[:, None] * b_k[None, :]
        b_o = tl.sum(b_S * b_q[None, :], 1)
        b_Sq = b_S.to(p_state.dtype.element_ty)
        b_S = b_Sq.to(tl.float32)  # the next token starts from what a decode step would have stored

        if SLOT_FORM:
            dst = tl.load(p_si + i_n * stride_si_b + t * stride_si_t).to(tl.int64)
            m_dst = live & (dst >= 0) & (dst < num_slots)
            tl.store(p_state + tl.where(m_dst, dst, 0) * stride_s_slot + o_tile, b_Sq, mask=m_dst)
            if HAS_CONV:
                # the slot's window moves: position W-2+t holds x_t (positions below: after the loop)
                p_cs_t = p_cs_slot + (W - 2 + t) * stride_cs_w
                tl.store(p_cs_t + o_q * stride_cs_c, tl.load(p_x_t + o_q), mask=live)
                tl.store(p_cs_t + o_kc * stride_cs_c, tl.load(p_x_t + o_kc), mask=live)
                tl.store(p_cs_t + o_vc * stride_cs_c, tl.load(p_x_t + o_vc), mask=live)
        else:
            tl.store(p_ss_row + t * stride_ss_t + o_tile, b_Sq, mask=live)

        if HAS_NORM:
            b_rstd = tl.rsqrt(tl.sum(b_o * b_o, 0) / V + norm_eps)
            b_gate = tl.load(p_gate + i_r * stride_g_n + i_h * stride_g_h + o_v).to(tl.float32)
            b_o = b_o * b_rstd * b_w * tl.sigmoid(b_gate)
        tl.store(p_out + i_r * stride_o_n + i_h * stride_o_h + o_v, tl.where(live, b_o, 0.0).to(
            p_out.dtype.element_ty))
        if HAS_PARENTS:
            tl.debug_barrier()  # this token's stored state is visible to every thread before a child reloads it

    if SLOT_FORM and HAS_CONV:
        # window[1:] of the committed window moves to positions 0 .. W-3
        if W > 2:
            tl.store(p_cs_slot + o_q * stride_cs_c + (W - 3) * stride_cs_w, q1, mask=live)
            tl.store(p_cs_slot + o_kc * stride_cs_c + (W - 3) * stride_cs_w, k1, mask=live)
            tl.store(p_cs_slot + o_vc * stride_cs_c + (W - 3) * stride_cs_w, v1, mask=live)
        if W > 3:
            tl.store(p_cs_slot + o_q * stride_cs_c, q2, mask=live)
            tl.store(p_cs_slot + o_kc * stride_cs_c, k2, mask=live)
            tl.store(p_cs_slot + o_vc * stride_cs_c, v2, mask=live)
