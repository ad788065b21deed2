"""FP8 paged attention: decode, KV write and ragged prefill (reference, Triton; FlyDSL decode through AITER)."""

from .api import REGISTRY, is_pa_decode_supported, pa_decode, pa_prefill, write_kv
from .contract import PAPlan, plan_decode, plan_prefill
from .fp8 import fp8_dtype_for, fp8_max
from .planner import reserve

__all__ = ["pa_decode", "pa_prefill", "write_kv", "plan_decode", "plan_prefill", "PAPlan", "is_pa_decode_supported",
           "reserve", "fp8_dtype_for", "fp8_max", "REGISTRY"]
