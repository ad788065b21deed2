"""Probe: a warp-specialized Gluon partition kernel for the multi-token decode and the prefill (NVIDIA sm_90).

The kernel now lives in pa_backend/triton/gluon_decode.py (opt-in: FLYDSL_BACKENDS_PA_GLUON=1 / all); this probe
launches it with other ring depths and register splits beside the Triton kernel. First run: H100, 2026-12-06
(gluon_H100_2026-12-06.txt): correct in every case; the ql 4 decode 1.03x at the 200k target, 1.06-1.20x on
shorter batches at the shipped ring depth (4); prefill 0.98-1.05x at depth 4 (0.94-1.05x at 3).

Question (benchmarks/NOTES.md, fifteenth session): the ql 4 decode (B=200, 200k context, Hq=16, Hkv=1, D=128,
page 16, per-tensor scales, 128k tables) runs at ~41% of the copy bandwidth on the H200 with the shipped
Triton kernel, bound inside the SM by one warpgroup's serial chain (load, Q.K, softmax, widen V, P.V). The
issue's target is 70%. Prediction: a producer warp that owns the copies (cp.async into a ring of NBUF K/V
slots, handed over with mbarriers) lets the consumer warpgroup's chain run without waiting for memory, and
the two resident CTAs of an SM overlap their chains.

Design (the shipped kernel's split, workspace and reduce are reused unchanged: this replaces only the
partition kernel's grid launch for M = 64 rows, D = 128, 16-token pages, the 4-D value layout, per-tensor
scales, no window):
* grid (items, Hkv, P) as the shipped grid launch; a program's partition [start, end) comes from the same
  device-side split (``_partition_span``);
* worker partition, 1 warp: for each 64-token tile, gathers the tile's 4 block ids and issues cp.async
  copies of K [BT, D] (16-byte pieces of the x-packed layout) and V^T [D, BT] (16 tokens contiguous) into
  slot j % NBUF (tokens past the partition's end are zero-filled: no stale id is dereferenced, no NaN byte
  of an unused slot enters), then hands tile j - NBUF + 1 over once its copies have landed
  (wait_group, proxy fence, mbarrier arrive);
* default partition, 4 warps (one warpgroup): the query as two FP8 tiles in shared memory (hi + lo / 16,
  exact: the shipped ``_split_query_fp8``), S = hi.K^T + (lo.K^T) / 16 on FP8 wgmma straight from the K
  slot, V widened FP8 -> FP16 through registers into a wgmma operand buffer, the slot released, online
  softmax in registers (exp2, log2 units), acc += P.V (P from registers);
* the partial (m in natural-log units, l, acc times the V scale) goes to the shipped workspace (a launch of one
  partition per item, the shipped plan's ``direct``: the output rows).

Prefill (the issue's 3x target over gather + SDPA; the shipped kernel reaches ~294 TFLOP/s on the H200): the
same kernel over the shipped ragged work items (chunks of 32 query rows x GQA 4 = M 128, the shipped plan at
FLYDSL_BACKENDS_PA_PREFILL_M=128). A second consumer warpgroup (a 4-warp worker partition) takes rows 64..127
of the item and reads the same K/V slots (each slot is released by both), so one K/V load serves 128 rows
and the two warpgroups' softmax and dots interleave. One CTA per SM (12 warps with Triton's padding, a cap of
168 registers: consumers 200, producer 72; no spills).

Run on a GPU: ``python3 benchmarks/pa_probe/gluon_decode.py [seconds]`` (accuracy against float64 and the
shipped kernel, then CUDA-graph timings of both, several NBUF; short decode and prefill cases first, then the
ql 4 decode target and the bench's prefill cases). On CPU: ``--compile`` compiles it for sm_90
and prints ptxas' registers / spills (no interpreter runs Gluon).
"""
import faulthandler
import os
import sys

sys.path.insert(0, os.getcwd())


def launch(p, L, nbuf: int = 4, producer_regs: int = 72, consumer_regs: int = 200):
    """The Gluon partition kernel of checked problem ``p`` with the shipped launch state ``L``
    (pa_backend.triton.launch_state), then the shipped reduce (none when L.direct: one partition per item,
    the kernel writes the output rows)."""
    from pa_backend.triton import _clear_unworked_rows, _run_gluon, gluon_covers, gluon_device
    if not (gluon_device(p.device) and gluon_covers(p) and L.BM in (64, 128) and L.qk8 and not L.queue_mode):
        raise ValueError("the Gluon probe covers what the backend's Gluon path does (gluon_covers: D 128, e4m3fn "
                         "caches with 16-byte strides, 16-token pages, 4-D V, per-tensor scales, no window), 64- "
                         "and 128-row items, grid launches")
    if not _clear_unworked_rows(L, p):  # as _run_attention does before it
        return p.out
    return _run_gluon(L, p.sinks if p.sinks is not None else L.ws[0], p, nbuf, producer_regs,
                      _maxnreg(L.BM).get("maxnreg", 0), consumer_regs)


