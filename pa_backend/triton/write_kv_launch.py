"""Launcher of the Triton FP8 KV-cache write (write_kv.py): ``write_kv``.

One program per (token, KV head). A call with the same addresses, shapes and strides as an earlier one (a
server's layers, step after step) launches the kept ``backend_core.launch.Bound`` again, with no argument
list or key built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend_core.launch import bind
from backend_core.validation import CheckMemo

from ..fp8 import fp8_max, fp8_nan_byte

if TYPE_CHECKING:  # annotations only (the contract imports the registries, which import this)
    from ..contract import WriteProblem

__all__ = ["run_write", "fp8_write_constants"]


def fp8_write_constants(dtype: torch.dtype) -> dict:
    """write_kv_kernel's constexprs of the cache's FP8 format: its largest value, the exponent below which
    its values are subnormal, and its NaN byte (e4m3fn: 448, -6, 0x7F; e4m3fnuz: 240, -7, 0x80)."""
    return dict(FMAX=fp8_max(dtype), MIN_EXP=-7 if dtype == torch.float8_e4m3fnuz else -6, NAN_BYTE=fp8_nan_byte(dtype))


def run_write(p: WriteProblem) -> None:
    from .write_kv import write_kv_kernel  # imports triton

    c = p.cache
    T = int(p.key.shape[0])
    if T == 0:
        return None
    # a call with the same addresses, shapes and strides as an earlier one (a server's layers, step after
    # step): the launch made for it again, every argument kept (backend_core.launch.Bound)
    bound = _WRITE_LAUNCHES.get(p.memo_key) if p.memo_key is not None else None
    if bound is not None and bound():
        return None
    kc, vc, ks, vs = c.key_cache, c.value_cache, c.key_scale, c.value_scale
    _, bound = bind(
        write_kv_kernel, (T, c.Hkv), (),
        p.key, p.value, kc, vc, ks, vs, p.slot_mapping, c.num_blocks * c.block_size, p.slot_mapping.stride(0),
        p.key.stride(0), p.key.stride(1), p.value.stride(0), p.value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0) if c.k_per_token else 0, ks.stride(1) if c.k_per_token else 0,
        vs.stride(0) if c.v_per_token else 0, vs.stride(1) if c.v_per_token else 0,
        D=c.D, BS=c.block_size, **fp8_write_constants(kc.dtype),
        V5D=c.v_transposed, K_PER_TOKEN=c.k_per_token, V_PER_TOKEN=c.v_per_token, num_warps=1 if c.D <= 128 else 2,
    )
    if bound is not None and p.memo_key is not None:
        _WRITE_LAUNCHES.put(p.memo_key, p.device, bound)
    return None


# write_kv's launches by check-memo key (least recently used dropped first); a Bound holds no tensor
_WRITE_LAUNCHES = CheckMemo(1024)
