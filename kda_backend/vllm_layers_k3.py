"""vLLM 0.33.0 adapter of the KDA decode op, the Kimi-K3 layer class: ``FlyDSLKimiK3DeltaAttention``.

Apart from ``kda_backend.vllm_layers`` because its base, ``vllm.models.kimi_k3.amd.kda``, imports only on
ROCm with AITER; ``kda_backend.vllm`` imports this module only there, once vLLM has imported that layer.
"""

from __future__ import annotations

from vllm.models.kimi_k3.amd.kda import KimiK3DeltaAttention

from .vllm_layers import FlyDSLKDADecode

__all__ = ["FlyDSLKimiK3DeltaAttention"]


class FlyDSLKimiK3DeltaAttention(FlyDSLKDADecode, KimiK3DeltaAttention):
    """ROCm Kimi-K3's KDA layer whose pure decode batches run ``kda_backend.kda_decode`` when
    ``additional_config {"flydsl_kda": true}`` (see ``kda_backend.vllm``)."""
