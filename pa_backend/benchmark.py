"""``flydsl-backends bench pa``: FP8 paged decode timed by CUDA-graph replay, and prefill.

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

from backend_core.timing import bench_context, result_row, time_cuda_graph, time_eager

from .verify import ACCURACY_TARGET

__all__ = ["bench_case", "gather_sdpa", "run_bench", "accuracy", "DEFAULT_CONFIGS", "PREFILL_CONFIGS", "kv_bytes"]

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
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0,
               tables: str = "random") -> Dict[str, object]:
    """pa_decode keyword arguments for B sequences of ``ctx`` tokens, built on ``device``.
    ``tables="random"`` scatters each sequence's pages over the whole cache (a long-running
    server's pool); ``"sequential"`` gives each sequence consecutive blocks (page locality)."""
    if tables not in ("random", "sequential"):
        raise ValueError(f"tables={tables!r}: expected 'random' or 'sequential'")
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
    order = (torch.randperm(NB - 1, generator=g, device=device) if tables == "random"
             else torch.arange(NB - 1, device=device))
    block_tables = order[: B * nb].view(B, nb).to(torch.int32)
    if scales == "tensor":
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.015, device=device)
    else:
        ks = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
        vs = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
    return dict(query=torch.randn((B * ql, Hq, D), generator=g, device=device).to(torch.bfloat16),
                key_cache=kc, value_cache=vc, block_tables=block_tables,
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


# Prefill (B sequences, prefix tokens already cached, new tokens, Hq, Hkv, D, block_size, scales):
# chunked prefill behind a prefix, and a fresh prompt batch, for a GQA-8 model.
PREFILL_CONFIGS: List[Tuple[int, int, int, int, int, int, int, str]] = [
    (4, 6144, 2048, 32, 8, 128, 16, "tensor"),
    (8, 0, 1024, 32, 8, 128, 16, "tensor"),
]


def accuracy(kw: Dict[str, object], out: torch.Tensor, seqs: int = 2) -> float:
    """Relative error of ``out`` on the first ``seqs`` sequences against the float64 reference on
    the same (dequantized) cache."""
    import dataclasses

    from .contract import prepare_attention
    from .reference import run_attention

    sub = dict(kw)
    n = min(seqs, int(kw["block_tables"].shape[0]))
    rows = (int(kw["query_start_loc"][n]) if "query_start_loc" in kw else n * int(kw["query_length"]))
    sub.update(query=kw["query"][:rows], block_tables=kw["block_tables"][:n], context_lengths=kw["context_lengths"][:n])
    if "query_start_loc" in kw:
        sub["query_start_loc"] = kw["query_start_loc"][:n + 1]
    ref = torch.empty(sub["query"].shape, dtype=torch.float64, device=out.device)
    p = prepare_attention(**sub, prefill="query_start_loc" in kw)
    run_attention(dataclasses.replace(p, out=ref), compute_dtype=torch.float64)
    return ((out[:rows].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _baseline_fits(B: int, ctx: int, Hkv: int, D: int, ql: int, Hq: int) -> Tuple[bool, str]:
    need = 8 * B * ctx * Hkv * D + 4 * B * Hq * ql * ctx  # bf16 K, V and their dequantized copies; the scores
    free = torch.cuda.mem_get_info()[0]
    if need > 0.6 * free:
        return False, f"baseline needs ~{need / 2**30:.0f} GiB of temporaries, {free / 2**30:.0f} GiB free"
    return True, ""


def run_bench(configs: Sequence[Tuple] = DEFAULT_CONFIGS, impls: Sequence[str] = ("triton",), trials: int = 30,
              baseline: bool = True, prefill_configs: Sequence[Tuple] = PREFILL_CONFIGS,
              progress=print) -> List[Dict[str, object]]:
    """Decode rows (CUDA-graph replay, median of ``trials``) and prefill rows (eager: the Triton
    prefill reads its metadata on the host), each implementation's accuracy in the notes."""
    from . import REGISTRY, pa_decode, pa_prefill

    usable = []
    for impl in impls:
        ok, why = REGISTRY.get(impl).is_available()
        if ok:
            usable.append(impl)
        else:
            progress(f"  {impl}: not timed ({why})")
    impls = usable
    run = bench_context(progress)
    dev, copy = run.device, run.copy_gbps
    rows: List[Dict[str, object]] = []
    jobs = [("pa_decode", c) for c in configs] + [("pa_prefill", c) for c in prefill_configs]
    for op, (B, ctx, ql, Hq, Hkv, D, bs, scales) in jobs:
        prefill = op == "pa_prefill"
        if prefill:  # ctx is the cached prefix, ql the new tokens
            total, new = ctx + ql, ql
        else:
            total, new = ctx, ql
        kw = bench_case(B, total, new, Hq, Hkv, D, bs, scales, dev)
        if prefill:
            kw.pop("query_length")
            kw["query_start_loc"] = torch.arange(0, B + 1, dtype=torch.int32, device=dev) * new
        nbytes = kv_bytes(B, total, Hkv, D, scales)
        flops = 4 * B * Hq * D * sum(total - new + 1 + i for i in range(new))
        shape = (f"B={B} ctx={total} ql={new} Hq={Hq} Hkv={Hkv} D={D} page={bs} scales={scales}"
                 + (f" prefix={ctx}" if prefill else ""))
        out = torch.empty_like(kw["query"])
        call = pa_prefill if prefill else pa_decode
        fns = {impl: (lambda i, impl=impl: call(**kw, out=out, backend=impl)) for impl in impls}
        if baseline:
            fits, why = _baseline_fits(B, total, Hkv, D, new, Hq)
            if fits:
                fns["torch_gather_sdpa"] = lambda i: gather_sdpa(**{**kw, "query_length": new})
            else:
                progress(f"  {shape}: torch_gather_sdpa skipped ({why})")
        line = f"  {op} {shape}:"
        for name, fn in fns.items():
            try:
                res = fn(0)
                err = accuracy(kw, res)
                t = (time_eager(fn, trials=trials, device=dev) if prefill
                     else time_cuda_graph(fn, inner=2, trials=trials, device=dev))
            except Exception as exc:  # e.g. a FlyDSL source that does not cover this case
                progress(f"  {shape}: {name} not timed: {type(exc).__name__}: {exc}")
                continue
            gbps = nbytes / (t.median_us * 1e-6) / 1e9
            tflops = flops / (t.median_us * 1e-6) / 1e12
            ok = "meets" if err <= ACCURACY_TARGET else "MISSES"
            note = (f"rel_err={err:.2e} ({ok} {ACCURACY_TARGET:g}; first 2 sequences vs float64 reference); "
                    f"{tflops:.1f} TFLOP/s; logical bytes = FP8 K+V (+ per-token scales) read once"
                    + ("; eager timing" if prefill else ""))
            rows.append(result_row(run, op, name, shape, t, nbytes, note))
            line += f" {name} {t.median_us:.1f} us ({100 * gbps / copy:.0f}% of copy, err {err:.1e})"
        progress(line)
        del kw, out, fns
        torch.cuda.empty_cache()
    return rows
