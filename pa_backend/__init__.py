"""FP8 paged attention: decode, KV write and ragged prefill (reference and Triton; FlyDSL slot)."""

from .api import REGISTRY, pa_decode, pa_prefill, write_kv
from .fp8 import fp8_dtype_for, fp8_max
from .planner import reserve

__all__ = ["pa_decode", "pa_prefill", "write_kv", "reserve", "fp8_dtype_for", "fp8_max", "REGISTRY"]
