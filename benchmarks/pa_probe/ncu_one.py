"""One paged-decode call for ncu (default B=81 ctx=8192 ql 1). NCU_CASE="B,ctx,ql" picks another case
(e.g. "200,200000,4", the ql 4 decode); 128k-token tables when NCU_TABLE_TOKENS is set (tokens).
Variant from the PA_PROBE_* / FLYDSL_* env; NCU_GLUON=1: the Gluon probe kernel (NCU_NBUF slots)."""
import os, sys
import torch
sys.path.insert(0, os.getcwd())
from pa_backend import pa_decode
from pa_backend.benchmark import bench_case
B, ctx, ql = (int(x) for x in os.environ.get("NCU_CASE", "81,8192,1").split(","))
kw = bench_case(B, ctx, ql, 16, 1, 128, 16, "tensor", "cuda", table_tokens=int(os.environ.get("NCU_TABLE_TOKENS", 0)))
out = torch.empty_like(kw["query"])
if os.environ.get("NCU_GLUON") == "1":  # the warp-specialized probe kernel (gluon_decode.py) instead
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks", "pa_probe"))
    from gluon_decode import launch
    from pa_backend.contract import prepare_attention
    from pa_backend.triton import launch_state
    p = prepare_attention(**kw, out=out)
    L = launch_state(p)
    for _ in range(2):
        launch(p, L, int(os.environ.get("NCU_NBUF", 4)), 72)
else:
    for _ in range(2):
        pa_decode(**kw, out=out, backend="triton")
torch.cuda.synchronize()
