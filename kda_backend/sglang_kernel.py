"""SGLang 0.5.23 adapter of the KDA decode op, the kernel class: ``FlyDSLKDAKernel``, the
``LinearAttnKernelBase`` that ``kda_backend.sglang.dispatcher_init_around`` puts in SGLang's
``KDAKernelDispatcher`` for ``--linear-attn-decode-backend flydsl``.

The argument mapping lives in ``kda_backend.sglang`` (which imports on any machine); this module
holds only the class SGLang calls, so it imports SGLang at the top and is imported when the
dispatcher is first built.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

from . import sglang as adapter

__all__ = ["FlyDSLKDAKernel"]


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
            raise NotImplementedError(f"flydsl KDA decode: unsupported arguments {extra} (use the triton decode "
                                      "backend)")
        # looked up on the module per call, so a test's or a trace's wrapper there sees every decode
        return adapter._packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                      ssm_states=ssm_states, state_indices=cache_indices, num_v_heads=num_v_heads,
                                      head_v_dim=head_v_dim, lower_bound=lower_bound, backend=self.backend)

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
               lower_bound=None, **kwargs):
        """Unpacked form (q, k, v [1, B, H, K] post-conv): packed into one row buffer first."""
        B, H, K = int(q.shape[1]), int(q.shape[2]), int(q.shape[3])
        x = torch.cat([t.reshape(B, H * K) for t in (q, k, v)], dim=1)
        return self.packed_decode(x, a, b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=ssm_states,
                                  cache_indices=cache_indices, num_v_heads=H, head_v_dim=K, lower_bound=lower_bound,
                                  **kwargs)  # packed_decode refuses the ReplaySSM buffers we do not fill

    def extend(self, *args, **kwargs):
        raise NotImplementedError("flydsl serves KDA decode only; prefill stays on SGLang's kernel")
