"""Triton implementation of the fused KDA decode step (one launch per call).

The public entry points are ``kda_backend.kda_decode(..., backend="triton")`` (or the
``kda_decode_triton`` alias). Triton itself is imported on first launch, so importing this package
never needs Triton.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Tuple

import torch

from backend_core import platform
from backend_core.buffers import DeviceBuffers
from backend_core.launch import launch
from backend_core.validation import env_positive_int

if TYPE_CHECKING:  # annotations only (the contract imports the registry, which imports this)
    from ..contract import KDAProblem
    from ..verify_contract import KDAVerifyProblem

__all__ = ["available", "supports", "run", "launch_config", "supports_verify", "run_verify"]

SUPPORTED_HEAD_DIMS = (32, 64, 128)
MAX_F_B_RANK = 256


def available() -> Tuple[bool, str]:
    return platform.triton_runnable()


def _supports_layer(p) -> Tuple[bool, str]:
    """What the decode and verify kernels both need: the device, K, the conv width, the f_b rank."""
    ok, why = platform.triton_device_ok(p.device)
    if not ok:
        return ok, why
    if p.K not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim K=V={p.K} not in {SUPPORTED_HEAD_DIMS}"
    if p.has_conv and not 2 <= p.W <= 4:
        return False, f"conv width W={p.W} not in 2..4"
    if p.has_f_b and p.R > MAX_F_B_RANK:
        return False, f"f_b rank R={p.R} > {MAX_F_B_RANK}"
    return True, ""


def supports(p: KDAProblem) -> Tuple[bool, str]:
    ok, why = _supports_layer(p)
    if not ok:
        return ok, why
    if p.H > 65535 or p.B > 65535:
        return False, f"B={p.B}, H={p.H}: the grid's second and third dimensions stop at 65535"
    return True, "ok"


def check_environment() -> None:
    """Parse the tuning variables now (the CLI checks them up front): ValueError naming the first malformed one.
    Whether a BV divides a layer's V is checked at that layer's first call."""
    for name in ("FLYDSL_BACKENDS_KDA_TRITON_BV", "FLYDSL_BACKENDS_KDA_TRITON_WARPS"):
        env_positive_int(name, 1, power_of_two=True)


@functools.lru_cache(maxsize=1024)
def launch_config(K: int, R: int, has_f_b: bool, pairs_class: int, sms: int) -> dict:
    """Compiled-specialization settings for a shape class (bounded LRU; scalars are not part of it).

    BV (state rows per program): programs per (row, head) NV = V / BV is the smallest power of two
    that gives >= 2 programs per SM, capped at V / 16, because a small batch leaves most SMs idle
    otherwise; the f_b variant never splits, because every program would re-form the projection
    (measured: few (row, head) pairs run best at BV = 16 without f_b and at BV = V with it; many pairs
    at BV = V, one program per (row, head), 4 warps). ``pairs_class`` is B*H rounded
    up to a power of two, so the cache key stays small. FLYDSL_BACKENDS_KDA_TRITON_BV / _WARPS
    override both for tuning sweeps (call ``launch_config.cache_clear()`` after changing them).
    """
    nv = 1
    # The f_b variant re-forms the [K, R] projection in every program, so it does not split.
    while not has_f_b and pairs_class * nv < 2 * max(sms, 1) and K // (2 * nv) >= 16:
        nv *= 2
    bv = env_positive_int("FLYDSL_BACKENDS_KDA_TRITON_BV", K // nv, power_of_two=True)
    warps = env_positive_int("FLYDSL_BACKENDS_KDA_TRITON_WARPS", 2 if K <= 32 else 4, power_of_two=True)
    if K % bv:
        raise ValueError(f"FLYDSL_BACKENDS_KDA_TRITON_BV={bv}: expected a power of two dividing V={K}")
    br = max(16, 1 << (max(R, 1) - 1).bit_length())
    return {"BV": bv, "num_warps": warps, "BR": br, "RC": min(br, 32)}


MAX_SPLIT_PAIRS = 4096


class _Workspace:
    """Per-device scratch for the last-program protocol: zeroed counters and FP32 o rows
    (``backend_core.buffers.DeviceBuffers``: grow-only, outgrown sets kept alive for captured graphs,
    growth inside CUDA-graph capture raises because the counters must start zeroed).

    Only launches that split V use it, and the launch policy splits only when B*H is small (a few
    programs per SM), so a first allocation of MAX_SPLIT_PAIRS (row, head) pairs suffices. The
    kernel leaves the counters at zero after every launch, so CUDA graphs replay. Launches that
    split V must not run concurrently on two streams of one device (they share the counters).
    """

    def __init__(self):
        self.buffers = DeviceBuffers("KDA Triton workspace", [(torch.int32, True), (torch.float32, False)])

    def get(self, device: torch.device, pairs: int, V: int):
        return self.buffers.get(device, (pairs, pairs * V), minimum=(MAX_SPLIT_PAIRS, MAX_SPLIT_PAIRS * max(V, 128)))


WORKSPACE = _Workspace()


def run(p: KDAProblem) -> torch.Tensor:
    if p.B == 0:
        return p.out
    from .kda_decode import kda_decode_kernel  # imports triton

    pairs = p.B * p.H
    cfg = launch_config(p.K, p.R, p.has_f_b, 1 << (pairs - 1).bit_length(), platform.sm_count(p.device))
    bv = cfg["BV"]
    nv = p.V // bv
    if nv > 1 and pairs > MAX_SPLIT_PAIRS:
        bv, nv = p.V, 1  # an override asked for a split the workspace is not sized for
    dummy = p.x
    if nv > 1 and (p.has_conv or p.has_norm):
        cnt, ows = WORKSPACE.get(p.device, p.B * p.H, p.V)
    else:
        cnt, ows = dummy, dummy
    launch(
        kda_decode_kernel, (nv, p.H, p.B),
        *p.kernel_tensors(), cnt, ows, *p.kernel_scalars(), *p.kernel_strides(),
        H=p.H, K=p.K, V=p.V, BV=bv, W=max(p.W, 2), R=max(p.R, 1), BR=cfg["BR"], RC=cfg["RC"],
        HAS_CONV=p.has_conv, HAS_BIAS=p.conv_bias is not None, HAS_FB=p.has_f_b, HAS_NORM=p.has_norm,
        USE_LOWER_BOUND=p.lower_bound is not None,
        num_warps=cfg["num_warps"],
    )
    return p.out


def supports_verify(p: KDAVerifyProblem) -> Tuple[bool, str]:
    ok, why = _supports_layer(p)
    if not ok:
        return ok, why
    if p.B > 65535:
        return False, f"B={p.B}: the grid's second dimension stops at 65535"
    return True, "ok"


def run_verify(p: KDAVerifyProblem) -> torch.Tensor:
    """One launch, one program per (head, request) (kda_verify.py says why)."""
    if p.B == 0 or p.N == 0:
        return p.out
    from .kda_verify import kda_verify_kernel  # imports triton

    d = p.x

    def st(t, *dims):
        return [int(t.stride(i)) if t is not None else 0 for i in dims]

    br = max(16, 1 << (max(p.R, 1) - 1).bit_length())
    si2 = p.state_indices.dim() == 2
    launch(
        kda_verify_kernel, (p.H, p.B),
        *[t if t is not None else d for t in (
            p.x, p.conv_weight, p.conv_bias, p.conv_state, p.a, p.f_a, p.f_b_weight, p.b, p.A_log, p.dt_bias,
            p.state, p.state_indices, p.query_start_loc, p.num_accepted_tokens, p.step_state,
            p.step_state_indices, p.step_conv_state, p.parent_indices, p.output_gate, p.norm_weight, p.out)],
        int(p.N), int(p.num_slots), int(p.num_rows), float(p.scale),
        float(p.lower_bound if p.lower_bound is not None else 0.0), float(p.norm_eps),
        *st(p.x, 0), *st(p.conv_weight, 0, 1), *st(p.conv_state, 0, 1, 2),
        *st(p.a, 0), *st(p.f_a, 0), *st(p.f_b_weight, 0, 1), *st(p.b, 0, 1),
        *st(p.state, 0), int(p.state_indices.stride(0)), int(p.state_indices.stride(1)) if si2 else 0,
        *st(p.query_start_loc, 0), *st(p.num_accepted_tokens, 0),
        *st(p.step_state, 0, 1), *st(p.step_state_indices, 0), *st(p.step_conv_state, 0, 1, 2, 3),
        *st(p.parent_indices, 0, 1), *st(p.output_gate, 0, 1), *st(p.out, 0, 1),
        H=p.H, K=p.K, V=p.V, T=p.T, W=max(p.W, 2), R=max(p.R, 1), BR=br, RC=min(br, 32),
        HAS_CONV=p.has_conv, HAS_BIAS=p.conv_bias is not None, HAS_FB=p.has_f_b, HAS_NORM=p.has_norm,
        USE_LOWER_BOUND=p.lower_bound is not None, SLOT_FORM=p.slot_form, HAS_PARENTS=p.has_parents,
        HAS_QSL=p.query_start_loc is not None, HAS_NACC=p.num_accepted_tokens is not None,
        num_warps=4,  # 8 warps spill far more at K = 128 (the [K] vectors replicate across the tile's rows)
    )
    return p.out
