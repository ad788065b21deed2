"""Triton implementation of the paged-attention ops: ``pa_decode`` (split-K partitions + reduce), ``pa_prefill``
(the same kernels over chunks of query rows) and ``write_kv``.

* ``tiling.py``: the tiling policy and the tuning variables (what a launch's shape decides);
* ``launch_state.py``: what every layer of one plan shares (tiling, split-K plan, workspace views, prefill work
  items, grid), made once per plan and layer shape;
* ``pa_decode_launch.py`` beside ``pa_decode.py``: the attention launcher and its kernels;
* ``write_kv_launch.py`` beside ``write_kv.py``: the KV-cache write launcher and its kernel.

Importing this package never needs Triton: the kernels are imported at their first launch.
"""

from __future__ import annotations

from typing import Tuple

import torch

from backend_core import platform

from .pa_decode_launch import run_attention
from .tiling import check_environment
from .write_kv_launch import run_write

__all__ = ["available", "supports", "run_attention", "run_write", "check_environment"]


def available() -> Tuple[bool, str]:
    return platform.triton_runnable()


def supports(p) -> Tuple[bool, str]:
    ok, why = platform.triton_device_ok(p.device)
    if not ok:
        return ok, why
    if p.cache.key_cache.dtype != torch.float8_e4m3fn and not (p.device.type == "cuda" and platform.is_hip()):
        return False, "float8_e4m3fnuz caches need an AMD GPU (the CPU interpreter and NVIDIA have no fnuz)"
    return True, "ok"
