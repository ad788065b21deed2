"""SGLang 0.5.23 adapter of the KDA decode op: a ``LinearAttnKernelBase`` decode kernel behind
``--linear-attn-decode-backend flydsl``.

SGLang has no registry for KDA kernels: ``flydsl`` maps to ``LinearAttnKernelBackend.CUSTOM`` and its
``KDAKernelDispatcher`` raises for it. The plugin (``flydsl_backends.plugins.register_sglang``)
therefore installs ``dispatcher_init_around`` as an AROUND hook on ``KDAKernelDispatcher.__init__``:
when the user asked for ``flydsl`` it builds the dispatcher as for ``triton`` (prefill, verify and
the fallback kernel stay SGLang's) and swaps in :func:`make_decode_kernel`'s kernel for decode.

What SGLang hands the decode kernel (after its own causal conv + SiLU, see the notes): packed
post-conv ``mixed_qkv`` [B, 3*H*K], raw ``a`` [B, H*K], raw ``b`` [1, B, H], ``A_log`` [1, 1, H, 1],
``dt_bias`` [H*K], the layer's ``ssm_states`` [slots, H, V, K] (strided pages), int32
``cache_indices`` where -1 marks CUDA-graph padding rows, and ``lower_bound`` for Kimi-K3's safe
gate. It expects [1, B, H, V] back; the model applies its gated ``o_norm`` itself. The adapter maps
that onto ``kda_decode(conv_weight=None, output_gate=None, norm_weight=None)``: SGLang's slot 0
stays a live (scratch) slot, -1 rows are padding (zero output, caches untouched), and strides
come from the pool's tensors. The implementation is the registry's choice (``backend="auto"``:
FlyDSL on gfx950/gfx942, Triton on NVIDIA, the reference on CPU; ``FLYDSL_BACKENDS_KDA`` forces
one).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .api import kda_decode

__all__ = ["make_decode_kernel", "dispatcher_init_around", "user_selected_flydsl", "register_hooks", "FLAG_VALUE"]

log = logging.getLogger("flydsl_backends.sglang")
FLAG_VALUE = "flydsl"


def _packed_decode(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, scale: float, ssm_states: torch.Tensor, cache_indices: torch.Tensor,
                   num_v_heads: int, head_v_dim: int, lower_bound: Optional[float] = None,
                   backend: str = "auto") -> torch.Tensor:
    """SGLang's packed decode arguments -> ``kda_decode``; returns [1, B, H, V]."""
    B = int(mixed_qkv.shape[0])
    H, V = int(num_v_heads), int(head_v_dim)
    if mixed_qkv.dim() != 2 or int(mixed_qkv.shape[1]) != 3 * H * V:
        raise ValueError(f"mixed_qkv: expected [B, 3*{H}*{V}] (q, k, v heads of equal size), got {list(mixed_qkv.shape)}")
    out = torch.empty(1, B, H, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    kda_decode(mixed_qkv, None, None, a, b, A_log.reshape(-1), dt_bias.reshape(-1), ssm_states, cache_indices, None, None,
               lower_bound=lower_bound, scale=scale, out=out[0], backend=backend)
    return out


@functools.lru_cache(maxsize=None)
def _kernel_class():
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    class FlyDSLKDAKernel(LinearAttnKernelBase):
        """KDA decode through the project's op (FlyDSL / Triton / reference by the registry)."""

        supports_packed_decode = True
        supports_packed_decode_safe_gate = True

        def __init__(self, backend: str = "auto"):
            self.backend = backend

        def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states, cache_indices, num_v_heads,
                          head_v_dim, lower_bound=None, **kwargs):
            extra = sorted(k for k, v in kwargs.items() if v is not None)
            if extra:  # ReplaySSM buffers: SGLang's resolution rejects them for non-triton decode already
                raise NotImplementedError(f"flydsl KDA decode: unsupported arguments {extra} (use the triton decode backend)")
            return _packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale, ssm_states=ssm_states,
                                  cache_indices=cache_indices, num_v_heads=num_v_heads, head_v_dim=head_v_dim,
                                  lower_bound=lower_bound, backend=self.backend)

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
                   lower_bound=None, **kwargs):
            """Unpacked form (q, k, v [1, B, H, K] post-conv): packed into one row buffer first."""
            B, H, K = int(q.shape[1]), int(q.shape[2]), int(q.shape[3])
            x = torch.cat([t.reshape(B, H * K) for t in (q, k, v)], dim=1)
            return self.packed_decode(x, a, b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=ssm_states,
                                      cache_indices=cache_indices, num_v_heads=H, head_v_dim=K, lower_bound=lower_bound)

        def extend(self, *args, **kwargs):
            raise NotImplementedError("flydsl serves KDA decode only; prefill stays on SGLang's kernel")

    return FlyDSLKDAKernel


def make_decode_kernel(backend: str = "auto"):
    """A ``LinearAttnKernelBase`` instance for SGLang's ``KDAKernelDispatcher.decode_kernel``."""
    return _kernel_class()(backend)


def user_selected_flydsl() -> bool:
    """Whether this server was launched with ``--linear-attn-decode-backend flydsl`` (or
    ``--linear-attn-backend flydsl``): SGLang maps every unknown name to CUSTOM, so the published
    server arguments are read instead."""
    try:
        from sglang.srt.runtime_context import get_exec

        mamba = get_exec().mamba
    except Exception:  # no published server arguments (unit tests building the dispatcher directly)
        return False
    return (getattr(mamba, "linear_attn_decode_backend", None) or getattr(mamba, "linear_attn_backend", None)) == FLAG_VALUE


def dispatcher_init_around(original, self, decode_backend, prefill_backend, verify_backend, *args, **kwargs):
    """AROUND hook on ``KDAKernelDispatcher.__init__``: ``flydsl`` decode with SGLang's own prefill,
    verify and fallback kernels."""
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    if decode_backend != LinearAttnKernelBackend.CUSTOM or not user_selected_flydsl():
        return original(self, decode_backend, prefill_backend, verify_backend, *args, **kwargs)
    if prefill_backend == LinearAttnKernelBackend.CUSTOM:
        raise ValueError("--linear-attn-backend flydsl would also make KDA prefill 'flydsl', which serves decode only: "
                         "use --linear-attn-decode-backend flydsl (prefill stays triton)")
    triton = LinearAttnKernelBackend.TRITON
    original(self, triton, prefill_backend, verify_backend, *args, **kwargs)
    self.decode_kernel = make_decode_kernel()
    self.supports_packed_decode = True
    self.supports_packed_decode_safe_gate = True
    log.info("KDA decode: flydsl-backends kernel (implementation chosen per call: FLYDSL_BACKENDS_KDA or auto)")
    return None


KDA_DISPATCHER_INIT = "sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher.__init__"


def register_hooks(hook_registry, hook_type) -> None:
    """Register this adapter's SGLang hooks (called once by ``flydsl_backends.plugins.register_sglang``;
    SGLang applies them after the plugin returns)."""
    hook_registry.register(KDA_DISPATCHER_INIT, dispatcher_init_around, hook_type.AROUND)
