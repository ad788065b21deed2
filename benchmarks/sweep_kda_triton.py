"""Tuning sweep for the Triton KDA kernel: BV x num_warps per shape (CUDA-graph replay, median).

Run on the GPU machine from the repo root: python3 benchmarks/sweep_kda_triton.py
Prints one line per configuration; the chosen defaults live in kda_backend/triton/__init__.py.
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from backend_core.timing import copy_bandwidth_gbps, time_cuda_graph  # noqa: E402
from kda_backend import triton as ktriton  # noqa: E402
from kda_backend.benchmark import TOUCH_BYTES, step_bytes  # noqa: E402
from kda_backend.cases import make_case  # noqa: E402

H, K, W = 12, 128, 4
copy = copy_bandwidth_gbps()
print(f"copy {copy:.0f} GB/s")
for state_dtype in (torch.float32, torch.bfloat16):
    elt = torch.empty((), dtype=state_dtype).element_size()
    for with_f_b in (False, True):
        for B in (1, 32, 128):
            n_sets = max(2, min(64, math.ceil(TOUCH_BYTES / (B * H * K * K * elt))))
            sets = [make_case(B, H, K, W, slots=B, state_dtype=state_dtype, with_f_b=with_f_b, device="cuda",
                              seed=s, state_scale=0.1) for s in range(n_sets)]
            floor = step_bytes(B, H, K, W, elt, with_f_b, K) / (copy * 1e9) * 1e6
            res = []
            for bv in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    os.environ["FLYDSL_BACKENDS_KDA_TRITON_BV"] = str(bv)
                    os.environ["FLYDSL_BACKENDS_KDA_TRITON_WARPS"] = str(warps)
                    ktriton.launch_config.cache_clear()
                    t = time_cuda_graph(lambda i: sets[i % n_sets].call("triton"), inner=max(n_sets, 16), trials=30)
                    res.append((t.median_us, bv, warps))
            res.sort()
            best = ", ".join(f"BV={bv}/w{w}: {us:.2f}" for us, bv, w in res[:4])
            print(f"{str(state_dtype)[6:]:>8} f_b={int(with_f_b)} B={B:>3} floor {floor:6.2f} us | {best}", flush=True)
            sets = None  # the cases' tensors go before the next shape allocates
            torch.cuda.empty_cache()
