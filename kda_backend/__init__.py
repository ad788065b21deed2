"""Fused KDA (Kimi Delta Attention) decode step: reference, Triton and FlyDSL implementations."""

from .api import (
    REGISTRY,
    VERIFY_REGISTRY,
    is_kda_decode_supported,
    kda_decode,
    kda_decode_ref,
    kda_decode_triton,
    kda_decode_with_f_b,
    kda_decode_with_f_b_ref,
    kda_decode_with_f_b_triton,
    kda_verify,
    kda_verify_with_f_b,
)

__all__ = [
    "kda_decode",
    "kda_decode_with_f_b",
    "is_kda_decode_supported",
    "kda_decode_ref",
    "kda_decode_with_f_b_ref",
    "kda_decode_triton",
    "kda_decode_with_f_b_triton",
    "kda_verify",
    "kda_verify_with_f_b",
    "REGISTRY",
    "VERIFY_REGISTRY",
]
