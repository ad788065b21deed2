"""Decode at the engines' shapes: short and mid contexts, many layers per graph (H200; nothing here ships).

Why: in SGLang's engine on the H200 (batch 64, contexts of a few hundred tokens, decode graphs) one layer's
attention took partition 10.3 us + reduce 8.3 us (+ write_kv 1.8 us) against SGLang's own Triton decode
6.3 + 2.1 us (pa_probe/sglang_kernels_profile_H200_2026-12-04.txt, at 591771e whose reduce was later
reverted). The bench cases are all long contexts; this probe times the short ones a chat server mostly runs,
against SGLang's kernel on the same FP8 values.

Each case: B sequences of one context length (or the mixed 32..2048), heads of the e2e tiny model (Hq 8 /
Hkv 2) or of Llama-3.1-8B (32 / 8), D 128, page 16, per-tensor scales; tables 1k tokens wide (where the
context fits) and 128k. LAYERS distinct caches share one block table, as a model's layers do; a CUDA graph
captures one call per layer and the row is the replay time per layer call (median). Every variant's layer-0
output is checked against the float64 reference first; round 0 also profiles the kernels (device us per call).

Variants (PROBE_VARIANTS, comma-separated):
  tree       the shipped kernels and plan (shape-only plan, as under CUDA graphs)
  minpt128 / minpt64 / minpt32   partitions may be as short as 128 / 64 / 32 tokens (MIN_PARTITION_TOKENS,
             shipped 256):
             more tasks in flight for short contexts, more partials to merge
  direct     direct_variant.py: an item whose context fits one partition writes its rows from that task, and
             the reduce skips it (sm_90 compile: the one-warp program spills 108 bytes instead of 4, all of them
             outside the tile loops: 27 stores before the task loop, 27 reloads per task; aot.hot_spill_count)
  nreg152 / nreg128    the one-warp program capped at 152 / 128 registers instead of 168 (13 / 16 programs per
             SM instead of 12; FLYDSL_BACKENDS_PA_TRITON_MAXNREG): ptxas keeps the tile loops spill-free at both
             caps (68 / 108 spill bytes, reloaded once per task)
  sglang     SGLang 0.5.23's decode_attention_fwd on the same values (sglang_baseline.py), when importable:
             its two kernels per layer in the graph; its per-step split-count kernel in the profile only
  vllm       vLLM 0.33.0's TRITON_ATTN forward (vllm_baseline.py: its metadata builder, KV layout and FP8 query
             as on CUDA), when importable

Run on the GPU machine from the repo root, SGLang's or vLLM's Python tree on the path for its baseline
(device_run.sh probe-short / probe-short-vllm; one framework per process):
  python3 benchmarks/pa_probe/short_probe.py [max_seconds]
PROBE_LAYERS (default 8), PROBE_CASES=quick (a subset) change the work."""
import importlib
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from pa_backend import plan_decode  # noqa: E402
from pa_backend import planner  # noqa: E402
from pa_backend.benchmark import accuracy, bench_case, kv_bytes, mixed_lengths  # noqa: E402
from pa_backend.triton import pa_decode as kmod  # noqa: E402

ARGS = ("query", "key_cache", "value_cache", "key_scale", "value_scale")
HEADS = {"tiny": (8, 2), "llama8b": (32, 8)}
D = 128
QUICK = os.environ.get("PROBE_CASES", "") == "quick"
# PROBE_CASES=small: few (sequence, KV head) pairs (B x Hkv <= the SM count), short to long contexts, and two cases
# with more work to see what a lower partition floor costs there
SMALL = os.environ.get("PROBE_CASES", "") == "small"
# PROBE_DRY=1: every variant's accuracy on tiny cases on CPU (TRITON_INTERPRET=1), nothing timed (checks the
# probe itself before a GPU call)
DRY = os.environ.get("PROBE_DRY", "") == "1"
DEVICE = "cpu" if DRY else "cuda"
# (heads, B, context: an int or (lo, hi) for mixed lengths)
CASES = ([("tiny", 64, 128), ("llama8b", 64, 512)] if QUICK else
         [("tiny", B, c) for B in (4, 16) for c in (128, 512, 2048, 8192)] + [("llama8b", 16, 128), ("llama8b", 16, 2048),
                                                                          ("tiny", 64, 512), ("llama8b", 64, 512)]
         if SMALL else
         [(h, B, c) for h in ("tiny", "llama8b") for B in (16, 64) for c in (128, 512, 2048)]
         + [("llama8b", 128, 512), ("llama8b", 64, (32, 2048))])
