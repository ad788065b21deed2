"""Where the host time of one layer's ``plan.run`` goes (GPU machine): cProfile over N calls.
Run from the repo root: python3 benchmarks/pa_probe/host_profile.py [N]"""

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from pa_backend import plan_decode  # noqa: E402
from pa_backend.benchmark import bench_case  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
kw = bench_case(8, 1024, 1, 32, 8, 128, 16, "tensor", torch.device("cuda"), table_tokens=1 << 17)
args = {k: kw[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale")}
out = torch.empty_like(kw["query"])
plan = plan_decode(kw["block_tables"], kw["context_lengths"], backend="triton")
for _ in range(10):
    plan.run(**args, out=out)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(n):
    plan.run(**args, out=out)
print(f"plan.run host: {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(n):
    plan.run(**args, out=out)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
