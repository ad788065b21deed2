"""The 1000-step long decode (pa_backend.accuracy.long_decode) with the Triton kernels launched through Triton and
directly (backend_core.launch), per-token and per-tensor scales (GPU machine; nothing here ships).
Run from the repo root: python3 benchmarks/pa_probe/long_decode_probe.py"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from backend_core import launch  # noqa: E402
from pa_backend.accuracy import long_decode  # noqa: E402

print(torch.cuda.get_device_name())
print("torch impl (the harness alone):", long_decode(1000, B=8, Hq=16, Hkv=2, D=128, block_size=64, device="cuda",
                                                     impl="torch", scales="token", v_layout="5d"), flush=True)
for direct in (False, True):
    launch.enabled = direct
    for bs, scales, v in ((64, "token", "5d"), (16, "tensor", "4d"), (64, "tensor", "5d"), (16, "token", "4d")):
        res = long_decode(1000, B=8, Hq=16, Hkv=2, D=128, block_size=bs, device="cuda", impl="triton", scales=scales,
                          v_layout=v)
        print(f"direct={direct} bs={bs} {scales} {v}: {res}", flush=True)