def _maxnreg(BM: int = 64):
    # the launch's register cap. BM 64: Triton pads the warp-specialized program to 8 warps, and without a
    # cap it takes 256 registers per thread (one CTA per SM); 128 gives two, the consumer warpgroup then
    # gets ~184 inside the specialized region (setmaxnreg), the producer warp PRODUCER_REGS. BM 128 (two
    # consumer warpgroups, 12 warps with the padding): one CTA per SM, 168 (GL_MAXNREG_PREFILL)
    from pa_backend.triton import GLUON_MAXNREG, GLUON_MAXNREG_128
    raw = os.environ.get("GL_MAXNREG" if BM == 64 else "GL_MAXNREG_PREFILL",
                         str(GLUON_MAXNREG if BM == 64 else GLUON_MAXNREG_128))
    return {"maxnreg": int(raw)} if raw and raw != "0" else {}


def compile_sm90(nbuf: int = 4, producer_regs: int = 72, prefill: bool = False, consumer_regs: int = 200,
                 direct: bool = True):
    """ptxas' resource numbers for sm_90 (backend_core.aot.ptxas_report; no GPU needed): the ql 4 decode
    (BM 64, GQA 16) or the prefill (BM 128 = 32 rows x GQA 4, ragged chunks; ``direct``: one partition per
    chunk, the output rows written by the kernel, else the workspace)."""
    from pa_backend.triton.resources import gluon_ptxas_report
    return gluon_ptxas_report(nbuf, producer_regs, _maxnreg(128 if prefill else 64).get("maxnreg", 0),
                              rows=128 if prefill else 64, consumer_regs=consumer_regs, direct=prefill and direct)


