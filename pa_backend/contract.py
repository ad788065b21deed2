"""The FP8 paged-attention contract and plan (docs/design.md §4): validation, the normalized problems, and
``PAPlan``, the one execution path of ``pa_decode`` / ``pa_prefill``.

One KV layout everywhere: key_cache [num_blocks, Hkv, D/16, block_size, 16] (16 FP8 bytes per
chunk), value_cache [num_blocks, Hkv, D, block_size] or [num_blocks, Hkv, block_size/16, D, 16].
Validation reads no tensor data (no host sync); nothing is written before it passes.

Plan once per batch, run per layer (FlashInfer's plan/run split). A server's forward step runs the same paged
attention batch through every layer: the block tables, context lengths and query layout are the batch's, only
the query, the layer's caches and its scalars change. ``plan_decode`` / ``plan_prefill`` check the batch once
(``check_batch``), from what the framework already holds on the host (query offsets, an upper bound on the
context), and ``PAPlan.run`` does the per-layer part: cheap shape checks (``check_layer``, memoized per
cache), the implementation chosen once per layer shape, and the launch state (split-K plan, prefill work
items on the device, workspace views) made once per plan. No host sync per layer. The eager ops
``pa_decode`` / ``pa_prefill`` (``api.py``) are a one-layer plan each (``eager_plan``).

    plan = plan_decode(block_tables, context_lengths, query_length=1, max_context=None)
    for layer in layers:
        plan.run(q, key_cache, value_cache, key_scale, value_scale, softmax_scale=..., out=o)

CUDA graphs: a decode plan is shape-only (its grid depends on the batch size and the table width,
or on ``max_context`` when given); capture one and refill its ``block_tables`` /
``context_lengths`` buffers in place before each replay: the kernels read the lengths on the
device and split each sequence's real context. A prefill plan's work items are fixed by the query
offsets it was made with, so a captured prefill replays only the same query layout.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from backend_core.validation import (
    CheckMemo,
    addresses,
    arg_key,
    checked_tensor,
    may_overlap,
    require_data,
    require_disjoint,
    require_disjoint_from,
    require_float,
    require_int32_span,
    require_non_overlapping,
    require_shape,
    require_tensor,
    require_unit_stride,
    signature_of,
)

from .fp8 import FP8_DTYPES
from .registry import registry_for

# the longest sequence a block table may describe: the kernels keep token positions in int32, and a
# context, a window and a partition's length added together must not pass 2^31
MAX_TABLE_TOKENS = 1 << 30
# softmax_scale's range: a normal fp32 number (the kernels scale the logits in fp32)
FP32_MIN_NORMAL, FP32_MAX = 2.0 ** -126, float.fromhex("0x1.fffffep+127")

__all__ = ["PAProblem", "PABatch", "WriteProblem", "PAPlan", "plan_decode", "plan_prefill", "eager_plan", "check_batch",
           "check_layer", "prepare_attention", "prepare_write", "BLOCK_SIZES", "HEAD_DIMS"]

ACT_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32,)
SLOT_DTYPES = (torch.int32, torch.int64)
BLOCK_SIZES = tuple(range(16, 129, 16))  # every multiple of 16 up to 128 (vLLM --block-size)
HEAD_DIMS = (64, 128, 256)
MAX_GQA = 16
MAX_QUERY_LENGTH = 4


@dataclass
class KVCache:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    num_blocks: int
    Hkv: int
    D: int
    block_size: int
    _addresses: Optional[list] = None

    def addresses(self) -> list:
        """Address summaries of the four tensors (for the output-overlap check), made once."""
        if self._addresses is None:
            self._addresses = addresses([("key_cache", self.key_cache), ("value_cache", self.value_cache),
                                         ("key_scale", self.key_scale), ("value_scale", self.value_scale)])
        return self._addresses

    @property
    def v_transposed(self) -> bool:
        """True for the 5-D value layout [num_blocks, Hkv, block_size/16, D, 16]."""
        return self.value_cache.dim() == 5

    @property
    def k_per_token(self) -> bool:
        return self.key_scale.dim() == 3

    @property
    def v_per_token(self) -> bool:
        return self.value_scale.dim() == 3


@dataclass
class PAProblem:
    """A validated pa_decode / pa_prefill call. Decode is the ragged form with equal lengths."""

    query: torch.Tensor  # [T, Hq, D]
    cache: KVCache
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lengths: torch.Tensor  # [num_seqs] int32
    query_start_loc: Optional[torch.Tensor]  # [num_seqs + 1] int32 (prefill) or None (decode)
    query_start_loc_host: Optional[Tuple[int, ...]]  # its checked values on the host (prefill)
    query_length: int  # decode: rows per sequence; prefill: 0
    num_seqs: int
    Hq: int
    softmax_scale: float
    sliding_window: int
    sinks: Optional[torch.Tensor]  # [Hq] fp32
    num_partitions: Optional[int]
    out: torch.Tensor
    plan: Optional[object] = None  # the PAPlan running it (implementations keep per-plan launch state there)
    # what an implementation's coverage check may read of this layer but the addresses (check_layer, memoized):
    # the layer tensors' shapes, dtypes, strides and alignment, the scale, the window, the partition hint
    layer_key: Optional[tuple] = None

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def is_decode(self) -> bool:
        return self.query_start_loc is None


@dataclass
class WriteProblem:
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    cache: KVCache
    slot_mapping: torch.Tensor  # [T]
    # the call's check-memo key (prepare_write): every argument's address, shape, strides, dtype and device
    # (a launch made for one key is right for every call with it); None where the memo could not keep it
    memo_key: Optional[tuple] = None

    @property
    def device(self) -> torch.device:
        return self.key.device


def _check_cache(key_cache, value_cache, key_scale, value_scale, device, anchor: str) -> KVCache:
    key_cache = checked_tensor(key_cache, "key_cache", device, FP8_DTYPES, anchor=anchor)
    if key_cache.dim() != 5 or int(key_cache.shape[4]) != 16:
        raise ValueError("key_cache: expected shape [num_blocks, Hkv, D/16, block_size, 16], got "
                         f"{list(key_cache.shape)}")
    NB, Hkv, D16, bs, _ = (int(s) for s in key_cache.shape)
    D = 16 * D16
    if D not in HEAD_DIMS:
        raise ValueError(f"key_cache: head dim D = 16 * {D16} = {D} not in {HEAD_DIMS}")
    if bs not in BLOCK_SIZES:
        raise ValueError(f"key_cache: block_size {bs} not in {BLOCK_SIZES} (a multiple of 16 up to 128)")
    if NB < 1 or Hkv < 1:
        raise ValueError(f"key_cache: expected at least one block and one KV head, got {list(key_cache.shape)}")
    require_unit_stride(key_cache, "key_cache")
    require_non_overlapping(key_cache, "key_cache")

    value_cache = checked_tensor(value_cache, "value_cache", device, (key_cache.dtype,), anchor=anchor)
    if value_cache.dim() == 4:
        require_shape(value_cache, "value_cache", (NB, Hkv, D, bs), "[num_blocks, Hkv, D, block_size]")
    elif value_cache.dim() == 5:
        require_shape(value_cache, "value_cache", (NB, Hkv, bs // 16, D, 16), "[num_blocks, Hkv, block_size/16, D, 16]")
    else:
        raise ValueError(
            f"value_cache: expected [num_blocks, Hkv, D, block_size] or [num_blocks, Hkv, block_size/16, D, 16], "
            f"got {list(value_cache.shape)}")
    require_unit_stride(value_cache, "value_cache")
    require_non_overlapping(value_cache, "value_cache")
    # the kernels offset blocks and KV heads in int64 and everything inside one (block, head) slice in int32
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_int32_span(t[0, 0], name, "one (block, KV head) slice")
    if may_overlap(key_cache, value_cache):
        raise ValueError("value_cache: shares memory with key_cache; the K and V caches must be separate "
                         "(they may interleave in one allocation, as vLLM's pages do, but no byte may be shared)")

    scales = []
    for name, sc in (("key_scale", key_scale), ("value_scale", value_scale)):
        sc = checked_tensor(sc, name, device, (torch.float32,), anchor=anchor)
        if sc.dim() == 0 or (sc.dim() == 1 and int(sc.shape[0]) == 1):
            sc = sc.reshape(())
        elif sc.dim() == 3:
            require_shape(sc, name, (NB, Hkv, bs), "[num_blocks, Hkv, block_size] (per token)")
            require_unit_stride(sc, name)
            require_non_overlapping(sc, name)
            require_int32_span(sc[0, 0], name, "one (block, KV head) slice")
        else:
            raise ValueError(f"{name}: expected a per-tensor scale (0-dim or [1]) or per-token [num_blocks, Hkv, "
                             f"block_size] = [{NB}, {Hkv}, {bs}], got shape {list(sc.shape)}")
        scales.append(sc)
    return KVCache(key_cache, value_cache, scales[0], scales[1], NB, Hkv, D, bs)


@dataclass
class PABatch:
    """The per-batch arguments of a paged-attention call, checked once (a plan holds one)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lengths: torch.Tensor  # [num_seqs] int32 (any stride)
    query_start_loc: Optional[torch.Tensor]  # [num_seqs + 1] int32 (prefill) or None (decode)
    query_start_loc_host: Optional[Tuple[int, ...]]  # its checked values (prefill)
    query_length: int  # decode rows per sequence; 0 for prefill
    num_seqs: int
    _addresses: Optional[list] = None
    _key: Optional[tuple] = None

    def addresses(self) -> list:
        """Address summaries of the batch tensors (for the output-overlap check), made once."""
        if self._addresses is None:
            self._addresses = addresses([("block_tables", self.block_tables), ("context_lengths", self.context_lengths),
                                         ("query_start_loc", self.query_start_loc)])
        return self._addresses

    def memo_key(self) -> tuple:
        """What ``check_layer`` reads of the batch (the per-call memo's part of it), made once."""
        if self._key is None:
            qsl = self.query_start_loc_host
            self._key = (arg_key(self.block_tables), arg_key(self.context_lengths), arg_key(self.query_start_loc),
                         self.query_length, self.num_seqs, qsl[-1] if qsl else None)
        return self._key

    @property
    def device(self) -> torch.device:
        return self.block_tables.device

    @property
    def is_decode(self) -> bool:
        return self.query_start_loc is None


