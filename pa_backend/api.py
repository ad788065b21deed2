"""Public FP8 paged-attention ops: ``pa_decode``, ``write_kv``, ``pa_prefill`` (docs/design.md §4).

Implementations are chosen by ``backend_core.registry``; ``FLYDSL_BACKENDS_PA=torch|triton|flydsl``
forces one when ``backend="auto"``. Status: on an NVIDIA GPU ``auto`` picks the Triton kernels
(performance: docs/performance.md); on CPU the ``torch`` reference (Triton there runs only under
``TRITON_INTERPRET=1``); on AMD the FlyDSL slot serves decode through AITER's
FlyDSL kernel when the installed AITER has it (``pa_backend/flydsl``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .contract import eager_plan, prepare_write
from .registry import DECODE, PREFILL, REGISTRIES, REGISTRY, WRITE, registry_for

# the registries (registry.py) are re-exported for the callers that name them here
__all__ = ["pa_decode", "write_kv", "pa_prefill", "is_pa_decode_supported", "REGISTRY", "REGISTRIES", "DECODE",
           "PREFILL", "WRITE", "registry_for"]


def pa_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
              query_length: int = 1, softmax_scale: Optional[float] = None, sliding_window: int = 0, sinks=None,
              num_partitions: Optional[int] = None, out: Optional[torch.Tensor] = None,
              backend: str = "auto") -> torch.Tensor:
    """Paged attention decode over an FP8 KV cache: a one-layer plan (``plan_decode(...).run(...)``).

    * ``query`` [num_seqs * query_length, Hq, D] bf16/fp16 (rows of sequence s are
      ``s*query_length .. s*query_length + query_length - 1``); ``out`` the same shape and dtype,
      contiguous (filled in place and returned; allocated when None).
    * ``key_cache`` [num_blocks, Hkv, D/16, block_size, 16]; ``value_cache`` [num_blocks, Hkv, D,
      block_size] or [num_blocks, Hkv, block_size/16, D, 16]; FP8 e4m3fn or e4m3fnuz; D in
      {64, 128, 256}, block_size a multiple of 16 up to 128, Hq / Hkv in 1..16.
    * ``key_scale`` / ``value_scale``: per-tensor (0-dim or [1] fp32) or per-token
      [num_blocks, Hkv, block_size] fp32; a stored value reads as fp8 * scale.
    * ``block_tables`` [num_seqs, max_blocks] int32, at most 2^30 tokens wide; ``context_lengths``
      [num_seqs] int32 (the new tokens included; 0 <= length <= max_blocks * block_size: not checked on
      the device, where the Triton kernels clamp a length to that range, positions included). Table entries
      past a sequence's extent are never read; an id outside [0, num_blocks) inside it is a corrupted table (the
      reference raises
      ValueError, the Triton kernels read block 0 instead: no load leaves the caches). Row i of a
      sequence attends tokens 0 .. context_length - query_length + i (causal among the new tokens), only
      the last ``sliding_window`` of them when > 0 (a window at least as wide as the table is none); a row
      with no token to attend (e.g. a padded sequence with context 0) gets zeros.
    * ``sinks`` [Hq] fp32: adds exp(sinks[h]) to head h's softmax denominator.
    * ``softmax_scale`` defaults to D**-0.5 (else a normal fp32 number). ``num_partitions`` (split-K) is a
      kernel hint, at most 256 of them are used; None lets the planner choose.
    """
    plan = eager_plan(query, block_tables, context_lengths, query_length=query_length, backend=backend)
    return plan.run(query, key_cache, value_cache, key_scale, value_scale, softmax_scale=softmax_scale,
                    sliding_window=sliding_window, sinks=sinks, num_partitions=num_partitions, out=out)


def pa_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lengths, key_scale, value_scale,
               *, softmax_scale: Optional[float] = None, sliding_window: int = 0, sinks=None,
               out: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """Ragged paged attention (extend, chunked prefill, mixed batches) over the same FP8 cache.

    Query rows of sequence s are ``query[query_start_loc[s]:query_start_loc[s+1]]`` (int32
    [num_seqs + 1]); their K/V must already be in the cache (``write_kv``). Row i of a sequence with
    ql rows attends tokens 0 .. context_lengths[s] - ql + i. Rows outside every sequence are zero.
    Everything else is as in :func:`pa_decode`.
    """
    plan = eager_plan(query, block_tables, context_lengths, query_start_loc=query_start_loc, prefill=True,
                      backend=backend)
    return plan.run(query, key_cache, value_cache, key_scale, value_scale, softmax_scale=softmax_scale,
                    sliding_window=sliding_window, sinks=sinks, out=out)


def write_kv(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale, *,
             backend: str = "auto") -> None:
    """Quantize ``key``/``value`` [tokens, Hkv, D] (bf16/fp16) into the FP8 caches in place.

    Token t goes to slot ``slot_mapping[t]`` = block * block_size + offset; a negative slot (-1,
    padding) or one past the cache is skipped. Per-tensor scales: stores clamp(x / scale) in FP8.
    Per-token scales ([num_blocks, Hkv, block_size]): the writer computes each (token, head)'s scale
    amax(|x|) / fp8_max, stores it, and stores x / scale. Non-finite values: a NaN is stored as the
    format's NaN (with per-token scales the (token, head)'s scale is NaN too); an inf saturates to
    +-fp8_max under a per-tensor scale and makes a per-token scale inf. Two tokens naming one slot in
    one call race on the GPU (the caller's slots are distinct, as a server's are).
    """
    p = prepare_write(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                      key_scale=key_scale, value_scale=value_scale)
    WRITE.select(p, backend, device_type=p.device.type, site_depth=1).run(p)


def is_pa_decode_supported(device=None, backend: str = "flydsl") -> bool:
    """Whether ``backend`` can run ``pa_decode`` on ``device`` (None: the current device). For
    ``flydsl``: flydsl and AITER's FlyDSL paged decode installed, and the device an AMD GPU whose
    arch (gcnArchName) is FlyDSL's build target. Shapes are checked per call."""
    return DECODE.supported_on(backend, device)
