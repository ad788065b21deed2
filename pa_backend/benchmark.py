"""``flydsl-backends bench pa``: FP8 paged attention at serving shape (docs/design.md §4.1).

Every case uses block tables as wide as a server's (``table_tokens``, default 128k tokens, or the
context when longer): the columns past each sequence's context hold garbage block ids, as stale
entries in a real server's tables do. Each row states its table width. Decode is timed by CUDA-graph
replay of a shape-only plan (``plan_decode``; what a server captures) and eagerly; prefill by graph
replay of a planned batch bounded by its longest context (``max_context``, as both adapters plan it).
``exact`` rows repeat two cases with exact-width tables, so the cost of the width shows directly.
``host`` rows give the host time of one layer's call: ``plan.run`` (what the adapters call per layer)
against the eager op (validation, selection and planning per call).

Caches are built on the device (random FP8 bytes drawn from a normal, random block permutation),
so the 10 GB configurations start in seconds. Logical bytes = the K and V bytes of every context
token read once (plus per-token scales), so GB/s compares directly with the copy bandwidth.
The baseline in the same run is what a user without a paged kernel would do: gather the pages,
dequantize to the query dtype and call ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from backend_core.timing import bench_context, result_row, time_cuda_graph, time_eager

from .verify import ACCURACY_TARGET

__all__ = ["bench_case", "gather_sdpa", "run_bench", "accuracy", "DEFAULT_CONFIGS", "PREFILL_CONFIGS", "kv_bytes",
           "mixed_lengths", "null_kernels", "host_overhead", "layer_sets"]

TABLE_TOKENS = 1 << 17  # a server's max-model-len (vLLM's block_table_tensor, SGLang's req_to_token width)

# (B, context, query_length, Hq, Hkv, D, block_size, scales): the targets, then variants
DEFAULT_CONFIGS: List[Tuple[int, int, int, int, int, int, int, str]] = [
    (81, 8192, 1, 16, 1, 128, 16, "tensor"),
    (200, 32768, 1, 16, 1, 128, 16, "tensor"),
    (200, 200_000, 4, 16, 1, 128, 16, "tensor"),
    (32, 2048, 1, 32, 8, 128, 16, "tensor"),
    (81, 8192, 1, 16, 1, 128, 64, "tensor"),
    (81, 8192, 1, 8, 1, 128, 16, "tensor"),
    (81, 8192, 1, 16, 1, 128, 16, "token"),
    # a chat server's step: Llama-3.1-8B heads, 64 sequences of 512 tokens (launch and latency, not bandwidth)
    (64, 512, 1, 32, 8, 128, 16, "tensor"),
]
# the same cases with exact-width tables (the convenient shape: the difference is the width's cost)
EXACT_CONFIGS = [DEFAULT_CONFIGS[0], DEFAULT_CONFIGS[3]]
# a mixed batch: B=64 contexts spread over 100..32k in one 128k-wide table
MIXED_CONFIG = (64, (100, 32768), 1, 16, 1, 128, 16, "tensor")


def mixed_lengths(B: int, lo: int, hi: int) -> List[int]:
    """B context lengths spread evenly over [lo, hi], in a seeded shuffled order (the mixed batch)."""
    g = torch.Generator().manual_seed(1)
    return [int(x) for x in torch.linspace(lo, hi, B)[torch.randperm(B, generator=g)]]


def kv_bytes(B: int, ctx, Hkv: int, D: int, scales: str) -> int:
    """FP8 K and V bytes of every context token (``ctx``: one length or a list per sequence)."""
    tokens = sum(ctx) if isinstance(ctx, (list, tuple)) else B * ctx
    n = 2 * tokens * Hkv * D
    return n + (2 * tokens * Hkv * 4 if scales == "token" else 0)


def bench_case(B: int, ctx, ql: int, Hq: int, Hkv: int, D: int, bs: int, scales: str, device,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0, tables: str = "random",
               table_tokens: int = 0) -> Dict[str, object]:
    """pa_decode keyword arguments for B sequences of ``ctx`` tokens (an int, or one per sequence),
    built on ``device``. ``tables="random"`` scatters each sequence's pages over the whole cache (a
    long-running server's pool); ``"sequential"`` gives each sequence consecutive blocks.
    ``table_tokens``: the table's width in tokens (0: exactly the longest context); the columns
    past a sequence's context hold garbage block ids (anywhere in the cache)."""
    if tables not in ("random", "sequential"):
        raise ValueError(f"tables={tables!r}: expected 'random' or 'sequential'")
    lens = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx] * B
    g = torch.Generator(device=device).manual_seed(seed)
    nbs = [-(-c // bs) for c in lens]
    width = max(max(nbs), -(-table_tokens // bs))
    NB = sum(nbs) + 1
    kc = torch.empty((NB, Hkv, D // 16, bs, 16), dtype=fp8_dtype, device=device)
    vc = torch.empty((NB, Hkv, D, bs), dtype=fp8_dtype, device=device)
    for cache in (kc, vc):  # in chunks: a bf16 staging copy of 10 GB of FP8 would not fit comfortably
        flat = cache.view(NB, -1)
        for i in range(0, NB, 4096):
            part = flat[i:i + 4096]
            part.copy_((torch.randn(part.shape, generator=g, device=device) * 64).clamp_(-240, 240).to(fp8_dtype))
    order = (torch.randperm(NB - 1, generator=g, device=device) if tables == "random"
             else torch.arange(NB - 1, device=device))
    block_tables = torch.randint(0, NB, (B, width), generator=g, device=device, dtype=torch.int32)  # garbage
    start = 0
    for s, nb in enumerate(nbs):
        block_tables[s, :nb] = order[start:start + nb].to(torch.int32)
        start += nb
    if scales == "tensor":
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.015, device=device)
    else:
        ks = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
        vs = torch.rand((NB, Hkv, bs), generator=g, device=device) * 0.02 + 0.01
    return dict(query=torch.randn((B * ql, Hq, D), generator=g, device=device).to(torch.bfloat16),
                key_cache=kc, value_cache=vc, block_tables=block_tables,
                context_lengths=torch.tensor(lens, dtype=torch.int32, device=device),
                key_scale=ks, value_scale=vs, query_length=ql)


def gather_sdpa(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                query_length: int = 1, ctx: int = 0, **_unused) -> torch.Tensor:
    """Baseline: gather every sequence's pages, dequantize, SDPA. Assumes one context length, a
    multiple of the block size, given as ``ctx`` (what ``bench_case`` builds with ``ctx % bs == 0``:
    only the first ctx / bs table columns are gathered; 0: the whole table row), and the 4-D V
    layout; no host sync."""
    NB, Hkv, D16, bs, _sixteen = key_cache.shape
    nb = ctx // bs if ctx else int(block_tables.shape[1])  # 0: the table is exactly as wide as the context
    ctx = nb * bs
    block_tables = block_tables[:, :nb]
    B = int(block_tables.shape[0])
    D = D16 * 16
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
    (1, 30720, 2048, 32, 8, 128, 16, "tensor"),  # chunked prefill: 2048 new tokens on a 30k prefix
]


def accuracy(kw: Dict[str, object], out: torch.Tensor, seqs: int = 2) -> float:
    """Relative error of ``out`` on the first ``seqs`` sequences against the float64 reference on
    the same (dequantized) cache (inf when those rows are not finite)."""
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
    err = ((out[:rows].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else float("inf")  # a NaN would compare as passing in max()


def _baseline_fits(B: int, ctx: int, Hkv: int, D: int, ql: int, Hq: int) -> Tuple[bool, str, int]:
    """(fits, why not, the free bytes to keep for it): the baseline's temporaries must take at most 60% of
    the free memory."""
    need = 8 * B * ctx * Hkv * D + 4 * B * Hq * ql * ctx  # bf16 K, V and their dequantized copies; the scores
    free = torch.cuda.mem_get_info()[0]
    if need > 0.6 * free:
        return False, f"baseline needs ~{need / 2**30:.0f} GiB of temporaries, {free / 2**30:.0f} GiB free", 0
    return True, "", int(need / 0.6)


def _layer_error(kw: Dict[str, object], out: torch.Tensor) -> float:
    """``accuracy`` of a layer's output ``out`` (inf when it is not finite, e.g. still the poison)."""
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return accuracy(kw, out)


def layer_sets(args: Dict[str, torch.Tensor], calls: int, share: float = 0.4,
               free: Optional[int] = None) -> List[Dict[str, torch.Tensor]]:
    """The op arguments of up to ``calls`` layers: ``args`` itself, then copies with their own caches,
    scales and query (counted with an output each), as many as fit in ``share`` of the free device
    memory (``free`` bytes; default: what the device reports, 0 off CUDA). A graph that cycles over
    them reads each layer's pages as a model step does, instead of one cache again. Each copy holds
    other values than every other layer (``_layer_copy``), so a launch that reads another layer's
    tensor computes another output, which the bench's per-layer reference check then sees."""
    q = args["query"]  # each layer also gets an output as large as its query
    per_layer = sum(t.numel() * t.element_size() for t in args.values() if t.dim() > 0) + q.numel() * q.element_size()
    if free is None:
        free = torch.cuda.mem_get_info(q.device)[0] if q.is_cuda else 0
    n = max(1, min(calls, 1 + int(share * free // max(per_layer, 1))))
    return [args] + [_layer_copy(args, j) for j in range(1, n)]


def _layer_copy(args: Dict[str, torch.Tensor], j: int) -> Dict[str, torch.Tensor]:
    """Layer ``j``'s arguments made from layer 0's: the caches and per-token scales with their pages
    rolled by ``j`` (the block tables stay the batch's, so the layer reads other pages' values at the
    same addresses), the query rolled by ``j`` rows and heads, and per-tensor scales (one element)
    times ``1 + j / 8``."""
    out = {}
    for k, t in args.items():
        if t.numel() == 1:  # a per-tensor scale (0-d or [1])
            out[k] = t * (1.0 + j / 8)
        else:  # through the bytes: FP8 tensors have no roll of their own on every device
            dims = (0, 1) if k == "query" else (0,)
            out[k] = t.view(torch.uint8).roll((j,) * len(dims), dims=dims).view(t.dtype)
    return out


# host-time rows' suffix by host_overhead's direct_launch (None: the launch as set)
_LAUNCH_LABEL = {None: "", False: " (Triton's launch)", True: " (direct launch)"}


def host_overhead(kw: Dict[str, object], layers: int = 200, backend: str = "triton",
                  direct_launch: Optional[bool] = None) -> Dict[str, float]:
    """Host microseconds of one layer's call, with the work queued but not waited for: ``plan.run``
    (the plan made once, as the adapters do per batch), the eager ``pa_decode`` (everything per call)
    and ``write_kv`` of the batch's new tokens (the adapters' other per-layer call). ``backend="null"``
    times the host side only (an implementation that returns at once: how the CPU run measures it).
    ``direct_launch`` True / False: the Triton kernels launched directly or through Triton's own path
    (``backend_core.launch``; None: as set), for the before/after of the direct launch. ``kw``: a
    ``bench_case`` (its cache layout: the block size is the K cache's dim 3)."""
    import time

    from backend_core import launch

    from . import pa_decode, plan_decode, write_kv

    args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
    out = torch.empty_like(kw["query"])
    dev = kw["query"].device
    T, Hkv, D = kw["query"].shape[0], kw["key_cache"].shape[1], kw["query"].shape[2]
    new_k = torch.randn((T, Hkv, D), device=dev).to(kw["query"].dtype)
    new_v = torch.randn((T, Hkv, D), device=dev).to(kw["query"].dtype)
    bs = kw["key_cache"].shape[3]
    # each sequence's last slot (its own block, no other sequence's)
    last = (kw["context_lengths"].long() - 1).clamp(min=0)
    blocks = kw["block_tables"].long().gather(1, (last // bs).unsqueeze(1)).squeeze(1)
    slots = (blocks * bs + last % bs).repeat_interleave(T // last.numel())
    res = {}
    was = launch.enabled
    launch.enabled = was if direct_launch is None else direct_launch
    try:
        with (null_kernels() if backend == "null" else contextlib.nullcontext()):
            plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=int(kw["query_length"]))
            for name, fn in (("plan.run", lambda: plan.run(**args, out=out, backend=backend)),
                             ("pa_decode", lambda: pa_decode(**args, block_tables=kw["block_tables"],
                                                             context_lengths=kw["context_lengths"],
                                                             query_length=int(kw["query_length"]), out=out,
                                                             backend=backend)),
                             ("write_kv", lambda: write_kv(new_k, new_v, kw["key_cache"], kw["value_cache"], slots,
                                                           kw["key_scale"], kw["value_scale"], backend=backend))):
                for _ in range(5):
                    fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(layers):
                    fn()
                res[name] = (time.perf_counter() - t0) / layers * 1e6
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
    finally:
        launch.enabled = was
    return res


@contextlib.contextmanager
def null_kernels():
    """A ``null`` implementation of every paged op while the block runs (``backend="null"``, or an
    adapter's ``pa_impl="null"``): it validates, plans and dispatches as any other and then returns at
    once, so a timing loop measures the host side alone, on any machine. Yields a dict counting the
    calls that reached it per op (a check that the timed path really dispatched)."""
    from backend_core.registry import Implementation

    from .registry import REGISTRIES

    calls: Dict[str, int] = {}

    def run_of(op):
        def run(p):
            calls[op] = calls.get(op, 0) + 1
            return getattr(p, "out", None)
        return run

    added = []
    for op, reg in REGISTRIES.items():
        if "null" not in reg.names():
            reg.register(Implementation("null", lambda: (True, "host-time probe"), lambda p: (True, "ok"),
                                        run_of(op), "returns at once (host-time probe)"))
            added.append(reg)
    try:
        yield calls
    finally:
        for reg in added:
            reg._impls.pop("null", None)


def run_bench(configs: Sequence[Tuple] = DEFAULT_CONFIGS, impls: Sequence[str] = ("triton",), trials: int = 30,
              baseline: bool = True, prefill_configs: Sequence[Tuple] = PREFILL_CONFIGS,
              table_tokens: int = TABLE_TOKENS, progress=print, calls_per_graph: int = 16) -> List[Dict[str, object]]:
    """Decode rows (graph replay of a shape-only plan, and eager), the exact-width and mixed-batch
    cases, prefill rows (graph replay of a planned batch) and the per-layer host time; each
    implementation's accuracy in the notes. A graph row's time is one replay of ``calls_per_graph``
    captured calls divided by that count, each call on its own layer's caches (``layer_sets``): each
    carries that share of the graph's launch, as the layers of a server's decode step do. Every row's
    outputs start as NaN; a graph row's error is the worst of its first (eager) call's and of what the
    replays wrote (the outputs poisoned again after the capture), each layer against its own reference."""
    if calls_per_graph < 1:
        raise ValueError(f"calls_per_graph must be >= 1, got {calls_per_graph}")
    from . import REGISTRY, pa_decode, plan_decode, plan_prefill

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
    jobs = ([("pa_decode", c, table_tokens) for c in configs] + [("pa_decode", c, 0) for c in EXACT_CONFIGS]
            + [("pa_decode", MIXED_CONFIG, table_tokens)] + [("pa_prefill", c, table_tokens) for c in prefill_configs])
    for op, (B, ctx, ql, Hq, Hkv, D, bs, scales), width in jobs:
        prefill = op == "pa_prefill"
        mixed = isinstance(ctx, tuple)
        if mixed:
            total, new = mixed_lengths(B, *ctx), ql
        elif prefill:  # ctx is the cached prefix, ql the new tokens
            total, new = ctx + ql, ql
        else:
            total, new = ctx, ql
        kw = bench_case(B, total, new, Hq, Hkv, D, bs, scales, dev, table_tokens=width)
        tw = int(kw["block_tables"].shape[1]) * bs
        if prefill:
            kw.pop("query_length")
            qsl_host = [i * new for i in range(B + 1)]
            kw["query_start_loc"] = torch.tensor(qsl_host, dtype=torch.int32, device=dev)
        nbytes = kv_bytes(B, total, Hkv, D, scales)
        ctx_desc = f"{min(total)}..{max(total)}" if mixed else str(total)
        flops = 0 if mixed else 4 * B * Hq * D * sum(total - new + 1 + i for i in range(new))
        shape = (f"B={B} ctx={ctx_desc} ql={new} Hq={Hq} Hkv={Hkv} D={D} page={bs} scales={scales} table={tw}"
                 + (f" prefix={ctx}" if prefill else "") + (" mixed" if mixed else "")
                 + (" exact" if not width else ""))
        out = torch.empty_like(kw["query"])
        args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
        base, why, keep = (_baseline_fits(B, total, Hkv, D, new, Hq) if baseline and not mixed and total % bs == 0
                           else (False, "", 0))
        # a graph replays calls_per_graph calls as a model step replays its layers: each call reads its own
        # layer's caches (as many copies as fit beside the baseline's temporaries), so no call finds the
        # previous call's pages in L2
        layers = layer_sets(args, calls_per_graph, free=max(0, torch.cuda.mem_get_info(dev)[0] - keep))
        outs = [out] + [torch.empty_like(out) for _ in layers[1:]]
        fns = {}
        for impl in impls:
            if prefill:
                # the adapters bound a prefill plan by the batch's longest context (vLLM's max_seq_len,
                # SGLang's seq_lens_cpu), which they hold on the host: so does the bench
                plan = plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                                    query_start_loc_host=qsl_host, max_context=total, backend=impl)
            else:
                plan = plan_decode(kw["block_tables"], kw["context_lengths"], query_length=new, backend=impl)
            fns[impl] = ("graph", lambda i, plan=plan: plan.run(**layers[i % len(layers)], out=outs[i % len(layers)]))
            if not prefill:
                fns[impl + "_eager"] = ("eager", lambda i, impl=impl: pa_decode(
                    **args, block_tables=kw["block_tables"], context_lengths=kw["context_lengths"], query_length=new,
                    out=out, backend=impl))
        if base:
            fns["torch_gather_sdpa"] = ("graph", lambda i: gather_sdpa(
                **{**kw, **layers[i % len(layers)], "query_length": new, "ctx": total}))
        elif why:
            progress(f"  {shape}: torch_gather_sdpa skipped ({why})")
        line = f"  {op} {shape}:"
        def poison():
            for o in outs:
                o.fill_(float("nan"))

        for name, (mode, fn) in fns.items():
            try:
                poison()  # nothing an earlier row wrote can pass for this row's output
                res = fn(0)
                err = accuracy(kw, res)
                checked = mode == "graph" and name in impls
                t = (time_eager(fn, trials=trials, device=dev) if mode == "eager"
                     else time_cuda_graph(fn, inner=calls_per_graph, trials=trials, device=dev,
                                          after_capture=poison if checked else None))
                if checked:  # what the replays wrote, each layer against its own reference
                    err = max([err] + [_layer_error({**kw, **a}, o) for a, o in zip(layers, outs)])
            except Exception as exc:  # e.g. a FlyDSL source that does not cover this case
                progress(f"  {shape}: {name} not timed: {type(exc).__name__}: {exc}")
                continue
            gbps = nbytes / (t.median_us * 1e-6) / 1e9
            tflops = flops / (t.median_us * 1e-6) / 1e12
            ok = "meets" if err <= ACCURACY_TARGET else "MISSES"
            note = (f"rel_err={err:.2e} ({ok} {ACCURACY_TARGET:g}; first 2 sequences vs float64 reference); "
                    + (f"{tflops:.1f} TFLOP/s; " if flops else "")
                    + f"logical bytes = FP8 K+V (+ per-token scales) read once; {mode} timing"
                    + (f" ({calls_per_graph} calls per replay, {len(layers)} layers' caches)" if mode == "graph"
                       else "") + f"; table {tw} tokens")
            rows.append(result_row(run, op, name, shape, t, nbytes, note))
            line += f" {name} {t.median_us:.1f} us ({100 * gbps / copy:.0f}% of copy, err {err:.1e})"
        progress(line)
        # the case's tensors go before the next case reads the free memory
        kw = out = outs = fns = layers = args = plan = res = None
        torch.cuda.empty_cache()
    # host time of one layer's call (small batch: the GPU keeps up, the host is what is measured)
    kw = bench_case(8, 1024, 1, 32, 8, 128, 16, "tensor", dev, table_tokens=table_tokens)
    for impl in impls:
        # Triton kernels: with the direct launch (the default) and through Triton's own launch path
        for direct in ((False, True) if impl == "triton" else (None,)):
            h = host_overhead(kw, backend=impl, direct_launch=direct)
            how = _LAUNCH_LABEL[direct]
            for name, us in h.items():
                rows.append(dict(result_row(run, "pa_decode_host", f"{impl}:{name}{how}",
                                            "B=8 ctx=1024 Hq=32 Hkv=8 per layer", _point(us), 0,
                                            "host wall time per layer call, work queued not awaited")))
            progress(f"  host per layer ({impl}{how}): " + ", ".join(f"{k} {v:.1f} us" for k, v in h.items()))
    return rows


def _point(us: float):
    from backend_core.timing import Timing

    return Timing(median_us=us, p10_us=us, p90_us=us, trials=1, inner=1)


def add_bench_args(parser) -> None:
    """``flydsl-backends bench pa`` flags."""
    from backend_core.cliargs import nonnegative_int, positive_int

    parser.add_argument("--no-baseline", action="store_true", help="pa: skip the torch gather + SDPA baseline")
    parser.add_argument("--table-tokens", type=nonnegative_int, default=TABLE_TOKENS,
                        help=f"pa: block-table width in tokens (a server's max-model-len; default {TABLE_TOKENS}; "
                             "0: each case's table exactly as wide as its longest context)")
    parser.add_argument("--calls-per-graph", type=positive_int, default=16,
                        help="pa: calls captured per CUDA graph, each reading its own layer's caches (each graph row "
                             "is one replay / this count; a server's step replays every layer in one graph; "
                             "default 16)")
    parser.add_argument("--host", action="store_true",
                        help="pa: only the per-layer host time (plan.run, the eager op, write_kv), printed; runs on "
                             "CPU too (null kernels; on a GPU also the Triton kernels); of the other flags only "
                             "--table-tokens and --trials apply")


def bench_cli(args):
    """``flydsl-backends bench pa``: rows for the CLI to write, or (``--host``) the per-layer host
    time printed here, on any machine (returns the exit status)."""
    if args.host:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        kw = bench_case(8, 1024, 1, 32, 8, 128, 16, "tensor", dev, table_tokens=args.table_tokens)
        width = int(kw["block_tables"].shape[1]) * 16  # the table built (at least the context)
        print(f"pa host time per layer call ({dev}, B=8, Hq=32, Hkv=8, table {width} tokens):")
        # null: the host side alone (any machine); on a GPU also the Triton kernels launched, directly and
        # through Triton's own launch path
        runs = [("null", None)] + ([("triton", False), ("triton", True)] if dev.type == "cuda" else [])
        for impl, direct in runs:
            res = host_overhead(kw, layers=args.trials * 20, backend=impl, direct_launch=direct)
            print(f"  {impl}" + _LAUNCH_LABEL[direct] + ": "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()))
        return 0
    return run_bench(impls=args.impl, trials=args.trials, baseline=not args.no_baseline,
                     table_tokens=args.table_tokens, calls_per_graph=args.calls_per_graph)