def check_batch(*, block_tables, context_lengths, query_length=1, query_start_loc=None,
                query_start_loc_host: Optional[Sequence[int]] = None, prefill: bool = False,
                device: Optional[torch.device] = None, anchor: str = "block_tables") -> PABatch:
    """Validate the batch-level arguments (tables, lengths, query layout). Decode reads no tensor
    data; prefill checks the query offsets on the host: from ``query_start_loc_host`` when the
    caller holds them (the adapters do: no sync), else by reading ``query_start_loc`` once."""
    if device is None:
        device = require_tensor(block_tables, "block_tables").device
    block_tables = checked_tensor(block_tables, "block_tables", device, INDEX_DTYPES, anchor=anchor)
    if block_tables.dim() != 2 or int(block_tables.shape[1]) < 1:
        raise ValueError(f"block_tables: expected shape [num_seqs, max_blocks], got {list(block_tables.shape)}")
    require_unit_stride(block_tables, "block_tables")
    N = int(block_tables.shape[0])
    context_lengths = checked_tensor(context_lengths, "context_lengths", device, INDEX_DTYPES, anchor=anchor)
    require_shape(context_lengths, "context_lengths", (N,), "[num_seqs]")
    if prefill:
        query_start_loc = checked_tensor(query_start_loc, "query_start_loc", device, INDEX_DTYPES, anchor=anchor)
        require_shape(query_start_loc, "query_start_loc", (N + 1,), "[num_seqs + 1]")
        name = "query_start_loc_host"  # the offsets checked are the caller's host copy, when given
        if query_start_loc_host is None:
            require_data(query_start_loc, "query_start_loc")
            query_start_loc_host = query_start_loc.tolist()  # host sync (eager pa_prefill only)
            name = "query_start_loc"
        query_start_loc_host = check_query_start_loc(query_start_loc_host, N, None, name=name)
        query_length = 0
    else:
        if isinstance(query_length, bool) or not isinstance(query_length, int):
            raise TypeError(f"query_length: expected an int, got {type(query_length).__name__}")
        if not 1 <= query_length <= MAX_QUERY_LENGTH:
            raise ValueError(f"query_length: expected 1..{MAX_QUERY_LENGTH}, got {query_length}")
        query_start_loc = None
        query_start_loc_host = None
    return PABatch(block_tables, context_lengths, query_start_loc, query_start_loc_host, query_length, N)


