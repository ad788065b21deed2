"""Where a vLLM decode step's time goes, FLYDSL vs TRITON_ATTN (CUDA graphs FULL_DECODE_ONLY,
max_model_len 1024, batch 64: the point where FLYDSL ran at 0.78x in
results/e2e_vllm_NVIDIA_H200_2026-12-03_77c813ac6139.md). For each backend: generate timed as
engine_bench does, then one generate under cProfile (host functions, engine core in process) and
one under torch.profiler (GPU kernels). Run on the GPU machine with vLLM's Python tree on the path
(benchmarks/device_run.sh's vllm_env): python3 benchmarks/pa_probe/engine_step_profile.py [batch] [tokens]"""
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
from integration_tests.e2e import engine_bench as eb  # noqa: E402
from integration_tests.e2e import tiny_model as tm  # noqa: E402
from integration_tests.e2e import vllm_gpu  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
vllm_gpu.prepare()
import torch  # noqa: E402

s = eb.settings(False)
with tempfile.TemporaryDirectory(prefix="tiny_llama_") as d:
    model_dir = tm.build(d)
    bench = eb.Bench(out=None, s=s, model_dir=model_dir, device="", commit="")
    for backend in os.environ.get("PROFILE_BACKENDS", "FLYDSL,TRITON_ATTN").split(","):
        llm = bench.build(backend, "graphs", int(os.environ.get("PROFILE_MAX_LEN", 1024)))
        prompts = tm.prompts(batch, seed=100 + batch)
        eb._generate(llm, prompts, tokens)
        for _ in range(2):
            eb.sync()
            t0 = time.perf_counter()
            eb._generate(llm, prompts, tokens)
            eb.sync()
            dt = time.perf_counter() - t0
            print(f"== {backend} batch {batch}: {tokens} tokens in {dt:.4f} s ({dt / tokens * 1e3:.3f} ms per step)",
                  flush=True)
        pr = cProfile.Profile()
        pr.enable()
        eb._generate(llm, prompts, tokens)
        eb.sync()
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(r"pa_backend|backend_core|attention|build|schedule|prepare_inputs", 30)
        print(buf.getvalue()[-12000:], flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            eb._generate(llm, prompts, 32)
            eb.sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        del llm
        eb.free()
