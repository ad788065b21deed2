"""FP8 paged attention: decode, KV write and ragged prefill (reference now; Triton and FlyDSL next)."""

from .api import REGISTRY, pa_decode, pa_prefill, write_kv
from .fp8 import fp8_dtype_for, fp8_max

__all__ = ["pa_decode", "pa_prefill", "write_kv", "fp8_dtype_for", "fp8_max", "REGISTRY"]
