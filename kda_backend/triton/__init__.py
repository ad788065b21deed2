"""Triton implementation of the fused KDA decode step (one launch per call).

The public entry points are ``kda_backend.kda_decode(..., backend="triton")`` (or the
``kda_decode_triton`` alias). Triton itself is imported on first launch, so importing this package
never needs Triton.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

from backend_core import platform
from ..contract import KDAProblem

__all__ = ["available", "supports", "run", "launch_config"]

SUPPORTED_HEAD_DIMS = (32, 64, 128)
MAX_F_B_RANK = 256


def available() -> Tuple[bool, str]:
    if not platform.triton_available():
        return False, "triton is not installed (pip install 'flydsl-backends[triton]')"
    if platform.has_gpu():
        return True, "triton installed, GPU present"
    if platform.triton_interpreter_enabled():
        return True, "triton installed, TRITON_INTERPRET=1 (CPU tensors, interpreted: slow, for tests)"
    return False, "no CUDA/ROCm GPU visible to torch (set TRITON_INTERPRET=1 to run the kernel on CPU tensors)"


def supports(p: KDAProblem) -> Tuple[bool, str]:
    dev = p.device
    if dev.type == "cpu" and not platform.triton_interpreter_enabled():
        return False, "CPU tensors need TRITON_INTERPRET=1"
    if dev.type not in ("cpu", "cuda"):
        return False, f"device type {dev.type!r} is not supported"
    if p.K not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim K=V={p.K} not in {SUPPORTED_HEAD_DIMS}"
    if p.has_conv and not 2 <= p.W <= 4:
        return False, f"conv width W={p.W} not in 2..4"
    if p.has_f_b and p.R > MAX_F_B_RANK:
        return False, f"f_b rank R={p.R} > {MAX_F_B_RANK}"
    if p.H > 65535:
        return False, f"H={p.H} exceeds the grid's second dimension (65535)"
    return True, "ok"


@functools.lru_cache(maxsize=1024)
def launch_config(K: int, R: int, state_dtype: torch.dtype) -> dict:
    """Compiled-specialization settings for a shape class (bounded LRU; scalars are not part of it)."""
    forced = os.environ.get("FLYDSL_BACKENDS_KDA_TRITON_WARPS")
    if forced:
        num_warps = int(forced)
    else:
        num_warps = {32: 2, 64: 4, 128: 8}[K]
    return {"num_warps": num_warps, "BR": max(16, 1 << (max(R, 1) - 1).bit_length())}


def run(p: KDAProblem) -> torch.Tensor:
    if p.B == 0:
        return p.out
    from .kda_decode import kda_decode_kernel  # imports triton

    cfg = launch_config(p.K, p.R, p.state.dtype)
    dummy = p.x
    cw, cb, cs = p.conv_weight, p.conv_bias, p.conv_state
    gate, nw = p.output_gate, p.norm_weight
    kda_decode_kernel[(p.B, p.H)](
        p.x,
        cw if cw is not None else dummy,
        cb if cb is not None else dummy,
        cs if cs is not None else dummy,
        p.a if p.a is not None else dummy,
        p.f_a if p.f_a is not None else dummy,
        p.f_b_weight if p.f_b_weight is not None else dummy,
        p.b, p.A_log, p.dt_bias, p.state, p.state_indices,
        gate if gate is not None else dummy,
        nw if nw is not None else dummy,
        p.out,
        p.num_slots, p.scale, p.lower_bound if p.lower_bound is not None else 0.0, p.norm_eps,
        p.x.stride(0),
        cw.stride(0) if cw is not None else 0, cw.stride(1) if cw is not None else 0,
        cs.stride(0) if cs is not None else 0, cs.stride(1) if cs is not None else 0,
        cs.stride(2) if cs is not None else 0,
        p.a.stride(0) if p.a is not None else 0,
        p.f_a.stride(0) if p.f_a is not None else 0,
        p.f_b_weight.stride(0) if p.f_b_weight is not None else 0,
        p.f_b_weight.stride(1) if p.f_b_weight is not None else 0,
        p.b.stride(0), p.b.stride(1), p.state.stride(0), p.state_indices.stride(0),
        gate.stride(0) if gate is not None else 0, gate.stride(1) if gate is not None else 0,
        p.out.stride(0), p.out.stride(1),
        H=p.H, K=p.K, V=p.V, W=max(p.W, 2), R=max(p.R, 1), BR=cfg["BR"],
        HAS_CONV=p.has_conv, HAS_BIAS=p.conv_bias is not None, HAS_FB=p.has_f_b, HAS_NORM=p.has_norm,
        USE_LOWER_BOUND=p.lower_bound is not None,
        num_warps=cfg["num_warps"],
    )
    return p.out
