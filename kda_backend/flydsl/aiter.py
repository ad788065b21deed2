"""The project's KDA contract mapped onto AITER's FlyDSL KDA decode entry points (one adapter).

AITER (``aiter.ops.flydsl``, the "fused FlyDSL KDA decode kernels on gfx950" work) exposes
``flydsl_kda_decode``, ``flydsl_kda_decode_with_f_b`` and ``is_flydsl_kda_decode_supported(device)``.
The signature mapped here is the documented one, which SGLang 0.5.23 also vendors for the f_b form::

    flydsl_kda_decode_with_f_b(f_a, f_b_weight, x, conv_weight, conv_bias, conv_state, raw_beta, A_log,
                               dt_bias, lower_bound, state, state_indices, output_gate, norm_weight,
                               norm_eps, out=None) -> out [1, B, H, V]
    flydsl_kda_decode(x, conv_weight, conv_bias, conv_state, raw_a, raw_beta, A_log, dt_bias, lower_bound,
                      state, state_indices, output_gate, norm_weight, norm_eps, out=None)   (raw_a = a [B, H*K])

Status: these entry points are in no AITER code read so far (main, every branch and pull request);
the nearest, pull request 4495 (``flydsl_kimi_k3_kda_decode*``), has other
names and arguments and is not bound. ``find`` therefore reports AITER's KDA source unusable with such an
AITER, and the project's own kernel serves. The mapping below is checked against a stand-in of the documented
signature only.

Where the contracts differ:

* AITER's kernels are built for the Kimi-K3 TP8 layer only: H = 12, K = V = 128, W = 4, conv and
  gated norm fused, safe gate (``lower_bound``) required, no conv bias, default q scale, gfx950.
  Anything else is "not covered" (the project's own kernel or Triton serves it).
* ``raw_beta`` is [1, B, H] and ``out`` [1, B, H, V]: the adapter passes ``unsqueeze(0)`` views of
  ours, so AITER writes straight into the caller's ``out`` (through a contiguous temporary only
  when ``out`` has a heads-outer row layout).
* Padding: AITER zeroes the output of rows whose index is negative or past *its* cache and leaves
  the caches alone, as ours does; ours measures "past" against the smaller of the two caches, so
  when the state and conv caches have different slot counts the indices in between are mapped to
  -1 first (one elementwise op, no host sync).
* State: FP32, or BF16 when the entry point lists ``torch.bfloat16`` in its ``state_dtypes``
  attribute. Conv state: channel-major or SGLang's width-major ``transpose(-1, -2)`` view (both
  AITER's too).
"""

from __future__ import annotations

from typing import Tuple

import torch

from backend_core import flydsl_source

__all__ = ["ENTRY_POINTS", "find", "covers", "run"]

_COMMON = ("x", "conv_weight", "conv_bias", "conv_state", "raw_beta", "A_log", "dt_bias", "lower_bound", "state",
           "state_indices", "output_gate", "norm_weight", "norm_eps", "out")
ENTRY_POINTS = {
    "flydsl_kda_decode": ("raw_a",) + _COMMON,
    "flydsl_kda_decode_with_f_b": ("f_a", "f_b_weight") + _COMMON,
    "is_flydsl_kda_decode_supported": (),
}
AITER_H, AITER_K, AITER_W = 12, 128, 4


def find():
    return flydsl_source.find_aiter(ENTRY_POINTS)


def covers(p) -> Tuple[bool, str]:
    """Can AITER's entry points serve this validated ``KDAProblem``?"""
    fns, why = find()
    if fns is None:
        return False, why
    if (p.H, p.K, p.V) != (AITER_H, AITER_K, AITER_K):
        return False, f"AITER's kernel is built for H={AITER_H}, K=V={AITER_K} (got H={p.H}, K={p.K})"
    if not p.has_conv or p.W != AITER_W or p.conv_bias is not None:
        return False, f"AITER's kernel needs the fused conv stage with W={AITER_W} and no conv bias"
    if not p.has_norm:
        return False, "AITER's kernel always applies the gated RMSNorm (call has output_gate/norm_weight None)"
    if p.lower_bound is None:
        return False, "AITER's kernel implements Kimi-K3's safe gate only (lower_bound is None)"
    if abs(p.scale - p.K ** -0.5) > 1e-12 * p.K ** -0.5:
        return False, f"AITER's kernel uses the default q scale K**-0.5 (got scale={p.scale})"
    fn = fns["flydsl_kda_decode_with_f_b" if p.has_f_b else "flydsl_kda_decode"]
    dtypes = tuple(getattr(fn, "state_dtypes", (torch.float32,)))
    if p.state.dtype not in dtypes:
        return False, f"AITER's kernel takes {', '.join(str(d) for d in dtypes)} state (got {p.state.dtype})"
    try:
        supported = bool(fns["is_flydsl_kda_decode_supported"](p.device))
    except Exception as exc:
        return False, f"is_flydsl_kda_decode_supported raised {type(exc).__name__}: {exc}"
    if not supported:
        return False, f"is_flydsl_kda_decode_supported({p.device}) is False (AITER's kernel is gfx950-only)"
    return True, "H=12, K=V=128 Kimi-K3 layer"


def run(p) -> torch.Tensor:
    """Launch AITER's kernel for a ``KDAProblem`` that ``covers`` accepted; fills and returns ``p.out``."""
    fns, why = find()
    if fns is None:
        raise ValueError(f"backend='flydsl' (AITER source): {why}")
    if p.B == 0:
        return p.out
    idx = p.state_indices
    if idx.dtype != torch.int32 or int(p.state.shape[0]) != int(p.conv_state.shape[0]):
        # AITER takes int32 [B] indices and bounds them by its state cache only: every row the contract calls
        # padding (outside [0, num_slots), int64 values past int32 included) reaches it as -1
        live = (idx >= 0) & (idx < p.num_slots)
        idx = torch.where(live, idx, torch.full_like(idx, -1)).to(torch.int32)
    out = p.out if p.out.is_contiguous() else torch.empty(p.out.shape, dtype=p.out.dtype, device=p.out.device)
    kw = dict(x=p.x, conv_weight=p.conv_weight, conv_bias=None, conv_state=p.conv_state, raw_beta=p.b.unsqueeze(0),
              A_log=p.A_log, dt_bias=p.dt_bias, lower_bound=p.lower_bound, state=p.state, state_indices=idx,
              output_gate=p.output_gate, norm_weight=p.norm_weight, norm_eps=p.norm_eps, out=out.unsqueeze(0))
    if p.has_f_b:
        fns["flydsl_kda_decode_with_f_b"](f_a=p.f_a, f_b_weight=p.f_b_weight, **kw)
    else:
        fns["flydsl_kda_decode"](raw_a=p.a, **kw)
    if out is not p.out:
        p.out.copy_(out)
    return p.out