WIDTHS = (1024, 1 << 17)
if DRY:
    HEADS = {"tiny": (8, 2), "llama8b": (8, 1)}
    CASES, WIDTHS = [("tiny", 3, 40), ("llama8b", 2, 300), ("tiny", 4, (5, 600))], (1024, 4096)


def profile_kernels(fn, match, runs=20) -> str:
    """"name us, ..." device time per call of the kernels whose name contains one of ``match``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return ", ".join(f"{ev.key[:40]} {ev.device_time_total / runs:.1f} us" for ev in prof.key_averages()
                     if any(m in ev.key for m in match))


class Flydsl:
    """The tree's plan and kernels with a variant's settings in place while it is planned and run."""

    def __init__(self, min_pt=None, kernels=None, maxnreg=None):
        self.min_pt, self.kernels, self.maxnreg = min_pt, kernels, maxnreg

    def __enter__(self):
        self.saved = (planner.MIN_PARTITION_TOKENS, kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel,
                      os.environ.get("FLYDSL_BACKENDS_PA_TRITON_MAXNREG"))
        if self.min_pt:
            planner.MIN_PARTITION_TOKENS = self.min_pt
        if self.kernels:
            kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel = self.kernels
        if self.maxnreg:  # read by register_cap when the plan's launch state is made (inside this block)
            os.environ["FLYDSL_BACKENDS_PA_TRITON_MAXNREG"] = str(self.maxnreg)
        planner.plan_partitions.cache_clear()
        return self

    def __exit__(self, *exc):
        planner.MIN_PARTITION_TOKENS, kmod.pa_decode_partition_kernel, kmod.pa_decode_reduce_kernel, nreg = self.saved
        if nreg is None:
            os.environ.pop("FLYDSL_BACKENDS_PA_TRITON_MAXNREG", None)
        else:
            os.environ["FLYDSL_BACKENDS_PA_TRITON_MAXNREG"] = nreg
        planner.plan_partitions.cache_clear()

    def build(self, layers, outs):
        kw0 = layers[0]
        plan = plan_decode(kw0["block_tables"], kw0["context_lengths"], backend="triton")
        args = [{k: kw[k] for k in ARGS} for kw in layers]
        return [lambda a=a, o=o: plan.run(**a, out=o) for a, o in zip(args, outs)]


# the frameworks' own decode kernels on the same values: variant -> (package, builder module)
BASELINES = {"sglang": ("sglang", "sglang_baseline"), "vllm": ("vllm", "vllm_baseline")}


def baseline_builder(name):
    package, module = BASELINES[name]
    if importlib.util.find_spec(package) is None:
        print(f"{name} baseline: {package} is not importable here", flush=True)
        return None
    if name == "vllm":  # the stand-ins for vLLM's CUDA extensions, as the GPU engine runs use them
        from integration_tests.e2e import vllm_gpu

        vllm_gpu.prepare()
    return importlib.import_module(module).build


def variants():
    out = {"tree": Flydsl(), "minpt128": Flydsl(min_pt=128), "minpt64": Flydsl(min_pt=64), "minpt32": Flydsl(min_pt=32),
           "nreg152": Flydsl(maxnreg=152), "nreg128": Flydsl(maxnreg=128)}
    try:
        from direct_variant import direct_kernels
        out["direct"] = Flydsl(kernels=direct_kernels())
    except Exception as exc:  # noqa: BLE001
        print(f"direct variant unavailable: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for name in BASELINES:
        build = baseline_builder(name)
        if build is not None:
            out[name] = build
    return out


def run_variant(name, v, layers, nbytes, copy, label, rnd):
    outs = [torch.empty_like(kw["query"]) for kw in layers]
    if isinstance(v, Flydsl):
        with v:
            calls = v.build(layers, outs)
            match = ("pa_decode",)
            return _measure(name, calls, outs, layers, nbytes, copy, label, rnd, match)
    launches, outs = [], []
    for kw in layers:
        if DRY:  # Triton 3.6's interpreter multiplies bf16 dot operands as integers: hand the baselines FP16
            kw = dict(kw, query=kw["query"].half())  # (exact for these values)
        launch, o = v(kw)
        launches.append(launch)
        outs.append(o)
    # The per-step device work (SGLang's split counts, outside its graphs; none for vLLM) runs once before the
    # graph, which times the per-layer kernels; the profile shows both. Both frameworks take Q and P in FP8
    # (SGLang's grouped kernel; vLLM quantizes the query on CUDA): ~3e-2 from the float64 reference, so the
    # baselines are held to 6e-2.
    for la in launches:
        la.step()
    return _measure(name, [la.layer for la in launches], outs, layers, nbytes, copy, label, rnd,
                    ("decode", "fwd_kernel", "stage", "num_kv_splits", "unified_attention", "reduce_segments"),
                    max_err=6e-2, profiled=launches[0])


def _measure(name, calls, outs, layers, nbytes, copy, label, rnd, match, max_err=1e-2, profiled=None):
    outs[0].fill_(float("nan"))
    calls[0]()
    err = accuracy(layers[0], outs[0])
    if not err < max_err:
        print(f"  {label} {name}: rel.err {err:.2e}: not timed", flush=True)
        return
    if DRY:
        print(f"  {label} {name}: rel.err {err:.1e} (dry run: not timed)", flush=True)
        return
    n = len(calls)
    t = time_cuda_graph(lambda i: calls[i % n](), inner=n, trials=30)
    ks = profile_kernels(profiled or calls[0], match) if rnd == 0 else ""
    pct = 100 * nbytes / (t.median_us * 1e-6) / 1e9 / copy
    print(f"  {label} round {rnd} {name}: {t.median_us:.1f} us per layer ({pct:.1f}% of copy) rel.err {err:.1e}"
          f"{'; ' + ks if ks else ''}", flush=True)


def main():
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
    t0 = time.time()
    nlayers = int(os.environ.get("PROBE_LAYERS", 2 if DRY else 8))
    vs = variants()
    pick = [v for v in os.environ.get("PROBE_VARIANTS", ",".join(vs)).split(",") if v in vs]
    copy = 1.0 if DRY else copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s; layers per graph {nlayers}; variants {pick}", flush=True)
    for heads, B, ctx in CASES:
        Hq, Hkv = HEADS[heads]
        lens = mixed_lengths(B, *ctx) if isinstance(ctx, tuple) else ctx
        top = max(lens) if isinstance(lens, list) else lens
        for width in WIDTHS:
            if width < top or time.time() - t0 > budget:
                continue
            layers = [bench_case(B, lens, 1, Hq, Hkv, D, 16, "tensor", DEVICE, seed=s, table_tokens=width)
                      for s in range(nlayers)]
            for kw in layers[1:]:  # one block table for every layer, as in a model
                kw["block_tables"], kw["context_lengths"] = layers[0]["block_tables"], layers[0]["context_lengths"]
            nbytes = kv_bytes(B, layers[0]["context_lengths"].tolist(), Hkv, D, "tensor")
            label = f"{heads} B={B} ctx={ctx} table={width}"
            for rnd in range(2):
                for name in pick:
                    if time.time() - t0 > budget:
                        print("  budget reached", flush=True)
                        break
                    try:
                        run_variant(name, vs[name], layers, nbytes, copy, label, rnd)
                    except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the others
                        print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            del layers
            if not DRY:
                torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
