"""Reference paged attention over the FP8 cache: gather pages, dequantize with the same scales,
FP32 softmax. Readable loops over sequences; docs/design.md §4 is the specification.

* ``dequantize_tokens`` reads tokens 0..n-1 of one sequence through its block table.
* ``run_attention`` executes a validated decode or prefill problem.
* ``run_write`` quantizes K/V into the cache (x / scale, saturating; per-token scales computed; a NaN is the
  one positive NaN byte, as the kernels store it, whatever sign the division gave on this device).

Both run without autograd: they write the caller's buffers in place, as the kernels do, so a cache never
becomes a graph node that keeps every written key alive, and a scale that requires grad is written too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .fp8 import fp8_max, fp8_nan_byte

if TYPE_CHECKING:  # annotations only (the contract imports the registries, which import this)
    from .contract import KVCache, PAProblem, WriteProblem

__all__ = ["dequantize_tokens", "run_attention", "run_write", "attend_rows"]


def _token_positions(block_row: torch.Tensor, n: int, bs: int):
    j = torch.arange(n, device=block_row.device)
    return block_row[j // bs].long(), j % bs


def dequantize_tokens(cache: KVCache, block_row: torch.Tensor, n: int, dtype=torch.float32):
    """K, V of tokens 0..n-1 as [n, Hkv, D] in ``dtype``; only the first ceil(n/bs) table entries are read."""
    if n == 0:
        empty = torch.zeros(0, cache.Hkv, cache.D, dtype=dtype, device=block_row.device)
        return empty, empty.clone()
    blocks, offs = _token_positions(block_row, n, cache.block_size)
    # key_cache[b, h, d // 16, t, d % 16] -> [n, Hkv, D]
    k = cache.key_cache[blocks, :, :, offs, :].to(dtype).reshape(n, cache.Hkv, cache.D)
    if cache.v_transposed:  # value_cache[b, h, t // 16, d, t % 16]
        v = cache.value_cache[blocks, :, offs // 16, :, offs % 16].to(dtype)
    else:  # value_cache[b, h, d, t]
        v = cache.value_cache[blocks, :, :, offs].to(dtype)
    ks = cache.key_scale.to(dtype)
    vs = cache.value_scale.to(dtype)
    if cache.k_per_token:
        ks = cache.key_scale[blocks, :, offs].to(dtype)[:, :, None]
    if cache.v_per_token:
        vs = cache.value_scale[blocks, :, offs].to(dtype)[:, :, None]
    return k * ks, v * vs


def attend_rows(q, k, v, ctx: int, ql: int, *, softmax_scale: float, sliding_window: int, sinks, group: int):
    """Causal attention of ql query rows [ql, Hq, D] (the last ql tokens of a ctx-token sequence)."""
    out = torch.zeros_like(q)
    for i in range(ql):
        last = ctx - ql + i  # row i sees tokens 0..last
        if last < 0:
            continue  # no token to attend: zero output
        first = max(0, last - sliding_window + 1) if sliding_window > 0 else 0
        kk = k[first:last + 1].repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = v[first:last + 1].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[i], kk) * softmax_scale  # [Hq, n]
        m = logits.max(dim=-1, keepdim=True).values
        if sinks is not None:
            m = torch.maximum(m, sinks[:, None])
        p = torch.exp(logits - m)
        denom = p.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks[:, None] - m)
        out[i] = torch.einsum("hn,nhd->hd", p / denom, vv)
    return out


@torch.no_grad()
def run_attention(p: PAProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    f = compute_dtype
    group = p.Hq // p.cache.Hkv
    max_tokens = p.block_tables.shape[1] * p.cache.block_size
    sinks = None if p.sinks is None else p.sinks.to(f)
    for s in range(p.num_seqs):
        ctx = int(p.context_lengths[s])
        if p.is_decode:
            r0, ql = s * p.query_length, p.query_length
        else:
            r0 = p.query_start_loc_host[s]
            ql = p.query_start_loc_host[s + 1] - r0
        if ql <= 0:
            continue
        if not 0 <= ctx <= max_tokens:
            raise ValueError(f"context_lengths: sequence {s} has {ctx} tokens; its block table row holds {max_tokens}")
        ids = p.block_tables[s, :-(-ctx // p.cache.block_size)]
        if ids.numel() and not bool(((ids >= 0) & (ids < p.cache.num_blocks)).all()):
            raise ValueError(f"block_tables: sequence {s} names a block outside 0..{p.cache.num_blocks - 1} inside its "
                             f"{ctx}-token extent (the reference checks this; the kernels do not)")
        k, v = dequantize_tokens(p.cache, p.block_tables[s], ctx, f)
        o = attend_rows(p.query[r0:r0 + ql].to(f), k, v, ctx, ql, softmax_scale=p.softmax_scale,
                        sliding_window=p.sliding_window, sinks=sinks, group=group)
        p.out[r0:r0 + ql] = o.to(p.out.dtype)
    if p.is_decode:
        return p.out
    # prefill rows outside [qsl[0], qsl[N]) belong to no sequence: zero
    start, end = p.query_start_loc_host[0], p.query_start_loc_host[p.num_seqs]
    p.out[:start].zero_()
    p.out[end:].zero_()
    return p.out


@torch.no_grad()
def run_write(p: WriteProblem) -> None:
    """Quantize and scatter all tokens at once (vectorized: test caches hold millions of tokens)."""
    c = p.cache
    fmax = fp8_max(c.key_cache.dtype)
    slots = p.slot_mapping.long()
    keep = (slots >= 0) & (slots < c.num_blocks * c.block_size)  # -1: padding; past the cache: skipped
    slots = slots[keep]
    b, off = slots // c.block_size, slots % c.block_size
    for x, cache, scale, per_token, is_key in ((p.key[keep], c.key_cache, c.key_scale, c.k_per_token, True),
                                               (p.value[keep], c.value_cache, c.value_scale, c.v_per_token, False)):
        xf = x.float()  # [n, Hkv, D]
        if per_token:
            # amax / fmax as an IEEE division on every device: torch's CUDA kernel divides by a Python number as
            # a multiplication by its reciprocal (an ulp off the quotient for about half of the tokens), a
            # tensor divisor is divided by
            fmax_t = torch.full((), fmax, dtype=torch.float32, device=xf.device)
            sc = (xf.abs().amax(dim=-1) / fmax_t).clamp_min(torch.finfo(torch.float32).tiny)  # [n, Hkv]
            scale[b, :, off] = sc
            q = xf / sc[:, :, None]
        else:
            q = xf / scale.float()
        # a NaN's sign follows the device's division (x86's inf / inf is -NaN, CUDA's +NaN): one byte for all
        nan = torch.tensor(fp8_nan_byte(cache.dtype), dtype=torch.uint8, device=q.device)
        q = torch.where(q.isnan(), nan, q.clamp(-fmax, fmax).to(cache.dtype).view(torch.uint8)).view(cache.dtype)
        if is_key:  # key_cache[b, h, d // 16, t, d % 16]
            cache[b, :, :, off, :] = q.view(-1, c.Hkv, c.D // 16, 16)
        elif c.v_transposed:  # value_cache[b, h, t // 16, d, t % 16]
            cache[b, :, off // 16, :, off % 16] = q
        else:  # value_cache[b, h, d, t]
            cache[b, :, :, off] = q