# Checks memoized on what they read (backend_core.validation.CheckMemo): a server's layers pass their
# tensors at the same addresses, shapes and strides step after step. Keys: each tensor's address, shape,
# strides, dtype and device, every other argument with its type, the anchor device, and for a layer the
# batch's own key.
_CALL_MEMO = CheckMemo(4096)  # (layers x distinct activation buffers, and each layer's caches) of a few models


def checked_cache(key_cache, value_cache, key_scale, value_scale, device, anchor: str) -> KVCache:
    """``_check_cache`` memoized on what it reads, so the layers of a model are checked once per
    process, not per call."""
    key = ("cache", device, arg_key(key_cache), arg_key(value_cache), arg_key(key_scale), arg_key(value_scale))
    hit = _CALL_MEMO.get(key)
    if hit is not None:
        return _cache_from_facts(key_cache, value_cache, key_scale, value_scale, hit)
    cache = _check_cache(key_cache, value_cache, key_scale, value_scale, device, anchor)
    _CALL_MEMO.put(key, device, _cache_facts(cache))
    return cache


def _cache_facts(cache: KVCache) -> tuple:
    return (cache.num_blocks, cache.Hkv, cache.D, cache.block_size, cache.addresses())


def _cache_from_facts(key_cache, value_cache, key_scale, value_scale, facts: tuple) -> KVCache:
    """A checked cache around the caller's own tensors; a per-tensor scale ([1] or 0-dim) read as 0-dim."""
    NB, Hkv, D, bs, addrs = facts
    ks = key_scale if key_scale.dim() != 1 else key_scale.reshape(())
    vs = value_scale if value_scale.dim() != 1 else value_scale.reshape(())
    return KVCache(key_cache, value_cache, ks, vs, NB, Hkv, D, bs, addrs)


