"""One B=81 ctx=8192 decode call (for ncu). Variant from the PA_PROBE_* / FLYDSL_* env."""
import os, sys
import torch
sys.path.insert(0, os.getcwd())
from pa_backend import pa_decode
from pa_backend.benchmark import bench_case
kw = bench_case(81, 8192, 1, 16, 1, 128, 16, "tensor", "cuda")
out = torch.empty_like(kw["query"])
for _ in range(2):
    pa_decode(**kw, out=out, backend="triton")
torch.cuda.synchronize()
