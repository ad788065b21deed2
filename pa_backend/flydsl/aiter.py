"""The project's paged-attention contract mapped onto AITER's FlyDSL paged decode (one adapter).

AITER's ``aiter.ops.flydsl.pa_decode`` (the "paged-attention Tile kernel", also registered as
``torch.ops.aiter.pa_decode_flydsl``) runs the partition kernel and its reduce. Documented call::

    pa_decode(output, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
              query_length, max_context_partition_num, context_partition_size=256, compute_type=...,
              sinks=None, sliding_window=0, ...)

It reads the cache layout of docs/design.md §4 as is (x-packed K, 4-D or transposed 5-D V, e4m3fnuz on
gfx942 and e4m3fn on gfx950, per-tensor [1] or per-token [num_blocks, Hkv, block] scales, block
16/64/128, query length <= 4, contiguous output). Where the contracts differ:

* ``output`` is the first positional argument (ours is ``out=``); everything is passed by keyword.
* Partitions: AITER splits the context into ``context_partition_size``-token partitions (256) and
  wants their maximum count; the adapter derives it from the block-table width, never from the
  context lengths, so the call stays graph-stable. ``num_partitions`` (our hint) is not forwarded.
* Per-tensor scales go as [1] views (ours may be 0-dim).
* ``softmax_scale``: forwarded when AITER's signature has it; otherwise only the default D**-0.5
  is covered.
* Decode only: ``pa_prefill`` and ``write_kv`` have no AITER FlyDSL entry point here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Tuple

import torch

from backend_core import flydsl_source, platform

__all__ = ["ENTRY_POINTS", "PARTITION_TOKENS", "find", "covers", "run"]

ENTRY_POINTS = {
    "pa_decode": ("output", "query", "key_cache", "value_cache", "block_tables", "context_lengths", "key_scale",
                  "value_scale", "query_length", "max_context_partition_num", "context_partition_size",
                  "compute_type", "sinks", "sliding_window"),
}
PARTITION_TOKENS = 256
AITER_BLOCK_SIZES = (16, 64, 128)  # the block sizes this adapter was written and checked for


def find():
    return flydsl_source.find_aiter(ENTRY_POINTS)


@functools.lru_cache(maxsize=64)
def _has_param(fn, name: str) -> bool:
    """Whether AITER's entry point takes ``name`` (memoized: ``inspect.signature`` is slow per call)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def covers(p) -> Tuple[bool, str]:
    """Can AITER's paged decode serve this validated call (a ``PAProblem`` or ``WriteProblem``)?"""
    fns, why = find()
    if fns is None:
        return False, why
    if not hasattr(p, "is_decode"):
        return False, "write_kv: AITER has no FlyDSL KV writer mapped here"
    if not p.is_decode:
        return False, "pa_prefill: AITER's FlyDSL paged kernel is decode-only"
    c = p.cache
    if p.num_seqs > 1 and p.context_lengths.stride(0) != 1:
        return False, "strided context_lengths (AITER's kernel reads them contiguous; the Triton kernel takes strides)"
    if c.block_size not in AITER_BLOCK_SIZES:
        return False, f"block size {c.block_size}: this adapter maps AITER's kernel for blocks of {AITER_BLOCK_SIZES}"
    want = torch.float8_e4m3fnuz if platform.device_info(p.device).arch == "gfx942" else torch.float8_e4m3fn
    if c.key_cache.dtype != want:
        return False, f"the cache is {c.key_cache.dtype}; AITER's kernel on this arch reads {want}"
    if not (c.D // 16 <= 8 or (c.D // 16) % 8 == 0):
        return False, f"head dim {c.D}: AITER needs D/16 <= 8 or a multiple of 8"
    if abs(p.softmax_scale - c.D ** -0.5) > 1e-12 and not _has_param(fns["pa_decode"], "softmax_scale"):
        return False, "a non-default softmax_scale (AITER's pa_decode here takes none)"
    return True, f"decode, D={c.D}, block {c.block_size}, ql {p.query_length}"


def _scale(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(1) if s.dim() == 0 else s


def run(p) -> torch.Tensor:
    fns, why = find()
    if fns is None:
        raise ValueError(f"backend='flydsl' (AITER source): {why}")
    c = p.cache
    max_tokens = int(p.block_tables.shape[1]) * c.block_size
    kw = dict(output=p.out, query=p.query, key_cache=c.key_cache, value_cache=c.value_cache,
              block_tables=p.block_tables, context_lengths=p.context_lengths, key_scale=_scale(c.key_scale),
              value_scale=_scale(c.value_scale), query_length=p.query_length,
              max_context_partition_num=max(1, -(-max_tokens // PARTITION_TOKENS)),
              context_partition_size=PARTITION_TOKENS, compute_type=p.query.dtype, sinks=p.sinks,
              sliding_window=p.sliding_window)
    if _has_param(fns["pa_decode"], "softmax_scale"):
        kw["softmax_scale"] = p.softmax_scale
    fns["pa_decode"](**kw)
    return p.out
