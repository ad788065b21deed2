"""Resource report of the Triton KDA kernel compiled ahead of time for sm_90 and for AMD gfx942 /
gfx950 (no GPU needed).

The runtime's specialization is imitated (16-byte divisible pointers and strides, unit strides
folded to constants) so the numbers match what the JIT builds on the device.
"""

from __future__ import annotations

import inspect
from typing import Dict

from backend_core.tests.aot import amdgcn_report as _amdgcn_report
from backend_core.tests.aot import ptxas_report as _ptxas_report

__all__ = ["ptxas_report", "amdgcn_report", "SHIPPED_CONFIGS", "VERIFY_CONFIGS", "verify_ptxas_report",
           "verify_amdgcn_report"]

# (state dtype, f_b, BV, warps): what launch_config picks for K = V = 128 on a 132-SM GPU.
SHIPPED_CONFIGS = [(dt, fb, bv, 4) for dt in ("fp32", "bf16")
                   for fb, bvs in ((False, (16, 32, 64, 128)), (True, (128,)))
                   for bv in bvs]

UNIT_STRIDES = ("stride_cs_c", "stride_cw_w", "stride_b_h", "stride_state_indices")
FP32_POINTERS = ("p_cw", "p_cb", "p_A_log", "p_dt_bias", "p_ows")


def ptxas_report(state_dtype: str = "fp32", with_f_b: bool = False, BV: int = 128, num_warps: int = 4,
                 K: int = 128, H: int = 12, W: int = 4) -> Dict[str, int]:
    """Registers / spills / stack of one specialization (conv and norm stages on), sm_90."""
    fn, types, constexprs, divisible = _spec(state_dtype, with_f_b, BV, K, H, W)
    return _ptxas_report(fn, types, constexprs, divisible, num_warps)


def amdgcn_report(arch: str = "gfx942", state_dtype: str = "fp32", with_f_b: bool = False, BV: int = 128,
                  num_warps: int = 4, K: int = 128, H: int = 12, W: int = 4) -> Dict[str, int]:
    """VGPRs / scratch / LDS of the same specialization compiled for AMD ``arch`` (never run there)."""
    fn, types, constexprs, divisible = _spec(state_dtype, with_f_b, BV, K, H, W)
    return _amdgcn_report(fn, types, constexprs, divisible, num_warps, arch=arch)


def _spec(state_dtype, with_f_b, BV, K, H, W):
    from kda_backend.triton.kda_decode import kda_decode_kernel

    types = {}
    for n in inspect.signature(kda_decode_kernel.fn).parameters:
        if n == "p_state":
            types[n] = "*fp32" if state_dtype == "fp32" else "*bf16"
        elif n in ("p_state_indices", "p_cnt"):
            types[n] = "*i32"
        elif n.startswith("p_"):
            types[n] = "*fp32" if n in FP32_POINTERS else "*bf16"
        elif n in ("scale", "lower_bound", "norm_eps"):
            types[n] = "fp32"
        elif n.startswith("stride_") or n == "num_slots":
            types[n] = "i32"
    constexprs = dict(H=H, K=K, V=K, BV=BV, W=W, R=K, BR=K, RC=32, HAS_CONV=True, HAS_BIAS=False, HAS_FB=with_f_b,
                      HAS_NORM=True, USE_LOWER_BOUND=with_f_b, **{n: 1 for n in UNIT_STRIDES})
    divisible = [n for n in types if n.startswith(("p_", "stride_"))]
    return kda_decode_kernel, types, constexprs, divisible


# (state dtype, slot form, tree, f_b, warps): the verify kernel at K = V = 128 as run_verify launches it.
VERIFY_CONFIGS = [("fp32", True, False, True, 4), ("bf16", True, False, True, 4), ("fp32", False, True, False, 4),
                  ("bf16", False, True, True, 4)]


def verify_ptxas_report(state_dtype: str = "fp32", slot_form: bool = True, tree: bool = False, with_f_b: bool = False,
                        num_warps: int = 4, K: int = 128, H: int = 96, T: int = 4, W: int = 4,
                        num_stages: int = 1) -> Dict[str, int]:
    """Registers / spills / stack of one ``kda_verify_kernel`` specialization (conv and norm on), sm_90."""
    fn, types, constexprs, divisible = _verify_spec(state_dtype, slot_form, tree, with_f_b, K, H, T, W)
    return _ptxas_report(fn, types, constexprs, divisible, num_warps, num_stages=num_stages)


def verify_amdgcn_report(arch: str = "gfx942", state_dtype: str = "fp32", slot_form: bool = True, tree: bool = False,
                         with_f_b: bool = False, num_warps: int = 4, K: int = 128, H: int = 96, T: int = 4,
                         W: int = 4) -> Dict[str, int]:
    """VGPRs / scratch / LDS of the same verify specialization compiled for AMD ``arch`` (never run there)."""
    fn, types, constexprs, divisible = _verify_spec(state_dtype, slot_form, tree, with_f_b, K, H, T, W)
    return _amdgcn_report(fn, types, constexprs, divisible, num_warps, arch=arch)


def _verify_spec(state_dtype, slot_form, tree, with_f_b, K, H, T, W):
    from kda_backend.triton.kda_verify import kda_verify_kernel

    types = {}
    for n in inspect.signature(kda_verify_kernel.fn).parameters:
        if n in ("p_state", "p_ss"):
            types[n] = "*fp32" if state_dtype == "fp32" else "*bf16"
        elif n in ("p_si", "p_qsl", "p_nacc", "p_ssi", "p_par"):
            types[n] = "*i32"
        elif n.startswith("p_"):
            types[n] = "*fp32" if n in FP32_POINTERS else "*bf16"
        elif n in ("scale", "lower_bound", "norm_eps"):
            types[n] = "fp32"
        elif n.startswith("stride_") or n in ("N", "num_slots", "num_rows"):
            types[n] = "i32"
    constexprs = dict(H=H, K=K, V=K, T=T, W=W, R=K, BR=K, RC=32, HAS_CONV=True, HAS_BIAS=False, HAS_FB=with_f_b,
                      HAS_NORM=True, USE_LOWER_BOUND=with_f_b, SLOT_FORM=slot_form, HAS_PARENTS=tree, HAS_QSL=True,
                      HAS_NACC=slot_form)
    divisible = [n for n in types if n.startswith(("p_", "stride_"))]
    return kda_verify_kernel, types, constexprs, divisible