def _gpu_probe(seconds: float):
    import time
    import torch
    from pa_backend import pa_decode, plan_prefill
    from pa_backend.benchmark import accuracy, bench_case
    from pa_backend.contract import check_layer, prepare_attention
    from pa_backend.triton import launch_state, prefill_tiling
    from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph
    t_end = time.time() + seconds
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbps(device=dev) * 1e9
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)

    def prefill_m(m):  # the shipped prefill tiling's M (None: its default, 256 at D 128)
        if m is None:
            os.environ.pop("FLYDSL_BACKENDS_PA_PREFILL_M", None)
        else:
            os.environ["FLYDSL_BACKENDS_PA_PREFILL_M"] = str(m)
        prefill_tiling.cache_clear()

    # short and ragged cases first (the partition's end, the causal diagonal, a short last chunk: a hang or a
    # wrong row shows early), then the targets (128k tables everywhere). Decode: (B, ctx, new rows); prefill:
    # (B, cached prefix, new rows), GQA 4 (Hq 32, Hkv 8), the bench's prefill cases last.
    cases = [("decode", 5, 70, 4), ("prefill", 2, 100, 70), ("decode", 64, 777, 4), ("prefill", 3, 0, 300),
             ("decode", 8, 3001, 4), ("decode", 32, 8192, 4), ("decode", 200, 200_000, 4),
             ("prefill", 4, 6144, 2048), ("prefill", 1, 30720, 2048), ("prefill", 8, 0, 1024)]
    for kind, B, ctx, ql in cases:
        prefill = kind == "prefill"
        Hq, Hkv = (32, 8) if prefill else (16, 1)
        total = ctx + ql if prefill else ctx
        kw = bench_case(B, total, ql, Hq, Hkv, 128, 16, "tensor", dev, table_tokens=131072)
        layer = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
        if prefill:
            # as the bench and the adapters: a plan per batch from the host offsets, bounded by the longest
            # context (a new plan per tiling: a plan keeps its launch state); its first run (the graph timer's
            # warm-up, outside the capture) makes the chunks
            kw.pop("query_length")
            qsl = [i * ql for i in range(B + 1)]
            kw["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32, device=dev)

            def new_plan():
                return plan_prefill(kw["block_tables"], kw["query_start_loc"], kw["context_lengths"],
                                    query_start_loc_host=qsl, max_context=total, backend="triton")
            plan = new_plan()
            run = lambda out: plan.run(**layer, out=out)  # noqa: E731
            flops = 4 * B * Hq * 128 * sum(total - ql + 1 + i for i in range(ql))
            size = lambda t: f"{flops / (t * 1e-6) / 1e12:.0f} TFLOP/s"  # noqa: E731
        else:
            run = lambda out: pa_decode(**kw, out=out, backend="triton")  # noqa: E731
            nbytes = B * ctx * 128 * 2  # K and V bytes read (Hkv 1, D 128)
            size = lambda t: f"{nbytes / (t * 1e-6) / copy * 100:.1f}% of copy"  # noqa: E731
        big = B * total * Hkv > 10**6
        inner, trials = (4, 15) if big else (10, 30)
        desc = f"{kind} B={B} {'prefix' if prefill else 'ctx'}={ctx} ql={ql} Hq={Hq} Hkv={Hkv}"
        ref_out = torch.full_like(kw["query"], float("nan"))
        prefill_m(None)
        run(ref_out)
        err_ship = accuracy(kw, ref_out)
        t_s = time_cuda_graph(lambda i: run(ref_out), inner=inner, trials=trials).median_us
        print(f"{desc}: shipped {t_s:.1f} us ({size(t_s)}), rel err {err_ship:.2e}", flush=True)
        if prefill:  # the Gluon kernel's prefill works on chunks of 32 rows (M 128): the shipped one at that M
            prefill_m(128)
            plan = new_plan()
            o128 = torch.full_like(kw["query"], float("nan"))
            run(o128)
            t128 = time_cuda_graph(lambda i: run(o128), inner=inner, trials=trials).median_us
            print(f"  shipped at M 128: {t128:.1f} us ({size(t128)}), rel err {accuracy(kw, o128):.2e}", flush=True)
            variants = ((3, 72, 200), (2, 72, 200), (4, 72, 200))
        else:
            variants = ((4, 72, 0), (3, 72, 0), (6, 72, 0), (2, 72, 0)) if B * ctx > 10**5 else ((4, 72, 0), (2, 72, 0))
        for nbuf, regs, cregs in variants:
            if time.time() > t_end:
                print("time budget spent", flush=True)
                return
            out = torch.full_like(kw["query"], float("nan"))
            if prefill:  # the M-128 plan's problem and launch state (as plan.run builds them)
                p = check_layer(plan.batch, **layer, out=out, anchor="block_tables")
                p.plan = plan
            else:
                p = prepare_attention(**kw, out=out)
            L = launch_state(p)
            faulthandler.dump_traceback_later(90, exit=True)  # a hang (a barrier never completes) ends the probe
            try:
                launch(p, L, nbuf, regs, cregs or 200)
                torch.cuda.synchronize()
                faulthandler.cancel_dump_traceback_later()
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                faulthandler.cancel_dump_traceback_later()
                print(f"  NBUF={nbuf} regs={regs}: {type(e).__name__}: {str(e)[:600]}", flush=True)
                continue
            err = accuracy(kw, out)
            diff = (out.float() - ref_out.float()).abs().max().item()
            out.fill_(float("nan"))
            t_g = time_cuda_graph(lambda i: launch(p, L, nbuf, regs, cregs or 200), inner=inner, trials=trials,
                                  after_capture=lambda: out.fill_(float("nan"))).median_us
            err_replay = accuracy(kw, out)
            print(f"  gluon NBUF={nbuf} producer regs={regs}{f' consumer regs={cregs}' if cregs else ''}"
                  f"{' direct' if L.direct else f' P={L.split.P}'}: {t_g:.1f} us ({size(t_g)}, {t_s / t_g:.2f}x), "
                  f"rel err {err:.2e} (replayed {err_replay:.2e}), max |gluon - shipped| {diff:.2e}", flush=True)
        prefill_m(None)
        del kw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--compile" in sys.argv:
        for nbuf, regs in ((4, 72), (3, 72), (6, 72), (2, 72)):
            print(f"NBUF={nbuf} producer regs={regs}:", compile_sm90(nbuf, regs))
        for nbuf, regs, cregs, direct in ((3, 72, 200, True), (2, 72, 200, True), (4, 72, 200, True),
                                          (3, 72, 200, False)):
            print(f"prefill NBUF={nbuf} producer regs={regs} consumer regs={cregs} direct={direct}:",
                  compile_sm90(nbuf, regs, True, cregs, direct))
    else:
        _gpu_probe(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