def check_layer(batch: PABatch, *, query, key_cache, value_cache, key_scale, value_scale, softmax_scale=None,
                sliding_window=0, sinks=None, num_partitions=None, out=None, anchor: str = "query") -> PAProblem:
    """Validate one layer's arguments against a checked batch: cheap (shapes, dtypes; the checks are
    memoized on what they read, so a server's layers are checked in full once). Nothing is written."""
    key = ("layer", anchor, batch.memo_key(), arg_key(query), arg_key(key_cache), arg_key(value_cache),
           arg_key(key_scale), arg_key(value_scale), arg_key(softmax_scale), arg_key(sliding_window), arg_key(sinks),
           arg_key(num_partitions), arg_key(out))
    hit = _CALL_MEMO.get(key)
    if hit is not None:
        facts, Hq, softmax_scale, sliding_window, layer_key = hit
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        return PAProblem(query=query, cache=_cache_from_facts(key_cache, value_cache, key_scale, value_scale, facts),
                         block_tables=batch.block_tables, context_lengths=batch.context_lengths,
                         query_start_loc=batch.query_start_loc, query_start_loc_host=batch.query_start_loc_host,
                         query_length=batch.query_length, num_seqs=batch.num_seqs, Hq=Hq,
                         softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
                         num_partitions=num_partitions, out=out, layer_key=layer_key)
    p = _check_layer(batch, query=query, key_cache=key_cache, value_cache=value_cache, key_scale=key_scale,
                     value_scale=value_scale, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
                     num_partitions=num_partitions, out=out, anchor=anchor)
    c = p.cache
    # an output made here (out=None) is a fresh contiguous tensor like the query at every call: the same key
    p.layer_key = (signature_of(p.query, c.key_cache, c.value_cache, c.key_scale, c.value_scale, p.out, p.sinks),
                   p.softmax_scale, p.sliding_window, p.num_partitions)
    _CALL_MEMO.put(key, batch.device, (_cache_facts(p.cache), p.Hq, p.softmax_scale, p.sliding_window, p.layer_key))
    return p


