"""``flydsl-backends bench pa``: FP8 paged decode timed by CUDA-graph replay.

Caches are built on the device (random FP8 bytes drawn from a normal, random block permutation),
so the 10 GB configurations start in seconds. Logical bytes = the K and V bytes of every context
token read once (plus per-token scales), so GB/s compares directly with the copy bandwidth.
The baseline in the same run is what a user without a paged kernel would do: gather the pages,
dequantize to the query dtype and call ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from backend_core.timing import bench_context, result_row, time_cuda_graph

__all__ = ["bench_case", "gather_sdpa", "run_bench", "DEFAULT_CONFIGS", "kv_bytes"]

# (B, context, query_length, Hq, Hkv, D, block_size, scales): the targets, then variants
DEFAULT_CONFIGS: List[Tuple[int, int, int, int, int, int, int, str]] = [
    (81, 8192, 1, 16, 1, 128, 16, "tensor"),
    (200, 32768, 1, 16, 1, 128, 16, "tensor"),
    (200, 200_000, 4, 16, 1, 128, 16, "tensor"),
    (81, 8192, 1, 16, 1, 128, 64, "tensor"),
    (81, 8192, 1, 8, 1, 128, 16, "tensor"),
    (81, 8192, 1, 16, 1, 128, 16, "token"),
]


def kv_bytes(B: int, ctx: int, Hkv: int, D: int, scales: str) -> int:
    n = 2 * B * ctx * Hkv * D  # FP8 K and V, one byte each
    return n + (2 * B * ctx * Hkv * 4 if scales == "token" else 0)


def bench_case(B: int, ctx: int, ql: int, Hq: int, Hkv: int, D: int, bs: int, scales: str, device,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0) -> Dict[str, object]:
    """pa_decode keyword arguments for B sequences of ``ctx`` tokens, built on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb = -(-ctx // bs)
    NB = B * nb + 1
    kc = torch.empty((NB, Hkv, D // 16, bs, 16), dtype=fp8_dtype, device=device)
    vc = torch.empty((NB, Hkv, D, bs), dtype=fp8_dtype, device=device)
    for cache in (kc, vc):  # in chunks: a bf16 staging copy of 10 GB of FP8 would not fit comfortably
        flat = cache.view(NB, -1)
        for i in range(0, NB, 4096):
            part = flat[i:i + 4096]
            part.copy_((torch.randn(part.shape, generator=g, device=device) * 64).clamp_(-240, 240).to(fp8_dtype))
    tables = torch.randperm(NB - 1, generator=g, device=device)[: B * nb].view(B, nb).to(torch.int32)
    if scales == "tensor":
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.015, device=device)
    else:
        ks = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
        vs = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
    return dict(query=torch.randn((B * ql, Hq, D), generator=g, device=device).to(torch.bfloat16),
                key_cache=kc, value_cache=vc, block_tables=tables,
                context_lengths=torch.full((B,), ctx, dtype=torch.int32, device=device),
                key_scale=ks, value_scale=vs, query_length=ql)


def gather_sdpa(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                query_length: int = 1, **_) -> torch.Tensor:
    """Baseline: gather every sequence's pages, dequantize, SDPA. Assumes every context fills its
    table row exactly and the 4-D V layout (what ``bench_case`` builds), so it needs no host sync."""
    B, nb = block_tables.shape
    NB, Hkv, D16, bs, _ = key_cache.shape
    D = D16 * 16
    ctx = nb * bs
    dt = query.dtype
    k = key_cache[block_tables.long()]  # [B, nb, Hkv, D/16, bs, 16]
    k = k.permute(0, 2, 1, 4, 3, 5).reshape(B, Hkv, ctx, D).to(dt)
    v = value_cache[block_tables.long()]  # [B, nb, Hkv, D, bs]
    v = v.permute(0, 2, 1, 4, 3).reshape(B, Hkv, ctx, D).to(dt)
    if key_scale.dim() == 3:
        k = k * key_scale[block_tables.long()].permute(0, 2, 1, 3).reshape(B, Hkv, ctx, 1).to(dt)
        v = v * value_scale[block_tables.long()].permute(0, 2, 1, 3).reshape(B, Hkv, ctx, 1).to(dt)
    else:
        k = k * key_scale.to(dt)
        v = v * value_scale.to(dt)
    n = ctx
    Hq = query.shape[1]
    q = query.view(B, query_length, Hq, D).transpose(1, 2)  # [B, Hq, ql, D]
    mask = None
    if query_length > 1:
        pos = torch.arange(n, device=query.device)
        rows = torch.arange(n - query_length, n, device=query.device)
        mask = pos[None, :] <= rows[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)
    return o.transpose(1, 2).reshape(B * query_length, Hq, D)


def run_bench(configs: Sequence[Tuple] = DEFAULT_CONFIGS, impls: Sequence[str] = ("triton",), trials: int = 30,
              baseline: bool = True, progress=print) -> List[Dict[str, object]]:
    from . import pa_decode

    run = bench_context(progress)
    dev, copy = run.device, run.copy_gbps
    rows: List[Dict[str, object]] = []
    for (B, ctx, ql, Hq, Hkv, D, bs, scales) in configs:
        kw = bench_case(B, ctx, ql, Hq, Hkv, D, bs, scales, dev)
        nbytes = kv_bytes(B, ctx, Hkv, D, scales)
        shape = f"B={B} ctx={ctx} ql={ql} Hq={Hq} Hkv={Hkv} D={D} page={bs} scales={scales}"
        out = torch.empty_like(kw["query"])
        fns = {impl: (lambda i, impl=impl: pa_decode(**kw, out=out, backend=impl)) for impl in impls}
        if baseline:
            fns["torch_gather_sdpa"] = lambda i: gather_sdpa(**kw)
        line = f"  {shape}:"
        for name, fn in fns.items():
            try:
                t = time_cuda_graph(fn, inner=2, trials=trials, device=dev)
            except Exception as exc:  # e.g. the baseline running out of memory at 200k
                progress(f"  {shape}: {name} failed: {type(exc).__name__}: {exc}")
                continue
            gbps = nbytes / (t.median_us * 1e-6) / 1e9
            rows.append(result_row(run, "pa_decode", name, shape, t, nbytes,
                                   "logical bytes = FP8 K+V (+ per-token scales) read once"))
            line += f" {name} {t.median_us:.1f} us ({100 * gbps / copy:.0f}% of copy)"
        progress(line)
        del kw, out
        torch.cuda.empty_cache()
    return rows
