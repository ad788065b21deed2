"""Paged-attention cases for tests, ``verify`` and benchmarks.

``make_pa_case`` lays out a cache the way serving engines do: blocks of each sequence scattered
by a random permutation, block-table entries past a sequence's extent holding ids of *other*
sequences' live pages (stale entries), and every unused page filled with FP8 NaN bytes so a
stray read poisons the output. K/V are written through the reference ``write_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .contract import prepare_write
from .fp8 import fp8_max, fp8_nan_byte
from .reference import run_write

__all__ = ["PACase", "make_pa_case"]


@dataclass
class PACase:
    kwargs: Dict[str, object]  # pa_decode / pa_prefill keyword arguments (query_length or query_start_loc)
    prefill: bool
    context_lengths: List[int]
    query_lengths: List[int]
    used_blocks: List[int]
    desc: str

    def call(self, backend: str = "auto", **overrides):
        from . import pa_decode, pa_prefill

        kw = dict(self.kwargs)
        kw.update(overrides)
        return (pa_prefill if self.prefill else pa_decode)(**kw, backend=backend)


def make_pa_case(
    context_lengths: Sequence[int],
    *,
    query_length: int = 1,
    query_lengths: Optional[Sequence[int]] = None,  # prefill: per-sequence rows (ragged)
    Hq: int = 4,
    Hkv: int = 1,
    D: int = 64,
    block_size: int = 16,
    v_layout: str = "4d",  # "4d" [NB, Hkv, D, bs] or "5d" [NB, Hkv, bs/16, D, 16]
    scales: str = "tensor",  # "tensor" or "token"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    sliding_window: int = 0,
    sinks: bool = False,
    spare_blocks: int = 3,
    extra_table: int = 2,  # table columns past the longest sequence (stale entries)
    act_dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
) -> PACase:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = len(context_lengths)
    prefill = query_lengths is not None
    qls = list(query_lengths) if prefill else [query_length] * N
    blocks_per_seq = [(c + block_size - 1) // block_size for c in context_lengths]
    used = sum(blocks_per_seq)
    NB = used + spare_blocks + 1
    perm = torch.randperm(NB, generator=g).tolist()
    max_blocks = max(blocks_per_seq + [1]) + extra_table

    nan = fp8_nan_byte(fp8_dtype)
    key_cache = torch.full((NB, Hkv, D // 16, block_size, 16), nan, dtype=torch.uint8).view(fp8_dtype).to(device)
    if v_layout == "4d":
        value_cache = torch.full((NB, Hkv, D, block_size), nan, dtype=torch.uint8)
    elif v_layout == "5d":
        value_cache = torch.full((NB, Hkv, block_size // 16, D, 16), nan, dtype=torch.uint8)
    else:
        raise ValueError(f"v_layout: expected '4d' or '5d', got {v_layout!r}")
    value_cache = value_cache.view(fp8_dtype).to(device)
    if scales == "tensor":
        key_scale = torch.tensor(0.02, device=device)
        value_scale = torch.tensor([0.015], device=device)
    elif scales == "token":
        key_scale = torch.full((NB, Hkv, block_size), float("nan"), device=device)
        value_scale = torch.full((NB, Hkv, block_size), float("nan"), device=device)
    else:
        raise ValueError(f"scales: expected 'tensor' or 'token', got {scales!r}")

    tables = torch.zeros(N, max_blocks, dtype=torch.int32)
    live_blocks: List[int] = []
    cursor = 0
    for s, nb in enumerate(blocks_per_seq):
        ids = perm[cursor:cursor + nb]
        cursor += nb
        live_blocks.extend(ids)
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):  # stale entries: other sequences' live pages
        for j in range(nb, max_blocks):
            tables[s, j] = live_blocks[(s * 7 + j) % len(live_blocks)] if live_blocks else perm[-1]
    tables = tables.to(device)

    # K/V of every token, written through the reference writer (values span the FP8 range)
    total = sum(context_lengths)
    if total:
        # drawn on the device when it is a GPU (the GPU grid writes millions of tokens per case)
        gk = g if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)
        key = (torch.randn(total, Hkv, D, generator=gk, device=gk.device) * 0.02 * fp8_max(fp8_dtype) / 3
               ).to(act_dtype).to(device)
        value = (torch.randn(total, Hkv, D, generator=gk, device=gk.device) * 0.015 * fp8_max(fp8_dtype) / 3
                 ).to(act_dtype).to(device)
        slot_mapping = torch.cat([tables[s, torch.arange(c, device=device) // block_size].long() * block_size
                                  + torch.arange(c, device=device) % block_size
                                  for s, c in enumerate(context_lengths)])
        run_write(prepare_write(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                slot_mapping=slot_mapping, key_scale=key_scale, value_scale=value_scale))

    T = sum(qls)
    query = torch.randn(T, Hq, D, generator=g).to(act_dtype).to(device)
    kwargs: Dict[str, object] = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables,
        context_lengths=torch.tensor(list(context_lengths), dtype=torch.int32, device=device),
        key_scale=key_scale, value_scale=value_scale, sliding_window=sliding_window,
        out=torch.full((T, Hq, D), float("nan"), dtype=act_dtype, device=device))
    if sinks:
        kwargs["sinks"] = (torch.randn(Hq, generator=g) * 2).to(device)
    if prefill:
        qsl = [0]
        for q in qls:
            qsl.append(qsl[-1] + q)
        kwargs["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32, device=device)
    else:
        kwargs["query_length"] = query_length
    desc = (f"N={N} ctx={list(context_lengths)[:4]}{'...' if N > 4 else ''} ql={qls[:4] if prefill else query_length} "
            f"Hq={Hq} Hkv={Hkv} D={D} bs={block_size} v={v_layout} scales={scales} "
            f"{str(fp8_dtype).replace('torch.float8_', '')}{' win=' + str(sliding_window) if sliding_window else ''}"
            f"{' sinks' if sinks else ''}{' prefill' if prefill else ''}")
    return PACase(kwargs=kwargs, prefill=prefill, context_lengths=list(context_lengths), query_lengths=qls,
                  used_blocks=live_blocks, desc=desc)