def _check_layer(batch: PABatch, *, query, key_cache, value_cache, key_scale, value_scale, softmax_scale,
                 sliding_window, sinks, num_partitions, out, anchor: str) -> PAProblem:
    device = batch.device
    query = checked_tensor(query, "query", device, ACT_DTYPES,
                           anchor=None if anchor == "query" else anchor)
    require_data(query, "query")  # shapes and strides are checked on meta tensors too; data from here on
    cache = checked_cache(key_cache, value_cache, key_scale, value_scale, device, "query")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [tokens, Hq, D], got {list(query.shape)}")
    T, Hq, D = (int(s) for s in query.shape)
    if D != cache.D:
        raise ValueError(f"query: head dim {D} does not match the cache's {cache.D}")
    if Hq % cache.Hkv or not 1 <= Hq // cache.Hkv <= MAX_GQA:
        raise ValueError(f"query: Hq={Hq} must be a multiple of Hkv={cache.Hkv} with a ratio of 1..{MAX_GQA}")
    require_unit_stride(query, "query")
    if T:  # rows are offset in int64, heads inside a row in int32 (a heads-outermost query can pass it)
        require_int32_span(query[0], "query", "one token's row (all heads)")
    N = batch.num_seqs
    if batch.is_decode:
        if T != N * batch.query_length:
            raise ValueError(f"query: expected {N} sequences x query_length {batch.query_length} = "
                             f"{N * batch.query_length} rows, got {T}")
    elif batch.query_start_loc_host[-1] > T:
        raise ValueError(f"query_start_loc: the last offset {batch.query_start_loc_host[-1]} is past the query's "
                         f"{T} rows")

    softmax_scale = require_float(softmax_scale, "softmax_scale", positive=True, optional=True)
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    elif not FP32_MIN_NORMAL <= softmax_scale <= FP32_MAX:  # the kernels scale the logits in fp32
        raise ValueError(f"softmax_scale: expected a normal fp32 number ({FP32_MIN_NORMAL:.3g} .. {FP32_MAX:.3g}), got "
                         f"{softmax_scale!r}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window: expected an int (0 = off), got {type(sliding_window).__name__}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window: expected >= 0 (0 = off), got {sliding_window}")
    table_tokens = int(batch.block_tables.shape[1]) * cache.block_size
    if table_tokens > MAX_TABLE_TOKENS:
        raise ValueError(f"block_tables: {int(batch.block_tables.shape[1])} blocks of {cache.block_size} tokens = "
                         f"{table_tokens} tokens per sequence; at most {MAX_TABLE_TOKENS} (2^30: the kernels keep "
                         "token positions in int32)")
    if sliding_window >= table_tokens:
        sliding_window = 0  # at least as wide as any context the table holds: no window
    if sinks is not None:
        sinks = checked_tensor(sinks, "sinks", device, (torch.float32,), anchor="query")
        require_shape(sinks, "sinks", (Hq,), "[Hq]")
        require_unit_stride(sinks, "sinks")
    if num_partitions is not None:
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
            raise ValueError(f"num_partitions: expected None or an int >= 1, got {num_partitions!r}")

    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        out = checked_tensor(out, "out", device, (query.dtype,), anchor="query")
        require_shape(out, "out", tuple(query.shape), "the query's shape")
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, got strides {tuple(out.stride())}")
        require_disjoint_from("out", out, addresses([("query", query), ("sinks", sinks)]) + cache.addresses()
                              + batch.addresses())
    return PAProblem(query=query, cache=cache, block_tables=batch.block_tables, context_lengths=batch.context_lengths,
                     query_start_loc=batch.query_start_loc, query_start_loc_host=batch.query_start_loc_host,
                     query_length=batch.query_length, num_seqs=N, Hq=Hq,
                     softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
                     num_partitions=num_partitions, out=out)


