"""Which FP8 format a device's KV cache uses, and its largest finite value.

gfx942 implements the "fnuz" variant (no negative zero, NaN = 0x80, max 240); gfx950 and NVIDIA
GPUs implement OCP e4m3fn (NaN = 0x7f/0xff, max 448).
"""

from __future__ import annotations

import torch

from backend_core import platform

__all__ = ["FP8_DTYPES", "fp8_dtype_for", "fp8_max", "fp8_nan_byte"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fp8_dtype_for(device=None) -> torch.dtype:
    """The FP8 KV-cache dtype of ``device`` (None: the current device; CPU: e4m3fn)."""
    info = platform.device_info(device)
    return torch.float8_e4m3fnuz if info.arch == "gfx942" else torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype: expected float8_e4m3fn or float8_e4m3fnuz, got {dtype}")
    return float(torch.finfo(dtype).max)


def fp8_nan_byte(dtype: torch.dtype) -> int:
    """A byte that decodes to NaN in ``dtype`` (tests fill unused pages with it)."""
    return 0x80 if dtype == torch.float8_e4m3fnuz else 0x7F
