"""The project's paged-attention contract mapped onto AITER's FlyDSL paged decode (one adapter).

AITER's ``aiter.ops.flydsl.pa_decode`` (the "paged-attention Tile kernel", also registered as
``torch.ops.aiter.pa_decode_flydsl``) runs the partition kernel and its reduce. Documented call::

    pa_decode(output, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
              query_length, max_context_partition_num, context_partition_size=256, compute_type=...,
              sinks=None, sliding_window=0, ...)

It reads the cache layout of docs/design.md §4 as is (x-packed K, 4-D or transposed 5-D V, e4m3fnuz on
gfx942 and e4m3fn on gfx950, per-tensor [1] or per-token [num_blocks, Hkv, block] scales, query length
<= 4, contiguous output). Where the contracts differ:

* ``output`` is the first positional argument (ours is ``out=``); everything is passed by keyword.
* Partitions: AITER splits the context into ``context_partition_size``-token partitions (256) and
  wants their maximum count; the adapter derives it from the block-table width, never from the
  context lengths, so the call stays graph-stable. ``num_partitions`` (our hint) is not forwarded.
* Per-tensor scales go as [1] views (ours may be 0-dim).
* ``softmax_scale``: forwarded when AITER's signature has it; otherwise only the default D**-0.5
  is covered.
* Decode only: ``pa_prefill`` and ``write_kv`` have no AITER FlyDSL entry point here.

What the one version of that kernel read so far requires (AITER branch ``flydsl-pa-decode-tile``:
``aiter/ops/flydsl/pa_decode.py`` and ``kernels/pa_decode_tile.py``; no AMD GPU here to check a later
one), and ``covers`` therefore declines (the call then goes to the Triton kernel):
* the caches, ``block_tables`` and the per-token scales contiguous: the kernel computes the caches' page
  and head strides from their shapes and a table row's from its width (vLLM's interleaved K/V pages and
  any strided layout our contract accepts would be misread; the wrapper's checks are ``assert``);
* blocks of 16 or 64 tokens; no sinks and no sliding window (the wrapper raises for them);
* at most 64 partitions of 256 tokens, i.e. tables up to 16384 tokens (the wrapper raises above);
* ``compute_type`` is the FP8 type of the MFMA operands (the cache dtype), not the query's.
Not checkable without reading the cache, and different from our contract: the kernel replaces table entries
past a sequence's last block with block 0 and feeds the unused tail of the last page to the P.V dot, so
block 0 and those slots must hold finite bytes (ours never reads them). ``flydsl-backends verify`` on an AMD
machine runs NaN-filled unused slots and shows whether the installed AITER serves our contract.
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
AITER_BLOCK_SIZES = (16, 64)  # the block sizes the readable AITER kernel takes (module docstring)
AITER_MAX_PARTITIONS = 64  # its wrapper's bound on max_context_partition_num


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
    for name, t in (("key_cache", c.key_cache), ("value_cache", c.value_cache), ("key_scale", c.key_scale),
                    ("value_scale", c.value_scale)):
        if not t.is_contiguous():
            return False, (f"a strided {name} (AITER's kernel computes the caches' strides from their shapes; "
                           "the Triton kernel takes any strides, e.g. vLLM's interleaved K/V pages)")
    bt = p.block_tables
    if bt.stride(-1) != 1 or (bt.shape[0] > 1 and bt.stride(0) != bt.shape[1]):
        return False, "strided block_tables rows (AITER's kernel indexes a row by the table's width)"
    if p.sinks is not None or p.sliding_window > 0:
        return False, "sinks / a sliding window (the readable AITER paged decode takes neither)"
    if _partitions(p) > AITER_MAX_PARTITIONS:
        return False, (f"a table of {int(bt.shape[1]) * c.block_size} tokens: AITER's wrapper takes at most "
                       f"{AITER_MAX_PARTITIONS} partitions of {PARTITION_TOKENS} tokens")
    want = torch.float8_e4m3fnuz if platform.device_info(p.device).arch == "gfx942" else torch.float8_e4m3fn
    if c.key_cache.dtype != want:
        return False, f"the cache is {c.key_cache.dtype}; AITER's kernel on this arch reads {want}"
    if not (c.D // 16 <= 8 or (c.D // 16) % 8 == 0):
        return False, f"head dim {c.D}: AITER needs D/16 <= 8 or a multiple of 8"
    if abs(p.softmax_scale - c.D ** -0.5) > 1e-12 and not _has_param(fns["pa_decode"], "softmax_scale"):
        return False, "a non-default softmax_scale (AITER's pa_decode here takes none)"
    return True, f"decode, D={c.D}, block {c.block_size}, ql {p.query_length}"


def _partitions(p) -> int:
    """AITER's partition count: from the block-table width, never the lengths (graph-stable)."""
    return max(1, -(-int(p.block_tables.shape[1]) * p.cache.block_size // PARTITION_TOKENS))


def _scale(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(1) if s.dim() == 0 else s


def run(p) -> torch.Tensor:
    fns, why = find()
    if fns is None:
        raise ValueError(f"backend='flydsl' (AITER source): {why}")
    c = p.cache
    kw = dict(output=p.out, query=p.query, key_cache=c.key_cache, value_cache=c.value_cache,
              block_tables=p.block_tables, context_lengths=p.context_lengths, key_scale=_scale(c.key_scale),
              value_scale=_scale(c.value_scale), query_length=p.query_length,
              max_context_partition_num=_partitions(p), context_partition_size=PARTITION_TOKENS,
              compute_type=c.key_cache.dtype, sinks=p.sinks, sliding_window=p.sliding_window)
    if _has_param(fns["pa_decode"], "softmax_scale"):
        kw["softmax_scale"] = p.softmax_scale
    fns["pa_decode"](**kw)
    return p.out
