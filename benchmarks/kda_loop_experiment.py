"""Experiment (not shipped): one program per (row, head) looping over V-blocks of BV rows.

Compares against the shipped kernel on the benchmark shapes. Run on the GPU from the repo root.
"""
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from kda_backend.benchmark import TOUCH_BYTES, step_bytes  # noqa: E402
from kda_backend.testing import make_case, clone_caches, compare_runs  # noqa: E402
from kda_backend.reference import run_reference  # noqa: E402
from kda_backend.triton.kda_decode import _conv_channels, _conv_shift  # noqa: E402


@triton.jit
def loop_kernel(p_x, p_cw, p_cs, p_a, p_b, p_A_log, p_dt_bias, p_state, p_idx, p_gate, p_nw, p_out, p_ows,
                num_slots, scale, norm_eps, stride_x_n, stride_cw_c, stride_cw_w, stride_cs_slot, stride_cs_c,
                stride_cs_w, stride_a_n, stride_b_n, stride_b_h, stride_s_slot, stride_g_n, stride_g_h,
                stride_o_n, stride_o_h,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
                STAGES: tl.constexpr):
    NB: tl.constexpr = V // BV
    i_h = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, K)
    s = tl.load(p_idx + i_n).to(tl.int64)
    live = (s >= 0) & (s < num_slots)
    s = tl.where(live, s, 0)
    p_x_row = p_x + i_n * stride_x_n
    p_cs_slot = p_cs + s * stride_cs_slot
    o_q = i_h * K + o_k
    o_kc = H * K + i_h * K + o_k
    b_q, x_q, q_s1, q_s2 = _conv_channels(p_x_row, p_cw, p_cw, p_cs_slot, o_q, live, stride_cw_c, stride_cw_w,
                                          stride_cs_c, stride_cs_w, W, False)
    b_k, x_k, k_s1, k_s2 = _conv_channels(p_x_row, p_cw, p_cw, p_cs_slot, o_kc, live, stride_cw_c, stride_cw_w,
                                          stride_cs_c, stride_cs_w, W, False)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_a = tl.load(p_a + i_n * stride_a_n + i_h * K + o_k).to(tl.float32)
    b_z = b_a + tl.load(p_dt_bias + i_h * K + o_k)
    b_A = tl.exp(tl.load(p_A_log + i_h))
    b_decay = tl.exp(-b_A * tl.where(b_z > 20.0, b_z, tl.log(1.0 + tl.exp(b_z))))
    b_beta = tl.sigmoid(tl.load(p_b + i_n * stride_b_n + i_h * stride_b_h).to(tl.float32))
    p_ows_row = p_ows + (i_n * H + i_h) * V
    sumsq = 0.0
    for j in tl.range(0, NB, num_stages=STAGES):
        o_v = j * BV + tl.arange(0, BV)
        p_S = p_state + s * stride_s_slot + i_h * (V * K) + o_v[:, None] * K + o_k[None, :]
        b_S = tl.load(p_S, mask=live, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o_vc = 2 * H * K + i_h * V + o_v
        b_v, x_v, v_s1, v_s2 = _conv_channels(p_x_row, p_cw, p_cw, p_cs_slot, o_vc, live, stride_cw_c, stride_cw_w,
                                              stride_cs_c, stride_cs_w, W, False)
        b_S = b_S * b_decay[None, :]
        b_vnew = b_beta * (b_v - tl.sum(b_S * b_k[None, :], 1))
        b_S = b_S + b_vnew[:, None] * b_k[None, :]
        b_o = tl.sum(b_S * b_q[None, :], 1)
        tl.store(p_S, b_S.to(p_state.dtype.element_ty), mask=live, eviction_policy="evict_first")
        tl.store(p_ows_row + o_v, b_o)
        sumsq += tl.sum(b_o * b_o, 0)
    tl.debug_barrier()
    o_all = tl.arange(0, V)
    o_vall = 2 * H * K + i_h * V + o_all
    b_v, x_v, v_s1, v_s2 = _conv_channels(p_x_row, p_cw, p_cw, p_cs_slot, o_vall, live, stride_cw_c, stride_cw_w,
                                          stride_cs_c, stride_cs_w, W, False)
    tl.debug_barrier()
    _conv_shift(p_cs_slot, o_q, x_q, q_s1, q_s2, live, stride_cs_c, stride_cs_w, W)
    _conv_shift(p_cs_slot, o_kc, x_k, k_s1, k_s2, live, stride_cs_c, stride_cs_w, W)
    _conv_shift(p_cs_slot, o_vall, x_v, v_s1, v_s2, live, stride_cs_c, stride_cs_w, W)
    b_o = tl.load(p_ows_row + o_all)
    b_rstd = tl.rsqrt(sumsq / V + norm_eps)
    b_g = tl.load(p_gate + i_n * stride_g_n + i_h * stride_g_h + o_all).to(tl.float32)
    b_w = tl.load(p_nw + o_all).to(tl.float32)
    b_y = b_o * b_rstd * b_w * tl.sigmoid(b_g)
    tl.store(p_out + i_n * stride_o_n + i_h * stride_o_h + o_all, tl.where(live, b_y, 0.0).to(p_out.dtype.element_ty))


def run_loop(case, ws, BV, warps, stages):
    p = case.problem()
    cw, cs = p.conv_weight, p.conv_state
    loop_kernel[(p.H, p.B)](p.x, cw, cs, p.a, p.b, p.A_log, p.dt_bias, p.state, p.state_indices, p.output_gate,
                            p.norm_weight, p.out, ws, p.num_slots, p.scale, p.norm_eps, p.x.stride(0), cw.stride(0),
                            cw.stride(1), cs.stride(0), cs.stride(1), cs.stride(2), p.a.stride(0), p.b.stride(0),
                            p.b.stride(1), p.state.stride(0), p.output_gate.stride(0), p.output_gate.stride(1),
                            p.out.stride(0), p.out.stride(1), H=p.H, K=p.K, V=p.V, BV=BV, W=p.W, STAGES=stages,
                            num_warps=warps)


H, K, W = 12, 128, 4
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
# correctness first
c = make_case(33, H, K, W, padding=[3], device="cuda", seed=1)
ref, t = clone_caches(c), clone_caches(c)
run_reference(ref.problem(), compute_dtype=torch.float64)
ws = torch.empty(1024 * H * K, device="cuda")
run_loop(t, ws, 32, 4, 2)
print("correct:", compare_runs(t, ref, c, out_tol=1e-2, state_tol=1e-4))
for state_dtype in (torch.float32, torch.bfloat16):
    elt = torch.empty((), dtype=state_dtype).element_size()
    for B in (32, 128):
        n_sets = max(2, min(64, math.ceil(TOUCH_BYTES / (B * H * K * K * elt))))
        sets = [make_case(B, H, K, W, slots=B, state_dtype=state_dtype, device="cuda", seed=s, state_scale=0.1)
                for s in range(n_sets)]
        floor = step_bytes(B, H, K, W, elt, False, K) / (copy * 1e9) * 1e6
        base = time_cuda_graph(lambda i: sets[i % n_sets].call("triton"), inner=max(n_sets, 16), trials=30).median_us
        res = []
        for bv in (16, 32, 64):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    t = time_cuda_graph(lambda i: run_loop(sets[i % n_sets], ws, bv, warps, stages),
                                        inner=max(n_sets, 16), trials=30)
                    res.append((t.median_us, bv, warps, stages))
        res.sort()
        print(f"{str(state_dtype)[6:]:>8} B={B:>3} floor {floor:6.2f} shipped {base:6.2f} | " +
              ", ".join(f"BV={bv}/w{w}/s{st}: {us:.2f}" for us, bv, w, st in res[:5]), flush=True)
