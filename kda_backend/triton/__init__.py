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
    if p.H > 65535 or p.B > 65535:
        return False, f"B={p.B}, H={p.H}: the grid's second and third dimensions stop at 65535"
    return True, "ok"


@functools.lru_cache(maxsize=1024)
def launch_config(K: int, R: int, state_dtype: torch.dtype, has_f_b: bool) -> dict:
    """Compiled-specialization settings for a shape class (bounded LRU; scalars are not part of it).

    BV (state rows per program) and num_warps; FLYDSL_BACKENDS_KDA_TRITON_BV / _WARPS override
    them for tuning sweeps (call ``launch_config.cache_clear()`` after changing them).
    """
    bv, warps = DEFAULTS.get((K, has_f_b), (min(K, 32), 4))
    bv = int(os.environ.get("FLYDSL_BACKENDS_KDA_TRITON_BV", bv))
    warps = int(os.environ.get("FLYDSL_BACKENDS_KDA_TRITON_WARPS", warps))
    if bv < 1 or K % bv or bv & (bv - 1):
        raise ValueError(f"FLYDSL_BACKENDS_KDA_TRITON_BV={bv}: expected a power of two dividing V={K}")
    return {"BV": bv, "num_warps": warps, "BR": max(16, 1 << (max(R, 1) - 1).bit_length())}


# (K, f_b) -> (BV, num_warps); measured on an H200 (benchmarks/results/).
DEFAULTS = {
    (32, False): (32, 2), (32, True): (32, 2),
    (64, False): (32, 4), (64, True): (32, 4),
    (128, False): (32, 4), (128, True): (32, 4),
}


class _Workspace:
    """Per (device, stream) scratch for the last-program protocol: zeroed counters, FP32 o rows.

    Sized once (grown only outside CUDA-graph capture), so a captured launch always sees the same
    buffers; the kernel leaves the counters at zero after every launch.
    """

    MIN_PAIRS = 32768

    def __init__(self):
        self._by_key = {}

    def get(self, device: torch.device, pairs: int, V: int):
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream)
        ws = self._by_key.get(key)
        if ws is None or ws[0].numel() < pairs or ws[1].numel() < pairs * V:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    f"state_indices: batch x heads = {pairs} exceeds the KDA workspace "
                    f"({0 if ws is None else ws[0].numel()} pairs) during CUDA-graph capture; run one eager step "
                    "at the largest batch size before capturing")
            n = max(pairs, self.MIN_PAIRS, 0 if ws is None else ws[0].numel())
            ws = (torch.zeros(n, dtype=torch.int32, device=device), torch.empty(n * V, dtype=torch.float32, device=device))
            self._by_key[key] = ws
        return ws


WORKSPACE = _Workspace()


def run(p: KDAProblem) -> torch.Tensor:
    if p.B == 0:
        return p.out
    from .kda_decode import kda_decode_kernel  # imports triton

    cfg = launch_config(p.K, p.R, p.state.dtype, p.has_f_b)
    bv = cfg["BV"]
    nv = p.V // bv
    dummy = p.x
    if nv > 1 and (p.has_conv or p.has_norm):
        cnt, ows = WORKSPACE.get(p.device, p.B * p.H, p.V)
    else:
        cnt, ows = dummy, dummy
    cw, cb, cs = p.conv_weight, p.conv_bias, p.conv_state
    gate, nw = p.output_gate, p.norm_weight
    kda_decode_kernel[(nv, p.H, p.B)](
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
        p.out, cnt, ows,
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
        H=p.H, K=p.K, V=p.V, BV=bv, W=max(p.W, 2), R=max(p.R, 1), BR=cfg["BR"],
        HAS_CONV=p.has_conv, HAS_BIAS=p.conv_bias is not None, HAS_FB=p.has_f_b, HAS_NORM=p.has_norm,
        USE_LOWER_BOUND=p.lower_bound is not None,
        num_warps=cfg["num_warps"],
    )
    return p.out
