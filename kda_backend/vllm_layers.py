"""vLLM 0.33.0 adapter of the KDA decode op, the layer classes: ``FlyDSLKimiGatedDeltaNetAttention``
(Kimi-Linear) and ``FlyDSLKDADecode``, the ``_forward`` it shares with the Kimi-K3 layer
(``kda_backend.vllm_layers_k3``).

What they run lives in ``kda_backend.vllm`` (which imports on any machine); the classes import vLLM's
layer module, so ``kda_backend.vllm`` imports this module only once vLLM itself has imported that layer
(its import initialises the GPU through FLA's utilities).
"""

from __future__ import annotations

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

from . import vllm as adapter

__all__ = ["FlyDSLKDADecode", "FlyDSLKimiGatedDeltaNetAttention"]


class FlyDSLKDADecode:
    """Placed before a vLLM KDA layer class: pure decode batches run ``kda_backend.kda_decode`` when
    ``additional_config {"flydsl_kda": true}`` (see ``kda_backend.vllm``), everything else the layer's
    own ``_forward``."""

    def __init__(self, config, vllm_config, prefix: str = "", *args, **kwargs):
        super().__init__(config, vllm_config, prefix, *args, **kwargs)
        adapter.configure_layer(self, get_current_vllm_config())

    # vLLM's _forward is the decorated wrapper; super()._forward below goes through it (its wrapper
    # runs the function directly when no breakable capture is recording, as inside ours).
    @eager_break_during_capture
    def _forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        if adapter.forward_on_flydsl(self, mixed_qkv, g1, g2, beta, core_attn_out):
            return None
        return super()._forward(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta, core_attn_out=core_attn_out)


class FlyDSLKimiGatedDeltaNetAttention(FlyDSLKDADecode, KimiGatedDeltaNetAttention):
    """Kimi-Linear's KDA layer whose pure decode batches run ``kda_backend.kda_decode`` when
    ``additional_config {"flydsl_kda": true}`` (see ``kda_backend.vllm``)."""