def _query_batch(query, *, block_tables, context_lengths, query_length, query_start_loc, query_start_loc_host,
                 prefill: bool) -> Tuple[torch.Tensor, PABatch]:
    """An eager call's query and batch, anchored at the query's device (the query is checked first)."""
    device = require_tensor(query, "query").device
    query = checked_tensor(query, "query", device, ACT_DTYPES)
    require_data(query, "query")
    return query, check_batch(block_tables=block_tables, context_lengths=context_lengths, query_length=query_length,
                              query_start_loc=query_start_loc, query_start_loc_host=query_start_loc_host,
                              prefill=prefill, device=device, anchor="query")


def prepare_attention(*, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                      query_length=1, query_start_loc=None, softmax_scale=None, sliding_window=0, sinks=None,
                      num_partitions=None, out=None, prefill: bool = False,
                      query_start_loc_host: Optional[Sequence[int]] = None) -> PAProblem:
    """Validate a whole pa_decode (``prefill=False``) or pa_prefill call: ``check_batch`` then
    ``check_layer``, anchored at the query's device. Nothing is written. (The reference and the coverage
    checks take the problem as is; the eager ops run the same checks through ``eager_plan``.)"""
    query, batch = _query_batch(query, block_tables=block_tables, context_lengths=context_lengths,
                                query_length=query_length, query_start_loc=query_start_loc,
                                query_start_loc_host=query_start_loc_host, prefill=prefill)
    return check_layer(batch, query=query, key_cache=key_cache, value_cache=value_cache, key_scale=key_scale,
                       value_scale=value_scale, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
                       num_partitions=num_partitions, out=out)


def _offset(v) -> int:
    """An integer offset (``operator.index``: Python and NumPy ints, integer 0-d tensors); TypeError for a
    bool, a float or anything else (``int()`` would truncate or parse it)."""
    if isinstance(v, bool):
        raise TypeError
    return operator.index(v)


