"""Public KDA decode ops: ``kda_decode``, ``kda_decode_with_f_b``, ``is_kda_decode_supported``.

docs/design.md §3 is the contract. Implementations (``torch`` reference, ``triton``, ``flydsl``) are
chosen by ``backend_core.registry``; ``FLYDSL_BACKENDS_KDA=torch|triton|flydsl`` forces one when
``backend="auto"``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from backend_core.registry import Implementation, OpRegistry

from . import flydsl as _flydsl
from . import triton as _triton
from .contract import KDAProblem, prepare
from .reference import run_reference

__all__ = [
    "kda_decode",
    "kda_decode_with_f_b",
    "is_kda_decode_supported",
    "REGISTRY",
    "kda_decode_ref",
    "kda_decode_with_f_b_ref",
    "kda_decode_triton",
    "kda_decode_with_f_b_triton",
]


def _torch_supports(p: KDAProblem):
    return True, "ok"


REGISTRY = OpRegistry(
    "kda",
    env_var="FLYDSL_BACKENDS_KDA",
    preference={"cuda": ("flydsl", "triton", "torch"), "cpu": ("torch", "triton")},
)
REGISTRY.register(Implementation("torch", lambda: (True, "always (reference, FP32 loop over rows)"),
                                 _torch_supports, run_reference, "reference: readable torch, FP32"))
REGISTRY.register(Implementation("triton", _triton.available, _triton.supports, _triton.run,
                                 "one Triton launch per step (NVIDIA, AMD; CPU via TRITON_INTERPRET=1)"))
REGISTRY.register(Implementation("flydsl", _flydsl.available, _flydsl.supports, _flydsl.run,
                                 "FlyDSL kernel (AMD gfx950/gfx942)", bind=_flydsl.bind))


def _dispatch(p: KDAProblem, backend: str) -> torch.Tensor:
    impl = REGISTRY.select(p, backend, device_type=p.device.type, site_depth=2)  # user -> kda_decode -> here
    return impl.run(p)


def kda_decode(x, conv_weight, conv_state, a, b, A_log, dt_bias, state, state_indices, output_gate, norm_weight, *,
               conv_bias=None, lower_bound: Optional[float] = None, norm_eps: float = 1e-5,
               scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
               backend: str = "auto") -> torch.Tensor:
    """One fused KDA decode step for B single-token requests (docs/design.md §3).

    Shapes (H heads, K = V head dim, C = 3*H*K channels, W conv width):

    * ``x`` [B, C] bf16: q | k | v channels, pre-conv (or post-conv and activated when
      ``conv_weight`` is None).
    * ``conv_weight`` [C, W] fp32 or None; ``conv_bias`` [C] fp32 or None.
    * ``conv_state`` [slots, C, W-1] bf16, channel-major or the ``transpose(-1, -2)`` view of a
      width-major [slots, W-1, C] buffer, any slot stride. **Updated in place** (window shifted,
      x appended) for live rows; ignored when ``conv_weight`` is None.
    * ``a`` [B, H*K] bf16 raw forget gate; ``b`` [B, H] (or [1, B, H]) bf16 raw beta.
    * ``A_log`` [H] fp32; ``dt_bias`` [H*K] fp32.
    * ``state`` [slots, H, V, K] fp32 or bf16, contiguous within a slot, any slot stride.
      **Updated in place** for live rows (FP32 math; bf16 rounded once on store).
    * ``state_indices`` [B] int32 (or int64): slot of each row. A row whose index is negative or
      >= the number of slots (the smaller of the two caches) is padding: its output row is zero
      and neither cache changes. Slot 0 is a live slot.
    * ``output_gate`` [B, H, V] bf16 and ``norm_weight`` [V] bf16: the sigmoid-gated RMSNorm;
      both None returns the raw readout ``o``.
    * ``lower_bound``: the safe gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``
      instead of ``-exp(A_log) * softplus(a + dt_bias)``.
    * ``scale`` defaults to K**-0.5; ``norm_eps`` to 1e-5.
    * ``out`` [B, H, V] bf16, any disjoint row layout with unit stride along V, filled in place
      and returned; allocated when None.

    Live rows must use distinct slots: two rows on one slot race on a GPU (the last writer wins; the
    reference applies them in row order). ``FLYDSL_BACKENDS_KDA_SLOT_CHECK=1`` checks it, with a host sync.
    Bad input raises ValueError/TypeError naming the argument before anything is written.
    No host synchronization and a shape-fixed grid: safe inside CUDA-graph capture.
    """
    p = prepare(x=x, conv_weight=conv_weight, conv_state=conv_state, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                conv_bias=conv_bias, lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out)
    return _dispatch(p, backend)


def kda_decode_with_f_b(f_a, f_b_weight, x, conv_weight, conv_state, b, A_log, dt_bias, state, state_indices,
                        output_gate, norm_weight, *, conv_bias=None, lower_bound: Optional[float] = None,
                        norm_eps: float = 1e-5, scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        backend: str = "auto") -> torch.Tensor:
    """``kda_decode`` with the forget-gate projection fused: ``a[n, h] = f_a[n] @ f_b_weight[h]^T``.

    ``f_a`` [B, R] bf16 and ``f_b_weight`` [H, K, R] bf16 replace ``a``; the product is formed in
    FP32 inside the kernel and never rounded to bf16 or written to memory. Everything else is as
    in :func:`kda_decode`.
    """
    p = prepare(x=x, conv_weight=conv_weight, conv_state=conv_state, a=None, b=b, A_log=A_log, dt_bias=dt_bias,
                state=state, state_indices=state_indices, output_gate=output_gate, norm_weight=norm_weight,
                conv_bias=conv_bias, lower_bound=lower_bound, norm_eps=norm_eps, scale=scale, out=out,
                f_a=f_a, f_b_weight=f_b_weight, with_f_b=True)
    return _dispatch(p, backend)


def is_kda_decode_supported(device=None, backend: str = "flydsl") -> bool:
    """Whether ``backend`` can run KDA decode on ``device`` (None: the current device). For
    ``flydsl``: flydsl installed and the device an AMD GPU whose arch (gcnArchName, memoized per
    device index) is FlyDSL's build target; shapes are checked per call."""
    return REGISTRY.supported_on(backend, device)


kda_decode_ref = functools.partial(kda_decode, backend="torch")
kda_decode_with_f_b_ref = functools.partial(kda_decode_with_f_b, backend="torch")
kda_decode_triton = functools.partial(kda_decode, backend="triton")
kda_decode_with_f_b_triton = functools.partial(kda_decode_with_f_b, backend="triton")