def check_query_start_loc(values: Sequence[int], num_seqs: int, num_rows: Optional[int],
                          name: str = "query_start_loc") -> Tuple[int, ...]:
    """Host-side check of prefill query offsets: ``num_seqs + 1`` ints, first >= 0, non-decreasing,
    last <= ``num_rows`` (the query's rows; None: checked later against the query). Returns them
    as a tuple of ints. ``name``: the argument the errors name (the device tensor or its host copy)."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        qsl = tuple(_offset(v) for v in values)
    except TypeError:
        raise TypeError(f"{name}: expected {num_seqs + 1} integers, got {values!r}") from None
    if len(qsl) != num_seqs + 1:
        raise ValueError(f"{name}: expected {num_seqs + 1} offsets (num_seqs + 1), got {len(qsl)}")
    if qsl[0] < 0:
        raise ValueError(f"{name}: expected a first offset >= 0, got {qsl[0]}")
    for s in range(num_seqs):
        if qsl[s + 1] < qsl[s]:
            raise ValueError(f"{name}: expected non-decreasing offsets, got {qsl[s]} then {qsl[s + 1]} "
                             f"(sequence {s})")
    if num_rows is not None and qsl[-1] > num_rows:
        raise ValueError(f"{name}: the last offset {qsl[-1]} is past the query's {num_rows} rows")
    return qsl


def prepare_write(*, key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale) -> WriteProblem:
    """Validate a write_kv call (memoized on what the checks read, as ``check_layer``). Nothing is written."""
    memo = ("write", arg_key(key), arg_key(value), arg_key(key_cache), arg_key(value_cache), arg_key(slot_mapping),
            arg_key(key_scale), arg_key(value_scale))
    hit = _CALL_MEMO.get(memo)
    if hit is not None:
        return WriteProblem(key=key, value=value, slot_mapping=slot_mapping, memo_key=memo,
                            cache=_cache_from_facts(key_cache, value_cache, key_scale, value_scale, hit))
    p = _prepare_write(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                       key_scale=key_scale, value_scale=value_scale)
    if _CALL_MEMO.put(memo, p.device, _cache_facts(p.cache)):
        p.memo_key = memo
    return p


def _prepare_write(*, key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale) -> WriteProblem:
    anchor = "key"
    device = require_tensor(key, "key").device
    key = checked_tensor(key, "key", device, ACT_DTYPES, anchor=anchor)
    cache = checked_cache(key_cache, value_cache, key_scale, value_scale, device, anchor)
    if key.dim() != 3:
        raise ValueError(f"key: expected shape [tokens, Hkv, D], got {list(key.shape)}")
    T = int(key.shape[0])
    require_shape(key, "key", (T, cache.Hkv, cache.D), "[tokens, Hkv, D]")
    require_unit_stride(key, "key")
    value = checked_tensor(value, "value", device, (key.dtype,), anchor=anchor)
    require_shape(value, "value", (T, cache.Hkv, cache.D), "[tokens, Hkv, D]")
    require_unit_stride(value, "value")
    slot_mapping = checked_tensor(slot_mapping, "slot_mapping", device, SLOT_DTYPES, anchor=anchor)
    require_shape(slot_mapping, "slot_mapping", (T,), "[tokens]")
    require_data(key, "key")
    # the caches (and per-token scales, which the write stores) share no memory with anything else
    ks, vs = cache.key_scale, cache.value_scale
    require_disjoint(
        [("key_cache", cache.key_cache), ("value_cache", cache.value_cache),
         ("key_scale", ks if cache.k_per_token else None), ("value_scale", vs if cache.v_per_token else None)],
        [("key", key), ("value", value), ("slot_mapping", slot_mapping),
         ("key_scale", None if cache.k_per_token else ks), ("value_scale", None if cache.v_per_token else vs)])
    return WriteProblem(key=key, value=value, cache=cache, slot_mapping=slot_mapping)


# -- the plan: checked once per batch, run per layer ------------------------------------------------------------

class PAPlan:
    """A checked batch plus the per-batch state implementations keep (``state``)."""

    def __init__(self, batch: PABatch, *, max_context: Optional[int] = None, backend: str = "auto",
                 anchor: str = "block_tables", site_depth: int = 1):
        """``anchor``: the argument whose device the layer's tensors must share (an eager call's: the query);
        ``site_depth``: frames between the user's call and ``run`` (for the once-per-call-site log line)."""
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 0):
            raise ValueError(f"max_context: expected None or an int >= 0, got {max_context!r}")
        self.batch = batch
        batch.memo_key()  # the batch tensors' layout as planned (run refuses a batch resized since)
        self.max_context = max_context  # an upper bound on every context (None: the table width)
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str ('auto' or an implementation name), got {type(backend).__name__}")
        self.backend = backend
        self.state: dict = {}  # implementation launch state, keyed by the implementation and layer shape
        self._impls: dict = {}  # layer signature -> Implementation (chosen once)
        self._registry = registry_for(batch)  # the op (decode or prefill), told from the batch once
        self._anchor = anchor
        self._site_depth = site_depth

    @property
    def device(self) -> torch.device:
        return self.batch.device

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def is_decode(self) -> bool:
        return self.batch.is_decode

    def run(self, query, key_cache, value_cache, key_scale, value_scale, *, softmax_scale: Optional[float] = None,
            sliding_window: int = 0, sinks=None, num_partitions: Optional[int] = None,
            out: Optional[torch.Tensor] = None, backend: Optional[str] = None,
            before_launch: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """One layer's attention over the planned batch. Arguments as in :func:`pa_decode` /
        :func:`pa_prefill` (``query`` [T, Hq, D]; ``out`` filled in place and returned).
        ``backend`` overrides the plan's choice (an adapter's per-layer setting). ``before_launch()``
        runs once every argument is checked, before any kernel: an adapter's write of the step's new
        K/V there leaves the caches untouched when the call is refused."""
        # checked before anything else: a falsy or unhashable override must not fall back to the plan's choice
        # or fail inside the memo below with an unrelated error
        chosen = self.backend if backend is None else backend
        if not isinstance(chosen, str):
            raise TypeError(f"backend: expected None or a str ('auto' or an implementation name), got "
                            f"{type(backend).__name__}")
        if before_launch is not None and not callable(before_launch):
            raise TypeError(f"before_launch: expected None or a callable, got {type(before_launch).__name__}")
        b = self.batch
        if (arg_key(b.block_tables), arg_key(b.context_lengths), arg_key(b.query_start_loc)) != b.memo_key()[:3]:
            # resized or re-strided in place since the plan was made (refilling their values is fine)
            raise ValueError("block_tables / context_lengths / query_start_loc: changed shape, strides or storage "
                             "since the plan was made; make a new plan for this batch")
        p = check_layer(self.batch, query=query, key_cache=key_cache, value_cache=value_cache, key_scale=key_scale,
                        value_scale=value_scale, softmax_scale=softmax_scale, sliding_window=sliding_window,
                        sinks=sinks, num_partitions=num_partitions, out=out, anchor=self._anchor)
        p.plan = self
        # everything an implementation's coverage check may read but the addresses (the layers of a step share
        # one choice; check_layer keeps it with its memo): shapes, dtypes, strides, alignment, scale, window
        # (FlyDSL's AITER kernel takes contiguous caches and no softmax_scale: a layer with interleaved K/V
        # pages or another scale must be chosen for anew)
        sig = (p.layer_key, chosen)
        impl = self._impls.get(sig)
        if impl is None:
            impl = self._impls[sig] = self._registry.select(p, chosen, device_type=p.device.type,
                                                            site_depth=self._site_depth)
        if before_launch is not None:
            before_launch()
        return impl.run(p)


def plan_decode(block_tables, context_lengths, *, query_length: int = 1, max_context: Optional[int] = None,
                backend: str = "auto") -> PAPlan:
    """Plan a decode batch: ``block_tables`` [num_seqs, max_blocks] int32, ``context_lengths``
    [num_seqs] int32 (new tokens included; read on the device at run time, so the buffers may be
    refilled between runs), ``query_length`` rows per sequence (1..4). ``max_context``: an upper
    bound on every context the plan will run with (None: the table width; CUDA graphs should
    leave it None or give the largest context they will replay)."""
    return PAPlan(check_batch(block_tables=block_tables, context_lengths=context_lengths, query_length=query_length),
                  max_context=max_context, backend=backend)


def plan_prefill(block_tables, query_start_loc, context_lengths, *,
                 query_start_loc_host: Optional[Sequence[int]] = None,
                 max_context: Optional[int] = None, backend: str = "auto") -> PAPlan:
    """Plan a ragged batch (extend, chunked prefill, mixed): ``query_start_loc`` [num_seqs + 1]
    int32 on the device and, to avoid a host sync, its values on the host
    (``query_start_loc_host``: a list or CPU tensor; checked non-decreasing from >= 0). The work
    items (chunks of query rows) are made from them once, on the first run."""
    if isinstance(query_start_loc_host, torch.Tensor):
        if query_start_loc_host.device.type != "cpu":
            raise ValueError("query_start_loc_host: expected host values (a list or a CPU tensor), got a tensor on "
                             f"{query_start_loc_host.device}")
        query_start_loc_host = query_start_loc_host.tolist()
    return PAPlan(check_batch(block_tables=block_tables, context_lengths=context_lengths,
                              query_start_loc=query_start_loc, query_start_loc_host=query_start_loc_host, prefill=True),
                  max_context=max_context, backend=backend)


def eager_plan(query, block_tables, context_lengths, *, query_length: int = 1, query_start_loc=None,
               prefill: bool = False, backend: str = "auto") -> PAPlan:
    """The one-layer plan of an eager ``pa_decode`` / ``pa_prefill`` call: the query checked first and the batch
    anchored at its device (the errors of ``prepare_attention``); prefill reads ``query_start_loc`` once on the
    host."""
    _, batch = _query_batch(query, block_tables=block_tables, context_lengths=context_lengths,
                            query_length=query_length, query_start_loc=query_start_loc, query_start_loc_host=None,
                            prefill=prefill)
    return PAPlan(batch, backend=backend, anchor="query", site_depth=2)
